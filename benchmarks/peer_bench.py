"""kvroute beside Dynamo's standalone KV indexer, fed the same stream at the same time
(issue: ingest and match faster than the strongest peer).

One publisher process (benchmarks.peer_publisher) serves ``--workers`` event streams; kvroute
(``kvroute serve``) and the peer (``python -m dynamo.indexer``, installed into
bench-out/peer-venv on first use) each subscribe to all of them, in processes of their own.
Measured in one run:

- ingest, per mix (benchmarks.peer_stream: ``roots`` with lagged removals, ``deep`` chains
  that workers share): stored blocks per second from the first batch sent until the
  indexer shows every worker holding the mix's marker block (its last), beside the
  msgspec decode-only floor of the same payloads (kvroute's decoder, in this process,
  before anything else runs); a 1k-token query every poll while it ingests (p99);
- kvroute's worst event-loop lag during each ingest (its ``kvroute_event_loop_lag_*``);
- each side's CPU time (all threads) from the first batch sent until every side is done,
  per stored block: on two shared cores the wall-clock rate depends on what the other
  processes take, the CPU per block much less;
- after ingest, both indexers' answers checked against what the stream leaves each worker
  holding; a mismatch, or a marker not seen within the deadline, is reported (the peer
  losing events), not waited for;
- query p50/p99 at 1k/8k/32k tokens over the deep mix's holdings, each query after one of
  the side's own health round trips, so the work per query (p50 minus the health p50 of
  the same stretch) is not skewed by what the machine did meanwhile; every round asks
  every length of both sides in turn, so the busy seconds right after ingest fall on all
  of them alike. kvroute is asked three times after each round trip, in turns first: a
  route (POST /v1/route, probe: its decision, which the peer does not make), a match (POST
  /v1/match: each worker's matched tokens, what the peer's query answers) and an empty
  match (one token); the peer its query and an empty one. The empty question is a second
  baseline, on the queries' own server path;
- RSS per holding (growth from before ingest over holdings).

``--rounds N`` ingests both mixes N times, each time in fresh processes of every side,
and adds each round's ratio of the two rates and their median; the other figures are the
last round's.

``--quick`` (what ``make bench`` runs) is a smaller stream, and runs kvroute alone when
the peer's venv is not there yet (``make bench-peer`` installs it). JSON and a table
(benchmarks.report), bench-out/peer/peer.json and, with matplotlib, peer.png.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import proc_sched
from benchmarks.peer_sides import Dynamo, Kvroute, Side, ensure_peer, peer_python
from benchmarks.peer_stream import BLOCK, Mix, deep, doc_tokens, roots
from benchmarks.report import emit
from kvroute.app.ingest.wire import decode_batch

POLL = 0.05
QUERY_LENGTHS = (1024, 8192, 32768)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def decode_floor(mix: Mix) -> float:
    """Stored blocks per second of decoding every payload once (nothing applied)."""
    payloads = [p for per_worker in mix.payloads for p in per_worker]
    started = time.perf_counter()
    for payload in payloads:
        decode_batch(payload)
    return mix.stored / (time.perf_counter() - started)


class _Watch(threading.Thread):
    """Polls one side while it ingests: a timed 1k-token query, then whether every worker
    holds the marker; stops at the marker or the deadline."""

    def __init__(self, side: Side, mix: Mix, probe: list[int], deadline: float) -> None:
        super().__init__(daemon=True)
        self.side, self.mix, self.probe, self.deadline = side, mix, probe, deadline
        self.done_at: float | None = None
        self.threads_at_end: dict[int, tuple[int, int]] = {}  # proc_sched.threads
        self.holders = 0
        self.latencies: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                self.latencies.append(self.side.query(self.probe)[0])
                held = self.side.holding(self.mix.marker)
                self.holders = sum(1 for n in held.values() if n == BLOCK)
                if self.holders == self.side.workers:
                    self.done_at = time.monotonic()
                    self.threads_at_end = proc_sched.threads(self.side.pid)
                    return
                time.sleep(POLL)
        except Exception as exc:  # reported, never waited for
            self.error = repr(exc)


def start_publisher(workers: int) -> tuple[subprocess.Popen[str], list[list[str]]]:
    """benchmarks.peer_publisher serving ``workers`` streams, and their endpoints."""
    publisher = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.peer_publisher", str(workers)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert publisher.stdout is not None
    return publisher, json.loads(publisher.stdout.readline())["endpoints"]


def stop_publisher(publisher: subprocess.Popen[str]) -> None:
    assert publisher.stdin is not None
    publisher.stdin.close()
    publisher.wait(30)


def ask(publisher: subprocess.Popen[str], request: dict[str, Any]) -> dict[str, Any]:
    assert publisher.stdin is not None and publisher.stdout is not None
    publisher.stdin.write(json.dumps(request) + "\n")
    publisher.stdin.flush()
    return json.loads(publisher.stdout.readline())


def _check(side: Side, mix: Mix, workers: int) -> list[str]:
    """Where ``side``'s answers differ from what the stream leaves held."""
    wrong = []
    for w, tokens, held in mix.samples:
        got = side.holding(tokens)
        want = {w: len(tokens)} if held else {}
        if got != want:
            wrong.append(f"{mix.name} chain of worker {w}: {got} instead of {want}")
    for doc, holders in sorted(mix.holders.items())[:8]:
        got = side.holding(doc_tokens(doc, 1024))
        want = dict.fromkeys(holders, 1024)
        if got != want:
            wrong.append(f"{mix.name} document {doc}: {len(got)} holders, want {len(want)}")
    return wrong


