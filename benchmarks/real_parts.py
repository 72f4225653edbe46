"""The pure parts of ``benchmarks.real_hitrate``: workloads, the client driver, metric
deltas, statistics, the table. Nothing here starts a process or talks to a network, so the
unit tests (benchmarks/tests/test_real_hitrate_parts.py) run them without vLLM.

Workloads are token-id prompts (the engines run with ``--skip-tokenizer-init``), seeded so
every run and every router sends exactly the same requests in the same order.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from e2e.workloads import random_tokens

SHARED = "shared-system-prompts"
CHAT = "multi-turn-chat"
WORKLOADS = (SHARED, CHAT)
ROUTERS = ("round-robin", "partition", "kvroute-route", "kvroute-proxy",
           "nginx-kvroute", "haproxy-kvroute", "nginx-rr", "haproxy-rr",
           "kvroute-2r", "kvroute-2r-roll", "kvroute-2r-cold")
#: Router -> (replicas share state through a redis-server, each restarted in turn mid-run):
#: two kvroute replicas answering ``POST /v1/route``, the client alternating between the
#: ones in service (a load balancer with readiness checks). ``kvroute-2r-cold`` is the
#: control of ``kvroute-2r-roll``: the same restarts without shared state, so a restarted
#: replica knows only what the engines' replay buffers still hold.
REPLICAS = {"kvroute-2r": (True, False), "kvroute-2r-roll": (True, True),
            "kvroute-2r-cold": (False, True)}
REPLICA_COUNT = 2
#: Router -> (balancer, whether it asks kvroute): nginx or HAProxy with deploy/'s files,
#: routing with kvroute, or plain round robin (the same files, the routing hook removed).
BALANCERS = {"nginx-kvroute": ("nginx", True), "haproxy-kvroute": ("haproxy", True),
             "nginx-rr": ("nginx", False), "haproxy-rr": ("haproxy", False)}
#: The router each one's added latency is measured against, in the same run.
BASELINES = {"kvroute-route": "round-robin", "kvroute-proxy": "round-robin",
             "nginx-kvroute": "nginx-rr", "haproxy-kvroute": "haproxy-rr",
             **dict.fromkeys(REPLICAS, "round-robin")}


# --- replicas -----------------------------------------------------------------------------------


def restart_points(requests: int, replicas: int) -> list[int]:
    """For a rolling restart: replica i is restarted once this many requests are done (the
    run cut into ``replicas + 1`` equal parts, one restart at each inner boundary)."""
    return [requests * (i + 1) // (replicas + 1) for i in range(replicas)]


def restart_windows(requests: int, replicas: int) -> list[tuple[int, int]]:
    """The request index ranges right after each restart point, half a part long each: where
    a restarted replica's knowledge shows (the same ranges in a run without restarts)."""
    width = max(1, requests // (2 * (replicas + 1)))
    return [(p, min(requests, p + width)) for p in restart_points(requests, replicas)]


def window_hit_rate(outcomes: Iterable[Outcome], windows: Sequence[tuple[int, int]]
                    ) -> float | None:
    """cached_tokens / prompt_tokens (as the responses reported them) over the answered
    requests whose index is in one of ``windows`` ([start, end)); None without any."""
    cached = prompt = 0
    for o in outcomes:
        if (o.error is None and o.cached_tokens is not None
                and any(a <= o.index < b for a, b in windows)):
            cached += o.cached_tokens
            prompt += o.prompt_tokens
    return cached / prompt if prompt else None


def replica_order(index: int, in_service: Sequence[bool]) -> list[int]:
    """The replicas to ask for request ``index``, in order: those in service, rotated by the
    index (round robin), and then the others (a failover of last resort: a replica taken out
    of service may still answer while it shuts down)."""
    up = [i for i, ok in enumerate(in_service) if ok]
    down = [i for i, ok in enumerate(in_service) if not ok]
    if up:
        k = index % len(up)
        up = up[k:] + up[:k]
    return up + down


# --- workloads ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    group: int  # system prompt id or chat session id: the static partition's key
    after: int | None = None  # a request that must have finished first (the previous turn)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    description: str
    groups: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    def summary(self) -> dict[str, Any]:
        lengths = [len(r.prompt) for r in self.requests]
        return {"requests": len(self.requests), "groups": self.groups,
                "prompt_tokens": sum(lengths), "min_prompt": min(lengths, default=0),
                "max_prompt": max(lengths, default=0), "description": self.description}


def shared_system_prompts(seed: int, requests: int = 120, systems: int = 6,
                          system_tokens: int = 480, question: tuple[int, int] = (60, 120)
                          ) -> Workload:
    """Each request: one of ``systems`` system prompts (chosen uniformly) + a fresh question."""
    rng = random.Random(f"{seed}/{SHARED}")
    heads = [random_tokens(rng, system_tokens) for _ in range(systems)]
    out = []
    for i in range(requests):
        group = rng.randrange(systems)
        out.append(Request(i, heads[group] + random_tokens(rng, rng.randint(*question)), group))
    return Workload(SHARED, out, f"{systems} system prompts of {system_tokens} tokens, "
                    f"questions of {question[0]}-{question[1]} tokens", systems)


def multi_turn_chat(seed: int, requests: int = 120, active: int = 8,
                    opening: tuple[int, int] = (64, 160), user: tuple[int, int] = (30, 90),
                    reply: tuple[int, int] = (20, 60), max_turns: int = 8,
                    max_prompt: int = 896) -> Workload:
    """Chat sessions, ``active`` of them open at a time; the next request is a turn of a
    random open session. Every turn resends the whole conversation so far (the session's
    opening, each user turn and a seeded stand-in for each assistant reply) plus a new user
    turn, and waits for the session's previous turn to finish (``after``). A session ends
    after ``max_turns`` or when its next prompt could pass ``max_prompt`` tokens, and a new
    one opens in its place. The stand-in replies are not what the engine generated, so the
    cacheable part of a turn is the previous turn's prompt (its full blocks), as in a chat
    whose client re-renders the assistant's answer."""
    if opening[1] + user[1] > max_prompt:
        raise ValueError("a first turn could exceed max_prompt")
    rng = random.Random(f"{seed}/{CHAT}")
    sessions = 0
    # per open session: [session id, conversation so far, turns sent, last request index]
    slots: list[list[Any]] = []

    def open_session() -> list[Any]:
        nonlocal sessions
        sessions += 1
        return [sessions - 1, random_tokens(rng, rng.randint(*opening)), 0, None]

    slots = [open_session() for _ in range(active)]
    out: list[Request] = []
    while len(out) < requests:
        slot = rng.randrange(active)
        sid, history, turns, last = slots[slot]
        prompt = history + random_tokens(rng, rng.randint(*user))
        out.append(Request(len(out), prompt, sid, last))
        history = prompt + random_tokens(rng, rng.randint(*reply))
        turns += 1
        if turns >= max_turns or len(history) + user[1] > max_prompt:
            slots[slot] = open_session()
        else:
            slots[slot] = [sid, history, turns, len(out) - 1]
    return Workload(CHAT, out, f"{active} open sessions at a time, every turn resends the "
                    f"conversation, prompts <= {max_prompt} tokens", sessions)


def make_workload(name: str, seed: int, requests: int) -> Workload:
    if name == SHARED:
        return shared_system_prompts(seed, requests)
    if name == CHAT:
        return multi_turn_chat(seed, requests)
    raise ValueError(f"unknown workload {name!r}")


# --- the client driver --------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    prompt_tokens: int
    engine: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    ttft_s: float | None = None
    latency_s: float | None = None
    route_s: float | None = None
    headers_s: float | None = None  # to the response's headers, routing included
    fallback: str | None = None  # a balancer's x-kvroute-fallback: why it did not route
    error: str | None = None
    abandoned: bool = False
    waited_s: float = 0.0  # time spent waiting for the previous turn (not part of TTFT)
    sent_at: float | None = None  # time.monotonic() when the client started sending it
    repeat: int = 0  # which repetition of its (workload, router, concurrency) cell
    # kvroute-route: each scored worker as "instance matched/prefill+queue" (the answer's
    # cost terms), so that a request sent away from its prefix's holder can be explained.
    scores: str | None = None


async def drive(requests: Sequence[Request], concurrency: int,
                send: Callable[[Request], Awaitable[Outcome]], timeout: float,
                on_done: Callable[[Outcome], None] | None = None) -> tuple[list[Outcome], bool]:
    """``concurrency`` clients take requests from the list in order; a request whose
    ``after`` has not finished waits for it first. Returns the outcomes in request order
    (a request cut off by ``timeout`` gets an error) and whether the deadline cut the run."""
    done = {r.index: asyncio.Event() for r in requests}
    outcomes: dict[int, Outcome] = {}
    cursor = iter(requests)

    async def client() -> None:
        for req in cursor:  # shared iterator: each request is taken by exactly one client
            started = time.monotonic()
            try:
                if req.after is not None and req.after in done:
                    await done[req.after].wait()
                waited = time.monotonic() - started
                sent_at = time.monotonic()
                try:
                    outcome = await send(req)
                except Exception as exc:  # a router bug must not stop the other clients
                    outcome = Outcome(req.index, len(req.prompt),
                                      error=f"{type(exc).__name__}: {exc}"[:300])
                outcome.waited_s = waited
                outcome.sent_at = sent_at
                outcomes[req.index] = outcome
                if on_done is not None:
                    on_done(outcome)
            finally:
                done[req.index].set()

    tasks = [asyncio.create_task(client()) for _ in range(max(1, concurrency))]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=30.0)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    result = [outcomes.get(r.index) or Outcome(r.index, len(r.prompt),
                                                error="not finished before the run deadline")
              for r in requests]
    return result, bool(pending)


