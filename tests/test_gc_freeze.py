"""The objects of workers added after start are left out of the garbage collector's passes
once they settle, and are still freed when their instance is removed (by reference
counting: removal leaves no cycles). Real publishers over loopback TCP, a real registry."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx

from kvroute.app.config import InstanceConfig
from kvroute.app.gc_freeze import FleetFreezer
from kvroute.app.registry import Registry
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.conftest import wait_until
from tests.support.events import EventSource, Ledger, run

RANKS = 3


def _tracked_ids() -> set[int]:
    """Objects the collector's passes scan (frozen ones are in none of its generations)."""
    return {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}


def test_workers_added_after_start_are_frozen_once_settled_and_freed_when_removed():
    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(5)
            for _ in range(3):
                ledger.publish(source.batch())
            pub.flush()
            async with httpx.AsyncClient() as client:
                registry = Registry(PrefixIndex(), client, ctx, max_instances=4)
                freezer = FleetFreezer(registry, lambda: True, interval=0.01,
                                       busy_seconds=0.1, max_interval=0.05)
                try:
                    freezer.start()
                    await wait_until(lambda: freezer.freezes >= 2, "the start-up freezes")
                    before = freezer.freezes
                    await registry.add(InstanceConfig(
                        id="added", block_size=16, events=(pub.endpoint,) * RANKS,
                        replay=(pub.replay_endpoint,) * RANKS))
                    await wait_until(
                        lambda: all(w.state == "live" and w.subscriber.status.last_seq
                                    == ledger.last for w in registry.workers()),
                        "every rank live", detail=lambda: [w.state for w in
                                                           registry.workers()])
                    # Settled: the freezer has frozen once more after the last went live.
                    await wait_until(lambda: not freezer._joined, "the freezer to settle")
                    assert freezer.freezes > before
                    subscribers = [w.subscriber for w in registry.workers()]
                    tracked = _tracked_ids()
                    assert not [s for s in subscribers if id(s) in tracked], \
                        "an added worker's subscriber is still scanned by every full pass"
                    kept = [weakref.ref(s) for s in subscribers]
                    del subscribers, tracked
                    frozen_passes = freezer.freezes
                    await registry.remove("added")
                    await asyncio.sleep(0)
                    assert [ref for ref in kept if ref() is not None] == [], \
                        "a frozen worker outlived its removal"
                    # Removal does not start freezing: nothing joined.
                    await asyncio.sleep(0.1)
                    assert freezer.freezes == frozen_passes
                finally:
                    await freezer.stop()
                    await registry.close()
                    gc.unfreeze()  # the rest of the test session is collected as before

    run(scenario)


def test_a_registration_with_no_workers_starts_no_freezing():
    async def scenario(ctx):
        async with httpx.AsyncClient() as client:
            registry = Registry(PrefixIndex(), client, ctx, max_instances=4)
            frozen: list[int] = []
            freezer = FleetFreezer(registry, lambda: True, interval=0.01,
                                   freeze=lambda: frozen.append(1))
            try:
                freezer.start()
                await wait_until(lambda: len(frozen) >= 2, "the start-up freezes")
                await registry.add(InstanceConfig(id="later", url="http://127.0.0.1:9"),
                                   wait_for_discovery=False)
                await asyncio.sleep(0.1)
                assert len(frozen) == 2
            finally:
                await freezer.stop()
                await registry.close()

    run(scenario)
