"""Subscribers against the wire-exact test publisher over real loopback TCP.

Ground truth is the publisher side's own bookkeeping (tests.support.events): every batch the
test published, applied in order to a fresh recording index. The subscriber's index must hold
exactly the same operation log for each worker (a clear wipes a worker's log, so the log is
"what the worker holds, and how it got there"). The real PrefixIndex is compared the same way
in test_subscriber_index.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import msgspec
import pytest
import zmq

from kvroute.app.ingest import subscriber as subscriber_module
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    apply_batch,
    encode_batch,
    encode_seq,
)
from kvroute.app.workers import COUNTERS, SubscriberHooks, WorkerEndpoint
from kvroute.sim.publisher import EventPublisher
from tests.support.events import (
    TEST_OPTIONS,
    EventSource,
    Ledger,
    OpLog,
    Running,
    caught_up,
    endpoint_of,
    run,
    subscribed,
)
from tests.support.waiting import refusing_ports, scaled, wait_until

SERVING = ("live", "degraded")


async def synced(sub: Subscriber, index: OpLog, ledger: Ledger, what: str) -> None:
    """Wait (cheaply) until `sub` has applied the ledger's last batch, then check once that
    the worker's log is exactly the ledger's truth."""
    await wait_until(lambda: caught_up(sub, ledger, SERVING), what, detail=lambda: sub.status)
    assert index.log(sub.worker) == ledger.truth(sub.worker), what


async def barrier(sub: Subscriber, index: OpLog, ledger: Ledger, source: EventSource) -> None:
    """Publish one more batch and wait for it: every live batch before it has been handled
    (the live queue is FIFO), so counters are final."""
    ledger.publish(source.batch())
    await synced(sub, index, ledger, "barrier batch")


FORMATS = [("map", "new"), ("array", "old"), ("map", "old"), ("array", "new")]


# --- scenarios ------------------------------------------------------------------------------


@pytest.mark.parametrize(("encoding", "replay_format"), FORMATS)
def test_started_after_the_publisher_learns_existing_state_by_replay(encoding, replay_format):
    async def scenario(ctx):
        rig = subscribed(ctx, 1, backlog=30, wait_live=False,
                         encoding=encoding, replay_format=replay_format)
        async with rig as (pub, ledger, source, index, sub):
            await synced(sub, index, ledger, "replayed state")
            assert sub.status.state == "live"
            assert sub.status.replays >= 1 and sub.status.batches == 30
            for _ in range(10):  # and goes on live from there
                ledger.publish(source.batch())
            await synced(sub, index, ledger, "live state")
            assert sub.status.gaps == 0 and sub.status.restarts == 0
            assert index.log(sub.worker)  # the scenario really stored something
    run(scenario)


@pytest.mark.parametrize(("encoding", "replay_format"), FORMATS)
def test_dropped_live_batches_are_recovered_exactly_by_replay(encoding, replay_format):
    async def scenario(ctx):
        rig = subscribed(ctx, 2, encoding=encoding, replay_format=replay_format)
        async with rig as (pub, ledger, source, index, sub):
            ledger.publish(source.batch())
            await synced(sub, index, ledger, "seq 0")
            pub.drop_live([3, 4, 5, 9])
            for _ in range(12):
                ledger.publish(source.batch())
            await synced(sub, index, ledger, "recovered state")
            await barrier(sub, index, ledger, source)
            # The replay for the first gap may already cover the second one.
            assert 1 <= sub.status.gaps <= 2
            assert sub.status.restarts == 0 and sub.status.degraded_count == 0
            assert sub.status.state == "live"
    run(scenario)


def test_dropped_tail_batches_are_found_when_the_stream_goes_quiet():
    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, idle_check=0.3)
        async with subscribed(ctx, 3, options=options) as (pub, ledger, source, index, sub):
            for _ in range(3):
                ledger.publish(source.batch())
            pub.drop_live([3, 4])
            ledger.publish(source.batch())
            ledger.publish(source.batch())  # the last two never arrive live
            await synced(sub, index, ledger, "tail recovered")
            assert sub.status.gaps == 0  # no later batch revealed them: the idle check did
    run(scenario)


@pytest.mark.parametrize("backlog", [0, 3])
def test_batches_sent_while_the_subscription_travels_are_found_soon_after_a_rebuild(
        backlog, monkeypatch):
    """A PUB drops what it sends before a new subscription has reached it, and the rebuild's
    replay may have been answered before those batches were sent. With the usual idle check
    an hour away, the check that follows every rebuild finds them, also when no batch had
    been heard before (an empty replay: no tail to check by the usual rule)."""
    # Time for the batches below to be sent before that check (at 2-6 s with its jitter),
    # even on a loaded machine: a check that came first would find nothing, and the next
    # one is an hour away.
    monkeypatch.setattr(subscriber_module, "SUBSCRIBE_SETTLE", 4.0)

    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, idle_check=3600.0)
        async with subscribed(ctx, 4, options=options, backlog=backlog) as (
                pub, ledger, source, index, sub):
            pub.drop_live([pub.next_seq, pub.next_seq + 1])  # as if sent before subscribed
            ledger.publish(source.batch())
            ledger.publish(source.batch())
            pub.flush()
            await synced(sub, index, ledger, "the batches the subscription missed")
            assert sub.status.gaps == 0  # nothing revealed them but the check
    run(scenario)


def test_duplicates_after_a_replay_under_load_are_skipped_not_taken_for_a_restart():
    async def scenario(ctx):
        async with subscribed(ctx, 4) as (pub, ledger, source, index, sub):
            rng = random.Random(4)
            # Drops scattered through a fast stream: each replay overlaps live batches
            # still queued behind it.
            pub.drop_live(s for s in range(5, 1500) if rng.random() < 0.03)
            for _ in range(1500):
                ledger.publish(source.batch(2))
            await synced(sub, index, ledger, "state after load")
            await barrier(sub, index, ledger, source)
            status = sub.status
            assert status.restarts == 0 and status.degraded_count == 0
            assert status.gaps >= 1 and status.duplicates >= 1
            assert status.batches == 1501
    run(scenario)


def test_holes_inside_a_replay_are_asked_for_again():
    async def scenario(ctx):
        async with subscribed(ctx, 5, replay_format="old") as (pub, ledger, source, index, sub):
            ledger.publish(source.batch())
            await synced(sub, index, ledger, "seq 0")
            pub.drop_live([1, 2, 3, 4])
            pub.drop_from_next_replay([3])
            for _ in range(6):
                ledger.publish(source.batch())
            await synced(sub, index, ledger, "state after hole")
            assert sub.status.replays >= 3  # connect, the gap, the hole
            assert sub.status.degraded_count == 0
    run(scenario)


def test_a_replay_that_stalls_is_asked_again_after_what_it_already_applied():
    # The first answer stops after 4 of 8 batches; while the subscriber waits for the rest,
    # the engine moves on and its buffer (8 batches) no longer holds seq 0. Asked again from
    # 0, the answer would start at 3: history lost, the worker cleared and degraded. Asked
    # from 4, the replay finishes what the first answer began.
    options = dataclasses.replace(TEST_OPTIONS, replay_timeout=scaled(2.0))

    async def scenario(ctx):
        with EventPublisher(buffer_steps=8) as pub:
            ledger, source = Ledger(pub), EventSource(11)
            for _ in range(8):
                ledger.publish(source.batch())
            pub.flush()
            pub.cut_next_replay(after=4)
            index = OpLog()
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
            async with Running(sub):
                await wait_until(lambda: sub.status.last_seq == 3, "the first 4 batches",
                                 detail=lambda: sub.status)
                for _ in range(3):
                    ledger.publish(source.batch())
                pub.flush()
                assert pub.buffered_seqs() == list(range(3, 11))
                await synced(sub, index, ledger, "the rest of the replay")
                assert pub.replay_starts[:2] == [0, 4]
                assert sub.status.state == "live" and sub.status.degraded_count == 0
                assert sub.status.replay_failures == 0
    run(scenario)


def test_buffer_overflow_degrades_then_rebuilds_a_correct_index():
    async def scenario(ctx):
        async with subscribed(ctx, 6, buffer_steps=5) as (pub, ledger, source, index, sub):
            ledger.publish(source.batch())
            await synced(sub, index, ledger, "seq 0")
            pub.drop_live(range(1, 12))  # more than the buffer holds
            for _ in range(13):
                ledger.publish(source.batch())
            pub.flush()
            kept = pub.buffered_seqs()
            assert kept == list(range(9, 14))
            # What can be known: exactly the batches still buffered, nothing stale.
            await wait_until(lambda: sub.status.last_seq == 13, "rebuilt from the buffer",
                             detail=lambda: sub.status)
            assert index.log(sub.worker) == ledger.truth(sub.worker, kept)
            assert sub.status.state == "degraded" and sub.status.degraded_count == 1
            # A cache reset makes the state exact again: back to live, equal to the truth.
            ledger.publish([AllBlocksCleared(), *source.batch()])
            await synced(sub, index, ledger, "state after reset")
            assert sub.status.state == "live"
    run(scenario)


def test_publisher_restart_clears_the_worker_and_replays_from_zero():
    async def scenario(ctx):
        async with subscribed(ctx, 7, wait_live=False) as (pub, ledger, source, index, sub):
            for _ in range(8):
                ledger.publish(source.batch())
            await synced(sub, index, ledger, "before restart")
            before = index.log(sub.worker)
            ledger.restart()
            fresh = EventSource(70)
            for _ in range(3):
                ledger.publish(fresh.batch())
            await synced(sub, index, ledger, "after restart")
            assert sub.status.restarts == 1
            assert not set(before) & set(index.log(sub.worker))  # nothing stale kept
    run(scenario)


def test_malformed_payloads_are_counted_and_skipped_while_the_subscriber_carries_on():
    good_and_bad_events = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 4},
        {"type": "BlockStored", "block_hashes": "not a list", "token_ids": [], "block_size": 4},
        {"type": "BlockRemoved", "block_hashes": [11], "medium": 7},
        {"type": "SomethingNewer", "payload": [1, 2]},
        {"type": "BlockRemoved", "block_hashes": [11]},
    ], 0])
    rng = random.Random(8)
    garbage = [
        bytes(rng.getrandbits(8) for _ in range(40)),  # random bytes
        msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}], 0])[:-3],  # truncated
        msgspec.msgpack.encode({"ts": "yesterday", "events": 5}),  # wrong types
        b"",
    ]

    async def scenario(ctx):
        async with subscribed(ctx, 8) as (pub, ledger, source, index, sub):
            ledger.publish(source.batch())
            for payload in garbage:
                ledger.publish_raw(payload)
                ledger.publish(source.batch())
            seq = ledger.publish_raw(good_and_bad_events)
            ledger.sent[seq] = [  # the two well-formed events are what must apply
                BlockStored(block_hashes=[11], token_ids=[1, 2, 3, 4], block_size=4),
                BlockRemoved(block_hashes=[11])]
            ledger.publish(source.batch())
            await synced(sub, index, ledger, "state after garbage")
            assert sub.status.malformed == len(garbage) + 2
            assert sub.status.unknown == 1
            assert sub.status.gaps == 0 and sub.status.restarts == 0
            assert sub.status.state == "live"
    run(scenario)


def test_frames_that_are_not_a_batch_message_are_counted_and_skipped():
    """A raw PUB (no replay endpoint) sends wrong frame counts and bad seq frames."""

    async def scenario(ctx):
        raw = ctx.socket(zmq.PUB)
        try:
            port = raw.bind_to_random_port("tcp://127.0.0.1")
            index = OpLog()
            endpoint = WorkerEndpoint("raw", 0, f"tcp://127.0.0.1:{port}", None)
            sub = Subscriber(endpoint, index, ctx=ctx, options=TEST_OPTIONS)
            source = EventSource(9)
            batches = [source.batch() for _ in range(3)]
            payloads = [encode_batch(b, dp_rank=0) for b in batches]
            async with Running(sub):
                await wait_until(lambda: sub.status.state == "live", "connection")
                # The subscription reaches the PUB a little after the handshake: resend the
                # first message until it is seen (the subscriber dedups by seq anyway).
                async def resend_first() -> None:
                    while True:
                        await raw.send_multipart([b"t", encode_seq(0), payloads[0]])
                        await asyncio.sleep(0.02)

                resending = asyncio.create_task(resend_first())
                try:
                    await wait_until(lambda: sub.status.last_seq is not None,
                                     "the first message to get through")
                finally:
                    resending.cancel()
                    await asyncio.gather(resending, return_exceptions=True)
                await raw.send_multipart([b"t", encode_seq(1)])  # two frames
                await raw.send_multipart([b"t", b"\x01\x02", payloads[1]])  # 2-byte seq
                await raw.send_multipart([b"t", encode_seq(1), payloads[1], b"x"])  # four
                await raw.send_multipart([b"t", encode_seq(1), payloads[1]])
                await raw.send_multipart([b"t", encode_seq(2), payloads[2]])
                await wait_until(lambda: sub.status.last_seq == 2, "seq 2")
                truth = OpLog()
                for b in batches:
                    apply_batch(truth, endpoint.worker, EventBatch(0.0, list(b)))
                assert index.log(endpoint.worker) == truth.log(endpoint.worker)
                assert sub.status.malformed == 3
        finally:
            raw.close(0)

    run(scenario)


def test_two_data_parallel_ranks_feed_one_index_as_two_workers():
    async def scenario(ctx):
        with EventPublisher(dp_rank=0) as rank0, EventPublisher(dp_rank=1) as rank1:
            index = OpLog()
            ledgers = [Ledger(rank0), Ledger(rank1)]
            sources = [EventSource(10), EventSource(11)]
            subs = [Subscriber(endpoint_of(p, rank=r), index, ctx=ctx, options=TEST_OPTIONS)
                    for r, p in enumerate((rank0, rank1))]
            async with Running(subs[0]), Running(subs[1]):
                for _ in range(20):
                    for ledger, source in zip(ledgers, sources, strict=True):
                        ledger.publish(source.batch())
                for sub, ledger in zip(subs, ledgers, strict=True):
                    await synced(sub, index, ledger, f"rank {sub.worker[1]}")
                assert index.log(("vllm-a", 0)) != index.log(("vllm-a", 1))
    run(scenario)


def test_disconnect_marks_down_then_reconnect_rebuilds_from_a_replay():
    async def scenario(ctx):
        first = EventPublisher().start()
        endpoints = (first.endpoint, first.replay_endpoint)
        second = None
        try:
            ledger, source, index = Ledger(first), EventSource(12), OpLog()
            states: list[str] = []

            class Hooks(SubscriberHooks):
                def state_changed(self, worker, state):
                    states.append(state)

            sub = Subscriber(endpoint_of(first), index, ctx=ctx, options=TEST_OPTIONS,
                             hooks=Hooks())
            async with Running(sub):
                for _ in range(5):
                    ledger.publish(source.batch())
                await synced(sub, index, ledger, "before disconnect")
                first.close()
                await wait_until(lambda: sub.status.state == "down", "down")
                assert not sub.status.serving
                assert index.log(sub.worker) == []  # nothing kept across a disconnect
                assert "disconnected" in (sub.status.last_error or "")
                # The engine comes back on the same ports with a different cache, and its seq
                # has already passed the old one: only the disconnect tells.
                second = EventPublisher(*endpoints).start()
                ledger, source = Ledger(second), EventSource(13)
                for _ in range(9):
                    ledger.publish(source.batch())
                await synced(sub, index, ledger, "rebuilt")
                assert sub.status.disconnects == 1 and sub.status.serving
                assert states[:2] == ["replaying", "live"] and "down" in states
        finally:
            first.close()
            if second is not None:
                second.close()

    run(scenario)


def test_unreachable_endpoint_is_down_until_the_publisher_appears():
    async def scenario(ctx):
        refusing = contextlib.ExitStack()
        # Two ports nobody listens on, for now.
        port, replay_port = refusing.enter_context(refusing_ports(2))
        endpoint = WorkerEndpoint("late", 0, f"tcp://127.0.0.1:{port}",
                                  f"tcp://127.0.0.1:{replay_port}")
        index = OpLog()
        sub = Subscriber(endpoint, index, ctx=ctx, options=TEST_OPTIONS)
        async with Running(sub):
            try:
                await wait_until(lambda: sub.status.state == "down", "down")
                assert "cannot connect" in (sub.status.last_error or "")
            finally:
                refusing.close()  # the engine comes up on those ports
            with EventPublisher(endpoint.endpoint, endpoint.replay_endpoint) as pub:
                ledger, source = Ledger(pub), EventSource(14)
                for _ in range(4):
                    ledger.publish(source.batch())
                await synced(sub, index, ledger, "up")
    run(scenario)


def test_a_gap_no_replay_can_fill_leaves_the_worker_cleared_and_degraded():
    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source, index = Ledger(pub), EventSource(15), OpLog()
            # The replay endpoint answers nothing: a ROUTER that never replies.
            silent = ctx.socket(zmq.ROUTER)
            silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
            try:
                endpoint = WorkerEndpoint("x", 0, pub.endpoint, f"tcp://127.0.0.1:{silent_port}")
                options = dataclasses.replace(TEST_OPTIONS, replay_timeout=0.1)
                sub = Subscriber(endpoint, index, ctx=ctx, options=options)
                async with Running(sub):
                    await wait_until(lambda: sub.status.state == "degraded", "first connection")
                    assert sub.status.replay_failures == 1  # nothing learnt at connect
                    first = ledger.publish(source.batch())
                    await wait_until(lambda: sub.status.last_seq == first, "first live batch")
                    pub.drop_live([first + 1])
                    ledger.publish(source.batch())
                    last = ledger.publish(source.batch())
                    await wait_until(lambda: sub.status.last_seq == last, "after the gap")
                    # Only what came after the hole: nothing that may be stale.
                    assert index.log(sub.worker) == ledger.truth(sub.worker, [last])
                    assert sub.status.state == "degraded" and sub.status.replay_failures == 2
                    assert "could not be recovered" in (sub.status.last_error or "")
            finally:
                silent.close(0)
    run(scenario)


class TickingLog(OpLog):
    """Records, for each stored event, how often a concurrent task had run by then."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0
        self.ticks_seen: list[int] = []

    def apply_stored(self, worker, *args, **kwargs) -> None:
        self.ticks_seen.append(self.ticks)
        super().apply_stored(worker, *args, **kwargs)

    async def tick_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.ticks += 1
            await asyncio.sleep(0)


