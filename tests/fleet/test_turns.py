"""The fleet's turns for socket work and fleet changes: a time budget per pass of the loop,
a rest after a pass that used turns, the subscribers' socket openings and closings inside
turns, and API registrations and removals waiting for one. Counted per pass of the loop
(never timed); the subscriber runs against a real publisher over loopback TCP."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.errors import RequestError
from kvroute.app.fleet.registry import Registry
from kvroute.app.http.auth import admin_guard
from kvroute.app.http.paced_changes import PacedFleetChanges, changes_fleet
from kvroute.app.ingest.pacing import FleetPacing
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.service import ROUTING_LATELY, Service
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import (
    TEST_OPTIONS,
    EventSource,
    Ledger,
    OpLog,
    Running,
    caught_up,
    endpoint_of,
    run,
)
from tests.support.waiting import run_async, wait_until


async def _anyone(request) -> None:
    """The guard of a kvroute without tokens: everyone may."""


class _PassCounter:
    """Counts passes of the running loop (a callback that schedules itself)."""

    def __init__(self) -> None:
        self.passes = 0
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.passes += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False


def test_a_pass_takes_no_turn_once_its_budget_is_spent_and_keeps_the_order():
    async def scenario(ctx):
        now = [0.0]  # a clock that moves only by the work done in turns
        pacing = FleetPacing(turns_per_pass=16, pass_budget=0.001, rest=0.0,
                             clock=lambda: now[0])
        counter = _PassCounter()
        taken: list[tuple[int, int]] = []

        async def worker(number: int) -> None:
            await pacing.turn()
            taken.append((number, counter.passes))
            now[0] += 0.0004  # each piece of work costs 0.4 ms of the clock

        await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(40))), 10)
        counter.stop()
        assert [number for number, _ in taken] == list(range(40))  # in order of asking
        per_pass: dict[int, int] = {}
        for _, seen in taken:
            per_pass[seen] = per_pass.get(seen, 0) + 1
        # Turns start at 0, 0.4 and 0.8 ms of a pass; the one at 1.2 ms waits: at most the
        # budget plus one piece of work in a pass, where the count alone would allow 16.
        assert max(per_pass.values()) == 3
        assert len(per_pass) >= 40 // 3
        # Woken about as many as the budget lets through: waking 16 a pass, 13 of them
        # would be sent back each time (some 150 task steps for nothing).
        assert pacing.sent_back <= 40
    run(scenario)


@pytest.mark.parametrize("routing", [False, True], ids=["no-routes", "routing"])
def test_after_a_pass_with_turns_the_next_turns_wait_for_a_rest(routing):
    """`rest`, or `routing_rest` while routes are being asked (each is 0 in the other case
    here, so the rest seen is the one that applies)."""
    async def scenario(ctx):
        now = [0.0]
        pacing = FleetPacing(turns_per_pass=4, pass_budget=1.0,
                             rest=0.0 if routing else 1.0,
                             routing_rest=1.0 if routing else 0.0,
                             routing=lambda: routing, clock=lambda: now[0])
        counter = _PassCounter()
        seen: list[int] = []

        async def worker() -> None:
            await pacing.turn()
            seen.append(counter.passes)
            now[0] += 0.002  # 2 ms of clock per piece: each rest is a few ms of real time

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(24))), 10)
        counter.stop()
        passes = sorted(set(seen))
        assert len(passes) >= 24 // 4
        # Between two passes that took turns, at least one pass of the loop took none.
        assert all(later - earlier >= 2 for earlier, later in zip(passes, passes[1:], strict=False))
    run(scenario)


class _CountingPacing(FleetPacing):
    def __init__(self) -> None:
        super().__init__()
        self.turns = 0

    async def turn(self) -> None:
        await super().turn()
        self.turns += 1


def test_a_subscriber_opens_and_closes_its_sockets_in_turns_and_reuses_its_channel():
    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(9)
            ledger.publish(source.batch())
            pacing = _CountingPacing()
            sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx, options=TEST_OPTIONS,
                             pacing=pacing)
            async with Running(sub):
                await wait_until(lambda: caught_up(sub, ledger, ("live",)), "the rebuild")
                # One turn to open the live connection, one to start the rebuild once it
                # is up, one to open the replay channel.
                assert pacing.turns == 3
                assert sub._replayer.channel is not None and sub._replayer.channel.is_open
            assert pacing.turns == 4  # and one to close them
            assert not sub._replayer.channel.is_open
    run(scenario)


def test_a_removal_asks_its_subscribers_to_stop_one_turn_each():
    """Asked all at once, the subscribers of a hundred instances removed together woke in
    one pass of the loop and their first steps filled it; asked in turns, a pass wakes at
    most `turns_per_pass` of them. Eight ranks on one real publisher, a real registry."""
    async def scenario(ctx):
        with EventPublisher() as pub:
            async with httpx.AsyncClient() as client:
                pacing = FleetPacing(turns_per_pass=2, pass_budget=1.0, rest=0.0)
                registry = Registry(PrefixIndex(), client, ctx, max_instances=4,
                                    pacing=pacing)
                try:
                    await registry.add(InstanceConfig(
                        id="gone", block_size=16, events=(pub.endpoint,) * 8,
                        replay=(pub.replay_endpoint,) * 8))
                    await wait_until(
                        lambda: all(w.state == "live" for w in registry.workers()),
                        "every rank live")
                    counter = _PassCounter()
                    asked: list[int] = []  # the pass of each subscriber's first ask

                    def recording(sub: Subscriber):
                        ask = sub.ask_to_stop

                        def ask_to_stop() -> None:
                            if not sub._stopping.is_set():
                                asked.append(counter.passes)
                            ask()
                        return ask_to_stop

                    for worker in registry.workers():
                        worker.subscriber.ask_to_stop = recording(worker.subscriber)
                    removed = await asyncio.wait_for(registry.remove("gone"), 30)
                    counter.stop()
                    assert removed.workers == [] and list(registry.workers()) == []
                    assert len(asked) == 8
                    per_pass: dict[int, int] = {}
                    for seen in asked:
                        per_pass[seen] = per_pass.get(seen, 0) + 1
                    assert max(per_pass.values()) <= 2, per_pass
                    assert len(per_pass) >= 4, per_pass
                finally:
                    await registry.close()
    run(scenario)


def test_instances_removed_at_once_close_their_replay_channels_each_in_its_own_turn():
    """Removed together, each instance left the registry at once, so the first removal to
    finish saw no workers left and closed every other stopping worker's kept replay
    channel for want of room, all in one step (30-40 ms for a hundred instances). Each
    subscriber closes its own channel in its own turn; none is closed for room. One turn
    a pass, and a one-rank instance first: it is removed while the others still stop."""
    async def scenario(ctx):
        with EventPublisher() as pub:
            async with httpx.AsyncClient() as client:
                pacing = FleetPacing(turns_per_pass=1)
                registry = Registry(PrefixIndex(), client, ctx, max_instances=4,
                                    pacing=pacing)
                ranks = {"one": 1, "two": 3, "three": 3}
                try:
                    for name, count in ranks.items():
                        await registry.add(InstanceConfig(
                            id=name, block_size=16, events=(pub.endpoint,) * count,
                            replay=(pub.replay_endpoint,) * count))
                    await wait_until(
                        lambda: all(w.state == "live" for w in registry.workers())
                        and len(pacing.replay_channels) == 7, "every rank live, channel kept")
                    await asyncio.wait_for(
                        asyncio.gather(*(registry.remove(name) for name in ranks)), 30)
                    assert list(registry.workers()) == []
                    assert len(pacing.replay_channels) == 0
                    assert pacing.replay_channels.closed_for_room == 0
                finally:
                    await registry.close()
    run(scenario)


def test_only_registrations_and_removals_wait_for_a_turn():
    assert changes_fleet("POST", "/v1/instances")
    assert changes_fleet("DELETE", "/v1/instances/a")
    assert not changes_fleet("GET", "/v1/instances")
    assert not changes_fleet("GET", "/v1/instances/a")
    assert not changes_fleet("POST", "/v1/route")

    async def scenario(ctx):
        pacing = FleetPacing(turns_per_pass=2, rest=0.0)
        counter = _PassCounter()
        ran: list[tuple[str, int]] = []

        async def inner(scope, receive, send) -> None:
            ran.append((scope["method"], counter.passes))

        class _State:
            service = type("S", (), {"registry": type("R", (), {"pacing": pacing})()})()

        app = type("App", (), {"state": _State()})()
        middleware = PacedFleetChanges(inner, guard=_anyone)

        def scope(method: str, path: str) -> dict:
            return {"type": "http", "method": method, "path": path, "app": app}

        async def nothing():
            return {}

        async def send(message) -> None:
            pass

        calls = [middleware(scope("POST", "/v1/instances"), nothing, send) for _ in range(8)]
        calls += [middleware(scope("DELETE", f"/v1/instances/i{n}"), nothing, send)
                  for n in range(4)]
        calls += [middleware(scope("GET", "/v1/instances"), nothing, send) for _ in range(4)]
        await asyncio.wait_for(asyncio.gather(*calls), 10)
        counter.stop()
        changes: dict[int, int] = {}
        for method, seen in ran:
            if method != "GET":
                changes[seen] = changes.get(seen, 0) + 1
        assert len([m for m, _ in ran if m != "GET"]) == 12
        assert max(changes.values()) <= 2  # two turns a pass
        first_change = min(changes)
        assert all(seen <= first_change for m, seen in ran if m == "GET")  # never held
    run(scenario)


def test_a_change_without_the_admin_token_takes_no_turn():
    """A registration the app will refuse (no admin token) goes straight to its 401: it
    cannot take turns from the operators' changes, however many are sent."""
    async def scenario(ctx):
        class _Pacing:
            turns = 0

            async def turn(self) -> None:
                self.turns += 1

        pacing = _Pacing()

        class _State:
            service = type("S", (), {"registry": type("R", (), {"pacing": pacing})()})()

        app = type("App", (), {"state": _State()})()
        reached: list[str] = []

        async def inner(scope, receive, send) -> None:
            reached.append(scope["method"])

        guard = admin_guard(Settings(api_token="reader", admin_token="admin"))
        middleware = PacedFleetChanges(inner, guard=guard)

        def scope(method: str, token: str | None) -> dict:
            headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
            path = "/v1/instances" if method == "POST" else "/v1/instances/i0"
            return {"type": "http", "method": method, "path": path, "app": app,
                    "headers": headers}

        async def nothing():
            return {}

        async def send(message) -> None:
            pass

        for method in ("POST", "DELETE"):
            for token in (None, "reader", "wrong"):
                await middleware(scope(method, token), nothing, send)
        assert pacing.turns == 0 and len(reached) == 6  # every one reached the app's refusal
        await middleware(scope("POST", "admin"), nothing, send)
        await middleware(scope("DELETE", "admin"), nothing, send)
        assert pacing.turns == 2 and len(reached) == 8
    run(scenario)


def test_a_route_asked_puts_the_fleets_turns_at_the_routing_pace():
    """The service tells its fleet's pacing that routes are being asked from the moment one
    is (answered or refused: the workers here are all down) until `ROUTING_LATELY` later."""
    settings = Settings(log_level="warning", load_interval=0.0, instances=(
        InstanceConfig(id="i", events=("tcp://127.0.0.1:9",), replay=("tcp://127.0.0.1:9",)),))

    async def scenario() -> None:
        service = Service(settings)
        await service.start()
        try:
            routing = service.registry.pacing._routing
            assert not routing()
            with contextlib.suppress(RequestError):
                await service.route(b'{"token_ids": [1, 2, 3]}')
            assert routing()
            service._last_route -= ROUTING_LATELY
            assert not routing()
        finally:
            await service.close()

    run_async(scenario)
