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
- Resume from saved holdings, and every replay (rebuild, gap, idle check): see
  ``app.ingest.replay``.
- When the live stream has been quiet for ``idle_check`` seconds, a replay from
  ``last_seq + 1`` picks up batches whose live copies were dropped at the end of a burst
  (a gap is otherwise only visible when the next batch arrives). Each check that finds
  nothing doubles the next quiet spell, up to ``IDLE_CHECK_BACKOFF`` times, until a live
  batch arrives; a quiet worker's task sleeps until its next check is due. A worker that
  has had no batch yet has no tail to check, and its quiet spells double all the same.
- Except right after a rebuild or resume: its first check comes ``SUBSCRIBE_SETTLE``
  seconds after it (sooner if ``idle_check`` is), with or without a batch. A PUB socket
  drops what it sends before the subscription has reached it, and the subscription
  travels on its own after the handshake: batches sent between the rebuild's replay and
  its arrival reach neither, and on an engine that then goes quiet nothing else reveals
  them. A live batch makes that check unneeded: whatever the subscription missed before it
  shows as a gap.
- A due check waits for its place under the fleet's rate bound (``FleetPacing.ask_check``)
  while the worker still takes live batches; a batch heard or a stop asked for meanwhile
  gives the place up. (A worker waiting for its place used to stop taking batches, and a
  stop waited for it: after a hundred instances were added, their settle checks queued for
  their places, the workers taking no batch meanwhile, and removing them waited for those.)
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
  is skipped (``app.ingest.apply``); a skipped store turns the worker degraded.

