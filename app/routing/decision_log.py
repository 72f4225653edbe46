"""The decision log: what each route weighed, what it chose, and what the engine then cached.

Off by default (`decision_log = 0`); with `decision_log = N` kvroute keeps the last N
decisions of `Service.decide` (routes, proxied requests, the Endpoint Picker's picks) and
serves them at `GET /v1/decisions`, oldest first. A bad run can then be replayed decision by
decision: the prompt's prefix key (the digest of its first block, the key `app.routing.demand` and
the tie-break use), every weighed worker's cost terms and load readings, the choice, and,
for requests the proxy relayed, the cached tokens vLLM reported in the answer's usage.

Invariants:

- Memory is bounded: at most `capacity` entries, the oldest dropped first; an entry holds
  at most `LOGGED_SCORES` of the scores its decision shows, cheapest first (a route asking
  for `all_scores` over a large fleet logs no more), never the prompt's tokens.
- Ids count up from 1 in the order decisions were made; `since` reads only newer ones, so
  a poller misses nothing that is still kept.
- An outcome is recorded at most once per entry, and only while the entry is kept; a route
  answered by `POST /v1/route` has none (the caller, not kvroute, hears the engine).
- Nothing here reads a clock or does I/O: times are passed in.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from kvroute.app.api.answers import LoggedChoice, LoggedDecision, LoggedScore
from kvroute.app.config import MAX_DECISION_LOG
from kvroute.app.routing.cost import Score

__all__ = ["LOGGED_SCORES", "DecisionLog"]

# The most weighed workers one entry keeps (the chosen one is always named in `chosen`).
LOGGED_SCORES = 8


def _score(score: Score) -> LoggedScore:
    load = score.load
    return LoggedScore(
        instance=score.instance, dp_rank=score.dp_rank, matched_tokens=score.matched_tokens,
        pending_blocks=score.pending_blocks, cost=round(score.cost, 1),
        prefill=round(score.prefill_cost, 1), copy=round(score.copy_cost, 1),
        crowding=round(score.crowding_cost, 1), queue=round(score.queue_cost, 1),
        queued_prefill=round(score.queued_prefill), running=score.running,
        inflight=load.inflight, answered=load.answered, metrics_running=load.running,
        metrics_waiting=load.waiting, recent_demand=load.recent_demand,
        overloaded=score.overloaded)


class DecisionLog:
    """The last `capacity` decisions (see the module)."""

    __slots__ = ("capacity", "_entries", "_by_id", "_last_id")

    def __init__(self, capacity: int) -> None:
        if not 0 < capacity <= MAX_DECISION_LOG:
            raise ValueError(f"decision log capacity must be in 1..{MAX_DECISION_LOG}")
        self.capacity = capacity
        self._entries: deque[LoggedDecision] = deque(maxlen=capacity)
        self._by_id: dict[int, LoggedDecision] = {}
        self._last_id = 0

    def record(self, *, at: float, mode: str, prefix: bytes, prompt_tokens: int | None,
               chosen: Score, scores: list[Score], eligible: int) -> int:
        """Keep one decision made at `at` (seconds on the service's clock); its id."""
        self._last_id += 1
        if len(self._entries) == self.capacity:
            del self._by_id[self._entries[0].id]
        entry = LoggedDecision(
            id=self._last_id, at=round(at, 4), mode=mode, prefix=prefix.hex()[:16],
            prompt_tokens=prompt_tokens,
            chosen=LoggedChoice(chosen.instance, chosen.dp_rank, chosen.matched_tokens),
            eligible_workers=eligible,
            scores=[_score(score) for score in islice(scores, LOGGED_SCORES)])
        self._entries.append(entry)
        self._by_id[self._last_id] = entry
        return self._last_id

    def outcome(self, entry_id: int, cached_tokens: int) -> None:
        """What the engine reported cached for decision `entry_id` (ignored once dropped)."""
        entry = self._by_id.get(entry_id)
        if entry is not None and entry.cached_tokens is None:
            entry.cached_tokens = cached_tokens

    def entries(self, since: int = 0, limit: int | None = None) -> list[LoggedDecision]:
        """Kept entries with an id above `since`, oldest first, at most `limit` of them."""
        if not self._entries:
            return []
        # Ids are consecutive: the first one above `since` is found by its offset.
        start = max(since - self._entries[0].id + 1, 0)
        return list(islice(self._entries, start, None if limit is None else start + limit))

    def __len__(self) -> int:
        return len(self._entries)
