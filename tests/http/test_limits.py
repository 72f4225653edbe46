"""The HTTP front against slow and abusive clients, through real sockets: header and body
deadlines, idle keep-alive, the header size bound, the concurrency limit, Host names and
HTTPS.

Deadlines under test are 1 s; a test only asserts that the server acts well before a
generous limit (and, for a refusal, what it answers), never how fast it acts.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import trustme

from kvroute.app.config import Settings
from kvroute.app.http.guard import host_name
from kvroute.app.server import MAX_HEADER_BYTES, BackgroundServer
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for

# Longer than any deadline under test by far: a connection still open then was never bounded.
CLOSE_LIMIT = 15.0
DRIP_INTERVAL = 0.5
# Request headers that take 70 s at one byte per DRIP_INTERVAL: they never finish in time.
SLOW_HEADERS = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100


def settings(**overrides: object) -> Settings:
    return Settings(host="127.0.0.1", port=0, log_level="warning", placement_ttl=0.0,
                    load_interval=0.0, **overrides)


@contextmanager
def connection(server: BackgroundServer) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT) as sock:
        yield sock


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (end of stream or reset); never blocks. Bytes
    from the server instead fail the test: these connections must get no answer."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        data = sock.recv(65536)
    except OSError:  # reset: the server closed with bytes of ours still unread
        return True
    assert data == b"", f"expected the connection closed, got an answer: {data[:200]!r}"
    return True


def drip_until_closed(sock: socket.socket, data: bytes) -> None:
    """Send `data` one byte per DRIP_INTERVAL until the server closes the connection; fail
    if it is still open after CLOSE_LIMIT (scaled)."""
    deadline = time.monotonic() + scaled(CLOSE_LIMIT)
    for byte in data:
        if closed(sock):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the connection is still open after {scaled(CLOSE_LIMIT):g} s")
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # closed (reset) while we sent
            wait_for(lambda: closed(sock), "the end of the connection", timeout=1.0)
            return
        time.sleep(DRIP_INTERVAL)
    pytest.fail("sent every byte without the connection being closed")


def exchange(sock: socket.socket, request: bytes) -> tuple[int, dict]:
    """Send one whole request, read its answer; the connection stays usable."""
    sock.sendall(request)
    return read_answer(sock)


def read_answer(sock: socket.socket) -> tuple[int, dict]:
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    try:
        return answer.status, json.loads(answer.read())
    finally:
        answer.close()  # the reader, not the socket


def get(path: str, host: bytes = b"127.0.0.1") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path.encode(), host)


def post_head(path: str, length: int) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (path.encode(), length))


def assert_refusal(status: int, answer: dict, expected: int, field: str | None) -> None:
    assert status == expected, answer
    assert set(answer) == {"error", "field"} and answer["error"], answer
    assert answer["field"] == field, answer


def test_headers_sent_slowly_close_the_connection() -> None:
    with BackgroundServer(settings(header_timeout=1.0, keep_alive_timeout=60.0)) as server:
        with connection(server) as sock:
            drip_until_closed(sock, SLOW_HEADERS)
        # The server still answers everyone else.
        with connection(server) as sock:
            assert exchange(sock, get("/healthz"))[0] == 200


def test_slow_headers_of_a_later_request_on_a_kept_alive_connection_are_closed() -> None:
    # keep_alive_timeout is long: only the header deadline can close this connection.
    with BackgroundServer(settings(header_timeout=1.0, keep_alive_timeout=60.0)) as server:
        with connection(server) as sock:
            for _ in range(2):
                assert exchange(sock, get("/healthz")) == (200, {"status": "ok"})
            drip_until_closed(sock, SLOW_HEADERS)


def test_a_body_left_unread_after_the_answer_is_bounded_like_headers() -> None:
    # /healthz answers without reading the declared body; what follows the answer belongs
    # to the next request, whose headers have header_timeout to arrive.
    with BackgroundServer(settings(header_timeout=1.0, keep_alive_timeout=60.0)) as server:
        with connection(server) as sock:
            head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 1000\r\n\r\n"
            assert exchange(sock, head)[0] == 200
            drip_until_closed(sock, b"a" * 200)


def test_bytes_that_are_not_http_are_refused_400_in_json() -> None:
    with BackgroundServer(settings()) as server, connection(server) as sock:
        status, answer = exchange(sock, b"NOT HTTP AT ALL\r\n\r\n")
    assert_refusal(status, answer, 400, None)


def test_a_connection_that_sends_nothing_is_closed() -> None:
    with BackgroundServer(settings(header_timeout=1.0, keep_alive_timeout=60.0)) as server:
        with connection(server) as sock:
            wait_for(lambda: closed(sock), "the server to close a silent connection",
                     timeout=CLOSE_LIMIT)


def test_an_idle_kept_alive_connection_is_closed() -> None:
    with BackgroundServer(settings(header_timeout=60.0, keep_alive_timeout=1.0)) as server:
        with connection(server) as sock:
            assert exchange(sock, get("/healthz"))[0] == 200
            wait_for(lambda: closed(sock), "the server to close an idle connection",
                     timeout=CLOSE_LIMIT)


def test_a_body_sent_slowly_is_refused_408_even_while_bytes_keep_coming() -> None:
    # Bytes arrive every DRIP_INTERVAL, so only a deadline for the whole body can end this.
    with BackgroundServer(settings(body_timeout=1.0)) as server:
        with connection(server) as sock:
            sock.sendall(post_head("/v1/route", 1000) + b'{"token_ids": [')
            deadline = time.monotonic() + scaled(CLOSE_LIMIT)
            while not select.select([sock], [], [], DRIP_INTERVAL)[0]:
                assert time.monotonic() < deadline, "no answer to a body sent slowly"
                sock.sendall(b"1,")
            status, answer = read_answer(sock)
    assert_refusal(status, answer, 408, "body")


def test_headers_over_the_size_bound_are_refused() -> None:
    with BackgroundServer(settings(header_timeout=60.0)) as server:
        # Big headers that fit are answered.
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            big = http.get("/v1/instances", headers={"x-big": "a" * (MAX_HEADER_BYTES // 2)})
            assert big.status_code == 200, big.text
        # Endless ones: the connection closes long before the header deadline (60 s).
        with connection(server) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            chunk = b"a" * 16384
            with suppress(OSError):  # the server closed the connection while we sent
                for _ in range(16 * MAX_HEADER_BYTES // len(chunk)):
                    if select.select([sock], [], [], 0)[0]:
                        break
                    sock.sendall(chunk)
            sock.settimeout(scaled(CLOSE_LIMIT))
            answer = b""
            try:
                while data := sock.recv(65536):
                    answer += data
            except TimeoutError:
                pytest.fail("a request with endless headers is still open")
            except ConnectionResetError:
                pass  # the refusal can be lost with the reset
    # The refusal, when it was not lost to a reset, is the JSON one.
    if answer:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert json.loads(body)["field"] is None and json.loads(body)["error"]


def test_requests_past_the_limit_are_refused_429_while_probes_answer() -> None:
    body = b'{"token_ids": [1, 2, 3]}'
    with BackgroundServer(settings(max_concurrent_requests=2, body_timeout=60.0)) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http, \
            connection(server) as first, connection(server) as second:
        # Two requests in progress: each waits for the last byte of its body.
        for sock in (first, second):
            sock.sendall(post_head("/v1/route", len(body)) + body[:-1])
        def refused_third() -> httpx.Response | None:
            answer = http.get("/v1/instances")
            return answer if answer.status_code == 429 else None

        refused = wait_for(refused_third, "a third request to be refused")
        assert_refusal(refused.status_code, refused.json(), 429, None)
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert http.get(probe).status_code == 200, probe
        # Both finish (with whatever answer routing gives: no instance is registered) ...
        for sock in (first, second):
            sock.sendall(body[-1:])
            assert read_answer(sock)[0] != 429
        # ... and then a request is served again.
        wait_for(lambda: http.get("/v1/instances").status_code == 200,
                 "a request to be served after the others finished")


def test_connections_past_the_limit_are_answered_503_and_closed() -> None:
    """Clients cannot take the open files the fleet's sockets need: with three connections
    held open, a fourth is answered 503 and closed before it sends anything; once one of
    the three goes, a new connection is served again."""
    with BackgroundServer(settings(max_connections=3)) as server:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT)
                for _ in range(3)]
        try:
            status, answer = exchange(held[0], get("/healthz"))  # the three are accepted
            assert status == 200, answer
            with connection(server) as extra:
                status, answer = read_answer(extra)
                assert_refusal(status, answer, 503, None)
                assert "max_connections" in answer["error"]
                wait_for(lambda: closed(extra), "the refused connection closed", timeout=5.0)
            held.pop().close()

            def served() -> int | None:
                with connection(server) as sock:
                    status, _ = exchange(sock, get("/healthz"))
                    return status if status == 200 else None

            # The server notices the closed connection as its loop turns.
            assert wait_for(served, "a connection served once one of the three left") == 200
            assert exchange(held[1], get("/healthz"))[0] == 200  # the others still served
        finally:
            for sock in held:
                sock.close()


def test_a_foreign_host_is_refused_on_a_loopback_address() -> None:
    with BackgroundServer(settings()) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        for host in ("rebound.attacker.example", f"rebound.example:{server.port}",
                     "127.0.0.1.attacker.example", "[::2]"):
            answer = http.get("/v1/instances", headers={"host": host})
            assert_refusal(answer.status_code, answer.json(), 400, "host")
        for host in (f"127.0.0.1:{server.port}", "localhost", f"LocalHost:{server.port}",
                     f"[::1]:{server.port}"):
            assert http.get("/v1/instances", headers={"host": host}).status_code == 200, host
        # Probes and scrapes answer whatever Host they name (Kubernetes and Prometheus send
        # the pod's address).
        for path in ("/healthz", "/metrics"):
            assert http.get(path, headers={"host": "10.1.2.3:8000"}).status_code == 200
        with connection(server) as sock:  # no Host header at all
            status, answer = exchange(sock, b"GET /v1/instances HTTP/1.1\r\n\r\n")
            assert_refusal(status, answer, 400, "host")


def test_allowed_hosts_name_the_hosts_and_their_subdomains() -> None:
    allowed = ("kvroute.example", "*.svc.example")
    with BackgroundServer(settings(allowed_hosts=allowed)) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        for host in ("kvroute.example", "KVROUTE.example:8443", "kvroute.example.",
                     "a.svc.example", "b.a.svc.example:80"):
            assert http.get("/v1/instances", headers={"host": host}).status_code == 200, host
        # The list replaces the loopback names; "*." does not match the bare name.
        for host in ("svc.example", "evilsvc.example", "kvroute.example.attacker.example",
                     "sub.kvroute.example", "127.0.0.1", "localhost"):
            answer = http.get("/v1/instances", headers={"host": host})
            assert_refusal(answer.status_code, answer.json(), 400, "host")


@pytest.mark.parametrize(("header", "name"), [
    ("Example.COM", "example.com"), ("example.com:8000", "example.com"),
    ("example.com.", "example.com"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("127.0.0.1:80", "127.0.0.1"), ("", None), (":80", None), ("::1", None),
    ("a.example:80:80", None), ("a.example:http", None), ("[::1", None), ("a b@c", "a b@c"),
])
def test_host_name_of_a_header(header: str, name: str | None) -> None:
    assert host_name(header) == name


def test_https_with_the_configured_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    certificate = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    certificate.cert_chain_pems[0].write_to_path(str(certfile))
    certificate.private_key_pem.write_to_path(str(keyfile))
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    with BackgroundServer(settings(tls_certfile=str(certfile),
                                   tls_keyfile=str(keyfile))) as server:
        assert server.url.startswith("https://")
        with httpx.Client(base_url=server.url, verify=trusted, timeout=HTTP_TIMEOUT) as http:
            answer = http.get("/healthz")
            assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        # Without the CA the certificate is not trusted.
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as untrusting, \
                pytest.raises(httpx.ConnectError):
            untrusting.get("/healthz")
