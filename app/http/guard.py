"""Which requests the HTTP front accepts, decided before any endpoint runs.

Two refusals, both in the service's JSON shape `{"error": message, "field": name-or-null}`
with the status the caller's STATUS_OF gives their kind (app.http.app owns that mapping):

* Host (400, field "host"): the Host header must name this server. A browser tricked by
  DNS rebinding into calling kvroute sends the attacker's name, so on a loopback address
  only loopback names are answered unless `allowed_hosts` says otherwise.
* Capacity (429, field null): at most `max_concurrent_requests` requests are in the app at
  once, counted from the first byte of the app's work to the last byte of its answer (a
  streamed proxy response counts until it finishes). A flood then costs one small refusal
  per request instead of unbounded tasks, buffers and upstream connections.

The probes /healthz and /readyz and the /metrics page pass both checks: under a flood
they must still answer, and Kubernetes probes and Prometheus send the pod's IP address
as Host, which no allowed_hosts lists. They are open without a token anyway, and change
nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from kvroute.app.api.answers import Error, encode
from kvroute.app.config import Settings, is_loopback
from kvroute.app.errors import Busy, MalformedRequest, RequestError

__all__ = ["OPEN_PATHS", "AllowedHosts", "HttpGuard", "allowed_hosts_of", "host_name"]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

# name or [IPv6], then an optional :port. The name part is not validated further: anything
# odd in it simply matches no allowed name.
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9a-f:.]+)\]|(?P<name>[^:\[\]]+))(?::[0-9]*)?", re.ASCII)


def host_name(header: str) -> str | None:
    """The server name in a Host header value: lowercase, without port, IPv6 brackets or
    a trailing dot ("Example.COM.:80" -> "example.com", "[::1]:8000" -> "::1"); None when
    the value is not HOST[:PORT]."""
    found = _HOST.fullmatch(header.strip().lower())
    if found is None:
        return None
    return (found["ipv6"] or found["name"]).removesuffix(".") or None


@dataclass(frozen=True)
class AllowedHosts:
    """Names answered exactly, and suffixes (".example" for "*.example") that match any
    subdomain at any depth but not the bare name itself."""

    names: frozenset[str]
    suffixes: tuple[str, ...]

    def allow(self, name: str) -> bool:
        return name in self.names or name.endswith(self.suffixes)


def allowed_hosts_of(settings: Settings) -> AllowedHosts | None:
    """The Host names `settings` accept; None when any Host is accepted (no allowed_hosts
    and an address other machines reach, where the operator's network decides)."""
    entries = [entry.strip().lower().strip("[]").removesuffix(".")
               for entry in settings.allowed_hosts]
    if not entries:
        if not is_loopback(settings.host):
            return None
        # The bound address itself is always a correct Host (127.0.0.2 as well).
        entries = [*LOOPBACK_NAMES, settings.host.strip("[]").lower()]
    return AllowedHosts(
        names=frozenset(entry for entry in entries if not entry.startswith("*.")),
        suffixes=tuple(entry[1:] for entry in entries if entry.startswith("*.")))


class HttpGuard:
    """Pure ASGI middleware: refuses a request on a foreign Host, or when the app is at
    capacity; lets everything else through untouched (bodies stream, nothing is buffered).

    `in_progress` counts the requests inside the app; it is only touched on the event
    loop's thread, so it needs no lock."""

    def __init__(self, app: ASGIApp, *, settings: Settings,
                 status_of: Mapping[type[RequestError], int]) -> None:
        self.app = app
        self.hosts = allowed_hosts_of(settings)
        self.capacity = settings.max_concurrent_requests
        self.status_of = status_of
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await self._refuse(refusal, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1

    def _refusal(self, scope: Scope) -> RequestError | None:
        if self.hosts is not None:
            headers = [value for name, value in scope["headers"] if name == b"host"]
            name = host_name(headers[0].decode("latin-1")) if len(headers) == 1 else None
            if name is None or not self.hosts.allow(name):
                return MalformedRequest("the Host header does not name this server; "
                                        "allowed_hosts lists the names it answers to", "host")
        if self.in_progress >= self.capacity:
            return Busy(f"{self.capacity} requests are in progress already "
                        "(max_concurrent_requests); retry later")
        return None

    async def _refuse(self, refusal: RequestError, send: Send) -> None:
        body = encode(Error(**refusal.payload()))
        await send({"type": "http.response.start", "status": self.status_of[type(refusal)],
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
