"""The objects of workers added after start are left out of the garbage collector's passes
once they settle, and are still freed when their instance is removed (by reference
counting: removal leaves no cycles). Real publishers over loopback TCP, a real registry."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx

from kvroute.app.config import InstanceConfig
from kvroute.app.fleet.gc_freeze import FleetFreezer
from kvroute.app.fleet.registry import Registry
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import EventSource, Ledger, run
from tests.support.waiting import wait_until

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


class _Cycle:
    """A reference cycle, as an HTTP client's finished request leaves a few dozen of;
    counted without a weak reference (one would be an object the freezes keep, too)."""

    alive = 0

    def __init__(self) -> None:
        self.me = self
        _Cycle.alive += 1

    def __del__(self) -> None:
        _Cycle.alive -= 1


def test_the_garbage_the_freezes_keep_is_collected_once_the_fleet_is_quiet():
    """Cyclic garbage that exists when a change's freezes run, and cycles frozen alive that
    die later, were kept by those freezes: what is kept grew with every change. Now a
    freeze collects the young generations first, and once the fleet is quiet the freezer
    re-freezes (unfreeze, collect, freeze): none of it is left."""
    cycles, per_cycle = 4, 500

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(6)
            ledger.publish(source.batch())
            pub.flush()
            async with httpx.AsyncClient() as client:
                registry = Registry(PrefixIndex(), client, ctx, max_instances=4)
                freezer = FleetFreezer(registry, lambda: True, interval=0.01,
                                       busy_seconds=0.05, max_interval=0.02,
                                       refreeze_interval=0.01, quiet_seconds=0.05)
                made = 0
                frozen_after: list[int] = []
                gc.collect()
                gc.disable()  # the garbage below waits for the freezes, as a busy heap's does
                try:
                    freezer.start()
                    for n in range(cycles):
                        refrozen = freezer.refreezes
                        garbage = [_Cycle() for _ in range(per_cycle)]
                        del garbage  # unreachable now, collected by no pass yet
                        aged = [_Cycle() for _ in range(per_cycle)]
                        gc.collect(1)  # survives into the oldest generation
                        del aged  # and is garbage there
                        in_flight = [_Cycle() for _ in range(per_cycle)]  # alive when frozen
                        made += 3 * per_cycle
                        await registry.add(InstanceConfig(
                            id=f"churn{n}", block_size=16, events=(pub.endpoint,) * RANKS,
                            replay=(pub.replay_endpoint,) * RANKS))
                        await wait_until(lambda: all(w.state == "live"
                                                     for w in registry.workers()),
                                         "every rank live")
                        await wait_until(freezer.quiet, "the freezer to settle")
                        del in_flight  # and dies frozen, still in its cycle
                        await registry.remove(f"churn{n}")
                        await wait_until(lambda r=refrozen: freezer.refreezes > r,
                                         "a re-freeze once the fleet is quiet")
                        frozen_after.append(gc.get_freeze_count())
                    assert _Cycle.alive == 0, \
                        f"{_Cycle.alive} of {made} garbage cycles are still kept frozen"
                    # What stays frozen does not grow by what each cycle left behind.
                    assert frozen_after[-1] - frozen_after[0] < per_cycle, frozen_after
                    # The aged garbage and the cycles frozen alive that died later were
                    # freed by a re-freeze (the young garbage, before it was frozen).
                    assert freezer.last_refreeze_freed >= 2 * per_cycle
                finally:
                    gc.enable()
                    await freezer.stop()
                    await registry.close()
                    gc.unfreeze()

    run(scenario)


def test_a_re_freeze_waits_for_a_quiet_fleet_and_comes_only_after_freezes():
    """Unfreeze, collect, freeze, in that order; not while a joined worker is still
    settling; and not again while nothing has been frozen since the last one."""
    async def scenario(ctx):
        async with httpx.AsyncClient() as client:
            registry = Registry(PrefixIndex(), client, ctx, max_instances=4)
            calls: list[str] = []
            pauses: list[tuple[float, int]] = []

            def collect(generation: int) -> int:
                calls.append(f"collect {generation}")
                return 7

            freezer = FleetFreezer(registry, lambda: True, interval=0.01,
                                   busy_seconds=0.05, max_interval=0.02,
                                   settle_deadline=600, refreeze_interval=0.01,
                                   quiet_seconds=0.05,
                                   on_refreeze=lambda p, f: pauses.append((p, f)),
                                   freeze=lambda: calls.append("freeze"),
                                   unfreeze=lambda: calls.append("unfreeze"), collect=collect)
            try:
                freezer.start()
                # The start-up freezes are owed a re-freeze.
                await wait_until(lambda: freezer.refreezes == 1, "the first re-freeze")
                assert calls == ["collect 0", "freeze"] * 2 + ["unfreeze", "collect 2", "freeze"]
                assert len(pauses) == 1 and pauses[0][1] == 7 and pauses[0][0] >= 0
                await asyncio.sleep(0.2)
                assert freezer.refreezes == 1, "re-froze with nothing frozen since"
                # A worker whose replay never ends stays replaying: not quiet.
                with EventPublisher() as pub:
                    ledger = Ledger(pub)
                    ledger.publish(EventSource(8).batch())
                    pub.flush()
                    pub.stall_replays()
                    await registry.add(InstanceConfig(
                        id="stuck", block_size=16, events=(pub.endpoint,),
                        replay=(pub.replay_endpoint,)))
                    await wait_until(lambda: calls.count("freeze") >= 5,
                                     "the settling freezes")
                    await asyncio.sleep(0.3)
                    assert [w.state for w in registry.workers()] == ["replaying"]
                    assert freezer.refreezes == 1, "re-froze while a change was pending"
                    await registry.remove("stuck")
                await wait_until(lambda: freezer.refreezes == 2,
                                 "a re-freeze once the fleet is quiet")
                assert calls[-3:] == ["unfreeze", "collect 2", "freeze"]
            finally:
                await freezer.stop()
                await registry.close()

    run(scenario)
