"""Saved state (issue 19): save and load time and size at 1M holdings, the event loop during
a save, and load + resume to ``live``.

Setup: 4 simulated vLLM ranks (--workers) (``sim.publisher.EventPublisher``, wire-exact) publish the
batches that make each hold ~250k blocks (--quick: 25k): 16-token blocks, random uint64
block hashes as vLLM's are, requests of 1 to 64 blocks hanging off 32 system prompts that
every rank caches (same content, each rank its own hashes), and a fifth of the requests'
content also cached by another rank. kvroute's subscribers (``app.ingest.subscriber.Subscriber``,
default options) follow them live into one ``PrefixIndex``.

Measured, each figure on the wall clock and in process CPU time (the CPU time leaves out
what other processes of a shared machine took), beside a floor of the same run:

- save as the service does it: ``StateKeeper.save`` on the subscribers' loop, to a
  ``DirectoryStore`` in a temporary directory, while a probe task on that loop sleeps 1 ms
  at a time and records how late it wakes (and the loop thread's CPU time in between): the
  longest is the longest the save held the loop (target: < 50 ms). Floor: the same probe
  with the loop idle.
- the save's steps, timed one by one (the keeper's calls in its order, without its awaits):
  capture per worker (the one step that cannot yield), making and encoding each piece
  (``PIECE_BLOCKS``), the writer's finish (checksum), the write (fsync). Floor: copying a
  plain dict the size of one worker's handle table.
- load to index: reading the file (page cache warm), ``decode_state``, then
  ``PrefixIndex.restore`` of every worker, a piece at a time as the subscriber does, into a
  fresh index, checked equal to the saved one. Floors: msgspec's untyped msgpack decode of
  the same frames, xxh3 over the blob, building a plain dict of all hash -> key entries.
- load + resume to live: the ranks move on (stores and evictions), the first kvroute stops,
  and a second one starts as the service does: ``StateKeeper.load``, then per worker a
  ``Subscriber(saved=keeper.claim(endpoint))``, timed until every worker is live at its
  rank's last seq (target: < 2 s for 1M holdings). Checked: each holds exactly what the
  first kvroute held, every block restored exactly (none unconfirmed). Beside it: the
  time the subscribers spent in ``restore`` and the longest the loop was held meanwhile.
- for comparison, a kvroute without saved state rebuilding from the replay buffers (which
  here still hold every batch since the start; vLLM's keep the last 10,000 steps).

Usage: python -m benchmarks.saved_state [--quick] [--holdings N] [--workers N] [--repeats N]
       [--out DIR] [--json-only] [--profile]
(--quick: 100k holdings, 2 repeats; --workers 1 puts every holding on one worker: the
longest capture; --profile: cProfile of one save's steps, one load to index and one
resume, top functions on stderr). Progress on stderr; one JSON object, then a table, on
stdout; with --out, the JSON also in DIR/saved_state.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq.asyncio

from benchmarks.report import emit
from benchmarks.saved_kvroute import Kvroute
from benchmarks.saved_measure import (
    LoopProbe,
    Stopwatch,
    dict_copy_floor,
    load_steps,
    resume_once,
    save_steps,
    snapshot,
    wall_cpu,
)
from benchmarks.saved_report import summarize, table
from benchmarks.saved_traffic import AFTER_BATCHES, build_traffic
from kvroute.app.state.format import PIECE_BLOCKS
from kvroute.app.state.keeper import StateKeeper
from kvroute.app.state.store import DirectoryStore
from kvroute.app.workers import WorkerEndpoint, WorkerState
from kvroute.sim.publisher import EventPublisher

TARGET_RESUME_S = 2.0
TARGET_STALL_MS = 50.0
PROBE_FLOOR_S = 2.0


def progress(message: str) -> None:
    print(f"[saved_state] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the run


async def run(holdings_wanted: int, workers_wanted: int, repeats: int,
              want_profile: bool) -> dict[str, Any]:
    per_worker = holdings_wanted // workers_wanted
    progress(f"building traffic: {workers_wanted} ranks x ~{per_worker:,} blocks")
    watch = Stopwatch()
    ranks = build_traffic(workers_wanted, per_worker)
    batches = sum(len(r.before) for r in ranks)
    progress(f"  {batches:,} batches, {sum(len(p) for r in ranks for p in r.before) / 2**20:.0f}"
             f" MiB of payloads, in {watch.lap()[0]:.1f} s")
    result: dict[str, Any] = {"workers": workers_wanted, "piece_blocks": PIECE_BLOCKS}
    ctx = zmq.asyncio.Context()
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        pubs = [stack.enter_context(EventPublisher(
            buffer_steps=len(r.before) + len(r.after) + 16)) for r in ranks]
        endpoints = [WorkerEndpoint(r.instance, 0, p.endpoint, p.replay_endpoint)
                     for r, p in zip(ranks, pubs, strict=True)]
        workers = [e.worker for e in endpoints]
        probe = LoopProbe()
        progress("first kvroute: subscribers follow the ranks as they publish")
        first = Kvroute(ctx, endpoints)
        first.start()
        await first.serving("first kvroute, connecting")
        watch.restart()
        for rank, pub in zip(ranks, pubs, strict=True):
            for payload in rank.before:
                pub.publish_raw(payload)
        saved_seqs = {e.worker: len(r.before) - 1 for e, r in zip(endpoints, ranks, strict=True)}
        await first.caught_up(saved_seqs, "first kvroute")
        ingest_s = watch.lap()[0]
        index = first.index
        stats = index.stats()
        holdings = sum(index.blocks_held(w) for w in workers)
        if stats.orphaned_blocks or holdings != sum(r.blocks for r in ranks):
            raise RuntimeError(f"the first kvroute holds {holdings:,} blocks, expected "
                               f"{sum(r.blocks for r in ranks):,} ({stats})")
        result["index"] = {"holdings": holdings, "nodes": stats.nodes, "batches": batches,
                           "live_ingest_s": round(ingest_s, 3)}
        progress(f"  {holdings:,} holdings ({stats.nodes:,} nodes), applied in {ingest_s:.1f} s")

        progress(f"loop probe floor: {PROBE_FLOOR_S:g} s with the loop idle")
        async with probe.measuring("idle"):
            await asyncio.sleep(PROBE_FLOOR_S)

        state_dir = Path(tmp) / "state"
        state_file = state_dir / "kvroute-state.bin"
        keeper = StateKeeper(DirectoryStore(state_dir), first.registry,  # type: ignore[arg-type]
                             index, interval=3600.0)
        saves = []
        for r in range(repeats):
            gc.collect()
            progress(f"StateKeeper.save {r + 1}/{repeats} with the loop probe running")
            async with probe.measuring(f"save {r}"):
                report = await keeper.save()
            if report is None:
                raise RuntimeError(f"save failed: {keeper.save_error}")
            late, cpu = probe.worst(f"save {r}")
            saves.append({"seconds": round(report.seconds, 4), "bytes": report.bytes,
                          "blocks": report.blocks, "loop_stall_ms": late,
                          "loop_stall_cpu_ms": cpu})
        idle_late, idle_cpu = probe.worst("idle")
        size = state_file.stat().st_size
        save = result["save"] = summarize(saves, worst=("loop_stall_ms", "loop_stall_cpu_ms"))
        save.update({
            "seconds_max": max(s["seconds"] for s in saves),
            "bytes_on_disk": size,
            "bytes_per_holding": round(size / holdings, 2),
            "floor_idle_loop_stall_ms": idle_late,
            "floor_idle_loop_stall_cpu_ms": idle_cpu,
            "target_stall_ms": TARGET_STALL_MS,
            "target_holds": save["loop_stall_ms"] < TARGET_STALL_MS,
            "target_holds_cpu": save["loop_stall_cpu_ms"] < TARGET_STALL_MS,
        })

        steps = []
        for r in range(repeats):
            gc.collect()
            progress(f"save steps timed one by one {r + 1}/{repeats}")
            steps.append(await save_steps(index, first.registry.units, Path(tmp) / "steps"))
        if want_profile:
            profiler = cProfile.Profile(time.thread_time)
            profiler.enable()
            await save_steps(index, first.registry.units, Path(tmp) / "steps")
            profiler.disable()
            print_profile(profiler, "the save's steps")
        result["save_steps"] = summarize(steps, worst=("capture_ms_max_per_worker",
                                                       "piece_make_encode_ms_max_per_piece",
                                                       "capture_and_first_piece_ms_max"))
        floors = [dict_copy_floor(max(holdings // workers_wanted, 1)) for _ in range(repeats)]
        result["save_steps"].update(wall_cpu("floor_dict_copy", [min(floors)]))

        saved_snapshot = snapshot(index, workers)
        loads = []
        for r in range(repeats):
            progress(f"load to index {r + 1}/{repeats}: read, decode_state, restore")
            loads.append(load_steps(state_file, saved_snapshot if r == 0 else None))
        if want_profile:
            profiler = cProfile.Profile(time.thread_time)
            profiler.enable()
            load_steps(state_file, None)
            profiler.disable()
            print_profile(profiler, "load to index (and its floors)")
        result["load"] = summarize(loads, worst=("restore_ms_max_per_worker",
                                                 "restore_ms_max_per_piece"))
        del saved_snapshot

        progress(f"the ranks move on: {AFTER_BATCHES} batches each (stores and evictions)")
        for rank, pub in zip(ranks, pubs, strict=True):
            for payload in rank.after:
                pub.publish_raw(payload)
        for pub in pubs:
            pub.flush(timeout=60)
        last_seqs = {e.worker: p.next_seq - 1 for e, p in zip(endpoints, pubs, strict=True)}
        await first.caught_up(last_seqs, "first kvroute, after the save")
        final = snapshot(index, workers)
        await first.stop()
        del first, index, keeper
        gc.collect()

        resumes = []
        for r in range(repeats):
            progress(f"second kvroute {r + 1}/{repeats}: load + resume to live")
            resumes.append(await resume_once(ctx, endpoints, state_dir, last_seqs, probe,
                                             f"resume {r}", final if r == 0 else None))
        if want_profile:
            profiler = cProfile.Profile(time.thread_time)
            await resume_once(ctx, endpoints, state_dir, last_seqs, probe, "profiled", None,
                              profiler)
            print_profile(profiler, "load + resume to live (the loop's thread)")
        resume = result["resume"] = summarize(resumes, worst=(
            "loop_stall_ms", "loop_stall_cpu_ms", "restore_in_subscribers_ms_max_per_call"))
        resume.update({
            "load_and_resume_ms_max": max(r["load_and_resume_ms"] for r in resumes),
            "target_s": TARGET_RESUME_S,
            "target_holds": resume["load_and_resume_ms"] < TARGET_RESUME_S * 1000,
            "target_holds_cpu": resume["load_and_resume_cpu_ms"] < TARGET_RESUME_S * 1000,
            "per_1m_holdings_s": round(resume["load_and_resume_ms"] / 1000
                                       * 1_000_000 / holdings, 3),
        })

        progress("for comparison, a kvroute without saved state: a cold rebuild from the "
                 "replay buffers (every batch since the start)")
        gc.collect()
        third = Kvroute(ctx, endpoints)
        started = time.perf_counter()
        third.start()
        cold_s = await third.serving("cold rebuild") - started
        statuses = [u.subscriber.status for u in third.registry.units]
        result["cold_rebuild"] = {
            "seconds": round(cold_s, 3),
            "live": sum(s.state == WorkerState.LIVE and s.last_seq == last_seqs[u.key]
                        for s, u in zip(statuses, third.registry.units, strict=True)),
            "workers": len(statuses),
            "replay_failures": sum(s.replay_failures for s in statuses),
            "holdings": sum(third.index.blocks_held(w) for w in workers),
            "errors": sorted({s.last_error for s in statuses if s.last_error}),
        }
        await third.stop()
        del third
        await probe.stop()
    ctx.destroy(linger=0)
    return result


def print_profile(profiler: cProfile.Profile, label: str) -> None:
    """The top functions by own time; the profiles count the loop thread's CPU time, so
    that neither waiting nor other processes of a shared machine show in them."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    progress(f"profile of {label}, by own CPU time:\n{text.getvalue()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true", help="100k holdings, 2 repeats")
    parser.add_argument("--holdings", type=int, default=None,
                        help="holdings in all (default 1,000,000; --quick 100,000)")
    parser.add_argument("--workers", type=int, default=4,
                        help="ranks the holdings are spread over (default 4)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each measurement (default 3, --quick 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the JSON to DIR/saved_state.json")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one save's steps, one load to index and one resume "
                        "(extra runs, not counted; stderr)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    started = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "saved_state", "quick": args.quick,
                              "python": sys.version.split()[0], "repeats": repeats}
    holdings = args.holdings or (100_000 if args.quick else 1_000_000)
    result.update(asyncio.run(run(holdings, args.workers, repeats, args.profile)))
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit(result, table(result), json_only=args.json_only,
         out_file=None if args.out is None else args.out / "saved_state.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