def parse_sse_line(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, else None."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def cached_of(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


# --- engine metrics -----------------------------------------------------------------------------

#: What is read from each engine's /metrics, each with the sample names it may appear under
#: (the first present wins), summed over label sets.
ENGINE_METRICS: dict[str, tuple[str, ...]] = {
    "hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "requests_ok": ("vllm:request_success_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}
COUNTERS = ("hits", "queries", "prompt_tokens", "requests_ok", "preemptions")


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The ENGINE_METRICS readings of one Prometheus text exposition (absent ones: 0)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    out: dict[str, float] = {}
    for key, names in ENGINE_METRICS.items():
        out[key] = next((sums[n] for n in names if n in sums), 0.0)
    return out


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increases between two readings of one engine. A counter that went down means
    the engine restarted in between: that is an error, not a delta."""
    out = {}
    for key in COUNTERS:
        change = after.get(key, 0.0) - before.get(key, 0.0)
        if change < 0:
            raise ValueError(f"counter {key} went down ({before.get(key)} -> {after.get(key)}): "
                             "did the engine restart?")
        out[key] = change
    return out


def hit_rate(deltas: Iterable[dict[str, float]]) -> float | None:
    """Prefix-cache hits / queries summed over engines; None when nothing was queried."""
    rows = list(deltas)
    queries = sum(d["queries"] for d in rows)
    return sum(d["hits"] for d in rows) / queries if queries else None


# --- statistics and the report ------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class RunRecord:
    """One (workload, router, concurrency) run, as the report keeps it."""

    workload: str
    router: str
    concurrency: int
    engines: list[str]
    outcomes: list[Outcome]
    deltas: dict[str, dict[str, float]]  # per engine name
    wall_s: float
    timed_out: bool = False
    inflight: dict[str, Any] | None = None  # kvroute runs: the leak check
    notes: list[str] = field(default_factory=list)
    repeat_hit_rates: list[float | None] = field(default_factory=list)  # one per repetition


def merge(records: Sequence[RunRecord]) -> RunRecord:
    """Repetitions of one cell as one record: requests pooled (so TTFT percentiles are over
    all of them), engine counter deltas summed (so the hit rate is pooled too), the first
    failed in-flight check kept; each repetition's own hit rate listed."""
    first = records[0]
    deltas: dict[str, dict[str, float]] = {}
    for record in records:
        for engine, delta in record.deltas.items():
            total = deltas.setdefault(engine, dict.fromkeys(delta, 0.0))
            for key, value in delta.items():
                total[key] = total.get(key, 0.0) + value
    checks = [r.inflight for r in records if r.inflight is not None]
    bad = [c for c in checks if c.get("leak") or c.get("error")]
    return RunRecord(
        first.workload, first.router, first.concurrency, first.engines,
        [o for r in records for o in r.outcomes], deltas, sum(r.wall_s for r in records),
        any(r.timed_out for r in records), (bad or checks or [None])[0],
        [n for r in records for n in r.notes],
        [h for r in records for h in (r.repeat_hit_rates or [hit_rate(r.deltas.values())])])


def _by_repeat(outcomes: Iterable[Outcome], what: str = "ttft_s") -> list[list[float]]:
    """One figure (`what`: an Outcome field) of each repetition's requests, in repetition
    order."""
    times: dict[int, list[float]] = {}
    for o in outcomes:
        value = getattr(o, what)
        if value is not None and not (what == "latency_s" and o.abandoned):
            times.setdefault(o.repeat, []).append(value)
    return [times[k] for k in sorted(times)]


def summarize(run: RunRecord) -> dict[str, Any]:
    ok = [o for o in run.outcomes if o.error is None]
    errors = [o for o in run.outcomes if o.error is not None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    latency = [o.latency_s for o in ok if o.latency_s is not None and not o.abandoned]
    route = [o.route_s for o in run.outcomes if o.route_s is not None]
    headers = [o.headers_s for o in ok if o.headers_s is not None]
    fallbacks = [o.fallback for o in run.outcomes if o.fallback is not None]
    sent_tokens = {e: 0 for e in run.engines}
    sent_requests = {e: 0 for e in run.engines}
    for o in run.outcomes:
        if o.engine is not None:
            sent_tokens[o.engine] = sent_tokens.get(o.engine, 0) + o.prompt_tokens
            sent_requests[o.engine] = sent_requests.get(o.engine, 0) + 1
    reported = [o for o in ok if o.cached_tokens is not None]
    usage_prompt = sum(o.prompt_tokens for o in reported)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 1)

    out: dict[str, Any] = {
        "workload": run.workload,
        "router": run.router,
        "concurrency": run.concurrency,
        "requests": len(run.outcomes),
        "errors": len(errors),
        "error_samples": sorted({o.error for o in errors if o.error})[:5],
        "abandoned": sum(o.abandoned for o in run.outcomes),
        "hit_rate": hit_rate(run.deltas.values()),
        "hit_rate_usage": (sum(o.cached_tokens or 0 for o in reported) / usage_prompt
                           if usage_prompt else None),
        "engine_hits": {e: d["hits"] for e, d in run.deltas.items()},
        "engine_queries": {e: d["queries"] for e, d in run.deltas.items()},
        "engine_prompt_tokens": {e: d["prompt_tokens"] for e, d in run.deltas.items()},
        "engine_preemptions": {e: d["preemptions"] for e, d in run.deltas.items()},
        "sent_prompt_tokens": sent_tokens,
        "sent_requests": sent_requests,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p90_ms": ms(percentile(ttft, 90)),
        "ttft_p90_repeats_ms": [ms(percentile(times, 90)) for times in _by_repeat(ok)],
        "latency_p50_ms": ms(percentile(latency, 50)),
        "latency_p90_ms": ms(percentile(latency, 90)),
        # Each run's request latency (sent to the last token, routing included), in order.
        "latency_p50_repeats_ms": [ms(percentile(times, 50))
                                   for times in _by_repeat(ok, "latency_s")],
        "latency_p90_repeats_ms": [ms(percentile(times, 90))
                                   for times in _by_repeat(ok, "latency_s")],
        "route_p50_ms": ms(percentile(route, 50)),
        "route_p99_ms": ms(percentile(route, 99)),
        "headers_p50_ms": ms(percentile(headers, 50)),
        "headers_p99_ms": ms(percentile(headers, 99)),
        "fallbacks": len(fallbacks),
        "fallback_samples": sorted(set(fallbacks))[:5],
        "wall_s": round(run.wall_s, 2),
        "repeats": max(1, len(run.repeat_hit_rates)),
        "hit_rate_repeats": run.repeat_hit_rates or [hit_rate(run.deltas.values())],
        "timed_out": run.timed_out,
        "notes": run.notes,
    }
    if run.inflight is not None:
        out["inflight"] = run.inflight
    if run.router in REPLICAS:
        requests = len({o.index for o in run.outcomes})
        windows = restart_windows(requests, REPLICA_COUNT)
        out["restart_windows"] = windows
        out["hit_rate_after_restarts"] = window_hit_rate(run.outcomes, windows)
    origin: dict[int, float] = {}
    for o in run.outcomes:
        if o.sent_at is not None:
            origin[o.repeat] = min(o.sent_at, origin.get(o.repeat, o.sent_at))
    # One line per request, for looking into a run: where it went, when (from the start of
    # its repetition), how long routing and its first token took, how much was cached.
    out["trace"] = {
        "columns": ["repeat", "index", "engine", "sent_ms", "route_ms", "ttft_ms",
                    "prompt_tokens", "cached_tokens", "headers_ms", "fallback", "scores"],
        "rows": [[o.repeat, o.index, o.engine,
                  ms(o.sent_at - origin[o.repeat]) if o.sent_at is not None else None,
                  ms(o.route_s), ms(o.ttft_s), o.prompt_tokens, o.cached_tokens,
                  ms(o.headers_s), o.fallback, o.scores]
                 for o in run.outcomes],
    }
    return out


def failed_row(workload: str, router: str, concurrency: int, engines: list[str],
               error: str) -> dict[str, Any]:
    """The report's row for a run that could not be measured."""
    zero = {"hits": 0.0, "queries": 0.0, "prompt_tokens": 0.0, "requests_ok": 0.0,
            "preemptions": 0.0}
    row = summarize(RunRecord(workload, router, concurrency, engines, [],
                              {e: dict(zero) for e in engines}, 0.0))
    row["failed"] = error[:2000]
    return row


def add_partition_share(rows: list[dict[str, Any]]) -> None:
    """Each row's hit rate as a share of the static partition's on the same workload and
    concurrency (the upper bound these workloads allow), in place: pooled over the runs
    (`share_of_partition`), and run by run (`share_repeats`: each run's hit rate over the
    partition's median run), with the worst run's (`share_worst`) and the median's."""
    pooled = {(r["workload"], r["concurrency"]): r["hit_rate"]
              for r in rows if r["router"] == "partition"}
    median_run = {(r["workload"], r["concurrency"]): median(r.get("hit_rate_repeats"))
                  for r in rows if r["router"] == "partition"}
    for r in rows:
        key = (r["workload"], r["concurrency"])
        b = pooled.get(key)
        r["share_of_partition"] = (r["hit_rate"] / b if b and r["hit_rate"] is not None
                                   else None)
        m = median_run.get(key)
        shares = [h / m if m and h is not None else None
                  for h in r.get("hit_rate_repeats") or []]
        r["share_repeats"] = shares
        known = [x for x in shares if x is not None]
        r["share_worst"] = min(known) if known else None
        r["share_median"] = median(known)


def median(values: Sequence[float | None] | None) -> float | None:
    """The median of the known values (the mean of the middle two of an even count)."""
    known = sorted(v for v in values or [] if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def add_added_latency(rows: list[dict[str, Any]]) -> None:
    """Each routed row's time to the response headers beside its baseline's in the same
    workload and concurrency (BASELINES: a balancer asking kvroute beside the same balancer
    doing round robin): ``added_p50_ms`` and ``added_p99_ms``, the differences of the
    percentiles (None without a baseline row), in place."""
    cells = {(r["workload"], r["concurrency"], r["router"]): r for r in rows}
    for r in rows:
        base = cells.get((r["workload"], r["concurrency"], BASELINES.get(r["router"], "")))
        for p in ("p50", "p99"):
            mine = r.get(f"headers_{p}_ms")
            theirs = base.get(f"headers_{p}_ms") if base else None
            r[f"added_{p}_ms"] = (round(mine - theirs, 1)
                                  if mine is not None and theirs is not None else None)


def inflight_leaks(rows: list[dict[str, Any]]) -> list[str]:
    """One line per kvroute run whose in-flight counts did not return to 0 (or could not be
    read)."""
    out = []
    for r in rows:
        check = r.get("inflight")
        if check and check.get("error"):
            out.append(f"{r['workload']} x{r['concurrency']} {r['router']}: the check itself "
                       f"failed: {check['error']}")
        elif check and check.get("leak"):
            out.append(f"{r['workload']} x{r['concurrency']} {r['router']}: inflight "
                       f"{check.get('settled')} still after {check.get('waited_s')}s "
                       f"(right after the run: {check.get('after_run')})")
    return out


def _pct(value: float | None) -> str:
    return "   -  " if value is None else f"{100 * value:5.1f}%"


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value:6.0f}"


def _ms1(value: float | None) -> str:
    return "     -" if value is None else f"{value:6.1f}"


def _added(row: dict[str, Any]) -> str:
    p50, p99 = row.get("added_p50_ms"), row.get("added_p99_ms")
    if p50 is None or p99 is None:
        return "-"
    return f"{p50:+.1f}/{p99:+.1f}"


def _tokens(by_engine: dict[str, float], requests: dict[str, int] | None = None) -> str:
    if requests is not None and not any(requests.values()):
        return "-"  # a balancer's round robin does not say which engine served
    return "/".join(f"{v / 1000:.1f}k" for v in by_engine.values())


def _inflight(check: dict[str, Any] | None) -> str:
    if not check:
        return "-"
    after, settled = check.get("after_run"), check.get("settled")
    if check.get("error"):
        return "ERROR"
    text = ",".join(str(v) for v in (settled or []))
    if check.get("leak"):
        return f"LEAK {text}"
    if after != settled:
        return f"{','.join(str(v) for v in after or [])}->{text}"
    return text


def _spread(values: list[float | None] | None, scale: float = 1.0, unit: str = "") -> str:
    """Lowest-highest of the repetitions' own figures ("-" for fewer than two)."""
    known = [v for v in values or [] if v is not None]
    if len(known) < 2:
        return "-"
    return f"{scale * min(known):.0f}-{scale * max(known):.0f}{unit}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'workload':<22} {'conc':>4} {'router':<15} {'hit':>6} {'runs':>9} {'usage':>6} "
            f"{'of part':>7} {'TTFT50':>6} {'TTFT90':>6} {'runs':>9} {'hdr50':>6} {'hdr99':>6} "
            f"{'added 50/99':>12} {'fb':>3} {'err':>3} {'wall':>6}  "
            f"{'tokens sent/engine':<20} {'inflight':<10}")
    lines = [head, "-" * len(head)]
    previous = None
    for r in rows:
        key = (r["workload"], r["concurrency"])
        if previous is not None and key != previous:
            lines.append("")
        previous = key
        if r.get("failed"):
            lines.append(f"{r['workload']:<22} {r['concurrency']:>4} {r['router']:<15} "
                         f"FAILED: {r['failed'].splitlines()[0][:120]}")
            continue
        lines.append(
            f"{r['workload']:<22} {r['concurrency']:>4} {r['router']:<15} "
            f"{_pct(r['hit_rate'])} {_spread(r.get('hit_rate_repeats'), 100, '%'):>9} "
            f"{_pct(r['hit_rate_usage'])} "
            f"{_pct(r.get('share_of_partition')):>7} {_ms(r['ttft_p50_ms'])} "
            f"{_ms(r['ttft_p90_ms'])} {_spread(r.get('ttft_p90_repeats_ms')):>9} "
            f"{_ms1(r.get('headers_p50_ms'))} "
            f"{_ms1(r.get('headers_p99_ms'))} {_added(r):>12} {r.get('fallbacks', 0):>3} "
            f"{r['errors']:>3} {r['wall_s']:5.0f}s  "
            f"{_tokens(r['sent_prompt_tokens'], r.get('sent_requests')):<20} "
            f"{_inflight(r.get('inflight')):<10}")
    lines.append("")
    windowed = [r for r in rows if not r.get("failed") and "hit_rate_after_restarts" in r]
    for r in windowed:
        lines.append(f"{r['workload']} x{r['concurrency']} {r['router']}: usage hit "
                     f"{_pct(r['hit_rate_after_restarts']).strip()} in the requests right "
                     f"after the restart points {r['restart_windows']}")
    if windowed:
        lines.append("")
    lines += [
        "hit: vllm:prefix_cache_hits / queries (the engines' /metrics, deltas over the run, "
        "summed; over all repetitions); runs: lowest-highest of the repetitions' own hit rates",
        "usage: cached_tokens / prompt_tokens as each response reported them; of part: hit / "
        "the static partition's hit",
        "TTFT: ms at the client to the first SSE event, routing included (its runs: lowest-"
        "highest of the repetitions' own p90); tokens sent/engine: prompt tokens the client "
        "sent to each engine",
        "hdr: ms at the client to the response's headers, routing included; added: hdr p50/p99 "
        "minus the baseline's in the same run",
        "  (kvroute-route and -proxy: round-robin; nginx- and haproxy-kvroute: the same balancer "
        "without the routing hook); fb: requests a balancer did not route",
        "inflight: kvroute's load.inflight per worker after the run (a->b: right after -> "
        "settled); anything but 0 is a leak",
    ]
    return "\n".join(line.rstrip() for line in lines)


