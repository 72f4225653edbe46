"""The routing service: what one kvroute process owns and how it decides.

`Service` holds the index, the registry of followed instances, the tokenizer and
the metrics; `decide` turns a route request into a chosen worker and every
eligible worker's score. The HTTP layer (`app.http.app`) and the proxy (`app.http.proxy`)
are thin shells around it.

Route requests are decoded with msgspec against strict types, so a float or a
bool among token ids is refused with the path of the bad element (`token_ids[3]`)
instead of being coerced. Refusals are `app.errors` kinds; the HTTP layer picks the status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

import httpx
from msgspec import UNSET

from kvroute.app.api.answers import (
    FleetStatus,
    InstanceDetail,
    InstanceList,
    InstanceSummary,
    MatchAnswer,
    MediumCounts,
    RouteAnswer,
    WorkerDetail,
    WorkerMatch,
)
from kvroute.app.api.route_decode import route_decoder
from kvroute.app.api.route_request import (
    INPUTS,
    MatchRequest,
    RouteRequest,
    check_messages,
    match_request_type,
    parse_hash,
    route_request_type,
)
from kvroute.app.config import Settings
from kvroute.app.errors import (
    Busy,
    InvalidRequest,
    NoEligibleWorker,
    NotFound,
    RequestError,
    TooLarge,
    UpstreamFailed,
)
from kvroute.app.fleet.dns import Fleet, FleetCollector, Resolver, resolve_with_getaddrinfo
from kvroute.app.fleet.limits import fleet_context
from kvroute.app.fleet.registry import Instance, Registry, Worker
from kvroute.app.ingest.pacing import FleetPacing
from kvroute.app.metrics import ServiceMetrics
from kvroute.app.routing.activity import RouteActivity
from kvroute.app.routing.cost import (
    DEFAULT_BLOCK_SIZE,
    CostWeights,
    Score,
    TieBreaker,
    WorkerGroup,
    WorkerView,
    choose,
    idle_cost,
    score_worker,
    score_workers,
)
from kvroute.app.routing.decision_log import DecisionLog
from kvroute.app.routing.demand import RecentDemand
from kvroute.app.routing.eligible import Eligible, EligibleCache, eligible_among
from kvroute.app.routing.inflight import InFlight, RecentAnswers
from kvroute.app.routing.load import LoadMonitor
from kvroute.app.routing.steady_queue import SteadyQueue
from kvroute.app.routing.tokenizer import Tokenizer, make_tokenizer
from kvroute.app.state.keeper import StateCollector, StateKeeper
from kvroute.app.state.store import DirectoryStore, StateStore
from kvroute.app.state.valkey import NO_LOAD, PeerLoad, Peers, PeersCollector, ValkeyStore
from kvroute.app.workers import SubscriberOptions, WorkerKey, WorkerState
from kvroute.index import Match, PrefixIndex
from kvroute.index.keys import TOKEN_BYTES, token_bytes
from kvroute.index.prefix_index import COMPILED_AVAILABLE

__all__ = ["Decision", "Service", "route_request_decoder"]

log = logging.getLogger("kvroute.service")

# Scores an answer shows unless asked for all: the chosen worker and the cheapest others.
TOP_SCORES = 4
# Instances asked in turn to tokenize a text prompt before the request fails.
TOKENIZE_ATTEMPTS = 3
# Instances answered for between two turns of the event loop (`Service.instance_slices`):
# few enough that a slice, in a listing or in the dashboard's costlier snapshot, is a short
# wait for the routes behind it, whatever the fleet's size.
INSTANCES_PER_SLICE = 16
# Seconds after a route during which fleet changes run at the routing pace (`_routing_lately`).
ROUTING_LATELY = 1.0


def route_request_decoder(settings: Settings) -> Callable[[bytes], RouteRequest]:
    """How POST /v1/route reads its body under `settings`; refusals are RequestErrors
    (`app.api.route_decode`: token ids read without a Python int each)."""
    return route_decoder(settings)


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the index holds of a request's prompt, among the workers that may answer it:
    `matches` has only workers holding at least its first block (some of them may not be
    eligible; `eligible` and `exclude` say which are). `tokens` is None for a block-hash
    query, `hashes` for any other; `prompt_bytes` are the tokens as the index hashes them."""

    kind: str  # the input given: one of INPUTS
    eligible: Eligible
    exclude: frozenset[WorkerKey]
    count: int  # eligible workers not excluded
    tokens: list[int] | None
    hashes: list[int | bytes] | None
    prompt_bytes: bytes | None
    lora_name: str | None
    cache_salt: str | None
    matches: dict[WorkerKey, Match]


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker, the scores an answer shows, and the prompt's tokens (None
    for a block-hash query). `guess_expires` is when the placement guess the decision left
    on the chosen worker runs out (None: it left none), `lora_name` and `cache_salt` the
    adapter and the tenant it was matched and guessed under."""

    kind: str
    worker: Worker
    best: Score
    scores: list[Score]  # the chosen worker and the cheapest others (all with all_scores)
    tokens: list[int] | None
    lora_name: str | None = None
    cache_salt: str | None = None
    guess_expires: float | None = None
    eligible: int = 0  # workers weighed, shown in `scores` or not
    logged: int | None = None  # its id in the decision log (None: not logged)

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens the chosen worker still has to compute (0 for a block-hash query)."""
        return 0 if self.tokens is None else len(self.tokens) - self.best.matched_tokens


