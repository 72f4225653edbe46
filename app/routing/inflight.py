"""The proxy's own requests in flight, per worker, as work the engine still has to do.

Ownership and invariants:

- The proxy opens a `Ticket` for a request before it connects to the worker and holds it
  until the response has ended (the Endpoint Picker, app.epp.stream, from its answer until the
  gateway's stream for the request ends), however it ends (complete, client gone, upstream error,
  cancellation anywhere in the ASGI server). `Ticket.close()` is idempotent and never
  awaits, so a `finally` that calls it first cannot be interrupted before it has run:
  every opened ticket is closed exactly once, and a worker with nothing open has no entry.
- A ticket carries the prompt tokens the chosen worker must compute (its uncached prefill,
  in tokens, as priced when it was chosen). They count as *queued prefill* until the first
  byte of the answer arrives (`started()`): for a streamed answer that is the first token,
  so the prefill is done; a non-streamed answer arrives whole, so its prefill counts until
  the end. After that the request counts only as *running* (decode pressure).
- In route mode kvroute never sees a request end. `RecentAnswers` counts each answer as a
  ticket until a reading of the instance's /metrics taken after it (which then shows the
  request itself), until the engine's recent mean request time has passed (it has most
  likely ended), or until `max_age`, whichever comes first; its prefill counts as queued
  until the engine's recent mean time to first token has passed. Without those means,
  answers counted for a whole scrape interval on engines that finish a request in far less:
  at one client, 16 answers each on two workers that each ran one request. It also keeps, per
  worker, a moving mean of the uncached prefill its answers named (`typical_prefill`):
  what a request the metrics show waiting there is likely to cost. At most
  `TYPICAL_WORKERS` workers are kept, the least recently answered forgotten first.
- Nothing here reads a clock or does I/O: times are passed in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvroute.app.workers import WorkerKey

__all__ = ["InFlight", "RecentAnswers", "Ticket", "WorkerLoad"]

# How many workers' typical prefill `RecentAnswers` remembers (a bound on its memory
# whatever the churn of instances), and how much one answer moves the mean.
TYPICAL_WORKERS = 65_536
TYPICAL_WEIGHT = 0.125



@dataclass(slots=True)  # a value, not frozen: see routing.WorkerView
class WorkerLoad:
    """What the proxy's own open requests ask of one worker."""

    requests: int = 0
    queued_prefill_tokens: int = 0


class Ticket:
    """One forwarded request; see the module invariants."""

    __slots__ = ("_ledger", "key", "prefill_tokens", "_prefilling", "_open")

    def __init__(self, ledger: InFlight, key: WorkerKey, prefill_tokens: int) -> None:
        self._ledger = ledger
        self.key = key
        self.prefill_tokens = prefill_tokens
        self._prefilling = True
        self._open = True

    @property
    def is_open(self) -> bool:
        return self._open

    def started(self) -> None:
        """The first byte of the answer arrived: the prefill is no longer queued."""
        if self._open and self._prefilling:
            self._prefilling = False
            self._ledger._add(self.key, 0, -self.prefill_tokens)

    def move_to(self, key: WorkerKey) -> Ticket:
        """The request was served by another worker than the one it was counted on: this
        ticket closes and one for `key` opens in the same state (prefill queued or not).
        Never awaits. A closed ticket moves nowhere: it is returned as it is."""
        if not self._open or key == self.key:
            return self
        moved = self._ledger.open(key, self.prefill_tokens)
        if not self._prefilling:
            moved.started()
        self.close()
        return moved

    def close(self) -> None:
        """The response ended. Idempotent; never awaits."""
        if not self._open:
            return
        self._open = False
        queued = self.prefill_tokens if self._prefilling else 0
        self._prefilling = False
        self._ledger._add(self.key, -1, -queued)


