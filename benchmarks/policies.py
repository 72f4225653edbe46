"""Routing policies compared by the hit-rate benchmark.

Each policy picks a worker (an index into the fleet) for a prompt at routing time. The ones
that look at load read the engines' queue lengths directly (a real router scrapes them); the
oracle reads every engine's cache directly; kvroute asks the real service over HTTP.
kvroute's proxy is kvroute's own choice plus what the proxy knows that a caller does not:
the requests it forwarded, each from its first byte to its end (``FollowsRequests``).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from kvroute.app.routing.inflight import InFlight, Ticket
from kvroute.sim.engine import Engine


@dataclass
class FleetWorker:
    """One routing unit of the benchmark's fleet: an engine (one data-parallel rank of one
    instance), read directly by the policies. Not the service's
    ``kvroute.app.fleet.registry.Worker``."""

    index: int
    instance: int
    dp_rank: int
    engine: Engine
    assigned: int = 0


class Policy(Protocol):
    name: str

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int: ...


@runtime_checkable
class FollowsRequests(Protocol):
    """A policy that sees the requests it placed as a proxy does: ``placed`` right after
    ``choose`` placed request ``request_id``, then its first token and its end."""

    def placed(self, request_id: str) -> None: ...

    def first_token(self, request_id: str) -> None: ...

    def finished(self, request_id: str) -> None: ...


def _least_loaded(workers: Sequence[FleetWorker], among: Sequence[int] | None = None) -> int:
    pool = range(len(workers)) if among is None else among
    return min(pool, key=lambda i: (workers[i].engine.load(), workers[i].assigned, i))


def cheapest(workers: Sequence[FleetWorker], matched: Sequence[int], prompt_len: int,
             load_tokens: int) -> int:
    """Prefix and load in one currency, tokens of prefill: a worker costs the prompt tokens it
    would recompute plus ``load_tokens`` per request already queued or running there. This is
    the kind of policy a caller builds from kvroute's per-worker scores; the oracle uses the
    same rule on the engines' true caches, so the two differ only in what they know."""
    return min(range(len(workers)), key=lambda i: (
        prompt_len - matched[i] + load_tokens * workers[i].engine.load(), workers[i].assigned, i))


class RandomPolicy:
    name = "random"

    def __init__(self, workers: Sequence[FleetWorker], seed: int = 0) -> None:
        self._n = len(workers)
        self._rng = random.Random(seed)

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        return self._rng.randrange(self._n)


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self, workers: Sequence[FleetWorker]) -> None:
        self._cycle = itertools.cycle(range(len(workers)))

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        return next(self._cycle)


class LeastLoadedPolicy:
    name = "least-loaded"

    def __init__(self, workers: Sequence[FleetWorker]) -> None:
        self._workers = workers

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        return _least_loaded(self._workers)


class ConsistentHashPolicy:
    """Hash of the first block of tokens on a ring with virtual nodes."""

    name = "consistent-hash"

    def __init__(self, workers: Sequence[FleetWorker], block_size: int, vnodes: int = 64) -> None:
        self._bs = block_size
        ring = sorted((_h64(f"{w.index}:{v}".encode()), w.index)
                      for w in workers for v in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        key = _h64(repr(tuple(prompt[: self._bs])).encode())
        i = bisect.bisect(self._points, key) % len(self._points)
        return self._owners[i]


class ApproximateTreePolicy:
    """A router-side prefix tree per worker that learns only from its own routing choices,
    the way SGLang's and vllm-router's cache-aware routers do. When load is imbalanced
    (max - min > ``balance_abs`` and max > ``balance_rel`` x min) it takes the least loaded
    worker; otherwise the longest match if it covers more than ``threshold`` of the prompt,
    else the least loaded worker. Each worker's tree forgets least recently used leaves
    beyond ``capacity_blocks``; it never sees the engines' real evictions. Defaults are
    SGLang's router defaults (cache_threshold 0.3, balance 64 / 1.5, a tree of 2**26 chars,
    i.e. about 2**24 tokens, which never fills in this benchmark).

    With ``load_tokens`` the tree's matches go through ``cheapest`` instead, the rule the
    "+load" variants of kvroute and the oracle use: then only the knowledge differs.

    The tree is kept as a prefix-closed set of chained block keys; on insert, keys are touched
    deepest first so a parent is always more recent than its children (leaves go first)."""

    def __init__(self, workers: Sequence[FleetWorker], block_size: int,
                 capacity_blocks: int = 2**24 // 16, threshold: float = 0.3,
                 balance_abs: int = 64, balance_rel: float = 1.5,
                 load_tokens: int | None = None) -> None:
        self.name = "approx-tree" if load_tokens is None else "approx-tree+load"
        self._load_tokens = load_tokens
        self._workers = workers
        self._bs = block_size
        self._cap = capacity_blocks
        self._threshold = threshold
        self._balance = (balance_abs, balance_rel)
        self._trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in workers]

    def _keys(self, prompt: Sequence[int]) -> list[int]:
        keys, parent = [], 0
        for start in range(0, len(prompt) - self._bs + 1, self._bs):
            parent = hash((parent, tuple(prompt[start : start + self._bs])))
            keys.append(parent)
        return keys

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        keys = self._keys(prompt)
        matched = []
        for tree in self._trees:
            n = 0
            while n < len(keys) and keys[n] in tree:
                n += 1
            matched.append(n)
        best = max(matched)
        loads = [w.engine.load() for w in self._workers]
        imbalanced = (max(loads) - min(loads) > self._balance[0]
                      and max(loads) > self._balance[1] * min(loads))
        if self._load_tokens is not None:
            choice = cheapest(self._workers, [m * self._bs for m in matched], len(prompt),
                              self._load_tokens)
        elif not imbalanced and keys and best * self._bs > self._threshold * len(prompt):
            choice = _least_loaded(self._workers, [i for i, m in enumerate(matched) if m == best])
        else:
            choice = _least_loaded(self._workers)
        tree = self._trees[choice]
        for key in reversed(keys):
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > self._cap:
            tree.popitem(last=False)
        return choice


