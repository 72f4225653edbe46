"""Saving the index and resuming from it: when, from where, and what it costs the loop.

Ownership and invariants:
- ``load`` runs once, before any subscriber starts. A blob that cannot be loaded
  (``SavedStateError``, an unreadable store) is logged in one line and ignored: kvroute
  then starts as if nothing were saved. Nothing of a bad blob reaches the index.
- A saved worker is handed to the subscriber of the same (instance, rank) and endpoint the
  first time one starts (``claim``), and to no other. One whose endpoint changed is
  dropped. Until claimed it is carried into every later save unchanged, so an instance
  that comes back late (discovery retrying, an engine down for a while) still finds it.
- ``save`` records each serving worker at a batch boundary (``Subscriber.save_point``),
  capturing its holdings in the same step of the loop, so every worker's holdings are
  exactly those of its saved seq. Making and encoding pieces yields to the loop between
  pieces, and the write runs on a thread or over the network: a save holds the loop for
  one worker's capture (C-level table copies, no Python loop per block) at most.
- Saves never overlap: a periodic save waits for the one before; the final save at
  shutdown runs before the registry stops any subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.app.api.answers import SavedStateLoaded, SavedStateStatus
from kvroute.app.fleet.registry import Registry
from kvroute.app.state.format import (
    PIECE_BLOCKS,
    SavedState,
    SavedStateError,
    SavedWorker,
    StateWriter,
    WorkerHead,
    decode_state,
    encode_piece,
)
from kvroute.app.state.store import StateStore, StateStoreError
from kvroute.app.tasks import cancel_and_wait, cancel_requested
from kvroute.app.workers import WorkerEndpoint, WorkerKey
from kvroute.index import PrefixIndex

__all__ = ["SaveReport", "StateCollector", "StateKeeper", "encode_worker"]

log = logging.getLogger("kvroute.state")

# Tries per worker to find it between two batches before a save leaves it out.
_BOUNDARY_TRIES = 50
# Kubernetes' default grace period is 30 s; the final save gets a third of it.
FINAL_SAVE_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class SaveReport:
    workers: int
    blocks: int
    bytes: int
    seconds: float


class StateKeeper:
    def __init__(self, store: StateStore, registry: Registry, index: PrefixIndex,
                 interval: float) -> None:
        self.store = store
        self.registry = registry
        self.index = index
        self.interval = interval
        self._unclaimed: dict[WorkerKey, SavedWorker] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        # What /metrics and /readyz show.
        self.loaded: SavedState | None = None
        self.load_seconds: float | None = None
        self.load_error: str | None = None
        self.last_save: SaveReport | None = None
        self.last_save_at: float | None = None  # unix time
        self.save_error: str | None = None
        self.saves = 0
        self.save_failures = 0

    # -- loading ---------------------------------------------------------
    async def load(self) -> None:
        started = time.perf_counter()
        try:
            blob = await self.store.read()
            if blob is None:
                log.info("no saved state in %s yet", self.store.where)
                return
            state = await asyncio.to_thread(decode_state, blob)
        except (SavedStateError, StateStoreError) as exc:
            self.load_error = str(exc)
            log.warning("saved state in %s ignored: %s", self.store.where, exc)
            return
        self.loaded = state
        self._unclaimed = dict(state.workers)
        self.load_seconds = time.perf_counter() - started
        age = max(0.0, time.time() - state.saved_at)
        log.info("saved state from %s: %d workers, %d blocks, saved %.0f s ago, read in "
                 "%.2f s", self.store.where, len(state.workers), state.blocks, age,
                 self.load_seconds)

    def claim(self, endpoint: WorkerEndpoint) -> SavedWorker | None:
        """The saved holdings for this worker, once (see the module invariants)."""
        saved = self._unclaimed.pop(endpoint.worker, None)
        if saved is None:
            return None
        if saved.head.endpoint != endpoint.endpoint:
            log.info("%s: saved state was for %s, now %s: not used", endpoint.worker,
                     saved.head.endpoint, endpoint.endpoint)
            return None
        saved.frames = []  # only the unclaimed are carried
        return saved

    @property
    def unclaimed(self) -> int:
        return len(self._unclaimed)

    def status(self) -> SavedStateStatus:
        """For /readyz: where the state goes and how the last save and the load went."""
        out = SavedStateStatus(store=self.store.where, saves=self.saves)
        if self.last_save_at is not None:
            out.last_save_age_seconds = round(max(0.0, time.time() - self.last_save_at), 1)
        if self.save_error is not None:
            out.save_error = self.save_error
        if self.loaded is not None:
            out.loaded = SavedStateLoaded(workers=len(self.loaded.workers),
                                          blocks=self.loaded.blocks, unclaimed=self.unclaimed)
        if self.load_error is not None:
            out.load_error = self.load_error
        return out

    # -- saving ----------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._save_periodically(), name="kvroute state saver")

    async def close(self, timeout: float = FINAL_SAVE_TIMEOUT) -> None:
        """Stop saving periodically and save one last time (before subscribers stop), for
        at most ``timeout`` seconds: a store that does not answer must not hold a shutdown
        past the orchestrator's grace period (the last periodic save stays)."""
        await cancel_and_wait(self._task)
        self._task = None
        try:
            await asyncio.wait_for(self.save(), timeout)
        except TimeoutError:
            log.warning("the final save to %s took over %.0f s; the last periodic save "
                        "stays", self.store.where, timeout)

    async def _save_periodically(self) -> None:
        while not cancel_requested():  # a store's client may swallow the cancellation
            await asyncio.sleep(self.interval)
            try:
                await self.save()
            except Exception:  # a bug must not end saving for the rest of the process
                self.save_failures += 1
                log.exception("saving state to %s failed", self.store.where)

    async def save(self) -> SaveReport | None:
        """Save every serving worker (and the unclaimed ones); None when it failed (logged,
        counted, and shown by /readyz)."""
        async with self._lock:
            started = time.perf_counter()
            try:
                writer, workers, blocks = await self._collect()
                chunks = writer.finish()
                await self.store.write(chunks)
            except StateStoreError as exc:
                self.save_failures += 1
                if self.save_error != str(exc):
                    log.warning("saving state to %s failed: %s", self.store.where, exc)
                self.save_error = str(exc)
                return None
            if self.save_error is not None:
                log.info("saving state to %s works again", self.store.where)
            self.save_error = None
            self.saves += 1
            self.last_save_at = time.time()
            self.last_save = SaveReport(workers, blocks, sum(len(c) for c in chunks),
                                        time.perf_counter() - started)
            return self.last_save

    async def _collect(self) -> tuple[StateWriter, int, int]:
        writer = StateWriter()
        workers = blocks = 0
        for worker in list(self.registry.workers()):
            subscriber = worker.subscriber
            for _ in range(_BOUNDARY_TRIES):
                point = subscriber.save_point()
                if point is not None or not subscriber.status.state.serving:
                    break
                await asyncio.sleep(0.001)
            else:
                log.info("%s: always mid-batch, left out of this save", worker.key)
                continue
            if point is None:
                continue
            # No await before the capture: it is taken in the same step as the save point.
            encoded = await encode_worker(self.index, worker.endpoint, point)
            if encoded is None:
                continue
            writer.add_worker(*encoded)
            workers += 1
            blocks += encoded[0].blocks
        for saved in list(self._unclaimed.values()):
            writer.carry(saved)
            workers += 1
            blocks += saved.head.blocks
        return writer, workers, blocks


