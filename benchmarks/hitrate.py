"""Routing hit-rate benchmark: which router keeps vLLM's prefix caches warm?

For every workload and every policy, a fresh simulated fleet (kvroute.sim) serves the same seeded
requests in virtual time; only the routing differs. Reported per (workload, policy):
prefix-cache hit rate (cached prompt tokens / prompt tokens, as vLLM counts them), recomputed
prompt tokens, load imbalance (max / mean requests per worker), TTFT p50/p90 from the engine's
time model, and the real wall-clock latency of each routing decision (for kvroute: the HTTP
round trip of ``POST /v1/route``), beside an HTTP floor measured in the same run.

Realism of kvroute's view: the fleet runs real ZMQ publishers, kvroute a real subscriber and
index. A step's events are published when virtual time passes the end of that step plus
``--event-lag-ms`` (vLLM sends them after the forward pass); before each routing decision the
benchmark waits until kvroute has applied everything published so far, so the index is exactly
as stale as the lag makes it, no more (machine noise) and no less. The oracle reads the engines'
caches directly, including blocks scheduled in a step that has not finished yet.

Closed loop (``--clients 1,4,16``): each workload runs once per client count, C clients each
sending its next session when the last one ended, so requests overlap in engine time the
way concurrent users make them; ``kvroute-proxy`` is then kvroute's proxy decision with the
proxy's in-flight accounting (see ``benchmarks.policies.KvrouteProxyPolicy``).

Usage: python -m benchmarks.hitrate [--quick | --full] [--clients N,...] [--out bench-out]
       [--seed N] [--policies ...] [--workloads ...]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.policies import (
    ApproximateTreePolicy,
    ConsistentHashPolicy,
    FleetWorker,
    FollowsRequests,
    KvroutePolicy,
    KvrouteProxyPolicy,
    LeastLoadedPolicy,
    OraclePolicy,
    Policy,
    RandomPolicy,
    ReplicatedRouter,
    RoundRobinPolicy,
)
from kvroute.app.ingest.wire import Event
from kvroute.sim.cluster import SimCluster
from kvroute.sim.engine import Engine, TimeModel
from kvroute.sim.rank import SimRank
from kvroute.sim.workloads import (
    Session,
    load_mooncake,
    multi_turn_chat,
    shared_system_prompts,
    tenants,
)

POLICIES = ("random", "round-robin", "least-loaded", "consistent-hash", "approx-tree",
            "approx-tree/2r", "kvroute", "kvroute-blind", "kvroute-proxy", "oracle",
            "approx-tree+load", "kvroute+load", "oracle+load")
KVROUTE_POLICIES = ("kvroute", "kvroute+load", "kvroute-proxy")
#: Pairs compared for index fidelity: same decision rule, kvroute's view vs the true caches.
PAIRS = (("kvroute", "oracle", "approx-tree"),
         ("kvroute+load", "oracle+load", "approx-tree+load"))
TRACE = Path(__file__).resolve().parent / "traces" / "sample_mooncake.jsonl"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    sessions: Callable[[int], list[Session]]
    num_blocks: int  # per engine, vLLM's count (one is the reserved null block)


def workloads(full: bool) -> list[WorkloadSpec]:
    """Quick: scaled so the whole run stays under two minutes on two shared cores, keeping
    the property that matters: the fleet's caches cannot hold every prefix everywhere."""
    if full:
        shared = dict(groups=150, prompts_per_group=5, system_tokens=6000, question_tokens=1200,
                      output_tokens=64, rate_per_s=12.0)
        chat = dict(sessions=200, turns=8, rate_per_s=4.0)
        trace = dict(max_requests=None, max_output_tokens=256)
        blocks = (8000, 1200, 1400)
    else:
        shared = dict(groups=40, prompts_per_group=5, system_tokens=1500, question_tokens=300,
                      output_tokens=16, rate_per_s=30.0)
        chat = dict(sessions=48, turns=5, rate_per_s=4.0)
        trace = dict(max_requests=250, max_output_tokens=48)
        blocks = (600, 500, 900)
    return [
        WorkloadSpec("shared-system-prompts",
                     lambda seed: shared_system_prompts(seed=seed, **shared), blocks[0]),
        WorkloadSpec("multi-turn-chat", lambda seed: multi_turn_chat(seed=seed, **chat),
                     blocks[1]),
        WorkloadSpec("mooncake-trace", lambda seed: load_mooncake(TRACE, seed=seed, **trace),
                     blocks[2]),
        # The shared prompts again, from four tenants with salts of their own: kvroute with
        # the salts beside kvroute blind to them (a gateway that drops them) and the rest.
        WorkloadSpec("tenants", lambda seed: tenants(
            seed=seed, tenants=4, **{**shared, "groups": shared["groups"] // 4}), blocks[0]),
    ]


# --- the simulation ------------------------------------------------------------------------------


@dataclass
class RunResult:
    outcomes: list[Any] = field(default_factory=list)
    route_s: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    per_worker: list[int] = field(default_factory=list)
    sync_timeouts: int = 0
    kvroute_url: str = ""


class KvrouteFeed:
    """Publishes each step's events once virtual time passes ``visible_at`` and waits until
    kvroute has applied them (its worker ``last_seq``), so kvroute's index is exactly as stale
    as the modelled lag."""

    def __init__(self, ranks: list[SimRank], client: httpx.Client, base: str,
                 ids: list[tuple[str, int]]) -> None:
        self._ranks = ranks
        self._client = client
        self._base = base
        self._ids = ids  # worker index -> (kvroute instance id, dp rank)
        self._pending: list[deque[tuple[float, list[Event]]]] = [deque() for _ in ranks]
        self.timeouts = 0

    def add(self, worker: int, visible_at: float, events: list[Event]) -> None:
        self._pending[worker].append((visible_at, events))

    def advance(self, now: float) -> float:
        """Publish what is due; returns the real seconds spent waiting for kvroute."""
        want: dict[str, dict[int, int]] = {}
        for w, queue in enumerate(self._pending):
            while queue and queue[0][0] <= now:
                _, events = queue.popleft()
                seq = self._ranks[w].publish(events)
                if seq is not None:
                    inst, rank = self._ids[w]
                    want.setdefault(inst, {})[rank] = seq
        if not want:
            return 0.0
        started = time.perf_counter()
        deadline = time.monotonic() + 10.0
        for inst, seqs in want.items():
            while not self._caught_up(inst, seqs):
                if time.monotonic() > deadline:
                    self.timeouts += 1
                    break
                time.sleep(0.0003)
        return time.perf_counter() - started

    def _caught_up(self, inst: str, seqs: dict[int, int]) -> bool:
        detail = self._client.get(f"{self._base}/v1/instances/{inst}").json()
        have = {w["dp_rank"]: w["stats"].get("last_seq") for w in detail["workers"]}
        return all(have.get(r) is not None and have[r] >= s for r, s in seqs.items())


def simulate(sessions: Sequence[Session], workers: list[FleetWorker], policy: Policy, *,
             lag_s: float, feed: KvrouteFeed | None = None, clients: int | None = None,
             progress: tqdm | None = None) -> RunResult:
    """Discrete-event run: each engine steps back to back while it has work; a chat's next
    turn arrives after its think time.

    Open loop (``clients`` None): each session starts at its own ``start``. Closed loop
    (``clients`` C): the sessions' start times are ignored; C clients each run one session
    after another, the next starting when the previous one's last turn finished, so exactly
    C sessions overlap, like C concurrent users.

    A policy that follows its requests (``FollowsRequests``, as kvroute's proxy does) hears
    of each request's first token and end at the virtual time the engine produced them."""
    res = RunResult(per_worker=[0] * len(workers))
    order = itertools.count()
    follows = policy if isinstance(policy, FollowsRequests) else None
    heap: list[tuple[float, int, int, str, Any]] = []
    if clients is None:
        for s, session in enumerate(sessions):
            heapq.heappush(heap, (session.start, 0, next(order), "arrive", (s, 0)))
        unstarted = len(sessions)
    else:
        for s in range(min(clients, len(sessions))):
            heapq.heappush(heap, (0.0, 0, next(order), "arrive", (s, 0)))
        unstarted = min(clients, len(sessions))
    stepping = [False] * len(workers)
    origin: dict[str, tuple[int, int]] = {}
    while heap:
        now, _, _, kind, data = heapq.heappop(heap)
        if kind == "arrive":
            s, k = data
            turn = sessions[s].turns[k]
            if feed is not None:
                res.sync_s.append(feed.advance(now))
            started = time.perf_counter()
            salt = sessions[s].cache_salt
            w = policy.choose(turn.prompt, salt)
            res.route_s.append(time.perf_counter() - started)
            res.per_worker[w] += 1
            workers[w].assigned += 1
            engine = workers[w].engine
            rid = f"s{s}t{k}"
            origin[rid] = (s, k)
            if follows is not None:
                follows.placed(rid)
            engine.add_request(rid, turn.prompt, turn.output, arrival_time=now, cache_salt=salt)
            if not stepping[w]:
                stepping[w] = True
                heapq.heappush(heap, (max(now, engine.clock), 1, next(order), "step", w))
            continue
        if kind == "observe":
            assert follows is not None
            first_tokens, finished = data
            for rid in first_tokens:
                follows.first_token(rid)
            for rid in finished:
                follows.finished(rid)
            continue
        w = data
        engine = workers[w].engine
        step = engine.step(now=now)
        if feed is not None and step.events:
            feed.add(w, step.end + lag_s, step.events)
        if follows is not None and (step.first_token_ids or step.finished):
            # Before any arrival at the same instant: the answer's bytes came first.
            heapq.heappush(heap, (step.end, -1, next(order), "observe", (
                list(step.first_token_ids), [o.request_id for o in step.finished])))
        for outcome in step.finished:
            res.outcomes.append(outcome)
            s, k = origin.pop(outcome.request_id)
            if progress is not None:
                progress.update(1)
            if k + 1 < len(sessions[s].turns):
                heapq.heappush(heap, (outcome.finish_time + sessions[s].think_s, 0,
                                      next(order), "arrive", (s, k + 1)))
            elif clients is not None and unstarted < len(sessions):
                heapq.heappush(heap, (outcome.finish_time, 0, next(order), "arrive",
                                      (unstarted, 0)))
                unstarted += 1
        if engine.has_work():
            heapq.heappush(heap, (step.end, 1, next(order), "step", w))
        else:
            stepping[w] = False
    if feed is not None:
        res.sync_timeouts = feed.timeouts
    return res


# --- fleets ---------------------------------------------------------------------------------------


def engine_fleet(n: int, num_blocks: int, seed: int) -> list[FleetWorker]:
    """In-process engines only: every policy but kvroute needs nothing else."""
    return [
        FleetWorker(i, i, 0, Engine(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                    seed=(seed * 7919 + i) * 1009, time_model=TimeModel()))
        for i in range(n)
    ]


def run_kvroute(sessions: Sequence[Session], n: int, num_blocks: int, seed: int, lag_s: float,
                load_tokens: int | None, progress: tqdm | None, *, proxy: bool = False,
                clients: int | None = None, blind: bool = False,
                ) -> tuple[RunResult, dict[str, float]]:
    """The fleet as real simulated vLLM servers, kvroute as a real service registering them by
    URL; returns the run and the HTTP floor (GET /healthz round trip) measured alongside.

    Three ways to use kvroute: its own pick (``kvroute``); its scores through the caller's
    ``cheapest`` rule (``load_tokens`` given: ``kvroute+load``); or as its proxy decides
    (``proxy``: ``kvroute-proxy``), with the proxy's in-flight ledger. ``blind``: its own
    pick, asked without the tenants' cache salts (``kvroute-blind``)."""
    from kvroute.app.config import Settings  # the service is only needed for this policy
    from kvroute.app.server import BackgroundServer

    with SimCluster(n=n, block_size=BLOCK_SIZE, num_blocks=num_blocks, seed=seed) as cluster:
        # The fleet runs in virtual time, so the service's own /metrics scrapes (real time)
        # would read it at arbitrary moments: kvroute answers without them here. The "+load"
        # variant prices the exact queues itself from the answer's scores; the proxy variant
        # has the proxy's own exact view of what it forwarded. A caller that overrides
        # kvroute's choice must turn placement guesses off: they assume the answer is followed.
        settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                            ready_grace_seconds=5, load_interval=0.0, proxy=proxy,
                            placement_ttl=0.0 if load_tokens is not None else 2.0)
        with BackgroundServer(settings) as server, httpx.Client(timeout=30) as client:
            ids = []
            for url in cluster.urls:
                resp = client.post(f"{server.url}/v1/instances", json={"url": url})
                if resp.status_code != 201:
                    raise RuntimeError(f"registering {url} failed: {resp.text[:300]}")
                ids.append(resp.json()["id"])
            _wait_live(client, server.url, ids)
            ranks = [rank for _, rank in cluster.ranks]
            workers = [FleetWorker(i, inst, rank.rank, rank.engine)
                       for i, (inst, rank) in enumerate(cluster.ranks)]
            keys = [(ids[inst], rank.rank) for inst, rank in cluster.ranks]
            worker_of = {k: i for i, k in enumerate(keys)}
            policy: Policy
            if proxy:
                policy = KvrouteProxyPolicy(client, server.url, worker_of,
                                            server.service.inflight)
            else:
                policy = KvroutePolicy(client, server.url, worker_of, workers, load_tokens,
                                       blind=blind)
            feed = KvrouteFeed(ranks, client, server.url, keys)
            floor = _http_floor(client, server.url)
            result = simulate(sessions, workers, policy, lag_s=lag_s, feed=feed,
                              clients=clients, progress=progress)
            if proxy and server.service.inflight.total():
                raise RuntimeError(f"in-flight accounting leaked: "
                                   f"{server.service.inflight.total()} requests still open")
            result.kvroute_url = server.url
            floor_after = _http_floor(client, server.url)
    return result, {k: min(floor[k], floor_after[k]) for k in floor}


def _wait_live(client: httpx.Client, base: str, ids: list[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {i["id"]: i["state"] for i in client.get(f"{base}/v1/instances").json()[
            "instances"]}
        if all(states.get(i) == "live" for i in ids):
            return
        time.sleep(0.05)
    raise RuntimeError(f"kvroute workers not live after {timeout}s: {states}")


def _http_floor(client: httpx.Client, base: str, n: int = 200) -> dict[str, float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        client.get(f"{base}/healthz")
        samples.append(time.perf_counter() - started)
    return {"p50": _pct(samples, 50), "p99": _pct(samples, 99)}


# --- reporting ------------------------------------------------------------------------------------


def _pct(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def summarize(res: RunResult) -> dict[str, Any]:
    prompt = sum(o.prompt_tokens for o in res.outcomes)
    cached = sum(o.cached_tokens for o in res.outcomes)
    ttft = [o.ttft for o in res.outcomes]
    loads = res.per_worker
    return {
        "requests": len(res.outcomes),
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "recomputed_tokens": prompt - cached,
        "load_imbalance": max(loads) / statistics.mean(loads) if sum(loads) else 0.0,
        "ttft_p50_ms": 1000 * _pct(ttft, 50),
        "ttft_p90_ms": 1000 * _pct(ttft, 90),
        "route_p50_us": 1e6 * _pct(res.route_s, 50),
        "route_p99_us": 1e6 * _pct(res.route_s, 99),
        "preemptions": sum(o.preemptions for o in res.outcomes),
        **({"index_sync_p50_ms": 1000 * _pct(res.sync_s, 50),
            "sync_timeouts": res.sync_timeouts} if res.sync_s else {}),
    }


def verdicts(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The targets, checked against this run's own numbers: each kvroute variant against the
    oracle that applies the same decision rule to the true caches, and every kvroute variant
    against round-robin (never below it; at least twice it on shared prompts)."""
    out: dict[str, Any] = {}
    for wl, by_policy in results.items():
        for kv_name, oracle_name, tree_name in PAIRS:
            kv = by_policy.get(kv_name)
            if kv is None:
                continue
            checks: dict[str, Any] = out.setdefault(wl, {}).setdefault(kv_name, {})
            if oracle_name in by_policy:
                gap = by_policy[oracle_name]["hit_rate"] - kv["hit_rate"]
                checks[f"gap_to_{oracle_name}_points"] = round(100 * gap, 2)
                checks["within_3_points_of_oracle"] = gap <= 0.03
            # the same rule's tree, and the tree behind two router replicas
            for tree_variant in (tree_name, f"{tree_name}/2r"):
                if tree_variant in by_policy:
                    tree = by_policy[tree_variant]["hit_rate"]
                    checks[f"ahead_of_{tree_variant}"] = kv["hit_rate"] > tree
                    checks[f"points_over_{tree_variant}"] = round(
                        100 * (kv["hit_rate"] - tree), 2)
        rr = by_policy.get("round-robin", {}).get("hit_rate")
        for kv_name in KVROUTE_POLICIES:
            if kv_name not in by_policy or rr is None:
                continue
            hit = by_policy[kv_name]["hit_rate"]
            checks = out.setdefault(wl, {}).setdefault(kv_name, {})
            checks["x_round_robin"] = round(hit / rr, 2) if rr else None
            checks["at_least_round_robin"] = hit >= rr
            if wl.startswith("shared-system-prompts"):
                checks["at_least_2x_round_robin"] = hit >= 2 * rr
        # Tenants: the salts are what tell kvroute that a tenant's copy is not another's.
        blind = by_policy.get("kvroute-blind", {}).get("hit_rate")
        if "kvroute" in by_policy and blind is not None:
            checks = out.setdefault(wl, {}).setdefault("kvroute", {})
            hit = by_policy["kvroute"]["hit_rate"]
            checks["points_over_kvroute-blind"] = round(100 * (hit - blind), 2)
            if wl.startswith("tenants"):
                checks["ahead_of_kvroute-blind"] = hit > blind
    return out


def table(results: dict[str, dict[str, dict[str, Any]]], floor: dict[str, float]) -> str:
    head = (f"{'workload':<26} {'policy':<16} {'hit rate':>8} {'recomputed':>11} "
            f"{'imbal':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'route p50':>10} {'route p99':>10}")
    lines = [head, "-" * len(head)]
    for wl, by_policy in results.items():
        for name, r in by_policy.items():
            lines.append(
                f"{wl:<26} {name:<16} {100 * r['hit_rate']:7.1f}% {r['recomputed_tokens']:>11,} "
                f"{r['load_imbalance']:6.2f} {r['ttft_p50_ms']:7.0f}ms {r['ttft_p90_ms']:7.0f}ms "
                f"{r['route_p50_us']:8.0f}us {r['route_p99_us']:8.0f}us")
        lines.append("")
    if floor:
        lines.append("HTTP floor (GET /healthz on kvroute, same run): "
                     f"p50 {1e6 * floor['p50']:.0f}us, p99 {1e6 * floor['p99']:.0f}us")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    policies = [p for p in POLICIES if any(p in results[w] for w in names)]
    width = 0.8 / len(policies)
    colors = plt.get_cmap("tab20").colors  # 11 policies: tab10 would repeat a colour
    files = []
    for metric, label, fname in (("hit_rate", "prefix-cache hit rate", "hitrate.png"),
                                 ("ttft_p50_ms", "TTFT p50 (ms, modelled)", "ttft_p50.png"),
                                 ("ttft_p90_ms", "TTFT p90 (ms, modelled)", "ttft_p90.png")):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        for j, policy in enumerate(policies):
            xs = [i + j * width for i in range(len(names))]
            ys = [results[w].get(policy, {}).get(metric, 0.0) for w in names]
            ax.bar(xs, ys, width, label=policy, color=colors[j % len(colors)])
        ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(names))], names)
        ax.set_ylabel(label)
        top = max((results[w].get(p, {}).get(metric, 0.0) for w in names for p in policies),
                  default=1.0)
        ax.set_ylim(0, 1.35 * top or 1.0)  # room for the legend above the bars
        ax.legend(ncol=4, fontsize=8, loc="upper left")
        ax.set_title(f"{label} per routing policy")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        files.append(str(out / fname))
    return files


# --- main -----------------------------------------------------------------------------------------


def make_policy(name: str, workers: list[FleetWorker], seed: int, load_tokens: int) -> Policy:
    if name == "random":
        return RandomPolicy(workers, seed)
    if name == "round-robin":
        return RoundRobinPolicy(workers)
    if name == "least-loaded":
        return LeastLoadedPolicy(workers)
    if name == "consistent-hash":
        return ConsistentHashPolicy(workers, BLOCK_SIZE)
    if name.startswith("approx-tree"):
        load = load_tokens if "+load" in name else None
        replicas = int(name.rsplit("/", 1)[1].rstrip("r")) if "/" in name else 1
        trees: list[Policy] = [ApproximateTreePolicy(workers, BLOCK_SIZE, load_tokens=load)
                               for _ in range(replicas)]
        return trees[0] if replicas == 1 else ReplicatedRouter(trees, seed)
    if name == "oracle":
        return OraclePolicy(workers)
    if name == "oracle+load":
        return OraclePolicy(workers, load_tokens)
    raise ValueError(f"unknown policy {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="scaled-down run (default)")
    size.add_argument("--full", action="store_true", help="llm-d-sized shared prompts etc.")
    parser.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--event-lag-ms", type=float, default=5.0,
                        help="virtual delay from a step's end to kvroute seeing its events")
    parser.add_argument("--load-tokens", type=int, default=256,
                        help="the +load policies' price of one queued request, in prefill tokens")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated subset of " + ",".join(POLICIES))
    parser.add_argument("--workloads", default=None, help="comma-separated subset of workloads")
    parser.add_argument("--clients", default=None,
                        help="comma-separated counts of concurrent clients (closed loop: each "
                             "sends its next session when the last one finished); default: "
                             "open loop, every session at its own arrival time")
    args = parser.parse_args(argv)
    try:
        levels: list[int | None] = ([int(c) for c in args.clients.split(",") if c.strip()]
                                    if args.clients else [None])
    except ValueError:
        parser.error(f"--clients: not a comma-separated list of integers: {args.clients!r}")
    if not levels or any(c is not None and c < 1 for c in levels):
        parser.error("--clients: every count must be at least 1")
    chosen = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies: {', '.join(unknown)}")
    specs = workloads(args.full)
    if args.workloads:
        wanted = {w.strip() for w in args.workloads.split(",")}
        missing = sorted(wanted - {s.name for s in specs})
        if missing:
            parser.error(f"unknown workloads: {', '.join(missing)}")
        specs = [s for s in specs if s.name in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    sessions = {spec.name: spec.sessions(args.seed) for spec in specs}
    total = (sum(len(s.turns) for ss in sessions.values() for s in ss) * len(chosen)
             * len(levels))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    floor: dict[str, float] = {}
    lag_s = args.event_lag_ms / 1000
    with tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True) as progress:
        for spec in specs:
            for clients in levels:
                label = spec.name if clients is None else f"{spec.name} x{clients}"
                results[label] = {}
                for name in chosen:
                    progress.set_description(f"{label}: {name}")
                    if name.startswith("kvroute"):
                        load = args.load_tokens if name == "kvroute+load" else None
                        run, run_floor = run_kvroute(
                            sessions[spec.name], args.instances, spec.num_blocks, args.seed,
                            lag_s, load, progress, proxy=name == "kvroute-proxy",
                            clients=clients, blind=name == "kvroute-blind")
                        floor = {k: min(v, floor.get(k, v)) for k, v in run_floor.items()}
                    else:
                        workers = engine_fleet(args.instances, spec.num_blocks, args.seed)
                        policy = make_policy(name, workers, args.seed, args.load_tokens)
                        run = simulate(sessions[spec.name], workers, policy, lag_s=lag_s,
                                       clients=clients, progress=progress)
                    results[label][name] = summarize(run)
    report = {
        "benchmark": "hitrate",
        "mode": "full" if args.full else "quick",
        "instances": args.instances,
        "block_size": BLOCK_SIZE,
        "event_lag_ms": args.event_lag_ms,
        "load_tokens": args.load_tokens,
        "seed": args.seed,
        "clients": levels,
        "time_model": TimeModel().__dict__ if hasattr(TimeModel(), "__dict__") else {
            f: getattr(TimeModel(), f) for f in TimeModel.__slots__},
        "workloads": {s.name: {"requests": sum(len(x.turns) for x in sessions[s.name]),
                               "num_blocks": s.num_blocks} for s in specs},
        "http_floor_us": {k: 1e6 * v for k, v in floor.items()},
        "results": results,
        "targets": verdicts(results),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    report["plots"] = plot(results, out)
    (out / "hitrate.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    print()
    print(table(results, floor))
    print(f"\ntargets: {json.dumps(report['targets'])}")
    print(f"wrote {out / 'hitrate.json'} and {len(report['plots'])} plots in "
          f"{report['wall_seconds']}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