class ReplicatedRouter:
    """``replicas`` independent copies of a router, each request handled by one of them at
    random: how a router deployed for availability sees traffic (each copy learns only its
    own share)."""

    def __init__(self, replicas: list[Policy], seed: int = 0) -> None:
        self._replicas = replicas
        self._rng = random.Random(seed)
        self.name = f"{replicas[0].name}/{len(replicas)}r"

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        return self._rng.choice(self._replicas).choose(prompt, cache_salt)


class OraclePolicy:
    """Reads every engine's real cache at routing time. Without ``load_tokens``: the longest
    cached prefix wins, ties go to the least loaded. With it: ``cheapest``."""

    def __init__(self, workers: Sequence[FleetWorker], load_tokens: int | None = None) -> None:
        self._workers = workers
        self._load_tokens = load_tokens
        self.name = "oracle" if load_tokens is None else "oracle+load"

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        matched = [w.engine.lookup(prompt, cache_salt) for w in self._workers]
        if self._load_tokens is not None:
            return cheapest(self._workers, matched, len(prompt), self._load_tokens)
        best = max(matched)
        return _least_loaded(self._workers, [i for i, m in enumerate(matched) if m == best])


class KvroutePolicy:
    """kvroute through its HTTP API: ``POST /v1/route {"token_ids": [...]}``, with the
    request's ``cache_salt`` unless ``blind`` (a gateway that does not pass tenants' salts
    on: kvroute then sees every tenant's blocks as the unsalted prompt's, which vLLM never
    shares). Without ``load_tokens`` the service's own pick is taken; with it, the answer's
    per-worker ``scores`` go through ``cheapest`` (the caller's own policy, as the API
    intends)."""

    def __init__(self, client: httpx.Client, base_url: str,
                 worker_of: dict[tuple[str, int], int], workers: Sequence[FleetWorker],
                 load_tokens: int | None = None, *, blind: bool = False) -> None:
        self._client = client
        self._url = f"{base_url}/v1/route"
        self._worker_of = worker_of
        self._workers = workers
        self._load_tokens = load_tokens
        self._blind = blind
        self.name = ("kvroute" if load_tokens is None else "kvroute+load") + (
            "-blind" if blind else "")

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        question: dict[str, Any] = {"token_ids": list(prompt)}
        if cache_salt is not None and not self._blind:
            question["cache_salt"] = cache_salt
        resp = self._client.post(self._url, json=question)
        if resp.status_code != 200:
            raise RuntimeError(f"kvroute answered {resp.status_code}: {resp.text[:300]}")
        answer: dict[str, Any] = resp.json()
        if self._load_tokens is None:
            return self._worker_of[(answer["instance"], int(answer["dp_rank"]))]
        matched = [0] * len(self._workers)
        for score in answer["scores"]:
            matched[self._worker_of[(score["instance"], int(score["dp_rank"]))]] = int(
                score["matched_tokens"])
        return cheapest(self._workers, matched, len(prompt), self._load_tokens)


class KvrouteProxyPolicy:
    """kvroute in proxy mode: the service's own pick (``POST /v1/route`` on a service
    started with ``proxy = true``), its in-flight ledger fed the way the proxy feeds it: a
    ticket with the chosen worker's uncached tokens opened when the request is placed,
    ``started()`` at its first token, ``close()`` at its end.

    ``inflight`` is the running service's own ledger. The simulation drives it from its own
    thread, but only between its HTTP calls: the service reads the ledger only while it
    answers one of them, so the two never touch it at the same time."""

    name = "kvroute-proxy"

    def __init__(self, client: httpx.Client, base_url: str,
                 worker_of: dict[tuple[str, int], int], inflight: InFlight) -> None:
        self._client = client
        self._url = f"{base_url}/v1/route"
        self._worker_of = worker_of
        self._inflight = inflight
        self._chosen: tuple[tuple[str, int], int] | None = None
        self._tickets: dict[str, Ticket] = {}

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        question: dict[str, Any] = {"token_ids": list(prompt)}
        if cache_salt is not None:
            question["cache_salt"] = cache_salt
        resp = self._client.post(self._url, json=question)
        if resp.status_code != 200:
            raise RuntimeError(f"kvroute answered {resp.status_code}: {resp.text[:300]}")
        answer: dict[str, Any] = resp.json()
        key = (answer["instance"], int(answer["dp_rank"]))
        self._chosen = (key, len(prompt) - int(answer["matched_tokens"]))
        return self._worker_of[key]

    def placed(self, request_id: str) -> None:
        assert self._chosen is not None, "placed() follows choose()"
        key, uncached = self._chosen
        self._chosen = None
        self._tickets[request_id] = self._inflight.open(key, uncached)

    def first_token(self, request_id: str) -> None:
        self._tickets[request_id].started()

    def finished(self, request_id: str) -> None:
        self._tickets.pop(request_id).close()


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
