"""How late the event loop runs: a task that asks to wake every ``interval`` seconds and
records how much later than asked it woke.

A late wake-up is a stretch in which the loop ran something else without yielding (a long
batch, a big decode, a slow scrape): every HTTP answer waiting meanwhile was that late too.
Exported as the histogram ``kvroute_event_loop_lag_seconds`` and the gauge
``kvroute_event_loop_lag_worst_seconds`` (the worst since start). The cost is one wake-up
per ``interval`` (100 a second by default): too little to matter beside the loop's work.

Invariant: a lag is measured only between two wake-ups of the monitor itself, so what it
reports is a lower bound of the longest stretch the loop did not yield (a stretch that
begins just after a wake-up is seen whole; one beginning earlier, minus what was waited).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Gauge, Histogram

from kvroute.app.tasks import cancel_and_wait

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class LoopLagMonitor:
    """Measures the running loop's lag once started; ``stop`` ends the task."""

    def __init__(self, registry: CollectorRegistry, interval: float = 0.01) -> None:
        self.interval = interval
        self.worst = 0.0
        self._histogram = Histogram(
            "kvroute_event_loop_lag_seconds",
            "how much later than asked a periodic wake-up of the event loop ran",
            registry=registry, buckets=_BUCKETS)
        self._worst = Gauge("kvroute_event_loop_lag_worst_seconds",
                            "the longest event-loop lag seen since start", registry=registry)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        interval = self.interval
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(interval)
            lag = max(0.0, time.perf_counter() - asked - interval)
            self._histogram.observe(lag)
            if lag > self.worst:
                self.worst = lag
                self._worst.set(lag)
