"""The test publisher speaks vLLM's wire protocol frame for frame (raw sync ZMQ peers)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvroute.app.ingest.wire import END_SEQ, AllBlocksCleared, BlockStored, decode_batch, encode_seq
from kvroute.sim.publisher import EventPublisher
from tests.support.waiting import scaled


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(ctx: zmq.Context, pub: EventPublisher, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(topic)
    sub.connect(pub.endpoint)
    return sub


def replay(ctx: zmq.Context, pub: EventPublisher, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", encode_seq(start)])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay reply within 5 s"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if END_SEQ in frames:
                return replies
    finally:
        dealer.close(0)


def recv_live(sub: zmq.Socket, pub: EventPublisher, n: int) -> list[list[bytes]]:
    """Collect n live messages (bounded in time)."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + scaled(30)
    while len(got) < n and time.monotonic() < deadline:
        if sub.poll(50):
            got.append(sub.recv_multipart())
    return got


@pytest.mark.parametrize("replay_format", ["new", "old"])
def test_replay_frames_are_exactly_vllms(ctx, replay_format):
    with EventPublisher(topic="kv-events", replay_format=replay_format, buffer_steps=3) as pub:
        for i in range(5):
            pub.publish([BlockStored(block_hashes=[i], token_ids=[i], block_size=1)])
        pub.flush()
        replies = replay(ctx, pub, 0)
    payloads = [r[-1] for r in replies[:-1]]
    seqs = [encode_seq(s) for s in (2, 3, 4)]  # only the last buffer_steps batches
    if replay_format == "new":
        assert [r[:3] for r in replies[:-1]] == [[b"", b"kv-events", s] for s in seqs]
        assert replies[-1] == [b"", b"", END_SEQ, b""]
    else:
        assert [r[:2] for r in replies[:-1]] == [[b"", s] for s in seqs]
        assert replies[-1] == [b"", END_SEQ, b""]
    assert [decode_batch(p).events[0].block_hashes for p in payloads] == [[2], [3], [4]]


def test_live_frames_topic_seq_payload_and_drops_restart(ctx):
    with EventPublisher(topic="kv-events", encoding="array", dp_rank=3) as pub:
        sub = subscribe(ctx, pub, b"kv-events")
        other = subscribe(ctx, pub, b"other-topic")
        try:
            deadline = time.monotonic() + scaled(30)
            while not sub.poll(50) and time.monotonic() < deadline:  # until subscribed
                pub.publish([AllBlocksCleared()])
            first_seq = int.from_bytes(sub.recv_multipart()[1], "big")
            while sub.poll(100):  # the rest of the probes
                sub.recv_multipart()
            base = pub.next_seq
            pub.drop_live([base + 1])
            for _ in range(3):
                pub.publish([AllBlocksCleared()])
            got = recv_live(sub, pub, 2)
            assert [(t, int.from_bytes(s, "big")) for t, s, _ in got] == [
                (b"kv-events", base), (b"kv-events", base + 2)]
            payload = msgspec.msgpack.decode(got[0][2])
            assert payload[1] == [["AllBlocksCleared"]] and payload[2] == 3
            assert first_seq >= 0 and not other.poll(100)  # topic filtering is the SUB's
            pub.flush()
            assert base + 1 in pub.buffered_seqs()  # dropped live, still replayable
            pub.restart()
            assert pub.publish([AllBlocksCleared()]) == 0
            pub.flush()
            assert pub.buffered_seqs() == [0]
            got = recv_live(sub, pub, 1)
            assert int.from_bytes(got[0][1], "big") == 0
        finally:
            sub.close(0)
            other.close(0)


def test_bad_replay_requests_are_ignored_and_later_ones_answered(ctx):
    with EventPublisher() as pub:
        pub.publish([AllBlocksCleared()])
        pub.flush()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", b"\x00\x01"])        # a 2-byte seq
            dealer.send_multipart([b"", encode_seq(0), b"x"])  # an extra frame
            assert not dealer.poll(200)
        finally:
            dealer.close(0)
        assert [r[2] for r in replay(ctx, pub, 0)] == [encode_seq(0), END_SEQ]
        assert pub.replays_served == 1


def test_close_frees_the_ports_for_a_restarted_engine():
    first = EventPublisher().start()
    endpoints = (first.endpoint, first.replay_endpoint)
    first.close()
    with EventPublisher(*endpoints) as second:
        assert (second.endpoint, second.replay_endpoint) == endpoints
    with pytest.raises(ValueError, match="encoding"):
        EventPublisher(encoding="json")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="could not bind"):
        EventPublisher(endpoint="tcp://256.0.0.1:1").start()