class Service:
    """Everything one kvroute process owns; created in the app's lifespan."""

    def __init__(self, settings: Settings, *, resolver: Resolver | None = None) -> None:
        """`resolver`: how fleets' DNS names are resolved (default: the system's)."""
        self.settings = settings
        self.route_request = route_request_type(settings)
        self.decode_route_request = route_request_decoder(settings)
        self.decode_match_request = route_decoder(settings, kind=match_request_type(settings))
        self.index = PrefixIndex()
        self._last_route = float("-inf")  # perf_counter() when a route or match last began
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        # A context of its own, sized for the fleet (app.fleet.limits), ended in close().
        self.zmq_context = fleet_context(settings)
        self.registry = Registry(self.index, self.client, self.zmq_context,
                                 options=SubscriberOptions(
            max_message_bytes=settings.max_event_message_bytes,
            max_blocks_per_event=settings.max_blocks_per_event,
            max_blocks_per_worker=settings.max_blocks_per_worker,
            unconfirmed_ttl=settings.unconfirmed_ttl),
            max_instances=settings.max_instances, endpoint_hosts=settings.zmq_endpoint_hosts,
            pacing=FleetPacing(settings.replay_concurrency, settings.idle_checks_per_second,
                               routing=self._routing_lately),
            connections=settings.max_connections)
        self.metrics = ServiceMetrics(self.registry)
        # The workers each model's routes weigh, kept until the registry changes.
        self.eligible = EligibleCache(self.registry)
        # DNS names followed as fleets (app.fleet.dns): each address is an instance.
        self.fleets = [Fleet(config, self.registry, resolver or resolve_with_getaddrinfo,
                             interval=settings.dns_refresh_seconds)
                       for config in settings.fleets]
        if self.fleets:
            self.metrics.registry.register(FleetCollector(lambda: iter(self.fleets)))
        self.tokenizer: Tokenizer | None = make_tokenizer(
            settings.tokenizer, self.client, max_prompt_tokens=settings.max_prompt_tokens)
        self.weights = CostWeights(
            miss_token=settings.cost_miss_token, cpu_hit_token=settings.cost_cpu_hit_token,
            storage_hit_token=settings.cost_storage_hit_token,
            queued_prefill_token=settings.cost_queued_prefill_token,
            running_request=settings.cost_running_request,
            copied_token=settings.cost_copied_token,
            crowded_token=settings.cost_crowded_token,
            overload_waiting=settings.overload_waiting,
            overload_kv_usage=settings.overload_kv_usage)
        self.load = LoadMonitor(self.registry, self.client, interval=settings.load_interval,
                                overload_kv_usage=settings.overload_kv_usage)
        # Requests the proxy has sent to each worker and not yet seen finish.
        self.inflight = InFlight()
        # Route answers, until the instance's own metrics show them (no metrics: not kept).
        self.answers = RecentAnswers(max_age=3 * settings.load_interval)
        self.demand = RecentDemand()
        # Each worker's recent queue cost: a swing does not push a prefix off its holder.
        self.steady = SteadyQueue()
        # The last decisions, for GET /v1/decisions (app.routing.decision_log); None: not kept.
        self.decisions = (DecisionLog(settings.decision_log) if settings.decision_log
                          else None)
        # Decisions per worker and their latency, for the dashboard (app.http.dashboard).
        self.activity = RouteActivity()
        self.started_at = time.monotonic()
        self._configured: list[Instance] = []
        self._ready = False
        # Replicas sharing placement guesses and load through Valkey/Redis; None: alone.
        self.peers: Peers | None = None
        if settings.state_url is not None:
            self.peers = Peers(settings.state_url, ca_file=settings.state_ca_file,
                               index=self.index, is_worker=self._follows,
                               own_load=self._own_load,
                               apply_guesses=settings.placement_ttl > 0)
            self.metrics.registry.register(PeersCollector(self.peers))
        # Saved state (app.state.keeper): loaded before any subscriber starts, saved
        # periodically and before the subscribers stop; None: nothing is saved.
        self.state: StateKeeper | None = None
        store = _state_store(settings)
        if store is not None:
            self.state = StateKeeper(store, self.registry, self.index,
                                     settings.state_save_interval)
            self.registry.claim_saved = self.state.claim
            self.metrics.registry.register(StateCollector(self.state))

    async def start(self) -> None:
        # Which loops the index runs, so that a build without the compiled ones is visible.
        log.info("prefix index: %s loops%s", self.index.implementation,
                 "" if COMPILED_AVAILABLE else " (the compiled ones are not built)")
        if self.state is not None:
            await self.state.load()
            self.state.start()
        if self.peers is not None:
            self.peers.start()
        if self.settings.load_interval > 0:
            self.load.start()
        for config in self.settings.instances:  # ids are unique: load_settings checked
            instance = await self.registry.add(config, wait_for_discovery=False)
            self._configured.append(instance)
        for fleet in self.fleets:
            fleet.start()

    async def close(self) -> None:
        for fleet in self.fleets:  # no member comes or goes while the rest stops
            await fleet.stop()
        if self.state is not None:  # first: the subscribers still hold the index
            await self.state.close()
            await self.state.store.close()
        if self.peers is not None:
            await self.peers.close()
        await self.load.stop()
        await self.registry.close()
        await self.client.aclose()
        self.zmq_context.destroy(linger=0)  # every subscriber's sockets are closed by now

    def readiness(self) -> tuple[bool, str]:
        if self._ready:
            return True, "ready"
        configured = self._configured + [
            self.registry.get(instance_id) for fleet in self.fleets
            for instance_id in fleet.members.values() if instance_id in self.registry]
        waiting = [f"{worker.instance.id} rank {worker.endpoint.dp_rank}: {worker.state}"
                   for instance in configured for worker in instance.workers
                   if not worker.state.serving]
        waiting += [f"{instance.id}: discovering ({instance.discovery_error or 'pending'})"
                    for instance in configured if not instance.workers]
        waiting += [f"fleet {fleet.id}: resolving {fleet.host} ({fleet.error or 'pending'})"
                    for fleet in self.fleets if fleet.resolved_at is None]
        if not waiting:
            self._ready = True
            return True, "all configured workers are live"
        if time.monotonic() - self.started_at >= self.settings.ready_grace_seconds:
            self._ready = True
            return True, "startup grace period over; not live: " + "; ".join(waiting)
        return False, "waiting for: " + "; ".join(waiting)

    # -- routing ---------------------------------------------------------
    def _eligible(self, request: RouteRequest) -> Eligible:
        if request.candidates is not None:
            unknown = sorted({c for c in request.candidates if c not in self.registry})
            if unknown:
                raise NotFound(f"unknown candidate instance(s): {', '.join(unknown)}",
                               "candidates", unknown=unknown)
            eligible = eligible_among((self.registry.get(c) for c in dict.fromkeys(
                request.candidates)), request.model)
            eligible.version = self.registry.version
        else:
            eligible = self.eligible.get(request.model)
        if request.model is not None and not (eligible.served or any(
                instance.serves(request.model) for instance in self.registry)):
            raise NotFound(f"model {request.model!r} is not served by any registered "
                           "instance", "model")
        return eligible

    async def _tokens(self, request: RouteRequest, urls: list[str]) -> list[int]:
        if request.token_ids is not None:
            return request.token_ids
        field = "prompt" if request.prompt is not None else "messages"
        if self.tokenizer is None:
            raise InvalidRequest(f"`{field}` needs a tokenizer; none is configured "
                                 "(set `tokenizer`), or send token_ids", field)
        # An instance whose HTTP server fails (502) hands over to the next, so one dead
        # server does not fail text routing while others could answer.
        template_args = request.template_args() if request.messages is not None else {}
        for attempt, url in enumerate(urls[:TOKENIZE_ATTEMPTS] or [None]):
            try:
                if request.prompt is not None:
                    tokens = await self.tokenizer.encode_prompt(request.prompt, url=url,
                                                                model=request.model)
                else:
                    tokens = await self.tokenizer.encode_chat(
                        request.messages or [], template_args, url=url, model=request.model)
                break
            except RequestError as exc:
                # Only an instance's failure hands over to the next one; a prompt that
                # cannot be tokenized would fail everywhere.
                last_try = attempt + 1 >= min(len(urls), TOKENIZE_ATTEMPTS)
                if not isinstance(exc, UpstreamFailed) or last_try:
                    raise exc.at(field) from None
                log.warning("tokenizing on %s failed (%s); trying the next instance", url, exc)
        if len(tokens) > self.settings.max_prompt_tokens:
            raise TooLarge(f"{field} is {len(tokens)} tokens, over the limit of "
                           f"{self.settings.max_prompt_tokens}", field)
        return tokens

    def _routing_lately(self) -> bool:
        """Whether a route or a match was asked in the last `ROUTING_LATELY` seconds: the
        fleet's turns then rest longer (`FleetPacing`'s `routing_rest`), so that a hundred
        instances added at once leave routes their usual latency (and take longer to
        connect)."""
        return time.perf_counter() - self._last_route < ROUTING_LATELY

    async def _lookup(self, request: MatchRequest,
                      exclude: frozenset[WorkerKey] = frozenset()) -> Lookup:
        """The workers eligible for `request` (minus `exclude`) and what the index holds of
        its prompt; raises a RequestError. What a route and a match query ask alike: the same
        refusals, and the same matches (only workers holding a block of it are in them)."""
        self._last_route = time.perf_counter()
        given = [name for name in INPUTS if getattr(request, name) is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of token_ids, block_hashes, prompt, messages"
                                 + (f" (got {', '.join(given)})" if given else ""),
                                 given[1] if len(given) > 1 else "token_ids")
        if request.messages is not None:
            check_messages(request.messages, self.settings.max_prompt_chars)
        eligible = self._eligible(request)
        exclude = frozenset(key for key in exclude if key in eligible)
        count = len(eligible) - len(exclude)
        if not count:
            reason = "no registered instance" if not len(self.registry) else (
                "no live worker" + (f" serves model {request.model!r}" if request.model else "")
                + (" among the candidates" if request.candidates is not None else "")
                + (" that has not failed already" if exclude else ""))
            raise NoEligibleWorker(f"no eligible worker: {reason}")
        lora_name = request.lora_name
        if request.block_hashes is not None:
            hashes = [parse_hash(h, i) for i, h in enumerate(request.block_hashes)]
            matches = self.index.match_hashes(
                hashes, workers=[key for key in eligible.workers if key not in exclude])
            return Lookup(given[0], eligible, exclude, count, None, hashes, None, lora_name,
                          request.cache_salt, matches)
        tokens = await self._tokens(request, eligible.urls(exclude))
        if self.registry.version != eligible.version:
            # Tokenizing awaited: instances may have come, gone or changed state.
            try:
                eligible = self._eligible(request)
            except NotFound:
                eligible = eligible_among((), None)
            exclude = frozenset(key for key in exclude if key in eligible)
            count = len(eligible) - len(exclude)
            if not count:
                raise NoEligibleWorker("no eligible worker: the instances went away")
        if lora_name is None and eligible.adapter:
            lora_name = request.model  # vLLM caches an adapter's blocks under its name
        # Every worker the index knows is walked (its bit masks cost the same whatever
        # the selection), and the matches of workers that may not take the route left.
        # Converted once: the walk and the placement guess hash the same bytes.
        prompt_bytes = token_bytes(tokens)
        # vLLM always computes a prompt's last token (it needs its logits), so its
        # prefix-cache hit is capped at the full blocks of all tokens but the last: a
        # prompt that ends on a block boundary reuses one block less than it holds.
        matches = self.index.match(prompt_bytes[:-TOKEN_BYTES], lora_name=lora_name,
                                   cache_salt=request.cache_salt,
                                   following=prompt_bytes[-TOKEN_BYTES:], now=time.monotonic(),
                                   matched_only=True)
        return Lookup(given[0], eligible, exclude, count, tokens, None, prompt_bytes, lora_name,
                      request.cache_salt, matches)

    async def decide(self, request: RouteRequest,
                     exclude: frozenset[WorkerKey] = frozenset(), *,
                     shed_when_overloaded: bool = False,
                     mode: Literal["route", "proxy", "epp"] = "route") -> Decision:
        """Weigh every eligible worker (minus `exclude`) and choose one; raises a RequestError.
        With `shed_when_overloaded`, a request that finds every eligible worker saturated
        (`routing.Score.saturated`: its waiting queue or its KV cache at the limit) is
        refused (Busy) instead of sent to the least bad one, and leaves nothing behind.

        Only workers that carry load get a full score; the others cost their prefill alone
        and are kept as keys, grouped by it (`_group`, `routing.WorkerGroup`), and which
        workers are eligible is kept between routes (`app.routing.eligible`), so a route's cost
        follows the work, not the fleet. The decision keeps `TOP_SCORES` scores, or all
        of them with `request.all_scores`. `mode` names the caller in the decision log."""
        started = time.perf_counter()
        now = time.monotonic()
        self.answers.settle(now, self.load.last, self.load.typical())
        asked = await self._lookup(request, exclude)
        eligible, exclude, tokens = asked.eligible, asked.exclude, asked.tokens
        matches = asked.matches
        held = _longest(matches, eligible.workers, exclude)
        groups: list[WorkerGroup] = []
        if asked.hashes is not None:
            # Each worker's prompt length is its own block size times the hashes: no
            # shared cost for idle workers, so every worker is scored.
            scored = [w for w in eligible.workers.values() if w.key not in exclude]
            # Each worker's block size its own: a tie weighs demand in the default's blocks.
            ties = TieBreaker(first_hash=asked.hashes[0] if asked.hashes else None,
                              demand=lambda key: self.demand.of(key, now),
                              slack=len(asked.hashes) * DEFAULT_BLOCK_SIZE)
            block_size = None  # best_of finds it among the scores
        else:
            assert tokens is not None
            ties = TieBreaker(tokens=tokens, demand=lambda key: self.demand.of(key, now),
                              slack=len(tokens))
            scored, groups, block_size = self._group(eligible, exclude, matches, len(tokens),
                                                     held)
        count = asked.count
        lora_name = asked.lora_name
        prompt_bytes = asked.prompt_bytes
        prompt_tokens = len(tokens) if tokens is not None else None
        prompt_blocks = len(request.block_hashes or ())
        prefix = ties.key(block_size or DEFAULT_BLOCK_SIZE)  # the prompt's key in demand
        scores = score_workers([self._view(w, prefix) for w in scored], matches, self.weights,
                               prompt_tokens=prompt_tokens, prompt_blocks=prompt_blocks,
                               held_elsewhere=held)
        self._steady(scores, eligible, exclude, prefix, now)
        best, shown = choose(scores, groups, ties,
                             keep=None if request.all_scores else TOP_SCORES,
                             block_size=block_size)
        if (shed_when_overloaded and all(score.saturated for score in scores)
                and not any(group.count for group in groups)):  # grouped: never saturated
            raise Busy(f"every eligible worker is overloaded ({count} scored: waiting "
                       f"queue at {self.weights.overload_waiting} or KV-cache usage at "
                       f"{self.weights.overload_kv_usage}); retry later")
        worker = eligible.workers[(best.instance, best.dp_rank)]
        if not request.probe:
            self.demand.add(worker.key, prefix,
                            prompt_tokens if prompt_tokens is not None
                            else prompt_blocks * (best.block_size or DEFAULT_BLOCK_SIZE), now)
        guess_expires = None
        if tokens and self.settings.placement_ttl > 0 and not request.probe:
            # Until its events arrive, the chosen worker counts as holding this prompt, so
            # a burst sharing a new prefix follows the first request instead of spreading.
            guess_expires = time.monotonic() + self.settings.placement_ttl
            self._guess(worker, tokens, lora_name, asked.cache_salt, guess_expires,
                        self.settings.placement_ttl, prompt=prompt_bytes)
        if tokens:
            self.metrics.match_ratio.observe(best.matched_tokens / len(tokens))
        self.activity.decided(worker.key, time.perf_counter() - started, request.probe)
        logged = None
        if self.decisions is not None and not request.probe:
            logged = self.decisions.record(
                at=now - self.started_at, mode=mode, prefix=prefix,
                prompt_tokens=prompt_tokens, chosen=best, scores=shown, eligible=count)
        return Decision(kind=asked.kind, worker=worker, best=best, scores=shown, tokens=tokens,
                        lora_name=lora_name, cache_salt=asked.cache_salt,
                        guess_expires=guess_expires,
                        eligible=count, logged=logged)

    def _steady(self, scores: list[Score], eligible: Eligible,
                exclude: frozenset[WorkerKey], prefix: bytes, now: float) -> None:
        """Each score's queue term as `app.routing.steady_queue` weighs it, in place: a worker that
        holds part of the prompt (matched or guessed), or that the prompt's prefix was sent
        to lately (`app.routing.demand`: it held it, and may have evicted it under the same
        pressure), counts at most its recent average."""
        loaded = set()
        for score in scores:
            key = (score.instance, score.dp_rank)
            if score.queue_cost > 0:
                loaded.add(key)
            steady = self.steady.observe(key, score.queue_cost, now)
            if (score.matched_tokens or score.pending_blocks
                    or self.demand.latest(key, prefix, now)):
                score.queue_cost = steady
        # The weighed workers not carrying load (another model's keep their queues).
        self.steady.settle(lambda key: key in eligible and key not in exclude
                           and key not in loaded, now)

    def retract(self, decision: Decision) -> None:
        """The chosen worker did not take the request (it refused the connection): its
        placement guesses will not come true."""
        self.index.placements.forget(decision.worker.key)

    def served_elsewhere(self, decision: Decision, served: Worker | None) -> None:
        """The request was served by `served` (None: by no worker kvroute follows), not by
        the chosen worker: the decision's placement guess moves there, with the expiry it
        had. Only this decision's guess moves; other guesses on the chosen worker stay.
        (Replicas that heard of the first guess keep it until it expires.)"""
        expires = decision.guess_expires
        if expires is None or decision.tokens is None:
            return
        self.index.withdraw(decision.worker.key, decision.tokens, lora_name=decision.lora_name,
                            cache_salt=decision.cache_salt, expires=expires)
        left = expires - time.monotonic()
        if served is None or left <= 0:
            return
        self._guess(served, decision.tokens, decision.lora_name, decision.cache_salt, expires,
                    left)

    def _guess(self, worker: Worker, tokens: list[int], lora_name: str | None,
               cache_salt: str | None, expires: float, ttl: float, *,
               prompt: bytes | None = None) -> None:
        """Place the guess that `worker` will hold `tokens` until `expires` (`ttl` seconds
        from now), here and, through Valkey, on the other replicas. `prompt`: the tokens'
        `token_bytes`, when the caller has them already."""
        self.index.place(worker.key, tokens if prompt is None else prompt,
                         block_size=worker.instance.block_size,
                         lora_name=lora_name, cache_salt=cache_salt, expires=expires)
        if self.peers is not None:
            self.peers.publish_guess(worker.key, tokens, block_size=worker.instance.block_size,
                                     lora_name=lora_name, cache_salt=cache_salt, ttl=ttl)

    def _busy(self) -> set[WorkerKey]:
        """A superset of the workers whose load adds to their cost or overloads them."""
        busy = {*self.inflight.workers(), *self.answers.workers(), *self.load.busy()}
        if self.peers is not None:
            busy.update(self.peers.loaded())
        return busy

    def _group(self, eligible: Eligible, exclude: frozenset[WorkerKey],
               matches: dict[WorkerKey, Match], prompt_tokens: int, held: int,
               ) -> tuple[list[Worker], list[WorkerGroup], int | None]:
        """(workers to score one by one, groups of the others, smallest block size of all)
        for a prompt of `prompt_tokens` tokens of which some eligible worker holds `held`
        (`routing.copy_cost`). Workers that carry load are scored, and while any does, so
        are those with recent demand (the crowding term weighs them); the others cost only
        their prefill, so they are grouped by it: those matching the same blocks, and the
        idle ones. Costs the matched, loaded and lately used workers, not the fleet."""
        busy = self._busy()
        if busy:  # the crowding term weighs idle workers that hold prefixes too (app.routing.cost)
            busy.update(self.demand.workers())
        workers = eligible.workers
        scored = [workers[key] for key in busy if key in workers and key not in exclude]
        by_cost: dict[float, list[WorkerKey]] = {}
        # Each as its score will say: the match's block size, else the worker's.
        sizes = [size for w in scored if (size := (
            matches[w.key].block_size if w.key in matches else None) or self._block_size(w))]
        # Holders of a shared prefix mostly match alike: one cost per distinct match.
        costs: dict[tuple[int, int, int, int], float] = {}
        for key, match in matches.items():
            if key in busy or key not in workers or key in exclude:
                continue
            size = match.block_size or self._block_size(workers[key]) or 0
            by_medium = match.by_medium
            alike = (match.tokens, by_medium["CPU"], by_medium["STORAGE"], size)
            cost = costs.get(alike)
            if cost is None:
                cost = costs[alike] = idle_cost(self.weights, prompt_tokens, *alike, held)
                if size:
                    sizes.append(size)
            by_cost.setdefault(cost, []).append(key)
        taken = {w.key for w in scored}
        for keys in by_cost.values():
            taken.update(keys)
        idle_count = len(workers) - len(exclude) - len(taken)
        smallest = eligible.smallest_block_size(taken | exclude, self.index.block_size)
        if smallest:
            sizes.append(smallest)

        # A route asks for the chosen worker's score and for those shown, which are
        # mostly the same workers: each is scored once.
        made: dict[WorkerKey, Score] = {}

        def score(key: WorkerKey) -> Score:
            found = made.get(key)
            if found is None:
                view = self._unloaded_view(workers[key], time.monotonic())
                found = made[key] = score_worker(view, matches.get(key), self.weights,
                                                 prompt_tokens=prompt_tokens, held_elsewhere=held)
            return found

        groups = [WorkerGroup.of(keys, cost, score) for cost, keys in by_cost.items()]
        if idle_count:
            def idle(key: WorkerKey) -> bool:
                return key in taken or key in exclude
            groups.append(WorkerGroup(
                cost=idle_cost(self.weights, prompt_tokens, 0, 0, 0, 0, held),
                count=idle_count,
                keys=lambda: eligible.ascending(idle),
                first=lambda n: list(islice(eligible.ascending(idle), n)), score=score))
        return scored, groups, min(sizes, default=None)

    def _block_size(self, worker: Worker) -> int | None:
        """A worker's block size when no match says it: its instance's as declared
        (configured or discovered; the same on every replica), else the index's."""
        return worker.instance.block_size or self.index.block_size(worker.key)

    def _unloaded_view(self, worker: Worker, now: float) -> WorkerView:
        """`_view` of a worker not in `_busy()`, without a prefix: by that invariant its
        requests and answers here and on the other replicas are none, so only its load
        reading and its demand at `now` are read."""
        key = worker.key
        load = self.load.get(key)
        # The proxy knows its own requests exactly; an instance's gauges trail them by a
        # scrape and would only blur that. Route mode has nothing better than the gauges.
        queue = load if load and not self.settings.proxy else None
        return WorkerView(
            key=key, block_size=self._block_size(worker), state=worker.state,
            running=queue.running if queue else None, waiting=queue.waiting if queue else None,
            kv_usage=load.kv_usage if load else None,
            waiting_prefill=self.answers.typical_prefill(key) if queue else None,
            recent_demand=self.demand.of(key, now))

    def _view(self, worker: Worker, prefix: bytes | None = None) -> WorkerView:
        """What the policy knows of `worker`; with `prefix` (the prompt's key in
        `app.routing.demand`), its demand from other prefixes than that one too."""
        now = time.monotonic()
        key = worker.key
        view = self._unloaded_view(worker, now)  # its counts are set here, as it is made
        forwarded = self.inflight.get(key)
        answered = self.answers.get(key)
        # The other replicas' own requests and answers, as they last said (app.state.valkey).
        peers = self.peers.load(key) if self.peers is not None else NO_LOAD
        view.inflight = forwarded.requests + peers.inflight
        view.answered = answered.requests + peers.answered
        view.queued_prefill = (forwarded.queued_prefill_tokens
                               + answered.queued_prefill_tokens + peers.queued_prefill)
        if prefix is not None:
            view.other_demand = max(
                view.recent_demand - self.demand.latest(key, prefix, now), 0.0)
        return view

    async def route(self, body: bytes) -> tuple[str, RouteAnswer]:
        """(input kind, answer) for a POST /v1/route body; raises a RequestError."""
        request = self.decode_route_request(body)
        decision = await self.decide(request)
        best = decision.best
        if (decision.tokens is not None and self.settings.load_interval > 0
                and not request.probe and not self.settings.proxy):
            # A caller follows the answer before the instance's metrics can show it. (In
            # proxy mode the proxy counts the requests it forwards itself, exactly.)
            self.answers.add(decision.worker.key, decision.uncached_tokens, time.monotonic())
        return decision.kind, RouteAnswer(
            instance=best.instance,
            url=decision.worker.instance.url,
            dp_rank=best.dp_rank,
            matched_blocks=best.matched_blocks,
            matched_tokens=best.matched_tokens,
            prompt_tokens=len(decision.tokens) if decision.tokens is not None else None,
            prompt_blocks=len(request.block_hashes) if request.block_hashes else None,
            scores=[score.answer() for score in decision.scores],
            eligible_workers=decision.eligible,
        )

    async def match(self, body: bytes) -> tuple[str, MatchAnswer]:
        """(input kind, answer) for a POST /v1/match body; raises a RequestError. Reads the
        index and nothing else: no load, no demand, no placement guess left behind."""
        request = self.decode_match_request(body)
        asked = await self._lookup(request)
        workers = asked.eligible.workers
        found = [WorkerMatch(instance=key[0], dp_rank=key[1], matched_blocks=match.blocks,
                             matched_tokens=match.tokens,
                             block_size=match.block_size or self._block_size(workers[key]),
                             by_medium=MediumCounts.of(match.by_medium),
                             pending_blocks=match.pending)
                 for key, match in asked.matches.items()
                 if match.blocks and key in workers]
        found.sort(key=_most_matched)
        return asked.kind, MatchAnswer(
            prompt_tokens=len(asked.tokens) if asked.tokens is not None else None,
            prompt_blocks=len(asked.hashes) if asked.hashes else None,
            matches=found, eligible_workers=asked.count)

    # -- replicas (app.state.valkey) ----------------------------------------------
    def _follows(self, key: WorkerKey) -> bool:
        instance_id, rank = key
        return instance_id in self.registry and any(
            worker.endpoint.dp_rank == rank for worker in self.registry.get(instance_id).workers)

    def _own_load(self) -> dict[WorkerKey, PeerLoad]:
        """This replica's own requests and answers per worker, for the other replicas."""
        self.answers.settle(time.monotonic(), self.load.last, self.load.typical())
        loads = {}
        for key in {*self.inflight.workers(), *self.answers.workers()}:
            forwarded, answered = self.inflight.get(key), self.answers.get(key)
            loads[key] = PeerLoad(forwarded.requests, answered.requests,
                                  forwarded.queued_prefill_tokens + answered.queued_prefill_tokens)
        return loads

    # -- instances -------------------------------------------------------
    def instance_summary(self, instance: Instance) -> InstanceSummary:
        return InstanceSummary(**self._instance_fields(instance))

    async def instance_slices(self) -> AsyncIterator[list[Instance]]:
        """The registered instances, `INSTANCES_PER_SLICE` at a time, with a turn of the
        event loop before each slice but the first: what answers about every instance (a
        listing, the dashboard) never holds the loop for the whole fleet, a stall that would
        grow with it, every route waiting. The instances are those registered as the first
        slice began, less those removed before their slice came."""
        instances = list(self.registry)
        for start in range(0, len(instances), INSTANCES_PER_SLICE):
            if start:
                await asyncio.sleep(0)
            yield [instance for instance in instances[start:start + INSTANCES_PER_SLICE]
                   if self.registry.holds(instance)]

    async def instance_list(self) -> InstanceList:
        """Every registered instance's summary, each as of its slice (`instance_slices`)."""
        summaries = [self.instance_summary(instance)
                     async for instances in self.instance_slices() for instance in instances]
        return InstanceList(summaries, [self.fleet_status(fleet) for fleet in self.fleets]
                            or UNSET)

    def instance_detail(self, instance: Instance) -> InstanceDetail:
        self.index.expire_unconfirmed(time.monotonic())
        workers = [
            WorkerDetail(
                dp_rank=worker.endpoint.dp_rank,
                events_endpoint=worker.endpoint.endpoint,
                replay_endpoint=worker.endpoint.replay_endpoint,
                state=worker.state,
                holdings=MediumCounts.of(self.index.held_by_medium(worker.key)),
                unconfirmed_blocks=self.index.unconfirmed_blocks(worker.key),
                stats=worker.subscriber.status,
            )
            for worker in instance.workers
        ]
        return InstanceDetail(**self._instance_fields(instance), workers=workers)

    def _instance_fields(self, instance: Instance) -> dict[str, Any]:
        states = [worker.state for worker in instance.workers]
        if not states:
            state = "discovering"
        elif all(s.serving for s in states):
            state = WorkerState.DEGRADED if WorkerState.DEGRADED in states else WorkerState.LIVE
        else:
            state = WorkerState.DOWN if all(s == WorkerState.DOWN for s in states) else next(
                s for s in states if not s.serving)
        return {
            "id": instance.id,
            "url": instance.url,
            "models": list(instance.models),
            "block_size": instance.block_size,
            "state": state,
            "dp_size": len(instance.workers),
            # Where the Endpoint Picker sends gateways (app.fleet.endpoints), when configured.
            "endpoint": instance.config.endpoint or UNSET,
            "discovery_error": instance.discovery_error or UNSET,
            "load_error": self.load.failure(instance.id) or UNSET,
            "fleet": instance.fleet or UNSET,
        }

    def fleet_status(self, fleet: Fleet) -> FleetStatus:
        return FleetStatus(id=fleet.id, url=fleet.config.url, addresses=list(fleet.addresses),
                           instances=sorted(fleet.members.values()),
                           resolve_failures=fleet.failures, error=fleet.error or UNSET)


def _state_store(settings: Settings) -> StateStore | None:
    if settings.state_url is not None:
        return ValkeyStore(settings.state_url, ca_file=settings.state_ca_file)
    if settings.state_dir is not None:
        return DirectoryStore(settings.state_dir)
    return None


def _most_matched(match: WorkerMatch) -> tuple[int, str, int]:
    return -match.matched_tokens, match.instance, match.dp_rank


def _longest(matches: dict[WorkerKey, Match], workers: Mapping[WorkerKey, Worker],
             exclude: frozenset[WorkerKey]) -> int:
    """The most tokens of the prompt that one eligible worker holds."""
    return max((match.tokens for key, match in matches.items()
                if key in workers and key not in exclude), default=0)
