"""Keeping the fleet's long-lived objects out of the cyclic garbage collector's passes.

A worker keeps a few hundred objects alive for as long as it is followed (its subscriber,
sockets, tasks, replay state). Every object the collector tracks and has not frozen is
scanned by each of its full passes, and a full pass comes once enough objects have
survived into its oldest generation: while a hundred instances (800 workers) registered at
once connect and replay, passes over their objects held the event loop for 40-140 ms each,
and every route waited. Frozen (`gc.freeze`), objects are never scanned again; they are
still freed by reference counting when the last reference goes (a removed instance leaves
no reference cycles: tests/test_fleet_teardown.py), which is what makes freezing the
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
- The price: cyclic garbage that exists at the moment of a freeze is never collected. That
  is what the requests in flight left (a freeze takes everything tracked), a bounded amount
  per fleet change; between changes nothing is frozen.
Made and used on one event loop.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from kvroute.app.registry import Instance, Registry, Worker
from kvroute.app.subscription import WorkerState
from kvroute.app.tasks import cancel_and_wait

__all__ = ["FleetFreezer"]

_UNSETTLED = (WorkerState.CONNECTING, WorkerState.REPLAYING)


class FleetFreezer:
    def __init__(self, registry: Registry, ready: Callable[[], bool], *,
                 interval: float = 0.05, busy_seconds: float = 2.0,
                 max_interval: float = 1.0, settle_deadline: float = 30.0,
                 freeze: Callable[[], None] = gc.freeze) -> None:
        self._registry = registry
        self._ready = ready
        self._interval = interval
        self._busy_seconds = busy_seconds
        self._max_interval = max_interval
        self._settle_deadline = settle_deadline
        self._freeze = freeze
        self.freezes = 0  # for tests and traces
        self._joined: list[Worker] = []  # workers joined since the fleet was last quiet
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._do_freeze()  # what start-up made already: the subscribers, their tasks
        self._registry.instance_listeners.append(self._instance_changed)
        self._task = asyncio.create_task(self._run(), name="gc freezer")

    async def stop(self) -> None:
        if self._instance_changed in self._registry.instance_listeners:
            self._registry.instance_listeners.remove(self._instance_changed)
        await cancel_and_wait(self._task)
        self._task = None
        self._joined.clear()

    def _instance_changed(self, instance: Instance, joined: bool) -> None:
        if joined and instance.workers:
            self._joined.extend(instance.workers)
            self._changed.set()
        elif not joined:  # not kept alive here once removed
            self._joined = [w for w in self._joined if w.instance is not instance]

    def _do_freeze(self) -> None:
        self._freeze()
        self.freezes += 1

    async def _run(self) -> None:
        while not self._ready():
            await asyncio.sleep(0.2)
        self._do_freeze()  # and what the configured fleet made connecting and replaying
        while True:
            await self._changed.wait()
            await self._freeze_until_settled()

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
                        if w.state in _UNSETTLED and w.instance.id in self._registry
                        and self._registry.get(w.instance.id) is w.instance]
        return bool(self._joined)