def runs_table(rows: list[dict[str, Any]]) -> str:
    """Run by run, the worst first: per cell, each router's worst and median run as a share
    of the partition's median run, then every run's hit rate and request latency p50/p90
    (ms, sent to last token, routing included), in the order they ran."""
    head = (f"{'workload':<22} {'conc':>4} {'router':<15} {'worst':>6} {'median':>6} "
            f"{'pooled':>6} {'lat p90 worst':>13}  runs: hit% (share) p50/p90 ms")
    lines = [head, "-" * len(head)]
    previous = None
    for r in rows:
        if r.get("failed"):
            continue
        key = (r["workload"], r["concurrency"])
        if previous is not None and key != previous:
            lines.append("")
        previous = key
        hits = r.get("hit_rate_repeats") or []
        shares = r.get("share_repeats") or [None] * len(hits)
        p50s = r.get("latency_p50_repeats_ms") or []
        p90s = r.get("latency_p90_repeats_ms") or []
        worst_p90 = max((v for v in p90s if v is not None), default=None)
        runs = "  ".join(
            f"{_pct(h).strip()}({_pct(sh).strip()}) "
            f"{_ms(p50s[i] if i < len(p50s) else None).strip()}/"
            f"{_ms(p90s[i] if i < len(p90s) else None).strip()}"
            for i, (h, sh) in enumerate(zip(hits, shares, strict=False)))
        lines.append(f"{r['workload']:<22} {r['concurrency']:>4} {r['router']:<15} "
                     f"{_pct(r.get('share_worst'))} {_pct(r.get('share_median'))} "
                     f"{_pct(r.get('share_of_partition'))} {_ms(worst_p90):>13}  {runs}")
    lines += ["", "worst / median: the worst and the median run's hit rate as a share of the "
              "partition's median run; pooled: all runs' requests together (hides dips)"]
    return "\n".join(line.rstrip() for line in lines)
