"""Asking an instance, bounded: one HTTP exchange whose answer can neither outlast a
deadline nor outgrow a byte limit.

kvroute asks vLLM instances at registration (discovery), on the routing path (/tokenize)
and every load interval (/metrics). An instance is trusted to be vLLM, not to be quick or
well-behaved: a huge, dripping or stalled answer must cost a bounded wait and a bounded
buffer, never the event loop's time or the process's memory.

Invariants of `fetch`:
- The whole exchange (waiting for a pooled connection, connecting, sending, the status
  line and headers, every byte of the body) runs under one `asyncio.timeout`. httpx's own
  timeouts apply per network operation, so an answer dripped a byte at a time would
  outlast them forever.
- At most `max_bytes` of body are held (plus one network read): a declared
  Content-Length over the limit is refused before the body is read, and a streamed body
  as soon as it passes the limit. Compression is not asked for (`Accept-Encoding:
  identity`) and an encoded answer is refused, so the limit counts the bytes held: a
  small gzip body can inflate a thousandfold.
- Every failure is an `UpstreamError`; its message names the method, the URL path and
  the limit that was hit, never anything the instance sent (a body, or the header bytes
  an HTTP protocol error may quote), so it is safe to log and to answer clients with.
- An HTTP status is an answer, not a failure: callers give 404 or 4xx their own meaning.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

__all__ = [
    "DISCOVERY_DEADLINE", "DISCOVERY_MAX_BYTES", "METRICS_MAX_BYTES", "Answer",
    "UpstreamError", "fetch", "tokenize_max_bytes", "url_at",
]

MiB = 1024 * 1024

# /kv_event_sources and /v1/models are a few hundred bytes per rank or model; 1 MiB is
# thousands of them and still a small buffer.
DISCOVERY_MAX_BYTES = 1 * MiB
# Each discovery request; registration through the API waits for discovery, so this (at
# most three times over) is the longest a POST /v1/instances can take.
DISCOVERY_DEADLINE = 10.0
# A real vLLM /metrics page is ~50 KB per engine (mostly histograms); 4 MiB holds dozens of
# data-parallel engines and several served models.
METRICS_MAX_BYTES = 4 * MiB
# A /tokenize answer is compact JSON: each token id at most 10 digits (kvroute accepts ids
# below 2**32) and a separator, 12 bytes even with ", "; the slack is the other fields.
TOKENIZE_BYTES_PER_TOKEN = 12
TOKENIZE_SLACK_BYTES = 64 * 1024

Failure = Literal["unreachable", "broken", "too_large", "too_slow"]


def tokenize_max_bytes(max_prompt_tokens: int) -> int:
    """The largest /tokenize answer that can hold `max_prompt_tokens` tokens; a larger
    one holds more tokens than any prompt kvroute accepts."""
    return max_prompt_tokens * TOKENIZE_BYTES_PER_TOKEN + TOKENIZE_SLACK_BYTES


class UpstreamError(Exception):
    """Asking an instance failed; `kind` says how, the message says where and which limit.

    `kind` is "unreachable" (no connection), "broken" (the exchange broke off or was not
    valid HTTP, or the answer was encoded though not asked to be), "too_large" (the body
    passed `max_bytes`) or "too_slow" (no whole answer within the deadline)."""

    def __init__(self, method: str, url: str, kind: Failure, reason: str) -> None:
        self.method, self.path, self.kind = method, urlsplit(url).path or "/", kind
        super().__init__(f"{method} {self.path} failed: {reason}")


@dataclass(frozen=True, slots=True)
class Answer:
    """An instance's whole answer: its status and body (at most the fetch's `max_bytes`)."""

    status: int
    body: bytes


def url_at(origin: str, path: str) -> str:
    """`path` on an instance's origin (`scheme://host[:port]`, as app.config leaves every
    instance URL), built by the URL library rather than by pasting strings, so a path can
    only ever replace the path."""
    return str(httpx.URL(origin).copy_with(path=path))


async def fetch(client: httpx.AsyncClient, method: str, url: str, *, max_bytes: int,
                deadline: float, headers: dict[str, str] | None = None,
                json: Any = None) -> Answer:
    """Send one request with `client` and read the whole answer within `deadline` seconds
    and `max_bytes` of body; raises `UpstreamError` otherwise (see the module's invariants)."""
    headers = {**(headers or {}), "Accept-Encoding": "identity"}
    try:
        async with asyncio.timeout(deadline):
            # httpx's per-operation timeouts, set to the same bound, can only fire earlier
            # than the total deadline; they are reported the same way.
            async with client.stream(method, url, headers=headers, json=json,
                                     timeout=deadline) as response:
                return Answer(response.status_code,
                              await _body(response, method, url, max_bytes))
    except (TimeoutError, httpx.TimeoutException):
        raise UpstreamError(method, url, "too_slow",
                            f"no whole answer within the {deadline:g} s deadline") from None
    except httpx.ConnectError as exc:
        # The reason comes from this host's resolver or network stack, not the instance.
        raise UpstreamError(method, url, "unreachable", f"ConnectError: {exc}") from None
    except httpx.HTTPError as exc:
        # Only the class: a protocol error's text may quote what the instance sent.
        raise UpstreamError(method, url, "broken", exc.__class__.__name__) from None


async def _body(response: httpx.Response, method: str, url: str, max_bytes: int) -> bytes:
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise UpstreamError(method, url, "broken",
                            "the answer is compressed though only identity was accepted")
    too_large = f"the answer is over the limit of {max_bytes} bytes"
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise UpstreamError(method, url, "too_large", too_large)
    body = bytearray()
    # Raw bytes: the transfer coding is undone, a content coding would not be (refused).
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > max_bytes:
            raise UpstreamError(method, url, "too_large", too_large)
    return bytes(body)
