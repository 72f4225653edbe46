"""Kvroute as the saved-state benchmark (``benchmarks.saved_state``) runs it: the
service's own subscribers, started as its registry starts them, into one index.

``Kvroute`` starts a subscriber per worker (given what a ``StateKeeper`` kept for it, when
there is one) and waits until they serve or have caught up; ``Units`` is the registry as
far as the keeper is concerned; ``ServingClock`` notes when each worker turned serving.
"""

from __future__ import annotations

import asyncio
import time

import zmq.asyncio

from kvroute.app.config import InstanceConfig
from kvroute.app.fleet.registry import Instance, Worker
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.state.keeper import StateKeeper
from kvroute.app.workers import SubscriberHooks, SubscriberOptions, WorkerEndpoint, WorkerState
from kvroute.index import PrefixIndex

WAIT_LIVE_S = 600.0


class ServingClock(SubscriberHooks):
    """When each worker first turned serving: live, or degraded (perf_counter)."""

    def __init__(self) -> None:
        self.serving_at: dict[tuple[str, int], float] = {}

    def state_changed(self, worker: tuple[str, int], state: WorkerState) -> None:
        if state.serving:
            self.serving_at.setdefault(worker, time.perf_counter())


class Units:
    """A registry as far as ``StateKeeper`` is concerned: ``workers()``."""

    def __init__(self) -> None:
        self.units: list[Worker] = []

    def workers(self) -> list[Worker]:
        return list(self.units)


class Kvroute:
    """Subscribers into one index, started as the registry starts them."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: list[WorkerEndpoint],
                 keeper: StateKeeper | None = None) -> None:
        self.index = keeper.index if keeper is not None else PrefixIndex()
        self.registry = Units()
        self.clock = ServingClock()
        self._ctx = ctx
        self._endpoints = endpoints
        self._keeper = keeper

    def start(self) -> None:
        for endpoint in self._endpoints:
            saved = self._keeper.claim(endpoint) if self._keeper is not None else None
            sub = Subscriber(endpoint, self.index, ctx=self._ctx, hooks=self.clock,
                             options=SubscriberOptions(), saved=saved)
            instance = Instance(endpoint.instance_id, InstanceConfig(events=(endpoint.endpoint,)),
                                url=None)
            unit = Worker(instance, endpoint, sub)
            unit.task = asyncio.create_task(sub.run(), name=f"subscriber {endpoint.worker}")
            self.registry.units.append(unit)

    async def serving(self, what: str) -> float:
        """The time (perf_counter) the last worker turned serving (live or degraded)."""
        deadline = time.monotonic() + WAIT_LIVE_S
        while len(self.clock.serving_at) < len(self.registry.units):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not serving after {WAIT_LIVE_S:.0f} s: "
                                   f"{self.states()}")
            await asyncio.sleep(0.002)
        return max(self.clock.serving_at.values())

    def check_live(self, last_seqs: dict[tuple[str, int], int], what: str) -> None:
        """Every worker live at its rank's last seq; raises (saying why not) otherwise."""
        for unit in self.registry.units:
            status = unit.subscriber.status
            if status.state != WorkerState.LIVE or status.last_seq != last_seqs[unit.key]:
                raise RuntimeError(f"{what}: {unit.key} is {status.state} at seq "
                                   f"{status.last_seq}, expected live at "
                                   f"{last_seqs[unit.key]} ({status.last_error})")

    def states(self) -> dict[str, str]:
        return {f"{u.key[0]}/{u.key[1]}": f"{u.subscriber.status.state} at seq "
                f"{u.subscriber.status.last_seq}" for u in self.registry.units}

    async def caught_up(self, last_seqs: dict[tuple[str, int], int], what: str) -> None:
        """Waits until every worker applied its rank's last seq, live."""
        deadline = time.monotonic() + WAIT_LIVE_S
        while any(u.subscriber.status.last_seq != last_seqs[u.key]
                  for u in self.registry.units):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not caught up after {WAIT_LIVE_S:.0f} s: "
                                   f"{self.states()}")
            await asyncio.sleep(0.01)
        self.check_live(last_seqs, what)

    async def stop(self) -> None:
        for unit in self.registry.units:
            await unit.subscriber.stop()
        await asyncio.gather(*(u.task for u in self.registry.units if u.task is not None),
                             return_exceptions=True)
