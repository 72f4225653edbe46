"""kvroute as an Endpoint Picker: Envoy's `ext_proc` stream, one per HTTP request.

The gateway opens a `Process` stream for each request it routes to the pool and sends the
request headers, then the body in chunks (FULL_DUPLEX_STREAMED), then, on the response
side, the response's headers, body and trailers. For each stream kvroute:

1. reads the request headers and buffers the body until its end (`end_of_stream`, or the
   request trailers), refusing a body over `max_body_bytes` (413, as soon as it is known)
   or one that takes longer than `body_timeout` (408);
2. decides exactly as `POST /v1/route` and the proxy do (`Service.decide` on the question
   `openai_request.route_request_of` reads from an OpenAI completions or chat body: token ids or
   text), among the workers whose instance has an endpoint the gateway can reach
   (app.fleet.endpoints) and, when the gateway sends a subset hint, whose endpoint it lists;
   other paths (GET /v1/models, ...) carry no prompt and go to the cheapest worker by load;
3. answers with the chosen endpoint and data-parallel rank, then the body unchanged
   (app.epp.messages); or with an ImmediateResponse in kvroute's JSON error shape: 400 or
   422 for a body that is not a routable request, 404 for a model nobody serves, 413, 408,
   429 when every eligible worker is overloaded or `max_concurrent_requests` streams are
   being routed already, 502 when an instance failed to tokenize, 503 when no endpoint is
   eligible;
4. follows the response: answers its messages (echoing the body), and when the gateway
   reports that another endpoint served the request (metadata `envoy.lb`
   `x-gateway-destination-endpoint-served`), moves the request's in-flight ticket and
   placement guess to that worker (to none when the endpoint is not one kvroute knows).

Invariants: each stream holds at most one in-flight ticket (app.routing.inflight), opened with the
answer and closed when the stream ends, however it ends (completed, cancelled by the
gateway, broken); a stream that ends before its answer was sent leaves no placement guess.
Nothing a client sends ends a stream with a gRPC error: bad input gets an ImmediateResponse.
Messages out of the protocol's order (a gateway's bug) end it with INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import msgspec
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from prometheus_client import Counter, Gauge

from kvroute.app.api.openai_request import route_request_of
from kvroute.app.epp import messages
from kvroute.app.errors import (
    Busy,
    MalformedRequest,
    NoEligibleWorker,
    RequestError,
    TimedOut,
    TooLarge,
)
from kvroute.app.fleet.endpoints import EndpointMap
from kvroute.app.fleet.registry import Worker
from kvroute.app.patterns import parse_endpoint
from kvroute.app.routing.inflight import Ticket
from kvroute.app.service import Decision, RouteRequest, Service

__all__ = ["EndpointPicker", "EppMetrics"]

log = logging.getLogger("kvroute.epp")

_PROMPT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_NOT_SET = processing_mode_pb2.ProcessingMode.NONE
_BODY_MODES = processing_mode_pb2.ProcessingMode.BodySendMode


class _Closed(Exception):
    """The gateway ended the stream (or it was answered with an ImmediateResponse)."""


class EppMetrics:
    def __init__(self, service: Service) -> None:
        registry = service.metrics.registry
        self.streams = Gauge("kvroute_epp_streams", "ext_proc streams open", registry=registry)
        self.routing = Gauge("kvroute_epp_routing", "requests between their headers and "
                             "their answer (reading the body, choosing)", registry=registry)
        self.requests = Counter(
            "kvroute_epp_requests", "requests the Endpoint Picker answered, by outcome "
            "(routed, or the status of its immediate response)", labelnames=["outcome"],
            registry=registry)
        self.served_elsewhere = Counter(
            "kvroute_epp_served_elsewhere", "requests the gateway reports another endpoint "
            "served than the one kvroute chose", registry=registry)


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    """The ext_proc servicer; lives on the service's event loop."""

    def __init__(self, service: Service, endpoints: EndpointMap, metrics: EppMetrics,
                 status_of: dict[type[RequestError], int]) -> None:
        self.service = service
        self.endpoints = endpoints
        self.metrics = metrics
        self.status_of = status_of
        self.picking = 0  # streams between their request headers and their answer
        self.misconfiguration_logged = False

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        self.metrics.streams.inc()
        exchange = _Exchange(self, context)
        try:
            await exchange.run()
        except _Closed:
            pass
        finally:
            exchange.close()
            self.metrics.streams.dec()


