"""A LoadMonitor over one registered instance, for tests that serve its /metrics pages."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from kvroute.app.config import InstanceConfig
from kvroute.app.fleet.registry import Registry
from kvroute.app.routing.load import LoadMonitor
from kvroute.index import PrefixIndex


@asynccontextmanager
async def watching(instance_id: str, url: str, events: str,
                   interval: float) -> AsyncIterator[tuple[LoadMonitor, Registry]]:
    """The instance `instance_id` at `url` (its events at `events`) registered, and a monitor
    of it that is not started (tests call `scrape_once`, or start and stop it); the
    registry is closed on the way out."""
    async with httpx.AsyncClient() as client:
        registry = Registry(PrefixIndex(), client, max_instances=4)
        try:
            await registry.add(InstanceConfig(id=instance_id, url=url, events=(events,)),
                               wait_for_discovery=False)
            yield LoadMonitor(registry, client, interval=interval), registry
        finally:
            await registry.close()
