"""Registrations and removals of instances through the API, run in the fleet's turns.

A hundred `POST /v1/instances` (or `DELETE /v1/instances/{id}`) sent at once arrive in a few
passes of the event loop, and each one, from the framework's routing through the registry's
bookkeeping to its answer, runs without waiting for anything: left alone, a pass ran
twenty or thirty of them back to back while routes waited. Here each such request
first waits for a turn of the fleet's pacing (`FleetPacing.turn`, the same turns the
subscribers open and close their sockets in), so a pass runs only as many of them as its
budget allows, and routes are answered between the pieces.

Invariant: only those two kinds of request wait, and only for a turn (handed out in order
of asking, every pass of the loop), and only once their token is the admin token those two
endpoints require: a request without it goes straight to the app's refusal, so it cannot
take turns from the operators' changes. Everything else goes straight through. What they
answer is unchanged. The middleware sits inside `HttpGuard`, so the requests it holds count toward
`max_concurrent_requests` and a flood of them is refused there, not queued here without
bound.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvroute.app.errors import RequestError
from kvroute.app.http.auth import Guard

__all__ = ["PacedFleetChanges", "changes_fleet"]

_INSTANCES = "/v1/instances"


def changes_fleet(method: str, path: str) -> bool:
    """Whether a request registers or removes an instance."""
    if method == "POST":
        return path == _INSTANCES
    return method == "DELETE" and path.startswith(_INSTANCES + "/")


class PacedFleetChanges:
    """Pure ASGI middleware: a request that changes the fleet waits for a turn first."""

    def __init__(self, app: ASGIApp, *, guard: Guard) -> None:
        self.app = app
        self.guard = guard  # the one the fleet-changing endpoints require

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and changes_fleet(scope["method"], scope["path"]):
            # The service exists from the lifespan's start, before any request is served.
            service = getattr(scope["app"].state, "service", None)
            if service is not None and await self._authorized(scope, receive):
                await service.registry.pacing.turn()
        await self.app(scope, receive, send)

    async def _authorized(self, scope: Scope, receive: Receive) -> bool:
        try:
            await self.guard(Request(scope, receive))  # reads the headers, not the body
        except RequestError:
            return False
        return True
