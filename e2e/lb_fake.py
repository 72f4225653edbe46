"""A scripted stand-in for kvroute's ``POST /v1/route``, for the load-balancer checks.

It records every question a load balancer asks (headers and body) and answers what the
check in progress tells it to: a fixed choice, an error status, something that is not
JSON, nothing at all until released (a stalled kvroute), or a closed connection. The
real kvroute is tested through the same load balancers elsewhere; this one makes the
glue's own rules visible: what is asked, and what is done with each kind of answer.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Asked", "FakeKvroute", "Reply"]

STALL_LIMIT_S = 120.0  # a stalled answer is released by then at the latest


@dataclass(frozen=True)
class Reply:
    """What the fake answers: ``kind`` is "json" (status and body), "raw" (status and
    bytes as they are), "stall" (no answer until released) or "close" (hang up)."""

    kind: str = "json"
    status: int = 200
    body: Any = None

    @classmethod
    def choice(cls, url: str, dp_rank: int = 0, instance: str = "fake-instance") -> Reply:
        return cls("json", 200, {"instance": instance, "url": url, "dp_rank": dp_rank,
                                 "matched_tokens": 0, "matched_blocks": 0, "scores": []})


@dataclass(frozen=True)
class Asked:
    """One question as the fake received it."""

    path: str
    headers: dict[str, str]  # lowercase names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class _State:
    reply: Reply = field(default_factory=Reply)
    asked: list[Asked] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)


class FakeKvroute:
    """``with FakeKvroute() as fake:`` binds a free loopback port; ``fake.url``."""

    def __init__(self) -> None:
        self.state = _State()
        state = self.state

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # quiet: the checks print what matters

            def setup(self) -> None:
                super().setup()
                # Headers and body go out as two writes: without this the second one
                # waits for the peer's delayed ACK (40 ms), which is not the glue's doing.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("transfer-encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline().strip():  # trailers
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("content-length") or 0)
                return self.rfile.read(length) if length else b""

            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self._body()
                with state.lock:
                    state.asked.append(Asked(self.path, {k.lower(): v for k, v in
                                                         self.headers.items()}, body))
                    reply, release = state.reply, state.release
                if reply.kind == "stall":
                    release.wait(STALL_LIMIT_S)
                    self.close_connection = True
                    return
                if reply.kind == "close":
                    self.close_connection = True
                    return
                payload = (reply.body if reply.kind == "raw"
                           else json.dumps(reply.body).encode())
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kvroute",
                                        daemon=True)

    def __enter__(self) -> FakeKvroute:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answer(self, reply: Reply) -> None:
        """Answer every later question with ``reply``; a stalled one still waiting is let go."""
        with self.state.lock:
            self.state.release.set()
            self.state.release = threading.Event()
            self.state.reply = reply

    def asked(self) -> list[Asked]:
        with self.state.lock:
            return list(self.state.asked)

    def forget(self) -> None:
        with self.state.lock:
            self.state.asked.clear()

    def stop(self) -> None:
        self.state.release.set()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
