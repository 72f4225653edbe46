"""One subscriber per worker endpoint: live KV events in, index updates out, never diverging.

Sequence tracking (docs/decisions.md; each seq is classified by ``sequence.classify``):

- ``last_seq`` is the last APPLIED seq. The next live batch must be ``last_seq + 1``.
- A live seq above that is a gap: the missing batches are fetched from the replay ROUTER
  (``replay_request``; after a timeout, bounded retries with backoff ask again from after
  the last batch applied). A replay must be contiguous; at the first hole the rest of it is
  dropped and asked for again from the hole.
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
  (a gap is otherwise only visible when the next batch arrives). Each check that finds
  nothing doubles the next quiet spell, up to ``IDLE_CHECK_BACKOFF`` times, until a live
  batch arrives; a quiet worker's task sleeps until its next check is due.
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
- Applying a batch holds the event loop for bounded pieces of work, and a store over a cap
  is skipped (``app.batch_apply``); a skipped store turns the worker degraded.

Ownership: the subscriber is the only writer of its worker's entries in the index, through
its ``BatchApplier``, on the event loop. A disconnect while the loop runs between two pieces
of work abandons the batch (the worker was cleared, and will be rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterable
from typing import Any, Protocol

import zmq
import zmq.asyncio

from kvroute.app.batch_apply import Abandoned, BatchApplier
from kvroute.app.fleet_pacing import FleetPacing
from kvroute.app.live_connection import LiveConnection
from kvroute.app.replay_request import ReplayChannel, ReplayRequest
from kvroute.app.saved_state import SavedWorker, payload_fingerprint
from kvroute.app.sequence import Kind, Verdict, classify
from kvroute.app.subscription import (
    SubscriberHooks,
    SubscriberOptions,
    WorkerEndpoint,
    WorkerState,
    WorkerStatus,
)
from kvroute.app.wire import IndexWriter, WireError, decode_replay_frame, decode_seq
from kvroute.index.holdings import Holdings

log = logging.getLogger(__name__)


class SubscriberIndex(IndexWriter, Protocol):
    """What a subscriber needs of its index besides applying events (``PrefixIndex``)."""

    def blocks_held(self, worker: Any) -> int: ...

    def holds_hash(self, worker: Any, block_hash: Any) -> bool: ...

    def restore(self, worker: Any, pieces: Iterable[Holdings]) -> int: ...

    def restore_unconfirmed(self, worker: Any, pieces: Iterable[Holdings],
                            expires: float) -> int: ...


class _Disconnected(Abandoned):
    """The connection dropped while a batch or replay was in progress: abandon it (the
    worker was cleared and will be rebuilt)."""


_POLL_MS = 100
# Quiet spells between idle checks that find nothing grow to at most this many idle_checks.
IDLE_CHECK_BACKOFF = 8
_MAX_REPLAYED_FINGERPRINTS = 20_000


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
        pacing: FleetPacing | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.worker = endpoint.worker
        self.index = index
        self.hooks = hooks or SubscriberHooks()
        self.options = options or SubscriberOptions()
        self.status = WorkerStatus()
        self._ctx = ctx or zmq.asyncio.Context.instance()
        # Shared with the fleet's other subscribers (replay slots, idle-check rate).
        self._pacing = pacing or FleetPacing()
        self._replay_channel = (
            None if endpoint.replay_endpoint is None else
            ReplayChannel(self._ctx, endpoint.replay_endpoint,
                          max_message_bytes=self.options.max_message_bytes))
        self._applier = BatchApplier(index, self.worker, self.options,
                                     check=self._check_connection, refused=self._store_refused)
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._live = LiveConnection(
            self._ctx, endpoint.endpoint, endpoint.topic, rcvhwm=self.options.rcvhwm,
            max_message_bytes=self.options.max_message_bytes,
            reconnect_ivl_ms=self.options.reconnect_ivl_ms,
            reconnect_ivl_max_ms=self.options.reconnect_ivl_max_ms, went_down=self._went_down)
        self._needs_rebuild = True      # first connection: learn what is already cached
        # Degraded only because the rebuild's replay did not finish: idle checks retry it.
        self._unfinished_rebuild = False
        self._generation = 0            # bumped on every disconnect
        self._working_generation = 0    # the generation the current step started in
        self._last_live: int | None = None
        self._degraded = False
        self._warned_rank = False
        self._task: asyncio.Task[None] | None = None
        # seq -> payload fingerprint of batches applied from a replay: tells a live duplicate
        # of one of them from a restarted engine's batch with the same seq.
        self._replayed: dict[int, int] = {}
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
        # The poll of a quiet wait for a live batch (`_wait_for_live`), while one runs.
        self._waiting: asyncio.Future[int] | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and apply until ``stop()``; never raises for wire or peer faults."""
        self._task = asyncio.current_task()
        try:
            # Opening costs a few sockets: a fleet added at once opens in bounded pieces.
            await self._pacing.turn()
            try:
                self._live.open()
            except zmq.ZMQError as exc:
                # An endpoint ZeroMQ will not even try (registration checks the form it
                # accepts, so this is a last line): down for good, said once.
                self.status.last_error = f"ZeroMQ refuses {self.endpoint.endpoint}: {exc}"
                log.error("%s: %s", self.worker, self.status.last_error)
                self._set_state(WorkerState.DOWN)
                return
            await self._main_loop()
        finally:
            try:
                await self._pacing.turn()  # and closing them, in bounded pieces too
            finally:
                await self._live.close()
                if self._replay_channel is not None:
                    self._replay_channel.close()
                self._stopped.set()

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask ``run()`` to return and wait for it (sockets closed when this returns)."""
        self._stopping.set()
        self._wake()
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

    def _went_down(self, was_connected: bool) -> None:
        """The live connection dropped, or could not be made: hold nothing until rebuilt."""
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
        self._wake()  # a quiet wait would otherwise last until the next idle check

    async def _main_loop(self) -> None:
        idle_since = time.monotonic()
        backoff = 1  # idle checks in a row that found nothing new, doubled (see _idle_check)
        quiet_for = self._pacing.idle_after(self.options.idle_check)
        while not self._stopping.is_set():
            self._working_generation = self._generation
            sub = self._live.socket
            try:
                if not self._live.connected.is_set():
                    await self._reopen_if_given_up()
                    await self._wait_or_stop(self._live.connected.wait(), _POLL_MS / 1000)
                elif self._needs_rebuild:
                    self._needs_rebuild = False
                    await self._drain()
                    saved, self._saved = self._saved, None
                    if saved is not None:
                        await self._resume(saved)
                    else:
                        await self._rebuild()
                    idle_since = time.monotonic()
                elif await self._wait_for_live(idle_since + quiet_for - time.monotonic()):
                    frames = await sub.recv_multipart()
                    idle_since = time.monotonic()
                    if backoff > 1:
                        backoff = 1
                        quiet_for = self._pacing.idle_after(self.options.idle_check)
                    self._check_connection()
                    await self._on_live(frames)
                elif time.monotonic() - idle_since >= quiet_for:
                    if self.status.last_seq is not None or self._unfinished_rebuild:
                        await self._pacing.idle_check_slot()
                        self._check_connection()
                        found = await self._idle_check()
                        backoff = 1 if found else min(2 * backoff, IDLE_CHECK_BACKOFF)
                    quiet_for = self._pacing.idle_after(self.options.idle_check * backoff)
                    idle_since = time.monotonic()
            except _Disconnected:
                continue
            except Exception as exc:  # never let a bug end the subscription silently
                log.exception("%s: unexpected error", self.worker)
                self.status.last_error = f"internal error: {exc!r}"
                await asyncio.sleep(_POLL_MS / 1000)

    async def _wait_for_live(self, seconds: float) -> bool:
        """Whether a live batch arrived within `seconds` (at least 10 ms). A quiet worker
        sleeps until its next idle check is due, not a poll interval: a quiet fleet of a
        thousand costs its event loop a wake-up per idle check, not a thousand a second.
        `_wake` (a stop, a dropped connection) ends the wait at once, with False."""
        waiting = self._live.socket.poll(max(_POLL_MS // 10, int(seconds * 1000) + 1),
                                         zmq.POLLIN)
        self._waiting = waiting
        try:
            return bool(await waiting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the task itself is cancelled, not only this wait
            return False
        finally:
            self._waiting = None

    def _wake(self) -> None:
        """End a quiet wait now (it then returns False), so the loop looks at its state."""
        waiting = self._waiting
        if waiting is not None and not waiting.done():
            waiting.cancel()

    async def _idle_check(self) -> bool:
        """Pick up dropped tail batches; after a rebuild whose replay did not finish, this
        is the rebuild's retry: when the rest of the history arrives whole (and nothing
        else turned the worker degraded meanwhile), the worker is exact again.

        Returns whether it found anything: a check that found nothing doubles the quiet
        spell before the next one (up to IDLE_CHECK_BACKOFF times `idle_check`) until a
        live batch arrives. Tail batches are lost at the end of a burst, so right after
        traffic a worker is checked at the set pace, and an idle fleet is seldom asked."""
        last, batches = self.status.last_seq, self.status.batches
        unfinished, marks = self._unfinished_rebuild, self.status.degraded_count
        complete = await self._fill_from(0 if last is None else last + 1)
        if unfinished and complete and self.status.degraded_count == marks:
            self._unfinished_rebuild = False
            self._degraded = False
            self._settle()
            log.info("%s: the replay finished on a retry; exact again", self.worker)
            return True
        return self.status.batches != batches or self.status.last_seq != last

    async def _reopen_if_given_up(self) -> None:
        if await self._live.reopen_if_given_up():
            self.status.last_error = (
                f"{self.endpoint.endpoint} sent something that made ZMQ drop the connection "
                f"for good (a message over max_message_bytes={self.options.max_message_bytes}"
                " does); connecting again on a new socket")
            log.warning("%s: %s", self.worker, self.status.last_error)

    def _check_connection(self) -> None:
        """Called after every await inside a step: a disconnect meanwhile voids the step."""
        if self._generation != self._working_generation:
            raise _Disconnected

    async def _wait_or_stop(self, awaitable: Awaitable[Any], timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(awaitable, timeout)

    async def _drain(self) -> None:
        """Drop live batches queued before the replay that is about to cover them."""
        sub = self._live.socket
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
        self._unfinished_rebuild = False
        self._set_state(WorkerState.REPLAYING)
        if self.endpoint.replay_endpoint is not None:
            if not await self._fill_from(0):
                self._mark_degraded()  # the engine may hold blocks we could not learn
                self._unfinished_rebuild = True
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
                    await self._applier.yield_to_loop()
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
        """One request, retried after timeouts. Returns "complete", "hole" (ask again from
        last_seq + 1) or "failed"."""
        endpoint = self.endpoint.replay_endpoint
        assert endpoint is not None
        self._count("replays")
        delay = self.options.retry_backoff
        channel = self._replay_channel
        assert channel is not None
        for attempt in range(self.options.replay_retries):
            deadline = self.options.replay_deadline
            asked_at = time.monotonic()
            try:
                # A slot first (the fleet's bound on replays at once); the deadline covers
                # the whole answer, so one that trickles in forever cannot keep the worker
                # replaying: it is asked again, and after the last attempt given up.
                async with self._pacing.replay_slot(), asyncio.timeout(deadline), \
                        ReplayRequest(channel, start,
                                      timeout=self.options.replay_timeout) as request:
                    return await self._consume_replay(request)
            except TimeoutError:
                how = (f"did not finish within {deadline:g} s"
                       if time.monotonic() - asked_at >= deadline else "timed out")
                self.status.last_error = (f"replay from {endpoint} {how} "
                                          f"(attempt {attempt + 1}/{self.options.replay_retries})")
            if self._stopping.is_set():
                break
            await asyncio.sleep(delay)
            self._check_connection()
            delay *= 2
            start = self._resume_point(start)
        self._count("replay_failures")
        log.warning("%s: %s", self.worker, self.status.last_error)
        return "failed"

    def _resume_point(self, start: int) -> int:
        """Where a retry after a timeout asks from: after what the timed-out answer already
        applied. Asking from ``start`` again would re-send all of it, and once the buffer has
        moved past ``start`` (a long replay of a busy engine) would read as history lost."""
        last = self.status.last_seq
        if self._resuming is not None or last is None or last < start:
            return start  # nothing of this answer applied yet
        return last + 1

    async def _consume_replay(self, request: ReplayRequest) -> str:
        start = request.start
        first = True
        while True:
            frames = await request.next_frames()
            self._check_connection()
            if frames is None:
                return self._replay_cut(start)
            try:
                reply = decode_replay_frame(frames)
            except WireError as exc:
                self._malformed(f"replay: {exc}")
                return "hole"
            if reply.seq is None:
                request.finished()  # the answer is whole: its socket can serve the next
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
        if replayed:
            self._remember_replayed(seq, payload)
        outcome = await self._applier.apply(seq, payload)
        status.last_seq = seq
        if outcome.garbage is not None:
            self._malformed(outcome.garbage)
            return
        if outcome.failed is not None:
            # A bug, not bad input: the worker's entries may be half-updated. Hold nothing
            # rather than something wrong, and carry on with the stream.
            self._give_up(outcome.failed)
            status.last_seq = seq
            return
        rank = outcome.data_parallel_rank
        if rank is not None and rank != self.endpoint.dp_rank:
            self._count("rank_mismatches")
            if not self._warned_rank:
                self._warned_rank = True
                log.warning("%s: payload says data-parallel rank %s; keeping the endpoint's",
                            self.worker, rank)
        if outcome.rejected is not None:
            status.last_error = outcome.rejected
        status.last_event_time = time.time()
        self._count("batches")
        self._count("events", outcome.events)
        self._count("blocks", outcome.blocks)
        self._count("malformed", outcome.malformed)
        self._count("unknown", outcome.unknown)
        if outcome.exact_again and self._degraded:
            self._degraded = False
        if status.state.serving:
            self._settle()

    def _store_refused(self, counter: str, reason: str) -> None:
        """A store the applier refused for a cap: the worker may now under-report."""
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
