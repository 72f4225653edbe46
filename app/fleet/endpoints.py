"""Where a gateway reaches each registered instance: the `IP:PORT` an Endpoint Picker names.

A gateway routes an EPP's answer through an ORIGINAL_DST cluster, which connects to the
address in `x-gateway-destination-endpoint` as written: no name resolution, so the answer
must be an IP literal. The mapping from a registered instance to that endpoint:

1. its `endpoint` setting (`IP:PORT`), when given: for an instance kvroute reaches by
   another address than the gateway does (a Service name for kvroute, the pod for the
   gateway);
2. else the host and port of its `url` (80 or 443 by scheme when the URL has none), the
   host resolved to an address when it is a name (the first address the resolver gives:
   a name must stand for the one server, such as a pod's name under a headless Service).

Invariants: an endpoint is always normalized (`parse_endpoint`), so the same address is
the same string wherever it came from (an answer, a subset hint, the served endpoint the
gateway reports). Names are looked up at most once per RESOLVED_TTL (NOT_RESOLVED_TTL after
a failure), each lookup bounded by RESOLVE_TIMEOUT and shared by everyone who needs it
meanwhile; a caller that gives up (a cancelled stream) never cancels a lookup others wait
for, and no lookup outlives its timeout. An instance whose name does not resolve has no
endpoint and is not offered to the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvroute.app.patterns import format_endpoint

if TYPE_CHECKING:
    from kvroute.app.fleet.registry import Instance

__all__ = ["EndpointMap"]

log = logging.getLogger("kvroute.endpoints")

RESOLVED_TTL = 10.0  # Kubernetes DNS answers for pods live 5-30 s
NOT_RESOLVED_TTL = 2.0
RESOLVE_TIMEOUT = 2.0


def _origin(instance: Instance) -> tuple[str, int] | None:
    """The host and port of the instance's URL; None when it has no URL."""
    if not instance.url:
        return None
    parts = urlsplit(instance.url)
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


class EndpointMap:
    """Instances' endpoints, with a small cache of resolved names; one per event loop."""

    def __init__(self, *, resolved_ttl: float = RESOLVED_TTL,
                 not_resolved_ttl: float = NOT_RESOLVED_TTL,
                 timeout: float = RESOLVE_TIMEOUT) -> None:
        self._resolved_ttl = resolved_ttl
        self._not_resolved_ttl = not_resolved_ttl
        self._timeout = timeout
        # (host, port) -> (endpoint or None, good until)
        self._cache: dict[tuple[str, int], tuple[str | None, float]] = {}
        self._lookups: dict[tuple[str, int], asyncio.Task[str | None]] = {}

    async def endpoints(self, instances: Iterable[Instance]) -> dict[str, str]:
        """Instance id -> endpoint, for every instance that has one."""
        found: dict[str, str] = {}
        waiting: dict[str, asyncio.Future[str | None]] = {}
        now = time.monotonic()
        for instance in instances:
            if instance.config.endpoint is not None:
                found[instance.id] = instance.config.endpoint
                continue
            origin = _origin(instance)
            if origin is None:
                continue
            literal = _literal(*origin)
            if literal is not None:
                found[instance.id] = literal
                continue
            cached = self._cache.get(origin)
            if cached is not None and cached[1] > now:
                if cached[0] is not None:
                    found[instance.id] = cached[0]
                continue
            waiting[instance.id] = self._lookup(origin)
        for instance_id, lookup in waiting.items():
            # shield: a caller cancelled here leaves the shared lookup running to its end.
            endpoint = await asyncio.shield(lookup)
            if endpoint is not None:
                found[instance_id] = endpoint
        return found

    def _lookup(self, origin: tuple[str, int]) -> asyncio.Task[str | None]:
        task = self._lookups.get(origin)
        if task is None:
            task = asyncio.create_task(self._resolve(origin), name=f"resolve {origin[0]}")
            self._lookups[origin] = task
        return task

    async def _resolve(self, origin: tuple[str, int]) -> str | None:
        host, port = origin
        endpoint: str | None = None
        try:
            async with asyncio.timeout(self._timeout):
                answers = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM)
            endpoint = format_endpoint(str(answers[0][4][0]), port) if answers else None
            if endpoint is None:
                log.warning("instance host %s resolves to no address", host)
        except (OSError, TimeoutError, ValueError) as exc:
            log.warning("instance host %s does not resolve (%s); the EPP cannot name it "
                        "until it does", host, exc or type(exc).__name__)
        finally:
            ttl = self._resolved_ttl if endpoint is not None else self._not_resolved_ttl
            self._cache[origin] = (endpoint, time.monotonic() + ttl)
            self._lookups.pop(origin, None)
        return endpoint

    async def close(self) -> None:
        """Cancel lookups still running (at shutdown)."""
        lookups, self._lookups = list(self._lookups.values()), {}
        for task in lookups:
            task.cancel()
        for task in lookups:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _literal(host: str, port: int) -> str | None:
    try:
        return format_endpoint(host.strip("[]"), port)
    except ValueError:
        return None
