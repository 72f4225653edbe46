"""OpenAI-compatible proxy mode (`kvroute serve --proxy`).

`POST /v1/completions` and `POST /v1/chat/completions` are routed with `Service.decide`
and forwarded to the chosen worker; `GET /v1/models` lists the union of the registered
instances' models. Invariants:

- The request body goes upstream byte for byte, to `{instance url}{path}` with the worker's
  data-parallel rank in `X-data-parallel-rank` (vLLM's API server reads that header and
  pins the request to that engine). End-to-end request headers pass through; hop-by-hop
  ones, `Host` and `Content-Length` do not, and `Accept-Encoding` is the client's or
  `identity` (so the body relayed raw is one the client can read).
- The upstream answer (status, headers but hop-by-hop ones, body, streamed or not) is
  relayed byte for byte as it arrives, errors included. Three headers are added:
  `x-kvroute-instance`, `x-kvroute-dp-rank` and `x-kvroute-attempts`.
- Retries: only when the chosen worker refused the connection (or it could not be
  established in time), i.e. before any byte of the request was sent; the next choice
  excludes every worker that failed, at most `MAX_CONNECT_ATTEMPTS` connections in all,
  then 503. Never after the upstream accepted the connection: generation is not idempotent.
- Every forwarded request holds a ticket in `service.inflight` (see `app.routing.inflight`) from
  before it connects until its response has ended: closed when the connection fails, when
  the upstream fails before answering, or when the relayed response ends however it ends
  (complete, client gone, upstream broken, the ASGI task cancelled). The ticket is closed
  before anything else is awaited, so no cancellation can skip it. Its prefill tokens stop
  counting as queued when the answer's first byte arrives.
- A client that goes away closes the upstream response and its connection, which is how
  vLLM learns to abort the request. This holds while the response is relayed; a client that
  leaves while a non-streamed request is still waiting for its answer is noticed too: the
  pending upstream request is cancelled.
- Every relayed answer is watched for vLLM's `usage.prompt_tokens_details.cached_tokens`
  (app.routing.accuracy) as its chunks pass, without holding any back; each forwarded request
  is recorded there once: compared with the decision's predicted `matched_tokens`, or
  counted as unavailable with its reason.
- Batched completions (`prompt` a list of strings or of token lists) are forwarded as they
  are and routed by their first prompt: vLLM runs a batch on the one instance it reaches.
  What kvroute reads of a body, and how it checks it, is `app.api.openai_request`.
- Errors of the proxy itself are kvroute's JSON `{"error", "field"}`: 400 for a body that is
  not an OpenAI request, 404 for a model no registered instance serves, 413 for size
  limits, 502 for an upstream that broke before answering, 503 when no worker is left.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from kvroute.app.api.answers import ModelCard, ModelList, encode
from kvroute.app.api.openai_request import route_request_of
from kvroute.app.errors import NoEligibleWorker, NotFound, UpstreamFailed
from kvroute.app.fleet.registry import Worker
from kvroute.app.fleet.upstream import url_at
from kvroute.app.http.request_body import read_body
from kvroute.app.routing.accuracy import HitWatch
from kvroute.app.routing.inflight import Ticket
from kvroute.app.service import Decision, Service
from kvroute.app.workers import WorkerKey

__all__ = ["MAX_CONNECT_ATTEMPTS", "Proxy", "add_proxy_routes"]

log = logging.getLogger("kvroute.proxy")

MAX_CONNECT_ATTEMPTS = 3
# Generation can take minutes and a stream can pause between tokens, so reads never time
# out: a client that gives up closes its connection, and that closes the upstream one.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=30.0)
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
# `expect: 100-continue` was answered to the client already; the body goes upstream whole.
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect",
                                "x-data-parallel-rank"}
# uvicorn adds its own `date` and `server`; relaying the upstream's would duplicate them.
_NOT_RELAYED = _HOP_BY_HOP | {"date", "server"}
# Rewritten with this hop appended.
_FORWARDING = frozenset({"x-forwarded-for", "forwarded"})


def _forwarded_headers(request: Request, worker: Worker,
                       instance_key: bool) -> list[tuple[str, str]]:
    """The client's headers for the instance. Hop-by-hop ones (and those the client's
    `Connection` names) stay here; with `instance_key` so does the client's
    `Authorization`, and the instance's own `api_key` (if it has one) is sent instead."""
    named = {name.strip().lower() for name in request.headers.get("connection", "").split(",")}
    api_key = worker.instance.config.api_key if instance_key else None
    skip = _NOT_FORWARDED | named | _FORWARDING | ({"authorization"} if instance_key else set())
    headers = [(name, value) for name, value in request.headers.items() if name not in skip]
    headers.append(("accept-encoding", request.headers.get("accept-encoding", "identity")))
    headers.append(("x-data-parallel-rank", str(worker.endpoint.dp_rank)))
    if api_key:
        headers.append(("authorization", f"Bearer {api_key}"))
    client = request.client.host if request.client else "unknown"
    node = f'"[{client}]"' if ":" in client else client
    for name, hop in (("x-forwarded-for", client), ("forwarded", f"for={node}")):
        earlier = ", ".join(request.headers.getlist(name))
        headers.append((name, f"{earlier}, {hop}" if earlier else hop))
    return headers


