"""Running the service: in the foreground for `kvroute serve`, or on a background
thread for the demo, the tests and the benchmarks.

A background server owns its thread and event loop; `stop()` runs the app's
lifespan shutdown (subscribers stopped, sockets closed) before it returns.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn

from kvroute.app.api import create_app
from kvroute.app.config import Settings
from kvroute.app.service import Service

__all__ = ["BackgroundServer", "serve_forever"]


def _config(settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                          log_level=settings.log_level, lifespan="on", access_log=False)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 lets the OS choose a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # that do, and with it on every small response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def serve_forever(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; the exit status for the CLI. Port 0 picks a free port,
    named in uvicorn's "running on" line."""
    server = uvicorn.Server(_config(settings))
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

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._socket = _bind(settings.host, settings.port)
        self.port: int = self._socket.getsockname()[1]
        self._config = _config(settings)
        self._server = uvicorn.Server(self._config)
        # A thread may not install signal handlers; the owner stops us instead.
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="kvroute-http", daemon=True)

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def service(self) -> Service:
        """The running service, for in-process callers (benchmarks, tests) that drive it
        from their own thread while no request of theirs is in flight."""
        return self._config.app.state.service  # type: ignore[union-attr]

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
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
