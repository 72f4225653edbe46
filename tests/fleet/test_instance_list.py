"""`GET /v1/instances` and `GET /v1/dashboard` of a large fleet: built a slice of instances
at a time with the event loop free between slices, and never showing an instance removed
before its slice came."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.http.dashboard import snapshot
from kvroute.app.service import INSTANCES_PER_SLICE, Service
from tests.support.waiting import run_async

# Nothing listens there: the workers stay down, which is all a listing needs.
NOWHERE = ("tcp://127.0.0.1:9",)


@pytest.mark.parametrize("answer", [Service.instance_list, snapshot], ids=["listing", "dashboard"])
def test_an_answer_about_every_instance_lets_the_loop_run_between_slices(answer):
    count = 3 * INSTANCES_PER_SLICE + 5
    settings = Settings(log_level="warning", load_interval=0.0, instances=tuple(
        InstanceConfig(id=f"i{n:03d}", events=NOWHERE, replay=NOWHERE)
        for n in range(count)))

    async def scenario() -> None:
        service = Service(settings)
        await service.start()
        try:
            turns = 0
            removals: list[asyncio.Task] = []

            async def meanwhile() -> None:
                nonlocal turns
                while True:
                    turns += 1
                    if turns == 2:  # after the first slice: one listed, one not yet
                        removals.extend(asyncio.create_task(service.registry.remove(i))
                                        for i in ("i000", f"i{count - 1:03d}"))
                    await asyncio.sleep(0)

            other = asyncio.create_task(meanwhile())
            await asyncio.sleep(0)
            try:
                listing = await answer(service)
            finally:
                other.cancel()
            await asyncio.gather(*removals)
            assert turns >= 4  # the loop ran between each of the four slices
            listed = [summary.id for summary in listing.instances]
            # i000's slice was done before it went; the last one's came after.
            assert listed == [f"i{n:03d}" for n in range(count - 1)]
            assert {summary.state for summary in listing.instances} <= {"down", "connecting"}
        finally:
            await service.close()

    run_async(scenario)
