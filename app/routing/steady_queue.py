"""The queue a route weighs: each worker's queue cost, no higher than its recent average.

Why: a prefix moves off the worker that holds it when that worker's queue costs more than
the prefill it saves plus the copy it makes (app.routing.cost). Under concurrent clients the
queues swing from one engine to the other and back within a second or two (a burst of
requests that happen to share the prefixes one engine holds; the start of a run, when every
client's first request arrives at once). Priced as they stood at that instant, those swings
moved hot prefixes onto the other engine, which then held a second copy of them, evicted
its own prefixes to make room, and sent their requests away in turn: on two real engines at
16 and 32 clients, a run with one such move lost 3-5 points of hit rate against a static
partition, and one with several 5-14 (docs/decisions.md, "Routing under concurrent
clients"). A queue that lasts is a reason to move a prefix; a swing is not.

So the queue cost of a worker that holds part of the prompt, or that the prompt's prefix
was sent to lately (its home: under the same pressure a holder evicts its prefixes, and a
prefix evicted from its home was then placed anew by the queues of the moment), counts at
most its exponentially weighted average over the last `WINDOW` seconds. A swing shorter
than the window weighs a fraction of its height, a queue that stays weighs in full once the
window has passed, and a queue that drains counts at once (the smaller of the two). The
other workers' queues count as they stand: for a prefix new to the fleet, spreading a burst
by the queues of the moment is what keeps new prefixes apart (app.routing.cost).

Invariants:

- The average treats each worker's queue as constant between observations: `observe` is
  called at every route for every weighed worker that carries load, and `settle` records 0
  for the weighed workers that stopped carrying load, so a worker's average never keeps a
  queue it lost. Workers a route did not weigh (another model's) keep theirs.
- A worker's entry is dropped once its queue is 0 and its average below `FORGOTTEN`: memory
  follows the workers that carried load lately, not the fleet.
- Nothing here reads a clock or does I/O: times are passed in, and never go back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvroute.app.workers import WorkerKey

__all__ = ["FORGOTTEN", "WINDOW", "SteadyQueue"]

# Longer than a request's life under load (a swing passes within it), short enough that a
# worker that stays busier than the others sheds its prefixes within a window or two.
WINDOW = 10.0
# An average below this many prefill tokens is no queue at all.
FORGOTTEN = 1.0


class SteadyQueue:
    """Per worker, the exponentially weighted average of its queue cost (see the module)."""

    __slots__ = ("_window", "_workers")

    def __init__(self, window: float = WINDOW) -> None:
        self._window = window
        # per worker: [average, the queue cost since `at`, at]
        self._workers: dict[WorkerKey, list[float]] = {}

    def observe(self, key: WorkerKey, queue_cost: float, now: float) -> float:
        """`key`'s queue cost is `queue_cost` from `now` on; the cost a route weighs: the
        smaller of it and the average up to `now`."""
        entry = self._workers.get(key)
        if entry is None:
            if queue_cost <= 0:
                return 0.0
            self._workers[key] = [0.0, queue_cost, now]
            return 0.0
        average = self._advance(entry, now)
        entry[1] = queue_cost
        return min(queue_cost, average)

    def settle(self, idle: Callable[[WorkerKey], bool], now: float) -> None:
        """Every worker for which `idle` says so carries no load from `now` on."""
        for key in [key for key in self._workers if idle(key)]:
            entry = self._workers[key]
            average = self._advance(entry, now)
            entry[1] = 0.0
            if average < FORGOTTEN:
                del self._workers[key]

    def average(self, key: WorkerKey, now: float) -> float:
        """`key`'s average queue cost at `now` (0.0 for a worker that carried none lately)."""
        entry = self._workers.get(key)
        if entry is None:
            return 0.0
        average, held, at = entry
        return held + (average - held) * math.exp(-max(now - at, 0.0) / self._window)

    def __len__(self) -> int:
        return len(self._workers)

    def _advance(self, entry: list[float], now: float) -> float:
        average, held, at = entry
        if now > at:
            average = held + (average - held) * math.exp(-(now - at) / self._window)
            entry[0], entry[2] = average, now
        return entry[0]
