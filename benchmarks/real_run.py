"""One run of the real-vLLM benchmark (``benchmarks.real_hitrate``): one workload, one
router, one concurrency level.

``run_one`` resets the engines, starts what the router needs (a kvroute, replicas and their
redis-server, a balancer), sends the workload (``client_phase``, each request by
``Sender``), checks kvroute's in-flight counts and stops what it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import proc_sched
from benchmarks.real_fleet import Fleet, inflight_check, start_kvroute
from benchmarks.real_parts import (
    BALANCERS,
    REPLICA_COUNT,
    REPLICAS,
    Outcome,
    Request,
    RunRecord,
    Workload,
    cached_of,
    drive,
    metric_delta,
    parse_sse_line,
    replica_order,
    restart_points,
    summarize,
)
from benchmarks.real_replicas import RedisServer, Replicas, rolling_restart
from e2e.lb import Balancer, start_balancer
from e2e.model import text_of
from e2e.processes import ProcessSet
from e2e.service import Kvroute


class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)


class Sender:
    """Sends one request the way its router says and measures it from the client."""

    def __init__(self, client: httpx.AsyncClient, fleet: Fleet, router: str, max_tokens: int,
                 abandon_every: int, kvroute: Kvroute | None, ids: dict[str, str],
                 balancer: Balancer | None = None, replicas: Replicas | None = None,
                 text: bool = False) -> None:
        self.client = client
        # Prompts as text (`e2e.model.text_of`), tokenized by the engines and by kvroute
        # through the engines' /tokenize, instead of token ids.
        self.text = text
        self.replicas = replicas
        self.failovers = 0  # route questions a replica did not answer, asked of the next
        self.fleet = fleet
        self.router = router
        self.max_tokens = max_tokens
        self.abandon_every = abandon_every
        self.kvroute = kvroute
        self.balancer = balancer
        # the answer names the engine (x-kvroute-instance) rather than the URL the client used
        self.named_by_answer = router == "kvroute-proxy" or router in BALANCERS
        self.name_of_id = {iid: name for name, iid in ids.items()}
        self.name_of_url = {e.url.rstrip("/"): e.name for e in fleet.engines}

    def body(self, prompt: str | list[int]) -> dict[str, Any]:
        return {"model": self.fleet.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    async def __call__(self, req: Request) -> Outcome:
        out = Outcome(req.index, len(req.prompt))
        prompt = text_of(req.prompt) if self.text else req.prompt  # as the engines get it
        abandon = self.abandon_every > 0 and (req.index + 1) % self.abandon_every == 0
        engines = self.fleet.engines
        started = time.monotonic()
        headers: dict[str, str] = {}
        if self.router == "round-robin":
            url = engines[req.index % len(engines)].url
        elif self.router == "partition":
            url = engines[req.group % len(engines)].url
        elif self.router == "kvroute-route" or self.router in REPLICAS:
            if self.replicas is not None:
                kvs = [self.replicas.kvs[i]
                       for i in replica_order(req.index, self.replicas.in_service)]
            else:
                assert self.kvroute is not None
                kvs = [self.kvroute]
            answer = None
            for n, kv in enumerate(kvs):
                try:
                    question = {"prompt" if self.text else "token_ids": prompt}
                    answer = await self.client.post(f"{kv.url}/v1/route", json=question,
                                                    timeout=10.0)
                    break
                except httpx.TransportError as exc:  # a replica going away: ask the next
                    if n + 1 == len(kvs):
                        out.error = f"route: {type(exc).__name__}: {exc}"[:300]
                        return out
                    self.failovers += 1
                except httpx.HTTPError as exc:
                    out.error = f"route: {type(exc).__name__}: {exc}"[:300]
                    return out
            assert answer is not None
            out.route_s = time.monotonic() - started
            if answer.status_code != 200:
                out.error = f"route: HTTP {answer.status_code}: {answer.text[:200]}"
                return out
            choice = answer.json()
            out.scores = " ".join(
                f"{s['instance']} {s['matched_tokens']}/{s['cost_terms']['prefill']:.0f}"
                f"+c{s['cost_terms']['copy']:.0f}+s{s['cost_terms'].get('crowding', 0):.0f}"
                f"+{s['cost_terms']['queue']:.0f}(q{s['queued_prefill_tokens']:.0f},"
                f"r{s['running_requests']:.0f};a{s['load']['answered']}"
                f",m{_count(s['load']['running'])}/{_count(s['load']['waiting'])})"
                for s in choice.get("scores", []))
            url = str(choice["url"])
            headers["X-data-parallel-rank"] = str(choice.get("dp_rank", 0))
        elif self.router == "kvroute-proxy":
            assert self.kvroute is not None
            url = self.kvroute.url
        elif self.router in BALANCERS:
            assert self.balancer is not None
            url = self.balancer.url
        else:
            raise ValueError(f"unknown router {self.router!r}")
        if not self.named_by_answer:
            out.engine = self.name_of_url.get(url.rstrip("/"))
            if out.engine is None:
                out.error = f"routed to an unknown URL {url}"
                return out
        await self._stream(url, prompt, headers, started, out, abandon)
        return out

    async def _stream(self, url: str, prompt: str | list[int], headers: dict[str, str],
                      started: float, out: Outcome, abandon: bool) -> None:
        usage = None
        finished = False
        try:
            async with self.client.stream("POST", f"{url}/v1/completions", json=self.body(prompt),
                                          headers=headers) as response:
                out.headers_s = time.monotonic() - started
                if self.named_by_answer:
                    iid = response.headers.get("x-kvroute-instance")
                    out.engine = self.name_of_id.get(iid or "")
                    out.fallback = response.headers.get("x-kvroute-fallback")
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    out.error = f"HTTP {response.status_code}: {text[:200]}"
                    return
                async for line in response.aiter_lines():
                    payload = parse_sse_line(line)
                    if payload is None:
                        continue
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - started
                        if abandon:  # hang up mid-stream: the request is aborted upstream
                            out.abandoned = True
                            break
                    if payload == "[DONE]":
                        # read on to the body's end: left unread, its last chunk makes the
                        # client close the connection, and every request pays a new one
                        finished = True
                        continue
                    chunk = json.loads(payload)
                    if chunk.get("error"):
                        out.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        if not finished and not out.abandoned and out.error is None:
            out.error = "the stream ended without [DONE]"
        out.latency_s = time.monotonic() - started
        out.cached_tokens = cached_of(usage)


class LoopLag:
    """How late the clients' event loop wakes up for a 10 ms sleep, over the run.

    A route call or a first token the clients read late is the clients' wait, not the
    router's: this tells the two apart."""

    PERIOD = 0.01

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.PERIOD)
            self.lags.append(time.monotonic() - before - self.PERIOD)

    def stop(self) -> None:
        self._task.cancel()

    def summary(self) -> str:
        lags = sorted(self.lags) or [0.0]
        return (f"clients' loop lag p50 {lags[len(lags) // 2] * 1e3:.1f} ms, p99 "
                f"{lags[int(len(lags) * 0.99)] * 1e3:.1f} ms, worst {lags[-1] * 1e3:.1f} ms")


