"""Keeping the fleet's long-lived objects out of the cyclic garbage collector's passes.

A worker keeps a few hundred objects alive for as long as it is followed (its subscriber,
sockets, tasks, replay state). Every object the collector tracks and has not frozen is
scanned by each of its full passes, and a full pass comes once enough objects have
survived into its oldest generation: while a hundred instances (800 workers) registered at
once connect and replay, each full pass scanned all their objects with the event loop held,
and every route waited. Frozen (`gc.freeze`), objects are never scanned again; they are
still freed by reference counting when the last reference goes (a removed instance leaves
no reference cycles: tests/fleet/test_teardown.py), which is what makes freezing the
workers of instances that may later be removed safe.

Invariants:
- Once started, what exists is frozen at once; again when the configured fleet is ready
  (or `ready` never says so and the freezer is stopped).
- After an instance joins with workers (`Registry.instance_listeners`), everything is
  frozen every `interval` seconds for the first `busy_seconds`, then at doubling intervals
  up to `max_interval`, until none of the workers that joined since the last quiet moment
  is `connecting` or `replaying` (or `settle_deadline` passed), and once more then: the
  objects a change makes are frozen within about `interval` of being made, so no full pass
  scans more than that much of them. A registration that makes no workers triggers nothing.
- A freeze first collects the youngest generation (`gc.collect(0)`: what survived since
  its last pass, at most some hundreds of allocations), so the cyclic garbage that is
  that young when a freeze comes is not frozen. Without it, what requests in flight, the
  load monitor's scrapes and the replays had left (an HTTP client's finished request is a
  few dozen objects in cycles) was kept for good: measured at about 190 objects per change
  of eight instances, and some 55,000 after registering 1,024 workers (benchmarks/
  freeze_churn.py), more with every change for as long as the process runs. A full
  collection before each freeze kept nothing, but was a long pass at the first freeze of
  each change, longest at the one when the configured 1,024 workers were ready, and every
  route waited; the two young generations cost more than the youngest alone, at every
  freeze (some 40 a change).
- What a freeze still keeps: garbage old enough to have left the young generations, and
  cycles frozen alive that die later (a request in flight at that moment). Hence the
  re-freeze: once something has been frozen since the last one, when `quiet_seconds` have
  passed with no change pending and at least `refreeze_interval` since the last re-freeze
  (or since start), everything is unfrozen, collected and frozen again. What the freezes
  keep is then bounded by what the changes of one `refreeze_interval` keep, not by the
  process's age; a fleet that never stays quiet for `quiet_seconds` is never re-frozen.
  The re-freeze's collection scans every object the process holds and holds the event
  loop as long (the longer, the more workers are followed; `on_refreeze` is told
  each pause: kvroute_gc_refreeze_seconds), which is why it waits for a quiet fleet and
  comes seldom.
Made and used on one event loop.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from kvroute.app.fleet.registry import Instance, Registry, Worker
from kvroute.app.tasks import cancel_and_wait
from kvroute.app.workers import WorkerState

__all__ = ["FleetFreezer"]

_UNSETTLED = (WorkerState.CONNECTING, WorkerState.REPLAYING)


class FleetFreezer:
    def __init__(self, registry: Registry, ready: Callable[[], bool], *,
                 interval: float = 0.05, busy_seconds: float = 2.0,
                 max_interval: float = 1.0, settle_deadline: float = 30.0,
                 refreeze_interval: float = 3600.0, quiet_seconds: float = 5.0,
                 on_refreeze: Callable[[float, int], None] | None = None,
                 freeze: Callable[[], None] = gc.freeze,
                 unfreeze: Callable[[], None] = gc.unfreeze,
                 collect: Callable[[int], int] = gc.collect) -> None:
        """`refreeze_interval` 0: never re-freeze. `on_refreeze(pause, freed)`: after each
        re-freeze, how long it held the loop (seconds) and how many objects it freed."""
        self._registry = registry
        self._ready = ready
        self._interval = interval
        self._busy_seconds = busy_seconds
        self._max_interval = max_interval
        self._settle_deadline = settle_deadline
        self._refreeze_interval = refreeze_interval
        self._quiet_seconds = quiet_seconds
        self._on_refreeze = on_refreeze
        self._freeze = freeze
        self._unfreeze = unfreeze
        self._collect = collect
        self.freezes = 0  # for tests and traces
        self.refreezes = 0
        self.longest_freeze = 0.0  # seconds, the longest collection and freeze since start
        self.last_refreeze_pause = 0.0  # seconds the last re-freeze held the loop
        self.last_refreeze_freed = 0  # objects its collection freed
        self._owed = False  # frozen since the last re-freeze (or start): garbage may be kept
        self._last_refreeze = 0.0  # loop.time() of the last re-freeze, or of start
        self._settled_at = 0.0  # loop.time() when the fleet was last left quiet
        self._joined: list[Worker] = []  # workers joined since the fleet was last quiet
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._do_freeze()  # what start-up made already: the subscribers, their tasks
        self.longest_freeze = 0.0  # that one ran before anything was served
        self._registry.instance_listeners.append(self._instance_changed)
        self._task = asyncio.create_task(self._run(), name="gc freezer")

    async def stop(self) -> None:
        if self._instance_changed in self._registry.instance_listeners:
            self._registry.instance_listeners.remove(self._instance_changed)
        await cancel_and_wait(self._task)
        self._task = None
        self._joined.clear()

    def quiet(self) -> bool:
        """Whether no joined worker is waiting to settle (for tests and benchmarks)."""
        return not self._joined and not self._changed.is_set()

    def _instance_changed(self, instance: Instance, joined: bool) -> None:
        if joined and instance.workers:
            self._joined.extend(instance.workers)
            self._changed.set()
        elif not joined:  # not kept alive here once removed
            self._joined = [w for w in self._joined if w.instance is not instance]

    def _do_freeze(self, generation: int = 0) -> int:
        """Collect `generation` and the younger ones, then freeze; the objects freed."""
        began = time.perf_counter()
        freed = self._collect(generation)
        self._freeze()
        self.freezes += 1
        self.longest_freeze = max(self.longest_freeze, time.perf_counter() - began)
        return freed

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_refreeze = loop.time()
        while not self._ready():
            await asyncio.sleep(0.2)
        self._do_freeze()  # and what the configured fleet made connecting and replaying
        self._owed = True
        self._settled_at = loop.time()
        while True:
            await self._wait_for_change()
            await self._freeze_until_settled()
            self._owed = True
            self._settled_at = loop.time()

    async def _wait_for_change(self) -> None:
        """Until an instance joins with workers; meanwhile, once owed and due, re-freeze."""
        while self._owed and self._refreeze_interval > 0:
            due = max(self._last_refreeze + self._refreeze_interval,
                      self._settled_at + self._quiet_seconds)
            try:
                async with asyncio.timeout_at(due):
                    await self._changed.wait()
                return
            except TimeoutError:
                self._refreeze()
        await self._changed.wait()

    def _refreeze(self) -> None:
        """Unfreeze, collect everything once, freeze again: the cyclic garbage the freezes
        kept is freed."""
        began = time.perf_counter()
        self._unfreeze()
        freed = self._do_freeze(2)
        pause = time.perf_counter() - began
        self.refreezes += 1
        self.last_refreeze_pause, self.last_refreeze_freed = pause, freed
        self._owed = False
        self._last_refreeze = asyncio.get_running_loop().time()
        if self._on_refreeze is not None:
            self._on_refreeze(pause, freed)

    async def _freeze_until_settled(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        delay = self._interval
        while True:
            self._changed.clear()
            self._do_freeze()
            elapsed = loop.time() - started
            if elapsed >= self._settle_deadline or not self._unsettled():
                self._joined.clear()
                return
            if elapsed >= self._busy_seconds:
                delay = min(self._max_interval, delay * 2)
            await asyncio.sleep(delay)

    def _unsettled(self) -> bool:
        """Whether a worker that joined is still connecting or replaying; the ones done
        (or removed meanwhile: their instance is gone) are forgotten."""
        self._joined = [w for w in self._joined
                        if w.state in _UNSETTLED and self._registry.holds(w.instance)]
        return bool(self._joined)
