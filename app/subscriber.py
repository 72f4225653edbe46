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
- Resume (``app.saved_state``): a subscriber given a saved worker asks, on its first
  connection, for a replay from the saved seq instead. The first batch decides:
  that seq with the saved fingerprint is the same engine, so the saved holdings are
  restored exactly and the rest of the replay brings them up to date (``live`` at once);
  no batch at or after it, or another payload under that seq, is another engine (the
  holdings are dropped and the worker is rebuilt as above); a first batch past the saved
  seq means the buffer moved on: the holdings are kept unconfirmed (they count like
  placement guesses until real events replace them or ``unconfirmed_ttl`` passes) and the
  worker rebuilds from what is buffered, degraded. Without any answer (no replay endpoint,
  timeouts) it rebuilds as above, and the holdings are kept unconfirmed too.
- When the live stream has been quiet for ``idle_check`` seconds, a replay from
  ``last_seq + 1`` picks up batches whose live copies were dropped at the end of a burst
  (a gap is otherwise only visible when the next batch arrives).
- ``degraded`` means the worker's entry may under-report what the engine holds (history
  lost, a gap that could not be filled, a store skipped for a cap). It ends when the state
  is known to be exact again: an ``AllBlocksCleared`` was applied after the last skip, or a
  rebuild got the publisher's history from seq 0.

Bounds against a hostile or broken publisher (``SubscriberOptions``):

- No frame over ``max_message_bytes`` is received, live or replayed: ZMQ drops a connection
  that sends one (``MAXMSGSIZE``) and gives it up. A dropped live connection is like any
  disconnect (down, cleared, rebuilt on reconnect; where ZMQ gave up, kvroute connects
  again on a new socket). A dropped replay connection loses the batch after the last one
  received: the worker is cleared and degraded, and the replay goes on after that batch.
- At most ``rcvhwm`` live messages wait in kvroute's memory; past that ZMQ stops reading and
  the backlog waits at the publisher, whose drops are sequence gaps that replay recovers.
- A BlockStored of more than ``max_blocks_per_event`` blocks, or one that would take the
  worker past ``max_blocks_per_worker`` blocks held, is counted and skipped, and the worker
  turns degraded. Removals are never skipped: a skipped one would over-report.
- Applying holds the event loop for at most ``slice_blocks`` blocks of index work (or
  ``chunk_events`` events): bigger events are applied in slices (``wire.slices``) that
  leave the index exactly as one call would, with a yield to the loop between them. A big
  payload is decoded ``chunk_events`` events at a time. Still one call each: a payload's
  envelope and one event's decoding (bounded by ``max_message_bytes``), and a clear
  (O(blocks held), bounded by ``max_blocks_per_worker``).

