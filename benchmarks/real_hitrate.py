"""Prefix-cache hit rate per router on real vLLM engines (CPU build), under concurrent traffic.

Boots N real vLLM engines on loopback (the e2e harness's engines: tiny dummy-weight Llama,
block size 32, 64 KV blocks each, prefix caching, KV events, per-request cached-token
reports, POST /reset_prefix_cache enabled) and sends each seeded workload with each router
at each concurrency level:

- ``round-robin``: request i goes to engine i mod N;
- ``partition``: system prompt id / chat session id mod N (the upper bound here);
- ``kvroute-route``: ``POST /v1/route {"token_ids"}`` on a fresh kvroute, then the request
  goes to the answer's ``url`` with ``X-data-parallel-rank: <dp_rank>``;
- ``kvroute-proxy``: a fresh ``kvroute serve`` with ``KVROUTE_PROXY=true``; completions are
  sent to kvroute itself;
- ``nginx-kvroute``, ``haproxy-kvroute``: nginx or HAProxy with deploy/'s files as shipped
  (only ports and addresses set, the 50 ms deadline kept) in front of the engines, asking a
  fresh kvroute; completions are sent to the balancer;
- ``nginx-rr``, ``haproxy-rr``: the same balancers with the routing hook removed (plain
  round robin over the same upstream group), the baseline of their added latency;
- ``kvroute-2r``: two fresh kvroute replicas sharing state (saved index, placement guesses,
  load) through a redis-server the benchmark starts on a unix socket; the client asks
  ``POST /v1/route`` of the replicas in service in turn (a load balancer with readiness
  checks) and sends the request to the answer's ``url``;
- ``kvroute-2r-roll``: the same, and each replica is taken out of service, stopped with
  SIGTERM (it saves), started again on the same state_url and put back once its workers
  serve, in turn, a third and two thirds into the run (a rolling update);
- ``kvroute-2r-cold``: the same rolling restart without a state_url (nothing saved, nothing
  shared): the control of ``kvroute-2r-roll``. A restarted replica knows only what the
  engines' replay buffers still hold; ``--buffer-steps`` makes those short.

Before every run each engine is idle and its prefix cache reset; hit rate is the engines' own
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` (deltas over the run,
summed over engines). TTFT is measured by the client (``"stream": true``, time to the first
SSE data event, routing included), and so is the time to the response's headers: a
balancer's or kvroute's added latency is that time beside its baseline's in the same run
(``BASELINES``). After each kvroute run the ``load.inflight`` of every
worker in a ``POST /v1/route`` answer must be 0: anything else is an in-flight accounting
leak, printed prominently.

Usage: .venv/bin/python -m benchmarks.real_hitrate [--quick] [--engines N] [--requests N]
       [--concurrency 1,4,16] [--routers ...] [--workloads ...] [--seed N]
       [--buffer-steps N] [--out DIR]

stdout: one JSON object. stderr: progress and the table (also written to --out with the JSON
and the plots). Everything it starts it stops, by process group id, on success, failure,
Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.real_parts import (
    BALANCERS,
    REPLICA_COUNT,
    REPLICAS,
    ROUTERS,
    WORKLOADS,
    Outcome,
    Request,
    RunRecord,
    Workload,
    add_added_latency,
    add_partition_share,
    cached_of,
    drive,
    failed_row,
    inflight_leaks,
    make_workload,
    merge,
    metric_delta,
    parse_engine_metrics,
    parse_sse_line,
    replica_order,
    restart_points,
    summarize,
    table,
)
from e2e.engines import Engine, EngineSpec, wait_ready
from e2e.lb import Balancer, ensure_installed, start_balancer, versions
from e2e.model import write_model_dir
from e2e.processes import ManagedProcess, ProcessSet, install_signal_handlers
from e2e.run import VLLM_VERSION, setup_vllm
from e2e.service import Kvroute, KvrouteError

ROOT = Path(__file__).resolve().parent.parent
PROBE = [7, 8, 9, 10, 11]  # shorter than a block: makes the engine step, caches nothing


class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)


# --- engines: metrics, idle, reset ----------------------------------------------------------------


class Fleet:
    """The engines the benchmark started, and the synchronous calls made between runs."""

    def __init__(self, engines: list[Engine], model: str, say: Callable[[str], None]) -> None:
        self.engines = engines
        self.model = model
        self.say = say
        self.http = httpx.Client(timeout=30.0, trust_env=False)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.engines]

    def metrics(self, engine: Engine) -> dict[str, float]:
        response = self.http.get(f"{engine.url}/metrics")
        response.raise_for_status()
        return parse_engine_metrics(response.text)

    def check_alive(self) -> None:
        for engine in self.engines:
            code = engine.proc.exited() if engine.proc else None
            if code is not None:
                raise RuntimeError(f"{engine.name} exited with code {code}; last log lines:\n"
                                   f"{engine.proc.log_tail() if engine.proc else ''}")

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no engine has a running or waiting request (abandoned requests included)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = {}
            for engine in self.engines:
                m = self.metrics(engine)
                if m["running"] or m["waiting"]:
                    busy[engine.name] = (m["running"], m["waiting"])
            if not busy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines still busy after {timeout:.0f}s "
                                   f"(running, waiting): {busy}")
            time.sleep(0.2)

    def settled_metrics(self, timeout: float = 10.0) -> dict[str, dict[str, float]]:
        """Readings of every engine that no longer change (the engine records a step's
        stats a moment after it answered)."""
        previous = {e.name: self.metrics(e) for e in self.engines}
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(0.3)
            current = {e.name: self.metrics(e) for e in self.engines}
            if current == previous or time.monotonic() > deadline:
                return current
            previous = current

    def reset(self, engine: Engine, attempts: int = 30) -> int:
        """POST /reset_prefix_cache until the engine says it succeeded; returns the attempts.

        vLLM refuses a reset while blocks are in use. Depending on the version it says so
        with 409, with ``{"success": false}``, or not at all (then the engine is idle, see
        wait_idle, and nothing holds blocks, so the reset cannot fail)."""
        last = ""
        for attempt in range(1, attempts + 1):
            response = self.http.post(f"{engine.url}/reset_prefix_cache")
            ok = response.status_code == 200
            if ok and response.content:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                if isinstance(body, dict) and body.get("success") is False:
                    ok = False
                elif body is False:
                    ok = False
            if ok:
                return attempt
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            time.sleep(1.0)
        raise RuntimeError(f"{engine.name}: /reset_prefix_cache did not succeed in "
                           f"{attempts} attempts; last answer {last}")

    def probe(self, engine: Engine) -> None:
        """One tiny request: vLLM publishes AllBlocksCleared with its next step."""
        response = self.http.post(f"{engine.url}/v1/completions", json={
            "model": self.model, "prompt": PROBE, "max_tokens": 1, "temperature": 0.0})
        response.raise_for_status()

    def prepare(self) -> list[str]:
        """Idle, empty prefix caches, the clears published; notes for the record."""
        notes = []
        self.check_alive()
        self.wait_idle()
        for engine in self.engines:
            attempts = self.reset(engine)
            if attempts > 1:
                notes.append(f"{engine.name}: reset took {attempts} attempts")
            self.probe(engine)
        self.wait_idle()
        return notes

    def close(self) -> None:
        self.http.close()


# --- kvroute ------------------------------------------------------------------------------------


def start_kvroute(procs: ProcessSet, fleet: Fleet, log_dir: Path, proxy: bool,
                  say: Callable[[str], None]) -> tuple[Kvroute, dict[str, str]]:
    """A fresh kvroute with the engines registered by URL and live; returns it and the
    instance id of each engine name."""
    kv = Kvroute(procs, log_dir)
    kv.start({"KVROUTE_PROXY": "true" if proxy else "false"})
    ids = {e.name: kv.register(e.url) for e in fleet.engines}
    for iid in ids.values():
        kv.wait_state(iid, {"live"}, 60.0, say, "after registering")
    # The engines were reset before kvroute started: whatever it replays ends empty.
    deadline = time.monotonic() + 15.0
    while any(kv.holdings(iid) for iid in ids.values()):
        if time.monotonic() > deadline:
            held = {name: kv.holdings(iid) for name, iid in ids.items()}
            raise KvrouteError(f"kvroute still holds blocks of reset engines: {held}")
        time.sleep(0.1)
    return kv, ids


def read_inflight(kv: Kvroute, probe: list[int], order: list[tuple[str, str]]
                  ) -> tuple[list[int], dict[str, Any]]:
    """load.inflight of each engine's rank-0 worker in a POST /v1/route answer (in ``order``
    of (engine name, instance id)), and the raw load readings. Asked as a probe (a question
    only: no placement guess, not counted as an answer)."""
    response = kv.http.post("/v1/route", json={"token_ids": probe, "probe": True})
    if response.status_code != 200:
        raise KvrouteError(f"POST /v1/route -> {response.status_code}: {response.text[:300]}")
    answer = response.json()
    by_id: dict[str, dict[str, Any]] = {}
    for score in answer.get("scores", []):
        if int(score.get("dp_rank", 0)) == 0:
            by_id[str(score["instance"])] = score
    values, loads = [], {}
    for name, iid in order:
        score = by_id.get(iid, {})
        load = score.get("load") or {}
        values.append(int(load.get("inflight") or 0))
        loads[name] = {"load": load, "cost_terms": score.get("cost_terms"),
                       "queued_prefill_tokens": score.get("queued_prefill_tokens"),
                       "running_requests": score.get("running_requests")}
    return values, loads


def inflight_check(kv: Kvroute, ids: dict[str, str], probe: list[int], wait_s: float
                   ) -> dict[str, Any]:
    """Right after the run and again until every value is 0 or ``wait_s`` has passed."""
    order = list(ids.items())
    started = time.monotonic()
    try:
        after_run, loads_after = read_inflight(kv, probe, order)
        settled, loads = after_run, loads_after
        while any(settled) and time.monotonic() - started < wait_s:
            time.sleep(0.25)
            settled, loads = read_inflight(kv, probe, order)
    except (KvrouteError, httpx.HTTPError, KeyError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "leak": None}
    check = {"engines": [n for n, _ in order], "after_run": after_run, "settled": settled,
             "waited_s": round(time.monotonic() - started, 2), "leak": any(settled),
             "loads_after_run": loads_after, "loads_settled": loads}
    if check["leak"]:  # what kvroute says about the workers, for the hunt
        try:
            check["instances"] = {name: kv.instance(iid) for name, iid in order}
        except (KvrouteError, httpx.HTTPError) as exc:
            check["instances"] = f"{type(exc).__name__}: {exc}"
    return check


# --- kvroute replicas ---------------------------------------------------------------------------

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A redis-server for one run's replicas: a unix socket in a short temporary directory
    (a socket path must stay under ~100 bytes), TCP off, no persistence. Ready once it
    answers with the pid started here; stopped by that process group, like the rest."""

    def __init__(self, procs: ProcessSet, log_dir: Path, timeout: float = 30.0) -> None:
        if not os.access(REDIS_SERVER, os.X_OK):
            raise RuntimeError(f"{REDIS_SERVER} is missing: the replica routers share state "
                               "through a redis-server (Debian: apt-get install redis-server)")
        self.directory = Path(tempfile.mkdtemp(prefix="kvr-redis-"))
        self.socket = self.directory / "redis.sock"
        argv = [REDIS_SERVER, "--port", "0", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--daemonize", "no"]
        self.proc = procs.start(ManagedProcess("redis-server", argv, dict(os.environ),
                                               log_dir / "redis.log"))
        deadline = time.monotonic() + timeout
        while not self._ours():
            code = self.proc.exited()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not come up (exit {code}):\n"
                                   f"{self.proc.log_tail()}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def _ours(self) -> bool:
        if not self.socket.exists():
            return False
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2.0)
        try:
            return int(client.info("server")["process_id"]) == self.proc.pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class Replicas:
    """Kvroute replicas in front of the same engines, and which of them are in service.

    ``in_service`` is what a load balancer's readiness checks would say: a replica leaves it
    before it is stopped and comes back once every engine's worker serves again."""

    def __init__(self, procs: ProcessSet, fleet: Fleet, log_dir: Path, count: int,
                 state_url: str | None, say: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.say = say
        self.kvs = [Kvroute(procs, log_dir / f"replica-{i}") for i in range(count)]
        self.settings = {"KVROUTE_PROXY": "false", "KVROUTE_STATE_DIR": ""}
        if state_url is not None:
            self.settings["KVROUTE_STATE_URL"] = state_url
        self.in_service = [False] * count
        self.ids: dict[str, str] = {}
        self.restarts: list[dict[str, Any]] = []

    def start(self, i: int, states: set[str]) -> dict[str, dict[str, Any]]:
        """Start replica ``i``, register the engines, wait until every worker is in one of
        ``states``, put it in service; its workers' state and restore counters."""
        kv = self.kvs[i]
        kv.start(self.settings)
        self.ids = {e.name: kv.register(e.url) for e in self.fleet.engines}
        for iid in self.ids.values():
            kv.wait_state(iid, states, 60.0, self.say, f"replica {i} after registering")
        workers = {}
        for name, iid in self.ids.items():
            worker = kv.worker(iid)
            stats = worker.get("stats", {})
            workers[name] = {"state": worker.get("state"),
                             "restored_blocks": stats.get("restored_blocks", 0),
                             "restored_unconfirmed": stats.get("restored_unconfirmed", 0),
                             "holdings": sum(int(v) for v in
                                             worker.get("holdings", {}).values())}
        self.in_service[i] = True
        return workers

    def start_all(self) -> None:
        for i in range(len(self.kvs)):
            self.start(i, {"live"})
        # The engines were reset before the replicas started: whatever they replay ends empty.
        deadline = time.monotonic() + 15.0
        while any(kv.holdings(iid) for kv in self.kvs for iid in self.ids.values()):
            if time.monotonic() > deadline:
                raise KvrouteError("a replica still holds blocks of reset engines")
            time.sleep(0.1)

    def restart(self, i: int, after: int) -> dict[str, Any]:
        """Out of service, SIGTERM, start again (same port and settings), back in service."""
        self.in_service[i] = False
        started = time.monotonic()
        kv = self.kvs[i]
        kv.stop()
        code = kv.proc.returncode if kv.proc else None
        stopped = time.monotonic() - started
        workers = self.start(i, {"live", "degraded"})
        record = {"replica": i, "after_requests": after, "exit": code,
                  "stop_s": round(stopped, 2),
                  "out_of_service_s": round(time.monotonic() - started, 2), "workers": workers}
        self.restarts.append(record)
        return record

    def stop(self) -> None:
        for kv in self.kvs:
            kv.stop()
            kv.close()


async def rolling_restart(replicas: Replicas, points: list[int], progress: dict[str, Any],
                          say: Callable[[str], None], label: str) -> None:
    """Restart replica i once ``points[i]`` requests are done, one at a time (on a thread:
    the clients go on sending meanwhile)."""
    for i, point in enumerate(points):
        while progress["done"] < point and not progress.get("finished"):
            await asyncio.sleep(0.05)
        if progress.get("finished"):  # the requests ran out first: noted by run_one
            return
        say(f"  {label}: restarting replica {i} after {progress['done']} requests")
        record = await asyncio.to_thread(replicas.restart, i, progress["done"])
        workers = ", ".join(f"{name} {w['state']} restored {w['restored_blocks']}"
                            f"+{w['restored_unconfirmed']} unconfirmed, holds {w['holdings']}"
                            for name, w in record["workers"].items())
        say(f"  {label}: replica {i} back in service after {record['out_of_service_s']}s "
            f"(exit {record['exit']}): {workers}")


# --- one run ------------------------------------------------------------------------------------


class Sender:
    """Sends one request the way its router says and measures it from the client."""

    def __init__(self, client: httpx.AsyncClient, fleet: Fleet, router: str, max_tokens: int,
                 abandon_every: int, kvroute: Kvroute | None, ids: dict[str, str],
                 balancer: Balancer | None = None, replicas: Replicas | None = None) -> None:
        self.client = client
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

    def body(self, req: Request) -> dict[str, Any]:
        return {"model": self.fleet.model, "prompt": req.prompt, "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    async def __call__(self, req: Request) -> Outcome:
        out = Outcome(req.index, len(req.prompt))
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
                    answer = await self.client.post(f"{kv.url}/v1/route",
                                                    json={"token_ids": req.prompt}, timeout=10.0)
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
        await self._stream(url, req, headers, started, out, abandon)
        return out

    async def _stream(self, url: str, req: Request, headers: dict[str, str], started: float,
                      out: Outcome, abandon: bool) -> None:
        usage = None
        finished = False
        try:
            async with self.client.stream("POST", f"{url}/v1/completions", json=self.body(req),
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
                        finished = True
                        break
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


async def client_phase(workload: Workload, concurrency: int, sender_args: dict[str, Any],
                       timeout: float, say: Callable[[str], None], label: str,
                       rolling: bool = False) -> tuple[list[Outcome], bool, int]:
    """The run's requests; with ``rolling``, the replicas are restarted in turn meanwhile.
    Returns the outcomes, whether the deadline cut the run, and the replica failovers."""
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
        return outcomes, timed_out, sender.failovers


def run_one(fleet: Fleet, procs: ProcessSet, workload: Workload, router: str,
            concurrency: int, args: argparse.Namespace, log_dir: Path, clock: Clock,
            repeat: int = 0) -> RunRecord:
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
                                redis_server.url if redis_server else None, clock.say)
            replicas.start_all()
            kv, ids = replicas.kvs[0], dict(replicas.ids)
            clock.say(f"  {REPLICA_COUNT} fresh kvroute replicas at "
                      f"{', '.join(k.url for k in replicas.kvs)}, state shared through "
                      f"{'redis-server ' + redis_server.url if redis_server else 'nothing'} "
                      f"(logs {log_dir.name}/{tag}/replica-*/kvroute.log), engines live: {ids}")
        elif router.startswith("kvroute") or router.endswith("-kvroute"):
            kv, ids = start_kvroute(procs, fleet, log_dir / tag, router == "kvroute-proxy",
                                    clock.say)
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
                           balancer=balancer, replicas=replicas)
        started = time.monotonic()
        rolling = router in REPLICAS and REPLICAS[router][1]
        outcomes, timed_out, failovers = asyncio.run(client_phase(
            workload, concurrency, sender_args, args.run_timeout, clock.say, label, rolling))
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


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# --- plots --------------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    routers = list(dict.fromkeys(r["router"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    cell = {(r["workload"], r["router"], r["concurrency"]): r for r in rows}
    width = 0.8 / max(1, len(routers))
    colors = plt.get_cmap("tab10").colors
    files = []
    for fname, ylabel, values in (
        ("hitrate.png", "prefix-cache hit rate (engines' metrics)",
         lambda r: (r["hit_rate"] or 0.0, None)),
        ("ttft.png", "TTFT at the client, ms (bar p50, tick p90)",
         lambda r: (r["ttft_p50_ms"] or 0.0, r["ttft_p90_ms"])),
    ):
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5),
                                 squeeze=False)
        for ax, wl in zip(axes[0], workloads, strict=True):
            for j, router in enumerate(routers):
                xs, ys, ticks = [], [], []
                for i, level in enumerate(levels):
                    r = cell.get((wl, router, level))
                    if r is None:
                        continue
                    y, tick = values(r)
                    xs.append(i + j * width)
                    ys.append(y)
                    ticks.append(tick)
                ax.bar(xs, ys, width, label=router, color=colors[j % len(colors)])
                tx = [x for x, t in zip(xs, ticks, strict=True) if t is not None]
                ty = [t for t in ticks if t is not None]
                if ty:
                    ax.scatter(tx, ty, marker="_", s=200, color="black", zorder=3)
            ax.set_xticks([i + width * (len(routers) - 1) / 2 for i in range(len(levels))],
                          [f"{c} client{'s' if c > 1 else ''}" for c in levels])
            ax.set_title(wl)
            ax.set_ylabel(ylabel)
            if fname == "hitrate.png":
                ax.set_ylim(0, 1.0)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(routers), fontsize=9)
        fig.suptitle(f"real vLLM {VLLM_VERSION} (CPU), {len(rows[0]['engine_hits'])} engines")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        files.append(str(out / fname))
    return files


