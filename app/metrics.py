"""Prometheus metrics.

Counters that subscribers already keep (events, blocks, gaps, ...) are read at
scrape time by a collector instead of being counted twice; only what exists
nowhere else (route latency, match ratio) is recorded here. Each service gets
its own CollectorRegistry so several can live in one process (tests, benchmark).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.app.hit_accuracy import HitAccuracy
from kvroute.app.registry import Registry
from kvroute.app.subscription import COUNTERS, WorkerState

__all__ = ["ServiceMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"



class _RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[object]:
        labels = ["instance", "dp_rank"]
        counters = {attr: CounterMetricFamily(name, text, labels=labels)
                    for attr, (name, text) in COUNTERS.items()}
        state = GaugeMetricFamily("kvroute_worker_state",
                                  "1 for the state each worker is in", labels=[*labels, "state"])
        holdings = GaugeMetricFamily("kvroute_worker_holdings",
                                     "blocks each worker holds in the index, per medium",
                                     labels=[*labels, "medium"])
        unconfirmed = GaugeMetricFamily(
            "kvroute_worker_unconfirmed_blocks",
            "saved blocks of each worker that no replay or event confirmed yet", labels=labels)
        index = self._registry.index
        index.expire_unconfirmed(time.monotonic())  # a gauge must not show expired blocks
        stats = index.stats()
        for worker in self._registry.workers():
            status = worker.subscriber.status
            key = [worker.instance.id, str(worker.endpoint.dp_rank)]
            for attr, family in counters.items():
                family.add_metric(key, float(getattr(status, attr)))
            for name in WorkerState:
                state.add_metric([*key, name.value], 1.0 if worker.state == name else 0.0)
            for medium, count in stats.holdings.get(worker.key, {}).items():
                holdings.add_metric([*key, medium], float(count))
            unconfirmed.add_metric(key, float(index.unconfirmed_blocks(worker.key)))
        yield from counters.values()
        yield state
        yield holdings
        yield unconfirmed
        yield GaugeMetricFamily("kvroute_index_nodes", "distinct cached blocks in the index",
                                value=float(stats.nodes))
        yield GaugeMetricFamily("kvroute_index_bytes", "estimated memory of the index",
                                value=float(stats.estimated_bytes))
        yield CounterMetricFamily("kvroute_orphaned_blocks",
                                  "stored blocks whose parent was never announced",
                                  value=float(stats.orphaned_blocks))
        yield CounterMetricFamily("kvroute_unknown_removals",
                                  "removals of blocks the worker did not hold",
                                  value=float(stats.unknown_removals))
        yield CounterMetricFamily("kvroute_ignored_blocks",
                                  "blocks of KV-cache groups that are not full attention",
                                  value=float(stats.ignored_blocks))
        yield GaugeMetricFamily("kvroute_instances", "registered instances",
                                value=float(len(self._registry)))


class ServiceMetrics:
    def __init__(self, registry: Registry) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RegistryCollector(registry))
        self.route_latency = Histogram(
            "kvroute_route_latency_seconds", "time to answer POST /v1/route",
            labelnames=["input"], registry=self.registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 1.0),
        )
        self.match_ratio = Histogram(
            "kvroute_route_match_ratio", "matched tokens / prompt tokens of the chosen worker",
            registry=self.registry, buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
        )
        self.route_errors = Counter(
            "kvroute_route_errors", "route requests answered with an error",
            labelnames=["status"], registry=self.registry,
        )
        # The proxy's predicted-vs-actual cached tokens (app.hit_accuracy).
        self.hits = HitAccuracy(self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
