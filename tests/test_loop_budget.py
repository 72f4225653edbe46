"""The fleet-wide budget of ingest work per turn of the event loop, and the loop-lag metric."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, generate_latest

from kvroute.app.loop_budget import LoopBudget, shared_budget
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
        assert not budget.exhausted()  # restarted in the new turn: the clock starts again
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
