"""The SUB socket of one worker's live event stream, and a task that watches it connect and
drop.

ZMQ connects and reconnects a SUB socket by itself and says nothing on the socket about it;
only its monitor tells. ``connected`` is set from the handshake until the next drop, and
every drop (or failed connect while not connected) calls ``went_down`` on the event loop, so
the subscriber can stop trusting what it holds. ``went_down`` runs inside the watcher task:
it must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.app.tasks import cancel_and_wait

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED


class LiveConnection:
    """One SUB socket subscribed to ``topic`` at ``endpoint``, replaced whole by ``reopen``."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str, *,
                 rcvhwm: int, max_message_bytes: int, reconnect_ivl_ms: int,
                 reconnect_ivl_max_ms: int, went_down: Callable[[bool], None]) -> None:
        self.endpoint = endpoint
        self.connected = asyncio.Event()
        self._ctx = ctx
        self._topic = topic.encode()
        self._options = {
            zmq.LINGER: 0,
            zmq.RCVHWM: rcvhwm,
            zmq.MAXMSGSIZE: max_message_bytes,
            zmq.RECONNECT_IVL: reconnect_ivl_ms,
            zmq.RECONNECT_IVL_MAX: reconnect_ivl_max_ms,
        }
        self._reconnect_ivl = reconnect_ivl_ms / 1000
        self._went_down = went_down  # called with whether it was connected
        self._sub: zmq.asyncio.Socket | None = None
        # The same socket without asyncio's futures, for messages already queued.
        self._sync: zmq.Socket[bytes] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watcher: asyncio.Task[None] | None = None
        # When the connection dropped without ZMQ scheduling a reconnect (it gives a
        # connection up after a protocol error, e.g. a message over MAXMSGSIZE); None
        # while connected or while ZMQ reconnects by itself.
        self._given_up_at: float | None = None

    @property
    def socket(self) -> zmq.asyncio.Socket:
        assert self._sub is not None, "not open"
        return self._sub

    def queued(self) -> list[bytes] | None:
        """A message already queued, or None, without waiting: many per wake-up of the
        loop cost one future per wake-up, not one per message."""
        assert self._sync is not None, "not open"
        try:
            return self._sync.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def open(self) -> None:
        """A new SUB socket connecting to the endpoint, and a task watching its connection."""
        sub = self._sub = self._ctx.socket(zmq.SUB)
        for option, value in self._options.items():
            sub.setsockopt(option, value)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sync = zmq.Socket.shadow(sub.underlying)
        monitor = self._monitor = sub.get_monitor_socket(_UP | _DOWN)
        self._watcher = asyncio.create_task(self._watch(monitor),
                                            name=f"kv-monitor-{self.endpoint}")
        sub.connect(self.endpoint)

    async def close(self) -> None:
        """Close what ``open`` made (whatever part of it exists)."""
        await self.stop_watching()
        self.close_sockets()

    async def stop_watching(self) -> None:
        """End the task watching the connection (the first half of ``close``: the sockets
        can then be closed at once, in a turn of the fleet's, by ``close_sockets``)."""
        watcher, self._watcher = self._watcher, None
        await cancel_and_wait(watcher)

    def close_sockets(self) -> None:
        """Close the sockets ``open`` made (whatever part of them exists); call
        ``stop_watching`` first."""
        assert self._watcher is None, "still watching"
        sub, monitor = self._sub, self._monitor
        self._sub = self._monitor = None
        self._sync = None  # a shadow: closing the socket is closing it
        if sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            sub.close(0)
        if monitor is not None:
            monitor.close(0)

    async def reopen_if_given_up(self) -> bool:
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
        await self.close()
        self.open()
        return True

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            frames = await monitor.recv_multipart()
            event = parse_monitor_message(frames)["event"]
            if event == _UP:
                self._given_up_at = None
                self.connected.set()
                continue
            # ZMQ follows a dropped connection with EVENT_CONNECT_RETRIED at once when it
            # will reconnect by itself. After a protocol error (a message over MAXMSGSIZE)
            # it drops the connection for good, and says nothing more.
            if event == zmq.EVENT_DISCONNECTED:
                self._given_up_at = time.monotonic()
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._given_up_at = None
            if event == zmq.EVENT_DISCONNECTED or not self.connected.is_set():
                was_connected = self.connected.is_set()
                self.connected.clear()
                self._went_down(was_connected)
