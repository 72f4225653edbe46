"""The composition root: one kvroute process, the service with its HTTP server and, when
`epp_port` is set, the Endpoint Picker beside it on the same event loop. It runs in the
foreground for `kvroute serve`, or on a background thread for the demo, the tests and the
benchmarks. The only module that knows every wing.

A background server owns its thread and event loop; `stop()` runs the app's
lifespan shutdown (subscribers stopped, sockets closed) before it returns.

Every connection is bounded before the app sees a request (`BoundedHttpProtocol`): at most
`max_connections` are open at once, its request headers must arrive within
`header_timeout` and fit in MAX_HEADER_BYTES, and an idle keep-alive connection closes
after `keep_alive_timeout`. The body's own deadline is
the app's (app.http.request_body), since only the app knows when it reads one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvroute.app.api.answers import Error, encode
from kvroute.app.config import Settings
from kvroute.app.fleet.dns import Resolver
from kvroute.app.http.app import STATUS_OF, Companion, create_app
from kvroute.app.ingest.budget import shared_budget
from kvroute.app.service import Service

if TYPE_CHECKING:
    from kvroute.app.epp.server import EppServer
    from kvroute.app.fleet.gc_freeze import FleetFreezer

__all__ = ["MAX_HEADER_BYTES", "BackgroundServer", "BoundedHttpProtocol", "serve_forever"]

log = logging.getLogger("kvroute.server")

# Request line and headers together: more than h11 (16 KiB) or nginx (4 x 8 KiB) accept by
# default, so what passes through those reaches kvroute too.
MAX_HEADER_BYTES = 64 * 1024


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus the bounds uvicorn lacks on connections.

    Count: a connection accepted while `max_connections` others are open is answered 503
    and closed at once, so clients cannot take the open files the fleet's sockets need
    (the limit is counted in them, app.fleet.limits) however many connect.

    Deadline: a connection has `header_timeout` seconds from being opened to deliver its
    first request's headers, and from the first byte after each response to deliver the
    next one's (idle time before that byte is keep_alive_timeout's). Otherwise it is closed
    without an answer: a slowloris client that sends a byte every few seconds, or one that
    connects and sends nothing, holds a connection at most that long. The timer runs only
    while no request of the connection is in the app, so it never cuts off an answer.

    Size: httptools buffers a header without limit until it ends, so the bytes fed while one
    request's headers are incomplete are counted; past MAX_HEADER_BYTES the request is
    refused with 431 and the connection closed. Reads that start or finish the headers are
    not counted (they may hold other bytes), so at most one read more is ever held.

    Relies on HttpToolsProtocol's hooks (data_received, on_message_begin,
    on_headers_complete, on_response_complete): hence the uvicorn range in pyproject.toml.
    """

    def __init__(self, config: uvicorn.Config, *args: Any, header_timeout: float,
                 max_connections: int, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self._header_deadline: asyncio.TimerHandle | None = None
        # Between a response (or the connection's start) and the next request's headers.
        self._awaiting_request = True
        # Inside one request's headers: which request, and the bytes counted for it.
        self._in_headers = False
        self._requests_begun = 0
        self._header_bytes = 0
        # Requests of this connection begun and not yet answered, counted in the loop's
        # ingest budget (app.ingest.budget): from a request's first byte, ingest takes a
        # smaller share of each turn, so the turns that read, run and answer it come sooner.
        # Its socket is watched by the budget too: bytes waiting on it end ingest's turn.
        self._budget = shared_budget()
        self._serving = 0
        self._fd: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counted in server_state.connections
        if len(self.server_state.connections) > self.max_connections:
            _say_full(self.max_connections)
            self._refuse(503, f"kvroute holds {self.max_connections} connections already "
                              "(max_connections); retry later")
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._fd = sock.fileno()
            self._budget.watch(self._fd, self)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        if self._fd is not None:
            self._budget.unwatch(self._fd, self)
            self._fd = None
        self._budget.serving -= self._serving  # requests cut off will not complete
        self._serving = 0
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_request and self._header_deadline is None:
            self._arm_header_deadline()
        counting = (self._in_headers, self._requests_begun)
        super().data_received(data)
        if self._in_headers and counting == (True, self._requests_begun):
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._requests_begun += 1
        self._header_bytes = 0
        self._serving += 1
        self._budget.serving += 1

    def on_headers_complete(self) -> None:
        self._in_headers = self._awaiting_request = False
        self._disarm_header_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # that request's headers are complete already
        if self._serving:
            self._serving -= 1
            self._budget.serving -= 1
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._awaiting_request = True
            if self._in_headers:  # the next request has begun arriving
                self._arm_header_deadline()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP, in the service's JSON shape."""
        self._refuse(400, msg)

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close; the answer is only written while no other response
        is being written on this connection (a pipelined request's would corrupt it)."""
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            body = encode(Error(message, None))
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status, _REASONS[status], len(body), body))
        self.transport.close()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout,
                                                     self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            log.debug("closing a connection from %s: no complete request headers within "
                      "%g s", self.client, self.header_timeout)
            self.transport.close()