Ownership: the subscriber is the only writer of its worker's entries in the index. All index
calls are synchronous and happen on the event loop; a batch is applied in chunks of events
and an event in slices of blocks, with yields to the loop between them. A disconnect during
a yield abandons the batch (the worker was cleared, and will be rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.app.saved_state import SavedWorker, payload_fingerprint
from kvroute.app.sequence import Kind, Verdict, classify
from kvroute.app.wire import (
    SLICE_TOKENS_PER_BLOCK,
    AllBlocksCleared,
    BlockStored,
    Event,
    Hash,
    IndexWriter,
    WireError,
    apply_event,
    coalesced,
    decode_batch,
    decode_envelope,
    decode_events,
    decode_replay_frame,
    decode_seq,
    encode_seq,
    slices,
)
from kvroute.index.holdings import Holdings

log = logging.getLogger(__name__)

class WorkerState(StrEnum):
    """Where a worker's subscriber stands: `live` and `degraded` workers take traffic."""

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
    "degraded_count": ("kvroute_degraded",
                       "times the worker turned degraded: history lost or a store skipped"),
    "restarts": ("kvroute_engine_restarts", "engine restarts detected (sequence went back)"),
    "disconnects": ("kvroute_disconnects", "connections to the publisher lost"),
    "rank_mismatches": ("kvroute_rank_mismatches",
                        "batches whose payload named another data-parallel rank"),
    "oversized_events": ("kvroute_oversized_events",
                         "BlockStored events over max_blocks_per_event, skipped"),
    "over_capacity": ("kvroute_over_capacity_events",
                      "BlockStored events that would take the worker past "
                      "max_blocks_per_worker blocks, skipped"),
    "unreceivable": ("kvroute_unreceivable_batches",
                     "replayed batches lost with their connection (a frame over "
                     "max_message_bytes drops it), skipped after clearing the worker"),
    "restored_blocks": ("kvroute_restored_blocks",
                        "saved blocks restored exactly (the replay continued the saved seq)"),
    "restored_unconfirmed": ("kvroute_restored_unconfirmed_blocks",
                             "saved blocks restored unconfirmed (no replay reached back)"),
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
    """A worker's subscriber: its state, the last sequence number applied, and counters."""

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
    oversized_events: int = 0
    over_capacity: int = 0
    unreceivable: int = 0
    restored_blocks: int = 0
    restored_unconfirmed: int = 0
    last_event_time: float | None = None
    last_error: str | None = None

    @property
    def serving(self) -> bool:
        """Whether answers may include this worker (it is connected and its state is known)."""
        return self.state.serving

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class SubscriberIndex(IndexWriter, Protocol):
    """What a subscriber needs of its index besides applying events (``PrefixIndex``)."""

    def blocks_held(self, worker: Any) -> int: ...

    def holds_hash(self, worker: Any, block_hash: Any) -> bool: ...

    def restore(self, worker: Any, pieces: Iterable[Holdings]) -> int: ...

    def restore_unconfirmed(self, worker: Any, pieces: Iterable[Holdings],
                            expires: float) -> int: ...


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
    chunk_events: int = 256         # events decoded or applied between two yields to the loop
    # Blocks of index work between two yields to the loop (a block of more than
    # wire.SLICE_TOKENS_PER_BLOCK tokens counts as one per that many): about 0.5 ms of
    # PrefixIndex work. An HTTP answer takes 6 to 10 turns of the loop, and a busy
    # subscriber may take one slice in each: so a flood adds a few ms to an answer, where
    # one 65,536-block store applied whole held the loop ~35 ms (4096 blocks: ~20 ms).
    slice_blocks: int = 1024
    # Live messages ZMQ may hold for kvroute while the subscriber is busy (a replay, a big
    # batch). Bounded so that a publisher cannot grow kvroute's memory: at most rcvhwm
    # messages of at most max_message_bytes each (256 MiB at the defaults, for a publisher
    # that sends nothing but maximum-size frames; real batches are KBs). Nothing is lost
    # by a small queue: when it is full ZMQ stops reading the connection, so the backlog
    # waits in the publisher's send queue (vLLM's holds 100,000 messages), and what the
    # publisher drops past that becomes sequence gaps, which replay recovers. Measured on
    # loopback: the same ~20k messages/s received with 16, 64, 1,000 or unbounded.
    rcvhwm: int = 16
    # Bounds against a hostile or broken publisher (Settings' max_event_message_bytes,
    # max_blocks_per_event, max_blocks_per_worker).
    max_message_bytes: int = 16 * 1024 * 1024
    max_blocks_per_event: int = 65_536
    max_blocks_per_worker: int = 4_194_304
    max_hole_retries: int = 5       # re-asks for holes inside replays, per gap
    # Saved holdings no replay confirmed count like placement guesses this long (seconds).
    unconfirmed_ttl: float = 600.0


class _Disconnected(Exception):
    """The connection dropped while a batch or replay was in progress: abandon it (the
    worker was cleared and will be rebuilt)."""


_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
_POLL_MS = 100
_DROP_GRACE_MS = 200  # replies queued before a replay connection dropped, still surfacing
_MAX_REPLAYED_FINGERPRINTS = 20_000
# A payload up to this size is decoded in one call (every real vLLM batch is far smaller):
# ~10 ms at worst, for one full of malformed events, which decode one by one (~40 ms per
# MiB). A bigger one is decoded chunk_events events at a time, with the loop running
# between chunks; only its envelope is one call (~25 ms for 16 MiB of tiny events).
_DECODE_WHOLE_BYTES = 256 * 1024
# Decoding cannot be cut into bounded pieces: one event, or one envelope, is one call (a
# 65,536-block store: ~30-50 ms). After such a call took _LONG_DECODE or more, the
# subscriber lets the loop run about as long (at most _MAX_PAUSE), because an HTTP answer
# needs several turns of the loop and a flood of big frames would otherwise put one long
# stretch in front of each of them. Real batches decode in well under a millisecond.
_LONG_DECODE = 0.005
_MAX_PAUSE = 0.05


def _fingerprint(payload: bytes) -> int:
    # Payloads carry the step's timestamp, so two engines' batches never share bytes.
    return hash(payload)


class Subscriber:
    """Keeps ``index``'s entries for one worker equal to what that worker's engine holds."""

    def __init__(
        self,
        endpoint: WorkerEndpoint,
        index: SubscriberIndex,
        *,
        ctx: zmq.asyncio.Context | None = None,
        hooks: SubscriberHooks | None = None,
        options: SubscriberOptions | None = None,
        saved: SavedWorker | None = None,
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
        # The SUB socket, its monitor and the task watching it: replaced together when ZMQ
        # gives a connection up (see _reopen_if_given_up).
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        # seq -> payload fingerprint of batches applied from a replay: tells a live duplicate
        # of one of them from a restarted engine's batch with the same seq.
        self._replayed: dict[int, int] = {}
        self._unyielded = 0  # events applied since the last yield to the event loop
        self._unyielded_work = 0  # blocks of index work since then (see slice_blocks)
        # When the live connection dropped without ZMQ scheduling a reconnect (it gives a
        # connection up after a protocol error, e.g. a message over MAXMSGSIZE); None
        # while connected or while ZMQ reconnects by itself.
        self._given_up_at: float | None = None
        # Saved holdings to resume from on the first connection (taken by _resume), and,
        # while its replay runs, the one whose first batch decides what they are worth.
        self._saved = saved
        self._resuming: SavedWorker | None = None
        # Why a resume's saved holdings were refused: "other engine" or "unusable".
        self._refused: str | None = None
        # The payload of the batch at last_seq (None when unknown) and whether a batch is
        # being applied: the index matches last_seq only between batches (save_point).
        self._last_payload: bytes | None = None
        self._applying = False

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and apply until ``stop()``; never raises for wire or peer faults."""
        self._task = asyncio.current_task()
        try:
            try:
                self._open()
            except zmq.ZMQError as exc:
                # An endpoint ZeroMQ will not even try (registration checks the form it
                # accepts, so this is a last line): down for good, said once.
                self.status.last_error = f"ZeroMQ refuses {self.endpoint.endpoint}: {exc}"
                log.error("%s: %s", self.worker, self.status.last_error)
                self._set_state(WorkerState.DOWN)
                return
            await self._main_loop()
        finally:
            await self._close()
            self._stopped.set()

    def _open(self) -> None:
        """A new SUB socket connecting to the endpoint, and a task watching its connection."""
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.options.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, self.options.reconnect_ivl_ms)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, self.options.reconnect_ivl_max_ms)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        monitor = self._monitor = sub.get_monitor_socket(_UP | _DOWN)
        self._watcher = asyncio.create_task(self._watch(monitor),
                                            name=f"kv-monitor-{self.worker}")
        sub.connect(self.endpoint.endpoint)

    async def _close(self) -> None:
        """Close what ``_open`` made (whatever part of it exists)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        sub, monitor = self._sub, self._monitor
        self._sub = self._monitor = None
        if sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            sub.close(0)
        if monitor is not None:
            monitor.close(0)

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
                self._given_up_at = None
                self._connected.set()
                continue
            # ZMQ follows a dropped connection with EVENT_CONNECT_RETRIED at once when it
            # will reconnect by itself. After a protocol error (a message over MAXMSGSIZE)
            # it drops the connection for good, and says nothing more.
            if event == zmq.EVENT_DISCONNECTED:
                self._given_up_at = time.monotonic()
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._given_up_at = None
            if event == zmq.EVENT_DISCONNECTED or not self._connected.is_set():
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

    async def _main_loop(self) -> None:
        idle_since = time.monotonic()
        while not self._stopping.is_set():
            self._working_generation = self._generation
            sub = self._sub
            assert sub is not None
            try:
                if not self._connected.is_set():
                    await self._reopen_if_given_up()
                    await self._wait_or_stop(self._connected.wait(), _POLL_MS / 1000)
                elif self._needs_rebuild:
                    self._needs_rebuild = False
                    await self._drain()
                    saved, self._saved = self._saved, None
                    if saved is not None:
                        await self._resume(saved)
                    else:
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

    async def _reopen_if_given_up(self) -> None:
        """Where ZMQ gave the connection up (see ``_watch``), connect again on a new socket,
        one reconnect interval after the drop: a publisher whose every connection ends in an
        oversized message is retried at that pace, not in a tight loop.

        A new socket, not ``disconnect()`` + ``connect()`` on this one: ZMQ ignores a
        second connect of a SUB to an endpoint it still lists, and ``disconnect()`` drops
        the messages still queued from that connection at once, which aborts the process
        (libzmq 4.3.5, fq.cpp ``!_more``) when a poll had already taken the first frame of
        one of them. Closing the socket is safe whatever it holds."""
        since = self._given_up_at
        if since is None or time.monotonic() - since < self.options.reconnect_ivl_ms / 1000:
            return
        self._given_up_at = None
        self.status.last_error = (
            f"{self.endpoint.endpoint} sent something that made ZMQ drop the connection for "
            f"good (a message over max_message_bytes={self.options.max_message_bytes} does); "
            "connecting again")
        log.warning("%s: %s", self.worker, self.status.last_error)
        await self._close()
        self._open()

    def _check_connection(self) -> None:
        """Called after every await inside a step: a disconnect meanwhile voids the step."""
        if self._generation != self._working_generation:
            raise _Disconnected

    async def _wait_or_stop(self, awaitable: Awaitable[Any], timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(awaitable, timeout)

    async def _drain(self) -> None:
        """Drop live batches queued before the replay that is about to cover them."""
        sub = self._sub
        assert sub is not None
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

    async def _resume(self, saved: SavedWorker) -> None:
        """Learn the engine's state from saved holdings and a replay from the saved seq
        (see the module docstring for what its first batch decides)."""
        self._clear_worker()
        self._degraded = False
        self._set_state(WorkerState.REPLAYING)
        self._resuming = saved
        self._refused = None
        try:
            complete = await self._fill_from(saved.head.seq)
        except _Disconnected:
            if self._resuming is not None:  # not judged yet: try on the next connection
                self._saved = self._resuming
            raise
        finally:
            unjudged, self._resuming = self._resuming, None
        if self._refused is not None:
            log.warning("%s: saved state not used: %s; rebuilding", self.worker,
                        self.status.last_error)
            if self._refused == "other engine":
                self._count("restarts")
            await self._rebuild()
            return
        if unjudged is not None:  # no batch said anything about the saved holdings
            await self._rebuild()
            self._restore_unconfirmed(*self._all_unconfirmed(unjudged))
            self._mark_degraded()  # what is really held may under-report the engine
            return
        if not complete:
            self._mark_degraded()
        self._settle()

    async def _judge_saved(self, start: int, seq: int | None, payload: bytes) -> bool:
        """The first reply of a resume's replay (``seq`` None: the end marker): restore the
        saved holdings as it says; False when they are refused (another engine's)."""
        saved, self._resuming = self._resuming, None
        assert saved is not None
        fingerprint = saved.head.fingerprint
        if seq is None or (seq == start and fingerprint is not None
                           and payload_fingerprint(payload) != fingerprint):
            self.status.last_error = (
                f"no batch at or after the saved seq {start} in the replay" if seq is None
                else f"the batch at the saved seq {start} differs from the saved one")
            self._refused = "other engine"
            return False
        if seq == start and fingerprint is not None:
            try:
                for piece in saved.pieces:  # a piece at a time, with the loop running between
                    self._count("restored_blocks", self.index.restore(self.worker, [piece]))
                    await self._yield_to_loop()
            except ValueError as exc:  # a sound blob of unsound holdings: a bug somewhere
                self.status.last_error = f"saved holdings rejected by the index: {exc}"
                self._refused = "unusable"
                return False
            self.status.last_seq = start
            self._last_payload = payload
            self._remember_replayed(start, payload)
            if saved.unconfirmed:  # still unconfirmed, for the time they had left
                self._restore_unconfirmed(saved.unconfirmed,
                                          saved.unconfirmed_left(time.time()))
            if saved.head.degraded:
                self._mark_degraded()
            log.info("%s: resumed %d saved blocks at seq %d", self.worker,
                     self.status.restored_blocks, start)
            return True
        self._lost_history(start, seq)
        self._restore_unconfirmed(*self._all_unconfirmed(saved))
        return True

    def _all_unconfirmed(self, saved: SavedWorker) -> tuple[list[Holdings], float]:
        """Saved holdings no replay confirmed, with how long they count: what was held
        gets a full ``unconfirmed_ttl`` from now (so all of it does, one expiry per worker);
        what was unconfirmed already, alone, keeps the time it had left."""
        if not saved.head.blocks:
            return saved.unconfirmed, saved.unconfirmed_left(time.time())
        return [*saved.pieces, *saved.unconfirmed], self.options.unconfirmed_ttl

    def _restore_unconfirmed(self, pieces: list[Holdings], lasting: float) -> None:
        if not pieces or lasting <= 0:
            return
        expires = time.monotonic() + lasting
        try:
            kept = self.index.restore_unconfirmed(self.worker, pieces, expires)
        except ValueError as exc:
            log.warning("%s: saved holdings rejected by the index: %s", self.worker, exc)
            return
        self._count("restored_unconfirmed", kept)
        log.warning("%s: %d saved blocks could not be confirmed by a replay; they count "
                    "as guesses for %.0f s", self.worker, kept, lasting)

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
            dealer.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
            dropped = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                dealer.connect(self.endpoint.replay_endpoint)
                await dealer.send_multipart([b"", encode_seq(start)])
                return await self._consume_replay(dealer, dropped, start)
            except TimeoutError:
                self.status.last_error = (
                    f"replay from {self.endpoint.replay_endpoint} timed out "
                    f"(attempt {attempt + 1}/{self.options.replay_retries})"
                )
            finally:
                with contextlib.suppress(zmq.ZMQError):
                    dealer.disable_monitor()
                dropped.close(0)
                dealer.close(0)
            if self._stopping.is_set():
                break
            await asyncio.sleep(delay)
            self._check_connection()
            delay *= 2
        self._count("replay_failures")
        log.warning("%s: %s", self.worker, self.status.last_error)
        return "failed"

    async def _consume_replay(self, dealer: zmq.asyncio.Socket, dropped: zmq.asyncio.Socket,
                              start: int) -> str:
        first = True
        while True:
            frames = await self._next_reply(dealer, dropped)
            if frames is None:
                return self._replay_cut(start)
            try:
                reply = decode_replay_frame(frames)
            except WireError as exc:
                self._malformed(f"replay: {exc}")
                return "hole"
            if first and self._resuming is not None:
                first = False
                if not await self._judge_saved(start, reply.seq, reply.payload):
                    return "failed"  # refused (the end marker first always is)
                if self.status.last_seq == reply.seq:
                    continue  # restored: the saved holdings end with this batch
                await self._apply(reply.seq, reply.payload, replayed=True)
                continue
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

    async def _next_reply(self, dealer: zmq.asyncio.Socket,
                          dropped: zmq.asyncio.Socket) -> list[bytes] | None:
        """The next reply's frames; None once the connection has dropped (``dropped`` is its
        EVENT_DISCONNECTED monitor) and every reply it delivered has been read. Raises
        TimeoutError after ``replay_timeout`` without either."""
        poller: zmq.asyncio.Poller | None = None
        while True:
            # Replies delivered before a drop stay queued, and ZMQ makes them readable
            # before it reports the drop: read them all first.
            if await dealer.poll(0, zmq.POLLIN):
                frames = await dealer.recv_multipart()
                self._check_connection()
                return frames
            if await dropped.poll(0, zmq.POLLIN):
                # The monitor's report travels on its own socket and can overtake replies
                # already queued from that connection: give them a moment to surface.
                if await dealer.poll(_DROP_GRACE_MS, zmq.POLLIN):
                    continue  # read above
                return None
            if poller is None:
                poller = zmq.asyncio.Poller()
                poller.register(dealer, zmq.POLLIN)
                poller.register(dropped, zmq.POLLIN)
            ready = await poller.poll(int(self.options.replay_timeout * 1000))
            self._check_connection()
            if not ready:
                raise TimeoutError

    def _replay_cut(self, start: int) -> str:
        """The replay connection dropped mid-answer. ZMQ drops one that sends a frame over
        max_message_bytes, and the ROUTER cannot send the rest to a new connection, so the
        batch after the last one received (the one such a frame held) cannot be had. Like a
        gap nothing can fill it clears the worker (the batch may have removed blocks: holding
        them would over-report); the replay is then asked again from the batch after it."""
        last = self.status.last_seq
        lost = start if last is None else max(start, last + 1)
        self._count("unreceivable")
        self._give_up(f"replayed batch {lost} could not be received: the replay connection "
                      "dropped (ZMQ drops one that sends a frame over max_message_bytes="
                      f"{self.options.max_message_bytes})")
        self.status.last_seq = lost
        self._last_payload = None
        return "hole"

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
        self._applying = True
        try:
            await self._apply_batch(seq, payload, replayed)
        finally:
            self._applying = False
        if self.status.last_seq == seq:
            self._last_payload = payload

    async def _apply_batch(self, seq: int, payload: bytes, replayed: bool) -> None:
        status = self.status
        self._unyielded += 1  # even an empty or garbage batch is work
        if replayed:
            self._remember_replayed(seq, payload)
        lazily = len(payload) > _DECODE_WHOLE_BYTES
        started = time.perf_counter()
        try:
            batch = decode_envelope(payload) if lazily else decode_batch(payload)
        except WireError as exc:
            self._malformed(str(exc))
            status.last_seq = seq
            took = time.perf_counter() - started  # garbage can be a long read, too
            if took >= _LONG_DECODE:
                await self._pause(took)
            return
        if (batch.data_parallel_rank is not None
                and batch.data_parallel_rank != self.endpoint.dp_rank):
            self._count("rank_mismatches")
            if not self._warned_rank:
                self._warned_rank = True
                log.warning("%s: payload says data-parallel rank %s; keeping the endpoint's",
                            self.worker, batch.data_parallel_rank)
        blocks = n_events = 0
        exact_again = False
        chunk = self.options.chunk_events
        took = time.perf_counter() - started
        if lazily or took >= _LONG_DECODE:  # a chunk's decoding is another stretch
            await self._pause(took)
        step = chunk if lazily else max(1, len(batch.events))
        for start in range(0, len(batch.events), step):
            if lazily:  # decoded a chunk at a time, with the loop running in between
                started = time.perf_counter()
                events = decode_events(batch.events[start:start + step], batch)
                await self._pause(time.perf_counter() - started)
            else:
                events = batch.events
            n_events += len(events)
            for event in coalesced(events):
                # Counted across batches, so that a replay of thousands of small batches
                # yields too, whether or not zmq's own awaits happen to.
                self._unyielded += 1
                if self._unyielded >= chunk:
                    await self._yield_to_loop()
                if isinstance(event, BlockStored) and self._over_a_cap(seq, event):
                    exact_again = False  # only a clear after the skip makes the worker exact
                    continue
                try:
                    blocks += await self._apply_event(event)
                except _Disconnected:
                    raise
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

    async def _apply_event(self, event: Event) -> int:
        """Apply one event; returns the blocks it stored or removed. An event of more work
        than ``slice_blocks`` goes in slices (``wire.slices``: the index ends up exactly as
        after one call), and the loop runs before any slice that would take the work done
        since its last turn past ``slice_blocks``. A ``ValueError`` can only come from the
        first slice, before anything changed."""
        budget = self.options.slice_blocks
        work = self._work(event)
        if work <= budget:  # nearly every event: one call
            if self._unyielded_work + work > budget:
                await self._yield_to_loop()
            self._unyielded_work += work
            return apply_event(self.index, self.worker, event)
        assert not isinstance(event, AllBlocksCleared)  # a clear is one call, whatever it costs
        # Decoding this event was one stretch already; slices() begins with another (a pass
        # over its tokens): let the loop run between the two.
        await self._yield_to_loop()
        applied = 0
        for piece in slices(event, budget, self._holds):
            work = self._work(piece)
            if self._unyielded_work and self._unyielded_work + work > budget:
                await self._yield_to_loop()
            self._unyielded_work += work
            applied += apply_event(self.index, self.worker, piece)
        return applied

    def _work(self, event: Event) -> int:
        """Blocks of index work ``event`` costs (see ``SubscriberOptions.slice_blocks``)."""
        if isinstance(event, AllBlocksCleared):
            return min(self.index.blocks_held(self.worker), self.options.slice_blocks)
        tokens = len(event.token_ids) if isinstance(event, BlockStored) else 0
        return max(len(event.block_hashes), tokens // SLICE_TOKENS_PER_BLOCK)

    def _holds(self, block_hash: Hash) -> bool:
        return self.index.holds_hash(self.worker, block_hash)

    async def _yield_to_loop(self) -> None:
        """Let the loop run (queries, other workers); a disconnect meanwhile voids the step."""
        self._unyielded = 0
        self._unyielded_work = 0
        await asyncio.sleep(0)
        self._check_connection()

    async def _pause(self, took: float) -> None:
        """``_yield_to_loop`` after decoding that took ``took`` seconds in one call: when
        that was long, the loop gets about as long again (see ``_LONG_DECODE``)."""
        self._unyielded = 0
        self._unyielded_work = 0
        await asyncio.sleep(min(took, _MAX_PAUSE) if took >= _LONG_DECODE else 0)
        self._check_connection()

    def _over_a_cap(self, seq: int, event: BlockStored) -> bool:
        """Whether a store is refused for a cap. A refused store is counted and skipped,
        and the worker turns degraded: it may now under-report. Removals are never refused:
        a skipped one would over-report."""
        options = self.options
        blocks = len(event.block_hashes)
        if blocks > options.max_blocks_per_event:
            self._skip_store("oversized_events", f"seq {seq}: a BlockStored of {blocks} blocks "
                             f"is over max_blocks_per_event ({options.max_blocks_per_event})")
            return True
        if not event.token_ids:
            return False  # an offload adds a medium to blocks the worker holds, never a block
        # Every block counts as new, also one stored again (that adds a reference, not a
        # block): telling them apart would cost a lookup per block.
        held = self.index.blocks_held(self.worker)
        if held + blocks > options.max_blocks_per_worker:
            self._skip_store("over_capacity", f"seq {seq}: storing {blocks} blocks would take "
                             f"the worker past max_blocks_per_worker "
                             f"({options.max_blocks_per_worker}); it holds {held}")
            return True
        return False

    def _skip_store(self, counter: str, reason: str) -> None:
        self._count(counter)
        self.status.last_error = f"{reason}; skipped"
        if not self._degraded:  # logged once per spell, however many stores follow
            log.warning("%s: %s; skipped, the worker is degraded", self.worker, reason)
            self._mark_degraded()

    # --- saving -------------------------------------------------------------------------------

    def save_point(self) -> tuple[int, int | None, bool] | None:
        """(last applied seq, fingerprint of its payload, degraded) when the index holds
        exactly what the batches up to that seq say and answers may use it; None in the
        middle of a batch, or while connecting, replaying or down. Capture the worker's
        holdings in the same step of the loop as this call."""
        if self._applying or not self.status.state.serving or self.status.last_seq is None:
            return None
        payload = self._last_payload
        return (self.status.last_seq, None if payload is None else payload_fingerprint(payload),
                self._degraded)

    # --- bookkeeping --------------------------------------------------------------------------

    def _remember_replayed(self, seq: int, payload: bytes) -> None:
        if len(self._replayed) >= _MAX_REPLAYED_FINGERPRINTS:
            del self._replayed[next(iter(self._replayed))]  # the oldest
        self._replayed[seq] = _fingerprint(payload)

    def _clear_worker(self) -> None:
        self.index.clear_worker(self.worker)
        self.status.last_seq = None
        self._last_payload = None
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
