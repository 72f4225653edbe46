"""Saved state (issue 19): save and load time and size at 1M holdings, the event loop during
a save, and load + resume to ``live``.

Setup: 4 simulated vLLM ranks (--workers) (``sim.publisher.EventPublisher``, wire-exact) publish the
batches that make each hold ~250k blocks (--quick: 25k): 16-token blocks, random uint64
block hashes as vLLM's are, requests of 1 to 64 blocks hanging off 32 system prompts that
every rank caches (same content, each rank its own hashes), and a fifth of the requests'
content also cached by another rank. kvroute's subscribers (``app.subscriber.Subscriber``,
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
import random
import statistics
import struct
import sys
import tempfile
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq.asyncio
from xxhash import xxh3_64

from benchmarks.report import emit
from kvroute.app.config import InstanceConfig
from kvroute.app.registry import Instance, Worker
from kvroute.app.saved_state import (
    PIECE_BLOCKS,
    StateWriter,
    WorkerHead,
    decode_state,
    encode_piece,
)
from kvroute.app.state_keeper import StateKeeper
from kvroute.app.state_store import DirectoryStore
from kvroute.app.subscriber import Subscriber
from kvroute.app.subscription import (
    SubscriberHooks,
    SubscriberOptions,
    WorkerEndpoint,
    WorkerState,
)
from kvroute.app.wire import BlockRemoved, BlockStored, Event, encode_batch
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher

BLOCK = 16
SYSTEM_PROMPTS = 32
SHARED = 0.2  # fraction of a rank's requests whose content another rank caches too
AFTER_BATCHES = 20  # batches each rank publishes between the save and the second kvroute
TARGET_RESUME_S = 2.0
TARGET_STALL_MS = 50.0
PROBE_FLOOR_S = 2.0
WAIT_LIVE_S = 600.0


def progress(message: str) -> None:
    print(f"[saved_state] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- traffic


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return array("H", rng.randbytes(2 * count)).tolist()


def random_hashes(rng: random.Random, count: int) -> list[int]:
    """Unsigned 64-bit block hashes, as vLLM's (about half of them >= 2**63)."""
    return array("Q", rng.randbytes(8 * count)).tolist()


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    """A BlockStored with every field vLLM 0.32.0 fills."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BLOCK, medium="GPU", extra_keys=[None] * len(hashes),
                       group_idx=0, kv_cache_spec_kind="full_attention")


@dataclass
class Rank:
    """One vLLM rank's traffic: the batches up to the save, and those after it."""

    instance: str
    before: list[bytes] = field(default_factory=list)
    after: list[bytes] = field(default_factory=list)
    blocks: int = 0  # blocks held after ``before`` (and after ``after``: evictions match)


