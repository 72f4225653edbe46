"""A subscriber resuming from saved holdings, against the wire-exact publisher.

Each scenario runs a first subscriber, saves its worker as kvroute does (a save point and a
capture in one step, through the blob format), stops it, lets the publisher go on, and
starts a second subscriber on a fresh index with the saved worker. What the replay's first
batch says decides (app/ingest/subscriber.py, "Resume"); the index is then checked against the
publisher's truth (every batch it ever sent, in order).
"""

from __future__ import annotations

import time

from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import BlockRemoved, BlockStored, Event
from kvroute.app.state.format import (
    PIECE_BLOCKS,
    SavedWorker,
    StateWriter,
    WorkerHead,
    decode_state,
)
from kvroute.app.state.keeper import encode_worker
from kvroute.app.workers import WorkerEndpoint
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import (
    TEST_OPTIONS,
    EventSource,
    Ledger,
    Running,
    caught_up,
    endpoint_of,
    run,
    truth_index,
)
from tests.support.waiting import wait_until

BUFFER = 40  # the publisher's replay buffer, in batches


class EngineLikeSource(EventSource):
    """`EventSource` as an engine behaves: a removed block is never a parent again (vLLM
    stores a chain only under a block it holds, which is what lets a chain hang off an
    unconfirmed parent)."""

    def batch(self, n_events: int = 3) -> list[Event]:
        events = super().batch(n_events)
        for event in events:
            if isinstance(event, BlockRemoved):
                gone = set(event.block_hashes)
                self.held = [h for h in self.held if h not in gone]
        return events


async def save(sub: Subscriber, index: PrefixIndex) -> SavedWorker:
    """What StateKeeper saves for this worker, through the blob format and back."""
    point = sub.save_point()
    assert point is not None, sub.status
    encoded = await encode_worker(index, sub.endpoint, point)
    assert encoded is not None
    writer = StateWriter()
    writer.add_worker(*encoded)
    state = decode_state(b"".join(writer.finish()))
    return state.workers[sub.worker]


def handles(index: PrefixIndex, worker) -> dict:
    capture = index.capture(worker)
    if capture is None:
        return {}
    return {h: k for piece in capture.pieces(PIECE_BLOCKS) for h, k in zip(piece.hashes,
                                                                             piece.keys,
                                                                             strict=True)}


def stored_prompts(ledger: Ledger) -> list[list[int]]:
    return [e.token_ids for events in ledger.sent.values() if events
            for e in events if isinstance(e, BlockStored)]


async def first_run(ctx, pub: EventPublisher, ledger: Ledger, source: EventSource,
                    batches: int) -> SavedWorker:
    """A subscriber follows `batches` new batches live; its worker is saved at the end."""
    index = PrefixIndex()
    sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=TEST_OPTIONS)
    async with Running(sub):
        await wait_until(lambda: sub.status.state == "live", "first connection")
        for _ in range(batches):
            ledger.publish(source.batch())
        await wait_until(lambda: caught_up(sub, ledger), "first run caught up",
                         detail=lambda: sub.status)
        return await save(sub, index)


async def resumed(ctx, endpoint: WorkerEndpoint, saved: SavedWorker, ledger: Ledger | None,
                  states=("live",)) -> tuple[Subscriber, PrefixIndex, Running]:
    index = PrefixIndex()
    sub = Subscriber(endpoint, index, ctx=ctx, options=TEST_OPTIONS, saved=saved)
    running = Running(sub)
    await running.__aenter__()
    if ledger is None:
        await wait_until(lambda: sub.status.state in states, "resumed",
                         detail=lambda: sub.status)
    else:
        await wait_until(lambda: caught_up(sub, ledger, states), "resumed and caught up",
                         detail=lambda: sub.status)
    return sub, index, running


