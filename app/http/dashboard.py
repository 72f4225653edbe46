"""What the live dashboard shows: one snapshot of the service, and the pages that show it.

`GET /v1/dashboard` answers `snapshot(service)`: every instance and worker with its state,
holdings by medium, subscriber counters (events, gaps, replays), load (the proxy's requests
in flight, the instance's own gauges), routing decisions per worker, and predicted against
actual cached tokens. Everything in it is a current value or a counter since start: the
page computes rates and keeps the history itself, so the service keeps none and the
answer's size depends only on the fleet's size.

`GET /dashboard` serves the page (`PAGES`): plain HTML, JavaScript and CSS shipped in the
package (`dashboard_static/`), read once; nothing is built and nothing is fetched from
anywhere but this server (its Content-Security-Policy says so to the browser).

Routing decisions come from the service's `RouteActivity` (app.routing.activity).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING

from kvroute.app.api.answers import (
    Dashboard,
    DashboardHits,
    DashboardInstance,
    DashboardRoutes,
    DashboardWorker,
    MediumCounts,
)

if TYPE_CHECKING:
    from kvroute.app.service import Service

__all__ = ["PAGES", "Page", "snapshot"]


async def snapshot(service: Service) -> Dashboard:
    """The dashboard's view of `service` now: its instances a slice at a time
    (`Service.instance_slices`), each as of its slice."""
    index = service.index
    index.expire_unconfirmed(time.monotonic())  # never show blocks that already expired
    stats = index.stats()
    hits = service.metrics.hits
    activity = service.activity
    followed = {worker.key for worker in service.registry.workers()}
    hits.forget(followed)
    activity.forget(followed)
    instances = []
    async for registered in service.instance_slices():
        for instance in registered:
            summary = service.instance_summary(instance)
            workers = []
            for worker in instance.workers:
                key = worker.key
                forwarded = service.inflight.get(key)
                load = service.load.get(key)
                totals = hits.totals.get(key)
                workers.append(DashboardWorker(
                    dp_rank=worker.endpoint.dp_rank,
                    state=worker.state,
                    holdings=MediumCounts.of(index.held_by_medium(key)),
                    unconfirmed_blocks=index.unconfirmed_blocks(key),
                    stats=worker.subscriber.status,
                    inflight=forwarded.requests,
                    queued_prefill=forwarded.queued_prefill_tokens,
                    running=load.running if load else None,
                    waiting=load.waiting if load else None,
                    kv_usage=load.kv_usage if load else None,
                    routed=activity.per_worker.get(key, 0),
                    hits=DashboardHits(
                        requests=totals.requests if totals else 0,
                        exact=totals.exact if totals else 0,
                        predicted=totals.predicted if totals else 0,
                        actual=totals.actual if totals else 0,
                        unavailable=totals.unavailable if totals else 0)))
            instances.append(DashboardInstance(
                id=instance.id, url=instance.url, state=summary.state, models=summary.models,
                block_size=instance.block_size, workers=workers))
    ready, reason = service.readiness()
    p50, p99 = activity.percentiles_ms()
    return Dashboard(
        time=time.time(),
        uptime_seconds=time.monotonic() - service.started_at,
        ready=ready,
        ready_reason=reason,
        proxy=service.settings.proxy,
        index_nodes=stats.nodes,
        index_bytes=stats.estimated_bytes,
        routes=DashboardRoutes(decisions=activity.decisions, routed=activity.routed,
                               seconds=activity.seconds, recent_p50_ms=p50,
                               recent_p99_ms=p99),
        instances=instances)


@dataclass(frozen=True, slots=True)
class Page:
    """One static file of the dashboard."""

    file: str
    media_type: str

    def read(self) -> bytes:
        return (files("kvroute.app.http") / "dashboard_static" / self.file).read_bytes()


# Path -> file. The page names the others relative to itself, so it works under a prefix.
PAGES = {
    "/dashboard": Page("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": Page("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": Page("style.css", "text/css; charset=utf-8"),
}
# Only this server's own files and JSON; no inline script, no frames, no other origin.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "frame-ancestors 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}
