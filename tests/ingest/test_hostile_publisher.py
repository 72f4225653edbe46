"""A hostile or broken publisher can neither exhaust kvroute's memory nor freeze its loop.

Through real ZMQ sockets on loopback: a frame over ``max_message_bytes`` never reaches the
index (live or replayed) and the worker recovers; a store over ``max_blocks_per_event`` or
past ``max_blocks_per_worker`` is counted and skipped while the rest of the stream applies;
garbage is counted as malformed; a huge store that is allowed is applied in slices with the
loop running between them. Without sockets: an event applied in slices (``wire.slices``)
leaves a PrefixIndex exactly as one call would, over random histories.

Nothing here measures time: the loop's responsiveness is asserted as the most blocks of
index work done between two turns of the loop (a concurrent task counts the turns).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    apply_event,
    decode_batch,
    decode_envelope,
    decode_events,
    encode_batch,
    slices,
)
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import (
    TEST_OPTIONS,
    EventSource,
    Ledger,
    Running,
    endpoint_of,
    run,
    subscribed,
    truth_index,
)
from tests.support.hostile import (
    WORKER,
    LoopWatchingIndex,
    chain,
    events,
    outcome,
    removals,
    settled,
    snapshot,
    stores,
    truth_of,
)
from tests.support.waiting import wait_until

# --- helpers ----------------------------------------------------------------------------------










def oversized_batch(seed: int, min_bytes: int) -> list[Event]:
    """One store whose encoded batch is over ``min_bytes`` (well under any block cap)."""
    blocks = min_bytes // 40  # a block of 16 tokens encodes to more than 40 bytes
    return [chain(1_000_000, blocks, block_size=16, seed=seed)]


# --- frames over max_message_bytes --------------------------------------------------------------

SMALL_FRAMES = dataclasses.replace(TEST_OPTIONS, max_message_bytes=64 * 1024)


def test_a_live_frame_over_max_message_bytes_never_reaches_the_index_and_the_worker_recovers():
    """ZMQ drops the connection (for good: kvroute connects again itself); the rebuild's
    replay drops too at that frame, so the batch is skipped, the worker cleared and degraded,
    and everything after it applied. A cache reset makes it exact, and live, again."""

    async def scenario(ctx):
        rig = subscribed(ctx, 1, index=PrefixIndex(), options=SMALL_FRAMES)
        async with rig as (pub, ledger, source, index, sub):
            for _ in range(3):
                ledger.publish(source.batch())
            await settled(sub, ledger, ("live",), "the batches before")
            big = oversized_batch(1, 2 * SMALL_FRAMES.max_message_bytes)
            big_seq = ledger.publish(big)
            after = [ledger.publish(source.batch()) for _ in range(3)]
            await settled(sub, ledger, ("degraded",), "the batches after the big frame")

            status = sub.status
            assert status.disconnects == 1 and status.unreceivable == 1
            assert f"batch {big_seq} could not be received" in (status.last_error or "")
            assert not any(index.holds_hash(WORKER, h) for h in big[0].block_hashes)
            # Exactly what came after the lost batch: nothing stale, nothing of it.
            assert snapshot(index, counters=False) == snapshot(truth_of(ledger, after),
                                                               counters=False)

            ledger.publish([AllBlocksCleared(), *source.batch()])
            ledger.publish(source.batch())
            await settled(sub, ledger, ("live",), "live again after a cache reset")
            assert snapshot(index, counters=False) == snapshot(truth_of(ledger),
                                                               counters=False)
    run(scenario)


class StallingIndex(PrefixIndex):
    """Holds the event loop, applying the store of hash STALL, until the publisher has sent
    everything queued so far and ZMQ had a moment to take it in: a busy subscriber."""

    STALL = 777_777
    # Every store through apply_stored, where the stall is: runs of plain events would
    # apply the STALL store without it, and the batches behind would not queue.
    apply_run = None

    def __init__(self, pub: EventPublisher) -> None:
        super().__init__()
        self.pub = pub

    def apply_stored(self, worker, block_hashes, *args, **kwargs) -> None:
        if list(block_hashes) == [self.STALL]:
            self.pub.flush()
            time.sleep(0.2)  # the loop is meant to be stuck here: nothing else can run
        super().apply_stored(worker, block_hashes, *args, **kwargs)


def test_a_big_frame_behind_queued_batches_is_survived():
    """The frame arrives while the subscriber is busy and earlier batches wait in ZMQ's
    queue. A poll on a SUB socket takes the first frame of the next queued message ahead
    (pyzmq polls whenever it looks for readiness; here the test does it, at the moment
    that matters); disconnecting that socket would then drop the rest of that message,
    which aborts the process in libzmq 4.3.5. The subscriber opens a new socket instead.
    A regression ends the test run with "Assertion failed: !_more (src/fq.cpp)"."""

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source, index = Ledger(pub), EventSource(8), StallingIndex(pub)
            # A yield after every event, so the drop is seen while batches are queued; a
            # reconnect interval long enough to poll the socket before kvroute replaces it.
            options = dataclasses.replace(SMALL_FRAMES, chunk_events=1, reconnect_ivl_ms=500)
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
            async with Running(sub):
                await wait_until(lambda: sub.status.state == "live", "first connection")
                ledger.publish([chain(StallingIndex.STALL, 1)])
                for _ in range(10):
                    ledger.publish(source.batch())
                ledger.publish(oversized_batch(8, 2 * SMALL_FRAMES.max_message_bytes))
                await wait_until(lambda: sub.status.state == "down", "the dropped connection")
                assert sub._live.socket.get(zmq.EVENTS) & zmq.POLLIN
                after = [ledger.publish(source.batch()) for _ in range(3)]
                await settled(sub, ledger, ("degraded",), "the batches after the big frame")
                assert sub.status.disconnects == 1 and sub.status.unreceivable == 1
                assert snapshot(index, counters=False) == snapshot(truth_of(ledger, after),
                                                                   counters=False)
    run(scenario)


def test_a_replayed_frame_over_max_message_bytes_is_skipped_and_the_replay_goes_on():
    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source, index = Ledger(pub), EventSource(2), PrefixIndex()
            before = [ledger.publish(source.batch()) for _ in range(2)]
            ledger.publish(oversized_batch(2, 2 * SMALL_FRAMES.max_message_bytes))
            after = [ledger.publish(source.batch()) for _ in range(2)]
            pub.flush()  # all buffered before the subscriber connects: only replay has them
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=SMALL_FRAMES)
            async with Running(sub):
                await settled(sub, ledger, ("degraded",), "the rebuild")
                status = sub.status
                assert status.unreceivable == 1 and status.disconnects == 0
                assert status.batches == len(before) + len(after)
                assert snapshot(index, counters=False) == snapshot(truth_of(ledger, after),
                                                                   counters=False)
    run(scenario)


# --- caps on stores ---------------------------------------------------------------------------


def test_a_store_over_max_blocks_per_event_is_counted_skipped_and_degrades_the_worker():
    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, max_blocks_per_event=64)
        rig = subscribed(ctx, 3, index=PrefixIndex(), options=options)
        async with rig as (pub, ledger, source, index, sub):
            first, big, under = chain(1, 10), chain(100, 65, seed=1), chain(200, 5, parent=10)
            seq = ledger.publish([first, big, under])
            ledger.sent[seq] = [first, under]  # what must apply: all but the big store
            # Removals are never skipped, however long: 10 held hashes and 90 unknown ones.
            ledger.publish([BlockRemoved(block_hashes=list(range(1, 101)))])
            ledger.publish([chain(300, 64, seed=2)])  # exactly the cap: applied
            await settled(sub, ledger, ("degraded",), "the batches around the big store")
            status = sub.status
            assert status.oversized_events == 1 and status.degraded_count == 1
            assert "65 blocks is over max_blocks_per_event (64)" in (status.last_error or "")
            assert index.blocks_held(WORKER) == 5 + 64
            assert snapshot(index) == snapshot(truth_of(ledger))

            # A clear before a skipped store does not make the worker exact; one after does.
            seq = ledger.publish([AllBlocksCleared(), big])
            ledger.sent[seq] = [AllBlocksCleared()]
            await settled(sub, ledger, ("degraded",), "a clear, then a big store")
            assert sub.status.oversized_events == 2 and sub.status.degraded_count == 1
            ledger.publish([big, AllBlocksCleared(), chain(400, 3)])
            ledger.sent[ledger.last] = [AllBlocksCleared(), chain(400, 3)]
            await settled(sub, ledger, ("live",), "a big store, then a clear")
            assert sub.status.oversized_events == 3
            assert snapshot(index) == snapshot(truth_of(ledger))
    run(scenario)


def test_a_store_past_max_blocks_per_worker_is_counted_and_skipped():
    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, max_blocks_per_worker=100)
        rig = subscribed(ctx, 4, index=PrefixIndex(), options=options)
        async with rig as (pub, ledger, source, index, sub):
            ledger.publish([chain(1, 60)])
            refused = [ledger.publish([chain(101, 50)])]  # 60 + 50: past the cap
            ledger.publish([chain(201, 40)])  # 60 + 40: at the cap, applied
            # An offload adds a medium to held blocks, never a block: never refused.
            ledger.publish([BlockStored(block_hashes=list(range(1, 11)), medium="CPU")])
            ledger.publish([BlockRemoved(block_hashes=list(range(1, 31)))])  # 20 leave
            ledger.publish([chain(301, 20)])  # back at 100
            refused.append(ledger.publish([chain(401, 1)]))
            await settled(sub, ledger, ("degraded",), "the stores around the cap")
            status = sub.status
            assert status.over_capacity == 2 and status.oversized_events == 0
            assert "past max_blocks_per_worker (100); it holds 100" in (status.last_error or "")
            assert index.blocks_held(WORKER) == 100
            for seq in refused:
                del ledger.sent[seq]  # the truth without them
            assert snapshot(index) == snapshot(truth_of(ledger))
    run(scenario)


# --- garbage ----------------------------------------------------------------------------------


def test_garbage_frames_are_counted_as_malformed_and_the_stream_goes_on():
    rng = random.Random(5)
    bad_event = {"type": "BlockStored", "block_hashes": "not a list", "block_size": 4}
    garbage = [
        rng.randbytes(60_000),  # noise, just under the frame limit
        msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}] * 500, 0])[:-100],
        msgspec.msgpack.encode({"ts": "yesterday", "events": 5}),
        msgspec.msgpack.encode([[[[[[[[1]]]]]]]] * 1000),  # nested, the wrong shape
        msgspec.msgpack.encode([1.0, [bad_event] * 800, 0]),  # 800 malformed events
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                       "token_ids": [2**32], "block_size": 1}], 0]),
    ]

    async def scenario(ctx):
        rig = subscribed(ctx, 6, index=PrefixIndex(), options=SMALL_FRAMES)
        async with rig as (pub, ledger, source, index, sub):
            for payload in garbage:
                assert len(payload) < SMALL_FRAMES.max_message_bytes
                ledger.publish(source.batch())
                ledger.publish_raw(payload)
            ledger.publish(source.batch())
            await settled(sub, ledger, ("live",), "the batches between the garbage")
            status = sub.status
            assert status.malformed == 4 + 800 + 1
            assert status.gaps == 0 and status.disconnects == 0 and status.degraded_count == 0
            assert snapshot(index) == snapshot(truth_index({WORKER: ledger}))
    run(scenario)


# --- a huge store that is allowed ---------------------------------------------------------------




@pytest.mark.parametrize("path", ["live", "replayed"])
def test_a_huge_allowed_store_is_applied_in_slices_with_the_loop_running_between(path):
    """20,000 blocks in one store, 10,000 of them removed by one event and 5,000 by as many
    single-hash events: never more than slice_blocks blocks between two turns of the loop,
    and the index ends up exactly as whole events would leave it."""
    slice_blocks = 256

    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, slice_blocks=slice_blocks)
        huge = chain(1, 20_000, block_size=16, seed=7, extra_keys=[None] * 20_000)
        batches = [
            [huge],
            [BlockRemoved(block_hashes=list(range(1, 20_001, 2)))],
            [BlockRemoved(block_hashes=[h]) for h in range(2, 10_001, 2)],
            [chain(30_000, 3, parent=20_000, block_size=16)],
        ]
        stop = asyncio.Event()
        index = LoopWatchingIndex()
        counting = asyncio.create_task(index.count_turns(stop))
        try:
            with EventPublisher() as pub:
                ledger = Ledger(pub)
                if path == "replayed":
                    for events in batches:
                        ledger.publish(events)
                    pub.flush()
                sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
                async with Running(sub):
                    if path == "live":
                        await wait_until(lambda: sub.status.state == "live", "connection")
                        for events in batches:
                            ledger.publish(events)
                    await settled(sub, ledger, ("live",), "the huge store and its removals")
        finally:
            stop.set()
            await counting
        assert index.blocks_held(WORKER) == 20_000 - 10_000 - 5_000 + 3
        assert 0 < index.most_between_turns <= slice_blocks
        assert len(index.turns_with_work) >= (20_000 + 10_000 + 5_000) // slice_blocks
        assert snapshot(index) == snapshot(truth_of(ledger))
    run(scenario)


def test_a_big_payload_of_small_events_is_decoded_a_chunk_at_a_time():
    """22,000 events in one 1 MB payload: decoded chunk_events at a time, so no turn of
    the loop sees more than that many events' work, and every malformed and unknown event
    is still counted."""

    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, chunk_events=128)
        removal = msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": [1]})
        bad = msgspec.msgpack.encode({"type": "BlockStored", "block_hashes": "no"})
        newer = msgspec.msgpack.encode({"type": "FromTheFuture", "x": 1})
        raws = [bad if k % 11 == 0 else newer if k % 11 == 5 else removal
                for k in range(22_000)]
        payload = b"\x93" + msgspec.msgpack.encode(1.0) + b"\xdd" + \
            len(raws).to_bytes(4, "big") + b"".join(raws) + b"\x00"
        assert len(payload) > 512 * 1024  # well past the size decoded in one call
        stop = asyncio.Event()
        index = LoopWatchingIndex()
        counting = asyncio.create_task(index.count_turns(stop))
        try:
            rig = subscribed(ctx, 9, index=index, options=options)
            async with rig as (pub, ledger, source, index, sub):
                ledger.publish([chain(1, 4)])
                ledger.publish_raw(payload)
                await settled(sub, ledger, ("live",), "the big payload")
        finally:
            stop.set()
            await counting
        assert sub.status.malformed == 2000 and sub.status.unknown == 2000
        assert index.stats().unknown_removals == 18_000 - 1  # hash 1 was held once
        assert 0 < index.most_between_turns <= 128
    run(scenario)


def test_decoding_the_envelope_then_slices_of_events_is_decode_batch():
    good = [chain(1, 2), BlockRemoved(block_hashes=[1]), AllBlocksCleared(), chain(5, 1)]
    unknown = {"type": "FromTheFuture"}
    bad = {"type": "BlockRemoved", "block_hashes": "no"}

    def mixed(*events: Any, rank: Any = 0) -> bytes:
        return msgspec.msgpack.encode([1.0, list(events), rank])

    as_maps = msgspec.msgpack.decode(encode_batch(good))[1]
    as_arrays = msgspec.msgpack.decode(encode_batch(good, encoding="array"))[1]
    payloads = [
        encode_batch(good), encode_batch(good, encoding="array"),
        mixed(*as_maps, *as_arrays),  # two encodings in one batch
        mixed(as_maps[0], bad, unknown, as_arrays[1], bad, as_maps[3]),
        mixed(*as_maps, rank="zero"),  # a garbled rank
        msgspec.msgpack.encode({"ts": 1.0, "events": as_maps}),  # a map envelope
        mixed(),
    ]
    for payload in payloads:
        whole = decode_batch(payload)
        for step in (1, 2, 3, 100):
            batch = decode_envelope(payload)
            raws = batch.events
            events = [e for at in range(0, len(raws), step)
                      for e in decode_events(raws[at:at + step], batch)]
            assert events == whole.events
            assert (batch.malformed, batch.unknown, batch.data_parallel_rank) == (
                whole.malformed, whole.unknown, whole.data_parallel_rank)


# --- slices against one call, without sockets ---------------------------------------------------









@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(history=st.lists(events, max_size=10), event=st.one_of(stores(), removals),
       max_blocks=st.integers(1, 5), guess=st.sampled_from(["nothing", "noise", "the event"]),
       noise=st.lists(st.integers(0, 3), max_size=64))
def test_an_event_applied_in_slices_leaves_the_index_as_one_call_would(history, event,
                                                                       max_blocks, guess,
                                                                       noise):
    """Guesses of the event's own prompt check that slices confirm what the whole would."""
    whole, sliced = PrefixIndex(), PrefixIndex()
    own = isinstance(event, BlockStored) and event.block_size > 0
    for index in (whole, sliced):
        for earlier in history:
            outcome(lambda index=index, earlier=earlier: apply_event(index, WORKER, earlier))
        if guess == "noise":
            index.place(WORKER, noise, block_size=4, expires=1.0)
        elif guess == "the event" and own:  # refused alike when a token is out of range
            outcome(lambda index=index: index.place(WORKER, event.token_ids,
                                                    block_size=event.block_size, expires=1.0))
    assert snapshot(sliced) == snapshot(whole)

    def in_slices() -> None:
        for piece in slices(event, max_blocks, lambda h: sliced.holds_hash(WORKER, h)):
            apply_event(sliced, WORKER, piece)

    assert outcome(in_slices) == outcome(lambda: apply_event(whole, WORKER, event))
    assert snapshot(sliced) == snapshot(whole)
    sliced._check()


def test_slices_hold_at_most_max_blocks_and_chain_through_the_previous_slice():
    event = chain(1, 10, parent=99, block_size=4, extra_keys=[None] * 9 + [("img",)])
    pieces = list(slices(event, 4))
    assert [p.block_hashes for p in pieces] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [p.parent_block_hash for p in pieces] == [99, 4, 8]
    assert [t for p in pieces for t in p.token_ids] == event.token_ids
    assert [k for p in pieces for k in p.extra_keys] == event.extra_keys
    # The worker does not hold the parent: every slice names it, all orphaned like the whole.
    assert [p.parent_block_hash for p in slices(event, 4, lambda h: False)] == [99, 99, 99]
    # 64-token blocks: at most 4 * 16 tokens per slice, so one block each.
    assert len(list(slices(chain(1, 3, block_size=64), 4))) == 3
    # What fits is not copied; a store whose tokens do not fit its blocks is not cut.
    assert next(slices(event, 10)) is event
    for malformed in (msgspec.structs.replace(event, token_ids=event.token_ids[:-1]),
                      msgspec.structs.replace(event, token_ids=[*event.token_ids[:-1], 2**32])):
        assert list(slices(malformed, 4)) == [malformed]
