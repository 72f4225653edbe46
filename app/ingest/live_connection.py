"""The SUB socket of one worker's live event stream, and the monitor that watches it
connect and drop.

ZMQ connects and reconnects a SUB socket by itself and says nothing on the socket about it;
only its monitor tells. ``connected`` is set from the handshake until the next drop, and
every drop (or failed connect while not connected) calls ``went_down`` on the event loop, so
the subscriber can stop trusting what it holds. ``went_down`` runs inside the loop's
callback for the monitor (``app.ingest.sockets``): it must not block.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq

from kvroute.app.ingest.sockets import LoopSocket, Monitor, Received

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED


class LiveConnection:
    """One SUB socket subscribed to ``topic`` at ``endpoint``, replaced whole by ``reopen``."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: str, *,
                 rcvhwm: int, max_message_bytes: int, reconnect_ivl_ms: int,
                 reconnect_ivl_max_ms: int, went_down: Callable[[bool], None]) -> None:
        self.endpoint = endpoint
        self.connected = asyncio.Event()
        self._ctx = ctx
        self._options: dict[int, int | bytes] = {
            zmq.LINGER: 0,
            zmq.RCVHWM: rcvhwm,
            zmq.MAXMSGSIZE: max_message_bytes,
            zmq.RECONNECT_IVL: reconnect_ivl_ms,
            zmq.RECONNECT_IVL_MAX: reconnect_ivl_max_ms,
            zmq.SUBSCRIBE: topic.encode(),
        }
        self._reconnect_ivl = reconnect_ivl_ms / 1000
        self._went_down = went_down  # called with whether it was connected
        self._sub: LoopSocket | None = None
        self._monitor: Monitor | None = None
        # When the connection dropped without ZMQ scheduling a reconnect (it gives a
        # connection up after a protocol error, e.g. a message over MAXMSGSIZE); None
        # while connected or while ZMQ reconnects by itself.
        self._given_up_at: float | None = None

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The open SUB socket (also for a compiled receive on the loop's thread:
        ``BatchApplier.drain``)."""
        assert self._sub is not None, "not open"
        return self._sub.socket

    def queued(self) -> list[Received] | None:
        """A message already queued, or None, without waiting: many per wake-up of the
        loop cost one wait per wake-up, not one per message."""
        assert self._sub is not None, "not open"
        return self._sub.recv()

    async def wait(self, seconds: float) -> bool:
        """Whether a message is queued within `seconds`; False at once after ``wake()``."""
        assert self._sub is not None, "not open"
        return await self._sub.wait(seconds)

    def wake(self) -> None:
        """End a ``wait`` now (it returns False); nothing if none runs."""
        if self._sub is not None:
            self._sub.wake()

    def open(self) -> None:
        """A new SUB socket connecting to the endpoint, and its monitor watching the
        connection."""
        sub = self._sub = LoopSocket(self._ctx, zmq.SUB, self._options)
        self._monitor = Monitor(self._ctx, sub.socket, _UP | _DOWN, self._on_event)
        sub.socket.connect(self.endpoint)

    def close(self) -> None:
        """Close what ``open`` made (whatever part of it exists): no connection event is
        passed on after this."""
        sub, monitor = self._sub, self._monitor
        self._sub = self._monitor = None
        if monitor is not None:
            monitor.close()
        if sub is not None:
            sub.close()

    def reopen_if_given_up(self) -> bool:
        """Where ZMQ gave the connection up, connect again on a new socket, one reconnect
        interval after the drop (a publisher whose every connection ends in an oversized
        message is retried at that pace, not in a tight loop). Returns whether it did.

        A new socket, not ``disconnect()`` + ``connect()`` on this one: ZMQ ignores a
        second connect of a SUB to an endpoint it still lists, and ``disconnect()`` drops
        the messages still queued from that connection at once, which aborts the process
        (libzmq 4.3.5, fq.cpp ``!_more``) when a poll had already taken the first frame of
        one of them. Closing the socket is safe whatever it holds."""
        since = self._given_up_at
        if since is None or time.monotonic() - since < self._reconnect_ivl:
            return False
        self._given_up_at = None
        self.close()
        self.open()
        return True

    def _on_event(self, event: int) -> None:
        if event == _UP:
            self._given_up_at = None
            self.connected.set()
            return
        # ZMQ follows a dropped connection with EVENT_CONNECT_RETRIED at once when it will
        # reconnect by itself. After a protocol error (a message over MAXMSGSIZE) it drops
        # the connection for good, and says nothing more.
        if event == zmq.EVENT_DISCONNECTED:
            self._given_up_at = time.monotonic()
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._given_up_at = None
        if event == zmq.EVENT_DISCONNECTED or not self.connected.is_set():
            was_connected = self.connected.is_set()
            self.connected.clear()
            self._went_down(was_connected)
