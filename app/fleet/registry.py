"""The set of vLLM instances kvroute follows, and the subscribers that feed the index.

Invariants:
- The registry owns every `Subscriber` task; an instance's subscribers run from
  the moment it is added until it is removed or the registry closes.
- The index holds entries only for workers of registered instances: `remove`
  stops the subscribers first and then drops the workers, so no late event can
  re-create them.
- Everything runs on one event loop; the index is synchronous, so a query sees
  each event applied entirely or not at all.
- An instance added from configuration whose discovery fails stays registered
  with no workers and keeps retrying in the background; one added through the
  API must be discoverable at once, or the caller gets the error.
- At most `max_instances` are registered, counting adds still discovering.
- `version` changes whenever the set of registered instances or their workers changes, and
  every `state_listeners` callback hears each worker's change of state, so what is derived
  from them (`app.routing.eligible`) can be kept between routes. When the change is one instance
  joining with its workers or leaving with them, the version moves by exactly one and every
  `instance_listeners` callback hears it at once, so that derived state can follow in
  O(that instance) instead of being rebuilt over the fleet.
- Every worker's endpoints are on its instance's host or an allowed one
  (`config.foreign_endpoints`), whether configured or discovered; and an instance's
  models are what its /v1/models lists whenever kvroute learnt it from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import zmq

from kvroute.app.config import InstanceConfig, default_instance_id, foreign_endpoints
from kvroute.app.errors import LimitReached, NotAllowed
from kvroute.app.fleet.discovery import DiscoveryError, WorkerEndpoint, discover, discover_models
from kvroute.app.fleet.limits import replay_channels_room, room_for
from kvroute.app.ingest.pacing import FleetPacing
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.state.format import SavedWorker
from kvroute.app.tasks import cancel_and_wait
from kvroute.app.workers import (
    SubscriberHooks,
    SubscriberOptions,
    WorkerKey,
    WorkerState,
)
from kvroute.index import PrefixIndex

__all__ = ["DuplicateInstance", "Instance", "ModelNotServed", "Registry", "UnknownInstance",
           "Worker"]

log = logging.getLogger("kvroute.registry")

# Bounds for the background discovery of configured instances.
DISCOVERY_RETRY_FIRST = 1.0
DISCOVERY_RETRY_MAX = 30.0


class DuplicateInstance(Exception):
    pass


class UnknownInstance(KeyError):
    pass


class ModelNotServed(DiscoveryError):
    """The instance answers, and does not serve the `model` its registration names."""


@dataclass(slots=True)
class Worker:
    """One routing unit: an instance's data-parallel rank and its subscriber."""

    instance: Instance
    endpoint: WorkerEndpoint
    subscriber: Subscriber
    task: asyncio.Task[None] | None = None
    # (instance id, rank): made once, since routes look it up for many workers each.
    key: WorkerKey = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.instance.id, self.endpoint.dp_rank)

    @property
    def state(self) -> WorkerState:
        return self.subscriber.status.state


@dataclass(slots=True, eq=False)
class Instance:
    id: str
    config: InstanceConfig
    url: str | None
    models: tuple[str, ...] = ()
    lora_adapters: frozenset[str] = frozenset()  # models that are LoRA adapters
    block_size: int | None = None
    workers: list[Worker] = field(default_factory=list)
    discovery_error: str | None = None
    added_at: float = field(default_factory=time.time)
    fleet: str | None = None  # the fleet (app.fleet.dns) that added it, and removes it


    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models