@pytest.mark.parametrize("shape", ["one big batch", "a long replay of small batches"])
def test_applying_yields_to_the_event_loop_between_chunks_of_events(shape):
    async def scenario(ctx):
        stop = asyncio.Event()
        with EventPublisher() as pub:
            ledger, source, index = Ledger(pub), EventSource(16), TickingLog()
            options = dataclasses.replace(TEST_OPTIONS, chunk_events=50)
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
            stores = [e for _ in range(200) for e in source.batch(10)
                      if isinstance(e, BlockStored)]
            assert len(stores) > 600
            if shape != "one big batch":
                for event in stores:  # all buffered before the subscriber connects
                    ledger.publish([event])
                pub.flush()
            ticking = asyncio.create_task(index.tick_until(stop))
            try:
                async with Running(sub):
                    if shape == "one big batch":
                        await wait_until(lambda: sub.status.state == "live", "connection")
                        index.ticks_seen.clear()
                        ledger.publish(stores)
                    await synced(sub, index, ledger, shape)
            finally:
                stop.set()
                await ticking
            # Events of one chunk see one tick value; the loop ran between chunks.
            assert len(set(index.ticks_seen)) >= len(stores) // 50
    run(scenario)


def test_counters_are_kept_once_in_the_status():
    async def scenario(ctx):
        async with subscribed(ctx, 17) as (pub, ledger, source, index, sub):
            ledger.publish(source.batch())
            pub.drop_live([1])
            ledger.publish(source.batch())
            ledger.publish(source.batch())
            await synced(sub, index, ledger, "synced")
        status = sub.status
        sent = [events for events in ledger.sent.values() if events is not None]
        # The dropped batch arrived by replay: applied once, counted once.
        assert status.batches == len(sent) == 3 and status.gaps == 1
        assert status.events == sum(len(events) for events in sent)
        assert status.replays >= 2  # the first connection's and the gap's
        assert all(getattr(status, field) >= 0 for field in COUNTERS)
    run(scenario)


def test_an_index_failure_clears_the_worker_and_the_subscription_goes_on():
    class FailingOnce(OpLog):
        def __init__(self) -> None:
            super().__init__()
            self.failed = False

        def apply_stored(self, worker, block_hashes, *args, **kwargs) -> None:
            if 666 in block_hashes and not self.failed:
                self.failed = True
                raise RuntimeError("index bug")
            super().apply_stored(worker, block_hashes, *args, **kwargs)

    async def scenario(ctx):
        async with subscribed(ctx, 18, index=FailingOnce()) as (pub, ledger, source, index, sub):
            ledger.publish(source.batch())
            bad = ledger.publish([BlockStored(block_hashes=[666], token_ids=[1, 2],
                                              block_size=2)])
            after = [ledger.publish(source.batch()) for _ in range(3)]
            await wait_until(lambda: sub.status.last_seq == after[-1], "after the failure")
            assert index.failed and sub.status.state == "degraded"
            assert "internal error applying seq" in (sub.status.last_error or "")
            # What came before the failure is gone; what came after is all there.
            assert index.log(sub.worker) == ledger.truth(sub.worker, after)
            assert sub.status.gaps == 0 and bad + 1 == after[0]
    run(scenario)
