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

import contextlib

import zmq
import zmq.asyncio

from kvroute.app.replay_channels import KeptChannels
from kvroute.app.wire import encode_seq

# Replies queued before a replay connection dropped can surface up to this long after the
# drop is reported (the report travels on the monitor's own socket).
_DROP_GRACE_MS = 200


class ReplayChannel:
    """A worker's DEALER (and the monitor that reports its drops) to one replay endpoint,
    opened on first use and kept while answers end cleanly. ``close`` releases both."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *,
                 max_message_bytes: int, kept: KeptChannels | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._kept = kept
        self.in_use = False  # a request is open on it: never closed to make room
        self._max_message_bytes = max_message_bytes
        self._sockets: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None = None
        self._poller: zmq.asyncio.Poller | None = None
        self.opened = 0  # sockets opened so far (each reuse saves one)

    @property
    def is_open(self) -> bool:
        return self._sockets is not None

    def sockets(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, zmq.asyncio.Poller]:
        if self._sockets is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            # ZMQ drops a connection that sends a bigger frame: see next_frames' None.
            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            dropped = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            dealer.connect(self.endpoint)
            self._sockets = (dealer, dropped)
            self._poller = zmq.asyncio.Poller()
            self._poller.register(dealer, zmq.POLLIN)
            self._poller.register(dropped, zmq.POLLIN)
            self.opened += 1
            if self._kept is not None:
                self._kept.opened(self)
        assert self._poller is not None
        return (*self._sockets, self._poller)

    def release(self, *, keep: bool) -> None:
        """A request on it is over: kept for the next when `keep` and the fleet has room for
        it, closed otherwise."""
        self.in_use = False
        if not keep or (self._kept is not None and not self._kept.keep(self)):
            self.close()

    def close(self) -> None:
        sockets, self._sockets, self._poller = self._sockets, None, None
        if sockets is None:
            return
        if self._kept is not None:
            self._kept.closed(self)
        dealer, dropped = sockets
        with contextlib.suppress(zmq.ZMQError):
            dealer.disable_monitor()
        dropped.close(0)
        dealer.close(0)


class ReplayRequest:
    """An open request: ``next_frames()`` until it returns None or the end marker came.

    Use as ``async with ReplayRequest(...) as request``: the request is sent on entry; on
    exit the channel's socket is kept if ``finished()`` was called, closed otherwise.
    """

    def __init__(self, channel: ReplayChannel, start: int, *, timeout: float) -> None:
        self.endpoint = channel.endpoint
        self.start = start
        self._timeout_ms = int(timeout * 1000)
        self._channel = channel
        channel.in_use = True
        self._dealer, self._dropped, self._poller = channel.sockets()
        self._finished = False

    def finished(self) -> None:
        """The end marker came: the socket holds nothing more of this answer."""
        self._finished = True

    async def __aenter__(self) -> ReplayRequest:
        # A drop reported between two requests is over (ZMQ reconnected, or will, and
        # sends this request then): only a drop during this answer cuts it.
        try:
            while await self._dropped.poll(0, zmq.POLLIN):
                await self._dropped.recv_multipart()
            await self._dealer.send_multipart([b"", encode_seq(self.start)])
        except BaseException:
            self._channel.release(keep=False)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._channel.release(keep=self._finished)

    async def next_frames(self) -> list[bytes] | None:
        """The next reply's frames; None once the connection has dropped and every reply it
        delivered has been read. Raises TimeoutError after ``timeout`` seconds without
        either."""
        dealer, dropped = self._dealer, self._dropped
        while True:
            # Replies delivered before a drop stay queued, and ZMQ makes them readable
            # before it reports the drop: read them all first.
            if await dealer.poll(0, zmq.POLLIN):
                return await dealer.recv_multipart()
            if await dropped.poll(0, zmq.POLLIN):
                if await dealer.poll(_DROP_GRACE_MS, zmq.POLLIN):
                    continue  # read above
                return None
            if not await self._poller.poll(self._timeout_ms):
                raise TimeoutError
