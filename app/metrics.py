"""Prometheus metrics.

Counters that subscribers already keep (events, blocks, gaps, ...) are read at
scrape time instead of being counted twice; only what exists nowhere else (route
latency, match ratio) is recorded here. The per-worker series are written by kvroute
itself, a slice of workers at a time with the event loop running between slices
(`_WorkerSeries`); the rest through prometheus_client. Each service gets its own
CollectorRegistry so several can live in one process (tests, benchmark).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvroute.app.fleet.registry import Registry
from kvroute.app.routing.accuracy import HitAccuracy
from kvroute.app.workers import COUNTERS, WorkerState

__all__ = ["ServiceMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"



# Workers whose series are written between two yields to the event loop (26 series each):
# a short piece of work, so a scrape of thousands of workers never holds routes up long.
WORKERS_PER_SLICE = 128
# Seconds, for a route's own time; a body's arrival also gets a 5 s bucket (slow clients).
_ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 1.0)
_LABEL_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})


def _family_head(name: str, text: str, kind: str) -> str:
    exposed = f"{name}_total" if kind == "counter" else name
    return f"# HELP {exposed} {text}\n# TYPE {exposed} {kind}\n"


class _WorkerSeries:
    """The per-worker series, written as Prometheus text a slice of workers at a time.

    prometheus_client built and wrote them in one call: at 1,824 workers (49k series) that
    held the event loop for all of them on every scrape, every route waiting. The text is the
    same, byte for byte, as prometheus_client writes (tests/app/test_metrics_text.py); each
    worker's values are read at one moment, workers of later slices a little later."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._heads = [*(_family_head(name, text, "counter") for name, text in COUNTERS.values()),
                       _family_head("kvroute_worker_state", "1 for the state each worker is in",
                                    "gauge"),
                       _family_head("kvroute_worker_holdings",
                                    "blocks each worker holds in the index, per medium",
                                    "gauge"),
                       _family_head("kvroute_worker_unconfirmed_blocks",
                                    "saved blocks of each worker that no replay or event "
                                    "confirmed yet", "gauge")]
        self._counter_names = [f"{name}_total{{" for name, _ in COUNTERS.values()]

    async def render(self) -> list[str]:
        """The families' text, in COUNTERS order, then state, holdings, unconfirmed."""
        index = self._registry.index
        index.expire_unconfirmed(time.monotonic())  # a gauge must not show expired blocks
        families: list[list[str]] = [[head] for head in self._heads]
        counters = families[:len(COUNTERS)]
        state, holdings, unconfirmed = families[len(COUNTERS):]
        attrs = list(COUNTERS)
        workers = list(self._registry.workers())  # the fleet as the scrape began
        for start in range(0, len(workers), WORKERS_PER_SLICE):
            if start:
                await asyncio.sleep(0)
            for worker in workers[start:start + WORKERS_PER_SLICE]:
                status = worker.subscriber.status
                labels = (f'dp_rank="{worker.endpoint.dp_rank}",'
                          f'instance="{worker.instance.id.translate(_LABEL_ESCAPES)}"')
                for attr, name, lines in zip(attrs, self._counter_names, counters, strict=True):
                    lines.append(f"{name}{labels}}} {floatToGoString(getattr(status, attr))}\n")
                for name in WorkerState:
                    state.append(f'kvroute_worker_state{{{labels},state="{name.value}"}} '
                                 f"{'1.0' if worker.state == name else '0.0'}\n")
                for medium, count in index.held_by_medium(worker.key).items():
                    holdings.append(f'kvroute_worker_holdings{{{labels},medium="{medium}"}} '
                                    f"{floatToGoString(count)}\n")
                unconfirmed.append(f"kvroute_worker_unconfirmed_blocks{{{labels}}} "
                                   f"{floatToGoString(index.unconfirmed_blocks(worker.key))}\n")
        return ["".join(lines) for lines in families]


class _FleetCollector(Collector):
    """The index's and the registry's own numbers (a handful of series)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[object]:
        stats = self._registry.index.stats()
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
                                  "blocks stored in KV-cache groups that hold no full "
                                  "prefix, or held elsewhere (a locality other than "
                                  "LOCAL): not indexed",
                                  value=float(stats.ignored_blocks))
        yield GaugeMetricFamily("kvroute_instances", "registered instances",
                                value=float(len(self._registry)))


class ServiceMetrics:
    def __init__(self, registry: Registry) -> None:
        self._workers = _WorkerSeries(registry)
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(registry))
        self.route_latency = Histogram(
            "kvroute_route_latency_seconds",
            "time to answer POST /v1/route once its body has arrived",
            labelnames=["input"], registry=self.registry, buckets=_ROUTE_BUCKETS)
        self.route_body_wait = Histogram(
            "kvroute_route_body_seconds",
            "time from a POST /v1/route request's headers to the end of its body",
            registry=self.registry, buckets=(*_ROUTE_BUCKETS, 5.0))
        self.match_ratio = Histogram(
            "kvroute_route_match_ratio", "matched tokens / prompt tokens of the chosen worker",
            registry=self.registry, buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
        )
        self.route_errors = Counter(
            "kvroute_route_errors", "route requests answered with an error",
            labelnames=["status"], registry=self.registry,
        )
        self.match_latency = Histogram(
            "kvroute_match_latency_seconds",
            "time to answer POST /v1/match once its body has arrived",
            labelnames=["input"], registry=self.registry, buckets=_ROUTE_BUCKETS)
        self.match_errors = Counter(
            "kvroute_match_errors", "match queries answered with an error",
            labelnames=["status"], registry=self.registry,
        )
        # The proxy's predicted-vs-actual cached tokens (app.routing.accuracy).
        self.hits = HitAccuracy(self.registry)

    async def render(self) -> bytes:
        """The exposition text: the per-worker series (written a slice of workers at a
        time, the loop running between slices), then everything in `registry`."""
        families = await self._workers.render()
        return "".join(families).encode() + generate_latest(self.registry)