def ingest(sides: list[Side], publisher: subprocess.Popen[str], mix: Mix, path: Path,
           kv: Kvroute, timeout: float, unpublished: int = 0) -> dict[str, Any]:
    """Send ``mix`` (its first ``unpublished`` batches per worker to the replay buffer only,
    see benchmarks.peer_publisher) and watch every side until it holds the mix's marker."""
    mix.save(path)
    probe = doc_tokens(0, 1024)
    lag_before = kv.loop_lag()
    cpu_before = {side.name: side.cpu_seconds() for side in sides}
    deadline = time.monotonic() + timeout
    watches = [_Watch(side, mix, probe, deadline) for side in sides]
    for watch in watches:
        watch.start()
    # On 2 cores the scheduler shares them out by thread: each side's share says why the
    # two rates move from run to run.
    threads_before = {side.name: proc_sched.threads(side.pid) for side in sides}
    sent = ask(publisher, {"send": str(path), "unpublished": unpublished})
    for watch in watches:
        watch.join(timeout + 5)
    row: dict[str, Any] = {"mix": mix.name, "stored_blocks": mix.stored,
                           "batches": sum(map(len, mix.payloads)),
                           "send_seconds": sent["sent"] - sent["started"],
                           "send_started": sent["started"]}  # time.monotonic()
    for side, watch in zip(sides, watches, strict=True):
        took = None if watch.done_at is None else watch.done_at - sent["started"]
        # CPU the side used until the whole run's end (2 shared cores: wall time depends
        # on what else runs; CPU per block does not, much).
        cpu = side.cpu_seconds() - cpu_before[side.name]
        row[side.name] = {
            "blocks_per_s": None if took is None else mix.stored / took,
            "cpu_seconds": cpu,
            "cpu_us_per_block": 1e6 * cpu / mix.stored,
            "seconds": took,
            "final_state": watch.done_at is not None,
            "marker_holders": watch.holders,
            "error": watch.error,
            "query_1k_during_ingest_p99_ms": percentile([x * 1000 for x in watch.latencies], 0.99),
            "cores": None if took is None else proc_sched.threads_window(
                threads_before[side.name], watch.threads_at_end, took, main=side.pid),
        }
        if watch.done_at is None:
            row[side.name]["error"] = watch.error or (
                f"did not reach the final state within {timeout:g} s: the marker shows on "
                f"{watch.holders} of {side.workers} workers (events lost?)")
    row["kvroute"]["worst_loop_lag_ms"] = 1000 * kv.stall_since(lag_before)
    for side in sides:
        row[side.name]["wrong_answers"] = _check(side, mix, side.workers)[:5]
    return row


