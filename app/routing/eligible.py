"""The workers a route may weigh, kept between routes instead of found anew for each.

A route weighs the serving (live or degraded) workers of the instances that serve its model.
Finding them walks the whole fleet, so an `EligibleCache` keeps one `Eligible` per model,
built again only when instances come or go, and updated in place when a worker changes
state (a hundred instances joining make thousands of those): a route then costs the
workers that match or carry load, not the fleet.

Invariants:
- A kept `Eligible` is exactly what a walk of the registry would find now: it is built at a
  `Registry.version` (instances added or removed, workers started bump it) and never
  answered at another; each worker's change of state since is applied to it
  (`worker_changed`) as it happens, and so is an instance joining or leaving with its
  workers (`Registry.instance_listeners`: the version it moves to is then the kept set's
  too). Any other change of the registry leaves it stale, rebuilt at the next route.
- `sorted_keys` holds its workers' keys sorted, so the first few idle workers are found
  without a sort. The order of `workers` and `instances` means nothing.
- Block sizes (the tie-break's, `routing.TieBreaker`): a worker's is its instance's declared
  (configured or discovered) block size; for an instance that declares none, the size the
  index learnt from the worker's events, read at each use (it can change any time).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from kvroute.app.fleet.registry import Instance, Registry, Worker
from kvroute.app.workers import WorkerKey

__all__ = ["Eligible", "EligibleCache", "eligible_among"]


@dataclass(slots=True)
class Eligible:
    """The serving workers of the instances serving one model (see the module invariants)."""

    workers: dict[WorkerKey, Worker]
    sorted_keys: list[WorkerKey]
    # Those with at least one serving worker (by id; the order means nothing).
    instances: dict[str, Instance]
    serving_instances: int  # registered instances serving the model, serving workers or not
    adapter_instances: int  # of `instances`, those where the model is a LoRA adapter
    declared_sizes: Counter[int]  # workers per declared block size
    undeclared: dict[WorkerKey, None]  # workers whose instance declares no block size
    version: int = -1
    _urls: list[str] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, key: object) -> bool:
        return key in self.workers

    @property
    def served(self) -> bool:
        """Some registered instance serves the model, serving workers or not."""
        return self.serving_instances > 0

    @property
    def adapter(self) -> bool:
        """The model is a LoRA adapter on some instance with serving workers."""
        return self.adapter_instances > 0

    def urls(self, exclude: frozenset[WorkerKey] = frozenset()) -> list[str]:
        """The instances' URLs, each once, leaving out instances whose every serving
        worker is in `exclude`."""
        if not exclude:
            if self._urls is None:
                self._urls = list(dict.fromkeys(
                    i.url for i in self.instances.values() if i.url))
            return self._urls
        return list(dict.fromkeys(
            i.url for i in self.instances.values() if i.url and any(
                w.key not in exclude for w in i.workers if w.state.serving)))

    def ascending(self, skip: Callable[[WorkerKey], bool]) -> Iterator[WorkerKey]:
        """The keys in sorted order, without those `skip` says."""
        return (key for key in self.sorted_keys if not skip(key))

    def worker_changed(self, worker: Worker, model: str | None) -> None:
        """`worker` (of a registered instance) changed state: join or leave."""
        if not worker.instance.serves(model) or \
                (worker.key in self.workers) == worker.state.serving:
            return
        if worker.state.serving:
            self._join(worker, model)
        else:
            self._leave(worker, model)

    def instance_joined(self, instance: Instance, model: str | None) -> None:
        """`instance` was registered, with whatever workers it has: O(its workers)."""
        if not instance.serves(model):
            return
        self.serving_instances += 1
        for worker in instance.workers:
            if worker.state.serving and worker.key not in self.workers:
                self._join(worker, model)

    def instance_left(self, instance: Instance, model: str | None) -> None:
        """`instance` is no longer registered, whatever its workers' states: O(its
        workers)."""
        if not instance.serves(model):
            return
        self.serving_instances -= 1
        for worker in instance.workers:
            if worker.key in self.workers:
                self._leave(worker, model)

    def _join(self, worker: Worker, model: str | None) -> None:
        key, instance = worker.key, worker.instance
        self._urls = None
        self.workers[key] = worker
        bisect.insort(self.sorted_keys, key)
        if instance.id not in self.instances:
            self.instances[instance.id] = instance
            self.adapter_instances += model in instance.lora_adapters
        if instance.block_size:
            self.declared_sizes[instance.block_size] += 1
        else:
            self.undeclared[key] = None

    def _leave(self, worker: Worker, model: str | None) -> None:
        key, instance = worker.key, worker.instance
        self._urls = None
        del self.workers[key]
        del self.sorted_keys[bisect.bisect_left(self.sorted_keys, key)]
        if instance.block_size:
            self.declared_sizes[instance.block_size] -= 1
            if not self.declared_sizes[instance.block_size]:
                del self.declared_sizes[instance.block_size]
        else:
            del self.undeclared[key]
        if not any(w.key in self.workers for w in instance.workers):
            del self.instances[instance.id]
            self.adapter_instances -= model in instance.lora_adapters
    def smallest_block_size(self, others: Collection[WorkerKey],
                            index_size: Callable[[WorkerKey], int | None]) -> int | None:
        """The smallest block size among the eligible workers that are not in `others`
        (keys of eligible workers, each at most once): costs `others` and the workers that
        declare no block size, not the fleet."""
        declared = self.declared_sizes
        if declared and not self.undeclared:
            least = min(declared)
            if declared[least] > len(others):  # some worker of that size is not in others
                return least
        taken: Counter[int] = Counter()
        for key in others:
            size = self.workers[key].instance.block_size
            if size:
                taken[size] += 1
        smallest = next((size for size in sorted(self.declared_sizes)
                         if self.declared_sizes[size] > taken[size]), None)
        if self.undeclared:
            skipped = set(others) if not isinstance(others, (set, frozenset, dict)) else others
            learnt = [size for key in self.undeclared
                      if key not in skipped and (size := index_size(key))]
            if learnt:
                smallest = min(learnt) if smallest is None else min(smallest, *learnt)
        return smallest



def eligible_among(instances: Iterable[Instance], model: str | None) -> Eligible:
    """Walk `instances` once (a route's candidates, or the whole registry)."""
    found = Eligible(workers={}, sorted_keys=[], instances={}, serving_instances=0,
                     adapter_instances=0, declared_sizes=Counter(), undeclared={})
    for instance in instances:
        if not instance.serves(model):
            continue
        found.serving_instances += 1
        # A worker still connecting or replaying may hold anything (and a registration
        # that never goes live, say a fake one, must never take traffic).
        for worker in instance.workers:
            if worker.state.serving:
                found.workers[worker.key] = worker
                if instance.block_size:
                    found.declared_sizes[instance.block_size] += 1
                else:
                    found.undeclared[worker.key] = None
        if any(w.key in found.workers for w in instance.workers):
            found.instances[instance.id] = instance
            found.adapter_instances += model in instance.lora_adapters
    found.sorted_keys = sorted(found.workers)
    return found


class EligibleCache:
    """One `Eligible` per model asked for, rebuilt when the registry's version moved."""

    # Models remembered at most (each costs a fleet's worth of keys); past it, all are
    # forgotten and rebuilt as asked, so many model names cannot grow memory.
    MAX_MODELS = 64

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._by_model: dict[str | None, Eligible] = {}
        registry.state_listeners.append(self._worker_changed)
        registry.instance_listeners.append(self._instance_changed)

    def _worker_changed(self, worker: Worker) -> None:
        version = self._registry.version
        for model, eligible in self._by_model.items():
            if eligible.version == version:  # a stale one is rebuilt when asked for
                eligible.worker_changed(worker, model)

    def _instance_changed(self, instance: Instance, joined: bool) -> None:
        """Told just after the version moved for `instance` alone: a kept set exact at
        the version before follows in place (O(the instance's workers)), so a hundred
        instances added or removed at once cost a hundred small steps, not a walk of the
        fleet by each route between them."""
        version = self._registry.version
        for model, eligible in self._by_model.items():
            if eligible.version == version - 1:
                if joined:
                    eligible.instance_joined(instance, model)
                else:
                    eligible.instance_left(instance, model)
                eligible.version = version

    def get(self, model: str | None) -> Eligible:
        version = self._registry.version
        found = self._by_model.get(model)
        if found is not None and found.version == version:
            return found
        if len(self._by_model) >= self.MAX_MODELS or any(
                e.version != version for e in self._by_model.values()):
            self._by_model.clear()  # stale ones are never used again
        found = eligible_among(self._registry, model)
        found.version = version
        self._by_model[model] = found
        return found
