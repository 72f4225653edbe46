"""One worker's ledger: what kvroute knows of its stream, and the one way a batch, live or
replayed, is applied to its entries in the index.

Ownership: a ``Subscriber`` owns one ledger and its ``Replayer`` shares it; neither writes
the worker's entries or its ``WorkerStatus`` any other way. The ledger owns:

- the worker's ``status`` (state, counters, ``last_seq``: the last APPLIED seq);
- ``degraded``: the worker's entries may under-report what the engine holds (history lost,
  a gap nothing could fill, a store skipped for a cap). It ends when the state is known to
  be exact again (an ``AllBlocksCleared`` applied after the last skip, or a whole rebuild);
- the payload of the batch at ``last_seq`` (``last_payload``, None when unknown) and the
  fingerprints of replayed batches, which tell a live duplicate of one of them from a
  restarted engine's batch under the same seq;
- the ``BatchApplier`` that writes the entries, and whether a batch is being applied (the
  index matches ``last_seq`` only between batches: ``save_point``).

Everything runs on the event loop, on the subscriber's task.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from kvroute.app.ingest.apply import BatchApplier, BatchOutcome, Begun
from kvroute.app.ingest.wire import IndexWriter, Payload
from kvroute.app.state.format import payload_fingerprint
from kvroute.app.workers import (
    SubscriberHooks,
    SubscriberOptions,
    WorkerEndpoint,
    WorkerState,
    WorkerStatus,
)
from kvroute.index.holdings import Holdings

__all__ = ["SubscriberIndex", "WorkerLedger", "weakly"]

log = logging.getLogger("kvroute.app.ingest.subscriber")

_MAX_REPLAYED_FINGERPRINTS = 20_000


class SubscriberIndex(IndexWriter, Protocol):
    """What a worker's ledger needs of its index besides applying events (``PrefixIndex``)."""

    def blocks_held(self, worker: Any) -> int: ...

    def holds_hash(self, worker: Any, block_hash: Any) -> bool: ...

    def restore(self, worker: Any, pieces: Iterable[Holdings]) -> int: ...

    def restore_unconfirmed(self, worker: Any, pieces: Iterable[Holdings],
                            expires: float) -> int: ...


def weakly(method: Callable[..., None]) -> Callable[..., None]:
    """`method` (bound), called only while its object lives: a callback that does not keep
    its owner alive, so owner and part make no reference cycle. (A removed worker's
    subscriber and sockets are then freed by reference counting as its task ends, not left
    in cycles for the garbage collector, whose passes over a hundred instances' leftovers
    stalled every route.)"""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def fingerprint(payload: Payload) -> int:
    # Payloads carry the step's timestamp, so two engines' batches never share bytes.
    return hash(payload)