class Registry:
    def __init__(self, index: PrefixIndex, client: httpx.AsyncClient,
                 context: zmq.Context | None = None,
                 options: SubscriberOptions | None = None, *, max_instances: int,
                 endpoint_hosts: tuple[str, ...] = (),
                 pacing: FleetPacing | None = None, connections: int = 0) -> None:
        self.index = index
        self._client = client
        self._options = options or SubscriberOptions()
        self._max_instances = max_instances
        self._endpoint_hosts = endpoint_hosts
        # Client connections the HTTP server may hold: open files the fleet cannot use.
        self._connections = connections
        self._adding = 0  # API adds waiting for discovery: they count toward the maximum
        self._context = context or zmq.Context.instance()
        # Shared by every subscriber: replays at once and idle checks a second, fleet-wide.
        self.pacing = pacing or FleetPacing()
        # Saved holdings for a worker whose subscriber is starting (app.state.keeper).
        self.claim_saved: Callable[[WorkerEndpoint], SavedWorker | None] = _nothing_saved
        self._instances: dict[str, Instance] = {}
        self._discovery_tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        # Bumped on every change of the instances or their workers; a worker's change of
        # state is told to each of state_listeners instead (with the worker).
        self.version = 0
        self.state_listeners: list[Callable[[Worker], None]] = []
        # (instance, joined): an instance registered with its workers, or removed.
        self.instance_listeners: list[Callable[[Instance, bool], None]] = []
        self._hooks = _VersionHooks(self)

    # -- queries ---------------------------------------------------------
    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._instances

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._instances.values()))

    def __len__(self) -> int:
        return len(self._instances)

    def holds(self, instance: Instance) -> bool:
        """Whether `instance` itself is registered (not only another of the same id)."""
        return self._instances.get(instance.id) is instance

    def get(self, instance_id: str) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstance(instance_id) from None

    def workers(self) -> Iterator[Worker]:
        for instance in list(self._instances.values()):
            yield from instance.workers

    # -- changes ---------------------------------------------------------
    async def add(self, config: InstanceConfig, *, wait_for_discovery: bool = True,
                  fleet: str | None = None) -> Instance:
        """Register an instance and start following its events (`fleet`: the fleet whose
        DNS name gave its address).

        With `wait_for_discovery` false (configured instances at start-up), an
        unreachable instance is registered anyway and discovered in the background.
        Raises DuplicateInstance, LimitReached, NotAllowed (explicit endpoints on a
        foreign host), or DiscoveryError (ModelNotServed among them) when waiting.
        """
        instance_id = default_instance_id(config)
        if instance_id in self._instances:
            raise DuplicateInstance(instance_id)
        if len(self._instances) + self._adding >= self._max_instances:
            raise LimitReached(f"{self._max_instances} instances are registered already "
                               "(max_instances)", "url")
        foreign = foreign_endpoints(config.url, (*config.events, *config.replay),
                                    self._endpoint_hosts)
        if foreign:
            raise NotAllowed(f"endpoint {foreign[0]} is not on the instance's host; the "
                             "operator can allow its host in zmq_endpoint_hosts", "events")
        instance = Instance(id=instance_id, config=config, url=config.url,
                            models=(config.model,) if config.model else (),
                            block_size=config.block_size, fleet=fleet)
        if config.events:
            if wait_for_discovery and config.url:
                await self._learn_models(instance)
                if instance_id in self._instances:
                    raise DuplicateInstance(instance_id)
            endpoints = [
                WorkerEndpoint(instance_id=instance_id, dp_rank=rank, endpoint=endpoint,
                               replay_endpoint=config.replay[rank] if config.replay else None,
                               topic=config.topic)
                for rank, endpoint in enumerate(config.events)
            ]
            self._check_room(len(endpoints))
            self._instances[instance_id] = instance
            self._start_workers(instance, endpoints)
            self._changed(instance, joined=True)
            return instance
        if wait_for_discovery:
            self._adding += 1
            try:
                endpoints = await self._discover(instance)
            finally:
                self._adding -= 1
            if instance_id in self._instances:  # a concurrent add of the same id won
                raise DuplicateInstance(instance_id)
            self._check_room(len(endpoints))
            self._instances[instance_id] = instance
            self._start_workers(instance, endpoints)
            self._changed(instance, joined=True)
            return instance
        self._instances[instance_id] = instance
        self._changed(instance, joined=True)  # no workers yet: they come with discovery
        self._discovery_tasks[instance_id] = asyncio.create_task(
            self._discover_until_found(instance), name=f"discover {instance_id}")
        return instance

    async def remove(self, instance_id: str) -> Instance:
        """Stop an instance's subscribers and drop everything the index had of it."""
        instance = self.get(instance_id)
        del self._instances[instance_id]
        self._changed(instance, joined=False)
        await cancel_and_wait(self._discovery_tasks.pop(instance_id, None))
        await self._stop_workers(instance.workers, paced=True)
        for worker in instance.workers:
            self.index.drop_worker(worker.key)
        self._size_replay_channels(self._followed())
        # A removed instance has no workers: each worker points at its instance, and
        # leaving them listed would make a cycle that only the garbage collector frees
        # (its passes over a hundred removed instances stalled every route).
        instance.workers = []
        return instance

    async def close(self) -> None:
        """Stop everything; the registry is unusable afterwards. Every subscriber is asked
        to stop at once and waited for together, so a fleet stops in about the time one
        subscriber takes, not the sum of them."""
        self._closed = True
        instances = list(self._instances.values())
        self._instances.clear()
        self.version += 1
        tasks = list(self._discovery_tasks.values())
        self._discovery_tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._stop_workers([w for instance in instances for w in instance.workers])
        for instance in instances:
            for worker in instance.workers:
                self.index.drop_worker(worker.key)

    # -- internals -------------------------------------------------------
    async def _discover(self, instance: Instance) -> list[WorkerEndpoint]:
        assert instance.url is not None
        info = await discover(instance.url, self._client, api_key=instance.config.api_key)
        self._check_model(instance, info.models)
        foreign = foreign_endpoints(instance.url, [
            e for w in info.workers for e in (w.endpoint, w.replay_endpoint) if e],
            self._endpoint_hosts)
        if foreign:
            raise DiscoveryError(instance.url, f"it reports event endpoint {foreign[0]}, not "
                                               "on its own host; the operator can allow that "
                                               "host in zmq_endpoint_hosts")
        instance.models = tuple(info.models)
        instance.lora_adapters = frozenset(info.lora_adapters)
        if instance.config.block_size is None:
            instance.block_size = info.block_size
        instance.discovery_error = None
        topic = instance.config.topic
        return [
            WorkerEndpoint(instance_id=instance.id, dp_rank=w.dp_rank, endpoint=w.endpoint,
                           replay_endpoint=w.replay_endpoint, topic=topic or w.topic)
            for w in info.workers
        ]

    async def _learn_models(self, instance: Instance) -> None:
        """An instance with explicit endpoints: its models from its /v1/models when that
        answers, so a registration cannot claim a model the instance does not serve; the
        registration's `model` when it does not (its HTTP server may be elsewhere)."""
        assert instance.url is not None
        self._adding += 1
        try:
            models, adapters = await discover_models(instance.url, self._client,
                                                     api_key=instance.config.api_key)
        except DiscoveryError as exc:
            log.info("instance %s: models from its registration (%s)", instance.id, exc)
            return
        finally:
            self._adding -= 1
        self._check_model(instance, models)
        instance.models = tuple(models)
        instance.lora_adapters = frozenset(adapters)

    @staticmethod
    def _check_model(instance: Instance, models: list[str]) -> None:
        wanted = instance.config.model
        if wanted is not None and wanted not in models:
            raise ModelNotServed(instance.url or instance.id,
                                 f"it serves {', '.join(models)}; not {wanted!r} (the "
                                 "registration's `model`)")

    async def _discover_until_found(self, instance: Instance) -> None:
        delay = DISCOVERY_RETRY_FIRST
        while not self._closed:
            try:
                endpoints = await self._discover(instance)
                self._check_room(len(endpoints))
            except (DiscoveryError, LimitReached) as exc:
                self.version += 1  # discovery may have learnt its models before failing
                instance.discovery_error = str(exc)
                log.warning("instance %s: %s; retrying in %.0f s", instance.id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, DISCOVERY_RETRY_MAX)
                continue
            self.version += 1  # its models and block size may be new
            if self._instances.get(instance.id) is instance:
                self._start_workers(instance, endpoints)
            self._discovery_tasks.pop(instance.id, None)
            return

    def _check_room(self, adding: int) -> None:
        """Raise LimitReached when `adding` workers more would not fit the process's open
        files or the ZMQ context's sockets: said now, in one sentence, rather than by their
        subscribers failing to open sockets."""
        reason = room_for(self._followed(), adding, self._context,
                          self.pacing.replay_concurrency, self._connections)
        if reason is not None:
            raise LimitReached(reason, "events")

    def _followed(self) -> int:
        return sum(len(instance.workers) for instance in self._instances.values())

    def _size_replay_channels(self, workers: int) -> None:
        """Keep as many replay channels open as the open files leave beside `workers`."""
        self.pacing.replay_channels.resize(
            replay_channels_room(workers, self.pacing.replay_concurrency, self._connections))

    def _changed(self, instance: Instance, *, joined: bool) -> None:
        self.version += 1
        for listener in self.instance_listeners:
            listener(instance, joined)

    def _start_workers(self, instance: Instance, endpoints: list[WorkerEndpoint]) -> None:
        self._size_replay_channels(self._followed() + len(endpoints))
        for endpoint in endpoints:
            subscriber = Subscriber(endpoint, self.index, ctx=self._context,
                                    options=self._options, saved=self.claim_saved(endpoint),
                                    pacing=self.pacing, hooks=self._hooks)
            worker = Worker(instance=instance, endpoint=endpoint, subscriber=subscriber)
            worker.task = asyncio.create_task(
                subscriber.run(), name=f"subscriber {instance.id} rank {endpoint.dp_rank}")
            instance.workers.append(worker)

    async def _stop_workers(self, workers: list[Worker], *, paced: bool = False) -> None:
        """Stop the workers' subscribers and wait for their tasks. `paced`: each is asked
        in a turn of the fleet's pacing, one turn each, so a hundred removals at once wake
        at most `turns_per_pass` subscribers a pass (asked all at once, the first steps
        of a few hundred stopping subscribers, each small, filled single passes of the
        loop for several milliseconds); unpaced (closing), all are asked at once."""
        if paced:
            try:
                for worker in workers:
                    await self.pacing.turn()
                    worker.subscriber.ask_to_stop()
            except BaseException:  # cancelled while waiting: none is left running
                for worker in workers:
                    worker.subscriber.ask_to_stop()
                raise
        await asyncio.gather(*(worker.subscriber.stop() for worker in workers))
        for worker in workers:
            if worker.task is not None and not worker.task.done():
                worker.task.cancel()
            if worker.task is not None:
                try:
                    await worker.task
                except asyncio.CancelledError:
                    pass
                except Exception:  # its end is not the remover's failure
                    log.exception("subscriber %s rank %d ended with an error",
                                  worker.instance.id, worker.endpoint.dp_rank)


class _VersionHooks(SubscriberHooks):
    """Every subscriber's state change, told to the registry's state listeners."""

    __slots__ = ("_registry",)

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def state_changed(self, worker: WorkerKey, state: WorkerState) -> None:
        registry = self._registry
        if not registry.state_listeners or worker[0] not in registry:
            return
        for candidate in registry.get(worker[0]).workers:
            if candidate.endpoint.dp_rank == worker[1]:
                for listener in registry.state_listeners:
                    listener(candidate)
                return


def _nothing_saved(endpoint: WorkerEndpoint) -> None:
    return None
