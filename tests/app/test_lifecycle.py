"""Start-up and shutdown: everything the service starts, it stops; no task outlives it."""

from __future__ import annotations

import asyncio

from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.service import Service
from kvroute.sim.cluster import SimCluster
from tests.support.waiting import run_async, wait_until


def test_close_stops_every_task_and_socket_it_started(dead_url: str):
    with SimCluster(n=2, block_size=16, num_blocks=64) as sim:
        dead = dead_url  # discovery of this one keeps retrying

        async def scenario() -> None:
            before = asyncio.all_tasks()
            settings = Settings(instances=(InstanceConfig(url=sim.urls[0]),
                                           InstanceConfig(url=dead)),
                                load_interval=0.05)
            service = Service(settings)
            await service.start()
            await service.registry.add(InstanceConfig(url=sim.urls[1]))
            # Both found (the second instance's discovery may trail its registration) and live.
            await wait_until(lambda: [w.state for w in service.registry.workers()]
                             == ["live", "live"], "workers to go live")
            workers = list(service.registry.workers())
            assert len(workers) == 2 and len(service.registry) == 3
            assert len(asyncio.all_tasks() - before) >= 4  # 2 subscribers, discovery, load

            await service.close()
            leaked = [t for t in asyncio.all_tasks() - before if not t.done()]
            assert leaked == [], leaked
            assert len(service.registry) == 0
            assert all(w.subscriber._live._sub is None for w in workers)  # sockets closed
            assert service.client.is_closed
            assert service.index.stats().workers == 0  # nothing of them stays indexed

        run_async(scenario)


def test_an_endpoint_zeromq_refuses_leaves_the_worker_down_and_removable():
    """Registration refuses what ZeroMQ cannot connect to (app.patterns); should one get
    through anyway, its worker is down saying why, and removing it answers normally (the
    fuzz test found DELETE answering 500 because the subscriber task had died raising)."""

    async def scenario() -> None:
        service = Service(Settings(load_interval=0))
        await service.start()
        config = InstanceConfig(id="odd", events=("tcp://127.0.0.1:1",))
        config.events = ("tcp://.odd:1",)  # past the check, as a bug upstream could be
        instance = await service.registry.add(config)
        (worker,) = instance.workers
        await wait_until(lambda: worker.state == "down", "the worker to be down")
        assert "ZeroMQ refuses tcp://.odd:1" in (worker.subscriber.status.last_error or "")
        removed = await service.registry.remove("odd")
        assert removed is instance and "odd" not in service.registry
        await service.close()

    run_async(scenario)
