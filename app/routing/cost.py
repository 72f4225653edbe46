"""Choosing a worker: cache reuse weighed against queued work.

Each eligible worker gets a cost in *prefill tokens*, the unit an engine spends:

    prefill = miss_token * uncached tokens of this prompt
            + cpu_hit_token * tokens whose fastest cached tier is CPU
            + storage_hit_token * tokens whose fastest cached tier is STORAGE
              (tokens cached on GPU cost nothing)
    copy    = copied_token * uncached tokens of this prompt that another eligible
              worker holds
    crowding = crowded_token * uncached tokens of this prompt
              * (others - least others) / others, between workers that carry load
              and those that hold prefixes lately, once one of them carries load
              (others: the prompts of other prefixes sent there lately, `app.routing.demand`)
    queue   = queued_prefill_token * prefill tokens queued ahead of it
            + running_request * requests running there (decode pressure)
    cost    = prefill + copy + crowding + queue

So "the prefix is cached on the busy worker" and "the idle worker must compute the
whole prompt" are compared in the same unit. (The service weighs the queue term of a
prompt's holders and of its prefix's recent home at no more than its recent average:
`app.routing.steady_queue`.) A queued token weighs less than a token to
compute (a quarter by default) because the two are not the same price: the wait for the
busy worker is paid once, by this request, while computing the prefix on another worker
also stores a second copy of it there, evicting other prefixes whose next requests then
miss. Priced one for one, each request decides for its own first token alone, copies of
hot prefixes crowd the caches, and under concurrent traffic the fleet loses both hits
and time to first token (benchmarks/hitrate.py --clients shows it). So the busy worker
keeps its prefix until the work queued ahead of it is several times the prefill it saves.
The `copy` term prices that second copy where it is made: computing tokens another
worker already holds takes as much cache space from other prefixes, whose next requests
miss. A held prefix moves only when its holder's queue outweighs twice what it saves.
(Measured on two real CPU engines with 16 concurrent clients sharing six system prompts,
route mode: without it a prefix moved 3 to 13 times a run and each move evicted another;
with it, most runs moved none and matched a static partition's hit rate.)
The `crowding` term prices the cache space of a prompt nobody holds, and of the uncached
part of any prompt, where it is stored: a worker that must already hold more prefixes
than another evicts sooner. `others` is a worker's recent demand (`app.routing.demand`: the latest
prompt of each prefix sent there, fading) without this prompt's own prefix, so a prefix
that its holder evicted under load goes back where it was sent lately instead of joining
another worker's set; and a burst of new prefixes lands where fewer others are held, not
by a coincidence of the queues. (Same bench: without it, the queues alone placed six cold
system prompts four to two in 2 of 5 runs per mode, and prefixes evicted from their
holder under load moved to the other engine; each such run lost 10-15 points of hit rate.
Priced at one token per token, 1 run of 10 still did; at two, none of 18.)
It weighs between the workers that carry load and, beside them, the idle workers that were
sent prefixes lately (a worker idle for a moment still holds its prefixes: priced without
it, a prefix its busy home had evicted went to the idle worker, which then held one
prefix more than its share; docs/decisions.md, "Routing under concurrent clients"). When
no worker carries load it weighs nothing: between idle ones demand breaks the tie.

What kvroute knows of a worker's queue, and which of it counts:
- in proxy mode, exactly the requests it forwarded and has not seen end (`inflight`), each
  with its uncached tokens until the answer's first byte (`queued_prefill`); the caller
  leaves `running` and `waiting` unset;
- in route mode, the answers it gave in the last moments (`answered`: a caller follows
  them before the instance's /metrics can show them) and the instance's /metrics
  (`running`, `waiting`). A waiting request is priced at the uncached tokens kvroute's
  recent answers named for that worker on average (`waiting_prefill`): the requests a
  gateway sends there are mostly the ones kvroute chose there, so they share its cache
  as those answers did. Priced like this prompt's full length instead, a queue of
  requests that mostly hit the cache read as several times the work it is, and hot
  prefixes moved off their holder for nothing. With no answer remembered, this prompt's
  full length is the price (nothing says how much of it is cached). The larger of the
  two views counts, queued tokens and running requests each, so work seen both ways is
  not counted twice.
Queued prefill that computes this prompt's own prefix
(blocks the worker is only guessed to hold, because an answer just sent that prefix there)
is not counted against it: that work is done once, and this request reuses it. So a burst
of a cold prefix follows the first answer instead of spreading over the fleet.

A worker is *overloaded* when its waiting queue reaches `overload_waiting`; overloaded
workers are skipped unless every worker is. A KV cache at `overload_kv_usage` makes a
worker *saturated*, which only shedding reads (the Endpoint Picker's 429 when every
eligible worker is saturated), never the choice: vLLM fills its cache with running requests
and queues the rest, so a full cache is a busy engine, priced by its queue like any other.
(Skipped outright, a holder whose cache filled under a burst sent its own prefixes to a
worker that had to compute and cache them again; on two real engines at 16 clients that
cost 3-5 points of hit rate against a static partition.) The lowest cost wins. With an
idle fleet the lowest cost is simply the most matched tokens (block sizes differ between
instances; blocks are not comparable).

Equal costs between workers that carry no load go first to the workers that were sent
the fewest prompt tokens lately (`app.routing.demand`; a worker more than a quarter and more than
one prompt above the least drops out); then, and for every other tie, rendezvous
(highest-random-weight) hashing: each remaining worker weighs xxh3(the prompt's first
block, the worker's key), and the heaviest wins. The hash alone spreads different prefixes
evenly only in expectation: over a few long-lived prefixes (chat sessions, one client) it
split two real engines' demand 115k to 54k prompt tokens, and the fuller one evicted its
sessions. Between loaded workers a tie is a coincidence of their queues, and the hash keeps
each prefix's tie going one way: weighing demand there too took chats at 16 clients in route
mode from above the partition's hit rate to below it. Among
workers of alike demand, a cold prefix nobody holds lands on the same worker in every
kvroute replica, with no message exchanged (a burst of it through several replicas builds
one copy, not one per replica). The first block is the prompt's first `block size` tokens
at the smallest block size among the eligible workers (a worker's block size: its
match's, else its instance's as configured or discovered, the
same on every replica, else the one its events use), or the first block hash of a
block-hash query: requests that could share a cached block share the key; a worker
joining or leaving the tie moves only the prefixes it wins or won.
"""

