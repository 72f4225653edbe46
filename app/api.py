"""The HTTP API: route queries, instance management, health and metrics.

Request bodies on the hot path are decoded with msgspec against strict types, so
a float or a bool among token ids is refused with the path of the bad element
(`token_ids[3]`) instead of being coerced. Every error answer is JSON
`{"error": message, "field": name-or-null}`; no request can produce a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import ConfigError, Settings, parse_instance
from app.discovery import DiscoveryError
from app.metrics import CONTENT_TYPE, ServiceMetrics
from app.registry import DuplicateInstance, Instance, Registry, UnknownInstance
from app.routing import Score, TieBreaker, best_of, scores_for
from app.tokenizer import Tokenizer, TokenizerError, make_tokenizer
from index import PrefixIndex

__all__ = ["ApiError", "Service", "create_app"]

log = logging.getLogger("kvroute.api")

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
# vLLM hashes: signed (older versions) or unsigned 64-bit ints, or hex strings. msgspec
# bounds cannot span both ranges, so `_parse_hash` checks them.
EngineHash = int | str
_HEX = re.compile(r"(?:0x)?([0-9a-fA-F]+)")
_INPUTS = ("token_ids", "block_hashes", "prompt", "messages")
_READY_STATES = frozenset({"live", "degraded"})


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[dict[str, Any]] | None = None


class RouteRequest(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[TokenId] | None = None
    block_hashes: list[EngineHash] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    lora_name: str | None = None
    candidates: list[str] | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.extra = status, message, field, extra

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message, "field": self.field, **self.extra},
                            status_code=self.status)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status,
                    media_type="application/json")


def _field_of(validation_message: str) -> str | None:
    """`... - at `$.token_ids[3]`` -> `token_ids[3]`; unknown fields name themselves."""
    found = re.search(r"at `\$\.?(.*)`", validation_message)
    if found:
        return found.group(1) or None
    found = re.search(r"unknown field `([^`]*)`", validation_message)
    return found.group(1) if found else None


def _parse_hash(value: int | str, position: int) -> int | bytes:
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ApiError(422, "an integer block hash must fit in 64 bits (signed or "
                           "unsigned)", f"block_hashes[{position}]")
        return value
    match = _HEX.fullmatch(value.strip())
    digits = match.group(1) if match else ""
    if match and len(digits) <= 16:
        return int(digits, 16)
    if match and len(digits) in (32, 64):
        return bytes.fromhex(digits)
    raise ApiError(422, "a block hash string must be hex: up to 16 digits for an integer "
                   "hash, 32 or 64 for a bytes hash", f"block_hashes[{position}]")


class Service:
    """Everything one kvroute process owns; created in the app's lifespan."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.index = PrefixIndex()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        self.registry = Registry(self.index, self.client)
        self.metrics = ServiceMetrics(self.registry)
        self.tokenizer: Tokenizer | None = make_tokenizer(settings.tokenizer, self.client)
        self.ties = TieBreaker()
        self.started_at = time.monotonic()
        self._configured: list[Instance] = []
        self._ready = False

    async def start(self) -> None:
        for config in self.settings.instances:  # ids are unique: load_settings checked
            instance = await self.registry.add(config, wait_for_discovery=False)
            self._configured.append(instance)

    async def close(self) -> None:
        await self.registry.close()
        await self.client.aclose()

    def readiness(self) -> tuple[bool, str]:
        if self._ready:
            return True, "ready"
        waiting = [f"{worker.instance.id} rank {worker.endpoint.dp_rank}: {worker.state}"
                   for instance in self._configured for worker in instance.workers
                   if worker.state not in _READY_STATES]
        waiting += [f"{instance.id}: discovering ({instance.discovery_error or 'pending'})"
                    for instance in self._configured if not instance.workers]
        if not waiting:
            self._ready = True
            return True, "all configured workers are live"
        if time.monotonic() - self.started_at >= self.settings.ready_grace_seconds:
            self._ready = True
            return True, "startup grace period over; not live: " + "; ".join(waiting)
        return False, "waiting for: " + "; ".join(waiting)

    # -- routing ---------------------------------------------------------
    def _eligible(self, request: RouteRequest) -> list[Any]:
        if request.candidates is not None:
            unknown = sorted({c for c in request.candidates if c not in self.registry})
            if unknown:
                raise ApiError(422, f"unknown candidate instance(s): {', '.join(unknown)}",
                               "candidates", unknown=unknown)
            wanted = set(request.candidates)
        else:
            wanted = None
        return [
            worker
            for instance in self.registry
            if (wanted is None or instance.id in wanted) and instance.serves(request.model)
            for worker in instance.workers
            if worker.state != "down"
        ]

    def _check_sizes(self, request: RouteRequest) -> None:
        limits = self.settings
        if request.token_ids is not None and len(request.token_ids) > limits.max_prompt_tokens:
            raise ApiError(413, f"{len(request.token_ids)} token ids exceed the limit of "
                           f"{limits.max_prompt_tokens}", "token_ids")
        if (request.block_hashes is not None
                and len(request.block_hashes) > limits.max_block_hashes):
            raise ApiError(413, f"{len(request.block_hashes)} block hashes exceed the limit of "
                           f"{limits.max_block_hashes}", "block_hashes")
        text = request.prompt if request.prompt is not None else ""
        if request.messages is not None:
            text = "".join(str(m.content or "") for m in request.messages)
        if len(text) > limits.max_prompt_chars:
            field = "prompt" if request.prompt is not None else "messages"
            raise ApiError(413, f"{len(text)} characters exceed the limit of "
                           f"{limits.max_prompt_chars}", field)

    async def _tokens(self, request: RouteRequest, eligible: list[Any]) -> list[int]:
        if request.token_ids is not None:
            return request.token_ids
        field = "prompt" if request.prompt is not None else "messages"
        if self.tokenizer is None:
            raise ApiError(422, f"`{field}` needs a tokenizer; none is configured "
                           "(set `tokenizer`), or send token_ids", field)
        live = [w for w in eligible if w.state in _READY_STATES and w.instance.url]
        url = (live or [w for w in eligible if w.instance.url] or [None])[0]
        url = url.instance.url if url is not None else None
        try:
            if request.prompt is not None:
                tokens = await self.tokenizer.encode_prompt(request.prompt, url=url,
                                                            model=request.model)
            else:
                messages = [msgspec.to_builtins(m) for m in request.messages or ()]
                tokens = await self.tokenizer.encode_chat(messages, url=url,
                                                          model=request.model)
        except TokenizerError as exc:
            raise ApiError(exc.status, str(exc), field) from None
        if len(tokens) > self.settings.max_prompt_tokens:
            raise ApiError(413, f"{field} is {len(tokens)} tokens, over the limit of "
                           f"{self.settings.max_prompt_tokens}", field)
        return tokens

    async def route(self, body: bytes) -> tuple[str, dict[str, Any]]:
        """(input kind, answer) for a POST /v1/route body; raises ApiError."""
        try:
            request = msgspec.json.decode(body, type=RouteRequest)
        except msgspec.ValidationError as exc:
            raise ApiError(422, str(exc), _field_of(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}") from None
        given = [name for name in _INPUTS if getattr(request, name) is not None]
        if len(given) != 1:
            raise ApiError(422, "give exactly one of token_ids, block_hashes, prompt, messages"
                           + (f" (got {', '.join(given)})" if given else ""),
                           given[1] if len(given) > 1 else "token_ids")
        self._check_sizes(request)
        eligible = self._eligible(request)
        if not eligible:
            reason = "no registered instance" if not len(self.registry) else (
                "no live worker" + (f" serves model {request.model!r}" if request.model else "")
                + (" among the candidates" if request.candidates is not None else ""))
            raise ApiError(503, f"no eligible worker: {reason}")
        keys = [worker.key for worker in eligible]
        prompt_tokens: int | None
        if request.block_hashes is not None:
            hashes = [_parse_hash(h, i) for i, h in enumerate(request.block_hashes)]
            matches = self.index.match_hashes(hashes, workers=keys)
            prompt_tokens = None
        else:
            tokens = await self._tokens(request, eligible)
            eligible = [w for w in eligible if w.instance.id in self.registry]
            keys = [worker.key for worker in eligible]
            if not eligible:
                raise ApiError(503, "no eligible worker: the instances went away")
            # vLLM always computes a prompt's last token (it needs its logits), so its
            # prefix-cache hit is capped at the full blocks of all tokens but the last: a
            # prompt that ends on a block boundary reuses one block less than it holds.
            matches = self.index.match(tokens[:-1], lora_name=request.lora_name,
                                       workers=keys)
            prompt_tokens = len(tokens)
        scores = scores_for(((w.key, w.instance.block_size, w.state) for w in eligible), matches)
        best = best_of(scores, self.ties)
        urls = {worker.key: worker.instance.url for worker in eligible}
        if prompt_tokens:
            self.metrics.match_ratio.observe(best.matched_tokens / prompt_tokens)
        return given[0], {
            "instance": best.instance,
            "url": urls[(best.instance, best.dp_rank)],
            "dp_rank": best.dp_rank,
            "matched_blocks": best.matched_blocks,
            "matched_tokens": best.matched_tokens,
            "prompt_tokens": prompt_tokens,
            "prompt_blocks": len(request.block_hashes) if request.block_hashes else None,
            "scores": [score.as_json() for score in _ranked(scores)],
        }

    # -- instances -------------------------------------------------------
    def instance_json(self, instance: Instance, *, detail: bool = False) -> dict[str, Any]:
        states = [worker.state for worker in instance.workers]
        if not states:
            state = "discovering"
        elif all(s in _READY_STATES for s in states):
            state = "degraded" if "degraded" in states else "live"
        else:
            state = "down" if all(s == "down" for s in states) else next(
                s for s in states if s not in _READY_STATES)
        out: dict[str, Any] = {
            "id": instance.id,
            "url": instance.url,
            "models": list(instance.models),
            "block_size": instance.block_size,
            "state": state,
            "dp_size": len(instance.workers),
        }
        if instance.discovery_error:
            out["discovery_error"] = instance.discovery_error
        if detail:
            holdings = self.index.stats().holdings
            out["workers"] = [
                {
                    "dp_rank": worker.endpoint.dp_rank,
                    "events_endpoint": worker.endpoint.endpoint,
                    "replay_endpoint": worker.endpoint.replay_endpoint,
                    "state": worker.state,
                    "holdings": dict(holdings.get(worker.key, {})),
                    "stats": _status_json(worker.subscriber.status),
                }
                for worker in instance.workers
            ]
        return out


def _ranked(scores: list[Score]) -> list[Score]:
    return sorted(scores, key=lambda s: (-s.matched_tokens, s.instance, s.dp_rank))


def _status_json(status: Any) -> dict[str, Any]:
    raw = msgspec.to_builtins(status, builtin_types=(), str_keys=True) if isinstance(
        status, msgspec.Struct) else dict(getattr(status, "__dict__", {}) or {
            name: getattr(status, name) for name in getattr(status, "__slots__", ())})
    return {key: (str(value) if key == "state" else value) for key, value in raw.items()
            if isinstance(value, str | int | float | bool | type(None)) or key == "state"}


def create_app(settings: Settings) -> FastAPI:
    """The ASGI app; the Service is built and torn down in its lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = Service(settings)
        app.state.service = service
        try:
            await service.start()
            yield
        finally:
            await service.close()

    app = FastAPI(title="kvroute", version="0.1.0", lifespan=lifespan,
                  summary="KV-cache-aware routing index for vLLM fleets")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if request.url.path == "/v1/route":
            request.app.state.service.metrics.route_errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return JSONResponse({"error": f"internal error: {exc.__class__.__name__}",
                             "field": None}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse({"error": first.get("msg", "invalid request"), "field": field},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail), "field": None},
                            status_code=exc.status_code)

    def service_of(request: Request) -> Service:
        return request.app.state.service

    async def read_body(request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"body of {declared} bytes exceeds the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"body exceeds the limit of {limit} bytes")
        return bytes(body)

    @app.post("/v1/route", summary="The worker with the longest cached prefix of a prompt")
    async def route(request: Request) -> Response:
        service = service_of(request)
        started = time.perf_counter()
        kind, answer = await service.route(await read_body(request, settings.max_body_bytes))
        service.metrics.route_latency.labels(kind).observe(time.perf_counter() - started)
        return _json(answer)

    @app.get("/v1/instances")
    async def list_instances(request: Request) -> Response:
        service = service_of(request)
        return _json({"instances": [service.instance_json(i) for i in service.registry]})

    @app.post("/v1/instances", status_code=201)
    async def add_instance(request: Request) -> Response:
        service = service_of(request)
        body = await read_body(request, 64 * 1024)
        try:
            raw = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}") from None
        try:
            config = parse_instance(raw, "body")
        except ConfigError as exc:
            found = re.match(r"body\.(\w+)", str(exc))
            raise ApiError(422, str(exc), found.group(1) if found else None) from None
        try:
            instance = await service.registry.add(config)
        except DuplicateInstance as exc:
            raise ApiError(409, f"instance {exc} is already registered", "id") from None
        except DiscoveryError as exc:
            raise ApiError(502, f"discovery failed: {exc}", "url") from None
        return _json(service.instance_json(instance, detail=True), status=201)

    @app.get("/v1/instances/{instance_id}")
    async def get_instance(instance_id: str, request: Request) -> Response:
        service = service_of(request)
        try:
            return _json(service.instance_json(service.registry.get(instance_id), detail=True))
        except UnknownInstance:
            raise ApiError(404, f"unknown instance {instance_id!r}", "instance_id") from None

    @app.delete("/v1/instances/{instance_id}")
    async def delete_instance(instance_id: str, request: Request) -> Response:
        service = service_of(request)
        try:
            instance = await service.registry.remove(instance_id)
        except UnknownInstance:
            raise ApiError(404, f"unknown instance {instance_id!r}", "instance_id") from None
        return _json({"deleted": instance.id})

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        ready, reason = service_of(request).readiness()
        return _json({"ready": ready, "reason": reason}, status=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(service_of(request).metrics.render(), media_type=CONTENT_TYPE)

    return app