Ownership: the subscriber owns the worker's live connection, its ``WorkerLedger`` (status,
and the one way batches reach the worker's entries: ``app.ingest.ledger``) and its
``Replayer`` (``app.ingest.replay``), which shares the ledger; all three run on the
subscriber's task. A disconnect while the loop runs between two pieces of work abandons the
batch (the worker was cleared, and will be rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Awaitable
from typing import Any

import zmq

from kvroute.app.ingest.ledger import SubscriberIndex, WorkerLedger, weakly
from kvroute.app.ingest.live_connection import LiveConnection
from kvroute.app.ingest.pacing import FleetPacing
from kvroute.app.ingest.replay import Disconnected, Replayer
from kvroute.app.ingest.sequence import Kind, Verdict, classify, is_next
from kvroute.app.ingest.wire import Payload, WireError, decode_seq
from kvroute.app.state.format import SavedWorker
from kvroute.app.tasks import cancel_and_wait
from kvroute.app.workers import (
    SubscriberHooks,
    SubscriberOptions,
    WorkerEndpoint,
    WorkerState,
    WorkerStatus,
)

__all__ = ["IDLE_CHECK_BACKOFF", "SUBSCRIBE_SETTLE", "Subscriber", "SubscriberIndex"]

log = logging.getLogger(__name__)


_POLL_MS = 100
# Backoff between attempts to open a worker's sockets while the process has no room.
_OPEN_RETRY_FIRST = 0.5
_OPEN_RETRY_MAX = 30.0
_MESSAGES_PER_WAKEUP = 256
# Quiet spells between idle checks that find nothing grow to at most this many idle_checks.
IDLE_CHECK_BACKOFF = 8
# Seconds from the end of a rebuild to its check for batches the subscription missed on its
# way to the publisher (module docstring): well past that trip even on a loaded machine.
SUBSCRIBE_SETTLE = 1.0
# Seconds a worker waiting for its check's place sleeps at most: the place's coming wakes
# it (a thousand workers queued at start-up once woke every second or so for nothing).
_LONGEST_WAIT = 60.0


def _give_up(check: asyncio.Future[None] | None) -> None:
    """Give up a place in the fleet's idle-check queue (`FleetPacing.ask_check`), if any:
    it takes no slot then. (Once given, cancelling it does nothing.)"""
    if check is not None:
        check.cancel()


class Subscriber:
    """Keeps ``index``'s entries for one worker equal to what that worker's engine holds."""

    def __init__(
        self,
        endpoint: WorkerEndpoint,
        index: SubscriberIndex,
        *,
        ctx: zmq.Context | None = None,
        hooks: SubscriberHooks | None = None,
        options: SubscriberOptions | None = None,
        saved: SavedWorker | None = None,
        pacing: FleetPacing | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.worker = endpoint.worker
        self.index = index
        self.options = options = options or SubscriberOptions()
        self._ctx = ctx or zmq.Context.instance()
        # Shared with the fleet's other subscribers (replay slots, idle-check rate).
        self._pacing = pacing or FleetPacing()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        # The parts it owns call it back through weak references (``ledger.weakly``).
        check = weakly(self._check_connection)
        self._ledger = WorkerLedger(endpoint, index, options, hooks or SubscriberHooks(),
                                    check=check)
        self._replayer = Replayer(self._ledger, self._ctx, self._pacing, saved=saved,
                                  stopping=self._stopping, check=check)
        self._live = LiveConnection(
            self._ctx, endpoint.endpoint, endpoint.topic, rcvhwm=options.rcvhwm,
            max_message_bytes=options.max_message_bytes,
            reconnect_ivl_ms=options.reconnect_ivl_ms,
            reconnect_ivl_max_ms=options.reconnect_ivl_max_ms,
            went_down=weakly(self._went_down))
        self._needs_rebuild = True      # first connection: learn what is already cached
        self._generation = 0            # bumped on every disconnect
        self._working_generation = 0    # the generation the current step started in
        self._last_live: int | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def status(self) -> WorkerStatus:
        """The worker's state and counters (its ledger's)."""
        return self._ledger.status

    def save_point(self) -> tuple[int, int | None, bool] | None:
        """``WorkerLedger.save_point``: where the index matches the stream exactly."""
        return self._ledger.save_point()

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and apply until ``stop()``; never raises for wire or peer faults."""
        self._task = asyncio.current_task()
        try:
            if not await self._open_live():
                return
            await self._main_loop()
        finally:
            try:
                # Closing the sockets in bounded pieces too: nothing is awaited between
                # the turn and the closing, so the closing is inside the turn's budget.
                await self._pacing.turn()
            finally:
                self._live.close()
                self._replayer.close()
                self._stopped.set()

    async def _open_live(self) -> bool:
        """Open the live connection's sockets; whether it is open (not: stopped, or an
        endpoint ZeroMQ will not even try). Opening costs a few sockets: a fleet added at
        once opens in bounded pieces. Out of sockets or open files (EMFILE: the process's
        open-file limit or the context's socket limit, reached by sockets that other
        workers were still closing), the worker is down with the reason and tries again
        after a backoff: the room comes back, so it is no reason to give up for good."""
        delay = _OPEN_RETRY_FIRST
        while not self._stopping.is_set():
            await self._pacing.turn()
            try:
                self._live.open()
                return True
            except zmq.ZMQError as exc:
                self._live.close()  # whatever part of it opened
                self.status.last_error = f"ZeroMQ refuses {self.endpoint.endpoint}: {exc}"
                self._ledger.set_state(WorkerState.DOWN)
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                    # An endpoint ZeroMQ will not even try (registration checks the form
                    # it accepts, so this is a last line): down for good, said once.
                    log.error("%s: %s", self.worker, self.status.last_error)
                    return False
                self.status.last_error += f"; retrying in {delay:g} s"
                log.warning("%s: %s", self.worker, self.status.last_error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(_OPEN_RETRY_MAX, 2 * delay)
        return False

    def ask_to_stop(self) -> None:
        """Ask ``run()`` to return, without waiting: its task wakes in a later pass of the
        loop (so a remover can ask its subscribers one turn at a time, and their first
        steps after waking do not all land in one pass)."""
        self._stopping.set()
        self._wake()

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask ``run()`` to return and wait for it (sockets closed when this returns)."""
        self.ask_to_stop()
        if self._task is None or self._stopped.is_set():
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped.wait()), timeout)
        except TimeoutError:
            # Stuck in a replay timeout: cancel; run()'s finally still closes the sockets.
            await cancel_and_wait(self._task)

    # --- connection state ---------------------------------------------------------------------

    def _went_down(self, was_connected: bool) -> None:
        """The live connection dropped, or could not be made: hold nothing until rebuilt."""
        ledger = self._ledger
        if was_connected:
            ledger.count("disconnects")
        if self.status.state != WorkerState.DOWN:
            self.status.last_error = (
                f"disconnected from {self.endpoint.endpoint}" if was_connected
                else f"cannot connect to {self.endpoint.endpoint}"
            )
        self._generation += 1
        ledger.clear()
        self._needs_rebuild = True
        ledger.set_state(WorkerState.DOWN)
        self._wake()  # a quiet wait would otherwise last until the next idle check

    async def _main_loop(self) -> None:
        idle_since = time.monotonic()
        backoff = 1  # idle checks in a row that found nothing new, doubled (see _idle_check)
        quiet_for = self._pacing.idle_after(self.options.idle_check)
        subscribing = False  # the next check is a rebuild's first (see SUBSCRIBE_SETTLE)
        check: asyncio.Future[None] | None = None  # a place in the fleet's check queue
        try:
            while not self._stopping.is_set():
                self._working_generation = self._generation
                try:
                    if not self._live.connected.is_set():
                        self._reopen_if_given_up()
                        await self._wait_or_stop(self._live.connected.wait(), _POLL_MS / 1000)
                    elif self._needs_rebuild:
                        # The rebuild starts in a turn of the fleet's: the connections of a
                        # hundred instances added at once come up together, and their
                        # subscribers, all woken in one pass, each began a rebuild there (a
                        # drain, a replay request): passes of several milliseconds.
                        _give_up(check)
                        check = None
                        await self._pacing.turn()
                        if self._stopping.is_set() or not self._live.connected.is_set():
                            continue
                        self._needs_rebuild = False
                        self._drain()
                        await self._replayer.start_over()
                        idle_since = time.monotonic()
                        backoff, subscribing = 1, True
                        quiet_for = self._pacing.idle_after(
                            min(self.options.idle_check, SUBSCRIBE_SETTLE))
                    elif check is not None and check.done():
                        check = None
                        self._check_connection()
                        found = await self._replayer.idle_check()
                        subscribing = False
                        backoff = 1 if found else min(2 * backoff, IDLE_CHECK_BACKOFF)
                        quiet_for = self._pacing.idle_after(self.options.idle_check * backoff)
                        idle_since = time.monotonic()
                    elif (frames := self._live.queued()) is not None or \
                            await self._wait_for_live(
                                _LONGEST_WAIT if check is not None  # woken when its place comes
                                else idle_since + quiet_for - time.monotonic()):
                        # A batch heard: not quiet, and the subscription has reached the
                        # publisher (whatever it missed before is a gap now): no check due.
                        _give_up(check)
                        check, subscribing = None, False
                        idle_since = time.monotonic()
                        if backoff > 1:
                            backoff = 1
                            quiet_for = self._pacing.idle_after(self.options.idle_check)
                        # Every message queued, up to a bound, in this wake-up: the applier
                        # yields between bounded pieces of work all the same. The common
                        # ones (the next batch, plain, applied whole) are taken in compiled
                        # calls when the applier has them; each other one goes by _on_live.
                        left = _MESSAGES_PER_WAKEUP
                        while left > 0:
                            if frames is None and self._ledger.applier.drains:
                                self._check_connection()
                                left, frames, rest, empty = self._drain_live(left)
                                if rest is not None:
                                    await rest
                                    continue
                                if empty:
                                    break
                            frames = frames or self._live.queued()
                            if frames is None:
                                break
                            left -= 1
                            self._check_connection()
                            rest = self._on_live(frames)
                            if rest is not None:
                                await rest
                            frames = None
                    elif check is None and time.monotonic() - idle_since >= quiet_for:
                        if (self.status.last_seq is not None or self._replayer.unfinished_rebuild
                                or subscribing):
                            # Live batches are still taken while it waits for its place.
                            check = self._pacing.ask_check()
                            check.add_done_callback(self._check_may_start)
                        else:  # no batch yet: no tail to look for, a longer sleep
                            backoff = min(2 * backoff, IDLE_CHECK_BACKOFF)
                            quiet_for = self._pacing.idle_after(
                                self.options.idle_check * backoff)
                            idle_since = time.monotonic()
                except Disconnected:
                    continue
                except zmq.ZMQError as exc:
                    # No room for a replay's socket (EMFILE: sockets of removed workers still
                    # closing): said without a stack trace, and what was under way is redone.
                    self._needs_rebuild = self._needs_rebuild or self._rebuilding_failed()
                    self.status.last_error = f"ZeroMQ: {exc}; retrying"
                    log.warning("%s: %s", self.worker, self.status.last_error)
                    await asyncio.sleep(_OPEN_RETRY_FIRST)
                except Exception as exc:  # never let a bug end the subscription silently
                    log.exception("%s: unexpected error", self.worker)
                    self._needs_rebuild = self._needs_rebuild or self._rebuilding_failed()
                    self.status.last_error = f"internal error: {exc!r}"
                    await asyncio.sleep(_POLL_MS / 1000)
        finally:
            _give_up(check)

    def _rebuilding_failed(self) -> bool:
        """Whether the step that just failed was a rebuild or resume (the worker is still
        `replaying`, which only they set): it is redone from the start, never left
        `replaying` with nothing to end it."""
        return self.status.state == WorkerState.REPLAYING

    async def _wait_for_live(self, seconds: float) -> bool:
        """Whether a live batch arrived within `seconds` (at least 10 ms). A quiet worker
        sleeps until its next idle check is due, not a poll interval: a quiet fleet of a
        thousand costs its event loop a wake-up per idle check, not a thousand a second.
        `_wake` (a stop, a dropped connection) ends the wait at once, with False."""
        return await self._live.wait(max(_POLL_MS / 10 / 1000, seconds))

    def _check_may_start(self, check: asyncio.Future[None]) -> None:
        if not check.cancelled():
            self._wake()

    def _wake(self) -> None:
        """End a quiet wait now (it then returns False), so the loop looks at its state."""
        self._live.wake()

    def _reopen_if_given_up(self) -> None:
        if self._live.reopen_if_given_up():
            self.status.last_error = (
                f"{self.endpoint.endpoint} sent something that made ZMQ drop the connection "
                f"for good (a message over max_message_bytes={self.options.max_message_bytes}"
                " does); connecting again on a new socket")
            log.warning("%s: %s", self.worker, self.status.last_error)

    def _check_connection(self) -> None:
        """Called after every await inside a step: a disconnect meanwhile voids the step."""
        if self._generation != self._working_generation:
            raise Disconnected

    async def _wait_or_stop(self, awaitable: Awaitable[Any], timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(awaitable, timeout)

    def _drain(self) -> None:
        """Drop live batches queued before the replay that is about to cover them."""
        while self._live.queued() is not None:
            pass
        self._last_live = None

    # --- live batches -------------------------------------------------------------------------

    def _drain_live(self, left: int) -> tuple[int, list[Payload] | None,
                                              Awaitable[None] | None, bool]:
        """Live messages taken by the applier's compiled drain (``BatchApplier.drain``), at
        most ``left``, recorded as the ledger records each: (what is left of the bound,
        the message it stopped at for ``_on_live``, or what to await: the rest of a batch it
        began, or a yield to the loop when it took some and stopped at the turn's end or
        for a waiting request; whether nothing more is queued)."""
        status = self.status
        ledger = self._ledger
        done = ledger.applier.drain(self._live.socket, status.last_seq,
                                   self._last_live, self.endpoint.dp_rank, left)
        if done is None:  # this turn's work is used up: _on_live's batch waits for the next
            return left, None, None, False
        if done.taken:
            self._last_live = status.last_seq = done.seq
            ledger.last_payload = done.payload
            ledger.count_applied(done.taken, done.events, done.blocks)
            if status.state.serving:
                ledger.settle()
        left -= done.taken
        if done.bounded and done.taken:
            # The turn is over, or a request waits: drain on after a yield. (Nothing taken:
            # _on_live's batch is applied after the yield whatever waits, so each turn takes
            # one at least.)
            return left, None, ledger.applier.yield_to_loop(), False
        if done.run is None:
            return left, done.frames, None, done.empty
        # The next batch in order, part of it applied: _on_live's _take would have begun it.
        seq = decode_seq(done.frames[1])
        self._last_live = seq
        return left - 1, None, ledger.apply(seq, done.frames[2],
                                            begun=ledger.applier.begun(done)), False

    def _on_live(self, frames: list[Payload]) -> Awaitable[None] | None:
        """Take one live message: None when that is done (nearly every batch of a live
        stream: the next in order, applied whole at once by ``BatchApplier.apply_now``),
        else the rest of the work, to await."""
        if len(frames) != 3:
            self._ledger.malformed(f"live message with {len(frames)} frames, expected 3")
            return None
        try:
            seq = decode_seq(frames[1])
        except WireError as exc:
            self._ledger.malformed(str(exc))
            return None
        previous_live, self._last_live = self._last_live, seq
        payload = frames[2]
        if is_next(seq, self.status.last_seq, previous_live):
            return self._ledger.take(seq, payload)
        return self._out_of_order(seq, payload, previous_live)

    async def _out_of_order(self, seq: int, payload: Payload, previous_live: int | None) -> None:
        """A live batch other than the next one in order: a duplicate, a restart or a gap."""
        verdict = classify(seq, last_applied=self.status.last_seq, last_live=previous_live)
        ledger = self._ledger
        if verdict.kind is Kind.DUPLICATE:
            if ledger.replayed_as(seq, payload) is not False:
                ledger.count("duplicates")
                return
            # Same seq, other content: a new engine counting from 0 again, caught before its
            # live seq went back (right after a replay there is no previous live seq).
            verdict = Verdict(Kind.RESTART)
        if verdict.kind is Kind.RESTART:
            log.warning("%s: seq went back to %d: the engine restarted", self.worker, seq)
            ledger.count("restarts")
            await self._replayer.rebuild()
            # Not live-vs-live any more: the rebuild may have applied this seq, or left a gap.
            verdict = classify(seq, last_applied=self.status.last_seq)
            if verdict.kind is Kind.DUPLICATE:
                return
        if verdict.kind is Kind.GAP:
            ledger.count("gaps")
            await self._replayer.fill_from(verdict.missing.start)
            verdict = classify(seq, last_applied=self.status.last_seq)
            if verdict.kind is Kind.DUPLICATE:
                return
            if verdict.kind is Kind.GAP:
                missing = verdict.missing
                ledger.give_up(f"batches {missing[0]}..{missing[-1]} could not be recovered")
        await ledger.apply(seq, payload)
