"""Bearer tokens: who may route, and who may change which instances kvroute follows.

Two tokens, both optional. `api_token` guards routing, the proxy, the instance list (it
shows the fleet's topology) and the dashboard's data; `admin_token` guards registering and
removing instances, and falls back to `api_token` when only that one is set, so that a
deployment with one token never leaves routing changeable by anyone. Health, readiness and
metrics stay open for probes and scrapers, and so do the dashboard's static files (they
hold no data). Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from kvroute.app.config import Settings
from kvroute.app.errors import Unauthorized

__all__ = ["Guard", "admin_guard", "api_guard"]

Guard = Callable[[Request], Awaitable[None]]


def _bearer(token: str | None) -> Guard:
    expected = token.encode() if token else None

    # A coroutine: FastAPI runs a plain `def` dependency on a worker thread, and under a
    # busy event loop winning the GIL back for it cost routes hundreds of milliseconds.
    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 expected):
            raise Unauthorized("a valid `Authorization: Bearer` token is required",
                               "authorization")

    return check


def api_guard(settings: Settings) -> Guard:
    return _bearer(settings.api_token)


def admin_guard(settings: Settings) -> Guard:
    return _bearer(settings.admin_token or settings.api_token)