from __future__ import annotations

import functools
import heapq
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

from xxhash import xxh3_64_intdigest, xxh3_128_digest

from kvroute.app.api.answers import CostTerms, LoadReadings, MediumCounts, WorkerScore
from kvroute.app.config import CostWeights
from kvroute.app.workers import WorkerKey
from kvroute.index import Match

__all__ = ["DEFAULT_BLOCK_SIZE", "CostWeights", "Score", "TieBreaker", "WorkerGroup",
           "WorkerView", "best_of", "choose", "copy_cost", "idle_cost", "prefill_cost",
           "ranked", "score_workers"]

MEDIA = ("GPU", "CPU", "STORAGE")
# The first block's length when no scored worker's block size is known: vLLM's default.
DEFAULT_BLOCK_SIZE = 16
# A tied worker that lately received more than this many times the prompt tokens of the
# least demanded one (and more than one prompt's worth above it) is left out of the tie.
DEMAND_SLACK = 1.25


# WorkerView and Score are values, never changed once made, but not frozen: a route makes
# several of each, and a frozen dataclass sets every field through object.__setattr__, a
# call per field on every one made.
@dataclass(slots=True)
class WorkerView:
    """What the policy knows of one eligible worker besides the index's match."""

    key: WorkerKey
    block_size: int | None
    state: str
    running: float | None = None  # None: no fresh reading of the instance's metrics
    waiting: float | None = None
    kv_usage: float | None = None
    inflight: int = 0  # requests kvroute's proxy forwarded and has not seen end
    answered: int = 0  # route answers naming it that its /metrics do not show yet
    queued_prefill: int = 0  # uncached prompt tokens of both, not yet computed
    waiting_prefill: float | None = None  # the price of one `waiting` request; None: unknown
    # prompt tokens routed there lately (app.routing.demand): breaks ties
    recent_demand: float = 0.0
    # recent_demand without this prompt's own prefix (None: the same), for `crowding`
    other_demand: float | None = None