async def client_phase(workload: Workload, concurrency: int, sender_args: dict[str, Any],
                       timeout: float, say: Callable[[str], None], label: str,
                       rolling: bool = False) -> tuple[list[Outcome], bool, int, str]:
    """The run's requests; with ``rolling``, the replicas are restarted in turn meanwhile.
    Returns the outcomes, whether the deadline cut the run, the replica failovers and the
    clients' own event-loop lag."""
    limits = httpx.Limits(max_connections=2 * concurrency + 8,
                          max_keepalive_connections=2 * concurrency + 8)
    timeouts = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=300.0)
    total = len(workload.requests)
    state = {"done": 0, "errors": 0, "last": time.monotonic()}

    def on_done(outcome: Outcome) -> None:
        state["done"] += 1
        state["errors"] += outcome.error is not None
        now = time.monotonic()
        if now - state["last"] >= 15.0 or state["done"] == total:
            state["last"] = now
            say(f"  {label}: {state['done']}/{total} done, {state['errors']} errors")

    lag = LoopLag()
    async with httpx.AsyncClient(limits=limits, timeout=timeouts, trust_env=False) as client:
        sender = Sender(client, **sender_args)
        roller = None
        if rolling:
            replicas = sender_args["replicas"]
            roller = asyncio.create_task(rolling_restart(
                replicas, restart_points(total, len(replicas.kvs)), state, say, label))
        try:
            outcomes, timed_out = await drive(workload.requests, concurrency, sender, timeout,
                                              on_done)
        finally:
            state["finished"] = True
            if roller is not None:
                await roller  # a restart under way ends before the replicas are stopped
            lag.stop()
        return outcomes, timed_out, sender.failovers, lag.summary()


