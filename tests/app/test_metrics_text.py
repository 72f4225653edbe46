"""The per-worker series of /metrics are written by kvroute a slice of workers at a time
(app.metrics): the text must be what prometheus_client writes for the same families, byte
for byte, whatever the instance ids hold, and the loop must run between slices."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvroute.app.metrics import WORKERS_PER_SLICE, ServiceMetrics
from kvroute.app.workers import COUNTERS, WorkerState, WorkerStatus
from kvroute.index import PrefixIndex
from tests.support.tokens import unique_tokens

IDS = ["10.0.0.1:8000", 'odd"id', "back\\slash", "new\nline", "ünïcode"]


class Fleet:
    """The registry surface the metrics read: workers with subscribers' counters and an
    index holding blocks for some of them."""

    def __init__(self, count: int) -> None:
        self.index = PrefixIndex()
        self._workers = []
        states = list(WorkerState)
        for n in range(count):
            key = (f"{IDS[n % len(IDS)]}-{n // len(IDS)}", n % 3)
            status = WorkerStatus(state=states[n % len(states)])
            for i, attr in enumerate(COUNTERS):
                setattr(status, attr, (n * 7 + i * 13) % 1000 + (10**17 if n == 3 else 0))
            self._workers.append(SimpleNamespace(
                key=key, instance=SimpleNamespace(id=key[0]),
                endpoint=SimpleNamespace(dp_rank=key[1]), state=status.state,
                subscriber=SimpleNamespace(status=status)))
            if n % 2:
                tokens = unique_tokens(n, 16 * (1 + n % 4))
                self.index.apply_stored(key, list(range(n * 10, n * 10 + len(tokens) // 16)),
                                        None, tokens, 16)

    def workers(self) -> Iterator[SimpleNamespace]:  # a generator, as the registry's is
        yield from self._workers

    def __len__(self) -> int:
        return len({w.key[0] for w in self._workers})


class Reference(Collector):
    """The per-worker families as prometheus_client builds them."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self):
        labels = ["instance", "dp_rank"]
        counters = {attr: CounterMetricFamily(name, text, labels=labels)
                    for attr, (name, text) in COUNTERS.items()}
        state = GaugeMetricFamily("kvroute_worker_state", "1 for the state each worker is in",
                                  labels=[*labels, "state"])
        holdings = GaugeMetricFamily("kvroute_worker_holdings",
                                     "blocks each worker holds in the index, per medium",
                                     labels=[*labels, "medium"])
        unconfirmed = GaugeMetricFamily(
            "kvroute_worker_unconfirmed_blocks",
            "saved blocks of each worker that no replay or event confirmed yet", labels=labels)
        for worker in self.fleet.workers():
            key = [worker.instance.id, str(worker.endpoint.dp_rank)]
            for attr, family in counters.items():
                family.add_metric(key, float(getattr(worker.subscriber.status, attr)))
            for name in WorkerState:
                state.add_metric([*key, name.value], 1.0 if worker.state == name else 0.0)
            for medium, count in self.fleet.index.held_by_medium(worker.key).items():
                holdings.add_metric([*key, medium], float(count))
            unconfirmed.add_metric(key, float(self.fleet.index.unconfirmed_blocks(worker.key)))
        yield from counters.values()
        yield from (state, holdings, unconfirmed)


def test_the_text_is_prometheus_clients_byte_for_byte_and_the_loop_runs_between_slices():
    fleet = Fleet(3 * WORKERS_PER_SLICE + 5)
    metrics = ServiceMetrics(fleet)  # type: ignore[arg-type]
    reference = CollectorRegistry()
    reference.register(Reference(fleet))
    expected = generate_latest(reference) + generate_latest(metrics.registry)

    async def scrape() -> tuple[bytes, int]:
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        try:
            text = await metrics.render()
        finally:
            counter.cancel()
        return text, turns

    text, turns = asyncio.run(scrape())
    assert text == expected
    assert turns >= 4  # a turn of the loop between each slice of workers
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    holdings = families["kvroute_worker_holdings"].samples
    assert {s.labels["instance"] for s in holdings} >= {'odd"id-0', "new\nline-0"}
    assert len(families["kvroute_worker_state"].samples) == len(WorkerState) * len(
        list(fleet.workers()))


def test_an_empty_fleet_writes_every_family_head():
    fleet = Fleet(0)
    text = asyncio.run(ServiceMetrics(fleet).render()).decode()  # type: ignore[arg-type]
    for name, _ in COUNTERS.values():
        assert f"# TYPE {name}_total counter\n" in text
    assert "# TYPE kvroute_worker_state gauge\n" in text
    assert "# TYPE kvroute_instances gauge\n" in text
