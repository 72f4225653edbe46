"""kvroute's ingest end to end over ZeroMQ, and the longest its event loop stalls meanwhile
(issue: no event-loop stall over 50 ms; routes answered while it ingests).

One publisher process (benchmarks.peer_publisher) serves ``--workers`` vLLM-style streams
with replay ROUTERs; one ``kvroute serve`` subscribes to all of them. Scenarios, in one run:

- ``burst``: every worker's batches of the ``roots`` mix (benchmarks.peer_stream: 8 root
  chains of 8 blocks per batch, lagged removals) sent at once, as fast as ZeroMQ takes
  them: a burst from all workers together. Stored blocks per second until kvroute holds
  the mix's last (marker) block on every worker, beside the msgspec decode-only floor of
  the same payloads measured in this process (the ratio);
- ``huge``: one batch of worker 0 carrying one BlockStored of ``--huge-blocks`` blocks
  (kvroute's caps, 65,536 blocks and 16 MiB per message by default, are raised for it);
- ``replay``: worker 0's next ``--replay-batches`` batches go to its replay buffer only,
  then one live batch: kvroute sees the gap and fills it from the replay ROUTER;
- ``burst, routing``: the burst again (other content), while the prober's routes are real
  ones, each leaving a placement guess on the worker it chose, as a gateway's do
  (``route_probe --placing``); its route p99 is that of those routes.

For each: kvroute's worst event-loop lag (its ``kvroute_event_loop_lag_*`` metrics), and
from outside, a prober in a process of its own (benchmarks.route_probe) sending routes (a
1k-token probe) and ``/healthz`` back to back: route p99 while it ingests (routes sent
after the first batch and answered before the final state was seen) beside route p99 idle
(measured first, same run), and the longest ``/healthz`` round trip. ``--quick``
(what ``make bench`` runs) is smaller. JSON and a table (benchmarks.report);
bench-out/ingest/ingest.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peer_bench import (
    ask,
    decode_floor,
    ingest,
    percentile,
    start_publisher,
    stop_publisher,
)
from benchmarks.peer_sides import Kvroute
from benchmarks.peer_stream import BLOCK, CHAIN_BLOCKS, Mix, marker_store, marker_tokens, roots
from benchmarks.report import emit
from kvroute.app.ingest.wire import BlockStored, encode_batch

STALL_TARGET_MS = 50.0
PLACING = "burst, routing"  # the scenario whose prober's routes leave placement guesses
_HUGE_HASHES = 1 << 52
_HUGE_TOKENS = 3_000_000_000
_REPLAY_HASHES = 1 << 53
_REPLAY_TOKENS = 2_000_000_000
_REPLAY_CHAIN = 4  # blocks per replayed batch


def huge(workers: int, blocks: int, number: int) -> Mix:
    """Worker 0: one event of ``blocks`` blocks; every worker: the marker."""
    store = BlockStored(block_hashes=list(range(_HUGE_HASHES, _HUGE_HASHES + blocks)),
                        parent_block_hash=None, block_size=BLOCK,
                        token_ids=list(range(_HUGE_TOKENS, _HUGE_TOKENS + blocks * BLOCK)))
    payloads = [[encode_batch([store, marker_store(number)], ts=0.0, dp_rank=0)]]
    payloads += [[encode_batch([marker_store(number)], ts=0.0, dp_rank=0)]
                 for _ in range(workers - 1)]
    return Mix("huge", payloads, blocks, marker_tokens(number))


def replay(workers: int, batches: int, number: int) -> Mix:
    """Worker 0: ``batches`` batches of one short chain each, then the marker; the others:
    the marker. Sent with ``unpublished=batches``: all but the last are replayed."""
    mine = []
    for i in range(batches):
        first = _REPLAY_HASHES + i * _REPLAY_CHAIN
        tokens = _REPLAY_TOKENS + i * _REPLAY_CHAIN * BLOCK
        mine.append(encode_batch([BlockStored(
            block_hashes=list(range(first, first + _REPLAY_CHAIN)), parent_block_hash=None,
            block_size=BLOCK, token_ids=list(range(tokens, tokens + _REPLAY_CHAIN * BLOCK)))],
            ts=float(i), dp_rank=0))
    mine.append(encode_batch([marker_store(number)], ts=float(batches), dp_rank=0))
    payloads = [mine] + [[encode_batch([marker_store(number)], ts=0.0, dp_rank=0)]
                         for _ in range(workers - 1)]
    return Mix("replay", payloads, batches * _REPLAY_CHAIN, marker_tokens(number))


class Prober:
    """Routes (a 1k-token probe) and ``/healthz``, back to back, from a process of its own
    (benchmarks.route_probe) until ``stop``: their round trips in ms, as seen by a client
    of kvroute."""

    def __init__(self, port: int, *, placing: bool = False) -> None:
        self.port = port
        self.placing = placing
        self.routes: list[float] = []
        self.began: list[float] = []  # time.monotonic() when each route was sent
        self.health: list[float] = []
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.route_probe",
                                       str(self.port), *(["--placing"] if self.placing else [])],
                                      stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        json.loads(self._proc.stdout.readline())  # its client is made: probing from now

    def stop(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        found = json.loads(proc.stdout.readline())
        proc.wait(60)
        self.routes, self.began, self.health = found["routes"], found["began"], found["health"]

    def routes_within(self, start: float, end: float) -> list[float]:
        """Round trips of the routes sent at ``start`` or later that ended by ``end``."""
        return [ms for began, ms in zip(self.began, self.routes, strict=True)
                if began >= start and began + ms / 1000 <= end]


def scenario(kv: Kvroute, publisher: Any, mix: Mix, workdir: Path, timeout: float,
             unpublished: int = 0) -> dict[str, Any]:
    prober = Prober(kv.port, placing=mix.name == PLACING)
    prober.start()
    try:
        row = ingest([kv], publisher, mix, workdir / f"{mix.name}.mix", kv, timeout,
                     unpublished)
    finally:
        prober.stop()
    mine = row.pop("kvroute")
    row.update(mine)
    # While it ingests: from the first batch sent until the final state was seen. The
    # scenario's other routes wait behind the benchmark's own checks of the answers too.
    during = ([] if row["seconds"] is None else
              prober.routes_within(row["send_started"], row["send_started"] + row["seconds"]))
    row["route_p99_ms"] = percentile(during, 0.99)
    row["routes"] = len(during)
    row["route_p99_whole_scenario_ms"] = percentile(prober.routes, 0.99)
    row["worst_healthz_ms"] = max(prober.health, default=None)
    return row


def idle_routes(kv: Kvroute, seconds: float) -> dict[str, Any]:
    prober = Prober(kv.port)
    prober.start()
    time.sleep(seconds)
    prober.stop()
    return {"route_p99_ms": percentile(prober.routes, 0.99), "routes": len(prober.routes),
            "worst_healthz_ms": max(prober.health, default=None)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    workers = args.workers
    burst = roots(workers, args.blocks, args.lag, number=10)
    burst.name = "burst"
    floor = decode_floor(burst)
    routed = roots(workers, args.blocks, args.lag, number=13,
                   first_chain=burst.stored // CHAIN_BLOCKS)
    routed.name = PLACING
    mixes = [(burst, 0), (huge(workers, args.huge_blocks, 11), 0),
             (replay(workers, args.replay_batches, 12), args.replay_batches), (routed, 0)]
    result: dict[str, Any] = {"benchmark": "ingest", "workers": workers,
                              "stall_target_ms": STALL_TARGET_MS,
                              "decode_floor_blocks_per_s": floor}
    # The huge event is over kvroute's default caps (blocks per event, bytes per message).
    settings = (f"max_blocks_per_event = {max(65_536, args.huge_blocks)}",
                f"max_event_message_bytes = {64 * 1024 * 1024}")
    with tempfile.TemporaryDirectory() as tmp:
        publisher, endpoints = start_publisher(workers)
        kv = Kvroute(workers, settings)
        try:
            kv.start(endpoints, Path(tmp))
            subscribed = ask(publisher, {"wait": 1, "timeout": 60})["subscribed"]
            if min(subscribed) < 1:
                raise RuntimeError(f"subscriptions per stream: {subscribed}")
            result["idle"] = idle_routes(kv, args.idle_seconds)
            result["scenarios"] = [scenario(kv, publisher, mix, Path(tmp), args.timeout, held)
                                   for mix, held in mixes]
        finally:
            kv.stop()
            stop_publisher(publisher)
    burst_row = result["scenarios"][0]
    if burst_row["blocks_per_s"]:
        result["burst_vs_floor"] = burst_row["blocks_per_s"] / floor
    idle_p99 = result["idle"]["route_p99_ms"]
    if idle_p99:
        for row in result["scenarios"]:
            if row["route_p99_ms"] is not None:
                row["route_p99_vs_idle"] = row["route_p99_ms"] / idle_p99
    result["worst_stall_ms"] = max(r["worst_loop_lag_ms"] for r in result["scenarios"])
    return result


def table(result: dict[str, Any]) -> str:
    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    idle = result["idle"]
    lines = [f"kvroute ingest over ZeroMQ, {result['workers']} workers; stall target "
             f"{result['stall_target_ms']:.0f} ms; idle route p99 "
             f"{cell(idle['route_p99_ms'], '.2f')} ms ({idle['routes']} routes)", "",
             "| scenario | blocks | blocks/s | worst loop lag | worst /healthz | "
             "route p99 while ingesting (x idle) | state |", "|---|---|---|---|---|---|---|"]
    for row in result["scenarios"]:
        state = "ok" if row["final_state"] and not row["wrong_answers"] else (
            row["error"] or f"{len(row['wrong_answers'])} wrong")
        lines.append(
            f"| {row['mix']} ({row['batches']:,} batches) | {row['stored_blocks']:,} | "
            f"{cell(row['blocks_per_s'], ',.0f')} | {row['worst_loop_lag_ms']:.1f} ms | "
            f"{cell(row['worst_healthz_ms'], '.1f')} ms | "
            f"{cell(row['route_p99_ms'], '.2f')} ms ({cell(row.get('route_p99_vs_idle'), '.1f')}x)"
            f" | {state} |")
    lines.append(f"\ndecode-only floor (msgspec, same run): "
                 f"{result['decode_floor_blocks_per_s']:,.0f} blocks/s; burst at "
                 f"{cell(result.get('burst_vs_floor'), '.2f')} of it")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (make bench)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="burst: blocks stored")
    parser.add_argument("--lag", type=int, default=16, help="burst: batches each worker keeps")
    parser.add_argument("--huge-blocks", type=int, default=300_000)
    parser.add_argument("--replay-batches", type=int, default=10_000)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="per scenario, seconds")
    parser.add_argument("--out", type=Path, default=Path("bench-out/ingest"))
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.idle_seconds = 200_000, 2.0
    result = run(args)
    emit(result, table(result), out_file=args.out / "ingest.json")


if __name__ == "__main__":
    main()