@dataclass(slots=True)
class Score:
    instance: str
    dp_rank: int
    matched_blocks: int
    matched_tokens: int
    block_size: int | None
    by_medium: dict[str, int]
    state: str
    prefill_cost: float
    copy_cost: float
    queue_cost: float
    queued_prefill: float
    running: float
    overloaded: bool  # skipped unless every worker is
    load: LoadReadings
    pending_blocks: int = 0
    saturated: bool = False  # overloaded, or its KV cache at the limit: only shedding reads it
    crowding_cost: float = 0.0

    @property
    def cost(self) -> float:
        return self.prefill_cost + self.copy_cost + self.crowding_cost + self.queue_cost

    def answer(self) -> WorkerScore:
        """This score as the API shows it."""
        return WorkerScore(
            instance=self.instance,
            dp_rank=self.dp_rank,
            matched_blocks=self.matched_blocks,
            matched_tokens=self.matched_tokens,
            block_size=self.block_size,
            by_medium=MediumCounts(**self.by_medium),
            pending_blocks=self.pending_blocks,
            state=self.state,
            cost=round(self.cost, 3),
            cost_terms=CostTerms(prefill=round(self.prefill_cost, 3),
                                 copy=round(self.copy_cost, 3),
                                 crowding=round(self.crowding_cost, 3),
                                 queue=round(self.queue_cost, 3)),
            queued_prefill_tokens=self.queued_prefill,
            running_requests=self.running,
            overloaded=self.overloaded,
            load=self.load,
        )


def prefill_cost(weights: CostWeights, prompt_tokens: int, matched_tokens: int, cpu_blocks: int,
                 storage_blocks: int, block_size: int) -> float:
    """The prefill term of a cost: the prompt's tokens to compute, by tier."""
    return (weights.miss_token * max(prompt_tokens - matched_tokens, 0)
            + weights.cpu_hit_token * cpu_blocks * block_size
            + weights.storage_hit_token * storage_blocks * block_size)


def copy_cost(weights: CostWeights, prompt_tokens: int, matched_tokens: int,
              held_elsewhere: int) -> float:
    """The copy term of a cost: the prompt's tokens this worker would compute that another
    eligible worker holds (`held_elsewhere`: the most tokens of the prompt one holds)."""
    return weights.copied_token * max(min(held_elsewhere, prompt_tokens) - matched_tokens, 0)


def idle_cost(weights: CostWeights, prompt_tokens: int, matched_tokens: int, cpu_blocks: int,
              storage_blocks: int, block_size: int, held_elsewhere: int) -> float:
    """The cost of a worker with no load (its queue term is 0.0): `WorkerGroup` costs made
    with it equal the `Score.cost` of each member."""
    return (prefill_cost(weights, prompt_tokens, matched_tokens, cpu_blocks, storage_blocks,
                         block_size)
            + copy_cost(weights, prompt_tokens, matched_tokens, held_elsewhere))