def run_one(fleet: Fleet, procs: ProcessSet, workload: Workload, router: str,
            concurrency: int, args: argparse.Namespace, log_dir: Path, clock: Clock,
            repeat: int = 0) -> RunRecord:
    text = args.prompts == "text"
    # kvroute's `tokenizer` setting: none for token ids; for text, the engines' /tokenize or
    # the model folder's tokenizer.json
    tokenizer = None if not text else (
        "instance" if args.kvroute_tokenizer == "instance" else fleet.model)
    label = f"{workload.name} x{concurrency} {router}" + (f" #{repeat + 1}" if repeat else "")
    clock.say(f"run {label}: resetting the engines' prefix caches")
    notes = fleet.prepare()
    kv: Kvroute | None = None
    balancer: Balancer | None = None
    ids: dict[str, str] = {}
    inflight = None
    tag = f"{workload.name}-c{concurrency}-{router}"
    replicas: Replicas | None = None
    redis_server: RedisServer | None = None
    try:
        if router in REPLICAS:
            shared, _ = REPLICAS[router]
            if shared:
                redis_server = RedisServer(procs, log_dir / tag)
            replicas = Replicas(procs, fleet, log_dir / tag, REPLICA_COUNT,
                                redis_server.url if redis_server else None, clock.say,
                                tokenizer=tokenizer)
            replicas.start_all()
            kv, ids = replicas.kvs[0], dict(replicas.ids)
            clock.say(f"  {REPLICA_COUNT} fresh kvroute replicas at "
                      f"{', '.join(k.url for k in replicas.kvs)}, state shared through "
                      f"{'redis-server ' + redis_server.url if redis_server else 'nothing'} "
                      f"(logs {log_dir.name}/{tag}/replica-*/kvroute.log), engines live: {ids}")
        elif router.startswith("kvroute") or router.endswith("-kvroute"):
            kv, ids = start_kvroute(procs, fleet, log_dir / tag, router == "kvroute-proxy",
                                    clock.say, tokenizer=tokenizer)
            clock.say(f"  fresh kvroute at {kv.url} (log {log_dir.name}/{tag}/kvroute.log), "
                      f"engines live: {ids}")
        if router in BALANCERS:
            kind, routing = BALANCERS[router]
            # the round-robin configuration never asks kvroute: any address will do
            balancer = start_balancer(kind, procs, log_dir / tag,
                                      instances=[e.url for e in fleet.engines],
                                      kvroute=kv.url if kv else "http://127.0.0.1:9",
                                      routing=routing, deadline_ms=args.lb_deadline_ms)
            clock.say(f"  {balancer.name} at {balancer.url} (files and log in "
                      f"{balancer.directory})")
        before = {e.name: fleet.metrics(e) for e in fleet.engines}
        sender_args = dict(fleet=fleet, router=router, max_tokens=args.max_tokens,
                           abandon_every=args.abandon_every, kvroute=kv, ids=ids,
                           balancer=balancer, replicas=replicas, text=text)
        started = time.monotonic()
        rolling = router in REPLICAS and REPLICAS[router][1]
        faults = (proc_sched.machine_major_faults(), proc_sched.major_faults(os.getpid()))
        kv_pid = kv.proc.pid if kv is not None and kv.proc is not None else None
        sched_before = _sched_sample(kv_pid)
        outcomes, timed_out, failovers, client_lag = asyncio.run(client_phase(
            workload, concurrency, sender_args, args.run_timeout, clock.say, label, rolling))
        sched = _sched_note(sched_before, _sched_sample(kv_pid), len(outcomes))
        if sched:
            notes.append(sched)
            clock.say(f"  {sched}")
        waits = (f"{client_lag}; major page faults meanwhile: "
                 f"{proc_sched.machine_major_faults() - faults[0]} on the machine, "
                 f"{proc_sched.major_faults(os.getpid()) - faults[1]} in the clients")
        notes.append(waits)
        clock.say(f"  {waits}")
        wall = time.monotonic() - started
        if replicas is not None:
            for record in replicas.restarts:
                workers = "; ".join(
                    f"{name} {w['state']}, restored {w['restored_blocks']} (+"
                    f"{w['restored_unconfirmed']} unconfirmed), holds {w['holdings']}"
                    for name, w in record["workers"].items())
                notes.append(f"replica {record['replica']} restarted after "
                             f"{record['after_requests']} requests (exit {record['exit']}, "
                             f"stopped in {record['stop_s']}s, out of service "
                             f"{record['out_of_service_s']}s): {workers}")
            if rolling and len(replicas.restarts) < len(replicas.kvs):
                notes.append(f"only {len(replicas.restarts)} of {len(replicas.kvs)} replicas "
                             "were restarted before the run ended")
            if failovers:
                notes.append(f"{failovers} route questions failed over to the other replica")
        if kv is not None:
            inflight = inflight_check(kv, ids, workload.requests[0].prompt, args.leak_wait)
            if inflight.get("leak") or inflight.get("error"):
                banner = "!" * 78
                clock.say(banner)
                shown = {k: inflight.get(k)
                         for k in ("engines", "after_run", "settled", "waited_s", "error")}
                clock.say(f"!! IN-FLIGHT LEAK CHECK FAILED after {label}: {json.dumps(shown)}")
                clock.say(banner)
            else:
                clock.say(f"  inflight after the run: {inflight['after_run']} -> "
                          f"{inflight['settled']} (ok)")
            _save_decisions(kv, log_dir / tag / f"decisions-{repeat + 1}.json", clock.say)
            own = own_timings(kv)
            if own:
                notes.append(own)
                clock.say(f"  {own}")
    finally:
        if balancer is not None:
            balancer.stop()
        if replicas is not None:
            replicas.stop()  # before the redis-server: their last saves go there
        elif kv is not None:
            kv.stop()
            kv.close()
        if redis_server is not None:
            redis_server.stop()
    fleet.check_alive()
    fleet.wait_idle()
    after = fleet.settled_metrics()
    deltas = {name: metric_delta(before[name], after[name]) for name in fleet.names}
    for outcome in outcomes:
        outcome.repeat = repeat
    record = RunRecord(workload.name, router, concurrency, fleet.names, outcomes, deltas, wall,
                       timed_out, inflight, notes)
    row = summarize(record)
    clock.say(f"  {label}: hit rate {_fmt(row['hit_rate'])} (usage {_fmt(row['hit_rate_usage'])})"
              f", TTFT p50 {row['ttft_p50_ms']} ms p90 {row['ttft_p90_ms']} ms, headers p50 "
              f"{row['headers_p50_ms']} ms p99 {row['headers_p99_ms']} ms, "
              f"{row['errors']} errors, {row['fallbacks']} not routed, {wall:.0f}s, "
              f"prompt tokens {row['engine_prompt_tokens']}")
    return record


