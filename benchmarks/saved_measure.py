"""The measurements of the saved-state benchmark (``benchmarks.saved_state``).

The clocks (``LoopProbe``: how long something held the event loop; ``Stopwatch``: wall and
process-CPU time), the check that an index holds what was saved (``snapshot``,
``check_same``), and each measurement: the save's steps one by one (``save_steps``), load
to index with its floors (``load_steps``, ``dict_copy_floor``), and load + resume to live
in a second kvroute (``resume_once``).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import random
import struct
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq.asyncio
from xxhash import xxh3_64

from benchmarks.saved_kvroute import Kvroute, Units
from benchmarks.saved_traffic import random_hashes
from kvroute.app.fleet.registry import Worker
from kvroute.app.state.format import (
    PIECE_BLOCKS,
    StateWriter,
    WorkerHead,
    decode_state,
    encode_piece,
)
from kvroute.app.state.keeper import StateKeeper
from kvroute.app.state.store import DirectoryStore
from kvroute.app.workers import WorkerEndpoint
from kvroute.index import PrefixIndex


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
