"""How a subscriber learns from its publisher's replay ROUTER: rebuilds, resumes, and the
fills of gaps and idle checks (the part of ``app.ingest.subscriber`` that asks for history).

- A rebuild clears the worker and applies everything the publisher still buffers, from seq
  0; it is ``replaying`` meanwhile, ``live`` after a whole answer, ``degraded`` when the
  answer was cut short (history lost, or the replay never finished: idle checks retry it).
- A fill asks from a seq on and applies the answer in order; a hole in it (the ROUTER
  dropped frames) is asked for again from there, a bounded number of times; a timed-out
  answer is asked again from after the last batch it applied (``_resume_point``), with
  backoff, up to ``replay_retries`` attempts, each holding one of the fleet's replay slots
  and bounded by ``replay_deadline`` in all.
- Resume (``app.state.format``): a subscriber given a saved worker asks, on its first
  connection, for a replay from the saved seq instead. The first batch decides:
  that seq with the saved fingerprint is the same engine, so the saved holdings are
  restored exactly and the rest of the replay brings them up to date (``live`` at once);
  no batch at or after it, or another payload under that seq, is another engine (the
  holdings are dropped and the worker is rebuilt as above); a first batch past the saved
  seq means the buffer moved on: the holdings are kept unconfirmed (they count like
  placement guesses until real events replace them or ``unconfirmed_ttl`` passes) and the
  worker rebuilds from what is buffered, degraded. Without any answer (no replay endpoint,
  timeouts) it rebuilds as above, and the holdings are kept unconfirmed too.

Ownership: a ``Replayer`` belongs to one ``Subscriber``, runs on its task, and applies what
it learns through the worker's ledger (``app.ingest.ledger``), which it shares with the
subscriber. It owns the replay channel (the DEALER sockets to the publisher's ROUTER), the
saved holdings not yet resumed from, and whether the last rebuild's replay finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq

from kvroute.app.ingest.apply import Abandoned
from kvroute.app.ingest.ledger import WorkerLedger
from kvroute.app.ingest.pacing import FleetPacing
from kvroute.app.ingest.replay_request import ReplayChannel, ReplayRequest
from kvroute.app.ingest.sequence import Kind, classify, next_seq
from kvroute.app.ingest.wire import Payload, WireError, decode_replay_frame
from kvroute.app.state.format import SavedWorker, payload_fingerprint
from kvroute.app.workers import WorkerState
from kvroute.index.holdings import Holdings

__all__ = ["Disconnected", "Replayer"]

log = logging.getLogger("kvroute.app.ingest.subscriber")


class Disconnected(Abandoned):
    """The connection dropped while a batch or replay was in progress: abandon it (the
    worker was cleared and will be rebuilt)."""


class Replayer:
    """Replays of one worker's history; see the module docstring."""

    def __init__(self, ledger: WorkerLedger, ctx: zmq.Context, pacing: FleetPacing, *,
                 saved: SavedWorker | None, stopping: asyncio.Event,
                 check: Callable[[], None]) -> None:
        self._ledger = ledger
        self.endpoint = ledger.endpoint
        self.worker = ledger.worker
        self.options = options = ledger.options
        self._pacing = pacing
        self.channel = (
            None if self.endpoint.replay_endpoint is None else
            ReplayChannel(ctx, self.endpoint.replay_endpoint,
                          max_message_bytes=options.max_message_bytes,
                          kept=pacing.replay_channels))
        self._stopping = stopping
        # The subscriber's: called after every await, a disconnect meanwhile voids the step.
        self._check = check
        # Degraded only because the rebuild's replay did not finish: idle checks retry it.
        self.unfinished_rebuild = False
        # Saved holdings to resume from on the first connection (taken by _resume), and,
        # while its replay runs, the one whose first batch decides what they are worth.
        self._saved = saved
        self._resuming: SavedWorker | None = None
        # Why a resume's saved holdings were refused: "other engine" or "unusable".
        self._refused: str | None = None

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()

    async def start_over(self) -> None:
        """On a (re)connection: resume from the saved holdings if there are any not yet
        tried, else rebuild."""
        saved, self._saved = self._saved, None
        if saved is not None:
            await self._resume(saved)
        else:
            await self.rebuild()

    async def idle_check(self) -> bool:
        """Pick up dropped tail batches; after a rebuild whose replay did not finish, this
        is the rebuild's retry: when the rest of the history arrives whole (and nothing
        else turned the worker degraded meanwhile), the worker is exact again.

        Returns whether it found anything (the subscriber spaces its checks by it)."""
        ledger = self._ledger
        status = ledger.status
        last, batches = status.last_seq, status.batches
        unfinished, marks = self.unfinished_rebuild, status.degraded_count
        complete = await self.fill_from(0 if last is None else last + 1)
        if unfinished and complete and status.degraded_count == marks:
            self.unfinished_rebuild = False
            ledger.degraded = False
            ledger.settle()
            log.info("%s: the replay finished on a retry; exact again", self.worker)
            return True
        return status.batches != batches or status.last_seq != last

    async def rebuild(self) -> None:
        """Clear the worker and learn everything the publisher still buffers."""
        self._ledger.clear()
        self._ledger.degraded = False
        self.unfinished_rebuild = False
        self._ledger.set_state(WorkerState.REPLAYING)
        if self.endpoint.replay_endpoint is not None:
            if not await self.fill_from(0):
                self._ledger.mark_degraded()  # the engine may hold blocks we could not learn
                self.unfinished_rebuild = True
        self._ledger.settle()

    async def _resume(self, saved: SavedWorker) -> None:
        """Learn the engine's state from saved holdings and a replay from the saved seq
        (see the module docstring for what its first batch decides)."""
        self._ledger.clear()
        self._ledger.degraded = False
        self._ledger.set_state(WorkerState.REPLAYING)
        self._resuming = saved
        self._refused = None
        try:
            complete = await self.fill_from(saved.head.seq)
        except Disconnected:
            if self._resuming is not None:  # not judged yet: try on the next connection
                self._saved = self._resuming
            raise
        finally:
            unjudged, self._resuming = self._resuming, None
        if self._refused is not None:
            log.warning("%s: saved state not used: %s; rebuilding", self.worker,
                        self._ledger.status.last_error)
            if self._refused == "other engine":
                self._ledger.count("restarts")
            await self.rebuild()
            return
        if unjudged is not None:  # no batch said anything about the saved holdings
            await self.rebuild()
            self._restore_unconfirmed(*self._all_unconfirmed(unjudged))
            self._ledger.mark_degraded()  # what is really held may under-report the engine
            return
        if not complete:
            self._ledger.mark_degraded()
        self._ledger.settle()

    async def _judge_saved(self, start: int, seq: int | None, payload: Payload) -> bool:
        """The first reply of a resume's replay (``seq`` None: the end marker): restore the
        saved holdings as it says; False when they are refused (another engine's)."""
        saved, self._resuming = self._resuming, None
        assert saved is not None
        fingerprint = saved.head.fingerprint
        if seq is None or (seq == start and fingerprint is not None
                           and payload_fingerprint(payload) != fingerprint):
            self._ledger.status.last_error = (
                f"no batch at or after the saved seq {start} in the replay" if seq is None
                else f"the batch at the saved seq {start} differs from the saved one")
            self._refused = "other engine"
            return False
        if seq == start and fingerprint is not None:
            ledger = self._ledger
            try:
                for piece in saved.pieces:  # a piece at a time, with the loop running between
                    ledger.count("restored_blocks", ledger.index.restore(self.worker, [piece]))
                    await ledger.applier.yield_to_loop()
            except ValueError as exc:  # a sound blob of unsound holdings: a bug somewhere
                self._ledger.status.last_error = f"saved holdings rejected by the index: {exc}"
                self._refused = "unusable"
                return False
            self._ledger.status.last_seq = start
            self._ledger.last_payload = payload
            self._ledger.remember_replayed(start, payload)
            if saved.unconfirmed:  # still unconfirmed, for the time they had left
                self._restore_unconfirmed(saved.unconfirmed,
                                          saved.unconfirmed_left(time.time()))
            if saved.head.degraded:
                self._ledger.mark_degraded()
            log.info("%s: resumed %d saved blocks at seq %d", self.worker,
                     self._ledger.status.restored_blocks, start)
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
            kept = self._ledger.index.restore_unconfirmed(self.worker, pieces, expires)
        except ValueError as exc:
            log.warning("%s: saved holdings rejected by the index: %s", self.worker, exc)
            return
        self._ledger.count("restored_unconfirmed", kept)
        log.warning("%s: %d saved blocks could not be confirmed by a replay; they count "
                    "as guesses for %.0f s", self.worker, kept, lasting)

    async def fill_from(self, start: int) -> bool:
        """Apply replayed batches from ``start`` on, re-asking from each hole (bounded).
        Returns whether the replay reached its end marker without a hole left."""
        if self.endpoint.replay_endpoint is None:
            return False
        for _ in range(self.options.max_hole_retries + 1):
            outcome = await self._replay_once(start)
            if outcome != "hole":
                return outcome == "complete"
            start = next_seq(self._ledger.status.last_seq)
        return False

    async def _replay_once(self, start: int) -> str:
        """One request, retried after timeouts. Returns "complete", "hole" (ask again from
        last_seq + 1) or "failed"."""
        endpoint = self.endpoint.replay_endpoint
        assert endpoint is not None
        self._ledger.count("replays")
        delay = self.options.retry_backoff
        channel = self.channel
        assert channel is not None
        for attempt in range(self.options.replay_retries):
            deadline = self.options.replay_deadline
            asked_at = time.monotonic()
            try:
                # A slot first (the fleet's bound on replays at once); the deadline covers
                # the whole answer, so one that trickles in forever cannot keep the worker
                # replaying: it is asked again, and after the last attempt given up.
                async with self._pacing.replay_slot(), asyncio.timeout(deadline):
                    if not channel.is_open:
                        # Opening its sockets is a piece of the fleet's socket work: a
                        # hundred workers rebuilding at once open them in bounded pieces.
                        await self._pacing.turn()
                    async with ReplayRequest(channel, start,
                                             timeout=self.options.replay_timeout) as request:
                        return await self._consume_replay(request)
            except TimeoutError:
                how = (f"did not finish within {deadline:g} s"
                       if time.monotonic() - asked_at >= deadline else "timed out")
                self._ledger.status.last_error = (f"replay from {endpoint} {how} "
                                          f"(attempt {attempt + 1}/{self.options.replay_retries})")
            if self._stopping.is_set():
                break
            await asyncio.sleep(delay)
            self._check()
            delay *= 2
            start = self._resume_point(start)
        self._ledger.count("replay_failures")
        log.warning("%s: %s", self.worker, self._ledger.status.last_error)
        return "failed"

    def _resume_point(self, start: int) -> int:
        """Where a retry after a timeout asks from: after what the timed-out answer already
        applied. Asking from ``start`` again would re-send all of it, and once the buffer has
        moved past ``start`` (a long replay of a busy engine) would read as history lost."""
        last = self._ledger.status.last_seq
        if self._resuming is not None or last is None or last < start:
            return start  # nothing of this answer applied yet
        return next_seq(last)

    async def _consume_replay(self, request: ReplayRequest) -> str:
        start = request.start
        first = True
        while True:
            frames = await request.next_frames()
            self._check()
            if frames is None:
                return self._replay_cut(start)
            try:
                reply = decode_replay_frame(frames)
            except WireError as exc:
                self._ledger.malformed(f"replay: {exc}")
                return "hole"
            if reply.seq is None:
                request.finished()  # the answer is whole: its socket can serve the next
            if first and self._resuming is not None:
                first = False
                if not await self._judge_saved(start, reply.seq, reply.payload):
                    return "failed"  # refused (the end marker first always is)
                if self._ledger.status.last_seq == reply.seq:
                    continue  # restored: the saved holdings end with this batch
                await self._ledger.apply(reply.seq, reply.payload, replayed=True)
                continue
            if reply.seq is None:
                return "complete"
            if first:
                first = False
                if reply.seq > start:
                    self._lost_history(start, reply.seq)
                    await self._ledger.apply(reply.seq, reply.payload, replayed=True)
                    continue
            verdict = classify(reply.seq, last_applied=self._ledger.status.last_seq)
            if verdict.kind is Kind.DUPLICATE:
                continue  # already applied (a replay overlapping live batches)
            if verdict.kind is Kind.GAP:
                return "hole"  # the ROUTER dropped frames (its HWM): ask again from here
            rest = self._ledger.take(reply.seq, reply.payload, replayed=True)
            if rest is not None:
                await rest

    def _replay_cut(self, start: int) -> str:
        """The replay connection dropped mid-answer. ZMQ drops one that sends a frame over
        max_message_bytes, and the ROUTER cannot send the rest to a new connection, so the
        batch after the last one received (the one such a frame held) cannot be had. Like a
        gap nothing can fill it clears the worker (the batch may have removed blocks: holding
        them would over-report); the replay is then asked again from the batch after it."""
        lost = max(start, next_seq(self._ledger.status.last_seq))
        self._ledger.count("unreceivable")
        self._ledger.give_up(f"replayed batch {lost} could not be received: the replay connection "
                      "dropped (ZMQ drops one that sends a frame over max_message_bytes="
                      f"{self.options.max_message_bytes})")
        self._ledger.status.last_seq = lost
        self._ledger.last_payload = None
        return "hole"

    def _lost_history(self, asked: int, got: int) -> None:
        log.warning("%s: replay asked from %d starts at %d: history lost, rebuilding degraded",
                    self.worker, asked, got)
        self._ledger.status.last_error = (
            f"replay history lost: asked from seq {asked}, buffer starts at {got}"
        )
        self._ledger.clear()
        self._ledger.mark_degraded()

