"""One replay request to a publisher's ROUTER, on a DEALER socket of its own.

A request is ``[b"", start_seq]``; the ROUTER answers with the batches it still buffers from
``start_seq`` on, then an end marker (``wire.decode_replay_frame`` reads both formats). This
module only moves frames: what they mean (a hole, history lost, a restart) is the
subscriber's to judge.

Why a fresh socket per request: a DEALER keeps whatever a ROUTER sent it, so a socket
reused after a timeout could deliver the late tail of the previous answer as if it were the
next one's. A socket is cheap next to a replay.
"""

from __future__ import annotations

import contextlib

import zmq
import zmq.asyncio

from kvroute.app.wire import encode_seq

# Replies queued before a replay connection dropped can surface up to this long after the
# drop is reported (the report travels on the monitor's own socket).
_DROP_GRACE_MS = 200


class ReplayRequest:
    """An open request: ``next_frames()`` until it returns None or the end marker came.

    Use as ``async with ReplayRequest(...) as request``: the socket connects and the request
    is sent on entry, and both sockets are closed on exit however the request ended.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, start: int, *,
                 max_message_bytes: int, timeout: float) -> None:
        self.endpoint = endpoint
        self.start = start
        self._timeout_ms = int(timeout * 1000)
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        # ZMQ drops a connection that sends a bigger frame: see next_frames' None.
        self._dealer.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._dropped = self._dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller: zmq.asyncio.Poller | None = None

    async def __aenter__(self) -> ReplayRequest:
        self._dealer.connect(self.endpoint)
        await self._dealer.send_multipart([b"", encode_seq(self.start)])
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._dealer.disable_monitor()
        self._dropped.close(0)
        self._dealer.close(0)

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
            if self._poller is None:
                self._poller = zmq.asyncio.Poller()
                self._poller.register(dealer, zmq.POLLIN)
                self._poller.register(dropped, zmq.POLLIN)
            if not await self._poller.poll(self._timeout_ms):
                raise TimeoutError
