"""Routing decisions as the dashboard shows them: how many, how long, which worker each chose.

The service records every decision here (`Service.decide`); `GET /v1/dashboard` reads it.
Invariants: its counts only grow; it keeps at most `RECENT` latencies and one count per
worker ever chosen, and `forget` drops those of workers no longer followed.
"""

from __future__ import annotations

import statistics
from collections import deque

from kvroute.app.workers import WorkerKey

__all__ = ["RECENT", "RouteActivity"]

RECENT = 512  # decisions whose latency the percentiles are taken over


class RouteActivity:
    """Routing decisions: how many, how long, and which worker each chose."""

    def __init__(self) -> None:
        self.decisions = 0
        self.routed = 0
        self.seconds = 0.0
        self.per_worker: dict[WorkerKey, int] = {}
        self._recent: deque[float] = deque(maxlen=RECENT)

    def decided(self, key: WorkerKey, seconds: float, probe: bool) -> None:
        self.decisions += 1
        self.seconds += seconds
        self._recent.append(seconds)
        if not probe:  # a probe is a question; nothing is sent there
            self.routed += 1
            self.per_worker[key] = self.per_worker.get(key, 0) + 1

    def percentiles_ms(self) -> tuple[float | None, float | None]:
        """The median and 99th percentile of the recent decisions, in milliseconds."""
        if not self._recent:
            return None, None
        if len(self._recent) == 1:
            only = self._recent[0] * 1000
            return only, only
        cuts = statistics.quantiles(self._recent, n=100, method="inclusive")
        return cuts[49] * 1000, cuts[98] * 1000

    def forget(self, keys: set[WorkerKey]) -> None:
        for key in set(self.per_worker) - keys:
            del self.per_worker[key]