def queries(sides: list[Side], mix: Mix, count: int, rng: random.Random,
            ) -> dict[str, dict[str, Any]]:
    """Query p50/p99 per side and prompt length over ``mix``'s documents, each query after a
    health round trip: the index's work per query (p50 minus the health p50 of the same
    stretch) compares two things measured in the same moments of a shared, noisy machine.
    Each of ``count`` rounds asks every length of every side in turn (the sides' order
    alternating), so a busy stretch (the first seconds after ingest, when an indexer or the
    publisher may still be working) falls on every length and side alike.

    A side with several questions (kvroute: a route, and a match like the peer's query)
    asks each of them after the same health round trip, in turns first; the first
    question's figures are the length's own, the others' under their names. Every side
    also asks an empty question (one token, nothing matched) each time: its p50 is a second
    baseline, on the same server path as the queries (`over_empty_p50_ms`), where a health
    check's path may be longer or shorter than a query's."""
    docs = sorted(mix.holders)
    asks = {side.name: list(side.questions().items()) for side in sides}
    times = {(side.name, length): {name: [] for name, _ in asks[side.name]}
             for side in sides for length in QUERY_LENGTHS}
    health: dict[tuple[str, int], list[float]] = {key: [] for key in times}
    wrong = dict.fromkeys(asks, 0)
    for number in range(count):
        for length in QUERY_LENGTHS:
            doc = rng.choice(docs)
            for side in sides[::-1] if number % 2 else sides:
                key = (side.name, length)
                health[key].append(side.health() * 1000)
                for name, ask in asks[side.name][::-1] if number % 2 else asks[side.name]:
                    took, got = ask(doc_tokens(doc, length))
                    times[key][name].append(took * 1000)
                    wrong[side.name] += (name != "empty"
                                         and max(got.values(), default=0) != length)
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        mine: dict[str, Any] = out.setdefault(side.name, {})
        for length in QUERY_LENGTHS:
            key = (side.name, length)
            health_p50 = statistics.median(health[key])
            empty_p50 = statistics.median(times[key]["empty"])
            row: dict[str, Any] = {"health_p50_ms": health_p50,
                                   "health_p99_ms": percentile(health[key], 0.99)}
            for number, (name, took) in enumerate(times[key].items()):
                figures = {"p50_ms": statistics.median(took),
                           "p99_ms": percentile(took, 0.99),
                           "work_p50_ms": statistics.median(took) - health_p50,
                           "over_empty_p50_ms": statistics.median(took) - empty_p50}
                if number == 0:
                    row.update(figures)
                elif name != "empty":
                    row[name] = figures
            row["empty_p50_ms"] = empty_p50
            mine[f"{length}"] = row
        every_health = [h for length in QUERY_LENGTHS for h in health[(side.name, length)]]
        mine["health"] = {"p50_ms": statistics.median(every_health),
                          "p99_ms": percentile(every_health, 0.99)}
        mine["questions"] = [name for name, _ in asks[side.name]]
        mine["wrong_best_matches"] = wrong[side.name]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    venv = Path(args.peer_venv)
    with_peer = not args.no_peer and (not args.quick or peer_python(venv).exists())
    python = ensure_peer(venv) if with_peer else None
    workers = args.workers
    mixes = [roots(workers, args.blocks, args.lag),
             deep(workers, args.docs_per_worker, args.doc_blocks)]
    floors = {m.name: decode_floor(m) for m in mixes}
    result: dict[str, Any] = {"benchmark": "peer", "workers": workers, "peer": with_peer,
                              "peer_threads": args.peer_threads, "decode_floor": floors}
    if not with_peer:
        result["peer_skipped"] = "no peer venv (make bench-peer installs it)"
    rounds = []
    for number in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"round {number} of {args.rounds}", file=sys.stderr, flush=True)
        last = number == args.rounds
        rounds.append(one_round(args, mixes, python, result if last else None))
    result["ingest"] = rounds[-1]
    if args.rounds > 1:
        result["ingest_rounds"] = rounds
        if with_peer:
            result["ingest_ratio"] = ratios(rounds)
    return result


