"""One replay request to a publisher's ROUTER, on a worker's DEALER socket.

A request is ``[b"", start_seq]``; the ROUTER answers with the batches it still buffers from
``start_seq`` on, then an end marker (``wire.decode_replay_frame`` reads both formats). This
module only moves frames: what they mean (a hole, history lost, a restart) is the
subscriber's to judge.

A worker's ``ReplayChannel`` keeps its DEALER between requests, but only after an answer
that ended with its end marker (``ReplayRequest.finished``): then the ROUTER has sent
everything for it and the socket holds nothing more. After a timeout, a dropped connection
or any other end, the socket is closed, since a DEALER keeps whatever a ROUTER sent it and
a reused one could deliver the late tail of the previous answer as if it were the next
one's. So a quiet fleet's idle checks cost no new socket and no new connection each, as
long as the fleet's `KeptChannels` keeps the channel (every worker's, when the open-file
limit allows).
"""

from __future__ import annotations

import asyncio

import zmq

from kvroute.app.ingest.replay_channels import KeptChannels
from kvroute.app.ingest.sockets import LoopSocket, Monitor, Received
from kvroute.app.ingest.wire import encode_seq

# Replies queued before a replay connection dropped can surface up to this long after the
# drop is reported (the report travels on the monitor's own socket).
_DROP_GRACE = 0.2


class ReplayChannel:
    """A worker's DEALER (and the monitor that reports its drops) to one replay endpoint,
    opened on first use and kept while answers end cleanly. ``close`` releases both."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *,
                 max_message_bytes: int, kept: KeptChannels | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._kept = kept
        self.in_use = False  # a request is open on it: never closed to make room
        self._max_message_bytes = max_message_bytes
        self._dealer: LoopSocket | None = None
        self._monitor: Monitor | None = None
        # The connection dropped since the request began (its monitor said so).
        self.dropped = False
        self.opened = 0  # sockets opened so far (each reuse saves one)

    @property
    def is_open(self) -> bool:
        return self._dealer is not None

    def dealer(self) -> LoopSocket:
        """The DEALER, opened (and connecting) if it is not."""
        if self._dealer is None:
            # ZMQ drops a connection that sends a bigger frame: see next_frames' None.
            dealer = LoopSocket(self._ctx, zmq.DEALER, {
                zmq.LINGER: 0, zmq.MAXMSGSIZE: self._max_message_bytes})
            try:
                self._monitor = Monitor(self._ctx, dealer.socket, zmq.EVENT_DISCONNECTED,
                                        self._on_drop)
                dealer.socket.connect(self.endpoint)
            except BaseException:
                if self._monitor is not None:
                    self._monitor.close()
                    self._monitor = None
                dealer.close()
                raise
            self._dealer = dealer
            self.opened += 1
            if self._kept is not None:
                self._kept.opened(self)
        return self._dealer

    def forget_drops(self) -> None:
        """A drop reported before now is over (ZMQ reconnected, or will, and sends the next
        request then): only a later one counts."""
        if self._monitor is not None:
            self._monitor.take_events()
        self.dropped = False

    def release(self, *, keep: bool) -> None:
        """A request on it is over: kept for the next when `keep` and the fleet has room for
        it, closed otherwise."""
        self.in_use = False
        if not keep or (self._kept is not None and not self._kept.keep(self)):
            self.close()

    def close(self) -> None:
        dealer, monitor = self._dealer, self._monitor
        self._dealer = self._monitor = None
        if dealer is None:
            return
        if self._kept is not None:
            self._kept.closed(self)
        if monitor is not None:
            monitor.close()
        dealer.close()

    def _on_drop(self, event: int) -> None:
        self.dropped = True
        if self._dealer is not None:
            self._dealer.wake()


class ReplayRequest:
    """An open request: ``next_frames()`` until it returns None or the end marker came.

    Use as ``async with ReplayRequest(...) as request``: the request is sent on entry; on
    exit the channel's socket is kept if ``finished()`` was called, closed otherwise.
    """

    def __init__(self, channel: ReplayChannel, start: int, *, timeout: float) -> None:
        self.endpoint = channel.endpoint
        self.start = start
        self._timeout = timeout
        self._channel = channel
        channel.in_use = True
        self._dealer = channel.dealer()
        self._finished = False

    def finished(self) -> None:
        """The end marker came: the socket holds nothing more of this answer."""
        self._finished = True

    async def __aenter__(self) -> ReplayRequest:
        try:
            self._channel.forget_drops()
            request = [b"", encode_seq(self.start)]
            try:
                self._dealer.socket.send_multipart(request, zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: wait for room, as long as for a reply
                if not await self._dealer.wait(self._timeout, zmq.POLLOUT):
                    raise TimeoutError from None
                self._dealer.socket.send_multipart(request, zmq.NOBLOCK)
        except BaseException:
            self._channel.release(keep=False)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._channel.release(keep=self._finished)

    async def next_frames(self) -> list[Received] | None:
        """The next reply's frames; None once the connection has dropped and every reply it
        delivered has been read. Raises TimeoutError after ``timeout`` seconds without
        either."""
        dealer, channel = self._dealer, self._channel
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        grace_ends: float | None = None
        while True:
            # Replies delivered before a drop stay queued, and ZMQ makes them readable
            # before it reports the drop: read them all first.
            if (frames := dealer.recv()) is not None:
                return frames
            now = loop.time()
            if channel.dropped:
                if grace_ends is None:
                    grace_ends = now + _DROP_GRACE
                if now >= grace_ends:
                    return None
                await dealer.wait(grace_ends - now)
            elif now >= deadline:
                raise TimeoutError
            else:
                await dealer.wait(deadline - now)  # woken early by a drop, too