def score_workers(
    workers: list[WorkerView],
    matches: Mapping[WorkerKey, Match],
    weights: CostWeights,
    *,
    prompt_tokens: int | None = None,
    prompt_blocks: int | None = None,
    held_elsewhere: int = 0,
) -> list[Score]:
    """One score per eligible worker; zero matched blocks where the index knows nothing.

    The prefill cost counts against `prompt_tokens`, or for a block-hash query
    against `prompt_blocks` times each worker's block size; `held_elsewhere` is the
    longest match (tokens) among all the eligible workers, `workers` or not. When one of
    `workers` carries load (a queue cost above 0), the crowding term compares those that
    carry load or have recent demand among themselves; the others pay none.
    """
    scores = [score_worker(view, matches.get(view.key), weights, prompt_tokens=prompt_tokens,
                           prompt_blocks=prompt_blocks, held_elsewhere=held_elsewhere)
              for view in workers]
    if len(scores) < 2 or not weights.crowded_token:
        return scores
    if not any(score.queue_cost > 0 for score in scores):
        return scores
    weighed = [i for i, score in enumerate(scores)
               if score.queue_cost > 0 or workers[i].recent_demand > 0]
    if len(weighed) > 1:
        others = {i: workers[i].recent_demand if workers[i].other_demand is None
                  else workers[i].other_demand for i in weighed}
        least = min(others.values())
        for i, other in others.items():
            if other > least:  # set here, on a score still being made (replace would copy it)
                score = scores[i]
                total = (prompt_tokens if prompt_tokens is not None
                         else (prompt_blocks or 0) * (score.block_size or 0))
                score.crowding_cost = (weights.crowded_token
                                       * max(total - score.matched_tokens, 0)
                                       * (other - least) / other)
    return scores


def score_worker(view: WorkerView, match: Match | None, weights: CostWeights, *,
                 prompt_tokens: int | None = None, prompt_blocks: int | None = None,
                 held_elsewhere: int = 0) -> Score:
    """One worker's score as `score_workers` makes it (`match`: its match, None where the
    index knows nothing), without the crowding term: whole for a worker scored alone, or
    for one that carries no load (which pays none)."""
    by_medium = dict.fromkeys(MEDIA, 0)
    blocks = tokens = pending = 0
    block_size = view.block_size
    if match is not None:
        by_medium.update(match.by_medium)
        blocks, tokens = match.blocks, match.tokens
        block_size = match.block_size or block_size
        pending = match.pending
    size = block_size or 0
    total = prompt_tokens if prompt_tokens is not None else (prompt_blocks or 0) * size
    prefill = prefill_cost(weights, total, tokens, by_medium["CPU"], by_medium["STORAGE"],
                           size)
    per_waiting = total if view.waiting_prefill is None else view.waiting_prefill
    queued = max(float(view.queued_prefill), (view.waiting or 0.0) * per_waiting)
    queued = max(0.0, queued - pending * size)  # the prefix being computed for us
    running = max(float(view.inflight + view.answered), view.running or 0.0)
    overloaded = (view.waiting or 0.0) >= weights.overload_waiting
    return Score(
        instance=view.key[0], dp_rank=view.key[1], matched_blocks=blocks,
        matched_tokens=tokens, block_size=block_size, by_medium=by_medium,
        state=view.state, prefill_cost=prefill,
        copy_cost=copy_cost(weights, total, tokens, held_elsewhere),
        queue_cost=(weights.queued_prefill_token * queued
                    + weights.running_request * running),
        queued_prefill=queued, running=running, overloaded=overloaded,
        load=LoadReadings(running=view.running, waiting=view.waiting,
                          kv_usage=view.kv_usage, inflight=view.inflight,
                          answered=view.answered, queued_prefill=view.queued_prefill,
                          recent_demand=round(view.recent_demand)),
        pending_blocks=pending,
        saturated=overloaded or (view.kv_usage or 0.0) >= weights.overload_kv_usage,
    )


