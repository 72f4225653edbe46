"""`make e2e-lb`: nginx and HAProxy with kvroute's shipped files (deploy/), run for real.

Run from the repository root with the project's interpreter: ``.venv/bin/python -m
e2e.lb_run``. It installs nginx, its njs module and HAProxy with apt-get when they are
missing, checks that each accepts its shipped configuration untouched, starts two
simulated vLLM instances (two data-parallel ranks each, an --api-key of their own), kvroute
(with an api_token) and a scripted stand-in for kvroute, then four balancers on loopback:
nginx and HAProxy asking kvroute, and nginx and HAProxy asking the stand-in. Their
configurations are the shipped files with only ports, addresses and the deadline changed
(e2e/lb.py); the deadline is stretched from 50 ms to seconds so that a busy machine never
turns a routing check into a fallback (the checks never assert speed). Then it runs the
checks of e2e/lb_checks.py, stops kvroute, and checks that the upstream group serves every
request. A balancer that cannot start fails the run; nothing is skipped. Everything it
starts it stops, by process group, on success, failure, Ctrl-C and SIGTERM.

Exit status 0 only if every check passed. KVROUTE_TEST_TIMEOUT_SCALE stretches every
deadline, as in the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx

from e2e import lb_checks
from e2e.lb import (
    DEPLOY,
    Balancer,
    BalancerError,
    binary,
    ensure_installed,
    render_haproxy,
    render_nginx,
    start_balancer,
    versions,
)
from e2e.lb_checks import API_TOKEN, BLOCK, INSTANCE_KEY, MODEL, STREAM_INTERVAL_S, Setup
from e2e.lb_fake import FakeKvroute
from e2e.ports import free_port
from e2e.processes import ProcessSet, install_signal_handlers
from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster


def _scale() -> float:
    raw = os.environ.get("KVROUTE_TEST_TIMEOUT_SCALE", "").strip() or "1"
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value < float("inf"):
        raise SystemExit(f"e2e-lb: KVROUTE_TEST_TIMEOUT_SCALE must be a number >= 1, got {raw!r}")
    return value


SCALE = _scale()
REAL_DEADLINE_MS = int(5000 * SCALE)  # kvroute's answer, for the balancers asking kvroute
FAKE_DEADLINE_MS = int(1500 * SCALE)  # the stand-in's answer (a stall costs this much)
WAIT_S = 30.0 * SCALE


class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", flush=True)


def run_check(clock: Clock, name: str, fn: Callable[[], str]) -> tuple[str, bool, str]:
    clock.say(f"check {name} ...")
    started = time.monotonic()
    details: list[str] = []
    try:
        summary, ok = fn(), True
    except (lb_checks.CheckFailed, BalancerError) as exc:
        summary, ok = str(exc), False
    except Exception as exc:  # a balancer died, an HTTP call failed
        summary, ok = f"{type(exc).__name__}: {exc}", False
        details = traceback.format_exc().splitlines()[-8:]
    clock.say(f"check {name}: {'PASS' if ok else 'FAIL'} ({time.monotonic() - started:.1f}s): "
              f"{summary}")
    for line in details:
        print(f"          {line}", flush=True)
    return name, ok, summary


def check_shipped_files(work: Path) -> str:
    """Each balancer accepts its configuration exactly as shipped (nginx -t, haproxy -c),
    and the shipped deadline is 50 ms."""
    render_nginx(8080, ["http://10.0.0.5:8000", "http://10.0.0.6:8000"],
                 "http://127.0.0.1:8000", None, True)  # finds the 50 ms example deadline
    render_haproxy(8080, ["http://10.0.0.5:8000", "http://10.0.0.6:8000"],
                   "http://127.0.0.1:8000", None, True)
    out = []
    for kind, files, argv in (
        ("nginx", ("nginx.conf", "kvroute.js"),
         lambda d: [binary("nginx"), "-t", "-p", str(d), "-c", str(d / "nginx.conf"),
                    "-e", "stderr"]),
        ("haproxy", ("haproxy.cfg", "kvroute.lua"),
         lambda d: [binary("haproxy"), "-c", "-f", str(d / "haproxy.cfg")]),
    ):
        directory = work / f"shipped-{kind}"
        directory.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy(DEPLOY / kind / name, directory / name)
        result = subprocess.run([str(a) for a in argv(directory)], capture_output=True,
                                text=True, check=False, timeout=60)
        if result.returncode != 0:
            raise lb_checks.CheckFailed(f"{kind} refuses deploy/{kind}/ as shipped:\n"
                                        f"{result.stdout}{result.stderr}")
        out.append(f"{kind} accepts deploy/{kind}/")
    return ", ".join(out)


def register(http: httpx.Client, kv_url: str, url: str) -> str:
    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    answer = http.post(f"{kv_url}/v1/instances", json={"url": url, "api_key": INSTANCE_KEY},
                       headers=headers)
    if answer.status_code != 201:
        raise RuntimeError(f"registering {url}: {answer.status_code} {answer.text}")
    instance_id = str(answer.json()["id"])
    deadline = time.monotonic() + WAIT_S
    while True:
        state = http.get(f"{kv_url}/v1/instances/{instance_id}", headers=headers).json()
        if state.get("state") == "live":
            return instance_id
        if time.monotonic() > deadline:
            raise RuntimeError(f"{instance_id} not live within {WAIT_S:.0f}s: {state}")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (configurations and logs)")
    args = parser.parse_args(argv)
    clock = Clock()
    install_signal_handlers()
    try:
        ensure_installed(clock.say)
    except BalancerError as exc:
        print(f"e2e-lb: FAILED: {exc}", flush=True)
        return 1
    found = versions()
    clock.say(f"balancers: {found['nginx']}; {found['haproxy']}")
    work = Path(tempfile.mkdtemp(prefix="kvroute-e2e-lb-"))
    work.chmod(0o755)  # nginx's workers drop root: they must reach their temporary files
    clock.say(f"work directory {work} (configurations and logs)")
    results: list[tuple[str, bool, str]] = [
        run_check(clock, "shipped files", lambda: check_shipped_files(work))]
    procs = ProcessSet()
    kv: BackgroundServer | None = None
    balancers: list[Balancer] = []
    try:
        with (SimCluster(n=2, block_size=BLOCK, num_blocks=1024, dp_size=2, model=MODEL,
                         stream_interval_s=STREAM_INTERVAL_S, api_key=INSTANCE_KEY) as cluster,
              FakeKvroute() as fake, FakeKvroute() as dying,
              httpx.Client(timeout=60.0 * SCALE, trust_env=False) as http):
            clock.say(f"simulated vLLM instances (2 ranks each): {', '.join(cluster.urls)}")
            kv = BackgroundServer(Settings(host="127.0.0.1", port=0, tokenizer="instance",
                                           api_token=API_TOKEN, log_level="warning")).start()
            ids = [register(http, kv.url, url) for url in cluster.urls]
            clock.say(f"kvroute at {kv.url}, instances live: {', '.join(ids)}")
            dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            token = {"KVROUTE_API_TOKEN": API_TOKEN}
            real, faked = {}, {}
            for kind in ("nginx", "haproxy"):
                real[kind] = start_balancer(kind, procs, work, instances=cluster.urls,
                                            kvroute=kv.url, deadline_ms=REAL_DEADLINE_MS,
                                            env=token, label="kvroute")
                faked[kind] = start_balancer(kind, procs, work,
                                             instances=[cluster.urls[0], dead_url],
                                             kvroute=fake.url, deadline_ms=FAKE_DEADLINE_MS,
                                             env=token, label="fake")
                balancers += [real[kind], faked[kind]]
                clock.say(f"{kind}: {real[kind].url} asks kvroute, {faked[kind].url} asks the "
                          f"stand-in (deadlines {REAL_DEADLINE_MS} and {FAKE_DEADLINE_MS} ms)")
            setup = Setup(cluster, kv.url, ids, fake, dying, dead_url, real, faked, http,
                          WAIT_S, clock.say)
            for name, fn in lb_checks.plan(setup):
                results.append(run_check(clock, name, fn))
            clock.say("stopping kvroute: the balancers must serve everything without it")
            kv.stop()
            kv = None
            setup.kvroute_stopped = True
            for kind, lb in real.items():
                results.append(run_check(clock, f"{kind}: kvroute stopped",
                                         lambda lb=lb: lb_checks.check_kvroute_stopped(setup,
                                                                                       lb)))
            for lb in balancers:
                code = lb.proc.exited()
                if code is not None:
                    results.append((f"{lb.kind} still running", False,
                                    f"exited with {code}:\n{lb.log_tail()}"))
    except (BalancerError, RuntimeError) as exc:
        clock.say(f"setup failed: {exc}")
        results.append(("setup", False, str(exc)))
    finally:
        clock.say("stopping everything the harness started")
        procs.stop_all()
        if kv is not None:
            kv.stop()
    failed = [r for r in results if not r[1]]
    print("\n==== nginx and HAProxy in front of kvroute and simulated vLLM")
    for name, ok, summary in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name:40s} {summary.splitlines()[0][:150]}")
    for lb in balancers if failed else []:
        crashes = [line for line in lb.log_tail(400).splitlines()
                   if "signal" in line and "exited" in line or "[alert]" in line]
        if crashes:
            print(f"{lb.kind} ({lb.directory}): {crashes[-3:]}")
    print(f"timing: total {time.monotonic() - clock.start:.0f}s")
    print(f"e2e-lb: {len(results) - len(failed)} passed, {len(failed)} failed")
    if failed or args.keep:
        print(f"configurations and logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