def _relayed_headers(upstream: httpx.Response, worker: Worker, attempts: int,
                     logged: int | None = None) -> list[tuple[str, str]]:
    headers = [(name, value) for name, value in upstream.headers.multi_items()
               if name.lower() not in _NOT_RELAYED]
    headers += [("x-kvroute-instance", worker.instance.id),
                ("x-kvroute-dp-rank", str(worker.endpoint.dp_rank)),
                ("x-kvroute-attempts", str(attempts))]
    if logged is not None:  # the decision's id in GET /v1/decisions
        headers.append(("x-kvroute-decision", str(logged)))
    return headers


class _Relay(StreamingResponse):
    """The upstream response, relayed raw. However the relay ends, the ticket is closed
    first and then the upstream response: a Starlette stream cancelled while its generator
    waits at `yield` would otherwise leave the upstream connection open until garbage
    collection. The hit watch sees every chunk as it passes and is finished once, complete
    only when the upstream body was read to its end."""

    def __init__(self, upstream: httpx.Response, headers: list[tuple[str, str]],
                 ticket: Ticket, watch: HitWatch) -> None:
        super().__init__(self._chunks(upstream.aiter_raw()), status_code=upstream.status_code)
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers]
        self._upstream = upstream
        self._ticket = ticket
        self._watch = watch
        self._ended = False
        watch.start(upstream.status_code, upstream.headers.get("content-encoding"))

    async def _chunks(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self._ticket.started()
            self._watch.feed(chunk)
            yield chunk
        self._ended = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ticket.close()  # never awaits: nothing can cancel it half-way
            self._watch.finish(self._ended)  # never awaits either
            await self._upstream.aclose()


class Proxy:
    """Forwards OpenAI requests; owns the HTTP client used for upstream calls."""

    def __init__(self, service: Service) -> None:
        self.service = service
        settings = service.settings
        # With kvroute's own token the client's Authorization is that token, not vLLM's.
        self.instance_key = settings.proxy_instance_key or settings.api_token is not None
        # No pool cap: each relayed request holds one connection for its whole response,
        # and a cap would queue clients in kvroute instead of in vLLM's scheduler.
        self.client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def close(self) -> None:
        await self.client.aclose()

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        if not any(instance.serves(model) for instance in self.service.registry):
            raise NotFound(f"model {model!r} is not served by any registered instance",
                           "model")

    async def forward(self, request: Request, path: str) -> Response:
        body = await read_body(request, self.service.settings.max_body_bytes,
                               timeout=self.service.settings.body_timeout)
        question = route_request_of(path, body, self.service.route_request)
        self._check_model(question.model)
        failed: set[WorkerKey] = set()
        refused: list[str] = []
        # Terminates: every pass excludes one more worker, and decide() raises once none is
        # left; connections are attempted at most MAX_CONNECT_ATTEMPTS times.
        while True:
            try:
                decision = await self.service.decide(question, exclude=frozenset(failed),
                                                     mode="proxy")
            except NoEligibleWorker as exc:
                if refused:
                    raise NoEligibleWorker(f"{exc.message}; connection refused by "
                                           f"{', '.join(refused)}") from None
                raise
            worker = decision.worker
            failed.add(worker.key)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("chose %s rank %d; scores %s", worker.instance.id,
                          worker.endpoint.dp_rank, [s.answer() for s in decision.scores])
            if decision.tokens is not None and question.token_ids is None:
                # A retry routes the same tokens without asking a tokenizer again.
                question = msgspec.structs.replace(question, prompt=None, messages=None,
                                                   token_ids=decision.tokens)
            if not worker.instance.url:
                continue  # configured with event endpoints only: nowhere to send requests
            response = await self._attempt(request, path, body, worker, len(refused) + 1,
                                           decision)
            if response is not None:
                return response
            self.service.retract(decision)
            refused.append(f"{worker.instance.id} rank {worker.endpoint.dp_rank}")
            if len(refused) >= MAX_CONNECT_ATTEMPTS:
                raise NoEligibleWorker(f"no worker accepted the connection after "
                                       f"{len(refused)} attempts: {', '.join(refused)}")

    async def _attempt(self, request: Request, path: str, body: bytes, worker: Worker,
                       attempt: int, decision: Decision) -> Response | None:
        """The relayed response, or None when the worker refused the connection."""
        url = url_at(worker.instance.url, path)
        upstream_request = self.client.build_request(
            "POST", url, content=body, params=request.url.query or None,
            headers=_forwarded_headers(request, worker, self.instance_key))
        ticket = self.service.inflight.open(worker.key, decision.uncached_tokens)
        decisions = self.service.decisions
        watch = self.service.metrics.hits.watch(
            worker.key, decision.best.matched_tokens, len(decision.tokens or ()),
            None if decisions is None or decision.logged is None
            else functools.partial(decisions.outcome, decision.logged))
        relayed = False
        # Unless the relay takes the watch over: "incomplete" when the client left or the
        # task was cancelled, "error" when the instance broke, None when it was never sent.
        unavailable: str | None = "incomplete"
        try:
            upstream = await _unless_client_leaves(
                request, self.client.send(upstream_request, stream=True))
            try:
                relay = _Relay(upstream, _relayed_headers(upstream, worker, attempt,
                                                          decision.logged), ticket, watch)
            except BaseException:
                await upstream.aclose()
                raise
            relayed = True
            return relay
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            log.warning("%s refused the connection (%r); choosing another worker", url, exc)
            unavailable = None  # nothing reached the worker: there is nothing to compare
            return None
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        except httpx.HTTPError as exc:
            unavailable = "error"
            # Only the class: a protocol error's text may quote what the instance sent.
            raise UpstreamFailed(f"{url} failed before answering: "
                                 f"{exc.__class__.__name__}") from None
        finally:
            if not relayed:  # from here on the relay owns the ticket and the watch
                ticket.close()
                if unavailable is not None:
                    watch.finish(False, unavailable)

    def models(self) -> ModelList:
        """vLLM's model list shape; a model served by several instances is listed once."""
        cards: dict[str, ModelCard] = {}
        for instance in self.service.registry:
            for model in instance.models:
                cards.setdefault(model, ModelCard(id=model, object="model",
                                                  created=int(instance.added_at),
                                                  owned_by="vllm"))
        return ModelList(object="list", data=list(cards.values()))


class _ClientGone(Exception):
    pass


async def _unless_client_leaves(request: Request, pending: Awaitable[httpx.Response]
                                ) -> httpx.Response:
    """Await the upstream's answer, cancelling it if the client disconnects meanwhile (the
    body is read already, so the next ASGI message can only be the disconnect)."""
    answer = asyncio.ensure_future(pending)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
    if answer in done:
        return answer.result()
    # Let the cancelled send finish (that closes the half-open upstream connection), and
    # close the answer should it have arrived before the cancellation did.
    await asyncio.wait({answer})
    if not answer.cancelled() and answer.exception() is None:
        await answer.result().aclose()
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def add_proxy_routes(app: FastAPI, dependencies: Sequence[Any]) -> None:
    """The proxy's routes, on `app` itself (an included router is a nested object that
    app.http.app's 405 answer and app.http.openapi would have to look into). They forward through
    ``app.state.proxy``, which the app's lifespan creates after the service has started and
    closes before it stops."""

    def proxy_of(request: Request) -> Proxy:
        return request.app.state.proxy

    @app.post("/v1/completions", dependencies=dependencies)
    async def completions(request: Request) -> Response:
        return await proxy_of(request).forward(request, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=dependencies)
    async def chat_completions(request: Request) -> Response:
        return await proxy_of(request).forward(request, "/v1/chat/completions")

    @app.get("/v1/models", dependencies=dependencies)
    async def models(request: Request) -> Response:
        return Response(encode(proxy_of(request).models()), media_type="application/json")
