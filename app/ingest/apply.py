"""Applying one batch of KV events to one worker's index entries, in bounded pieces of work
with the event loop running between them.

A batch reaches the index by one of two paths:

- **Plain**: the compiled index reads the payload (``read_plain_batch``: every event a GPU
  store or removal with nothing special about it; lists of over 65,536 items checked but
  left in the payload, and a payload over ``_DECODE_WHOLE_BYTES`` read on another thread,
  the index checking long lists without the GIL) and applies runs of its events in one
  call each (``index.runs``). An event no run takes (a parent the worker does not hold, a
  worker not known yet, more work than a run may do, a cap) is rebuilt from the reading a
  slice at a time (``app.ingest.plain_slices``) and applied as the decoded path applies an
  event. ``apply_now`` is this path's first run taken at once, with no coroutine;
  ``drain`` is ``apply_now`` for each queued live message, in one compiled call that also
  receives them (app/ingest/_live_drain.pyx). Both hand a batch they did not finish
  (``Begun``) to ``apply``, which goes on from where they stopped.
- **Decoded**: every other payload (one that is not plain, or any payload when the
  index has no reader: the pure install). Its envelope is decoded, then ``chunk_events``
  events at a time (``wire.decode_events``); runs take what they can of each chunk and the
  rest goes one event at a time, removals next to each other coalesced. An encoded event
  over ``huge_store.HUGE_EVENT_BYTES`` is decoded and applied a slice at a time
  (``app.ingest.huge_store``: nothing applied before all of it is decoded and checked;
  meanwhile routes see a prefix of its chain).

Bounds, on both paths (``SubscriberOptions``): at most ``chunk_events`` events, or
``slice_blocks`` blocks of index work, between two yields to the loop, counted across
batches (a replay of thousands of small batches yields too), except in ``drain``, which
looks at the turn's clock before each batch and bounds each one's run so; and all
appliers together stop for the turn once the loop's ``LoopBudget`` is used up
(``app.ingest.budget``). An event of more work is applied in slices that leave the index
exactly as one call would. A clear is one call whatever it costs (bounded by
``max_blocks_per_worker``). A BlockStored of more than ``max_blocks_per_event`` blocks, or
one that would take the worker past ``max_blocks_per_worker`` blocks held, is refused:
reported through ``refused`` and skipped. Removals are never refused: a skipped one would
over-report.

Ownership: an applier is its subscriber's only way of writing the worker's entries, and runs
on the event loop. ``check`` is called after every yield; when it raises ``Abandoned`` (the
subscriber's connection dropped meanwhile) the batch stops at once, half applied: its
subscriber clears the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from kvroute.app.ingest.budget import LoopBudget, shared_budget
from kvroute.app.ingest.huge_store import HUGE_EVENT_BYTES, HugeStore
from kvroute.app.ingest.plain_slices import event_slices
from kvroute.app.ingest.sockets import BIG_FRAME_BYTES
from kvroute.app.ingest.wire import (
    SLICE_TOKENS_PER_BLOCK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Hash,
    Payload,
    RawStored,
    WireError,
    apply_event,
    coalesced,
    decode_envelope,
    decode_events,
    slices,
    stored,
)
from kvroute.index.runs import Run, RunLimits

# compiled with the index where libzmq's header is found (app/ingest/_live_drain.pyx);
# without it every message goes by Python
try:
    from kvroute.app.ingest._live_drain import LiveTake
except ImportError:
    LiveTake = None

if TYPE_CHECKING:
    from kvroute.app.ingest._live_drain import Drained
    from kvroute.app.ingest.ledger import SubscriberIndex
    from kvroute.app.workers import SubscriberOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

# A plain payload up to this size is read on the loop's thread (``apply_now``, ``drain``);
# a bigger one on another thread, with the loop running meanwhile. Every real vLLM batch is
# far smaller.
_DECODE_WHOLE_BYTES = 256 * 1024
# Decoding cannot be cut into bounded pieces: one event, or one envelope, is one call (a
# store of up to huge_store.HUGE_EVENT_BYTES, or an envelope, which grows with the number of
# events). After such a call took _LONG_DECODE or more, the applier lets the loop run about
# as long (at most _MAX_PAUSE), because an HTTP answer needs several turns of the loop and a
# flood of big frames would otherwise put one long stretch in front of each of them. Real
# batches decode in far less than _LONG_DECODE.
_LONG_DECODE = 0.005
_MAX_PAUSE = 0.05


def _split_huge(raws: list[msgspec.Raw]) -> Iterator[tuple[list[msgspec.Raw], msgspec.Raw | None]]:
    """``raws`` in order, as runs of ordinary events ``(run, None)`` and each event over
    ``HUGE_EVENT_BYTES`` on its own ``([], event)``."""
    run: list[msgspec.Raw] = []
    for raw in raws:
        if len(raw) > HUGE_EVENT_BYTES:
            if run:
                yield run, None
                run = []
            yield [], raw
        else:
            run.append(raw)
    if run:
        yield run, None


class Abandoned(Exception):
    """Raised by ``check``: the step this batch belongs to is void; stop applying."""


@dataclass(slots=True)
class BatchOutcome:
    """What applying one batch did. ``garbage`` (the payload could not be decoded) and
    ``failed`` (a bug left the worker's entries half updated) each end it early."""

    garbage: str | None = None
    failed: str | None = None
    data_parallel_rank: int | None = None
    events: int = 0
    blocks: int = 0
    malformed: int = 0
    unknown: int = 0
    # An AllBlocksCleared was applied after the last refused store: what the worker holds
    # is exactly what the engine says again.
    exact_again: bool = False
    rejected: str | None = None  # why the index refused the batch's last refused event


@dataclass(slots=True)
class Begun:
    """A batch ``apply_now`` or ``drain`` did not finish, for ``apply`` to go on with:
    the index's reading of it and the first run made on it (``done``), or, when the
    payload is not plain, neither (nothing applied; ``apply`` decodes it)."""

    reading: Any = None
    outcome: BatchOutcome | None = None
    done: Run | None = None


NOT_PLAIN = Begun()


class BatchApplier:
    """Applies batches for one worker, keeping the loop's turns short (module docstring)."""

    def __init__(self, index: SubscriberIndex, worker: Any, options: SubscriberOptions, *,
                 check: Callable[[], None], refused: Callable[[str, str], None]) -> None:
        self.index = index
        self.worker = worker
        self.options = options
        self._check = check
        # Called with (counter, reason) when a store is refused for a cap, as it is skipped.
        self._refused = refused
        self._unyielded = 0  # events applied since the last yield to the event loop
        self._unyielded_work = 0  # blocks of index work since then (see slice_blocks)
        self._budget: LoopBudget | None = None  # the loop's, shared by the fleet
        # The index's way of applying runs of plain events in one call (index.runs), when
        # it has one; None: every event one by one.
        self._runs: Callable[..., Run] | None = getattr(index, "apply_run", None)
        # The index's reader of a whole payload of plain events (no object per event), when
        # it has one: the plain path.
        self._read_plain: Callable[[Payload], Any] | None = (
            getattr(index, "read_plain_batch", None) if self._runs is not None else None)
        self._limits = RunLimits(stored=(BlockStored, RawStored), removed=BlockRemoved,
                                 max_event_blocks=options.max_blocks_per_event,
                                 max_worker_blocks=options.max_blocks_per_worker,
                                 max_work=options.slice_blocks)
        # The compiled take of live messages (``drain``): with the compiled index only,
        # whose reading it needs.
        self._take = (LiveTake(index, worker, self._limits, options.chunk_events,
                               options.slice_blocks, _DECODE_WHOLE_BYTES, BIG_FRAME_BYTES)
                      if LiveTake is not None and self._read_plain is not None
                      and getattr(index, "implementation", None) == "compiled" else None)

    @property
    def budget(self) -> LoopBudget:
        if self._budget is None:
            self._budget = shared_budget()
        return self._budget

    def apply_now(self, payload: Payload) -> BatchOutcome | Begun | None:
        """The plain path's first run, taken at once, without the coroutines of ``apply``,
        when this turn's budget has room and the payload is small enough to read here: the
        outcome when that run applied the batch whole; else the batch as ``Begun`` (the run
        stopped short, or used up the work allowed between two yields; ``NOT_PLAIN``: the
        payload is not plain), for ``apply`` to go on with; None when nothing was tried.

        The same events applied, the same counts, the same bounds of work between two
        yields as ``apply`` would."""
        read = self._read_plain
        if (read is None or len(payload) > _DECODE_WHOLE_BYTES
                or self._unyielded + 1 >= self.options.chunk_events or self.budget.exhausted()):
            return None
        reading = read(payload)
        if reading is None:
            return NOT_PLAIN
        self._unyielded += 1
        outcome = BatchOutcome(data_parallel_rank=reading.data_parallel_rank,
                               events=len(reading))
        done = self._run(reading, 0, outcome)
        if done.next >= outcome.events and done.error is None and not done.full:
            return outcome
        return Begun(reading, outcome, done)

    @property
    def drains(self) -> bool:
        """Whether ``drain`` is there (the compiled take and the compiled index)."""
        return self._take is not None

    def drain(self, socket: zmq.Socket[bytes], last_seq: int | None, last_live: int | None,
              rank: int, limit: int) -> Drained | None:
        """``apply_now`` for each queued live message on ``socket`` while it is the next
        batch in order (after ``last_seq``, above ``last_live``) and one run applies its
        plain payload whole, in one compiled call that receives them too
        (app/ingest/_live_drain.pyx), within this turn's share of the ``LoopBudget``. At
        most ``limit`` messages. None when the turn's work is used up. The message it
        stopped at, if any, is in the result: the caller goes on with it (``begun`` when
        part of it was applied).

        Unlike ``apply_now``, it does not yield between batches for the events and blocks
        applied since the last yield: it looks at the turn's clock, and for a waiting
        request, before each message, and ``chunk_events`` and ``slice_blocks`` bound each
        message's run (the first one's with the work counted since the last yield). The
        work counted toward the next yield is then that since its last look."""
        assert self._take is not None
        budget = self.budget
        window = budget.stretch()
        if window is None:
            return None
        deadline, arrivals = window
        done = self._take.drain(socket, last_seq, last_live, rank, limit, deadline, arrivals,
                                budget.look_seconds, self._unyielded, self._unyielded_work)
        self._unyielded, self._unyielded_work = done.unyielded, done.unyielded_work
        if done.requests_waiting:
            budget.look_now()
        return done

    @staticmethod
    def begun(done: Drained) -> Begun:
        """The batch a drain stopped in, part of it applied, as ``apply`` takes it."""
        run = done.run
        outcome = BatchOutcome(data_parallel_rank=done.plain.data_parallel_rank,
                               events=len(done.plain), blocks=run.blocks)
        return Begun(done.plain, outcome, run)

    async def apply(self, seq: int, payload: Payload, begun: Begun | None = None,
                    ) -> BatchOutcome:
        """Apply one batch, yielding to the loop between bounded pieces of work; or the rest
        of it, after ``apply_now`` or ``drain`` left it ``begun``."""
        if begun is not None and begun.reading is not None:
            assert begun.outcome is not None
            await self._apply_reading(seq, begun.reading, begun.outcome, begun.done)
            return begun.outcome
        outcome = BatchOutcome()
        self._unyielded += 1  # even an empty or garbage batch is work
        if self.budget.exhausted():  # the fleet's work in this turn of the loop is done
            await self.yield_to_loop()
        reading = None
        if begun is None and self._read_plain is not None:
            if len(payload) > _DECODE_WHOLE_BYTES:
                # The index checks a long list without the GIL (most of a huge event's
                # reading), so the loop answers routes meanwhile. This batch waits for it;
                # the worker's next batches wait behind this one.
                reading = await self._away(asyncio.to_thread(self._read_plain, payload))
            else:
                reading = self._read_plain(payload)
        if reading is None:
            return await self._apply_decoded(seq, payload, outcome)
        outcome.data_parallel_rank = reading.data_parallel_rank
        outcome.events = len(reading)
        await self._apply_reading(seq, reading, outcome)
        return outcome

    async def _apply_reading(self, seq: int, reading: Any, outcome: BatchOutcome,
                             done: Run | None = None) -> None:
        """The plain path from the run ``done`` (or from event 0): runs, and each event no
        run takes rebuilt from ``reading`` a slice at a time."""
        budget = self.budget
        position, count = 0, len(reading)
        while done is not None or position < count:
            if done is None:
                if self._unyielded >= self.options.chunk_events or budget.exhausted():
                    await self.yield_to_loop()
                done = self._run(reading, position, outcome)
            position, run, done = done.next, done, None
            if run.error is not None:
                if not self._failed_at(seq, run.error, outcome):
                    return
                continue
            if run.full:
                await self.yield_to_loop()
                continue
            if position >= count:
                return
            if not await self._apply_read(seq, reading, position, outcome):
                return
            position += 1

    async def _apply_decoded(self, seq: int, payload: Payload, outcome: BatchOutcome,
                             ) -> BatchOutcome:
        """The decoded path: the envelope, then ``chunk_events`` events at a time, the loop
        running between chunks; an event too big to decode in one call goes through
        ``app.ingest.huge_store``."""
        started = time.perf_counter()
        try:
            batch = decode_envelope(payload)
        except WireError as exc:
            outcome.garbage = str(exc)
            await self._paused_if_long(started)  # garbage can be a long read, too
            return outcome
        outcome.data_parallel_rank = batch.data_parallel_rank
        await self._paused_if_long(started)
        step = self.options.chunk_events
        pieces = (piece for start in range(0, len(batch.events), step)
                  for piece in _split_huge(batch.events[start:start + step]))
        for raws, huge in pieces:
            if huge is not None and await self._apply_huge(seq, huge, outcome):
                continue
            started = time.perf_counter()
            events = decode_events(raws if huge is None else [huge], batch,
                                   raw_tokens=self._runs is not None)
            await self._paused_if_long(started)
            if not await self._apply_events(seq, events, batch, outcome):
                break
        outcome.malformed += batch.malformed
        outcome.unknown = batch.unknown
        return outcome

    def _run(self, events: Sequence[Any], position: int, outcome: BatchOutcome) -> Run:
        """One run of ``events`` from ``position`` (``index.runs``), within what is left of
        the bounds of work between two yields, counted into them and into ``outcome``."""
        options = self.options
        done = self._runs(self.worker, events, position,  # type: ignore[misc]
                          options.slice_blocks - self._unyielded_work,
                          options.chunk_events - self._unyielded, self._limits)
        self._unyielded += done.next - position
        self._unyielded_work += done.work
        outcome.blocks += done.blocks
        return done

    async def _apply_events(self, seq: int, events: list[Event], batch: EventBatch,
                            outcome: BatchOutcome) -> bool:
        """Apply decoded events, counting into ``outcome``; False when a bug stopped it
        (``outcome.failed`` says which). Runs of plain events (``index.runs``) go to the
        index in one call each, within the bounds of work between two yields; every other
        event goes one by one (removals next to each other coalesced)."""
        outcome.events += len(events)
        if self._runs is None:
            for event in coalesced(events):
                if not await self._apply_one(seq, event, outcome):
                    return False
            return True
        budget = self.budget
        position, count = 0, len(events)
        while position < count:
            if self._unyielded >= self.options.chunk_events or budget.exhausted():
                await self.yield_to_loop()
            run = self._run(events, position, outcome)
            position = run.next
            if run.error is not None:
                if not self._failed_at(seq, run.error, outcome):
                    return False
                continue
            if run.full or position >= count:
                continue
            # Not plain: this event, with the removals right after it, the way runs do not.
            end = position + 1
            if isinstance(events[position], BlockRemoved):
                while end < count and isinstance(events[end], BlockRemoved):
                    end += 1
            for event in coalesced(events[position:end]):
                if isinstance(event, RawStored):
                    plain_event = stored(event)
                    if plain_event is None:  # what decode_batch would have left out
                        batch.malformed += 1
                        outcome.events -= 1
                        continue
                    event = plain_event
                if not await self._apply_one(seq, event, outcome):
                    return False
            position = end
        return True

    async def _apply_one(self, seq: int, event: Event, outcome: BatchOutcome) -> bool:
        """Apply one event (caps, slices, yields), counting into ``outcome``; False when a
        bug stopped it."""
        self._unyielded += 1
        if self._unyielded >= self.options.chunk_events or self.budget.exhausted():
            await self.yield_to_loop()
        if isinstance(event, BlockStored) and self._over_a_cap(
                seq, len(event.block_hashes), bool(event.token_ids)):
            outcome.exact_again = False  # only a clear after the skip makes it exact
            return True
        try:
            outcome.blocks += await self._apply_event(event)
        except Abandoned:
            raise
        except Exception as exc:
            return self._failed_at(seq, exc, outcome)
        if isinstance(event, AllBlocksCleared):
            outcome.exact_again = True
        return True

    async def _apply_read(self, seq: int, reading: Any, k: int, outcome: BatchOutcome) -> bool:
        """Event ``k`` of the index's reading, which no run took: applied as ``_apply_one``
        applies a decoded event (the caps for the whole event first), from slices rebuilt
        one at a time (``app.ingest.plain_slices``). False when a bug stopped it."""
        kind, blocks, _, _ = reading.head(k)
        if kind == "BlockStored" and self._over_a_cap(seq, blocks, True):
            outcome.exact_again = False
            return True
        for piece in event_slices(reading, k, self.options.slice_blocks, self._holds):
            self._unyielded += 1
            if self._unyielded >= self.options.chunk_events or self.budget.exhausted():
                await self.yield_to_loop()
            try:
                outcome.blocks += await self._apply_event(piece)
            except Abandoned:
                raise
            except Exception as exc:
                return self._failed_at(seq, exc, outcome)
        return True

    def _failed_at(self, seq: int, exc: BaseException, outcome: BatchOutcome) -> bool:
        """Count an event the index raised for: a ``ValueError`` rejects that event (the
        batch goes on); anything else is a bug that ends the batch (returns False)."""
        if isinstance(exc, ValueError):
            outcome.malformed += 1
            outcome.rejected = f"seq {seq}: event rejected by the index: {exc}"
            return True
        log.error("%s: applying seq %d failed", self.worker, seq, exc_info=exc)
        outcome.failed = f"internal error applying seq {seq}: {exc!r}"
        return False

    async def _apply_huge(self, seq: int, raw: bytes, outcome: BatchOutcome) -> bool:
        """Apply one encoded event over ``HUGE_EVENT_BYTES`` without decoding it in one
        call (``app.ingest.huge_store``); False when it is not a store that way can take (decode
        it the ordinary way then: nothing was applied). Routes meanwhile see a prefix of
        its chain held, never more than the engine holds."""
        store = HugeStore.open(raw, self.options.slice_blocks)
        if store is None or not store.valid:
            return False
        if self._over_a_cap(seq, store.blocks, store.has_tokens):
            outcome.events += 1
            outcome.exact_again = False
            return True
        await self.yield_to_loop()
        for _ in store.decode_steps():
            if self.budget.exhausted():
                await self.yield_to_loop()
        if not store.valid:
            return False
        outcome.events += 1
        await self.yield_to_loop()  # resolving the parent and the first slice come next
        for piece in store.slices(self._holds):
            if self._unyielded_work or self.budget.exhausted():
                await self.yield_to_loop()
            self._unyielded_work += self._work(piece)
            outcome.blocks += apply_event(self.index, self.worker, piece)
        return True

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
                await self.yield_to_loop()
            self._unyielded_work += work
            return apply_event(self.index, self.worker, event)
        assert not isinstance(event, AllBlocksCleared)  # a clear is one call, whatever it costs
        # Decoding this event was one stretch already; slices() begins with another (a pass
        # over its tokens): let the loop run between the two.
        await self.yield_to_loop()
        applied = 0
        for piece in slices(event, budget, self._holds):
            work = self._work(piece)
            if (self._unyielded_work and self._unyielded_work + work > budget
                    or self.budget.exhausted()):
                await self.yield_to_loop()
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

    def _over_a_cap(self, seq: int, blocks: int, has_tokens: bool) -> bool:
        """Whether a store of ``blocks`` blocks is refused for a cap (module docstring)."""
        options = self.options
        if blocks > options.max_blocks_per_event:
            self._refused("oversized_events", f"seq {seq}: a BlockStored of {blocks} blocks "
                          f"is over max_blocks_per_event ({options.max_blocks_per_event})")
            return True
        if not has_tokens:
            return False  # an offload adds a medium to blocks the worker holds, never a block
        # Every block counts as new, also one stored again (that adds a reference, not a
        # block): telling them apart would cost a lookup per block.
        held = self.index.blocks_held(self.worker)
        if held + blocks > options.max_blocks_per_worker:
            self._refused("over_capacity", f"seq {seq}: storing {blocks} blocks would take "
                          f"the worker past max_blocks_per_worker "
                          f"({options.max_blocks_per_worker}); it holds {held}")
            return True
        return False

    async def yield_to_loop(self) -> None:
        """Let the loop run (queries, other workers); ``check`` may then void the step. When
        the fleet's ingest work of this turn is used up, that is until the next turn."""
        budget = self.budget
        await self._away(budget.next_turn() if budget.exhausted() else asyncio.sleep(0))

    async def _paused_if_long(self, started: float) -> None:
        """After decoding that began at ``started`` (``time.perf_counter``) in one call:
        when that was long, the loop gets about as long again (see ``_LONG_DECODE``)."""
        took = time.perf_counter() - started
        if took >= _LONG_DECODE:
            await self._away(asyncio.sleep(min(took, _MAX_PAUSE)))

    async def _away(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result: the loop runs meanwhile, so the work counted since the
        last yield starts again from nothing, and ``check`` may then void the step."""
        self._unyielded = 0
        self._unyielded_work = 0
        result = await awaitable
        self._check()
        return result