# --- main ---------------------------------------------------------------------------------------


def _rotated(items: list[str], by: int) -> list[str]:
    k = by % len(items)
    return items[k:] + items[:k]


def _csv(text: str, cast: Callable[[str], Any] = str) -> list[Any]:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def _git_state() -> dict[str, Any]:
    def git(*argv: str) -> str:
        result = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                                check=False)
        return result.stdout

    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": [line[3:] for line in git("status", "--porcelain").splitlines()
                         if "M" in line[:2]]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="64 requests per workload, concurrency 1 and 4")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per workload (default 120, quick 64)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated client counts (default 1,4,16; quick 1,4)")
    parser.add_argument("--routers", default=",".join(ROUTERS),
                        help="comma-separated subset of " + ",".join(ROUTERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every cell this many times (routers in a rotating order) and "
                             "pool the requests: these engines share two cores, so one short "
                             "run is noisy")
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=64, help="KV blocks per engine")
    parser.add_argument("--buffer-steps", type=int, default=None,
                        help="KV-event batches each engine's replay keeps (default: vLLM's "
                             "10,000); short, a kvroute started from nothing misses what was "
                             "stored earlier (see kvroute-2r-roll and kvroute-2r-cold)")
    parser.add_argument("--abandon-every", type=int, default=0,
                        help="hang up every K-th stream after its first event (0: never)")
    parser.add_argument("--lb-deadline-ms", type=int, default=None,
                        help="the balancers' deadline for kvroute's answer (default: the "
                             "shipped files' 50 ms)")
    parser.add_argument("--leak-wait", type=float, default=10.0,
                        help="seconds kvroute gets for its inflight counts to reach 0")
    parser.add_argument("--run-timeout", type=float, default=900.0,
                        help="limit of one run's client phase, seconds")
    parser.add_argument("--boot-timeout", type=float, default=600.0)
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".e2e",
                        help="vLLM venv (shared with make e2e), model and logs (default .e2e/)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "real")
    args = parser.parse_args(argv)
    args.requests = args.requests or (64 if args.quick else 120)
    args.concurrency = _csv(args.concurrency or ("1,4" if args.quick else "1,4,16"), int)
    args.routers = _csv(args.routers)
    args.workloads = _csv(args.workloads)
    for given, known, what in ((args.routers, ROUTERS, "routers"),
                               (args.workloads, WORKLOADS, "workloads")):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            parser.error(f"unknown or no {what}: {', '.join(unknown)}")
    if args.buffer_steps is not None and args.buffer_steps < 1:
        parser.error("--buffer-steps must be positive")
    if (args.engines < 1 or args.requests < 1 or args.repeat < 1 or not args.concurrency
            or min(args.concurrency) < 1 or (args.lb_deadline_ms is not None
                                             and args.lb_deadline_ms < 1)):
        parser.error("--engines, --requests, --repeat, --concurrency and --lb-deadline-ms "
                     "must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock()
    install_signal_handlers()
    git_at_start = _git_state()  # kvroute is started afresh for each run from this tree
    work = args.work_dir.resolve()
    logs = work / "real-hitrate" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    workloads = {name: make_workload(name, args.seed, args.requests) for name in args.workloads}
    for wl in workloads.values():
        clock.say(f"workload {wl.name}: {wl.summary()}")

    if any(router in BALANCERS for router in args.routers):
        ensure_installed(clock.say)
        found = versions()
        clock.say(f"balancers: {found['nginx']}; {found['haproxy']}")
    clock.say(f"vLLM {VLLM_VERSION}: creating or reusing its virtual environment")
    venv = setup_vllm(work, clock.say)
    model = write_model_dir(work / "real-hitrate" / "model-tiny-llama")
    procs = ProcessSet()
    engines: list[Engine] = []
    fleet: Fleet | None = None
    rows: list[dict[str, Any]] = []
    planned = len(args.workloads) * len(args.concurrency) * len(args.routers)
    try:
        for i in range(args.engines):
            spec = EngineSpec(f"vllm-{i}", venv, model, logs, num_blocks=args.num_blocks,
                              buffer_steps=args.buffer_steps)
            engines.append(Engine(spec, procs))
            clock.say(f"starting {spec.name}: {spec.url}, events :{spec.events_port}, "
                      f"{spec.num_blocks} blocks of {spec.block_size} tokens "
                      f"(log {logs / (spec.name + '.log')})")
            engines[-1].start()
        wait_ready(engines, args.boot_timeout, clock.say)
        fleet = Fleet(engines, str(model), clock.say)
        # Each repetition visits the routers in a rotated order, so no router always runs
        # first (or last) in a cell when the machine's load drifts.
        runs = [(rep, w, c, r) for rep in range(args.repeat) for w in args.workloads
                for c in args.concurrency for r in _rotated(args.routers, rep)]
        records: dict[tuple[str, int, str], list[RunRecord]] = {}
        failures: dict[tuple[str, int, str], str] = {}
        for n, (rep, wname, level, router) in enumerate(runs, 1):
            clock.say(f"---- run {n}/{len(runs)}")
            cell = (wname, level, router)
            try:
                records.setdefault(cell, []).append(run_one(
                    fleet, procs, workloads[wname], router, level, args, logs, clock, rep))
            except Exception as exc:  # keep the other runs; an engine that died stops them
                message = f"{type(exc).__name__}: {exc}"
                clock.say(f"run {wname} x{level} {router} FAILED: {message}")
                failures.setdefault(cell, message)
                try:
                    fleet.check_alive()
                except RuntimeError:
                    clock.say("an engine died: no further runs")
                    break
        for wname in args.workloads:
            for level in args.concurrency:
                for router in args.routers:
                    cell = (wname, level, router)
                    if cell in failures:
                        rows.append(failed_row(wname, router, level, fleet.names,
                                               failures[cell]))
                    elif cell in records:
                        rows.append(summarize(merge(records[cell])))
    finally:
        clock.say("stopping everything the benchmark started")
        procs.stop_all()
        if fleet is not None:
            fleet.close()
        for engine in engines:
            engine.close()

    add_partition_share(rows)
    add_added_latency(rows)
    leaks = inflight_leaks(rows)
    boots = {e.name: round(e.boot_seconds, 1) for e in engines if e.boot_seconds is not None}
    report = {
        "benchmark": "real_hitrate",
        "vllm": VLLM_VERSION,
        "mode": "quick" if args.quick else "default",
        "engines": args.engines,
        "block_size": engines[0].spec.block_size if engines else None,
        "num_blocks": args.num_blocks,
        "buffer_steps": args.buffer_steps,
        "max_model_len": engines[0].spec.max_model_len if engines else None,
        "max_tokens": args.max_tokens,
        "abandon_every": args.abandon_every,
        "lb_deadline_ms": args.lb_deadline_ms or 50,
        "seed": args.seed,
        "repeat": args.repeat,
        "concurrency": args.concurrency,
        "routers": args.routers,
        "workloads": {name: wl.summary() for name, wl in workloads.items()},
        "kvroute": {"at_start": git_at_start, "at_end": _git_state()},
        "boot_seconds": boots,
        "runs": rows,
        "inflight_leaks": leaks,
        "wall_seconds": round(clock.elapsed(), 1),
    }
    done = [r for r in rows if not r.get("failed")]
    report["plots"] = plot(done, out) if done else []
    text = table(rows)
    (out / "real_hitrate.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "real_hitrate.txt").write_text(text + "\n")
    print(json.dumps(report), flush=True)
    print("\n" + text, file=sys.stderr)
    if leaks:
        print("\n" + "!" * 78 + "\nIN-FLIGHT LEAKS (kvroute load.inflight not back to 0):",
              file=sys.stderr)
        for line in leaks:
            print(f"  {line}", file=sys.stderr)
        print("!" * 78, file=sys.stderr)
    else:
        checked = sum(1 for r in rows if "inflight" in r)
        print(f"\nin-flight check: {checked} kvroute runs, every load.inflight back to 0",
              file=sys.stderr)
    failed = [r for r in rows if r.get("failed")]
    print(f"wrote {out / 'real_hitrate.json'}, {out / 'real_hitrate.txt'} and "
          f"{len(report['plots'])} plots; {report['wall_seconds']:.0f}s in all; "
          f"{len(rows) - len(failed)} runs done, {len(failed)} failed", file=sys.stderr)
    return 1 if failed or len(rows) < planned else 0  # a missing row: an engine died


if __name__ == "__main__":
    sys.exit(main())
