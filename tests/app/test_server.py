"""The in-process server: binds its own port first, reports it, and answers without
Nagle delays."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx

from kvroute.app.config import Settings
from kvroute.app.ingest.budget import shared_budget
from kvroute.app.server import BackgroundServer
from tests.support.waiting import HTTP_TIMEOUT


def test_port_zero_is_bound_before_start_and_reported():
    server = BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning"))
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        taken = socket.socket()
        try:  # bound already: nobody else can take it between now and start()
            assert taken.connect_ex(("127.0.0.1", server.port)) == 0  # the backlog accepts
        finally:
            taken.close()
        server.start()
        assert httpx.get(f"{server.url}/healthz", timeout=HTTP_TIMEOUT).json() == {
            "status": "ok"}
    finally:
        server.stop()
    refused = socket.socket()
    try:
        assert refused.connect_ex(("127.0.0.1", server.port)) != 0  # released on stop
    finally:
        refused.close()


def test_the_listening_socket_says_tcp_so_asyncio_disables_nagle():
    """asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; without it each
    small answer waits for the client's delayed ACK (about 40 ms on Linux)."""
    server = BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning"))
    try:
        assert server._socket.proto == socket.IPPROTO_TCP
    finally:
        server.stop()


def _serving(server: BackgroundServer) -> int:
    """The server loop's count of requests being answered (app.ingest.budget), read there."""
    loop = server._server.servers[0].get_loop()

    async def read() -> int:
        return shared_budget().serving

    return asyncio.run_coroutine_threadsafe(read(), loop).result(HTTP_TIMEOUT)


def _serving_becomes(server: BackgroundServer, want: int) -> int:
    deadline = time.monotonic() + HTTP_TIMEOUT
    while (got := _serving(server)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_a_request_counts_as_served_from_its_first_byte_until_answered_or_cut_off():
    """Ingest takes a smaller share of the loop while requests are being answered: the
    count starts with a request's first bytes and ends with its answer or its connection."""
    with BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning")) as server:
        assert _serving(server) == 0
        client = socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT)
        try:  # headers and a body that never finishes arriving
            client.sendall(b"POST /v1/route HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                           b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{")
            assert _serving_becomes(server, 1) == 1
        finally:
            client.close()
        assert _serving_becomes(server, 0) == 0  # cut off: it will never be answered
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            for _ in range(3):  # one kept-alive connection, answered requests
                assert http.get("/healthz").status_code == 200
                assert http.post("/v1/route", json={"token_ids": [1, 2]}).status_code == 503
            assert _serving(server) == 0


def _on_loop(server: BackgroundServer, coroutine_function):
    loop = server._server.servers[0].get_loop()
    return asyncio.run_coroutine_threadsafe(coroutine_function(), loop)


def _watching(server: BackgroundServer) -> int:
    async def read() -> int:
        return shared_budget().watching

    return _on_loop(server, read).result(HTTP_TIMEOUT)


def test_a_request_arriving_while_the_loop_works_ends_ingest_s_turn():
    """Each connection is watched by the loop's ingest budget: bytes of a request that
    arrive while the loop is busy show as waiting before the loop reads them, so ingest
    gives the turn up at its next piece instead of working to the end of its share."""
    healthz = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    with BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning")) as server:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT)
        try:
            client.sendall(healthz)
            assert b"200 OK" in client.recv(4096)  # accepted and answered: watched now
            assert _watching(server) == 1
            busy = threading.Event()

            async def hold_the_loop() -> bool:
                """Work that does not yield (as a piece of ingest does), asking the
                budget meanwhile whether a request waits."""
                busy.set()
                deadline = time.monotonic() + HTTP_TIMEOUT
                while time.monotonic() < deadline:
                    if shared_budget().requests_waiting():
                        return True
                    time.sleep(0.001)
                return False

            held = _on_loop(server, hold_the_loop)
            assert busy.wait(HTTP_TIMEOUT)
            client.sendall(healthz)
            assert held.result(HTTP_TIMEOUT + 5)
            assert b"200 OK" in client.recv(4096)  # then read and answered as ever
        finally:
            client.close()
        deadline = time.monotonic() + HTTP_TIMEOUT
        while _watching(server) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _watching(server) == 0  # a closed connection is no longer watched
