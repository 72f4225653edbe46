"""`POST /v1/route` and `POST /v1/match` answered straight from ASGI, past FastAPI's routing
and dependency machinery: these are the requests kvroute answers most, and at a few hundred
microseconds per answer the framework's layers (route matching, dependency solving, the
request and response objects, the exception middleware) were a large part of a short
prompt's time.

Invariant: the answer is the one the declared FastAPI endpoint (app.http.app) gives, byte for
byte in its body and status, header for header in what matters: the same bearer check
(`auth`), the same body reader (`request_body.read_body`: content type, size, deadline),
the same decoding and answer (`Service.route`, `Service.match`), the same refusal shape and
status (`STATUS_OF`, with `www-authenticate` on a 401 and the path's errors metric), and an
unexpected exception propagates to the app's own 500 handler as before. Only POST on the
exact paths is taken; any other method or path goes on to the app (a GET still gets its 405
with `allow`). The endpoints stay declared in the app, so the OpenAPI contract is unchanged.
It runs inside `HttpGuard`, which still refuses foreign hosts and requests over capacity.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvroute.app.api.answers import Error, encode
from kvroute.app.config import Settings
from kvroute.app.errors import RequestError
from kvroute.app.http.auth import Guard
from kvroute.app.http.request_body import read_body

__all__ = ["MATCH_PATH", "ROUTE_PATH", "RouteFastPath", "answer_match", "answer_route",
           "count_error"]

ROUTE_PATH = "/v1/route"
MATCH_PATH = "/v1/match"
_JSON = (b"content-type", b"application/json")


async def answer_route(request: Request, settings: Settings) -> bytes:
    """The JSON answer to a route request (the service is the app's); raises RequestError."""
    service = request.app.state.service
    started = time.perf_counter()
    body = await read_body(request, settings.max_body_bytes, timeout=settings.body_timeout)
    read = time.perf_counter()
    kind, answer = await service.route(body)
    # Apart: how long the body took to arrive is the client's and the network's (and the
    # loop's turns), the route's own time is kvroute's.
    service.metrics.route_body_wait.observe(read - started)
    service.metrics.route_latency.labels(kind).observe(time.perf_counter() - read)
    return encode(answer)


async def answer_match(request: Request, settings: Settings) -> bytes:
    """The JSON answer to a match query (the service is the app's); raises RequestError."""
    service = request.app.state.service
    body = await read_body(request, settings.max_body_bytes, timeout=settings.body_timeout)
    read = time.perf_counter()
    kind, answer = await service.match(body)
    service.metrics.match_latency.labels(kind).observe(time.perf_counter() - read)
    return encode(answer)


def count_error(request: Request, status: int) -> None:
    """Count a refused route or match query in its path's errors metric (others: none)."""
    metrics = request.app.state.service.metrics
    errors = {ROUTE_PATH: metrics.route_errors, MATCH_PATH: metrics.match_errors}.get(
        request.url.path)
    if errors is not None:
        errors.labels(str(status)).inc()


_ANSWERS = {ROUTE_PATH: answer_route, MATCH_PATH: answer_match}


class RouteFastPath:
    """Pure ASGI middleware answering POST /v1/route and /v1/match itself (see the module
    docstring)."""

    def __init__(self, app: ASGIApp, *, settings: Settings, guard: Guard,
                 status_of: Mapping[type[RequestError], int]) -> None:
        self.app = app
        self.settings = settings
        self.guard = guard
        self.status_of = status_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = _ANSWERS.get(scope["path"]) if scope["type"] == "http" else None
        if answer is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            await self.guard(request)
            body = await answer(request, self.settings)
            status, headers = 200, [_JSON]
        except RequestError as exc:
            status = self.status_of[type(exc)]
            count_error(request, status)
            body = encode(Error(**exc.payload()))
            headers = [_JSON, (b"www-authenticate", b"Bearer")] if status == 401 else [_JSON]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", b"%d" % len(body)), *headers]})
        await send({"type": "http.response.body", "body": body})
