"""One subscriber per worker endpoint: live KV events in, index updates out, never diverging.

Sequence tracking (docs/decisions.md; each seq is classified by ``sequence.classify``):

- ``last_seq`` is the last APPLIED seq. The next live batch must be ``last_seq + 1``.
- A live seq above that is a gap: the missing batches are fetched from the replay ROUTER
  (fresh DEALER per request, timeouts, bounded retries with backoff). A replay must be
  contiguous; at the first hole the rest of it is dropped and asked for again from the hole.
- A replay that starts above the seq asked for has lost history (the publisher's buffer moved
  on): the worker is cleared, rebuilt from everything still buffered, and marked degraded.
- The live stream of one publisher is strictly increasing, so the live seq going backwards
  (at or below the previous LIVE seq) means the engine restarted: the worker is cleared and
  rebuilt from a replay from 0. Otherwise a live seq at or below ``last_seq`` is a batch a
  replay already applied (it was queued behind the replay): a duplicate, skipped, unless its
  payload differs from the replayed one, which again means a restarted engine (this is what
  tells the two apart right after a replay, when there is no previous live seq yet).
- On the first connection, and on every reconnection, the worker is rebuilt from a replay
  from 0 (state is never trusted across a disconnect; while disconnected it is ``down`` and
  holds nothing in the index).
- When the live stream has been quiet for ``idle_check`` seconds, a replay from
  ``last_seq + 1`` picks up batches whose live copies were dropped at the end of a burst
  (a gap is otherwise only visible when the next batch arrives).
- ``degraded`` means the worker's entry may under-report what the engine holds (history
  lost, a gap that could not be filled). It ends when the state is known to be exact again:
  an ``AllBlocksCleared`` was applied, or a rebuild got the publisher's history from seq 0.

Ownership: the subscriber is the only writer of its worker's entries in the index. All index
calls are synchronous and happen on the event loop, so each event is applied atomically; big
batches yield to the loop between chunks of events, never inside one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.app.sequence import Kind, Verdict, classify
from kvroute.app.wire import (
    AllBlocksCleared,
    WireError,
    apply_event,
    coalesced,
    decode_batch,
    decode_replay_frame,
    decode_seq,
    encode_seq,
)

log = logging.getLogger(__name__)

class WorkerState(StrEnum):
    """Where a worker's subscriber stands; the only spelling of these states in kvroute."""

    CONNECTING = "connecting"  # no connection yet, or reconnecting: holds nothing
    REPLAYING = "replaying"  # rebuilding from the publisher's buffer
    LIVE = "live"  # applying the live stream; its entries are exact
    DEGRADED = "degraded"  # live, but history was lost: its entries may under-report
    DOWN = "down"  # disconnected or given up: holds nothing

    @property
    def serving(self) -> bool:
        """Whether answers may include a worker in this state."""
        return self in SERVING


SERVING = frozenset({WorkerState.LIVE, WorkerState.DEGRADED})

Worker = tuple[str, int]

#: Every counter a subscriber keeps, declared once: the ``WorkerStatus`` field, and the
#: Prometheus counter (name, help) that /metrics exports it as, per worker.
COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("kvroute_batches", "event batches applied, garbage included"),
    "events": ("kvroute_events", "KV events applied to the index"),
    "blocks": ("kvroute_blocks", "blocks named by applied events"),
    "gaps": ("kvroute_sequence_gaps", "sequence gaps seen on the live stream"),
    "replays": ("kvroute_replays", "replay requests sent to the replay endpoint"),
    "replay_failures": ("kvroute_replay_failures",
                        "replay requests that got no complete answer"),
    "malformed": ("kvroute_malformed_frames", "frames or events that could not be decoded"),
    "unknown": ("kvroute_unknown_events", "events of a type kvroute does not know, skipped"),
    "duplicates": ("kvroute_duplicate_batches",
                   "live batches a replay had already applied, skipped"),
    "degraded_count": ("kvroute_degraded", "times history was lost and the worker was rebuilt"),
    "restarts": ("kvroute_engine_restarts", "engine restarts detected (sequence went back)"),
    "disconnects": ("kvroute_disconnects", "connections to the publisher lost"),
    "rank_mismatches": ("kvroute_rank_mismatches",
                        "batches whose payload named another data-parallel rank"),
}


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """Where one routing unit (an instance's data-parallel rank) publishes."""

    instance_id: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @property
    def worker(self) -> Worker:
        return (self.instance_id, self.dp_rank)


