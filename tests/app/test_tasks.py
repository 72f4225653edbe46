"""`cancel_and_wait` ends a task and waits for it, and keeps its own caller's cancellation:
a caller cancelled while it waits is cancelled once the task has ended, whatever the task
did with its own cancellation; a caller already stopping (in a `finally`) goes on with its
clean-up."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.app.tasks import cancel_and_wait, cancel_requested
from tests.support.waiting import run_async


async def _slow_to_stop(ended: list[str], name: str, *, swallow: bool = False) -> str:
    """Waits for good; once cancelled, takes a few turns of the loop to clean up, then
    either ends cancelled or (`swallow`) returns as if it had not been asked to stop."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        for _ in range(5):
            await asyncio.sleep(0)
        ended.append(name)
        if not swallow:
            raise
    return "went on"


@pytest.mark.parametrize("swallow", [False, True], ids=["task-ends-cancelled",
                                                         "task-swallows-it"])
def test_a_caller_cancelled_while_it_waits_stays_cancelled(swallow: bool) -> None:
    async def scenario() -> None:
        ended: list[str] = []
        went_on: list[bool] = []
        task = asyncio.create_task(_slow_to_stop(ended, "task", swallow=swallow))
        await asyncio.sleep(0)

        async def caller() -> None:
            await cancel_and_wait(task)
            went_on.append(True)

        waiting = asyncio.create_task(caller())
        await asyncio.sleep(0)  # the caller now waits for the task's clean-up
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert ended == ["task"], "the caller's cancellation came before the task had ended"
        assert not went_on, "the caller went on as if it had not been cancelled"

    run_async(scenario)


def test_a_caller_stopping_already_finishes_its_clean_up() -> None:
    async def scenario() -> None:
        ended: list[str] = []
        first = asyncio.create_task(_slow_to_stop(ended, "first"))
        second = asyncio.create_task(_slow_to_stop(ended, "second", swallow=True))
        cleaned: list[bool] = []

        async def owner() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                assert cancel_requested()
                await cancel_and_wait(first)
                await cancel_and_wait(second)
                cleaned.append(True)

        owning = asyncio.create_task(owner())
        await asyncio.sleep(0)
        owning.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owning
        assert ended == ["first", "second"]
        assert cleaned == [True]

    run_async(scenario)


def test_nothing_to_stop_and_a_task_already_ended() -> None:
    async def scenario() -> None:
        await cancel_and_wait(None)
        done = asyncio.create_task(asyncio.sleep(0, result="done"))
        await done
        await cancel_and_wait(done)
        failed = asyncio.create_task(_raise())
        await asyncio.wait({failed})
        with pytest.raises(RuntimeError, match="its own failure"):
            await cancel_and_wait(failed)

    run_async(scenario)


async def _raise() -> None:
    raise RuntimeError("its own failure")
