"""A removed instance leaves nothing for the garbage collector: its workers, subscribers,
sockets and tasks are freed by reference counting as they stop. A hundred instances
removed at once otherwise leave their objects in reference cycles, and the collector's
passes over them hold the event loop (every route waits) for tens of milliseconds.

Real publishers over loopback TCP, a real registry; the collector is off while the
instance is removed, so what is freed is freed without it."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx

from kvroute.app.config import InstanceConfig
from kvroute.app.fleet.registry import Registry
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import EventSource, Ledger, run
from tests.support.waiting import wait_until

RANKS = 3


def test_a_removed_instance_is_freed_without_the_garbage_collector():
    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(7)
            for _ in range(3):
                ledger.publish(source.batch())
            pub.flush()
            async with httpx.AsyncClient() as client:
                registry = Registry(PrefixIndex(), client, ctx, max_instances=4)
                try:
                    await registry.add(InstanceConfig(
                        id="gone", block_size=16, events=(pub.endpoint,) * RANKS,
                        replay=(pub.replay_endpoint,) * RANKS))
                    await wait_until(
                        lambda: all(w.state == "live" for w in registry.workers()),
                        "every rank live", detail=lambda: [w.state for w in
                                                           registry.workers()])
                    workers = list(registry.workers())
                    assert len(workers) == RANKS
                    assert all(w.subscriber.status.last_seq == ledger.last for w in workers)
                    kept = [weakref.ref(part) for w in workers
                            for part in (w.subscriber, w.task, w.subscriber._live,
                                         w.subscriber._replayer.channel)]
                    del workers
                    gc.collect()
                    gc.disable()
                    try:
                        removed = await registry.remove("gone")
                        assert removed.id == "gone" and removed.workers == []
                        del removed
                        await asyncio.sleep(0)  # the tasks' last callbacks
                        alive = [ref() for ref in kept if ref() is not None]
                        assert alive == [], f"kept alive after removal: {alive}"
                        assert gc.collect() == 0, "removal left cyclic garbage"
                    finally:
                        gc.enable()
                    assert "gone" not in registry and list(registry.workers()) == []
                finally:
                    await registry.close()
    run(scenario)
