"""Reading a JSON request body with a size limit, for every endpoint that takes one."""

from __future__ import annotations

from fastapi import Request

from kvroute.app.errors import TooLarge, UnsupportedMediaType

__all__ = ["read_body"]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused unless declared `application/json`, and with a 413 as soon
    as it passes `limit` bytes (by its declared length before reading anything, else while
    it streams in)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            f"the body must be sent as application/json, not {media_type or 'undeclared'}",
            "content-type")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes")
    return bytes(body)