def _save_decisions(kv: Kvroute, path: Path, say: Callable[[str], None]) -> None:
    """The run's decision log (app.routing.decision_log), as kvroute kept it, into ``path``: page
    after page (`since`), so a log longer than one answer is saved whole."""
    decisions: list[dict[str, Any]] = []
    while True:
        try:
            answer = kv.http.get("/v1/decisions",
                                 params={"since": decisions[-1]["id"] if decisions else 0},
                                 timeout=30.0)
        except httpx.HTTPError as exc:
            say(f"  decision log not read: {type(exc).__name__}: {exc}")
            return
        if answer.status_code != 200:  # a kvroute started without the log (replicas)
            return
        page = answer.json()
        if not page["decisions"]:
            break
        decisions += page["decisions"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"capacity": page["capacity"], "decisions": decisions}))
    say(f"  decision log: {len(decisions)} decisions in {path}")


def _sched_sample(kv_pid: int | None) -> proc_sched.Sample | None:
    """kvroute's main thread as Linux accounts it, with the clients' process beside it."""
    if kv_pid is None:
        return None
    try:
        return proc_sched.sample(kv_pid, {"clients": [os.getpid()]})
    except (OSError, ValueError):  # kvroute gone: the run's own checks say why
        return None


def _sched_note(first: proc_sched.Sample | None, last: proc_sched.Sample | None,
                requests: int) -> str | None:
    """Whether kvroute's loop waited for a core during the run: a route's time at the client
    beyond kvroute's own is either that wait or the clients' own."""
    if first is None or last is None:
        return None
    w = proc_sched.window(first, last, requests)
    return (f"kvroute's loop on a core {100 * w['loop_on_core_share']:.0f}% of the run, "
            f"ready but waiting for one {100 * w['loop_queued_share']:.1f}% "
            f"({w['loop_queued_ms_per_route']:.2f} ms per request), kvroute "
            f"{w['process_cpu_share']:.2f} of a core, the clients "
            f"{w['clients_cpu_share']:.2f}, the machine {w['machine_busy_cores']:.2f} cores")