_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}
_FULL_SAID_EVERY = 10.0  # seconds: one warning per stretch of refusals, not one each
_full_said_at = -_FULL_SAID_EVERY


def _say_full(limit: int) -> None:
    global _full_said_at
    now = time.monotonic()
    if now - _full_said_at >= _FULL_SAID_EVERY:
        _full_said_at = now
        log.warning("refusing connections: %d open already (max_connections)", limit)


def _companions(settings: Settings) -> dict[str, Callable[[Service], Companion]]:
    """The servers beside the HTTP API on the same service: the Endpoint Picker when
    `epp_port` is set."""
    if settings.epp_port is None:
        return {}

    def endpoint_picker(service: Service) -> Companion:
        # Imported here: gRPC and Envoy's messages load only when the EPP is on.
        from kvroute.app.epp.server import EppServer

        return EppServer(service, STATUS_OF)

    return {"epp": endpoint_picker}


def _config(settings: Settings, resolver: Resolver | None = None, *,
            freeze_fleet: bool = False) -> uvicorn.Config:
    # uvicorn calls the protocol class with keywords only (config=, server_state=, ...).
    protocol = functools.partial(BoundedHttpProtocol, header_timeout=settings.header_timeout,
                                 max_connections=settings.max_connections)
    return uvicorn.Config(create_app(settings, resolver=resolver, freeze_fleet=freeze_fleet,
                                     companions=_companions(settings)),
                          host=settings.host, port=settings.port,
                          log_level=settings.log_level, lifespan="on", access_log=False,
                          http=protocol,  # type: ignore[arg-type]
                          timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
                          ssl_certfile=settings.tls_certfile, ssl_keyfile=settings.tls_keyfile)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 lets the OS choose a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # that do, and with it on every small response waits for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def _epp_port_taken(settings: Settings) -> str | None:
    """Why the Endpoint Picker's port cannot be listened on, if it cannot: checked before
    anything starts, so a taken port is one clear line instead of a failed start-up's
    traceback (gRPC binds only inside the app's lifespan)."""
    if not settings.epp_port:  # off, or any free port
        return None
    try:
        _bind(settings.host.strip("[]"), settings.epp_port).close()
    except OSError as exc:
        return f"the Endpoint Picker cannot listen on {settings.host}:{settings.epp_port}: {exc}"
    return None


def serve_forever(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; the exit status for the CLI. Port 0 picks a free port,
    named in uvicorn's "running on" line."""
    taken = _epp_port_taken(settings)
    if taken is not None:
        log.error("%s", taken)
        return 1
    server = uvicorn.Server(_config(settings, freeze_fleet=True))
    # uvicorn shuts down gracefully on SIGTERM and then raises the signal again with the
    # previous handler restored; this one makes that a no-op, so a clean stop exits 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1


class BackgroundServer:
    """kvroute on a daemon thread, for callers that need the real HTTP API in-process.

    The listening socket is bound when the server is made (port 0: any free port), so
    ``port`` and ``url`` are final before ``start()`` and no other process can take the port
    in between."""

    def __init__(self, settings: Settings, *, resolver: Resolver | None = None,
                 freeze_fleet: bool = False) -> None:
        self.settings = settings
        self._socket = _bind(settings.host, settings.port)
        self.port: int = self._socket.getsockname()[1]
        # freeze_fleet as `kvroute serve` does (app.fleet.gc_freeze): the freezes are the whole
        # process's, so only for a caller that owns it (a benchmark, a test that unfreezes).
        self._config = _config(settings, resolver, freeze_fleet=freeze_fleet)
        self._server = uvicorn.Server(self._config)
        # A thread may not install signal handlers; the owner stops us instead.
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="kvroute-http", daemon=True)

    @property
    def url(self) -> str:
        host = self.settings.host
        scheme = "https" if self.settings.tls_certfile else "http"
        return (f"{scheme}://[{host}]:{self.port}" if ":" in host
                else f"{scheme}://{host}:{self.port}")

    @property
    def service(self) -> Service:
        """The running service, for in-process callers (benchmarks, tests) that drive it
        from their own thread while no request of theirs is in flight."""
        return self._config.app.state.service  # type: ignore[union-attr]

    @property
    def freezer(self) -> FleetFreezer | None:
        """The running garbage-collector freezer (with `freeze_fleet`), else None."""
        return self._config.app.state.freezer  # type: ignore[union-attr]

    @property
    def epp(self) -> EppServer | None:
        """The running Endpoint Picker (its port, its certificate), None when it is off."""
        return self._config.app.state.companions.get("epp")  # type: ignore[union-attr]

    def start(self, timeout: float = 20.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvroute did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():  # said, not left to be found by what it does later
                log.error("kvroute on %s did not stop within %.0f s; its thread runs on",
                          self.url, timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