@dataclass(slots=True)
class WorkerStatus:
    state: WorkerState = WorkerState.CONNECTING
    last_seq: int | None = None
    batches: int = 0
    events: int = 0
    blocks: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    malformed: int = 0
    unknown: int = 0
    duplicates: int = 0
    degraded_count: int = 0
    restarts: int = 0
    disconnects: int = 0
    rank_mismatches: int = 0
    last_event_time: float | None = None
    last_error: str | None = None

    @property
    def serving(self) -> bool:
        """Whether answers may include this worker (it is connected and its state is known)."""
        return self.state.serving

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class SubscriberHooks:
    """Override to follow state changes; called on the event loop, must not block."""

    def state_changed(self, worker: Worker, state: WorkerState) -> None:
        pass


@dataclass(slots=True)
class SubscriberOptions:
    replay_timeout: float = 2.0     # seconds to wait for each replay reply frame
    replay_retries: int = 3         # attempts per replay request
    retry_backoff: float = 0.1      # first retry delay, doubled per attempt
    reconnect_ivl_ms: int = 100     # ZMQ reconnect interval, doubled by ZMQ up to the max
    reconnect_ivl_max_ms: int = 5_000
    idle_check: float = 5.0         # quiet live stream: look for dropped tail batches
    chunk_events: int = 256         # events applied between two yields to the loop
    rcvhwm: int = 0                 # 0 = unbounded: never drop on kvroute's side
    # Bounds against a hostile or broken publisher (Settings' max_event_message_bytes,
    # max_blocks_per_event, max_blocks_per_worker).
    max_message_bytes: int = 16 * 1024 * 1024
    max_blocks_per_event: int = 65_536
    max_blocks_per_worker: int = 4_194_304
    max_hole_retries: int = 5       # re-asks for holes inside replays, per gap


class _Disconnected(Exception):
    """The connection dropped while a batch or replay was in progress: abandon it (the
    worker was cleared and will be rebuilt)."""


_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
_POLL_MS = 100
_MAX_REPLAYED_FINGERPRINTS = 20_000


def _fingerprint(payload: bytes) -> int:
    # Payloads carry the step's timestamp, so two engines' batches never share bytes.
    return hash(payload)


