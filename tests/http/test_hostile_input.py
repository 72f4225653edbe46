"""Inputs an attacker or a broken client sends: each is a 4xx with the JSON error shape,
never a 500, a reset or a hang (found by probing; each was a 500 before)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from tests.support.waiting import HTTP_TIMEOUT

DEEP = b"[" * 5000 + b"]" * 5000


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    server = BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning",
                                       tokenizer="instance", proxy=True)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            yield http
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/route", b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
        ("/v1/route", b'{"messages": ' + DEEP + b"}", 422, "messages[0]"),
        ("/v1/route", DEEP, 422, "Expected `object`, got `array`"),
        ("/v1/completions", b'{"model": "m", "prompt": "\xc3"}', 400, "not valid JSON"),
        # Decoded as the chat struct, the first message is not an object: refused at once.
        ("/v1/chat/completions", b'{"model": "m", "messages": ' + DEEP + b"}", 400,
         "messages[0]"),
        ("/v1/completions", b'{"model": "m", "prompt": ' + DEEP + b"}", 400,
         "nested too deeply"),
        ("/v1/route", b'{"prompt": "\\ud800"}', 400, "not valid JSON"),
        # A float where an int goes makes kvroute read the body again (3.0 is an integer to
        # JSON Schema); what follows it must still be JSON (that second read answered 500).
        ("/v1/route", b'{"token_ids": [1.0, NaN]}', 400, "not valid JSON"),
        ("/v1/route", b'{"token_ids": [1.5, 2]', 400, "not valid JSON"),
        ("/v1/completions", b'{"model": "m", "prompt": "\\udfff"}', 400, "not valid JSON"),
        ("/v1/instances", b'{"url": "http://127.0.0.1:99999"}', 422, "is not an http(s)://"),
        ("/v1/instances", b'{"url": "http://[::1"}', 422, "is not an http(s)://"),
        ("/v1/instances", b'{"url": "http://127.0.0.1:0"}', 422, "HOST[:PORT]"),
        ("/v1/instances", b'{"url": "http://u:p@127.0.0.1:1"}', 422, "no path, query"),
        ("/v1/instances", b'{"url": "http://127.0.0.1:1/admin?x=1"}', 422, "no path, query"),
        ("/v1/instances", b'{"url": "http://127.0.0.1:1#frag"}', 422, "no path, query"),
        ("/v1/instances", DEEP, 400, "nested too deeply"),
        ("/v1/instances", b'{"url": "\xff"}', 400, "not valid JSON"),
    ],
)
def test_bad_input_is_a_named_4xx(client: httpx.Client, path: str, body: bytes, status: int,
                                  needle: str) -> None:
    answer = client.post(path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert set(error) >= {"error", "field"} and needle in error["error"], error
    if path == "/v1/instances" and status == 422:
        assert error["field"] == "url"
