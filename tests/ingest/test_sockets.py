"""app.ingest.sockets: plain ZeroMQ sockets read from the event loop, through real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from kvroute.app.ingest.sockets import BIG_FRAME_BYTES, LoopSocket, Monitor
from tests.support.waiting import run_async, wait_until


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@contextmanager
def _connected(ctx: zmq.Context, on_readable=None) -> Iterator[tuple[zmq.Socket, LoopSocket]]:
    """A plain PAIR bound on loopback and a LoopSocket PAIR connected to it; both closed."""
    sender = ctx.socket(zmq.PAIR)
    sender.setsockopt(zmq.LINGER, 0)
    try:
        port = sender.bind_to_random_port("tcp://127.0.0.1")
        reader = LoopSocket(ctx, zmq.PAIR, {zmq.LINGER: 0}, on_readable=on_readable)
        try:
            reader.socket.connect(f"tcp://127.0.0.1:{port}")
            yield sender, reader
        finally:
            reader.close()
    finally:
        sender.close(0)


def test_a_message_queued_before_the_wait_is_seen_without_a_signal(ctx) -> None:
    async def scenario() -> None:
        with _connected(ctx) as (sender, reader):
            sender.send(b"one")
            # It arrives, and the loop's callback takes the descriptor's signal meanwhile.
            await wait_until(reader.ready, what="the message queued")
            await asyncio.sleep(0.05)
            started = time.monotonic()
            assert await reader.wait(30.0)
            assert time.monotonic() - started < 10  # not the timeout: it was already there
            assert reader.recv() == [b"one"]
            assert reader.recv() is None

    run_async(scenario)


def test_a_big_frame_is_handed_over_in_place_and_outlives_the_next_messages(ctx) -> None:
    """Frames up to BIG_FRAME_BYTES are copied out as bytes; a bigger one is ZeroMQ's
    message itself, as a read-only memoryview: the same bytes, hashed as they hash, and
    still whole after later messages reuse the socket's buffers."""
    big = bytes(range(256)) * (BIG_FRAME_BYTES // 256 + 7)
    edge = b"e" * BIG_FRAME_BYTES

    async def scenario() -> None:
        with _connected(ctx) as (sender, reader):
            sender.send_multipart([b"seq", edge, big])
            await wait_until(reader.ready, what="the message queued")
            frames = reader.recv()
            assert frames is not None and [type(f) for f in frames] == [bytes, bytes,
                                                                      memoryview]
            held = frames[2]
            assert held.readonly and hash(held) == hash(big)
            for n in range(3):
                sender.send_multipart([b"seq", bytes([n]) * (2 * BIG_FRAME_BYTES)])
                await wait_until(reader.ready, what="a later message")
                later = reader.recv()
                assert later is not None and later[1] == bytes([n]) * (2 * BIG_FRAME_BYTES)
            assert held == big and bytes(held) == big

    run_async(scenario)


def test_a_wait_ends_with_a_message_a_timeout_or_a_wake(ctx) -> None:
    async def scenario() -> None:
        with _connected(ctx) as (sender, reader):
            assert not await reader.wait(0.05)  # nothing came: the timeout, False
            waiting = asyncio.ensure_future(reader.wait(30.0))
            await asyncio.sleep(0.05)
            sender.send(b"two")
            assert await asyncio.wait_for(waiting, 10)
            assert reader.recv() == [b"two"]
            waiting = asyncio.ensure_future(reader.wait(30.0))
            await asyncio.sleep(0.05)
            reader.wake()
            assert await asyncio.wait_for(waiting, 10) is False

    run_async(scenario)


def test_close_ends_a_wait_and_stops_the_callbacks(ctx) -> None:
    async def scenario() -> None:
        calls = []
        with _connected(ctx, on_readable=lambda: calls.append(1)) as (sender, reader):
            watched = reader.socket.getsockopt(zmq.FD)
            waiting = asyncio.ensure_future(reader.wait(30.0))
            await asyncio.sleep(0.05)
            reader.close()
            assert await asyncio.wait_for(waiting, 10) is False
            reader.close()  # twice is fine
            # The loop no longer watches the descriptor: there is nothing left to remove.
            assert asyncio.get_running_loop().remove_reader(watched) is False
            before = len(calls)
            # A PAIR blocks a send once it has seen its peer go; whether it has is a race.
            try:
                sender.send(b"after", zmq.NOBLOCK)
            except zmq.Again:
                pass
            await asyncio.sleep(0.2)
            assert len(calls) == before

    run_async(scenario)


def test_an_unread_message_does_not_keep_waking_the_loop(ctx) -> None:
    async def scenario() -> None:
        calls = []
        with _connected(ctx, on_readable=lambda: calls.append(1)) as (sender, reader):
            await asyncio.sleep(0.05)
            sender.send(b"left unread")
            await wait_until(lambda: calls, what="the callback told of the message")
            await asyncio.sleep(0.3)  # spinning on the descriptor would be thousands of calls
            assert len(calls) <= 3
            assert reader.recv() == [b"left unread"]  # still there to read

    run_async(scenario)


def test_a_monitor_passes_on_the_events_reported_before_anyone_read(ctx) -> None:
    """A fresh pipe's first messages do not signal the descriptor: without the read at
    creation, a handshake reported at once never woke the loop (workers stayed
    `connecting`)."""
    async def scenario() -> None:
        publisher = ctx.socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        port = publisher.bind_to_random_port("tcp://127.0.0.1")
        events: list[int] = []
        sub = LoopSocket(ctx, zmq.SUB, {zmq.LINGER: 0, zmq.SUBSCRIBE: b""})
        monitor = Monitor(ctx, sub.socket,
                          zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED, events.append)
        try:
            sub.socket.connect(f"tcp://127.0.0.1:{port}")
            await wait_until(lambda: zmq.EVENT_HANDSHAKE_SUCCEEDED in events,
                             what="the handshake reported")
            publisher.close(0)
            await wait_until(lambda: zmq.EVENT_DISCONNECTED in events, what="the drop reported")
            assert events.index(zmq.EVENT_HANDSHAKE_SUCCEEDED) < events.index(
                zmq.EVENT_DISCONNECTED)
        finally:
            monitor.close()
            monitor.close()  # twice is fine
            sub.close()
            publisher.close(0)

    run_async(scenario)
