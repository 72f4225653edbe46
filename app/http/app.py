"""The HTTP API: route queries, instance management, health and metrics.

Every error answer is JSON `{"error": message, "field": name-or-null}`; no request
can produce a traceback. The decisions themselves live in `app.service`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any, Protocol

import msgspec
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Scope

from kvroute.app.api.answers import (
    DecisionLogAnswer,
    Deleted,
    Error,
    Health,
    Readiness,
    encode,
)
from kvroute.app.api.contract import DECISIONS_PAGE, REGISTRATION_MAX_BYTES
from kvroute.app.api.json_body import decode_json, integral_numbers
from kvroute.app.config import ConfigError, Settings, parse_instance
from kvroute.app.errors import (
    AlreadyExists,
    Busy,
    Conflict,
    InvalidRequest,
    LimitReached,
    MalformedRequest,
    NoEligibleWorker,
    NotAllowed,
    NotFound,
    RequestError,
    TimedOut,
    TooLarge,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamFailed,
)
from kvroute.app.fleet.discovery import DiscoveryError
from kvroute.app.fleet.dns import Resolver
from kvroute.app.fleet.gc_freeze import FleetFreezer
from kvroute.app.fleet.registry import DuplicateInstance, ModelNotServed, UnknownInstance
from kvroute.app.http.auth import admin_guard, api_guard
from kvroute.app.http.dashboard import PAGES, SECURITY_HEADERS, Page, snapshot
from kvroute.app.http.guard import HttpGuard
from kvroute.app.http.openapi import openapi_document
from kvroute.app.http.paced_changes import PacedFleetChanges
from kvroute.app.http.proxy import Proxy, add_proxy_routes
from kvroute.app.http.request_body import read_body
from kvroute.app.http.route_asgi import (
    MATCH_PATH,
    ROUTE_PATH,
    RouteFastPath,
    answer_match,
    answer_route,
    count_error,
)
from kvroute.app.loop_lag import LoopLagMonitor
from kvroute.app.metrics import CONTENT_TYPE
from kvroute.app.service import Service

__all__ = ["allowed_methods", "create_app"]

log = logging.getLogger("kvroute.api")

# The one place a refusal becomes an HTTP status.
STATUS_OF: dict[type[RequestError], int] = {
    MalformedRequest: 400,
    Unauthorized: 401,
    NotAllowed: 403,
    NotFound: 404,
    TimedOut: 408,
    AlreadyExists: 409,
    Conflict: 409,
    LimitReached: 409,
    TooLarge: 413,
    UnsupportedMediaType: 415,
    InvalidRequest: 422,
    Busy: 429,
    UpstreamFailed: 502,
    NoEligibleWorker: 503,
}


def _json(answer: msgspec.Struct, status: int = 200) -> Response:
    return Response(encode(answer), status_code=status, media_type="application/json")


def _error(status: int, answer: Error, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(answer), status_code=status, media_type="application/json",
                    headers=headers)


def allowed_methods(app: FastAPI, scope: Scope) -> str:
    """The methods some route of `app` answers on the request's path, as an Allow value."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods and route.path_regex.fullmatch(
                scope["path"]):
            methods |= route.methods
    return ", ".join(sorted(methods))


def _static(page: Page) -> Any:
    """An endpoint answering one of the dashboard's files, read once here."""
    content = page.read()

    async def serve() -> Response:
        return Response(content, media_type=page.media_type, headers=SECURITY_HEADERS)

    return serve


