"""The report of the saved-state benchmark (``benchmarks.saved_state``): each figure's
median (or worst) over the runs, and the table printed beside the JSON.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def summarize(runs: list[dict[str, Any]], worst: Sequence[str] = ()) -> dict[str, Any]:
    """Each figure's median over the runs (the largest for those in ``worst``; the value
    itself where every run agrees), and the runs themselves."""
    out: dict[str, Any] = {}
    for name in runs[0]:
        values = [r[name] for r in runs]
        if name in worst:
            out[name] = max(values)
        elif len(set(values)) == 1:
            out[name] = values[0]
        else:
            out[name] = round(statistics.median(values), 4)
    out["runs"] = runs
    return out


def table(result: dict[str, Any]) -> str:
    index, save, steps = result["index"], result["save"], result["save_steps"]
    load, resume, cold = result["load"], result["resume"], result["cold_rebuild"]
    holdings = index["holdings"]
    runs = result["repeats"]

    def verdict(holds: bool, holds_cpu: bool) -> str:
        if holds:
            return "holds"
        if holds_cpu:
            return "does NOT hold on the wall clock; holds in CPU time (a busy machine)"
        return "does NOT hold"

    def pair(row: dict[str, Any], name: str) -> str:
        """wall ms / CPU ms of one figure."""
        return f"{row[name + '_ms']:9.2f} {row[name + '_cpu_ms']:9.2f}"

    lines = [
        f"index: {result['workers']} workers, {holdings:,} holdings, {index['nodes']:,} nodes "
        f"({index['batches']:,} batches, applied live in {index['live_ingest_s']:.1f} s)",
        "",
        f"save: StateKeeper.save on the subscribers' loop, to a DirectoryStore ({runs} runs)",
        f"  seconds                      median {save['seconds']:.3f}, max "
        f"{save['seconds_max']:.3f}",
        f"  bytes on disk                {save['bytes_on_disk']:,} "
        f"({save['bytes_per_holding']:.1f} B per holding)",
        f"  loop stall, worst            {save['loop_stall_ms']:.1f} ms wall, "
        f"{save['loop_stall_cpu_ms']:.1f} ms loop-thread CPU   floor (idle loop): "
        f"{save['floor_idle_loop_stall_ms']:.1f} ms wall, "
        f"{save['floor_idle_loop_stall_cpu_ms']:.1f} ms CPU",
        f"  target: no stall over {save['target_stall_ms']:.0f} ms: "
        f"{verdict(save['target_holds'], save['target_holds_cpu'])}",
        "",
        f"save steps one by one (median of {runs}; the max per worker / piece / step: worst "
        f"of {runs})",
        f"  {'':<28} {'wall ms':>9} {'CPU ms':>9}",
        f"  {'capture, all workers':<28} {pair(steps, 'capture')}   max per worker "
        f"{steps['capture_ms_max_per_worker']:.2f} ms",
        f"  {'  floor: plain dict copy':<28} {pair(steps, 'floor_dict_copy')}   "
        "(one worker's size)",
        f"  {'pieces: make':<28} {pair(steps, 'piece_make')}   {steps['pieces']} pieces, "
        f"max make + encode per piece {steps['piece_make_encode_ms_max_per_piece']:.2f} ms",
        f"  {'pieces: encode':<28} {pair(steps, 'piece_encode')}",
        f"  {'longest step between yields':<28} {steps['capture_and_first_piece_ms_max']:9.2f}"
        "             capture + the first piece, one worker",
        f"  {'writer finish (checksum)':<28} {pair(steps, 'finish')}",
        f"  {'write (thread, fsync)':<28} {pair(steps, 'write')}",
        f"  {'total':<28} {pair(steps, 'total')}",
        "",
        f"load to index (median of {runs}; floors on the same bytes)",
        f"  {'':<28} {'wall ms':>9} {'CPU ms':>9}",
        f"  {'file read (page cache)':<28} {pair(load, 'read')}   (the I/O floor)",
        f"  {'decode_state':<28} {pair(load, 'decode_state')}",
        f"  {'  floor: untyped decode':<28} {pair(load, 'floor_untyped_decode')}",
        f"  {'  floor: xxh3 of the blob':<28} {pair(load, 'floor_checksum')}",
        f"  {'restore, all workers':<28} {pair(load, 'restore')}   a piece at a time: "
        f"worst piece {load['restore_ms_max_per_piece']:.1f} ms, worst worker "
        f"{load['restore_ms_max_per_worker']:.0f} ms",
        f"  {'  floor: dict build':<28} {pair(load, 'floor_dict_build')}   "
        f"({holdings:,} entries)",
        f"  {'load to index':<28} {pair(load, 'load_to_index')}",
        "",
        "load + resume to live: a second kvroute, StateKeeper.load then "
        f"Subscriber(saved=...) per worker (median of {runs})",
        f"  {'':<28} {'wall ms':>9} {'CPU ms':>9}",
        f"  {'load (read + decode)':<28} {pair(resume, 'load')}",
        f"  {'subscribers to all live':<28} {pair(resume, 'subscribers_to_live')}",
        f"  {'  of which restore':<28} {pair(resume, 'restore_in_subscribers')}   worst "
        f"call {resume['restore_in_subscribers_ms_max_per_call']:.1f} ms",
        f"  {'load + resume to live':<28} {pair(resume, 'load_and_resume')}   "
        f"worst {resume['load_and_resume_ms_max']:.0f} ms; per 1M holdings "
        f"{resume['per_1m_holdings_s']:.2f} s",
        f"  target: under {resume['target_s']:.0f} s for 1M holdings: "
        f"{verdict(resume['target_holds'], resume['target_holds_cpu'])}"
        + ("" if holdings >= 1_000_000 else f" (here {holdings:,}: see per 1M)"),
        f"  loop stall meanwhile, worst  {resume['loop_stall_ms']:.1f} ms wall, "
        f"{resume['loop_stall_cpu_ms']:.1f} ms CPU",
        "",
        f"instead, without saved state: a cold rebuild from the replay buffers (all "
        f"{index['batches']:,} batches) took {cold['seconds']:.2f} s; "
        f"{cold['live']}/{cold['workers']} workers live, {cold['holdings']:,} holdings, "
        f"{cold['replay_failures']} replay failures"
        + "".join(f"\n  {error}" for error in cold["errors"]),
    ]
    return "\n".join(lines)
