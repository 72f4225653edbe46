"""The in-process server: binds its own port first, reports it, and answers without
Nagle delays."""

from __future__ import annotations

import socket

import httpx

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from tests.conftest import HTTP_TIMEOUT


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