class Subscriber:
    """Keeps ``index``'s entries for one worker equal to what that worker's engine holds."""

    def __init__(
        self,
        endpoint: WorkerEndpoint,
        index: Any,
        *,
        ctx: zmq.asyncio.Context | None = None,
        hooks: SubscriberHooks | None = None,
        options: SubscriberOptions | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.worker = endpoint.worker
        self.index = index
        self.hooks = hooks or SubscriberHooks()
        self.options = options or SubscriberOptions()
        self.status = WorkerStatus()
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._connected = asyncio.Event()
        self._needs_rebuild = True      # first connection: learn what is already cached
        self._generation = 0            # bumped on every disconnect
        self._working_generation = 0    # the generation the current step started in
        self._last_live: int | None = None
        self._degraded = False
        self._warned_rank = False
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        # seq -> payload fingerprint of batches applied from a replay: tells a live duplicate
        # of one of them from a restarted engine's batch with the same seq.
        self._replayed: dict[int, int] = {}
        self._unyielded = 0  # events applied since the last yield to the event loop

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and apply until ``stop()``; never raises for wire or peer faults."""
        self._task = asyncio.current_task()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.options.rcvhwm)
        sub.setsockopt(zmq.RECONNECT_IVL, self.options.reconnect_ivl_ms)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, self.options.reconnect_ivl_max_ms)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        monitor = sub.get_monitor_socket(_UP | _DOWN)
        self._sub = sub
        watcher = asyncio.create_task(self._watch(monitor), name=f"kv-monitor-{self.worker}")
        try:
            sub.connect(self.endpoint.endpoint)
            await self._main_loop(sub)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            self._sub = None
            self._stopped.set()

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask ``run()`` to return and wait for it (sockets closed when this returns)."""
        self._stopping.set()
        if self._task is None or self._stopped.is_set():
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped.wait()), timeout)
        except TimeoutError:
            # Stuck in a replay timeout: cancel; run()'s finally still closes the sockets.
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- connection state ---------------------------------------------------------------------

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            frames = await monitor.recv_multipart()
            event = parse_monitor_message(frames)["event"]
            if event == _UP:
                self._connected.set()
            elif event == zmq.EVENT_DISCONNECTED or not self._connected.is_set():
                self._went_down(event)

    def _went_down(self, event: int) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        if was_connected:
            self._count("disconnects")
        if self.status.state != WorkerState.DOWN:
            self.status.last_error = (
                f"disconnected from {self.endpoint.endpoint}" if was_connected
                else f"cannot connect to {self.endpoint.endpoint}"
            )
        self._generation += 1
        self._clear_worker()
        self._needs_rebuild = True
        self._set_state(WorkerState.DOWN)

    async def _main_loop(self, sub: zmq.asyncio.Socket) -> None:
        idle_since = time.monotonic()
        while not self._stopping.is_set():
            self._working_generation = self._generation
            try:
                if not self._connected.is_set():
                    await self._wait_or_stop(self._connected.wait(), _POLL_MS / 1000)
                elif self._needs_rebuild:
                    self._needs_rebuild = False
                    await self._drain(sub)
                    await self._rebuild()
                    idle_since = time.monotonic()
                elif await sub.poll(_POLL_MS, zmq.POLLIN):
                    frames = await sub.recv_multipart()
                    idle_since = time.monotonic()
                    self._check_connection()
                    await self._on_live(frames)
                elif time.monotonic() - idle_since >= self.options.idle_check:
                    idle_since = time.monotonic()
                    if self.status.last_seq is not None:
                        await self._fill_from(self.status.last_seq + 1)
            except _Disconnected:
                continue
            except Exception as exc:  # never let a bug end the subscription silently
                log.exception("%s: unexpected error", self.worker)
                self.status.last_error = f"internal error: {exc!r}"
                await asyncio.sleep(_POLL_MS / 1000)

    def _check_connection(self) -> None:
        """Called after every await inside a step: a disconnect meanwhile voids the step."""
        if self._generation != self._working_generation:
            raise _Disconnected

    async def _wait_or_stop(self, awaitable: Awaitable[Any], timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(awaitable, timeout)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        """Drop live batches queued before the replay that is about to cover them."""
        while await sub.poll(0, zmq.POLLIN):
            await sub.recv_multipart()
        self._last_live = None

    # --- live batches -------------------------------------------------------------------------

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed(f"live message with {len(frames)} frames, expected 3")
            return
        try:
            seq = decode_seq(frames[1])
        except WireError as exc:
            self._malformed(str(exc))
            return
        previous_live, self._last_live = self._last_live, seq
        payload = frames[2]
        verdict = classify(seq, last_applied=self.status.last_seq, last_live=previous_live)
        if verdict.kind is Kind.DUPLICATE:
            known = self._replayed.get(seq)
            if known is None or known == _fingerprint(payload):
                self._count("duplicates")
                return
            # Same seq, other content: a new engine counting from 0 again, caught before its
            # live seq went back (right after a replay there is no previous live seq).
            verdict = Verdict(Kind.RESTART)
        if verdict.kind is Kind.RESTART:
            log.warning("%s: seq went back to %d: the engine restarted", self.worker, seq)
            self._count("restarts")
            await self._rebuild()
            # Not live-vs-live any more: the rebuild may have applied this seq, or left a gap.
            verdict = classify(seq, last_applied=self.status.last_seq)
            if verdict.kind is Kind.DUPLICATE:
                return
        if verdict.kind is Kind.GAP:
            self._count("gaps")
            await self._fill_from(verdict.missing.start)
            verdict = classify(seq, last_applied=self.status.last_seq)
            if verdict.kind is Kind.DUPLICATE:
                return
            if verdict.kind is Kind.GAP:
                missing = verdict.missing
                self._give_up(f"batches {missing[0]}..{missing[-1]} could not be recovered")
        await self._apply(seq, payload)

    def _give_up(self, reason: str) -> None:
        """A gap nothing can fill: hold nothing rather than something possibly stale."""
        log.warning("%s: %s; clearing the worker and going on degraded", self.worker, reason)
        self.status.last_error = reason
        self._clear_worker()
        self._mark_degraded()

    # --- replay -------------------------------------------------------------------------------

    async def _rebuild(self) -> None:
        """Clear the worker and learn everything the publisher still buffers."""
        self._clear_worker()
        self._degraded = False
        self._set_state(WorkerState.REPLAYING)
        if self.endpoint.replay_endpoint is not None:
            if not await self._fill_from(0):
                self._mark_degraded()  # the engine may hold blocks we could not learn
        self._settle()

    async def _fill_from(self, start: int) -> bool:
        """Apply replayed batches from ``start`` on, re-asking from each hole (bounded).
        Returns whether the replay reached its end marker without a hole left."""
        if self.endpoint.replay_endpoint is None:
            return False
        for _ in range(self.options.max_hole_retries + 1):
            outcome = await self._replay_once(start)
            if outcome != "hole":
                return outcome == "complete"
            start = 0 if self.status.last_seq is None else self.status.last_seq + 1
        return False

    async def _replay_once(self, start: int) -> str:
        """One request. Returns "complete", "hole" (ask again from last_seq + 1) or "failed"."""
        assert self.endpoint.replay_endpoint is not None
        self._count("replays")
        delay = self.options.retry_backoff
        for attempt in range(self.options.replay_retries):
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(self.endpoint.replay_endpoint)
                await dealer.send_multipart([b"", encode_seq(start)])
                return await self._consume_replay(dealer, start)
            except TimeoutError:
                self.status.last_error = (
                    f"replay from {self.endpoint.replay_endpoint} timed out "
                    f"(attempt {attempt + 1}/{self.options.replay_retries})"
                )
            finally:
                dealer.close(0)
            if self._stopping.is_set():
                break
            await asyncio.sleep(delay)
            self._check_connection()
            delay *= 2
        self._count("replay_failures")
        log.warning("%s: %s", self.worker, self.status.last_error)
        return "failed"

    async def _consume_replay(self, dealer: zmq.asyncio.Socket, start: int) -> str:
        first = True
        while True:
            ready = await dealer.poll(int(self.options.replay_timeout * 1000), zmq.POLLIN)
            self._check_connection()
            if not ready:
                raise TimeoutError
            frames = await dealer.recv_multipart()
            self._check_connection()
            try:
                reply = decode_replay_frame(frames)
            except WireError as exc:
                self._malformed(f"replay: {exc}")
                return "hole"
            if reply.seq is None:
                return "complete"
            if first:
                first = False
                if reply.seq > start:
                    self._lost_history(start, reply.seq)
                    await self._apply(reply.seq, reply.payload, replayed=True)
                    continue
            verdict = classify(reply.seq, last_applied=self.status.last_seq)
            if verdict.kind is Kind.DUPLICATE:
                continue  # already applied (a replay overlapping live batches)
            if verdict.kind is Kind.GAP:
                return "hole"  # the ROUTER dropped frames (its HWM): ask again from here
            await self._apply(reply.seq, reply.payload, replayed=True)

    def _lost_history(self, asked: int, got: int) -> None:
        log.warning("%s: replay asked from %d starts at %d: history lost, rebuilding degraded",
                    self.worker, asked, got)
        self.status.last_error = (
            f"replay history lost: asked from seq {asked}, buffer starts at {got}"
        )
        self._clear_worker()
        self._mark_degraded()

    # --- applying -----------------------------------------------------------------------------

    async def _apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        """Apply one batch; the seq counts even when the payload is garbage."""
        status = self.status
        self._unyielded += 1  # even an empty or garbage batch is work
        if replayed:
            self._remember_replayed(seq, payload)
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self._malformed(str(exc))
            status.last_seq = seq
            return
        if (batch.data_parallel_rank is not None
                and batch.data_parallel_rank != self.endpoint.dp_rank):
            self._count("rank_mismatches")
            if not self._warned_rank:
                self._warned_rank = True
                log.warning("%s: payload says data-parallel rank %s; keeping the endpoint's",
                            self.worker, batch.data_parallel_rank)
        blocks = 0
        exact_again = False
        chunk = self.options.chunk_events
        for event in coalesced(batch.events):
            # Counted across batches, so that a replay of thousands of small batches yields
            # too, whether or not zmq's own awaits happen to.
            self._unyielded += 1
            if self._unyielded >= chunk:
                self._unyielded = 0
                await asyncio.sleep(0)
                self._check_connection()
            try:
                blocks += apply_event(self.index, self.worker, event)
            except ValueError as exc:
                batch.malformed += 1
                status.last_error = f"seq {seq}: event rejected by the index: {exc}"
            except Exception as exc:
                # A bug, not bad input: the worker's entries may be half-updated. Hold
                # nothing rather than something wrong, and carry on with the stream.
                log.exception("%s: applying seq %d failed", self.worker, seq)
                self._give_up(f"internal error applying seq {seq}: {exc!r}")
                status.last_seq = seq
                return
            if isinstance(event, AllBlocksCleared):
                exact_again = True
        n_events = len(batch.events)
        status.last_seq = seq
        status.last_event_time = time.time()
        self._count("batches")
        self._count("events", n_events)
        self._count("blocks", blocks)
        self._count("malformed", batch.malformed)
        self._count("unknown", batch.unknown)
        if exact_again and self._degraded:
            self._degraded = False
        if status.state.serving:
            self._settle()

    # --- bookkeeping --------------------------------------------------------------------------

    def _remember_replayed(self, seq: int, payload: bytes) -> None:
        if len(self._replayed) >= _MAX_REPLAYED_FINGERPRINTS:
            del self._replayed[next(iter(self._replayed))]  # the oldest
        self._replayed[seq] = _fingerprint(payload)

    def _clear_worker(self) -> None:
        self.index.clear_worker(self.worker)
        self.status.last_seq = None
        self._replayed.clear()

    def _mark_degraded(self) -> None:
        self._degraded = True
        self._count("degraded_count")
        if self.status.state.serving:
            self._set_state(WorkerState.DEGRADED)

    def _settle(self) -> None:
        self._set_state(WorkerState.DEGRADED if self._degraded else WorkerState.LIVE)

    def _malformed(self, reason: str) -> None:
        self.status.last_error = reason
        self._count("malformed")

    def _set_state(self, state: WorkerState) -> None:
        if self.status.state != state:
            self.status.state = state
            self.hooks.state_changed(self.worker, state)

    def _count(self, name: str, n: int = 1) -> None:
        """Add to one of the ``COUNTERS`` in this worker's status."""
        setattr(self.status, name, getattr(self.status, name) + n)