class WorkerLedger:
    """One worker's status and the way its batches reach the index (module docstring)."""

    def __init__(self, endpoint: WorkerEndpoint, index: SubscriberIndex,
                 options: SubscriberOptions, hooks: SubscriberHooks, *,
                 check: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.worker = endpoint.worker
        self.index = index
        self.options = options
        self.hooks = hooks
        self.status = WorkerStatus()
        self.degraded = False
        self.last_payload: Payload | None = None
        self.applying = False
        # seq -> payload fingerprint of batches applied from a replay.
        self._replayed: dict[int, int] = {}
        self._warned_rank = False
        # ``check`` is the subscriber's: a disconnect while the loop ran voids the step.
        self.applier = BatchApplier(index, self.worker, options, check=check,
                                    refused=weakly(self._store_refused))

    # --- applying -----------------------------------------------------------------------------

    def take(self, seq: int, payload: Payload, *, replayed: bool = False,
             ) -> Awaitable[None] | None:
        """Apply batch ``seq``, the next in order: None when that is done at once (the
        applier took it whole, ``BatchApplier.apply_now``), else the rest, to await."""
        if replayed:
            self.remember_replayed(seq, payload)
        taken = self.applier.apply_now(payload)
        if type(taken) is BatchOutcome:
            self.applied(seq, payload, taken)
            return None
        return self.apply(seq, payload, begun=taken)

    async def apply(self, seq: int, payload: Payload, *, replayed: bool = False,
                    begun: Begun | None = None) -> None:
        """Apply one batch (the rest of it, after ``apply_now`` or a drain left it
        ``begun``); the seq counts even when the payload is garbage."""
        self.applying = True
        try:
            if replayed:
                self.remember_replayed(seq, payload)
            outcome = await self.applier.apply(seq, payload, begun)
        finally:
            self.applying = False
        self.applied(seq, payload, outcome)

    def applied(self, seq: int, payload: Payload, outcome: BatchOutcome) -> None:
        """What applying batch ``seq`` did, into the worker's status."""
        self._record(seq, outcome)
        if self.status.last_seq == seq:
            self.last_payload = payload

    def _record(self, seq: int, outcome: BatchOutcome) -> None:
        status = self.status
        status.last_seq = seq
        if outcome.garbage is not None:
            self.malformed(outcome.garbage)
            return
        if outcome.failed is not None:
            # A bug, not bad input: the worker's entries may be half-updated. Hold nothing
            # rather than something wrong, and carry on with the stream.
            self.give_up(outcome.failed)
            status.last_seq = seq
            return
        rank = outcome.data_parallel_rank
        if rank is not None and rank != self.endpoint.dp_rank:
            self.count("rank_mismatches")
            if not self._warned_rank:
                self._warned_rank = True
                log.warning("%s: payload says data-parallel rank %s; keeping the endpoint's",
                            self.worker, rank)
        if outcome.rejected is not None:
            status.last_error = outcome.rejected
        self.count_applied(1, outcome.events, outcome.blocks)
        if outcome.malformed:
            status.malformed += outcome.malformed
        if outcome.unknown:
            status.unknown += outcome.unknown
        if outcome.exact_again and self.degraded:
            self.degraded = False
        if status.state.serving:
            self.settle()

    def count_applied(self, batches: int, events: int, blocks: int) -> None:
        """Batches applied, into the counters every batch adds to (without ``count``'s
        lookups by name), and the time of the last one."""
        status = self.status
        status.last_event_time = time.time()
        status.batches += batches
        status.events += events
        status.blocks += blocks

    def _store_refused(self, counter: str, reason: str) -> None:
        """A store the applier refused for a cap: the worker may now under-report."""
        self.count(counter)
        self.status.last_error = f"{reason}; skipped"
        if not self.degraded:  # logged once per spell, however many stores follow
            log.warning("%s: %s; skipped, the worker is degraded", self.worker, reason)
            self.mark_degraded()

    def save_point(self) -> tuple[int, int | None, bool] | None:
        """(last applied seq, fingerprint of its payload, degraded) when the index holds
        exactly what the batches up to that seq say and answers may use it; None in the
        middle of a batch, or while connecting, replaying or down. Capture the worker's
        holdings in the same step of the loop as this call."""
        if self.applying or not self.status.state.serving or self.status.last_seq is None:
            return None
        payload = self.last_payload
        return (self.status.last_seq, None if payload is None else payload_fingerprint(payload),
                self.degraded)

    # --- replayed batches ---------------------------------------------------------------------

    def remember_replayed(self, seq: int, payload: Payload) -> None:
        if len(self._replayed) >= _MAX_REPLAYED_FINGERPRINTS:
            del self._replayed[next(iter(self._replayed))]  # the oldest
        self._replayed[seq] = fingerprint(payload)

    def replayed_as(self, seq: int, payload: Payload) -> bool | None:
        """Whether ``payload`` is the batch a replay applied under ``seq``; None when no
        replay applied one there (or it was forgotten)."""
        known = self._replayed.get(seq)
        return None if known is None else known == fingerprint(payload)

    # --- the worker's state -------------------------------------------------------------------

    def clear(self) -> None:
        """Empty the worker's entries in the index: nothing applied from here back."""
        self.index.clear_worker(self.worker)
        self.status.last_seq = None
        self.last_payload = None
        self._replayed.clear()

    def give_up(self, reason: str) -> None:
        """A gap nothing can fill: hold nothing rather than something possibly stale."""
        log.warning("%s: %s; clearing the worker and going on degraded", self.worker, reason)
        self.status.last_error = reason
        self.clear()
        self.mark_degraded()

    def mark_degraded(self) -> None:
        self.degraded = True
        self.count("degraded_count")
        if self.status.state.serving:
            self.set_state(WorkerState.DEGRADED)

    def settle(self) -> None:
        self.set_state(WorkerState.DEGRADED if self.degraded else WorkerState.LIVE)

    def malformed(self, reason: str) -> None:
        self.status.last_error = reason
        self.count("malformed")

    def set_state(self, state: WorkerState) -> None:
        if self.status.state != state:
            self.status.state = state
            self.hooks.state_changed(self.worker, state)

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of the ``COUNTERS`` in this worker's status."""
        setattr(self.status, name, getattr(self.status, name) + n)
