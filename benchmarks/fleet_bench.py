"""A fleet of simulated workers behind one `kvroute serve --config`: start-up, routing and
idle cost as the fleet grows (issue: fleets of a thousand workers).

Per fleet size: publishers in separate processes (64 at most, shared by the workers: each
worker is one data-parallel rank of an instance, its events on a publisher), one publisher
in eight holding a 64-block prefix; kvroute as its own process. Measured: time until every
worker is live, `POST /v1/route` of a 1,040-token prompt starting with the prefix (p50/p99,
answer bytes) beside `/healthz` of the same server in the same run (the floor), kvroute's
CPU idle (share of one core, from /proc) over the 10 s right after, and over 20 s from a
minute after the fleet went live (settled: quiet workers' idle checks have backed off), its
RSS, routes and /healthz while 100 instances (800 workers) are added through the API at
once and then removed at once, three times (p50/p99 beside those of the same requests on
the idle fleet just before, how long until every added worker was live; the routes timed
from a process of their own, benchmarks.route_timer), and the time from SIGTERM to its
exit. For both of those windows, what kvroute's own histograms say (loop lag, a route's own
time, the wait for its body) and what Linux says of its event loop (time on a core, time
ready but waiting for one) beside the CPU of everything else (benchmarks.proc_sched):
kvroute's own work apart from its wait for a core. `--pin` and `--favour` try two ways to
take that wait away. Then two fleets (`--compare`, 32 and 1,024 workers) run at once, their
routes sent alternately, so the ratio of their latencies is measured under the same machine
noise. The load monitor runs as configured by default; the simulated publishers have no
HTTP server, so the instances have no `url`. Prints JSON and a table (benchmarks.report);
writes bench-out/fleet/fleet.json and, when matplotlib is installed, fleet.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from benchmarks import proc_sched
from benchmarks.peer_sides import rss_bytes
from benchmarks.report import emit
from benchmarks.route_timer import RouteTimer

T = TypeVar("T")

PUBLISHER_PROCESSES = 4
MAX_PUBLISHERS = 64
RANKS = 8
ROUTES = 200
IDLE_SECONDS = 10.0  # the first idle window, right after the fleet went live and routed
# The settled window: quiet workers' idle checks back off (doubling up to 40 s), so the
# first minute after start-up is the fleet's first waves of checks, not its steady cost.
SETTLED_AFTER_LIVE = 60.0
SETTLED_SECONDS = 20.0
CHANGED_INSTANCES = 100  # added at once through the API, then removed at once
CHANGE_CYCLES = 3  # of adding and removing them, routed through all along
CHANGE_IDLE_SECONDS = 10.0  # routes on the idle fleet just before (a p99 of thousands)
POLL = 0.2  # seconds between listings while waiting for the added instances
INTERLEAVED_ROUTES = 1000  # to each of two fleets at once, alternately


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# kvroute's own histograms read at the edges of each window: its event loop's lag, a
# route's own time once its body has arrived, and the wait for that body.
_HISTOGRAMS = ("kvroute_event_loop_lag_seconds", "kvroute_route_latency_seconds",
               "kvroute_route_body_seconds")


def _scrape(http: httpx.Client) -> dict:
    """kvroute's histograms (`_HISTOGRAMS`, summed over labels): cumulative counts by
    bucket bound and the sum of observations, and how long the scrape took (ms,
    "scrape")."""
    t = time.perf_counter()
    text = http.get("/metrics").text
    read: dict = {"scrape": (time.perf_counter() - t) * 1000}
    for line in text.splitlines():
        for name in _HISTOGRAMS:
            if line.startswith(name + "_bucket"):
                bound = line.split('le="')[1].split('"')[0]
                buckets = read.setdefault(name, {})
                buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_sum"):
                read[name + "_sum"] = read.get(name + "_sum", 0.0) + \
                    float(line.rsplit(" ", 1)[1])
    return read


def _own_time(before: dict, after: dict, name: str) -> dict[str, float]:
    """Of one of kvroute's histograms between two scrapes: how many observations, their
    total (s), the share over 1, 2.5 and 5 ms, and the 99th percentile as the bound of the
    bucket that holds it (so "<= 1 ms" reads 0.001)."""
    b, a = before[name], after[name]
    bounds = sorted((k for k in a if k != "+Inf"), key=float)
    total = a["+Inf"] - b["+Inf"]
    shown = {"count": total, "sum_s": after[name + "_sum"] - before[name + "_sum"]}
    for bound in ("0.001", "0.0025", "0.005"):
        shown[f"over_{bound}"] = (total - (a[bound] - b[bound])) / max(total, 1)
    shown["p99_at_most"] = next((float(k) for k in bounds
                                 if a[k] - b[k] >= 0.99 * total), float("inf"))
    return shown


_LAG, _ROUTE, _BODY = _HISTOGRAMS


def _lag_shares(before: dict, after: dict) -> dict[str, float]:
    """Of the loop-lag monitor's wake-ups between two scrapes (one every 10 ms), the share
    that woke more than 2.5, 5 and 10 ms late: stalls of kvroute's own loop, apart from
    whatever delays the client and the machine add to the latencies measured outside.
    The scrape that opened the window held the loop itself (its answer was made before the
    monitor saw that): that one late wake-up is not counted."""
    lags_before, lags_after = before[_LAG], after[_LAG]
    total = lags_after["+Inf"] - lags_before["+Inf"]
    shares = {}
    for bound in ("0.0025", "0.005", "0.01"):
        late = total - (lags_after[bound] - lags_before[bound])
        if before["scrape"] > float(bound) * 1000:
            late = max(0.0, late - 1)
        shares[f"over_{bound}"] = late / max(total, 1)
    shares["scrape_ms"] = before["scrape"]
    shares["sum_s"] = after[_LAG + "_sum"] - before[_LAG + "_sum"]
    return shares


def _add_then_remove(base: str, bodies: list[dict], pool) -> dict:
    """One cycle: POST every body at once, wait until every added instance is live (polled
    every POLL seconds: the listing of a thousand instances is itself work for kvroute),
    DELETE them all at once."""
    with httpx.Client(base_url=base, timeout=60,
                      limits=httpx.Limits(max_connections=32)) as admin:
        started = time.monotonic()
        answers = list(pool.map(lambda body: admin.post("/v1/instances", json=body), bodies))
        added = [body["id"] for body, answer in zip(bodies, answers, strict=True)
                 if answer.status_code == 201]
        refused = [answer.json()["error"] for answer in answers if answer.status_code != 201]
        live_after = None
        while time.monotonic() - started < 120:
            states = [i["state"] for i in admin.get("/v1/instances").json()["instances"]
                      if i["id"].startswith("added")]
            if len(states) == len(added) and all(s == "live" for s in states):
                live_after = time.monotonic() - started
                break
            time.sleep(POLL)
        removing = time.monotonic()
        removed = list(pool.map(lambda i: admin.delete(f"/v1/instances/{i}").status_code,
                                added))
        assert all(status in (200, 204) for status in removed), removed
        return {"live_after": live_after, "removed_after": time.monotonic() - removing,
                "refused": refused}


def _cpu_share(pid: int, seconds: float) -> float:
    """Process `pid`'s CPU over the next `seconds`, as a share of one core."""
    before = proc_sched.cpu_seconds(pid)
    time.sleep(seconds)
    return (proc_sched.cpu_seconds(pid) - before) / seconds


