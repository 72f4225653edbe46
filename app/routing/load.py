"""How busy each worker is, from the instances' own Prometheus metrics.

vLLM exports, per engine (the `engine` label is the data-parallel rank):
`vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` (a fraction, 0..1, despite the name). A `LoadMonitor`
scrapes every registered instance's `/metrics` on an interval and keeps the last
reading per worker.

vLLM sets those gauges from each engine step's scheduler stats, so an engine that has
gone idle keeps reporting its last step's values (often one request running) until its
next request. Its `vllm:prompt_tokens` and `vllm:generation_tokens` counters move on every
step that does work: when neither moved for two scrape intervals (longer than any one
step), the engine is idle, and the reading says nothing runs or waits there and no KV
block is in use.

Its `vllm:time_to_first_token_seconds` and `vllm:e2e_request_latency_seconds` histograms
say how long its requests have lately taken: each reading keeps the mean of those that
ended since the previous one (`ttft_seconds`, `request_seconds`). In route mode kvroute
never sees a request end, and counts an answer sent there for about that long
(app.routing.inflight).

Invariants:
- A reading older than `stale_after` intervals is not trusted: `get` returns None
  for it, and the policy then uses only what kvroute itself knows (its in-flight
  count). An instance whose /metrics fails has no current reading (`get`); its
  workers' last readings stay for what they say of the past (`last`), until they leave.
- Scrapes of one round run concurrently, each bounded by one deadline for the whole
  exchange (`max(0.2, interval)`) and a page of at most `METRICS_MAX_BYTES`
  (`app.fleet.upstream`), so one slow, dripping or huge instance cannot delay the readings of
  the others, nor routes. A failed scrape drops the instance's readings (as any failure
  does) and is kept, for the operator, until the next scrape that succeeds (`failure`).
- An instance is read as it joins (registered, or its workers discovered) for what its
  reading says of the past (`last`: how long its requests take); its gauges count (`get`)
  from the next round on.
- An instance whose scrapes fail is asked again at the interval `PATIENT_FAILURES` times
  (a busy engine can miss a deadline), then after a delay that doubles with each failure,
  up to `FAILED_SCRAPE_BACKOFF` seconds, and at the interval again once one succeeds: a
  fleet whose instances serve no /metrics (or are down) costs a request each per half a
  minute, not each per interval.
- A page is parsed on a worker thread: at the size cap a hostile page takes long to
  parse, a stall of every route if it ran on the event loop. On the thread, no single
  C call (a `str.find` over the page, one regex over one line of bounded length) holds
  the GIL for more than a small part of its switch interval (5 ms), so the loop waits at
  most about that interval at a time; measured so with every hostile page shape at the cap.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx

from kvroute.app.fleet.registry import Instance, Registry
from kvroute.app.fleet.upstream import METRICS_MAX_BYTES, UpstreamError, fetch, url_at
from kvroute.app.tasks import cancel_and_wait
from kvroute.app.workers import WorkerKey

__all__ = ["Load", "LoadMonitor", "parse_load"]

log = logging.getLogger("kvroute.load")

_SAMPLES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prompt_tokens_total": "work",  # counters: prefill and generated tokens, summed
    "vllm:generation_tokens_total": "work",
    # histograms' sums and counts: how long the engine's requests took, lately
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
}
_PREFIXES = tuple(_SAMPLES)
# The longest wait before scraping again an instance whose scrapes fail, in seconds.
FAILED_SCRAPE_BACKOFF = 30.0
# Failures in a row asked again at the interval before the delays double: an engine busy
# enough to miss a scrape's deadline is not a dead one, and every reading of it counts.
PATIENT_FAILURES = 3
# Longer lines are skipped: vLLM's sample lines are a few hundred bytes (labels engine and
# model_name), and one regex call over a line holds the GIL for all of it.
_MAX_SAMPLE_LINE = 16 * 1024
# One sample line of the Prometheus text format: name, optional {labels}, value, optional
# timestamp. Label values are quoted strings in which \\, \" and \n are escaped. The
# possessive `*+` never gives back what the labels matched (a shorter match could not be
# followed by "}" anyway): without it, a line with no closing "}" backtracks through
# every character, and a long one holds the GIL far longer than a route can wait.
_SAMPLE = re.compile(r'([^{\s]+)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*+")*+)\})?\s+(\S+)(?:\s+\S+)?\s*')
_LABEL = re.compile(r'([a-zA-Z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Load:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    read_at: float = 0.0  # time.monotonic() when the scrape was sent
    work: float | None = None  # tokens the engine has processed; None: not exported
    work_since: float = 0.0  # read_at of the first reading with this `work`
    # Totals of the engine's time-to-first-token and end-to-end request histograms (seconds
    # and requests since it started); None: not exported.
    ttft_sum: float | None = None
    ttft_count: float | None = None
    e2e_sum: float | None = None
    e2e_count: float | None = None
    # The mean of the requests that ended between the previous reading and this one (the
    # previous mean when none did; every request's when there is no previous reading);
    # None: not known. app.routing.inflight reads them as how long a request sent there lasts.
    ttft_seconds: float | None = None
    request_seconds: float | None = None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _recent_mean(total: float | None, count: float | None, previous_total: float | None,
                 previous_count: float | None, previous_mean: float | None) -> float | None:
    """The mean of the observations a histogram gained since the previous reading; None
    for what no engine exports (a negative, infinite or NaN mean)."""
    if total is None or count is None:
        return None
    if previous_total is None or previous_count is None or count < previous_count:
        # first reading, or the engine restarted: its whole life so far
        mean = total / count if count > 0 else None
    elif count > previous_count:
        mean = (total - previous_total) / (count - previous_count)
    else:
        mean = previous_mean
    return mean if mean is not None and 0.0 <= mean < math.inf else None


def parse_load(text: str, read_at: float) -> dict[int, Load]:
    """Readings per data-parallel rank from a /metrics page (rank 0 when unlabelled).

    Only the few samples above are read, by their names at the start of a line: a full
    parse of vLLM's page (about 50 KB of histograms) would build every sample on it, per
    instance and scrape, to read a few. Lines that do not parse, or are longer than
    `_MAX_SAMPLE_LINE`, are skipped."""
    values: dict[int, dict[str, float]] = {}
    for line in _lines_starting(text, "vllm:", _MAX_SAMPLE_LINE):
        if not line.startswith(_PREFIXES):
            continue
        sample = _SAMPLE.fullmatch(line)
        if sample is None:
            continue
        name, labels, value = sample.groups()
        field = _SAMPLES.get(name)
        if field is None:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        engine = next((label for key, label in _LABEL.findall(labels or "")
                       if key == "engine"), "0")
        rank = int(engine) if engine.isdigit() else 0
        per_rank = values.setdefault(rank, {})
        per_rank[field] = per_rank.get(field, 0.0) + number
    return {rank: Load(read_at=read_at, **fields) for rank, fields in values.items()}


def _lines_starting(text: str, prefix: str, max_length: int) -> Iterator[str]:
    """The lines of `text` (ended by "\\n", as the format says) that start with `prefix`
    and are at most `max_length` characters long.

    Found with `str.find`, so the other lines cost no Python step and no string each:
    `splitlines()` of a 4 MiB page of empty lines would hold 4 million strings (~250 MB)."""
    needle = "\n" + prefix

    def after(newline: int) -> int:  # where the line after a found needle starts; -1: none
        return newline + 1 if newline >= 0 else -1

    start = 0 if text.startswith(prefix) else after(text.find(needle))
    while start >= 0:
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        if end - start <= max_length:
            yield text[start:end]
        start = after(text.find(needle, end))


class LoadMonitor:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, *,
                 interval: float = 1.0, stale_after: float = 3.0,
                 overload_kv_usage: float = 1.0) -> None:
        self._registry = registry
        self._client = client
        self.interval = interval
        self._max_age = interval * stale_after
        self._loads: dict[WorkerKey, Load] = {}
        # The last reading of each worker, kept through failed scrapes (`last`).
        self._last: dict[WorkerKey, Load] = {}
        self._typical: tuple[float | None, float | None] = (None, None)
        # Workers whose reading shows work (running or waiting) or a KV cache at the
        # overload limit: every other worker's reading costs it nothing (`busy`).
        self._overload_kv_usage = overload_kv_usage
        self._busy: set[WorkerKey] = set()
        self._failures: dict[str, str] = {}  # instance id -> why its last scrape failed
        # Instance id -> (when to scrape it again, the delay that gave, failures in a row),
        # while it fails.
        self._retry: dict[str, tuple[float, float, int]] = {}
        self._task: asyncio.Task[None] | None = None
        # Instances that joined since the round began, read before the next (`_joined`).
        self._arrivals: dict[str, Instance] = {}
        self._arrived = asyncio.Event()

    def get(self, worker_key: WorkerKey) -> Load | None:
        load = self._loads.get(worker_key)
        if load is None or time.monotonic() - load.read_at > self._max_age:
            return None
        return load

    def last(self, worker_key: WorkerKey) -> Load | None:
        """The worker's last reading however old, kept after failed scrapes until the worker
        leaves: what it says of the past (when it was taken, how long requests took) stays
        true when its gauges are no longer current. A busy engine can miss the scrape's
        deadline; answers sent to it then still end when its requests typically do, rather
        than count for `stale_after` intervals and send everything elsewhere."""
        return self._last.get(worker_key)

    def typical(self) -> tuple[float | None, float | None]:
        """The median over the workers' last readings of (`ttft_seconds`,
        `request_seconds`), each None when no reading says it; renewed every round."""
        return self._typical

    def busy(self) -> set[WorkerKey]:
        """A superset of the workers whose reading adds to their cost or overloads them
        (the set itself, not a copy: do not change it)."""
        return self._busy

    def failure(self, instance_id: str) -> str | None:
        """Why the instance's last scrape failed (no body text in it); None once one
        succeeds, and before the first."""
        return self._failures.get(instance_id)

    def start(self) -> None:
        self._registry.instance_listeners.append(self._joined)
        self._task = asyncio.create_task(self._run(), name="load monitor")

    async def stop(self) -> None:
        if self._joined in self._registry.instance_listeners:
            self._registry.instance_listeners.remove(self._joined)
        await cancel_and_wait(self._task)
        self._task = None

    def _joined(self, instance: Instance, joined: bool) -> None:
        """An instance (or its workers) just joined: read at once, not at the next round
        (an instance without a `url` has no /metrics to read)."""
        if joined and instance.url and instance.workers:
            self._arrivals[instance.id] = instance
            self._arrived.set()

    async def scrape_once(self) -> None:
        now = time.monotonic()
        instances = [i for i in self._registry if i.url and i.workers
                     and (i.id not in self._retry or self._retry[i.id][0] <= now)]
        await asyncio.gather(*(self._scrape(instance) for instance in instances))
        known = {worker.key for worker in self._registry.workers()}
        for key in [key for key in self._loads if key not in known]:
            del self._loads[key]
        for key in [key for key in self._last if key not in known]:
            del self._last[key]
        self._typical = (
            _median([r.ttft_seconds for r in self._last.values() if r.ttft_seconds is not None]),
            _median([r.request_seconds for r in self._last.values()
                     if r.request_seconds is not None]))
        self._busy.intersection_update(self._loads)
        for instance_id in [i for i in self._failures if i not in self._registry]:
            del self._failures[instance_id]
            self._retry.pop(instance_id, None)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            self._arrivals.clear()
            await self.scrape_once()
            # Until the next round, instances that join are read as they come, for how long
            # their requests take: without it a route mode answer sent to one counts for
            # `stale_after` intervals, and on two real engines at four clients a run's first
            # second of answers piled up there and moved chat sessions off their holders.
            # Their gauges count from the round: a first reading cannot tell an idle
            # engine's leftover gauges from work (see above).
            while (left := self.interval - (time.monotonic() - started)) > 0:
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    break
                self._arrived.clear()
                arrivals, self._arrivals = self._arrivals, {}
                await asyncio.gather(*(self._scrape(instance, past_only=True)
                                       for instance in arrivals.values()
                                       if instance.id in self._registry))

    async def _scrape(self, instance: Instance, *, past_only: bool = False) -> None:
        """Read the instance's /metrics into its workers' readings; `past_only`: into their
        last readings alone (`last`), not the current ones (`get`)."""
        sent = time.monotonic()  # the reading shows every request the instance had by then
        try:
            answer = await fetch(self._client, "GET", url_at(instance.url, "/metrics"),
                                 max_bytes=METRICS_MAX_BYTES, deadline=max(0.2, self.interval))
        except UpstreamError as exc:
            self._failed(instance, str(exc))
            return
        if answer.status != 200:
            self._failed(instance, f"GET /metrics answered HTTP {answer.status}")
            return
        try:
            # Off the event loop: see the module's invariants.
            readings = await asyncio.to_thread(_read_page, answer.body, sent)
        except ValueError:  # int() of an engine label of thousands of digits
            self._failed(instance, "GET /metrics: a page that does not parse")
            return
        if self._failures.pop(instance.id, None) is not None:
            log.info("instance %s: load read again", instance.id)
        self._retry.pop(instance.id, None)
        for worker in instance.workers:
            reading = readings.get(worker.endpoint.dp_rank)
            if reading is None:
                self._loads.pop(worker.key, None)
                self._last.pop(worker.key, None)
                continue
            previous = self._last.get(worker.key)
            since = reading.read_at
            if previous is not None and reading.work is not None and reading.work == previous.work:
                since = previous.work_since
            reading = replace(reading, work_since=since, ttft_seconds=_recent_mean(
                reading.ttft_sum, reading.ttft_count,
                previous.ttft_sum if previous else None,
                previous.ttft_count if previous else None,
                previous.ttft_seconds if previous else None,
            ), request_seconds=_recent_mean(
                reading.e2e_sum, reading.e2e_count,
                previous.e2e_sum if previous else None,
                previous.e2e_count if previous else None,
                previous.request_seconds if previous else None,
            ))
            if reading.read_at - since >= 2 * self.interval:
                # No step for that long: the gauges are the last step's leftovers. KV usage
                # counts the blocks of running requests, so none are used now; a leftover
                # usage at the overload limit would keep the idle worker skipped until
                # some other worker overloads too.
                reading = replace(reading, running=0.0, waiting=0.0, kv_usage=0.0)
            self._last[worker.key] = reading
            if past_only:
                continue
            self._loads[worker.key] = reading
            if (reading.running or reading.waiting
                    or reading.kv_usage >= self._overload_kv_usage):
                self._busy.add(worker.key)
            else:
                self._busy.discard(worker.key)

    def _failed(self, instance: Instance, reason: str) -> None:
        """No reading: the policy falls back to what kvroute knows itself (its in-flight
        count). Said once when an instance starts failing, not every interval."""
        if instance.id not in self._failures:
            log.warning("instance %s: load not read (%s); routing without its metrics until "
                        "a scrape succeeds", instance.id, reason)
        self._failures[instance.id] = reason
        _, delay, failures = self._retry.get(instance.id, (0.0, 0.0, 0))
        failures += 1
        delay = (self.interval if failures <= PATIENT_FAILURES
                 else min(FAILED_SCRAPE_BACKOFF, max(self.interval, 2 * delay)))
        self._retry[instance.id] = (time.monotonic() + delay, delay, failures)
        for worker in instance.workers:
            self._loads.pop(worker.key, None)


def _read_page(body: bytes, read_at: float) -> dict[int, Load]:
    # latin-1 decodes any bytes one to one, at C speed and one byte per character (UTF-8
    # could take four); the names and numbers read are ASCII.
    return parse_load(body.decode("latin-1"), read_at)
