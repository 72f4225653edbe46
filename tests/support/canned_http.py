"""A real HTTP server on a free loopback port that answers GETs with canned bodies."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def canned_http(routes: dict[str, tuple[int, str]],
                asked: Counter[str] | None = None) -> Iterator[str]:
    """Serve `routes` (path -> (status, body)); the dict may change while it runs, and
    `asked` counts the GETs of each path. Yields the base URL; the server and its thread are
    stopped on exit."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if asked is not None:
                asked[self.path] += 1
            status, body = routes.get(self.path, (404, "not found"))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
