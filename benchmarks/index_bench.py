"""Prefix-index benchmark: ingestion throughput, query latency and memory per holding.

Every figure stands beside a floor measured in the same run, so that results compare across
noisy machines:

- ingestion: batches in vLLM 0.32.0's map encoding (``[ts, events, dp_rank]``, events as maps
  with every field vLLM writes), 16-token blocks, chains of 1 to 64 blocks hanging off cached
  shared system prompts, and in steady state one BlockRemoved (one hash each, as vLLM sends
  them) per stored block. Measured: decode + apply through ``app.ingest.wire.decode_batch`` +
  ``app.ingest.wire.apply_batch`` (the service's path; a typed msgspec decoder of this file when
  app.ingest.wire is absent), apply alone, and the floor: a typed msgspec decode of the same bytes
  with nothing applied. Blocks counted = blocks stored + blocks removed.
- queries: 1k, 8k and 32k-token prompts against an index with about 1M holdings spread over
  4, 32 and 128 workers; the prompt is fully cached by one worker and partly by the others,
  so the walk never stops early. Floors: a bare chain of dict lookups (one per block) in a
  1M-entry dict, and the chained hashing of the prompt alone.
- memory: resident memory taken by building an index of 1M holdings (32 workers) in a fresh
  process, once with no content shared between workers (worst case: one node per holding)
  and once with every block held by four workers; beside it tracemalloc's traced bytes
  (Python's allocations only: the compiled index's tables are not among them) and the
  index's own estimate (``stats()``).
- growth: the worst single insertion into the compiled node table (``NodeMap``) while it
  grows from empty to 1M (and 4M) entries, the caller's longest wait, and its mean; the
  floor is a dict given the same keys in the same run (it rebuilds its whole table at each
  growth). A route or a subscriber's turn waits as long as one insertion does.

Ingestion runs once per implementation of the index's loops (compiled when built, then the
pure reference) on the same batches; queries time both on the same index.

Usage: python -m benchmarks.index_bench [--quick] [--json-only]
(--quick: fewer blocks and repeats, queries at 32 workers only, memory without sharing only)
Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import os
import random
import statistics
import struct
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from xxhash import xxh3_128_digest

from benchmarks.peer_sides import rss_bytes
from benchmarks.report import emit
from kvroute.index import PrefixIndex, prefix_index

BLOCK = 16
TARGET_INGEST_BLOCKS_PER_S = 1_000_000
TARGET_INGEST_RATIO = 0.40
TARGET_QUERY_P99_US = 300.0
TARGET_BYTES_PER_HOLDING = 100  # issue 20: at most 100 B per holding


# --------------------------------------------------------------------------- random data


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """Token ids below 2**16, fast (no per-token Python call)."""
    return array("H", rng.randbytes(2 * count)).tolist()


def random_hashes(rng: random.Random, count: int) -> list[int]:
    """Unsigned 64-bit engine hashes (about half of them >= 2**63, as vLLM's are)."""
    return array("Q", rng.randbytes(8 * count)).tolist()


# --------------------------------------------------------------------------- ingestion mix


def stored_event(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    """A BlockStored map exactly as vLLM 0.32.0 writes it (see shared/fixtures)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed_event(block_hash: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU",
            "group_idx": 0}


@dataclass
class IngestWorkload:
    """Encoded batches per phase: warm-up (filling the caches) then steady state."""

    warmup: list[tuple[int, bytes]] = field(default_factory=list)  # (worker number, payload)
    steady: list[tuple[int, bytes]] = field(default_factory=list)
    steady_blocks: int = 0  # stored + removed blocks in the steady batches


def build_ingest_workload(workers: int, capacity: int, steady_blocks: int,
                          seed: int = 1) -> IngestWorkload:
    """Engines that each cache ``capacity`` tail blocks (FIFO eviction) besides 32 shared
    system prompts of 2..32 blocks; every request stores a 1..64-block tail (and its system
    prompt the first time a worker sees it). One batch = one engine step = 1..4 requests.
    """
    rng = random.Random(seed)
    system_prompts = [random_tokens(rng, BLOCK * rng.randint(2, 32)) for _ in range(32)]
    prompt_hashes = [[random_hashes(rng, len(p) // BLOCK) for p in system_prompts]
                     for _ in range(workers)]
    cached_prompts: list[set[int]] = [set() for _ in range(workers)]
    fifo: list[list[int]] = [[] for _ in range(workers)]
    fifo_head = [0] * workers
    workload = IngestWorkload()
    encoder = msgspec.msgpack.Encoder()
    ts = 1_700_000_000.0
    while workload.steady_blocks < steady_blocks:
        worker = rng.randrange(workers)
        events: list[dict[str, Any]] = []
        blocks_in_batch = 0
        steady = len(fifo[worker]) - fifo_head[worker] >= capacity
        for _ in range(rng.randint(1, 4)):
            which = min(int(rng.paretovariate(1.2)) - 1, 31)
            tail_blocks = rng.randint(1, 64)
            tail_tokens = random_tokens(rng, BLOCK * tail_blocks)
            tail_hashes = random_hashes(rng, tail_blocks)
            queue, head = fifo[worker], fifo_head[worker]
            evict = max(0, len(queue) - head + tail_blocks - capacity)
            for block_hash in queue[head : head + evict]:
                events.append(removed_event(block_hash))
            fifo_head[worker] = head + evict
            blocks_in_batch += evict
            hashes = prompt_hashes[worker][which]
            if which in cached_prompts[worker]:
                events.append(stored_event(tail_hashes, hashes[-1], tail_tokens))
            else:
                cached_prompts[worker].add(which)
                events.append(stored_event(hashes + tail_hashes, None,
                                           system_prompts[which] + tail_tokens))
                blocks_in_batch += len(hashes)
            queue.extend(tail_hashes)
            blocks_in_batch += tail_blocks
        if fifo_head[worker] > 4 * capacity:  # keep the FIFO lists short
            fifo[worker] = fifo[worker][fifo_head[worker]:]
            fifo_head[worker] = 0
        ts += 0.01
        payload = encoder.encode([ts, events, 0])
        if steady:
            workload.steady.append((worker, payload))
            workload.steady_blocks += blocks_in_batch
        else:
            workload.warmup.append((worker, payload))
    return workload


# A decoder of this file: the floor (decode only), and decode + apply when app.ingest.wire is
# absent.
class BenchStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None


class BenchRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int = 0


class BenchCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class BenchBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BenchStored | BenchRemoved | BenchCleared]
    data_parallel_rank: int | None = None


_bench_decoder = msgspec.msgpack.Decoder(BenchBatch)


def bench_apply(index: PrefixIndex, worker: Any, batch: BenchBatch) -> None:
    for event in batch.events:
        if type(event) is BenchStored:
            index.apply_stored(worker, event.block_hashes, event.parent_block_hash,
                               event.token_ids, event.block_size, lora_name=event.lora_name,
                               extra_keys=event.extra_keys, medium=event.medium,
                               group_idx=event.group_idx,
                               kv_cache_spec_kind=event.kv_cache_spec_kind)
        elif type(event) is BenchRemoved:
            index.apply_removed(worker, event.block_hashes, medium=event.medium,
                                group_idx=event.group_idx)
        else:
            index.clear_worker(worker)


def service_codec() -> tuple[str, Callable[[bytes], Any], Callable[[PrefixIndex, Any, Any], Any]]:
    """The service's decode + apply (app.ingest.wire) if present, else this file's."""
    try:
        from kvroute.app.ingest.wire import apply_batch, decode_batch
    except ImportError:
        return "bench msgspec decoder", _bench_decoder.decode, bench_apply
    return "kvroute.app.ingest.wire", decode_batch, apply_batch


def best_of(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


def implementations() -> list[str]:
    """The index's loops to measure: the compiled ones when built, and the pure ones."""
    return (["compiled"] if prefix_index.COMPILED_AVAILABLE else []) + ["pure"]


def bench_ingestion(quick: bool) -> list[dict[str, Any]]:
    """Ingestion with each implementation of the index's loops, on the same batches."""
    return [bench_ingestion_with(quick, name) for name in implementations()]


def bench_ingestion_with(quick: bool, implementation: str) -> dict[str, Any]:
    workers = 8
    capacity = 2_000 if quick else 8_000
    workload = build_ingest_workload(workers, capacity, 150_000 if quick else 600_000)
    codec_name, decode, apply = service_codec()
    names = [(f"instance-{n}", 0) for n in range(workers)]
    steady = [(names[w], payload) for w, payload in workload.steady]
    repeats = 2 if quick else 3

    def warm_index() -> PrefixIndex:
        index = PrefixIndex(compiled=implementation == "compiled")
        for w, payload in workload.warmup:
            apply(index, names[w], decode(payload))
        return index

    # CPU time of this process: on a shared machine, wall time also counts other processes.
    clock = time.process_time

    def decode_only() -> float:
        start = clock()
        for _, payload in steady:
            _bench_decoder.decode(payload)
        return clock() - start

    def decode_and_apply(apply: Callable[[PrefixIndex, Any, Any], Any]) -> float:
        index = warm_index()
        start = clock()
        for worker, payload in steady:
            apply(index, worker, decode(payload))
        elapsed = clock() - start
        stats = index.stats()
        assert stats.unknown_removals == 0 and stats.orphaned_blocks == 0, stats
        return elapsed

    def apply_only() -> float:
        index = warm_index()
        decoded = [(worker, decode(payload)) for worker, payload in steady]
        start = clock()
        for worker, batch in decoded:
            apply(index, worker, batch)
        return clock() - start

    floor = best_of(repeats, decode_only)
    full = best_of(repeats, lambda: decode_and_apply(apply))
    applied = best_of(repeats, apply_only)
    blocks = workload.steady_blocks
    return {
        "implementation": implementation,
        "codec": codec_name,
        "clock": f"process CPU time, best of {repeats}",
        "workers": workers,
        "capacity_blocks_per_worker": capacity,
        "steady_batches": len(steady),
        "steady_blocks": blocks,
        "payload_bytes": sum(len(p) for _, p in steady),
        "decode_only_blocks_per_s": blocks / floor,
        "decode_apply_blocks_per_s": blocks / full,
        "apply_only_blocks_per_s": blocks / applied,
        "decode_apply_vs_decode_only": floor / full,
    }


# --------------------------------------------------------------------------- query setup


def fill_index(index: PrefixIndex, workers: int, holdings: int, shared_by: int,
               rng: random.Random, doc: list[int]) -> None:
    """About ``holdings`` holdings: worker w holds a prefix of ``doc`` (the last worker all
    of it), the rest in 64-block chains, each chain held by ``shared_by`` workers."""
    doc_blocks = len(doc) // BLOCK
    total = 0
    for w in range(workers):
        held = max(1, doc_blocks * (w + 1) // workers)
        index.apply_stored((f"i{w}", 0), random_hashes(rng, held), None,
                           doc[: held * BLOCK], BLOCK)
        total += held
    chain_blocks = 64
    chains = max(0, holdings - total) // (chain_blocks * shared_by)
    for c in range(chains):
        tokens = random_tokens(rng, chain_blocks * BLOCK)
        first = (c * shared_by) % workers
        for k in range(shared_by):
            worker = (f"i{(first + k) % workers}", 0)
            index.apply_stored(worker, random_hashes(rng, chain_blocks), None, tokens, BLOCK)


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Samples = tuple[list[float], list[float]]  # (wall-clock, CPU time) in microseconds


def timed_us(runs: Sequence[Callable[[], Any]], repeats: int) -> list[Samples]:
    """Wall-clock and CPU-time samples (microseconds) of each of ``runs``, interleaved so
    that every run and its floors see the same machine; the CPU time leaves out the time
    other processes of a shared machine held the core."""
    samples: list[Samples] = [([], []) for _ in runs]
    for _ in range(repeats):
        for run, (wall, cpu) in zip(runs, samples, strict=True):
            cpu_start = time.process_time_ns()
            start = time.perf_counter_ns()
            run()
            wall.append((time.perf_counter_ns() - start) / 1e3)
            cpu.append((time.process_time_ns() - cpu_start) / 1e3)
    return samples


def bench_queries(quick: bool) -> list[dict[str, Any]]:
    holdings = 1_000_000
    prompt_sizes = (1024, 8192, 32768)
    repeats = 100 if quick else 400
    rng = random.Random(7)
    doc = random_tokens(rng, max(prompt_sizes))
    other = random_tokens(rng, 64 * BLOCK)  # a prompt every worker is guessed to hold
    rows = []
    # The floor's dict: 1M 16-byte keys, as many entries as the index's node table.
    floor_keys = [xxh3_128_digest(i.to_bytes(8, "little")) for i in range(holdings)]
    floor_table = dict.fromkeys(floor_keys, 1)
    split = struct.Struct(f"{BLOCK * 4}s").iter_unpack
    for workers in (32,) if quick else (4, 32, 128):
        index = PrefixIndex()
        fill_index(index, workers, holdings, shared_by=1, rng=rng, doc=doc)
        stats = index.stats()
        held = sum(h["GPU"] for h in stats.holdings.values())
        for size in prompt_sizes:
            prompt = doc[:size]
            blocks = size // BLOCK
            chain = floor_keys[:blocks]

            def lookups(chain: list[bytes] = chain) -> None:
                get = floor_table.get
                for key in chain:
                    if get(key) is None:
                        break

            def hashing(prompt: list[int] = prompt) -> None:
                """The keys alone: token conversion and chained xxh3, as the index does."""
                parent = b"\0" * 16
                for (block,) in split(array("I", prompt).tobytes()):
                    parent = xxh3_128_digest(parent + block)

            def query(index: PrefixIndex = index, prompt: list[int] = prompt) -> None:
                index.match(prompt)

            # Both implementations keep the same containers: the pure loops are timed on
            # this same index by switching its loops (a benchmark's liberty).
            pure = PrefixIndex(compiled=False)
            pure.__dict__.update({k: v for k, v in vars(index).items() if k != "_fast"})

            def pure_query(index: PrefixIndex = pure, prompt: list[int] = prompt) -> None:
                index.match(prompt)

            answer = index.match(prompt)
            assert max(m.blocks for m in answer.values()) == blocks
            assert len(answer) == workers
            assert pure.match(prompt) == answer
            gc.collect()
            (wall, cpu), (pure_wall, _), (floor_wall, _), (hash_wall, _) = timed_us(
                [query, pure_query, lookups, hashing], repeats)
            # Under a gateway's routes every worker routed to lately has placement guesses,
            # and a worker with any has its match extended through them (_add_guesses).
            for w in range(workers):
                index.place((f"i{w}", 0), other, block_size=BLOCK, expires=math.inf)
            assert index.match(prompt) == answer == pure.match(prompt)  # guesses of others
            gc.collect()
            (guessed_wall, _), (pure_guessed_wall, _) = timed_us([query, pure_query], repeats)
            index.placements.expire(math.inf)
            rows.append({
                "workers": workers,
                "holdings": held,
                "nodes": stats.nodes,
                "prompt_tokens": size,
                "blocks": blocks,
                "match_p50_us": statistics.median(wall),
                "match_p99_us": percentile(wall, 0.99),
                "match_cpu_p99_us": percentile(cpu, 0.99),
                "implementation": index.implementation,
                "pure_match_p50_us": statistics.median(pure_wall),
                "pure_match_p99_us": percentile(pure_wall, 0.99),
                "floor_dict_chain_p50_us": statistics.median(floor_wall),
                "floor_dict_chain_p99_us": percentile(floor_wall, 0.99),
                "hash_chain_p50_us": statistics.median(hash_wall),
                "guessed_match_p50_us": statistics.median(guessed_wall),
                "pure_guessed_match_p50_us": statistics.median(pure_guessed_wall),
            })
        del index
        gc.collect()
    return rows


# --------------------------------------------------------------------------- memory


def _memory_row(shared_by: int) -> dict[str, Any]:
    """Build an index of 1M holdings in this (fresh) process and measure what it took."""
    holdings = 1_000_000
    workers = 32
    rng = random.Random(11)
    doc = random_tokens(rng, 2048 * BLOCK)
    gc.collect()
    resident = rss_bytes(os.getpid())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    fill_index(index, workers, holdings, shared_by, rng, doc)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    resident = rss_bytes(os.getpid()) - resident
    stats = index.stats()
    held = sum(sum(h.values()) for h in stats.holdings.values())
    return {
        "workers": workers,
        "holders_per_block": shared_by,
        "holdings": held,
        "nodes": stats.nodes,
        "implementation": index.implementation,
        "resident_bytes": resident,
        "bytes_per_holding": resident / held,
        "traced_bytes_per_holding": traced / held,
        "estimated_bytes_per_holding": stats.estimated_bytes / held,
        # Floor: the engine hashes alone, the one thing any index must keep per holding.
        "floor_hash_int_bytes": sys.getsizeof(2**63),
    }


def _growth_row(entries: int) -> dict[str, Any]:
    from kvroute.index._fast import NodeMap

    rng = random.Random(entries)
    keys = [rng.randbytes(16) for _ in range(entries)]
    row: dict[str, Any] = {"entries": entries}
    for name, make in (("table", NodeMap), ("dict", dict)):
        table = make()  # made here, so that the table before is gone when this one grows
        worst = 0
        clock = time.perf_counter_ns
        started = clock()
        for key in keys:
            before = clock()
            table[key] = 1
            worst = max(worst, clock() - before)
        row[f"{name}_worst_insert_ms"] = worst / 1e6
        row[f"{name}_mean_insert_ns"] = (clock() - started) / entries
        del table
        gc.collect()
    return row


def bench_growth(quick: bool) -> list[dict[str, Any]]:
    if not prefix_index.COMPILED_AVAILABLE:
        return []
    return [_growth_row(entries) for entries in ((1_000_000,) if quick else (1_000_000, 4_000_000))]


def bench_memory(quick: bool) -> list[dict[str, Any]]:
    """Each row in a fresh interpreter, so that what earlier benchmarks freed does not
    hide what the index takes from the system."""
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for shared_by in (1,) if quick else (1, 4):
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
            rows.append(child.submit(_memory_row, shared_by).result())
    return rows


# --------------------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    lines = []
    for ingest in result["ingestion"]:
        lines += [
            f"ingestion, {ingest['implementation']} loops ({ingest['codec']}, "
            f"{ingest['steady_blocks']:,} blocks in {ingest['steady_batches']:,} batches, "
            f"{ingest['workers']} workers)",
            f"  decode + apply   {ingest['decode_apply_blocks_per_s'] / 1e6:7.2f} M blocks/s   "
            f"target >= {TARGET_INGEST_BLOCKS_PER_S / 1e6:.2f} M/s",
            f"  apply only       {ingest['apply_only_blocks_per_s'] / 1e6:7.2f} M blocks/s",
            f"  floor: decode    {ingest['decode_only_blocks_per_s'] / 1e6:7.2f} M blocks/s   "
            f"decode+apply / decode = {ingest['decode_apply_vs_decode_only']:.0%} "
            f"(target >= {TARGET_INGEST_RATIO:.0%})",
        ]
    lines += [
        "",
        "queries (match over all workers, default loops; pure = the pure loops on the same "
        "index; floor = a bare chain of dict lookups; hash = the keys alone: token "
        "conversion + chained xxh3; guessed = every worker also guessed to hold another "
        "prompt, as under a gateway's routes)",
        f"  {'workers':>7} {'holdings':>9} {'tokens':>6} {'blocks':>6} "
        f"{'p50 us':>8} {'p99 us':>8} {'cpu p99':>8} {'pure p50':>8} {'pure p99':>8} "
        f"{'floor p50':>9} {'floor p99':>9} {'hash p50':>8} {'guessed p50':>11} "
        f"{'pure guessed p50':>16}",
    ]
    for row in result["queries"]:
        lines.append(
            f"  {row['workers']:>7} {row['holdings']:>9,} {row['prompt_tokens']:>6} "
            f"{row['blocks']:>6} {row['match_p50_us']:>8.1f} {row['match_p99_us']:>8.1f} "
            f"{row['match_cpu_p99_us']:>8.1f} "
            f"{row['pure_match_p50_us']:>8.1f} {row['pure_match_p99_us']:>8.1f} "
            f"{row['floor_dict_chain_p50_us']:>9.1f} {row['floor_dict_chain_p99_us']:>9.1f} "
            f"{row['hash_chain_p50_us']:>8.1f} {row['guessed_match_p50_us']:>11.1f} "
            f"{row['pure_guessed_match_p50_us']:>16.1f}"
        )
    lines.append("  target: 8k tokens, 32 workers, 1M holdings: "
                 f"p99 <= {TARGET_QUERY_P99_US:.0f} us")
    lines += ["", "memory (resident, fresh process; traced = tracemalloc, Python's allocations "
              "only; estimate = PrefixIndex.stats().estimated_bytes)",
              f"  {'workers':>7} {'holders/block':>13} {'holdings':>9} {'nodes':>9} "
              f"{'B/holding':>9} {'traced':>6} {'estimate':>8} {'floor':>5}  loops"]
    for row in result["memory"]:
        lines.append(
            f"  {row['workers']:>7} {row['holders_per_block']:>13} {row['holdings']:>9,} "
            f"{row['nodes']:>9,} {row['bytes_per_holding']:>9.0f} "
            f"{row['traced_bytes_per_holding']:>6.0f} "
            f"{row['estimated_bytes_per_holding']:>8.0f} {row['floor_hash_int_bytes']:>5}  "
            f"{row['implementation']}"
        )
    lines.append(f"  target: <= {TARGET_BYTES_PER_HOLDING} bytes per holding at 1M holdings")
    if result["growth"]:
        lines += ["", "growth (one insertion at a time from empty; mean includes the timing "
                  "of each; floor = a dict given the same keys)",
                  f"  {'entries':>9} {'worst ms':>9} {'mean ns':>8} {'floor worst ms':>14} "
                  f"{'floor mean ns':>13}"]
        for row in result["growth"]:
            lines.append(
                f"  {row['entries']:>9,} {row['table_worst_insert_ms']:>9.2f} "
                f"{row['table_mean_insert_ns']:>8.0f} {row['dict_worst_insert_ms']:>14.2f} "
                f"{row['dict_mean_insert_ns']:>13.0f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced run (< 60 s)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "index",
        "quick": args.quick,
        "python": sys.version.split()[0],
        "ingestion": bench_ingestion(args.quick),
        "queries": bench_queries(args.quick),
        "memory": bench_memory(args.quick),
        "growth": bench_growth(args.quick),
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit(result, table(result), json_only=args.json_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