class TieBreaker:
    """Among equally cheap workers: first the least demanded lately, then rendezvous
    hashing keyed on one prompt's first block.

    When none of the tied workers carries load, one whose recent demand (`app.routing.demand`, as
    `demand` reads it) is more than `DEMAND_SLACK` times the least one's, and more than one
    prompt's length (`slack`, in tokens) above it, is left out; the heaviest of the rest by
    rendezvous weight wins.

    Invariants: among workers whose demand is alike the pick depends only on the prompt's
    first block and their keys, never on the process, the order of `tied` or earlier picks
    (xxh3 is seedless and the same on every platform; token ids are hashed as little-endian
    uint32), so every replica breaks the same tie the same way. Made per request; keeps
    nothing but the prompt's key, once made (a route asks for it twice).
    """

    __slots__ = ("_tokens", "_first_hash", "_demand", "_slack", "_key")

    def __init__(self, tokens: Sequence[int] | None = None,
                 first_hash: int | bytes | None = None, *,
                 demand: Callable[[WorkerKey], float] | None = None,
                 slack: float = 0.0) -> None:
        self._tokens = tokens
        self._first_hash = first_hash
        self._demand = demand
        self._slack = slack
        self._key: tuple[int, bytes] | None = None  # (block size, key) once made

    def key(self, block_size: int) -> bytes:
        """The digest of the prompt's first block (or all of it, when shorter)."""
        made = self._key
        if made is not None and made[0] == block_size:
            return made[1]
        if self._first_hash is not None:
            value = self._first_hash
            # A hash spelled signed or unsigned is the same hash (as the index treats it).
            raw = value if isinstance(value, bytes) else (value % 2**64).to_bytes(8, "little")
            digest = xxh3_128_digest(b"hash:" + raw)
        else:
            first = array("I", self._tokens[:block_size] if self._tokens is not None else ())
            if sys.byteorder != "little":
                first.byteswap()
            digest = xxh3_128_digest(b"tokens:" + first.tobytes())
        self._key = (block_size, digest)
        return digest

    def pick(self, tied: list[Score], block_size: int = DEFAULT_BLOCK_SIZE) -> Score:
        chosen = self.pick_key([(s.instance, s.dp_rank) for s in tied], block_size,
                               idle=not any(s.queue_cost for s in tied))
        return next(s for s in tied if (s.instance, s.dp_rank) == chosen)

    def pick_key(self, tied: Iterable[WorkerKey], block_size: int, *,
                 idle: bool = True) -> WorkerKey:
        """`pick` for workers known by their keys alone (the same weights, so the same pick);
        `idle`: whether none of them carries load (demand weighs only then)."""
        key = self.key(block_size)
        # Ordered by weight; a (practically impossible) equal weight falls back to the key.
        return max((xxh3_64_intdigest(_rendezvous_name(w) + key), w)
                   for w in (self._least_demanded(tied) if idle else tied))[1]

    def _least_demanded(self, tied: Iterable[WorkerKey]) -> Iterable[WorkerKey]:
        if self._demand is None:
            return tied
        keys = list(tied)
        if len(keys) < 2:
            return keys
        demands = [self._demand(key) for key in keys]
        least = min(demands)
        ceiling = max(least * DEMAND_SLACK, least + self._slack)
        return [key for key, demand in zip(keys, demands, strict=True) if demand <= ceiling]


@functools.lru_cache(maxsize=1 << 16)
def _rendezvous_name(worker: WorkerKey) -> bytes:
    """A worker's part of its rendezvous weight (kept: a tie among the holders of a shared
    prefix weighs each of them, route after route)."""
    return f"{worker[0]}\0{worker[1]}\0".encode()


def best_of(scores: list[Score], ties: TieBreaker) -> Score:
    """The cheapest score among those not overloaded (among all if every one is); ties
    go to the rendezvous pick for the prompt's first block. `scores` is not empty."""
    pool = [score for score in scores if not score.overloaded] or scores
    lowest = min(score.cost for score in pool)
    tied = [score for score in pool if score.cost == lowest]
    if len(tied) == 1:
        return tied[0]
    # From every score, not only the tied ones: replicas whose loads differ still agree.
    block_size = min((s.block_size for s in scores if s.block_size), default=DEFAULT_BLOCK_SIZE)
    return ties.pick(tied, block_size)


@dataclass(slots=True)  # never changed once made; not frozen, as WorkerView and Score
class WorkerGroup:
    """Eligible workers that carry no load and cost the same: those that match the same
    blocks, or none (the idle ones: the whole prompt to compute). None of them is
    overloaded or saturated, and each one's `Score.cost` is exactly `cost`. They are kept
    as keys, so a route costs the workers whose scores differ, not the fleet; a `Score` is
    made only for the ones an answer shows (`score`).

    `count` keys in all; `keys()` yields every one (asked for only when the group ties for
    the lowest cost, or for every score), `first(n)` the n smallest, ascending."""

    cost: float
    count: int
    keys: Callable[[], Iterable[WorkerKey]]
    first: Callable[[int], list[WorkerKey]]
    score: Callable[[WorkerKey], Score]

    @classmethod
    def of(cls, keys: Sequence[WorkerKey], cost: float,
           score: Callable[[WorkerKey], Score]) -> WorkerGroup:
        """A group of the listed workers."""
        return cls(cost=cost, count=len(keys), keys=lambda: keys,
                   first=lambda n: heapq.nsmallest(n, keys), score=score)


