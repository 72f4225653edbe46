"""Recent demand per worker: the prompts of the distinct prefixes kvroute sent there lately.

A tie between equally cheap workers (a new prefix nobody holds, on an idle fleet) used to be
broken by rendezvous hashing alone. Over a few long-lived prefixes (chat sessions, each
growing with every turn) that splits the demand unevenly by chance: on two real engines at
one client, one took 115k prompt tokens of chats and the other 54k, and the fuller one
evicted the sessions it held. So before the hash, a tie between workers that carry no
load drops those whose recent demand is clearly above the least (`routing.TieBreaker`):
the cache each one must hold follows the prompts sent there. (A tie between loaded
workers is left to the hash: see app.routing.cost.)

Demand estimates what a worker's cache must hold, not how busy it is: per prefix (a prompt's
first block, the tie's key) only the latest prompt sent there counts, so a hot prefix asked
a thousand times weighs one prompt, and a chat session weighs its conversation so far. (So a
burst of one new prefix, a thousand times the same tie, stays on the worker it went to.)

Invariants:

- A worker's demand is the sum over the prefixes routed to it of the length of the latest
  prompt sent with each, that prompt decaying by half every `HALF_LIFE` seconds since it
  was sent: a prefix no longer asked for fades. Probes add nothing.
- A (worker, prefix) pair is forgotten, along with what it added, once its prompt is
  `FORGET_AFTER` half-lives old (it adds less than 0.4% of its tokens then), or when more
  than `PREFIXES` pairs are remembered, the least recently routed first: memory is bounded
  whatever the traffic (about 20 MB at the bound: 260 B a pair and its 16-byte key).
- Each replica counts the routes it answered itself. Behind a balancer replicas see alike
  shares of the traffic, so their ties mostly agree; when they do not, a new prefix may be
  computed on two workers instead of one, which its next requests then settle.
- Nothing here reads a clock or does I/O: times are passed in.
"""

from __future__ import annotations

from collections import OrderedDict

from kvroute.app.workers import WorkerKey

__all__ = ["HALF_LIFE", "RecentDemand"]

# Long enough to span a chat session's turns at a few requests a second, short enough that
# a session over for a minute has mostly faded.
HALF_LIFE = 10.0
FORGET_AFTER = 8  # half-lives
PREFIXES = 65_536


class RecentDemand:
    """Decayed prompt tokens of the prefixes routed to each worker; see the module."""

    __slots__ = ("_prompts", "_workers", "_half_life", "_limit")

    def __init__(self, half_life: float = HALF_LIFE, limit: int = PREFIXES) -> None:
        # per (worker, prefix): (latest prompt's tokens, when it was sent)
        self._prompts: OrderedDict[tuple[WorkerKey, bytes], tuple[int, float]] = OrderedDict()
        # per worker: [sum of its prompts decayed to `at`, at, how many prompts]
        self._workers: dict[WorkerKey, list[float]] = {}
        self._half_life = half_life
        self._limit = limit

    def add(self, key: WorkerKey, prefix: bytes, tokens: int, now: float) -> None:
        """A route chose `key` at `now` for a prompt of `tokens` tokens whose first block
        is `prefix`: it replaces the prompt sent there with that prefix before."""
        self._take((key, prefix), now)
        self._prompts[(key, prefix)] = (tokens, now)
        entry = self._workers.get(key)
        if entry is None:
            self._workers[key] = [float(tokens), now, 1]
        else:
            entry[0] = self._decayed(entry[0], entry[1], now) + tokens
            entry[1] = now
            entry[2] += 1
        # Oldest first: every add moves its pair to the end, and `now` never goes back.
        horizon = now - FORGET_AFTER * self._half_life
        while self._prompts:
            oldest = next(iter(self._prompts))
            if len(self._prompts) <= self._limit and self._prompts[oldest][1] > horizon:
                break
            self._take(oldest, now)

    def of(self, key: WorkerKey, now: float) -> float:
        """`key`'s demand at `now` (0.0 for a worker nothing was routed to lately)."""
        entry = self._workers.get(key)
        return 0.0 if entry is None else self._decayed(entry[0], entry[1], now)

    def workers(self) -> list[WorkerKey]:
        """The workers some prefix was routed to lately (a copy)."""
        return list(self._workers)

    def latest(self, key: WorkerKey, prefix: bytes, now: float) -> float:
        """What the prompt last sent to `key` with `prefix` adds to its demand at `now` (0.0
        when none is remembered): `of` less this is what other prefixes ask of its cache."""
        prompt = self._prompts.get((key, prefix))
        return 0.0 if prompt is None else self._decayed(prompt[0], prompt[1], now)

    def _take(self, pair: tuple[WorkerKey, bytes], now: float) -> None:
        """Forget one remembered prompt and what it adds to its worker's sum."""
        prompt = self._prompts.pop(pair, None)
        if prompt is None:
            return
        entry = self._workers[pair[0]]
        entry[2] -= 1
        if not entry[2]:
            del self._workers[pair[0]]
            return
        left = self._decayed(entry[0], entry[1], now) - self._decayed(prompt[0], prompt[1], now)
        entry[0], entry[1] = max(left, 0.0), now  # rounding never leaves it negative

    def _decayed(self, tokens: float, at: float, now: float) -> float:
        return tokens * 0.5 ** (max(now - at, 0.0) / self._half_life)
