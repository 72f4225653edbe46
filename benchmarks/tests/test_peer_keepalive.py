"""The peer bench's keep-alive client (benchmarks.peer_sides.KeepAlive) against a real HTTP
server on loopback: bodies by length and chunked, one connection for many requests, a new
one when the server closes it (saying so or not), and a refused status said, not read as
an answer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.peer_sides import KeepAlive


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    connections: set[int] = set()

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, *, chunked: bool = False,
              close: bool = False) -> None:
        _Handler.connections.add(self.client_address[1])
        self.send_response(status)
        self.send_header("content-type", "application/json")
        if close:
            self.send_header("connection", "close")
            self.close_connection = True
        if chunked:
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for start in range(0, len(body), 7):  # several chunks, and a trailer
                piece = body[start:start + 7]
                self.wfile.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\nx-trailer: 1\r\n\r\n")
        else:
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/chunked":
            self._send(200, b'{"chunked": true, "padding": "0123456789"}', chunked=True)
        elif self.path == "/close":
            self._send(200, b'{"closed": true}', close=True)
        elif self.path == "/drop":  # closes without saying so, as an idle timeout does
            self._send(200, b'{"dropped": true}')
            self.close_connection = True
        elif self.path == "/missing":
            self._send(404, b'{"error": "no such path"}')
        else:
            self._send(200, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["content-length"]))
        self._send(200, json.dumps({"echo": json.loads(body),
                                    "type": self.headers["content-type"]}).encode())


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    _Handler.connections = set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def test_many_requests_share_one_connection(server: ThreadingHTTPServer) -> None:
    client = KeepAlive(server.server_address[1], timeout=10)
    try:
        for n in range(20):
            took, answer = client.request("POST", "/echo", json.dumps({"n": n}).encode(),
                                          "application/json")
            assert answer.status_code == 200 and took > 0
            assert answer.json() == {"echo": {"n": n}, "type": "application/json"}
            took, answer = client.request("GET", "/")
            assert answer.json() == {}
        assert len(_Handler.connections) == 1
    finally:
        client.close()


def test_a_chunked_body_is_read_whole_and_the_connection_goes_on(
        server: ThreadingHTTPServer) -> None:
    client = KeepAlive(server.server_address[1], timeout=10)
    try:
        for _ in range(3):
            _, answer = client.request("GET", "/chunked")
            assert answer.json() == {"chunked": True, "padding": "0123456789"}
        _, answer = client.request("GET", "/")
        assert answer.json() == {}
        assert len(_Handler.connections) == 1
    finally:
        client.close()


def test_a_connection_the_server_closes_is_made_again(server: ThreadingHTTPServer) -> None:
    client = KeepAlive(server.server_address[1], timeout=10)
    try:
        for _ in range(3):
            _, answer = client.request("GET", "/close")
            assert answer.json() == {"closed": True}
            _, answer = client.request("GET", "/")
            assert answer.json() == {}
        assert len(_Handler.connections) == 4  # after each close, one more
        for _ in range(3):  # the next request finds the connection gone: sent again, anew
            _, answer = client.request("GET", "/drop")
            assert answer.json() == {"dropped": True}
        assert len(_Handler.connections) == 6  # the first on the open one, two anew
    finally:
        client.close()


def test_a_refusal_is_raised_with_its_status(server: ThreadingHTTPServer) -> None:
    client = KeepAlive(server.server_address[1], timeout=10)
    try:
        _, answer = client.request("GET", "/missing")
        assert answer.status_code == 404
        with pytest.raises(RuntimeError, match="HTTP 404"):
            answer.raise_for_status()
        _, answer = client.request("GET", "/")  # the connection is still good
        assert answer.status_code == 200
    finally:
        client.close()
