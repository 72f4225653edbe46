"""The periodic state saver stops when asked, even when its store swallows the cancellation
(redis-py's asyncio client does, now and then: app.tasks)."""

from __future__ import annotations

import asyncio

import httpx
import zmq.asyncio

from kvroute.app.fleet.registry import Registry
from kvroute.app.state.keeper import StateKeeper
from kvroute.index.prefix_index import PrefixIndex
from tests.support.waiting import run_async, wait_until


class SwallowingStore:
    """A store whose write, cancelled mid-flight the first time, finishes as if it had not
    been."""

    where = "a store that swallows cancellations"

    def __init__(self) -> None:
        self.writes = 0
        self.swallowed = 0
        self.writing = asyncio.Event()

    async def read(self) -> bytes | None:
        return None

    async def write(self, chunks: list[bytes]) -> None:
        self.writes += 1
        self.writing.set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            if self.swallowed:  # only the first: a second cancellation ends the saver
                raise
            self.swallowed += 1

    async def close(self) -> None:
        pass


def test_the_saver_stops_when_its_store_swallows_the_cancellation():
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        store = SwallowingStore()
        try:
            async with httpx.AsyncClient() as client:
                registry = Registry(PrefixIndex(), client, ctx, max_instances=4)
                keeper = StateKeeper(store, registry, registry.index, interval=0.01)
                keeper.start()
                await store.writing.wait()  # cancelled now, the write swallows it
                closing = asyncio.create_task(keeper.close(timeout=5.0))
                try:
                    await wait_until(lambda: closing.done(), "the saver to stop", timeout=10.0)
                finally:
                    if not closing.done():  # unstick it, so the failure is reported
                        task = keeper._task
                        if task is not None:
                            task.cancel()
                        await closing
                assert store.swallowed == 1
                # The final save of close() ran after the periodic one was given up.
                assert store.writes >= 2
        finally:
            ctx.term()

    run_async(scenario)