def ratios(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """kvroute's ingest rate over the peer's, per mix: each round's (None where a side did
    not reach the final state) and their median."""
    out: dict[str, dict[str, Any]] = {}
    for rows in rounds:
        for row in rows:
            mine, theirs = row["kvroute"]["blocks_per_s"], row["dynamo"]["blocks_per_s"]
            each = out.setdefault(row["mix"], {"each": []})["each"]
            each.append(None if not mine or not theirs else mine / theirs)
    for figures in out.values():
        known = [x for x in figures["each"] if x is not None]
        figures["median"] = statistics.median(known) if known else None
    return out


def one_round(args: argparse.Namespace, mixes: list[Mix], python: Path | None,
              result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Both mixes ingested by fresh processes of every side: their ingest rows. With a
    ``result`` to fill (the last round), the holdings' memory and the queries after them
    too, and the profile, if asked."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        publisher, endpoints = start_publisher(args.workers)
        kv = Kvroute(args.workers)
        sides: list[Side] = [kv]
        if python is not None:
            sides.append(Dynamo(args.workers, python, args.peer_threads))
        try:
            for side in sides:
                side.start(endpoints, workdir)  # type: ignore[attr-defined]
            subscribed = ask(publisher, {"wait": len(sides), "timeout": 60})["subscribed"]
            if min(subscribed) < len(sides):
                raise RuntimeError(f"subscriptions per stream: {subscribed}")
            rss0 = {s.name: s.rss() for s in sides}
            # Sampled without stopping kvroute: py-spy's default pauses the process for
            # every sample, and at 500 a second that cut its ingest to a tenth (82k
            # blocks/s), so the profile showed the benchmark's routes more than the ingest.
            spy = None if args.profile is None or result is None else subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(kv.pid),
                 "--nonblocking", "--format", "raw", "--rate", "1000",
                 "--output", str(args.profile)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows = [ingest(sides, publisher, m, workdir / f"{m.name}.mix", kv, args.timeout)
                    for m in mixes]
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            if result is not None:
                held = sum(m.held_at_end for m in mixes)
                result["holdings"] = held
                result["rss_bytes_per_holding"] = {s.name: (s.rss() - rss0[s.name]) / held
                                                   for s in sides}
                rng = random.Random(20)
                result["queries"] = queries(sides, mixes[1], args.queries, rng)
            return rows
        finally:
            for side in sides:
                side.stop()
            stop_publisher(publisher)


def table(result: dict[str, Any]) -> str:
    names = ["kvroute", "dynamo"] if result["peer"] else ["kvroute"]
    lines = ["| measure | " + " | ".join(names) + " | decode floor |",
             "|---|" + "---|" * (len(names) + 1)]

    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for row in result.get("ingest", []):
        floor = result["decode_floor"][row["mix"]]
        cells = []
        for n in names:
            r = row[n]
            text = (f"{cell(r['blocks_per_s'], ',.0f')} blocks/s "
                    f"(1k query p99 {cell(r['query_1k_during_ingest_p99_ms'], '.1f')} ms)")
            text += f", {r['cpu_us_per_block']:.2f} CPU µs/block"
            if r.get("cores"):
                c = r["cores"]
                text += (f", ran on {c['run']:.2f} cores (busy threads: {c['busy_threads']};"
                         f" threads waiting for a core: {c['waiting']:.2f} on average)")
            if n == "kvroute":
                text += f", worst loop lag {r['worst_loop_lag_ms']:.0f} ms"
                if r.get("cores"):
                    text += (f"; the event loop's thread ran {r['cores']['main_run']:.2f} of"
                             f" the time and waited for a core {r['cores']['main_waiting']:.2f}")
            if r["error"] or r["wrong_answers"]:
                text += f" **{r['error'] or len(r['wrong_answers'])} wrong**"
            cells.append(text)
        lines.append(f"| ingest {row['mix']} ({row['stored_blocks']:,} blocks) | "
                     + " | ".join(cells) + f" | {floor:,.0f} blocks/s |")
    for mix, figures in result.get("ingest_ratio", {}).items():
        every = ", ".join("-" if x is None else f"{x:.2f}" for x in figures["each"])
        median = "-" if figures["median"] is None else f"{figures['median']:.2f}x"
        lines.append(f"| ingest {mix}, kvroute's rate over the peer's, each round |"
                     f" {every}; median {median} | | |")
    q = result.get("queries", {})

    def each(n: str, length: str, text: Callable[[dict[str, Any]], str]) -> str:
        """One side's cell: each of its questions' figures, named when it has several."""
        asked = [name for name in q[n]["questions"] if name != "empty"]
        if length == "health" or len(asked) == 1:
            return text(q[n][length])
        return "; ".join(f"{name} {text(q[n][length] if i == 0 else q[n][length][name])}"
                         for i, name in enumerate(asked))

    for length in [*map(str, QUERY_LENGTHS), "health"]:
        if not q:
            break
        label = "health round trip" if length == "health" else f"query {int(length) // 1024}k"
        lines.append(f"| {label} p50 (p99) | " + " | ".join(
            each(n, length, lambda f: f"{f['p50_ms']:.2f} ({f['p99_ms']:.2f}) ms")
            for n in names) + " | |")
        if length != "health":
            lines.append(f"| {label}: work p50 (health p50, p99) | " + " | ".join(
                each(n, length, lambda f: f"{f['work_p50_ms']:.2f} ms") + (
                    f" ({q[n][length]['health_p50_ms']:.2f}, "
                    f"{q[n][length]['health_p99_ms']:.2f} ms)") for n in names) + " | |")
            lines.append(f"| {label}: p50 over an empty query's (its p50) | " + " | ".join(
                each(n, length, lambda f: f"{f['over_empty_p50_ms']:.2f} ms")
                + f" ({q[n][length]['empty_p50_ms']:.2f} ms)" for n in names) + " | |")
    if "rss_bytes_per_holding" in result:
        lines.append(f"| RSS per holding ({result['holdings']:,}) | " + " | ".join(
            f"{result['rss_bytes_per_holding'][n]:.0f} B" for n in names) + " | |")
    if not result["peer"]:
        lines.append(f"\npeer skipped: {result['peer_skipped']}")
    lines.append("\nkvroute gets every prompt with one token more than Dynamo (which counts "
                 "the block holding the last token): both match the same full blocks. "
                 "kvroute's `route` is its routing decision (POST /v1/route, probe); its "
                 "`match` (POST /v1/match) answers what the peer's query does: each "
                 "worker's matched tokens, nothing weighed.")
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = ["kvroute", "dynamo"] if result["peer"] else ["kvroute"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    mixes = [r["mix"] for r in result["ingest"]]
    width = 0.8 / (len(names) + 1)
    for k, n in enumerate([*names, "decode floor"]):
        values = [(result["decode_floor"][r["mix"]] if n == "decode floor"
                   else r[n]["blocks_per_s"] or 0) for r in result["ingest"]]
        left.bar([i + k * width for i in range(len(mixes))], values, width, label=n)
    left.set_xticks([i + width for i in range(len(mixes))], mixes)
    left.set_ylabel("stored blocks/s")
    left.set_yscale("log")
    left.legend()
    for n in names:
        q = result["queries"][n]
        right.plot([x // 1024 for x in QUERY_LENGTHS], [q[str(x)]["p50_ms"] for x in QUERY_LENGTHS],
                   "o-", label=f"{n} p50")
    right.set_xlabel("prompt (k tokens)")
    right.set_ylabel("ms")
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "peer.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a small stream; without the peer when its venv is absent")
    parser.add_argument("--no-peer", action="store_true", help="kvroute alone")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="roots mix: blocks stored")
    parser.add_argument("--lag", type=int, default=16, help="roots mix: batches kept")
    parser.add_argument("--docs-per-worker", type=int, default=15)
    parser.add_argument("--doc-blocks", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=200, help="per prompt length")
    parser.add_argument("--rounds", type=int, default=1,
                        help="ingest both mixes this many times, each time in fresh processes,"
                        " and report each round's rate ratio and their median (one run's"
                        " ratio swings by 0.3x on a busy 2-core machine)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per mix, seconds")
    parser.add_argument("--peer-threads", type=int, default=None,
                        help="the peer's --threads (default: its own default)")
    parser.add_argument("--peer-venv", default="bench-out/peer-venv")
    parser.add_argument("--profile", type=Path, default=None,
                        help="record kvroute's ingest with py-spy (collapsed stacks) here")
    parser.add_argument("--out", type=Path, default=Path("bench-out/peer"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.quick:
        args.blocks, args.docs_per_worker, args.queries = 100_000, 2, 50
    result = run(args)
    emit(result, table(result), out_file=args.out / "peer.json")
    plot(result, args.out)


if __name__ == "__main__":
    main()