def test_a_gap_the_replay_covers_resumes_exactly_and_live() -> None:
    """More batches than the buffer keeps went by before the save: without the saved
    holdings the second subscriber could not learn the early blocks."""

    async def scenario(ctx) -> None:
        with EventPublisher(buffer_steps=BUFFER) as pub:
            ledger, source = Ledger(pub), EngineLikeSource(seed=3)
            saved = await first_run(ctx, pub, ledger, source, batches=3 * BUFFER)
            for _ in range(BUFFER // 2):  # while kvroute is down, within the buffer
                ledger.publish(source.batch())
            pub.flush()
            sub, index, running = await resumed(ctx, endpoint_of(pub), saved, ledger)
            try:
                assert sub.status.state == "live"
                assert sub.status.restored_blocks == saved.head.blocks > 0
                assert sub.status.restored_unconfirmed == 0
                truth = truth_index({sub.worker: ledger})
                assert handles(index, sub.worker) == handles(truth, sub.worker)
                for prompt in stored_prompts(ledger):
                    assert index.match(prompt) == truth.match(prompt)
                ledger.publish(source.batch())  # and it goes on live
                await wait_until(lambda: caught_up(sub, ledger), "next live batch")
                assert handles(index, sub.worker) == handles(
                    truth_index({sub.worker: ledger}), sub.worker)
                index._check()
            finally:
                await running.__aexit__(None, None, None)

            # The contrast: the same engine without the saved state loses the early blocks.
            sub, index, running = await resumed(ctx, endpoint_of(pub), None, ledger,
                                                states=("degraded",))
            try:
                assert len(handles(index, sub.worker)) < len(handles(truth, sub.worker))
            finally:
                await running.__aexit__(None, None, None)

    run(scenario)


def test_a_buffer_that_moved_on_keeps_the_saved_blocks_unconfirmed() -> None:
    async def scenario(ctx) -> None:
        with EventPublisher(buffer_steps=BUFFER) as pub:
            ledger, source = Ledger(pub), EngineLikeSource(seed=4)
            saved = await first_run(ctx, pub, ledger, source, batches=BUFFER)
            for _ in range(2 * BUFFER):  # kvroute down longer than the buffer covers
                ledger.publish(source.batch())
            pub.flush()
            sub, index, running = await resumed(ctx, endpoint_of(pub), saved, ledger,
                                                states=("degraded",))
            try:
                assert sub.status.restored_blocks == 0
                assert sub.status.restored_unconfirmed > 0
                assert index.unconfirmed_blocks(sub.worker) > 0
                truth = truth_index({sub.worker: ledger})
                real = handles(index, sub.worker)
                # Nothing unconfirmed is ever counted as really held, and what is really
                # held is true.
                assert set(real.items()) <= set(handles(truth, sub.worker).items())
                pending = 0
                for prompt in stored_prompts(ledger):
                    match = index.match(prompt)[sub.worker]
                    real_blocks = match.blocks - match.pending
                    assert real_blocks <= truth.match(prompt)[sub.worker].blocks
                    pending += match.pending
                assert pending > 0  # the saved blocks still count, as guesses
                index._check()
                # They expire.
                index.expire_unconfirmed(time.monotonic() + TEST_OPTIONS.unconfirmed_ttl + 1)
                assert index.unconfirmed_blocks(sub.worker) == 0
                assert all(index.match(p)[sub.worker].pending == 0
                           for p in stored_prompts(ledger))
            finally:
                await running.__aexit__(None, None, None)

    run(scenario)


def test_an_engine_restarted_meanwhile_is_not_resumed() -> None:
    """Behind (no batch at the saved seq) or ahead (another payload under it): either way
    the saved holdings are another engine's and are dropped."""

    async def scenario(ctx) -> None:
        for after_restart in (3, BUFFER):  # fewer batches than saved, then more
            with EventPublisher(buffer_steps=4 * BUFFER) as pub:
                ledger, source = Ledger(pub), EngineLikeSource(seed=5)
                saved = await first_run(ctx, pub, ledger, source, batches=BUFFER // 2)
                ledger.restart()
                source = EngineLikeSource(seed=6)
                for _ in range(after_restart):
                    ledger.publish(source.batch())
                pub.flush()
                sub, index, running = await resumed(ctx, endpoint_of(pub), saved, ledger)
                try:
                    assert sub.status.restored_blocks == 0
                    assert sub.status.restored_unconfirmed == 0
                    assert sub.status.restarts == 1
                    assert handles(index, sub.worker) == handles(
                        truth_index({sub.worker: ledger}), sub.worker)
                finally:
                    await running.__aexit__(None, None, None)

    run(scenario)


def test_without_a_replay_the_saved_blocks_are_unconfirmed() -> None:
    async def scenario(ctx) -> None:
        with EventPublisher(buffer_steps=BUFFER) as pub:
            ledger, source = Ledger(pub), EngineLikeSource(seed=7)
            saved = await first_run(ctx, pub, ledger, source, batches=10)
            no_replay = WorkerEndpoint("vllm-a", 0, pub.endpoint, None)
            sub, index, running = await resumed(ctx, no_replay, saved, None,
                                                states=("degraded",))
            try:
                assert sub.status.restored_unconfirmed == len(handles(
                    truth_index({sub.worker: ledger}), sub.worker))
                assert index.blocks_held(sub.worker) == 0
            finally:
                await running.__aexit__(None, None, None)

    run(scenario)


def altered(saved: SavedWorker, **changes: object) -> SavedWorker:
    fields = {name: getattr(saved.head, name) for name in WorkerHead.__struct_fields__}
    return SavedWorker(WorkerHead(**{**fields, **changes}), saved.pieces)


def test_a_saved_degraded_worker_resumes_degraded() -> None:
    async def scenario(ctx) -> None:
        with EventPublisher(buffer_steps=BUFFER) as pub:
            ledger, source = Ledger(pub), EngineLikeSource(seed=8)
            saved = altered(await first_run(ctx, pub, ledger, source, batches=5),
                            degraded=True)
            sub, _, running = await resumed(ctx, endpoint_of(pub), saved, ledger,
                                            states=("degraded",))
            try:
                assert sub.status.restored_blocks == saved.head.blocks
            finally:
                await running.__aexit__(None, None, None)

    run(scenario)


def test_a_save_without_a_fingerprint_cannot_be_confirmed() -> None:
    """The last batch's payload was not known when it was saved: the engine cannot be
    told from another, so the blocks are kept unconfirmed and the replay rebuilds from the
    saved seq on (the batch at that seq included)."""

    async def scenario(ctx) -> None:
        with EventPublisher(buffer_steps=BUFFER) as pub:
            ledger, source = Ledger(pub), EngineLikeSource(seed=9)
            saved = altered(await first_run(ctx, pub, ledger, source, batches=10),
                            fingerprint=None)
            sub, index, running = await resumed(ctx, endpoint_of(pub), saved, ledger,
                                                states=("degraded",))
            try:
                assert sub.status.restored_blocks == 0
                assert sub.status.restored_unconfirmed == saved.head.blocks
                truth = handles(truth_index({sub.worker: ledger}), sub.worker)
                real = handles(index, sub.worker)
                assert set(real.items()) <= set(truth.items())
                assert len(real) + index.unconfirmed_blocks(sub.worker) == len(truth)
                index._check()
            finally:
                await running.__aexit__(None, None, None)

    run(scenario)


def test_unconfirmed_blocks_survive_a_second_restart_with_the_time_they_had_left() -> None:
    """Down longer than the buffer, then restarted again quickly: the second resume is
    exact, and what was unconfirmed still counts (it is saved too), for no longer than
    it had left."""

    async def scenario(ctx) -> None:
        with EventPublisher(buffer_steps=BUFFER) as pub:
            ledger, source = Ledger(pub), EngineLikeSource(seed=10)
            saved = await first_run(ctx, pub, ledger, source, batches=BUFFER)
            for _ in range(2 * BUFFER):
                ledger.publish(source.batch())
            pub.flush()
            sub, index, running = await resumed(ctx, endpoint_of(pub), saved, ledger,
                                                states=("degraded",))
            try:
                unconfirmed = index.unconfirmed_blocks(sub.worker)
                assert unconfirmed > 0
                again = await save(sub, index)
            finally:
                await running.__aexit__(None, None, None)
            assert len(again.unconfirmed) > 0
            assert 0 < again.unconfirmed_left(time.time()) <= TEST_OPTIONS.unconfirmed_ttl
            sub, index, running = await resumed(ctx, endpoint_of(pub), again, ledger,
                                                states=("degraded",))
            try:
                assert sub.status.restored_blocks == again.head.blocks
                assert index.unconfirmed_blocks(sub.worker) == unconfirmed
                assert sub.status.restored_unconfirmed == unconfirmed
                index._check()
            finally:
                await running.__aexit__(None, None, None)

    run(scenario)