_PLACE = itemgetter(0)  # a candidate's place in `ranked` order (unique: it ends in the key)


def ranked(scores: Iterable[Score]) -> list[Score]:
    """Cheapest first, overloaded ones last; equal costs by instance id and rank."""
    return sorted(scores, key=lambda s: (s.overloaded, s.cost, s.instance, s.dp_rank))


def choose(scores: list[Score], groups: Sequence[WorkerGroup], ties: TieBreaker,
           keep: int | None, block_size: int | None) -> tuple[Score, list[Score]]:
    """`best_of` over `scores` and the groups' workers together, and the `keep` first scores
    in `ranked` order, the chosen one always among them (every score when `keep` is None).
    `block_size` is the smallest block size among all of them (None: none known), as
    `best_of` takes it for a tie. Not every one of `scores` and the groups is empty.

    Same choice and scores as `best_of` and `ranked` over every worker's full score: a
    group's workers cost exactly its `cost` and are never overloaded, so a group either
    ties for the lowest cost as a whole or not at all, and ranks its own workers by key."""
    groups = [group for group in groups if group.count]
    if not groups:
        best = best_of(scores, ties)
    else:
        pool = [score for score in scores if not score.overloaded]
        lowest = min([*(s.cost for s in pool), *(g.cost for g in groups)])
        tied_scores = [s for s in pool if s.cost == lowest]
        tied_groups = [g for g in groups if g.cost == lowest]
        if len(tied_scores) + sum(g.count for g in tied_groups) == 1:
            best = tied_scores[0] if tied_scores else tied_groups[0].score(
                tied_groups[0].first(1)[0])
        else:
            tied_keys = [(s.instance, s.dp_rank) for s in tied_scores]
            owners: list[tuple[int, WorkerGroup]] = []  # where each group's keys end
            for group in tied_groups:
                tied_keys.extend(group.keys())
                owners.append((len(tied_keys), group))
            # A group's workers carry no load (see WorkerGroup).
            chosen = ties.pick_key(tied_keys, block_size or DEFAULT_BLOCK_SIZE,
                                   idle=not any(s.queue_cost for s in tied_scores))
            position = tied_keys.index(chosen)
            if position < len(tied_scores):
                best = tied_scores[position]
            else:
                best = next(g for end, g in owners if position < end).score(chosen)
    if keep is None:
        shown = ranked([*scores, *(g.score(key) for g in groups for key in g.keys())])
    else:
        # Each group ranks its workers by key among themselves: only its first `keep` can
        # show; and as a group's workers cost exactly its cost and are never overloaded,
        # their places in `ranked` are known from their keys: only those shown are scored.
        candidates: list[tuple[tuple[bool, float, str, int], Score | None,
                               WorkerGroup | None]] = [  # (place, score, or its group)
            ((s.overloaded, s.cost, s.instance, s.dp_rank), s, None) for s in scores]
        candidates += [((False, g.cost, key[0], key[1]), None, g)
                       for g in groups for key in g.first(keep)]
        places = heapq.nsmallest(keep, candidates, key=_PLACE)
        chosen = (best.instance, best.dp_rank)
        if keep and all((order[2], order[3]) != chosen for order, _, _ in places):
            # A tie's pick need not rank first: the answer always shows the chosen worker
            # (in the last place, which is then neither shown nor scored).
            places[keep - 1] = ((best.overloaded, best.cost, *chosen), best, None)
        shown = ranked([score if group is None else group.score((order[2], order[3]))
                        for order, score, group in places])
    return best, shown
