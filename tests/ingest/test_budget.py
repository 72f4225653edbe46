"""The fleet-wide budget of ingest work per turn of the event loop, and the loop-lag metric."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, generate_latest

from kvroute.app.ingest.budget import LoopBudget, shared_budget
from kvroute.app.loop_lag import LoopLagMonitor


def test_a_used_up_budget_holds_work_until_the_next_turn() -> None:
    async def scenario() -> list[str]:
        budget = LoopBudget(seconds=0.0)
        order: list[str] = []

        async def worker(name: str) -> None:
            if budget.exhausted():
                await budget.next_turn()
            order.append(name)

        def other() -> None:  # a callback that became ready while the workers ran
            order.append("request")

        budget.exhausted()  # work earlier in this turn started its clock
        tasks = [asyncio.create_task(worker(name)) for name in ("a", "b")]
        asyncio.get_running_loop().call_soon(other)  # ready after the workers' first steps
        await asyncio.gather(*tasks)
        assert budget.turns == 2  # a turn for each of them
        return order

    order = asyncio.run(scenario())
    assert order.index("request") < order.index("a")
    assert order.index("request") < order.index("b")


def test_one_budget_per_loop() -> None:
    async def get() -> tuple[LoopBudget, LoopBudget]:
        return shared_budget(), shared_budget()

    first, again = asyncio.run(get())
    assert first is again
    other, _ = asyncio.run(get())
    assert other is not first


def test_a_blocked_loop_shows_as_lag() -> None:
    registry = CollectorRegistry()

    async def scenario() -> LoopLagMonitor:
        monitor = LoopLagMonitor(registry, interval=0.005)
        monitor.start()
        await asyncio.sleep(0.02)
        time.sleep(0.1)  # a stretch that never yields
        await asyncio.sleep(0.02)
        await monitor.stop()
        return monitor

    monitor = asyncio.run(scenario())
    assert monitor.worst >= 0.05  # a lower bound: a loaded machine only adds lag
    text = generate_latest(registry).decode()
    assert "kvroute_event_loop_lag_seconds_bucket" in text
    assert "kvroute_event_loop_lag_worst_seconds" in text


def test_requests_being_answered_shrink_the_share_of_a_turn() -> None:
    budget = LoopBudget(seconds=60.0, serving_seconds=0.0)
    assert not budget.exhausted()  # starts this turn's clock
    assert not budget.exhausted()  # a minute's share: far from used up
    budget.serving += 1
    assert budget.exhausted()  # the share while serving is used up at once
    budget.serving -= 1
    assert not budget.exhausted()
    assert LoopBudget(seconds=0.002, serving_seconds=0.5).serving_seconds == 0.002  # never more


class _TurnCounter:
    """Counts turns of the running loop (a callback that schedules itself) until ``stop``."""

    def __init__(self) -> None:
        self.turn = 0
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False


def test_parked_workers_go_one_per_turn_in_the_order_they_parked() -> None:
    """Each worker has a backlog and the budget holds one piece of work per turn: the
    parked ones are woken one per turn, round robin, not all of them in every turn (each
    would then take a piece before any request of that turn is read)."""

    async def scenario() -> list[tuple[int, str]]:
        budget = LoopBudget(seconds=0.0)  # the second piece of a turn finds it used up
        turns = _TurnCounter()
        pieces: list[tuple[int, str]] = []

        async def worker(name: str) -> None:
            for _ in range(3):
                if budget.exhausted():
                    await budget.next_turn()
                pieces.append((turns.turn, name))

        budget.exhausted()  # work earlier in this turn started its clock
        await asyncio.gather(*(worker(name) for name in "abcdef"))
        turns.stop()
        assert budget.turns >= 18
        return pieces

    pieces = asyncio.run(scenario())
    assert [name for _, name in pieces] == list("abcdef") * 3
    assert max(Counter(turn for turn, _ in pieces).values()) == 1


def test_a_cancelled_parked_worker_gives_its_place_up() -> None:
    async def scenario() -> list[str]:
        budget = LoopBudget(seconds=0.0)
        done: list[str] = []

        async def worker(name: str) -> None:
            if budget.exhausted():
                await budget.next_turn()
            done.append(name)

        budget.exhausted()
        tasks = {name: asyncio.create_task(worker(name)) for name in "abc"}
        await asyncio.sleep(0)  # all three parked
        tasks["b"].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return done

    assert asyncio.run(scenario()) == ["a", "c"]


@contextmanager
def _watching(look_seconds: float) -> Iterator[tuple[LoopBudget, socket.socket, socket.socket]]:
    """A budget of an hour a turn watching one end of a socket pair; both ends closed."""
    budget = LoopBudget(seconds=3600.0, serving_seconds=3600.0, look_seconds=look_seconds)
    ours, peer = socket.socketpair()
    with ours, peer:
        budget.watch(ours.fileno(), ours)
        yield budget, ours, peer


def test_bytes_waiting_on_a_watched_connection_use_the_turn_up() -> None:
    with _watching(look_seconds=0.0) as (budget, ours, peer):
        assert not budget.exhausted()  # starts this turn's clock: an hour's share
        assert not budget.exhausted() and not budget.requests_waiting()
        peer.sendall(b"GET / HTTP/1.1\r\n")
        assert budget.requests_waiting() and budget.exhausted()
        ours.recv(64)  # the loop read the request
        assert not budget.exhausted()
        peer.sendall(b"more")
        budget.unwatch(ours.fileno(), object())  # not its owner: still watched
        assert budget.exhausted()
        budget.unwatch(ours.fileno(), ours)
        assert budget.watching == 0
        assert not budget.exhausted()  # bytes wait, but on a connection not watched


def test_a_turn_looks_for_waiting_bytes_at_most_every_look_seconds() -> None:
    with _watching(look_seconds=3600.0) as (budget, _ours, peer):
        assert not budget.exhausted()  # starts this turn's clock
        assert not budget.exhausted()  # looks: nothing waits
        peer.sendall(b"GET / HTTP/1.1\r\n")
        assert budget.requests_waiting()
        assert not budget.exhausted()  # it looked less than an hour ago: not again yet
