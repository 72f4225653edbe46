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
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.real_fleet import Fleet
from benchmarks.real_parts import (
    BALANCERS,
    ROUTERS,
    WORKLOADS,
    RunRecord,
    add_added_latency,
    add_partition_share,
    failed_row,
    inflight_leaks,
    make_workload,
    merge,
    runs_table,
    summarize,
    table,
)
from benchmarks.real_run import Clock, run_one
from e2e.engines import Engine, EngineSpec, wait_ready
from e2e.lb import ensure_installed, versions
from e2e.model import write_model_dir
from e2e.processes import ProcessSet, install_signal_handlers
from e2e.run import VLLM_VERSION, setup_vllm

ROOT = Path(__file__).resolve().parent.parent


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
    files.append(plot_runs(rows, out))
    return files


def plot_runs(rows: list[dict[str, Any]], out: Path) -> str:
    """One panel per (workload, concurrency) cell, one point per run: each router's runs as
    shares of the partition's median run, so a dip shows where an average would hide it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in rows))
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4.2), squeeze=False)
    for ax, (wl, level) in zip(axes[0], cells, strict=True):
        routers = [r for r in rows if (r["workload"], r["concurrency"]) == (wl, level)]
        for x, r in enumerate(routers):
            shares = [100 * v for v in r.get("share_repeats") or [] if v is not None]
            ax.scatter([x] * len(shares), shares, s=22, alpha=0.7)
        ax.axhline(97, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(routers)), [r["router"] for r in routers], rotation=30,
                      ha="right", fontsize=8)
        ax.set_title(f"{wl}, {level} client{'s' if level > 1 else ''}", fontsize=9)
        ax.set_ylabel("run's hit rate, % of the partition's median run")
    fig.suptitle(f"real vLLM {VLLM_VERSION} (CPU), {len(rows[0]['engine_hits'])} engines: "
                 "every run")
    fig.tight_layout()
    path = out / "runs.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --- main ---------------------------------------------------------------------------------------


def _rotated(items: list[str], by: int) -> list[str]:
    k = by % len(items)
    return items[k:] + items[:k]


def _csv(text: str, cast: Callable[[str], Any] = str) -> list[Any]:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def _cores(text: str) -> frozenset[int] | str:
    """``--engine-cores``: 'shared', or cores as taskset spells them (1 / 2-3 / 1,3)."""
    if text == "shared":
        return text
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of cores: {text!r}") from None
    if not cores:
        raise argparse.ArgumentTypeError("no core given")
    return frozenset(cores)


def split_cores(requested: frozenset[int] | str | None,
                available: set[int]) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(the engines' cores, everyone else's), or (None, None) to share every core.

    On this rig the engines' compute is a GPU's in a deployment, and vLLM's engine and
    worker processes wait for each other in loops that yield the core and spin again (for a
    second after each message). Sharing cores with them, the clients and kvroute were held
    off a core for up to a second at a time, and that was measured as routing time; the
    split keeps each side on cores of its own, as separate machines would."""
    if requested == "shared":
        return None, None
    if requested is None:
        if len(available) < 2:
            return None, None
        requested = frozenset(sorted(available)[1:])
    missing = requested - available
    rest = frozenset(available - requested)
    if missing or not rest:
        raise SystemExit(f"--engine-cores: cores {sorted(requested)} leave no core of "
                         f"{sorted(available)} for the clients and kvroute"
                         if not missing else
                         f"--engine-cores: cores {sorted(missing)} are not available to this "
                         f"process (it may use {sorted(available)})")
    return requested, rest


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
    parser.add_argument("--engines", "--instances", type=int, default=2,
                        help="vLLM engines (CPU builds of the same tiny model, sharing cores)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per workload (default 120, quick 64)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated client counts (default 1,4,16; quick 1,4)")
    parser.add_argument("--routers", default=",".join(ROUTERS),
                        help="comma-separated subset of " + ",".join(ROUTERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every cell this many times (routers in a rotating order); "
                             "each run is reported on its own, the worst first, beside the "
                             "pooled figures")
    parser.add_argument("--prompts", choices=("tokens", "text"), default="tokens",
                        help="send token ids (engines without a tokenizer), or text that the "
                             "engines tokenize and kvroute tokenizes through their /tokenize "
                             "(tokenizer = \"instance\", a user's default)")
    parser.add_argument("--kvroute-tokenizer", choices=("instance", "local"), default="instance",
                        help="with text prompts, how kvroute tokenizes them: through the "
                             "engines' /tokenize (default), or with the model's tokenizer.json "
                             "read by kvroute itself (no call to the engines)")
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=64, help="KV blocks per engine")
    parser.add_argument("--engine-cores", type=_cores, default=None,
                        help="the cores the engines run on, e.g. 1 or 2-3 (default: every core "
                             "but the first, which the clients, kvroute and the balancers "
                             "keep; 'shared': no split)")
    parser.add_argument("--front-ends", choices=("engines", "clients"), default="engines",
                        help="with the cores split, where the engines' HTTP front ends (the "
                             "`vllm serve` processes: HTTP, tokenizing, /tokenize, streaming) "
                             "run: on the engines' cores (default), or on the clients' and "
                             "kvroute's, as on a GPU machine, where only the forward pass "
                             "runs on the accelerator")
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
    engine_cores, own_cores = split_cores(args.engine_cores, os.sched_getaffinity(0))
    if own_cores is not None:
        os.sched_setaffinity(0, own_cores)  # kvroute, the balancers, redis-server inherit it
        clock.say(f"engines on cores {sorted(engine_cores or ())}; clients, kvroute and "
                  f"balancers on {sorted(own_cores)}")
    procs = ProcessSet()
    engines: list[Engine] = []
    fleet: Fleet | None = None
    rows: list[dict[str, Any]] = []
    planned = len(args.workloads) * len(args.concurrency) * len(args.routers)
    try:
        for i in range(args.engines):
            spec = EngineSpec(f"vllm-{i}", venv, model, logs, num_blocks=args.num_blocks,
                              buffer_steps=args.buffer_steps, cpus=engine_cores,
                              tokenizer=args.prompts == "text")
            engines.append(Engine(spec, procs))
            clock.say(f"starting {spec.name}: {spec.url}, events :{spec.events_port}, "
                      f"{spec.num_blocks} blocks of {spec.block_size} tokens "
                      f"(log {logs / (spec.name + '.log')})")
            engines[-1].start()
        wait_ready(engines, args.boot_timeout, clock.say)
        if own_cores is not None and args.front_ends == "clients":
            for engine in engines:
                engine.move_front_end(own_cores)
            clock.say(f"engines' HTTP front ends moved to cores {sorted(own_cores)}")
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
        "engine_cores": sorted(engine_cores) if engine_cores else "shared",
        "front_ends": args.front_ends if engine_cores else "shared",
        "max_model_len": engines[0].spec.max_model_len if engines else None,
        "max_tokens": args.max_tokens,
        "abandon_every": args.abandon_every,
        "lb_deadline_ms": args.lb_deadline_ms or 50,
        "seed": args.seed,
        "prompts": args.prompts,
        "kvroute_tokenizer": args.kvroute_tokenizer if args.prompts == "text" else None,
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
    text = runs_table(rows) + "\n\n" + table(rows)  # the worst run first
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