async def encode_worker(
        index: PrefixIndex, endpoint: WorkerEndpoint,
        point: tuple[int, int | None, bool]) -> tuple[WorkerHead, list[bytes]] | None:
    """One worker's head and encoded pieces (held, then unconfirmed with the time they have
    left) at ``point`` (``Subscriber.save_point``); None for a worker the index does not
    know. The holdings are captured before this coroutine first awaits: awaited right after
    ``save_point``, they are the point's. It yields to the loop between pieces."""
    capture = index.capture(endpoint.worker)
    if capture is None:
        return None
    unconfirmed = index.capture_unconfirmed(endpoint.worker, PIECE_BLOCKS)
    seq, fingerprint, degraded = point
    pieces = []
    blocks = 0
    for piece in capture.pieces(PIECE_BLOCKS):
        pieces.append(encode_piece(piece))
        blocks += len(piece)
        await asyncio.sleep(0)
    held = len(pieces)
    left = 0.0
    if unconfirmed is not None:
        pieces.extend(encode_piece(piece) for piece in unconfirmed[0])
        left = max(0.0, unconfirmed[1] - time.monotonic())
    return WorkerHead(endpoint.instance_id, endpoint.dp_rank, endpoint.endpoint, seq,
                      fingerprint, degraded, held, blocks, len(pieces) - held, left), pieces


class StateCollector(Collector):
    """The saved state's metrics, read from ``StateKeeper`` at scrape time."""

    def __init__(self, keeper: StateKeeper) -> None:
        self._keeper = keeper

    def collect(self) -> Iterator[Any]:
        keeper = self._keeper
        last = keeper.last_save
        if keeper.last_save_at is not None:
            yield GaugeMetricFamily("kvroute_state_age_seconds",
                                    "seconds since the last successful save",
                                    value=max(0.0, time.time() - keeper.last_save_at))
        if last is not None:
            yield GaugeMetricFamily("kvroute_state_bytes", "size of the last save",
                                    value=float(last.bytes))
            yield GaugeMetricFamily("kvroute_state_blocks", "blocks in the last save",
                                    value=float(last.blocks))
            yield GaugeMetricFamily("kvroute_state_save_seconds",
                                    "time the last save took, start to written",
                                    value=last.seconds)
        if keeper.load_seconds is not None:
            yield GaugeMetricFamily("kvroute_state_load_seconds",
                                    "time reading and decoding the saved state took at start",
                                    value=keeper.load_seconds)
        yield CounterMetricFamily("kvroute_state_saves", "saves written", value=keeper.saves)
        yield CounterMetricFamily("kvroute_state_save_failures", "saves that failed",
                                  value=keeper.save_failures)
        yield GaugeMetricFamily("kvroute_state_unclaimed_workers",
                                "saved workers whose instance has not come back yet",
                                value=float(keeper.unclaimed))
