"""Plain ZeroMQ sockets read straight from the event loop, and monitors that call back.

pyzmq's asyncio sockets make a future, a poll and several enum conversions for every
receive or wait, and a second (shadow) socket object each. With four sockets per worker
(the live SUB, the replay DEALER and a monitor of each), that machinery was a quarter of
the event loop's work when a hundred instances (800 workers) were added at once, in the
same loop that answers routes. Here a socket's file descriptor is handed to the loop once,
for the socket's life, and a wait is one future.

ZeroMQ's descriptor is not a readiness flag: it signals that the socket's state may have
changed, and reading ``ZMQ_EVENTS`` is what clears it (it signals again only after a later
change). A pipe's messages signal only once a read has found the pipe empty, which a fresh pipe's
reader has never done. Hence the rules this module keeps:
- every wait reads ``EVENTS`` first, so a message that came while nobody waited is seen at
  once instead of waiting for a signal that already went;
- the loop's reader callback reads ``EVENTS`` whether or not anyone waits, so a signal
  never stays set and the loop never spins on it;
- a socket read by callback (a monitor) is read empty once when it is made, and by every
  callback after.

Invariants: a socket has at most one waiter (it belongs to one task); its descriptor is
watched from creation until ``close``, which also ends a wait (with False). Made and used
on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from collections.abc import Callable, Mapping

import zmq

__all__ = ["BIG_FRAME_BYTES", "LoopSocket", "Monitor", "Received"]

#: A received frame over this size is not copied (``LoopSocket.recv``).
BIG_FRAME_BYTES = 1 << 20
#: A received frame: bytes, or a big one in place (its memoryview keeps the message alive).
Received = bytes | memoryview

_monitor_numbers = itertools.count()
_EVENT_ID = struct.Struct("=H")  # a monitor message's first frame starts with the event id


class LoopSocket:
    """One plain ZeroMQ socket of `kind`, its `options` set, its descriptor on the running
    loop. `on_readable` (if given) is called from the loop each time a message may be
    waiting; it must read everything queued (the descriptor does not signal again for
    messages already there) and must not block."""

    __slots__ = ("socket", "_loop", "_fd", "_waiter", "_wanted", "_on_readable")

    def __init__(self, ctx: zmq.Context, kind: int,
                 options: Mapping[int, int | bytes] | None = None, *,
                 on_readable: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[bool] | None = None
        self._wanted = zmq.POLLIN
        self._on_readable = on_readable
        self._fd: int | None = None
        self.socket: zmq.Socket[bytes] = ctx.socket(kind, socket_class=zmq.Socket)
        try:
            for option, value in (options or {}).items():
                self.socket.setsockopt(option, value)
            fd = self.socket.getsockopt(zmq.FD)
            self._loop.add_reader(fd, self._signalled)
            self._fd = fd
        except BaseException:
            self.socket.close(0)
            raise

    def ready(self, flag: int = zmq.POLLIN) -> bool:
        """Whether a receive (POLLIN) or a send (POLLOUT) would not block now."""
        return bool(self.socket.getsockopt(zmq.EVENTS) & flag)

    def recv(self) -> list[Received] | None:
        """The next queued message, or None if there is none: never waits.

        Its frames are read as ``zmq.Frame`` objects, whose ``more`` says whether another
        follows: ``recv_multipart`` asks the socket's ``RCVMORE`` option after each frame
        instead, through an enum conversion, a cost on every message received. A
        message's frames arrive together, so the rest is there. Each is copied out as bytes,
        but one over ``BIG_FRAME_BYTES`` is handed over in place, as a read-only memoryview
        of ZeroMQ's message: copying a huge one into fresh memory held the loop for the whole
        copy."""
        socket = self.socket
        try:
            frame = socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [frame.bytes if len(frame) <= BIG_FRAME_BYTES else _in_place(frame)]
        while frame.more:
            frame = socket.recv(zmq.NOBLOCK, copy=False)
            frames.append(frame.bytes if len(frame) <= BIG_FRAME_BYTES else _in_place(frame))
        return frames

    async def wait(self, seconds: float, flag: int = zmq.POLLIN) -> bool:
        """Whether the socket became ready for `flag` within `seconds`. False also at once
        when `wake()` or `close()` ends the wait."""
        if self.ready(flag):
            return True
        waiter = self._loop.create_future()
        self._waiter, self._wanted = waiter, flag
        timer = self._loop.call_later(seconds, _settle, waiter, False)
        try:
            return await waiter
        finally:
            timer.cancel()
            if self._waiter is waiter:
                self._waiter = None

    def wake(self) -> None:
        """End the current wait now, with False (nothing if none)."""
        _settle(self._waiter, False)

    def close(self) -> None:
        """Stop watching the descriptor, end a wait, close the socket (pending messages
        dropped). Safe to call more than once."""
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        self.wake()
        self.socket.close(0)

    def _signalled(self) -> None:
        try:
            events = self.socket.getsockopt(zmq.EVENTS)  # also what clears the signal
        except zmq.ZMQError:  # the context is being torn down: nothing more will come
            self.close()
            return
        if events & zmq.POLLIN and self._on_readable is not None:
            self._on_readable()
        if events & self._wanted:
            _settle(self._waiter, True)


class Monitor:
    """ZeroMQ's monitor of `watched` for `events`: each event's id is passed to `on_event`
    from the loop, in the order ZeroMQ reports them. `on_event` must not block."""

    __slots__ = ("_watched", "_pair", "_on_event")

    def __init__(self, ctx: zmq.Context, watched: zmq.Socket[bytes], events: int,
                 on_event: Callable[[int], None]) -> None:
        address = f"inproc://kvroute-monitor-{next(_monitor_numbers)}"
        self._watched = watched
        self._on_event = on_event
        self._pair: LoopSocket | None = None
        watched.monitor(address, events)
        try:
            self._pair = LoopSocket(ctx, zmq.PAIR, on_readable=self.take_events)
            self._pair.socket.connect(address)
        except BaseException:
            self.close()
            raise
        # A pipe signals the descriptor only once its reader has found it empty: read it
        # empty now, or the first events (reported before anyone read) never wake the loop.
        self.take_events()

    def take_events(self) -> None:
        """Pass on every event already reported (the loop calls this when some are)."""
        pair = self._pair
        while pair is not None and (frames := pair.recv()) is not None:
            self._on_event(_EVENT_ID.unpack_from(frames[0])[0])
            pair = self._pair  # `on_event` may have closed it

    def close(self) -> None:
        """Stop monitoring; no event is passed on after this. Safe to call more than once."""
        pair, self._pair = self._pair, None
        # Fails only when the watched socket is closed already, and its monitor with it.
        with contextlib.suppress(zmq.ZMQError):
            self._watched.disable_monitor()
        if pair is not None:
            pair.close()


def _in_place(frame: zmq.Frame) -> memoryview:
    """A big frame's bytes where ZeroMQ holds them, read-only (so they hash)."""
    return frame.buffer.toreadonly()


def _settle(waiter: asyncio.Future[bool] | None, result: bool) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(result)