def own_timings(kv: Kvroute) -> str | None:
    """kvroute's own view of the run, beside what the clients measured: its mean time to
    answer a route (server side, from the whole body), how long bodies took to arrive after
    their headers, and its event loop's lag."""
    try:
        text = kv.http.get("/metrics").text
    except httpx.HTTPError:
        return None
    samples = {s.name + s.labels.get("le", ""): s.value
               for family in text_string_to_metric_families(text)
               for s in family.samples if s.name.startswith(
                   ("kvroute_route_latency_seconds_", "kvroute_route_body_seconds_",
                    "kvroute_event_loop_lag_"))}
    count = samples.get("kvroute_route_latency_seconds_count", 0.0)
    parts = []
    if count:
        mean = 1000 * samples.get("kvroute_route_latency_seconds_sum", 0.0) / count
        parts.append(f"route answered in {mean:.1f} ms on average (server side, {count:.0f})")
    bodies = samples.get("kvroute_route_body_seconds_count", 0.0)
    if bodies:
        mean = 1000 * samples.get("kvroute_route_body_seconds_sum", 0.0) / bodies
        slow = bodies - samples.get("kvroute_route_body_seconds_bucket1.0", bodies)
        parts.append(f"bodies arrived {mean:.1f} ms after their headers on average "
                     f"({slow:.0f} over 1 s)")
    wakeups = samples.get("kvroute_event_loop_lag_seconds_count", 0.0)
    if wakeups:
        mean = 1000 * samples.get("kvroute_event_loop_lag_seconds_sum", 0.0) / wakeups
        parts.append(f"event-loop lag {mean:.1f} ms on average")
    worst = samples.get("kvroute_event_loop_lag_worst_seconds")
    if worst is not None:
        parts.append(f"worst {1000 * worst:.0f} ms")
    return "kvroute's own: " + ", ".join(parts) if parts else None


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