class InFlight:
    """Per worker: open tickets and the prefill tokens queued among them."""

    __slots__ = ("_requests", "_queued")

    def __init__(self) -> None:
        self._requests: dict[WorkerKey, int] = {}
        self._queued: dict[WorkerKey, int] = {}

    def open(self, key: WorkerKey, prefill_tokens: int = 0) -> Ticket:
        ticket = Ticket(self, key, max(0, prefill_tokens))
        self._add(key, 1, ticket.prefill_tokens)
        return ticket

    def get(self, key: WorkerKey) -> WorkerLoad:
        return WorkerLoad(self._requests.get(key, 0), self._queued.get(key, 0))

    def total(self) -> int:
        return sum(self._requests.values())

    def workers(self) -> list[WorkerKey]:
        """The workers with at least one open request (a copy)."""
        return list(self._requests)

    def __len__(self) -> int:
        """Workers with at least one open request."""
        return len(self._requests)

    def _add(self, key: WorkerKey, requests: int, queued: int) -> None:
        count = self._requests.get(key, 0) + requests
        tokens = self._queued.get(key, 0) + queued
        if count < 0 or tokens < 0:  # a bug in the callers: say so, never go negative
            raise AssertionError(f"in-flight accounting for {key} went negative")
        if count == 0:
            self._requests.pop(key, None)
            self._queued.pop(key, None)
            return
        self._requests[key] = count
        if tokens:
            self._queued[key] = tokens
        else:
            self._queued.pop(key, None)


class Reading(Protocol):
    """What `RecentAnswers` reads of a worker's last /metrics reading (app.routing.load.Load)."""

    @property
    def read_at(self) -> float: ...  # when it was taken
    @property
    def ttft_seconds(self) -> float | None: ...  # the engine's recent means; None: unknown
    @property
    def request_seconds(self) -> float | None: ...


class RecentAnswers:
    """Route-mode answers as tickets of their own ledger, until the instance's metrics cover
    them or they have most likely ended. Kept apart from the proxy's tickets: an answer may
    never be followed.

    Per worker, the open answers are in two queues, each oldest first: those whose prefill
    still counts, and before them (all older) those whose prefill has started."""

    __slots__ = ("_ledger", "_max_age", "_margin", "_open", "_typical")

    def __init__(self, max_age: float, margin: float = 0.05) -> None:
        self._ledger = InFlight()
        self._max_age = max_age
        # A caller forwards the request a moment after the answer; a reading taken within
        # this margin of the answer may not show it yet.
        self._margin = margin
        # worker -> (answers whose prefill started, answers whose prefill counts)
        self._open: dict[WorkerKey, tuple[deque[tuple[float, Ticket]],
                                          deque[tuple[float, Ticket]]]] = {}
        self._typical: OrderedDict[WorkerKey, float] = OrderedDict()

    def get(self, key: WorkerKey) -> WorkerLoad:
        return self._ledger.get(key)

    def typical_prefill(self, key: WorkerKey) -> float | None:
        """The moving mean of the uncached tokens of the answers naming this worker; None
        when none is remembered."""
        return self._typical.get(key)

    def workers(self) -> list[WorkerKey]:
        """The workers with at least one answer counted (a copy)."""
        return self._ledger.workers()

    def add(self, key: WorkerKey, prefill_tokens: int, now: float) -> None:
        ticket = self._ledger.open(key, prefill_tokens)
        self._open.setdefault(key, (deque(), deque()))[1].append((now, ticket))
        mean = self._typical.pop(key, None)
        self._typical[key] = (ticket.prefill_tokens if mean is None
                              else mean + TYPICAL_WEIGHT * (ticket.prefill_tokens - mean))
        if len(self._typical) > TYPICAL_WORKERS:
            self._typical.popitem(last=False)

    def settle(self, now: float, reading_of: Callable[[WorkerKey], Reading | None],
               typical: tuple[float | None, float | None] = (None, None)) -> None:
        """Close the answers that a later metrics reading covers, that lasted the engine's
        recent mean request time or that are too old, and stop counting the prefill of
        those that lasted its mean time to first token; `reading_of(key)` is the worker's
        last reading, if any. A worker whose reading says neither time uses `typical`
        (time to first token, request time) of the fleet's engines instead: an engine
        whose first scrapes failed under load had its answers counted for `max_age` while
        the others' ended, and lost every prefix it held."""
        margin = self._margin
        for key in list(self._open):
            started, prefilling = self._open[key]
            reading = reading_of(key)
            # an answer at or before `ended` has ended, or shows in the reading
            ended = now - self._max_age
            ttft, request = typical
            if reading is not None:
                ended = max(ended, reading.read_at - margin)
                if reading.request_seconds is not None:
                    ttft, request = reading.ttft_seconds, reading.request_seconds
            if request is not None:
                ended = max(ended, now - margin - request)
            first_token = None if ttft is None else now - margin - ttft
            for answers in (started, prefilling):  # oldest first
                while answers and answers[0][0] <= ended:
                    answers.popleft()[1].close()
            while first_token is not None and prefilling and prefilling[0][0] <= first_token:
                answer = prefilling.popleft()
                answer[1].started()
                started.append(answer)
            if not started and not prefilling:
                del self._open[key]
