"""`make e2e`: kvroute against two real vLLM engines (CPU build), end to end.

Run from the repository root with the project's interpreter:
``.venv/bin/python -m e2e.run``. It creates or reuses the vLLM environment
(e2e/setup_vllm.sh), writes a tiny dummy-weight model, boots two engines on
loopback with small KV caches (so eviction happens), prefix caching, KV
events with replay and per-request cached-token reports, starts kvroute,
registers the engines by their HTTP URLs only, and runs the checks in
:mod:`e2e.checks`. Everything it starts it stops, on success, failure,
Ctrl-C or SIGTERM. Exit status 0 only if every check passed.

The last check (10, saved state) restarts both engines with a short replay
buffer and kvroute on a state dir; ``--drop-saved-state`` turns it into its
negative control (the state dir is deleted between kvroute's stop and start,
and the check must fail). ``--checks 10`` runs that check alone. Check 11 routes
completions through kvroute's Endpoint Picker (ext_proc gRPC), the harness playing
the gateway (``--checks 11`` alone: about two minutes after the engines are up). Check
12 reads kvroute's own predicted-vs-actual metrics for requests it proxies, and empties an
engine's cache behind kvroute's back to see the difference counted. Check 13 evicts a prompt
that vLLM's reuse reports (``kv_cache_report_mode: "full"``) re-announced, and check 14 sends
one prompt under two cache salts and none, through the route API and the proxy
(:mod:`e2e.tenant_checks`).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from e2e import checks
from e2e.checks import CheckFailed, CheckResult, Cluster
from e2e.engines import Engine, EngineSpec, wait_ready
from e2e.epp_check import check_epp
from e2e.hit_check import check_hit_accuracy
from e2e.model import write_model_dir
from e2e.processes import ProcessSet, install_signal_handlers
from e2e.service import Kvroute, KvrouteError
from e2e.tap import EventTap
from e2e.tenant_checks import check_reuse_reports, check_tenants
from e2e.workloads import shared_prefix_workload

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"

# Checks 1-6 compare the index's event-derived state with vLLM, and several ask
# kvroute about prompts they then do not send. With placement guesses on, each
# such question would leave a guess behind (by design), so those checks run
# with guesses off; check 8 restarts kvroute with its defaults to test guesses.
# Proxy mode is on so that check 7 can send completions through kvroute.
EVENTS_ONLY = {"KVROUTE_PLACEMENT_TTL": "0", "KVROUTE_PROXY": "true"}
# Check 10 restarts the engines with a replay buffer this small (checks 5, 8 and 9 need
# the default one: a kvroute they start from nothing rebuilds from a replay from seq 0).
SAVED_STATE_BUFFER = 32
CHECKS = {str(n) for n in range(1, 15)}


class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", flush=True)


def setup_vllm(work: Path, say: Callable[[str], None]) -> Path:
    venv = work / f"venv-vllm-{VLLM_VERSION}"
    result = subprocess.run(
        ["bash", str(ROOT / "e2e" / "setup_vllm.sh"), str(venv)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"e2e: FAILED: vLLM {VLLM_VERSION} could not be installed "
                         "(reason above); the end-to-end checks need a real vLLM")
    return venv


def run_check(clock: Clock, name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    clock.say(f"check {name} ...")
    started = time.monotonic()
    try:
        result = fn()
    except (CheckFailed, KvrouteError) as exc:
        result = CheckResult(name, False, str(exc))
    except Exception as exc:  # an engine died, kvroute crashed, an HTTP call failed
        result = CheckResult(name, False, f"{type(exc).__name__}: {exc}",
                             details=traceback.format_exc().splitlines()[-6:])
    result.seconds = time.monotonic() - started
    clock.say(f"check {result.name}: {'PASS' if result.ok else 'FAIL'} "
              f"({result.seconds:.1f}s): {result.summary}")
    for line in result.details[:40]:
        print(f"          {line}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".e2e",
                        help="venv, model and logs (default: .e2e/)")
    parser.add_argument("--num-blocks", type=int, default=64,
                        help="KV-cache blocks per engine; small so eviction happens")
    parser.add_argument("--boot-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=20261121)
    parser.add_argument("--checks", default=None, metavar="N,N,...",
                        help="run only these checks (by number, in the usual order; they "
                             "may depend on the ones before: for debugging)")
    parser.add_argument("--buffer-steps", type=int, default=SAVED_STATE_BUFFER,
                        help="the engines' replay buffer in check 10 (saved state)")
    parser.add_argument("--drop-saved-state", action="store_true",
                        help="negative control: check 10 deletes kvroute's state dir between "
                             "its stop and its start, and must then FAIL")
    args = parser.parse_args(argv)
    if args.buffer_steps < 8:
        parser.error("--buffer-steps must be at least 8")
    selected = None if args.checks is None else {
        c.strip() for c in args.checks.split(",") if c.strip()}
    if selected is not None and (not selected or selected - CHECKS):
        parser.error(f"--checks: the checks are {', '.join(sorted(CHECKS, key=int))}")

    clock = Clock()
    install_signal_handlers()
    work = args.work_dir.resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    clock.say(f"vLLM {VLLM_VERSION}: creating or reusing its virtual environment")
    venv = setup_vllm(work, clock.say)
    install_seconds = time.monotonic() - clock.start
    model = write_model_dir(work / "model-tiny-llama")
    clock.say(f"model folder {model.relative_to(ROOT) if model.is_relative_to(ROOT) else model}"
              " (config.json only, dummy weights)")

    procs = ProcessSet()
    taps: dict[str, EventTap] = {}
    engines: dict[str, Engine] = {}
    kvroute: Kvroute | None = None
    results: list[CheckResult] = []
    try:
        # Only check 10: the engines start with its small replay buffer (no restart).
        buffer_steps = args.buffer_steps if selected == {"10"} else None
        for name in ("vllm-a", "vllm-b"):
            spec = EngineSpec(name, venv, model, logs, num_blocks=args.num_blocks,
                              buffer_steps=buffer_steps)
            engines[name] = Engine(spec, procs)
            taps[name] = EventTap(name, f"tcp://127.0.0.1:{spec.events_port}")
            clock.say(f"starting {name}: http {spec.url}, events :{spec.events_port}, "
                      f"replay :{spec.replay_port}, {spec.num_blocks} blocks of "
                      f"{spec.block_size} tokens (log {spec.name}.log)")
            engines[name].start()
        wait_ready(list(engines.values()), args.boot_timeout, clock.say)

        kvroute = Kvroute(procs, logs)
        kvroute.start(EVENTS_ONLY)
        clock.say(f"kvroute serving at {kvroute.url} (log kvroute.log); registering engines by URL")
        cluster = Cluster(engines, taps, kvroute, say=clock.say)
        cluster.register_all()

        rng = random.Random(args.seed)
        workload = shared_prefix_workload(rng, 40)
        names = list(engines)
        plan: list[tuple[str, Callable[[], CheckResult]]] = [
            ("1 agreement", lambda: checks.check_agreement(cluster, workload)),
            ("5 kvroute restart", lambda: checks.check_kvroute_restart(cluster, workload)),
            ("2 eviction", lambda: checks.check_eviction(cluster, names[0], rng)),
            ("3 reset_prefix_cache", lambda: checks.check_reset(cluster, names[0], workload)),
            ("6 routing pays", lambda: checks.check_routing_pays(cluster, rng)),
            ("4 engine restart", lambda: checks.check_engine_restart(
                cluster, names[1], rng, args.boot_timeout)),
            ("7 proxy", lambda: checks.check_proxy(cluster, rng)),
            ("8 placement guesses", lambda: checks.check_placement(cluster, rng)),
            ("9 concurrent proxy", lambda: checks.check_concurrent_proxy(cluster, rng)),
            ("10 saved state", lambda: checks.check_saved_state(
                cluster, rng, buffer_steps=args.buffer_steps, state_dir=work / "kvroute-state",
                settings=EVENTS_ONLY | {"KVROUTE_STATE_DIR": str(work / "kvroute-state"),
                                        "KVROUTE_STATE_SAVE_INTERVAL": "3600"},
                boot_timeout=args.boot_timeout, drop_saved_state=args.drop_saved_state)),
            ("11 epp", lambda: check_epp(cluster, rng)),
            ("12 hit accuracy", lambda: check_hit_accuracy(cluster, rng)),
            ("13 reuse reports", lambda: check_reuse_reports(cluster, names[0], rng)),
            ("14 tenants", lambda: check_tenants(cluster, rng)),
        ]
        assert {name.split()[0] for name, _ in plan} == CHECKS
        if selected is not None:
            plan = [(name, fn) for name, fn in plan if name.split()[0] in selected]
        for name, fn in plan:
            results.append(run_check(clock, name, fn))
    finally:
        clock.say("stopping everything the harness started")
        for tap in taps.values():
            tap.close()
        procs.stop_all()
        for engine in engines.values():
            engine.close()
        if kvroute is not None:
            kvroute.close()

    boots = ", ".join(f"{e.name} {e.boot_seconds:.0f}s" for e in engines.values()
                      if e.boot_seconds is not None)
    print("\n==== kvroute end-to-end against vLLM " + VLLM_VERSION)
    for result in sorted(results, key=lambda r: int(r.name.split()[0])):
        print(f"{'PASS' if result.ok else 'FAIL'}  {result.name:22s} {result.summary}")
    total = time.monotonic() - clock.start
    print(f"timing: setup {install_seconds:.0f}s, last boots {boots}, total {total:.0f}s")
    passed = sum(r.ok for r in results)
    print(f"e2e: {passed} passed, {len(results) - passed} failed")
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