class _Exchange:
    """One stream: one HTTP request and its response."""

    def __init__(self, picker: EndpointPicker, context: grpc.aio.ServicerContext) -> None:
        self.picker = picker
        self.service = picker.service
        self.settings = picker.service.settings
        self.context = context
        self.subset: list[str] | None = None
        self.decision: Decision | None = None
        self.endpoint: str | None = None
        self.endpoints: dict[str, str] = {}
        self.ticket: Ticket | None = None
        self.answered = False  # the routed headers response was sent
        self.served_seen = False
        self.stream_response_body = True

    # -- the stream ------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with asyncio.timeout(self.settings.header_timeout):
                first = await self._read()
        except TimeoutError:
            log.debug("an ext_proc stream sent no request headers within %g s; closing it",
                      self.settings.header_timeout)
            return
        if first.WhichOneof("request") != "request_headers":
            await self._violation(f"the stream began with {first.WhichOneof('request')}, not "
                                  "request_headers")
        if first.HasField("protocol_config"):
            config = first.protocol_config
            if config.request_body_mode != _FULL_DUPLEX:
                # Another mode waits for the headers' answer before sending the body, and
                # kvroute needs the body to answer: it would only ever time out.
                mode = _BODY_MODES.Name(config.request_body_mode)
                await self._misconfigured(
                    f"the gateway sends request bodies in mode {mode}; an Endpoint Picker "
                    "needs FULL_DUPLEX_STREAMED (with trailers SEND)")
            self.stream_response_body = config.response_body_mode in (_FULL_DUPLEX, _NOT_SET)
        self._note_subset(first)
        headers = messages.headers_of(first.request_headers.headers)
        picker = self.picker
        if picker.picking >= self.settings.max_concurrent_requests:
            await self._refuse(Busy(f"{self.settings.max_concurrent_requests} requests are "
                                    "being routed already (max_concurrent_requests); retry "
                                    "later"))
        picker.picking += 1
        picker.metrics.routing.inc()
        try:
            await self._answer_request(headers, first.request_headers.end_of_stream)
        finally:
            picker.picking -= 1
            picker.metrics.routing.dec()
        await self._follow_response()

    async def _answer_request(self, headers: dict[str, str], headers_only: bool) -> None:
        body: bytes | None = None
        trailers = False
        if not headers_only:
            body, trailers = await self._read_body(headers)
        try:
            decision = await self._decide(headers, body)
        except RequestError as exc:
            await self._refuse(exc)
        except Exception as exc:  # a bug: the request still gets an answer, and a log
            log.exception("choosing an endpoint failed")
            await self._immediate(500, {"error": f"internal error: {type(exc).__name__}",
                                        "field": None}, "kvroute_internal_error")
        assert self.endpoint is not None
        self.ticket = self.service.inflight.open(decision.worker.key, decision.uncached_tokens)
        length = None if body is None else len(body)
        await self._write(messages.routed(self.endpoint, decision.worker.endpoint.dp_rank,
                                          length))
        self.answered = True
        self.picker.metrics.requests.labels("routed").inc()
        if body is not None:
            for response in messages.request_body(body, end_of_stream=not trailers):
                await self._write(response)
        if trailers:
            await self._write(messages.request_trailers())

    async def _read_body(self, headers: dict[str, str]) -> tuple[bytes, bool]:
        """The whole body, and whether trailers ended it."""
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(TooLarge(f"body of {declared} bytes exceeds the limit of "
                                        f"{limit}"))
        body = bytearray()
        try:
            async with asyncio.timeout(self.settings.body_timeout):
                while True:
                    message = await self._read()
                    kind = message.WhichOneof("request")
                    self._note_subset(message)
                    if kind == "request_trailers":
                        return bytes(body), True
                    if kind != "request_body":
                        await self._violation(f"{kind} arrived before the request body ended")
                    body += message.request_body.body
                    if len(body) > limit:
                        await self._refuse(TooLarge(f"body exceeds the limit of {limit} bytes"))
                    if message.request_body.end_of_stream:
                        return bytes(body), False
        except TimeoutError:
            await self._refuse(TimedOut(f"the body did not arrive within "
                                        f"{self.settings.body_timeout:g} s", "body"))
        raise AssertionError("unreachable")  # every branch above returns or raises

    async def _follow_response(self) -> None:
        while True:
            try:
                message = await self._read()
            except _Closed:
                return
            kind = message.WhichOneof("request")
            self._note_served(message)
            if kind == "response_headers":
                await self._write(messages.response_headers())
            elif kind == "response_body":
                chunk = message.response_body
                if chunk.body and self.ticket is not None:
                    self.ticket.started()  # the first token (or the whole answer) is out
                for response in messages.response_body(
                        chunk.body, end_of_stream=chunk.end_of_stream,
                        streamed=self.stream_response_body):
                    await self._write(response)
            elif kind == "response_trailers":
                await self._write(messages.response_trailers())
            else:
                await self._violation(f"{kind} arrived after the request was answered")

    def close(self) -> None:
        """The stream ended: release the ticket; an answer never sent leaves no guess."""
        if self.ticket is not None:
            self.ticket.close()
        if self.decision is not None and not self.answered:
            self.service.served_elsewhere(self.decision, None)

    # -- deciding --------------------------------------------------------------
    async def _decide(self, headers: dict[str, str], body: bytes | None) -> Decision:
        question = _question(headers.get(":method", ""),
                             headers.get(":path", "").partition("?")[0], body)
        registry = self.service.registry
        self.endpoints = await self.picker.endpoints.endpoints(registry)
        allowed = {iid: endpoint for iid, endpoint in self.endpoints.items()
                   if iid in registry and (self.subset is None or endpoint in self.subset)}
        if not allowed:
            raise NoEligibleWorker(
                "no eligible endpoint: " + ("no registered instance" if not len(registry) else
                                            "none of the subset hint's endpoints is a "
                                            "registered instance" if self.subset is not None
                                            else "no instance has an endpoint"))
        # No await since `allowed` was checked against the registry: every id is known.
        question = msgspec.structs.replace(question, candidates=sorted(allowed))
        decision = await self.service.decide(question, shed_when_overloaded=True, mode="epp")
        self.decision = decision
        self.endpoint = allowed[decision.worker.instance.id]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("picked %s (%s rank %d, %d of %s tokens cached)", self.endpoint,
                      decision.worker.instance.id, decision.worker.endpoint.dp_rank,
                      decision.best.matched_tokens,
                      len(decision.tokens) if decision.tokens is not None else "?")
        return decision

    def _note_subset(self, message: ext_proc.ProcessingRequest) -> None:
        """The gateway's subset hint, from the first request message that carries one. A
        hint kvroute cannot read names no endpoint (so the answer is a 503, not a request
        sent where the gateway said not to)."""
        if self.subset is not None:
            return
        hint = messages.metadata_value(message, messages.SUBSET_NAMESPACE, messages.SUBSET_KEY)
        if hint is None:
            return
        if isinstance(hint, str):
            hint = hint.split(",")
        if not isinstance(hint, list):
            log.warning("ignoring a subset hint that is not a list of IP:PORT: %r", hint)
            hint = []
        self.subset = [e for e in (parse_endpoint(str(item)) for item in hint) if e]

    def _note_served(self, message: ext_proc.ProcessingRequest) -> None:
        """Follow the endpoint the gateway reports as served, the first time it does."""
        if self.served_seen or self.decision is None:
            return
        reported = messages.metadata_value(message, messages.LB_NAMESPACE, messages.SERVED)
        if reported is None:
            return
        self.served_seen = True
        served = parse_endpoint(str(reported))
        if served == self.endpoint:
            return
        worker = self._worker_at(served)
        self.picker.metrics.served_elsewhere.inc()
        log.info("the gateway served a request on %s, not on the chosen %s; its placement "
                 "guess and in-flight count follow", reported, self.endpoint)
        self.service.served_elsewhere(self.decision, worker)
        if self.ticket is not None:
            if worker is None:
                self.ticket.close()
            else:
                self.ticket = self.ticket.move_to(worker.key)

    def _worker_at(self, endpoint: str | None) -> Worker | None:
        """The worker behind `endpoint`: the chosen rank on that instance if it has one."""
        assert self.decision is not None
        rank = self.decision.worker.endpoint.dp_rank
        for instance_id, known in self.endpoints.items():
            if known != endpoint or instance_id not in self.service.registry:
                continue
            workers = self.service.registry.get(instance_id).workers
            if workers:
                return next((w for w in workers if w.endpoint.dp_rank == rank), workers[0])
        return None

    # -- the wire --------------------------------------------------------------
    async def _read(self) -> ext_proc.ProcessingRequest:
        message = await self.context.read()
        if message is grpc.aio.EOF:
            raise _Closed
        return message

    async def _write(self, response: ext_proc.ProcessingResponse) -> None:
        await self.context.write(response)

    async def _refuse(self, exc: RequestError) -> None:
        status = self.picker.status_of[type(exc)]
        await self._immediate(status, exc.payload(), f"kvroute_{status}")

    async def _immediate(self, status: int, payload: dict[str, Any], details: str) -> None:
        """Answer the request locally and end the stream (raises _Closed)."""
        self.picker.metrics.requests.labels(str(status)).inc()
        await self._write(messages.immediate(status, payload, details))
        raise _Closed

    async def _misconfigured(self, what: str) -> None:
        if not self.picker.misconfiguration_logged:
            self.picker.misconfiguration_logged = True
            log.error("refusing ext_proc streams: %s (logged once)", what)
        await self.context.abort(grpc.StatusCode.FAILED_PRECONDITION, what)

    async def _violation(self, what: str) -> None:
        log.warning("ending an ext_proc stream: %s (a gateway that does not follow the "
                    "protocol, or one configured with other processing modes)", what)
        await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, what)


def _question(method: str, path: str, body: bytes | None) -> RouteRequest:
    """What `POST /v1/route` would be asked for this request. Completions and chat bodies
    are read as the proxy reads them; any other request has no prompt: it goes to the
    worker whose queue is cheapest, among those serving the body's `model` if it names one."""
    if method.upper() == "POST" and path in _PROMPT_PATHS:
        return route_request_of(path, body or b"")
    model = None
    if body:
        try:
            payload = msgspec.json.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            payload = None  # not JSON: not ours to judge on a path kvroute does not read
        if isinstance(payload, dict):
            model = payload.get("model")
            if model is not None and not isinstance(model, str):
                raise MalformedRequest("`model` must be a string", "model")
    return RouteRequest(token_ids=[], model=model)
