"""Reading a JSON request body with a size limit and a deadline, for every endpoint that
takes one."""

from __future__ import annotations

import asyncio

from fastapi import Request

from kvroute.app.errors import TimedOut, TooLarge, UnsupportedMediaType

__all__ = ["read_body"]


async def read_body(request: Request, limit: int, *, timeout: float) -> bytes:
    """The request body, refused unless declared `application/json`, with a 413 as soon as
    it passes `limit` bytes (by its declared length before reading anything, else while it
    streams in), and with a 408 unless the whole body has arrived `timeout` seconds after
    reading began.

    The deadline covers the whole body, not each chunk: a client dripping one byte at a
    time would otherwise hold a request slot (and its buffer) for as long as it likes."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            f"the body must be sent as application/json, not {media_type or 'undeclared'}",
            "content-type")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
    # Kept as the chunks that came and joined once: a body of one chunk is not copied at
    # all, a longer one once (not grown in a buffer and copied out again).
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                if chunk:
                    chunks.append(chunk)
                    size += len(chunk)
                if size > limit:
                    raise TooLarge(f"body exceeds the limit of {limit} bytes")
    except TimeoutError:
        raise TimedOut(f"the body did not arrive within {timeout:g} s", "body") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