def _favour(pid: int) -> None:
    """The main thread of process `pid` (kvroute's event loop, the timed routes' client)
    scheduled first in, first out at the lowest real-time priority: it runs as soon as it
    is ready, whatever else wants a core (the threads it starts later do not inherit this).
    Its CPU use is what it was, and Linux keeps 5% of each core for other tasks all the
    same. Needs the privilege to set real-time scheduling."""
    try:
        os.sched_setscheduler(pid, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except PermissionError:
        raise SystemExit("--favour needs the privilege to set real-time scheduling "
                         "(CAP_SYS_NICE)") from None


def _timed_window(base: str, prompt: list[int], pid: int, others: dict[str, list[int]],
                  favour: bool, work: Callable[[], T]) -> tuple[dict, T]:
    """Routes and /healthz timed from a process of their own (the route timer) while `work`
    runs, beside kvroute's histograms and Linux's accounting of its process (`pid`) and of
    `others` plus the timer, read before and after. `favour`: the timer's process
    scheduled as `_favour` says. Returns what the window measured, and what `work` did."""
    with httpx.Client(base_url=base, timeout=60) as http:
        timer = RouteTimer(base, prompt).start()
        if favour:
            _favour(timer.pid)
        try:
            group = {**others, "router": [timer.pid]}
            lags_start, sched_start = _scrape(http), proc_sched.sample(pid, group)
            timer.go()
            done = work()
            routes, health = timer.finish()
            lags_end, sched_end = _scrape(http), proc_sched.sample(pid, group)
        finally:
            timer.close()
    return {"routes": routes, "health": health, "lags": (lags_start, lags_end),
            "sched": (sched_start, sched_end)}, done


def change_fleet(base: str, endpoints: list, prompt: list[int], pid: int,
                 others: dict[str, list[int]], cycles_n: int = CHANGE_CYCLES,
                 favour: bool = False) -> dict:
    """`cycles_n` times: add CHANGED_INSTANCES instances of RANKS workers at once
    (concurrent POSTs), wait until every one is live, remove them at once (concurrent
    DELETEs), with routes and /healthz answered all along on another connection. Beside
    them, the same routes and /healthz on an idle fleet just before, in the same run.
    For both windows, what kvroute's own histograms and Linux's accounting of its process
    (`pid`) and of `others` (publishers, this client) say (benchmarks.proc_sched).
    `favour`: the route timer's process scheduled as `_favour` says (kvroute's loop is
    the caller's to favour)."""
    idle, _ = _timed_window(base, prompt, pid, others, favour,
                            lambda: time.sleep(CHANGE_IDLE_SECONDS))
    ids = [f"added{n:03d}" for n in range(CHANGED_INSTANCES)]
    bodies = [{"id": i, "block_size": 16,
               "events": [endpoints[(n * RANKS + r) % len(endpoints)][0] for r in range(RANKS)],
               "replay": [endpoints[(n * RANKS + r) % len(endpoints)][1] for r in range(RANKS)]}
              for n, i in enumerate(ids)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        changing, cycles = _timed_window(
            base, prompt, pid, others, favour,
            lambda: [_add_then_remove(base, bodies, pool) for _ in range(cycles_n)])
    lives = [c["live_after"] for c in cycles]
    refused = [reason for c in cycles for reason in c["refused"]]
    shown: dict = {"change_instances": CHANGED_INSTANCES, "change_cycles": cycles_n}
    for when, window in (("before", idle), ("during", changing)):
        routes, health, lags = window["routes"], window["health"], window["lags"]
        shown.update({
            f"change_route_{when}_p50_ms": statistics.median(routes),
            f"change_route_{when}_p99_ms": _percentile(routes, 0.99),
            f"change_healthz_{when}_p50_ms": statistics.median(health),
            f"change_healthz_{when}_p99_ms": _percentile(health, 0.99),
            f"loop_lag_{when}": _lag_shares(*lags),
            f"own_route_{when}": _own_time(*lags, _ROUTE),
            f"body_wait_{when}": _own_time(*lags, _BODY),
            f"sched_{when}": proc_sched.window(*window["sched"], len(routes))})
    shown.update({
        "change_routes": len(changing["routes"]),
        "change_live_after_s": None if None in lives else max(lives),
        "change_refused": len(refused),
        "change_refused_reason": refused[0] if refused else None,
        "change_removed_after_s": max(c["removed_after"] for c in cycles)})
    return shown


def _echo(stream, said: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        said.append(line)


def _publishers(workers: int) -> tuple[list[subprocess.Popen], list]:
    publishers_n = min(MAX_PUBLISHERS, workers)
    per_process = -(-publishers_n // PUBLISHER_PROCESSES)
    procs, endpoints = [], []
    for first in range(0, publishers_n, per_process):
        count = min(per_process, publishers_n - first)
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fleet_publishers", "--count", str(count),
             "--first", str(first)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        endpoints += json.loads(proc.stdout.readline())
    return procs, endpoints


def _kvroute(workers: int, endpoints: list, workdir: Path,
             cores: set[int] | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """`kvroute serve --config` following `workers` workers on `endpoints` (on `cores`
    only, if given): the process, its base URL, and the lines it says (echoed; its last one
    says why, if it exits)."""
    port = _free_port()
    lines = [f"port = {port}", 'log_level = "warning"',
             f"max_instances = {workers + CHANGED_INSTANCES * RANKS}"]
    for n in range(workers // RANKS):
        ranks = [endpoints[(n * RANKS + r) % len(endpoints)] for r in range(RANKS)]
        lines += ["[[instances]]", f'id = "i{n:04d}"', "block_size = 16",
                  "events = [" + ", ".join(f'"{e}"' for e, _ in ranks) + "]",
                  "replay = [" + ", ".join(f'"{r}"' for _, r in ranks) + "]"]
    config = workdir / f"fleet-{workers}.toml"
    config.write_text("\n".join(lines) + "\n")
    kvroute = subprocess.Popen([sys.executable, "-m", "kvroute.app.cli", "serve",
                                "--config", str(config)], stderr=subprocess.PIPE, text=True,
                               preexec_fn=None if cores is None
                               else lambda: os.sched_setaffinity(0, cores))
    said: list[str] = []
    threading.Thread(target=_echo, args=(kvroute.stderr, said), daemon=True).start()
    return kvroute, f"http://127.0.0.1:{port}", said


def _wait_live(base: str, instances: int, seconds: float) -> float | None:
    started = time.monotonic()
    with httpx.Client(base_url=base, timeout=30) as http:
        while time.monotonic() - started < seconds:
            try:
                listed = http.get("/v1/instances").json()["instances"]
                if len(listed) == instances and all(i["state"] == "live" for i in listed):
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    return None


def interleaved(small: int, large: int, workdir: Path) -> dict:
    """Both fleets' kvroute servers up at once, their routes sent alternately (one to
    each, INTERLEAVED_ROUTES times), so that whatever else the machine does slows both
    alike: the ratio of the large fleet's route latency to the small one's."""
    procs, servers = [], []
    try:
        for workers in (small, large):
            pubs, endpoints = _publishers(workers)
            procs += pubs
            servers.append(_kvroute(workers, endpoints, workdir))
        for workers, (_, base, _) in zip((small, large), servers, strict=True):
            if _wait_live(base, workers // RANKS, 180) is None:
                return {"error": f"the {workers}-worker fleet did not go live"}
        prompt = list(range(1, 1041))
        times: dict[int, list[float]] = {small: [], large: []}
        with httpx.Client(base_url=servers[0][1], timeout=30) as a, \
                httpx.Client(base_url=servers[1][1], timeout=30) as b:
            for client in (a, b):  # warm both up before timing
                for _ in range(20):
                    client.post("/v1/route", json={"token_ids": prompt, "probe": True})
            for n in range(INTERLEAVED_ROUTES):
                order = ((small, a), (large, b)) if n % 2 else ((large, b), (small, a))
                for workers, client in order:
                    t = time.perf_counter()
                    answer = client.post("/v1/route", json={"token_ids": prompt,
                                                            "probe": True})
                    times[workers].append((time.perf_counter() - t) * 1000)
                    assert answer.status_code == 200, answer.text
        p50 = {w: statistics.median(v) for w, v in times.items()}
        p99 = {w: _percentile(v, 0.99) for w, v in times.items()}
        return {"small": small, "large": large, "routes_each": INTERLEAVED_ROUTES,
                "small_p50_ms": p50[small], "small_p99_ms": p99[small],
                "large_p50_ms": p50[large], "large_p99_ms": p99[large],
                "p50_ratio": p50[large] / p50[small], "p99_ratio": p99[large] / p99[small]}
    finally:
        for kvroute, _, _ in servers:
            kvroute.send_signal(signal.SIGTERM)
            try:
                kvroute.wait(30)
            except subprocess.TimeoutExpired:
                kvroute.kill()
                kvroute.wait()
        for proc in procs:
            proc.stdin.close()
            proc.wait(30)


def run_one(workers: int, workdir: Path, kvroute_cores: set[int] | None = None,
            cycles_n: int = CHANGE_CYCLES, favour: bool = False) -> dict:
    procs, endpoints = _publishers(workers)
    publishers_n = len(endpoints)
    kvroute = None
    try:
        started = time.monotonic()
        kvroute, base, said = _kvroute(workers, endpoints, workdir, kvroute_cores)
        with httpx.Client(base_url=base, timeout=30) as http:
            live_after = None
            while time.monotonic() - started < 180:
                try:
                    listed = http.get("/v1/instances").json()["instances"]
                    if all(i["state"] == "live" for i in listed) and \
                            len(listed) == workers // RANKS:
                        live_after = time.monotonic() - started
                        break
                except httpx.TransportError:
                    if kvroute.poll() is not None:  # it could not start: say why, go on
                        time.sleep(1)  # for its last line to be echoed
                        return {"workers": workers, "publishers": publishers_n,
                                "error": said[-1].strip() if said else "kvroute exited"}
                time.sleep(0.1)
            prompt = list(range(1, 1041))
            route_ms, health_ms, size = [], [], 0
            for _ in range(ROUTES):
                t = time.perf_counter()
                answer = http.post("/v1/route", json={"token_ids": prompt, "probe": True})
                route_ms.append((time.perf_counter() - t) * 1000)
                size = len(answer.content)
                t = time.perf_counter()
                http.get("/healthz")
                health_ms.append((time.perf_counter() - t) * 1000)
            matched = answer.json().get("matched_blocks")
            idle_cpu = _cpu_share(kvroute.pid, IDLE_SECONDS)
            if live_after is not None:
                time.sleep(max(0.0, started + live_after + SETTLED_AFTER_LIVE
                               - time.monotonic()))
            settled_cpu = _cpu_share(kvroute.pid, SETTLED_SECONDS)
            rss = rss_bytes(kvroute.pid) / 2**20
        if favour:
            _favour(kvroute.pid)
        change = change_fleet(base, endpoints, prompt, kvroute.pid,
                              {"publishers": [p.pid for p in procs], "client": [os.getpid()]},
                              cycles_n, favour)
        stop_at = time.monotonic()
        kvroute.send_signal(signal.SIGTERM)
        kvroute.wait(60)
        shutdown = time.monotonic() - stop_at
        return {"workers": workers, "publishers": publishers_n, "live_after_s": live_after,
                "route_p50_ms": statistics.median(route_ms),
                "route_p99_ms": _percentile(route_ms, 0.99),
                "healthz_p50_ms": statistics.median(health_ms),
                "healthz_p99_ms": _percentile(health_ms, 0.99),
                "answer_bytes": size, "matched_blocks": matched,
                "idle_cpu_core_share": idle_cpu, "settled_cpu_core_share": settled_cpu,
                "rss_mb": rss, "shutdown_s": shutdown,
                **change}
    finally:
        if kvroute is not None and kvroute.poll() is None:
            kvroute.kill()
            kvroute.wait()
        for proc in procs:
            proc.stdin.close()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,256,1024",
                        help="fleet sizes, comma-separated (multiples of 8)")
    parser.add_argument("--huge", action="store_true", help="also 4,096 workers")
    parser.add_argument("--compare", default="32,1024",
                        help="two fleet sizes whose routes are compared interleaved, both up "
                             "at once ('' to skip)")
    parser.add_argument("--cycles", type=int, default=CHANGE_CYCLES,
                        help="times the instances are added and removed")
    parser.add_argument("--pin", action="store_true",
                        help="kvroute on the first core alone, the publishers and this client "
                             "on the others (other users of the machine are not moved)")
    parser.add_argument("--favour", action="store_true",
                        help="kvroute's event loop and the timed routes' client at real-time "
                             "priority (first in, first out) once the fleet is live, so "
                             "neither waits for a core behind the publishers, ZeroMQ's "
                             "threads or anything else: the change-phase latency left is "
                             "kvroute's own work (needs privilege)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/fleet"))
    args = parser.parse_args()
    kvroute_cores, all_cores = None, os.sched_getaffinity(0)
    if args.pin:
        kvroute_cores = {min(os.sched_getaffinity(0))}
        os.sched_setaffinity(0, os.sched_getaffinity(0) - kvroute_cores or kvroute_cores)
    sizes = [int(s) for s in args.sizes.split(",")] + ([4096] if args.huge else [])
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_one(size, Path(tmp), kvroute_cores, args.cycles, args.favour)
                for size in sizes]
        compared = None
        if args.compare:
            small, large = (int(s) for s in args.compare.split(","))
            os.sched_setaffinity(0, all_cores)  # both fleets alike, wherever they run
            compared = interleaved(small, large, Path(tmp))
    ran = [r for r in rows if "error" not in r]
    base = ran[0]
    per_worker = None
    if len(ran) > 1:
        last = ran[-1]
        per_worker = (last["rss_mb"] - base["rss_mb"]) * 1024 / (last["workers"] - base["workers"])
    table = ["| workers | all live after | route p50 / p99 | /healthz p50 / p99 | answer | "
             "idle CPU: first 10 s / settled | RSS | shutdown |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['workers']:,} | did not start: {r['error']} |")
            continue
        live = "never" if r["live_after_s"] is None else f"{r['live_after_s']:.1f} s"
        table.append(
            f"| {r['workers']:,} | {live} | {r['route_p50_ms']:.1f} / {r['route_p99_ms']:.1f} ms"
            f" | {r['healthz_p50_ms']:.1f} / {r['healthz_p99_ms']:.1f} ms"
            f" | {r['answer_bytes'] / 1024:.1f} KB | {100 * r['idle_cpu_core_share']:.1f}% / "
            f"{100 * r['settled_cpu_core_share']:.1f}%"
            f" | {r['rss_mb']:.0f} MB | {r['shutdown_s']:.1f} s |")
    table += ["", f"| workers | idle just before: route p50 / p99, /healthz p50 / p99 | "
              f"while {CHANGED_INSTANCES} instances are added, then removed "
              f"({args.cycles} times): route p50 / p99, /healthz p50 / p99 | "
              "added all live after (worst) | removed in (worst) |",
              "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            continue
        live = "never" if r["change_live_after_s"] is None else \
            f"{r['change_live_after_s']:.1f} s"
        table.append(
            f"| {r['workers']:,} | {r['change_route_before_p50_ms']:.1f} / "
            f"{r['change_route_before_p99_ms']:.1f} ms, "
            f"{r['change_healthz_before_p50_ms']:.1f} / "
            f"{r['change_healthz_before_p99_ms']:.1f} ms | "
            f"{r['change_route_during_p50_ms']:.1f} / {r['change_route_during_p99_ms']:.1f} ms,"
            f" {r['change_healthz_during_p50_ms']:.1f} / "
            f"{r['change_healthz_during_p99_ms']:.1f} ms ({r['change_routes']} routes) | "
            f"{live} | {r['change_removed_after_s']:.1f} s |")
        lag_b, lag_d = r["loop_lag_before"], r["loop_lag_during"]
        table.append(f"| | kvroute's loop woke late by > 2.5 / 5 / 10 ms: idle "
                     f"{100 * lag_b['over_0.0025']:.1f} / {100 * lag_b['over_0.005']:.1f} / "
                     f"{100 * lag_b['over_0.01']:.1f}% of wake-ups, changing "
                     f"{100 * lag_d['over_0.0025']:.1f} / {100 * lag_d['over_0.005']:.1f} / "
                     f"{100 * lag_d['over_0.01']:.1f}% (a /metrics scrape itself held it "
                     f"{lag_d['scrape_ms']:.0f} ms) |")
        for when in ("before", "during"):
            sched, own = r[f"sched_{when}"], r[f"own_route_{when}"]
            body = r[f"body_wait_{when}"]
            table.append(
                f"| | {'idle' if when == 'before' else 'changing'}: kvroute's loop on a core "
                f"{100 * sched['loop_on_core_share']:.0f}% of the time, ready but waiting "
                f"for one {100 * sched['loop_queued_share']:.0f}% "
                f"({sched['loop_queued_ms_per_route']:.2f} ms per route, preempted "
                f"{sched['loop_preempted_per_s']:.0f}/s); loop lag in all "
                f"{1000 * r[f'loop_lag_{when}']['sum_s']:.0f} ms over "
                f"{sched['seconds']:.1f} s; a route's own time p99 <= "
                f"{1000 * own['p99_at_most']:.1f} ms ({100 * own['over_0.0025']:.1f}% over "
                f"2.5 ms), its body's wait p99 <= {1000 * body['p99_at_most']:.1f} ms; CPU "
                f"(cores): kvroute {sched['process_cpu_share']:.2f}, publishers "
                f"{sched['publishers_cpu_share']:.2f}, timed routes' client "
                f"{sched['router_cpu_share']:.2f}, the changes' client "
                f"{sched['client_cpu_share']:.2f},"
                f" rest of the machine {sched['rest_of_machine_cores']:.2f} of "
                f"{sched['cores']} |")
        if r["change_refused"]:
            asked = CHANGED_INSTANCES * r["change_cycles"]
            table.append(f"| | {r['change_refused']} of the {asked} registrations "
                         f"({r['change_cycles']} cycles of {CHANGED_INSTANCES}) refused: "
                         f"{r['change_refused_reason']} |")
    if per_worker is not None:
        table.append(f"\nmemory per idle worker: {per_worker:.0f} KB "
                     f"(RSS from {base['workers']} to {ran[-1]['workers']} workers)")
    if compared is not None and "error" in compared:
        table.append(f"\ninterleaved comparison: {compared['error']}")
    elif compared is not None:
        c = compared
        table.append(
            f"\nboth up at once, routes alternated ({c['routes_each']} to each): "
            f"{c['small']:,} workers {c['small_p50_ms']:.2f} / {c['small_p99_ms']:.2f} ms, "
            f"{c['large']:,} workers {c['large_p50_ms']:.2f} / {c['large_p99_ms']:.2f} ms "
            f"(p50 / p99); ratio {c['p50_ratio']:.2f}x p50, {c['p99_ratio']:.2f}x p99")
    result = {"benchmark": "fleet", "rows": rows, "rss_kb_per_worker": per_worker,
              "interleaved": compared, "cycles": args.cycles, "pinned": args.pin,
              "favour": args.favour}
    emit(result, "\n".join(table), out_file=args.out / "fleet.json")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots()
    xs = [r["workers"] for r in ran]
    ax.plot(xs, [r["route_p50_ms"] for r in ran], "o-", label="route p50")
    ax.plot(xs, [r["route_p99_ms"] for r in ran], "o-", label="route p99")
    ax.plot(xs, [r["healthz_p50_ms"] for r in ran], "o--", label="/healthz p50")
    ax.set_xscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("ms")
    ax.legend()
    fig.savefig(args.out / "fleet.png")


if __name__ == "__main__":
    main()