class RankTraffic:
    """Makes one rank's requests: its own hashes for the shared system prompts, which of
    those it cached already, and its request blocks oldest first (what evictions take)."""

    def __init__(self, rng: random.Random, system: list[list[int]],
                 pool: list[tuple[int, list[int]]]) -> None:
        self.rng = rng
        self.system = system
        self.pool = pool
        self.system_hashes = [random_hashes(rng, len(p) // BLOCK) for p in system]
        self.shared_order = rng.sample(range(len(pool)), len(pool))
        self.cached: set[int] = set()
        self.fifo: deque[int] = deque()

    def request(self, events: list[Event]) -> int:
        """Stores one request's blocks (and its system prompt's, the first time); returns
        how many blocks it stored."""
        rng = self.rng
        if rng.random() < SHARED and self.shared_order:
            which, tail = self.pool[self.shared_order.pop()]
        else:
            which, tail = pick_prompt(rng), random_tokens(rng, BLOCK * rng.randint(1, 64))
        hashes = random_hashes(rng, len(tail) // BLOCK)
        prompt_hashes = self.system_hashes[which]
        self.fifo.extend(hashes)
        if which in self.cached:
            events.append(stored(hashes, prompt_hashes[-1], tail))
            return len(hashes)
        self.cached.add(which)
        events.append(stored(prompt_hashes + hashes, None, self.system[which] + tail))
        return len(prompt_hashes) + len(hashes)


def pick_prompt(rng: random.Random) -> int:
    """Which system prompt a request starts with (a few are far more common)."""
    return min(int(rng.paretovariate(1.2)) - 1, SYSTEM_PROMPTS - 1)


def build_traffic(workers: int, blocks_per_worker: int, seed: int = 19) -> list[Rank]:
    rng = random.Random(seed)
    system = [random_tokens(rng, BLOCK * rng.randint(2, 32)) for _ in range(SYSTEM_PROMPTS)]
    # Content several ranks cache: each entry is used by about two ranks.
    requests_per_rank = blocks_per_worker / 32.5
    pool = [(pick_prompt(rng), random_tokens(rng, BLOCK * rng.randint(1, 64)))
            for _ in range(max(8, int(requests_per_rank * SHARED * workers / 2)))]
    ranks = []
    for w in range(workers):
        rank = Rank(f"vllm-{w}")
        traffic = RankTraffic(rng, system, pool)
        ts = 1_700_000_000.0 + w
        while rank.blocks < blocks_per_worker:
            events: list[Event] = []
            for _ in range(rng.randint(1, 4)):
                rank.blocks += traffic.request(events)
            ts += 0.01
            rank.before.append(encode_batch(events, ts=ts, dp_rank=0))
        for _ in range(AFTER_BATCHES):  # the engine goes on at capacity: stores and evictions
            events = []
            added = sum(traffic.request(events) for _ in range(rng.randint(1, 4)))
            events[:0] = [BlockRemoved(block_hashes=[traffic.fifo.popleft()], medium="GPU",
                                       group_idx=0) for _ in range(added)]
            ts += 0.01
            rank.after.append(encode_batch(events, ts=ts, dp_rank=0))
        ranks.append(rank)
    return ranks


# --------------------------------------------------------------------------- kvroute pieces


class ServingClock(SubscriberHooks):
    """When each worker first turned serving: live, or degraded (perf_counter)."""

    def __init__(self) -> None:
        self.serving_at: dict[tuple[str, int], float] = {}

    def state_changed(self, worker: tuple[str, int], state: WorkerState) -> None:
        if state.serving:
            self.serving_at.setdefault(worker, time.perf_counter())


class Units:
    """A registry as far as ``StateKeeper`` is concerned: ``workers()``."""

    def __init__(self) -> None:
        self.units: list[Worker] = []

    def workers(self) -> list[Worker]:
        return list(self.units)


class Kvroute:
    """Subscribers into one index, started as the registry starts them."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: list[WorkerEndpoint],
                 keeper: StateKeeper | None = None) -> None:
        self.index = keeper.index if keeper is not None else PrefixIndex()
        self.registry = Units()
        self.clock = ServingClock()
        self._ctx = ctx
        self._endpoints = endpoints
        self._keeper = keeper

    def start(self) -> None:
        for endpoint in self._endpoints:
            saved = self._keeper.claim(endpoint) if self._keeper is not None else None
            sub = Subscriber(endpoint, self.index, ctx=self._ctx, hooks=self.clock,
                             options=SubscriberOptions(), saved=saved)
            instance = Instance(endpoint.instance_id, InstanceConfig(events=(endpoint.endpoint,)),
                                url=None)
            unit = Worker(instance, endpoint, sub)
            unit.task = asyncio.create_task(sub.run(), name=f"subscriber {endpoint.worker}")
            self.registry.units.append(unit)

    async def serving(self, what: str) -> float:
        """The time (perf_counter) the last worker turned serving (live or degraded)."""
        deadline = time.monotonic() + WAIT_LIVE_S
        while len(self.clock.serving_at) < len(self.registry.units):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not serving after {WAIT_LIVE_S:.0f} s: "
                                   f"{self.states()}")
            await asyncio.sleep(0.002)
        return max(self.clock.serving_at.values())

    def check_live(self, last_seqs: dict[tuple[str, int], int], what: str) -> None:
        """Every worker live at its rank's last seq; raises (saying why not) otherwise."""
        for unit in self.registry.units:
            status = unit.subscriber.status
            if status.state != WorkerState.LIVE or status.last_seq != last_seqs[unit.key]:
                raise RuntimeError(f"{what}: {unit.key} is {status.state} at seq "
                                   f"{status.last_seq}, expected live at "
                                   f"{last_seqs[unit.key]} ({status.last_error})")

    def states(self) -> dict[str, str]:
        return {f"{u.key[0]}/{u.key[1]}": f"{u.subscriber.status.state} at seq "
                f"{u.subscriber.status.last_seq}" for u in self.registry.units}

    async def caught_up(self, last_seqs: dict[tuple[str, int], int], what: str) -> None:
        """Waits until every worker applied its rank's last seq, live."""
        deadline = time.monotonic() + WAIT_LIVE_S
        while any(u.subscriber.status.last_seq != last_seqs[u.key]
                  for u in self.registry.units):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not caught up after {WAIT_LIVE_S:.0f} s: "
                                   f"{self.states()}")
            await asyncio.sleep(0.01)
        self.check_live(last_seqs, what)

    async def stop(self) -> None:
        for unit in self.registry.units:
            await unit.subscriber.stop()
        await asyncio.gather(*(u.task for u in self.registry.units if u.task is not None),
                             return_exceptions=True)


class LoopProbe:
    """A task that sleeps 1 ms at a time and records, per phase, its largest lateness (ms,
    wall clock): the longest stretch something else held the loop. Beside it, the most CPU
    time the loop's thread spent between two wake-ups: the loop's own work, without the
    time other processes of a shared machine took the core."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.late_ms: dict[str, float] = {}
        self.cpu_ms: dict[str, float] = {}
        self._task = asyncio.create_task(self._watch(), name="loop probe")

    async def _watch(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(0.001)
            now, cpu = time.perf_counter(), time.thread_time()
            phase = self.phase
            if phase is not None:
                self.late_ms[phase] = max(self.late_ms[phase], (now - last) * 1000 - 1.0)
                self.cpu_ms[phase] = max(self.cpu_ms[phase], (cpu - last_cpu) * 1000)
            last, last_cpu = now, cpu

    @contextlib.asynccontextmanager
    async def measuring(self, phase: str) -> AsyncIterator[None]:
        self.late_ms.setdefault(phase, 0.0)
        self.cpu_ms.setdefault(phase, 0.0)
        # The probe wakes once first, so that whatever ran before (a gc.collect of this
        # benchmark's own) is not counted in the phase.
        await asyncio.sleep(0.005)
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def worst(self, phase: str) -> tuple[float, float]:
        """(wall lateness, loop-thread CPU) in ms, the largest of ``phase``."""
        return round(self.late_ms[phase], 2), round(self.cpu_ms[phase], 2)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class Stopwatch:
    """Wall-clock and process-CPU seconds since it started (or since ``restart``)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        """(wall, CPU) seconds so far, and starts again."""
        wall, cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu
        self.restart()
        return wall, cpu


Snapshot = dict[tuple[str, int], dict[int | bytes, tuple[bytes, int]]]


def snapshot(index: PrefixIndex, workers: Sequence[tuple[str, int]]) -> Snapshot:
    """Every worker's holdings as hash -> (content key, position bits), through capture."""
    out: Snapshot = {}
    for worker in workers:
        capture = index.capture(worker)
        held: dict[int | bytes, tuple[bytes, int]] = {}
        if capture is not None:
            for piece in capture.pieces(PIECE_BLOCKS):
                held.update(zip(piece.hashes, zip(piece.keys, piece.flags, strict=True),
                                strict=True))
        out[worker] = held
    return out


def check_same(expected: Snapshot, index: PrefixIndex, what: str) -> None:
    got = snapshot(index, list(expected))
    for worker, held in expected.items():
        if got[worker] != held:
            missing = len(held.keys() - got[worker].keys())
            extra = len(got[worker].keys() - held.keys())
            raise RuntimeError(f"{what}: {worker} differs from the saved index ({missing} "
                               f"blocks missing, {extra} extra, of {len(held):,})")


def split_frames(body: bytes | memoryview) -> list[memoryview]:
    """A blob's frames (4-byte big-endian length, body), without the footer's checksum."""
    view = memoryview(body)
    frames, offset = [], 0
    length_of = struct.Struct(">I").unpack_from
    while offset < len(view):
        (length,) = length_of(view, offset)
        frames.append(view[offset + 4:offset + 4 + length])
        offset += 4 + length
    return frames


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def wall_cpu(name: str, pairs: Sequence[tuple[float, float]], *,
             per: str = "") -> dict[str, float]:
    """``name_ms`` (wall) and ``name_cpu_ms`` summed over ``pairs``; with ``per``, also the
    largest single one as ``name_ms_max_per_<per>``."""
    out = {f"{name}_ms": ms(sum(w for w, _ in pairs)),
           f"{name}_cpu_ms": ms(sum(c for _, c in pairs))}
    if per:
        out[f"{name}_ms_max_per_{per}"] = ms(max(w for w, _ in pairs))
    return out


# --------------------------------------------------------------------------- measurements


async def save_steps(index: PrefixIndex, units: list[Worker], directory: Path) -> dict[str, Any]:
    """The keeper's save, step by step, each timed (no yields between them)."""
    watch = Stopwatch()
    writer = StateWriter()
    captures, makes, encodes, per_piece = [], [], [], []
    first_steps = []  # capture + the first piece: the keeper's longest step between yields
    holdings = 0
    for unit in units:
        point = unit.subscriber.save_point()
        assert point is not None, f"{unit.key} is not at a batch boundary"
        watch.restart()
        capture = index.capture(unit.key)
        unconfirmed = index.capture_unconfirmed(unit.key, PIECE_BLOCKS)
        captures.append(watch.lap())
        assert capture is not None and unconfirmed is None
        pieces = []
        count = 0
        made = iter(capture.pieces(PIECE_BLOCKS))
        while True:
            watch.restart()
            piece = next(made, None)
            if piece is None:
                break
            makes.append(watch.lap())
            pieces.append(encode_piece(piece))
            encodes.append(watch.lap())
            per_piece.append(makes[-1][0] + encodes[-1][0])
            count += len(piece)
        first_steps.append(captures[-1][0] + per_piece[-len(pieces)])
        seq, fingerprint, degraded = point
        writer.add_worker(WorkerHead(unit.instance.id, unit.endpoint.dp_rank,
                                     unit.endpoint.endpoint, seq, fingerprint, degraded,
                                     len(pieces), count), pieces)
        holdings += count
    watch.restart()
    chunks = writer.finish()
    finish = watch.lap()
    await DirectoryStore(directory).write(chunks)
    write = watch.lap()
    every = [*captures, *makes, *encodes, finish, write]
    return {
        "holdings": holdings,
        "pieces": len(per_piece),
        "bytes": sum(len(c) for c in chunks),
        **wall_cpu("capture", captures, per="worker"),
        **wall_cpu("piece_make", makes),
        **wall_cpu("piece_encode", encodes),
        "piece_make_encode_ms_max_per_piece": ms(max(per_piece)),
        "capture_and_first_piece_ms_max": ms(max(first_steps)),
        **wall_cpu("finish", [finish]),
        **wall_cpu("write", [write]),  # on a thread: its CPU is mostly the kernel's
        **wall_cpu("total", every),
    }


def load_steps(path: Path, expected: Snapshot | None) -> dict[str, Any]:
    """File read, decode_state and restore into a fresh index, each timed; with their
    floors on the same bytes. Checks the restored index against ``expected``."""
    watch = Stopwatch()
    blob = path.read_bytes()
    read = watch.lap()
    state = decode_state(blob)
    decode = watch.lap()
    index = PrefixIndex()
    restores = []  # per piece, as the subscriber restores them (the loop runs between)
    per_worker = []
    for worker, saved in state.workers.items():
        for piece in saved.pieces:
            watch.restart()
            index.restore(worker, [piece])
            restores.append(watch.lap())
        per_worker.append(sum(w for w, _ in restores[-len(saved.pieces):]))
    holdings = sum(index.blocks_held(w) for w in state.workers)

    # Floors on the same bytes, keeping what they make as decode_state and restore keep
    # theirs (allocating memory that stays is a good part of the cost).
    frames = split_frames(memoryview(blob)[:-8])
    untyped = msgspec.msgpack.Decoder().decode
    watch.restart()
    decoded = [untyped(frame) for frame in frames]
    raw_decode = watch.lap()
    del decoded
    watch.restart()
    xxh3_64(blob).digest()
    checksum = watch.lap()
    pairs = [(piece.hashes, piece.keys) for saved in state.workers.values()
             for piece in saved.pieces]
    table: dict[Any, bytes] = {}
    watch.restart()
    for hashes, keys in pairs:
        table.update(zip(hashes, keys, strict=True))
    dict_build = watch.lap()
    del table, pairs

    if expected is not None:
        check_same(expected, index, "restore")
    result = {
        "bytes": len(blob),
        "holdings": holdings,
        **wall_cpu("read", [read]),
        **wall_cpu("decode_state", [decode]),
        **wall_cpu("restore", restores, per="piece"),
        "restore_ms_max_per_worker": ms(max(per_worker)),
        **wall_cpu("load_to_index", [read, decode, *restores]),
        **wall_cpu("floor_untyped_decode", [raw_decode]),
        **wall_cpu("floor_checksum", [checksum]),
        **wall_cpu("floor_dict_build", [dict_build]),
    }
    del index, state, blob
    gc.collect()
    return result


def dict_copy_floor(size: int) -> tuple[float, float]:
    """(wall, CPU) seconds to copy a plain dict of ``size`` uint64 -> 16-byte entries: what
    capture does per worker, without the index around it."""
    rng = random.Random(5)
    table = dict(zip(random_hashes(rng, size), (rng.randbytes(16) for _ in range(size)),
                     strict=True))
    watch = Stopwatch()
    table.copy()
    return watch.lap()


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


class TimedIndex(PrefixIndex):
    """A PrefixIndex that times each ``restore`` (the subscribers call it on the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.restores: list[tuple[float, float]] = []

    def restore(self, worker: Any, pieces: Any) -> int:
        watch = Stopwatch()
        try:
            return super().restore(worker, pieces)
        finally:
            self.restores.append(watch.lap())


async def resume_once(ctx: zmq.asyncio.Context, endpoints: list[WorkerEndpoint],
                      state_dir: Path, last_seqs: dict[tuple[str, int], int], probe: LoopProbe,
                      phase: str, expected: Snapshot | None,
                      profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """A second kvroute started as the service starts one: StateKeeper.load, then a
    subscriber per worker given what the keeper kept for it; timed until all are live."""
    gc.collect()
    index = TimedIndex()
    watch = Stopwatch()
    async with probe.measuring(phase):
        if profiler is not None:
            profiler.enable()
        watch.restart()
        keeper = StateKeeper(DirectoryStore(state_dir), Units(),  # type: ignore[arg-type]
                             index, interval=3600.0)
        await keeper.load()
        if keeper.loaded is None:
            raise RuntimeError(f"the saved state did not load: {keeper.load_error}")
        load = watch.lap()
        started = time.perf_counter()
        second = Kvroute(ctx, endpoints, keeper)
        second.start()
        live = await second.serving("resume")
        to_live = (live - started, watch.lap()[1])
        if profiler is not None:
            profiler.disable()
    second.check_live(last_seqs, "resume")
    statuses = [u.subscriber.status for u in second.registry.units]
    restored = sum(s.restored_blocks for s in statuses)
    unconfirmed = sum(s.restored_unconfirmed for s in statuses)
    if unconfirmed or restored != keeper.loaded.blocks or any(s.degraded_count
                                                             for s in statuses):
        raise RuntimeError(f"resume: {restored:,} blocks restored exactly, {unconfirmed:,} "
                           f"unconfirmed; expected {keeper.loaded.blocks:,} exact")
    if expected is not None:
        check_same(expected, index, "resume")
    late, cpu = probe.worst(phase)
    await second.stop()
    return {
        **wall_cpu("load", [load]),
        **wall_cpu("subscribers_to_live", [to_live]),
        **wall_cpu("restore_in_subscribers", index.restores, per="call"),
        **wall_cpu("load_and_resume", [load, to_live]),
        "loop_stall_ms": late,
        "loop_stall_cpu_ms": cpu,
        "restored_blocks": restored,
    }


def print_profile(profiler: cProfile.Profile, label: str) -> None:
    """The top functions by own time; the profiles count the loop thread's CPU time, so
    that neither waiting nor other processes of a shared machine show in them."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    progress(f"profile of {label}, by own CPU time:\n{text.getvalue()}")


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


# --------------------------------------------------------------------------- report


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