def _refreeze_metric(registry: CollectorRegistry) -> Callable[[float, int], None]:
    """Records each garbage-collector re-freeze's pause (app.fleet.gc_freeze)."""
    pauses = Histogram("kvroute_gc_refreeze_seconds",
                       "how long each unfreeze, full collection and freeze held the event loop",
                       registry=registry,
                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
    freed = Counter("kvroute_gc_refreeze_freed_objects",
                    "objects the re-freezes' collections freed (garbage the freezes kept)",
                    registry=registry)

    def record(pause: float, objects: int) -> None:
        pauses.observe(pause)
        freed.inc(objects)
        log.info("garbage collector: re-froze the fleet in %.1f ms, %d objects freed",
                 pause * 1000, objects)

    return record


class Companion(Protocol):
    """A server beside the HTTP API on the same service (the Endpoint Picker)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_app(settings: Settings, *, resolver: Resolver | None = None,
               freeze_fleet: bool = False,
               companions: Mapping[str, Callable[[Service], Companion]] | None = None
               ) -> FastAPI:
    """The ASGI app; the Service is built and torn down in its lifespan (`resolver`: how
    fleets' DNS names resolve, default the system's). With `freeze_fleet` (a process
    that serves only this app: `kvroute serve`), the objects the fleet's workers keep are
    left out of the garbage collector's passes, at start-up and as instances join
    (app.fleet.gc_freeze).

    `companions` (from the composition root, app.server) are made with the service once it
    has started, started in order, kept in `app.state.companions` under their names, and
    stopped in reverse order before the service closes."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = Service(settings, resolver=resolver)
        if settings.proxy:
            log.info("proxy on: text and chat prompts are tokenized %s",
                     "by the instances' /tokenize (tokenizer = \"instance\")"
                     if settings.tokenizer == "instance"
                     else f"locally with {settings.tokenizer}")
        app.state.service = service
        app.state.freezer = None
        app.state.companions = started = {}
        proxy = freezing = None
        lag = LoopLagMonitor(service.metrics.registry)
        try:
            lag.start()
            await service.start()
            if freeze_fleet:
                freezing = FleetFreezer(
                    service.registry, lambda: service.readiness()[0],
                    refreeze_interval=settings.gc_refreeze_interval,
                    on_refreeze=_refreeze_metric(service.metrics.registry))
                freezing.start()
                app.state.freezer = freezing
            # The proxy's HTTP client lives as long as the service it forwards for.
            proxy = app.state.proxy = Proxy(service) if settings.proxy else None
            for name, make in (companions or {}).items():
                companion = make(service)
                await companion.start()
                started[name] = companion
            yield
        finally:
            await lag.stop()
            if freezing is not None:
                await freezing.stop()
            for companion in reversed(started.values()):
                await companion.stop()
            if proxy is not None:
                await proxy.close()
            await service.close()

    docs = settings.docs
    # No redirect from /path/ to /path: an API client gets a 404, not a 307 it must follow.
    app = FastAPI(title="kvroute", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  summary="KV-cache-aware routing index for vLLM fleets",
                  openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    # Registrations and removals run in the fleet's turns (app.http.paced_changes): innermost,
    # so the guard's refusals and the route fast path never wait for one.
    app.add_middleware(PacedFleetChanges, guard=admin_guard(settings))
    # POST /v1/route and /v1/match are answered below the guard, past FastAPI's layers
    # (app.http.route_asgi); the endpoints declared further down give the same answers and the
    # OpenAPI contract.
    app.add_middleware(RouteFastPath, settings=settings, guard=api_guard(settings),
                       status_of=STATUS_OF)
    # Foreign Host names and requests past max_concurrent_requests never reach an endpoint.
    app.add_middleware(HttpGuard, settings=settings, status_of=STATUS_OF)
    api = [Depends(api_guard(settings))]
    admin = [Depends(admin_guard(settings))]

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> Response:
        status = STATUS_OF[type(exc)]
        count_error(request, status)
        return _error(status, Error(**exc.payload()),
                      headers={"www-authenticate": "Bearer"} if status == 401 else None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return _error(500, Error(f"internal error: {exc.__class__.__name__}", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(422, Error(first.get("msg", "invalid request"), field))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette names only the first route of the path; every method of it is
            # allowed (RFC 9110: a 405 lists them all).
            allowed = allowed_methods(request.app, request.scope)
            return _error(405, Error(f"{request.method} is not allowed on "
                                     f"{request.url.path}; allowed: {allowed}", None),
                          headers={"allow": allowed})
        return _error(exc.status_code, Error(str(exc.detail), None))

    def service_of(request: Request) -> Service:
        return request.app.state.service

    @app.post(ROUTE_PATH, dependencies=api)
    async def route(request: Request) -> Response:
        # Reached only where RouteFastPath does not answer first (it answers every POST).
        return Response(await answer_route(request, settings), media_type="application/json")

    @app.post(MATCH_PATH, dependencies=api)
    async def match(request: Request) -> Response:
        # Reached only where RouteFastPath does not answer first (it answers every POST).
        return Response(await answer_match(request, settings), media_type="application/json")

    @app.get("/v1/instances", dependencies=api)
    async def list_instances(request: Request) -> Response:
        return _json(await service_of(request).instance_list())

    @app.get("/v1/instances/{instance_id}", dependencies=api)
    async def get_instance(instance_id: str, request: Request) -> Response:
        service = service_of(request)
        try:
            return _json(service.instance_detail(service.registry.get(instance_id)))
        except UnknownInstance:
            raise NotFound(f"unknown instance {instance_id!r}", "instance_id") from None

    # Off: the instances are the configured ones; POST and DELETE answer 405.
    if settings.manage_instances:
        @app.post("/v1/instances", status_code=201, dependencies=admin)
        async def add_instance(request: Request) -> Response:
            service = service_of(request)
            body = await read_body(request, REGISTRATION_MAX_BYTES,
                                   timeout=settings.body_timeout)
            raw = integral_numbers(decode_json(body))  # block_size 16.0 is 16 to its schema
            try:
                config = parse_instance(raw, "body")
            except ConfigError as exc:
                raise InvalidRequest(str(exc), exc.field) from None
            try:
                instance = await service.registry.add(config)
            except DuplicateInstance as exc:
                raise AlreadyExists(f"instance {exc} is already registered", "id") from None
            except ModelNotServed as exc:
                raise Conflict(f"{exc}", "model") from None
            except DiscoveryError as exc:
                raise UpstreamFailed(f"discovery failed: {exc}", "url") from None
            return _json(service.instance_detail(instance), status=201)

        @app.delete("/v1/instances/{instance_id}", dependencies=admin)
        async def delete_instance(instance_id: str, request: Request) -> Response:
            service = service_of(request)
            try:
                fleet = service.registry.get(instance_id).fleet
                if fleet is not None:  # it would come back at the fleet's next refresh
                    raise Conflict(f"instance {instance_id!r} is an address of fleet "
                                   f"{fleet!r}, which follows DNS; it leaves when its address "
                                   "does", "instance_id")
                instance = await service.registry.remove(instance_id)
            except UnknownInstance:
                raise NotFound(f"unknown instance {instance_id!r}", "instance_id") from None
            return _json(Deleted(instance.id))

    if settings.proxy:
        add_proxy_routes(app, dependencies=api)

    if settings.decision_log:
        @app.get("/v1/decisions", dependencies=api)
        async def decisions(request: Request, since: Annotated[int, Query(ge=0)] = 0,
                            limit: Annotated[int, Query(ge=1, le=DECISIONS_PAGE)] = DECISIONS_PAGE
                            ) -> Response:
            """The decision log (app.routing.decision_log): entries with an id above `since`,
            oldest first, at most `limit`."""
            kept = service_of(request).decisions
            assert kept is not None  # declared only when the log is on
            return _json(DecisionLogAnswer(kept.capacity, kept.entries(since, limit)))

    @app.get("/v1/dashboard", dependencies=api)
    async def dashboard_data(request: Request) -> Response:
        return _json(await snapshot(service_of(request)))

    # The dashboard's files hold no data (the page asks /v1/dashboard, with the token), so
    # they are served without one: a browser cannot send a bearer token for a page load.
    for path, page in PAGES.items():
        app.add_api_route(path, _static(page), methods=["GET"],
                          name="dashboard" + path.removeprefix("/dashboard").replace(".", "_")
                          .replace("/", "_"))

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json(Health("ok"))

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        service = service_of(request)
        ready, reason = service.readiness()
        answer = Readiness(ready=ready, reason=reason)
        if service.peers is not None:  # losing Valkey leaves a replica ready: it routes alone
            answer.replicas = service.peers.status()
        if service.state is not None:  # a failing save leaves it ready: it still routes
            answer.saved_state = service.state.status()
        return _json(answer, status=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(await service_of(request).metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        # What each operation takes and answers is app.api.contract's; built once, on demand.
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
