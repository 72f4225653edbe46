"""The simulated vLLM's HTTP surface: the OpenAI-style endpoints and the ones kvroute uses.

Generation (``POST /v1/completions``, ``POST /v1/chat/completions``) validates like vLLM and
queues the request on a rank (``SimRank.submit``): the ``X-data-parallel-rank`` header's, as in
vLLM, else the least loaded.

Text prompts use a byte tokenizer: one token per UTF-8 byte (ids 0..255); chat messages go
through the template in ``kvroute.sim.openai`` first, and ``/tokenize`` accepts both, giving the
exact tokens the engine sees. Generated tokens are lowercase letters chosen deterministically
from the prompt, so responses are reproducible. Response ids are ``cmpl-``/``chatcmpl-`` plus the
``X-Request-Id`` header when given (as in vLLM), else a random hex.

A completions ``prompt`` may be a batch (texts or token lists, as vLLM takes): each prompt runs
as its own engine request, the answer has one choice per prompt and the usage of all of them;
a batch is not streamed (400).

Streaming (``"stream": true``): the engine runs the request as usual; the response is then sent
as one SSE event per generated token, ``stream_interval_s`` apart, so a client can go away
mid-stream. A client that goes away, streaming or not, gets its request aborted in the engine
if it is still there, as vLLM does. Every generation response is recorded on the instance
(``SimInstance.record``), also one cut short, and every generation request as it arrived, with
the rank that ran it (``SimInstance.received``).

``/reset_prefix_cache`` behaves like vLLM's: refused (still 200) while blocks are in use, and the
``AllBlocksCleared`` event goes out with the rank's next step. ``/metrics`` carries vLLM's metric
names, one ``engine`` label per data-parallel rank.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvroute.sim.engine import EngineError, RequestOutcome
from kvroute.sim.openai import chat_request_prompt, completion_body, sse_events
from kvroute.sim.rank import SimRank

if TYPE_CHECKING:  # the instance builds this app, so only its type is needed here
    from kvroute.sim.instance import SimInstance

__all__ = ["ReceivedRequest", "build_app", "detokenize", "planned_output", "tokenize_text"]

_REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ReceivedRequest:
    """One generation request as the instance received it (``SimInstance.received``)."""

    path: str
    headers: tuple[tuple[str, str], ...]  # as sent, names in lowercase
    rank: int | None  # the rank that ran it; None when it was refused before reaching one
    status: int  # the status it was answered with (200 for a stream)

    def header(self, name: str) -> str | None:
        """The value of the first header called ``name`` (any case), else None."""
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)


def tokenize_text(text: str) -> list[int]:
    """The simulator's tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def detokenize(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def planned_output(prompt: list[int], max_tokens: int) -> list[int]:
    """Deterministic "generated" tokens: lowercase letters seeded by the prompt."""
    seed = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
    rng = random.Random(seed)
    return [rng.randrange(ord("a"), ord("z") + 1) for _ in range(max_tokens)]


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    body = {"message": message, "type": kinds.get(status, "Error"), "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


def _prompt_tokens(body: dict[str, Any]) -> list[list[int]] | str:
    """A completion's prompts as token ids, or an error message. As vLLM: text, token ids
    (a number with a zero fractional part is one, as pydantic reads it), or a batch of
    texts or of token lists."""
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(
        prompt[0], str | list) else [prompt]
    if all(isinstance(each, str) for each in batch):
        return [tokenize_text(each) for each in batch]
    if all(isinstance(each, list) and all(_is_token(t) for t in each) for each in batch):
        return [[int(t) for t in each] for each in batch]
    return "'prompt' must be text, a list of token ids (integers), or a batch of either"


def _is_token(value: Any) -> bool:
    return type(value) is int or (type(value) is float and value.is_integer())


def _check_tokens(tokens: list[int], vocab_size: int) -> str | None:
    if not tokens:
        return "the prompt cannot be empty"
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"token id {bad} is out of vocabulary (size {vocab_size})"
    return None


class _Stream(StreamingResponse):
    """Closes its generator however the response ends, so a client that went away is noticed
    at once (Starlette leaves a generator suspended at ``yield`` to the garbage collector)."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


def build_app(inst: SimInstance) -> FastAPI:
    app = FastAPI(title="simulated vLLM")
    cfg = inst.config

    def max_model_len() -> int:
        return inst.ranks[0].engine.max_model_len

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    def models(request: Request) -> Any:
        refused = _unauthorized(inst, request)
        if refused is not None:
            return refused
        card = {
            "id": cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": max_model_len(),
        }
        return {"object": "list", "data": [card]}

    @app.get("/kv_event_sources")
    def kv_event_sources() -> Any:
        return inst.kv_event_sources_body()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, dict) and "messages" in body:
            problem, rendered = chat_request_prompt(body)
            if problem:
                return _error(400, problem, rendered)
            tokens = tokenize_text(rendered)
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            tokens = tokenize_text(body["prompt"])
        else:
            return _error(400, "give 'prompt' (a string) or 'messages'", "prompt")
        return {"count": len(tokens), "max_model_len": max_model_len(), "tokens": tokens,
                "token_strs": None}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> Response:
        inst.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        registry = CollectorRegistry()
        registry.register(_MetricsCollector(inst))
        return PlainTextResponse(generate_latest(registry).decode())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return _noted(inst, request, await _generate(inst, request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return _noted(inst, request, await _generate(inst, request, chat=True))

    return app


def _noted(inst: SimInstance, request: Request, response: Response) -> Response:
    """Records who received the request (``SimInstance.received``); returns ``response``."""
    headers = tuple((key.decode("latin-1").lower(), value.decode("latin-1"))
                    for key, value in request.headers.raw)
    rank = getattr(request.state, "sim_rank", None)
    inst.note_received(ReceivedRequest(request.url.path, headers, rank, response.status_code))
    return response


def _unauthorized(inst: SimInstance, request: Request) -> Response | None:
    """vLLM's --api-key check, which guards every /v1 path (not /tokenize or /metrics)."""
    key = inst.config.api_key
    if key is not None and request.headers.get("authorization") != f"Bearer {key}":
        return JSONResponse({"error": "Unauthorized"}, status_code=401)  # vLLM's exact answer
    return None


async def _generate(inst: SimInstance, request: Request, *, chat: bool) -> Response:
    """Validate like vLLM, queue on a rank, answer whole or streamed."""
    cfg = inst.config
    refused = _unauthorized(inst, request)
    if refused is not None:
        return refused
    body = await _json_body(request)
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    if body.get("model") not in (None, cfg.model):
        return _error(404, f"The model `{body['model']}` does not exist.", "model")
    if chat:
        problem, rendered = chat_request_prompt(body)
        if problem:
            return _error(400, problem, rendered)
        prompts: list[list[int]] | str = [tokenize_text(rendered)]
        limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        prompts = _prompt_tokens(body)
        limit = "max_tokens"
    problem = prompts if isinstance(prompts, str) else next(
        filter(None, (_check_tokens(tokens, cfg.vocab_size) for tokens in prompts)), None)
    if problem:
        return _error(400, problem, "messages" if chat else "prompt")
    assert not isinstance(prompts, str)
    max_tokens = body.get(limit, 16)
    if type(max_tokens) is not int or max_tokens < 1:
        return _error(400, f"'{limit}' must be a positive integer", limit)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        return _error(400, "'cache_salt' must be a non-empty string", "cache_salt")
    xargs = body.get("vllm_xargs")
    report_reused = isinstance(xargs, dict) and xargs.get("kv_cache_report_mode") == "full"
    stream, options = body.get("stream", False), body.get("stream_options")
    if not isinstance(stream, bool):
        return _error(400, "'stream' must be a boolean", "stream")
    if options is not None and (not stream or not isinstance(options, dict)):
        return _error(400, "'stream_options' must be an object, and only with stream=true",
                      "stream_options")
    if stream and len(prompts) > 1:
        return _error(400, "the simulator streams one prompt at a time", "stream")
    rank_header = request.headers.get("x-data-parallel-rank")
    rank: int | None = None
    if rank_header is not None:
        if not rank_header.isdigit() or int(rank_header) >= len(inst.ranks):
            return _error(400, f"no data-parallel rank {rank_header!r}")
        rank = int(rank_header)
    target = inst.pick_rank(rank)
    request.state.sim_rank = target.rank
    request_id = ("chatcmpl-" if chat else "cmpl-") + (
        request.headers.get("x-request-id") or uuid.uuid4().hex)
    # A batch runs as one engine request per prompt, as vLLM runs it.
    engine_ids = [request_id] if len(prompts) == 1 else [
        f"{request_id}-{number}" for number in range(len(prompts))]
    futures: list[Future[RequestOutcome]] = []
    try:
        for engine_id, tokens in zip(engine_ids, prompts, strict=True):
            futures.append(target.submit(tokens, planned_output(tokens, max_tokens), engine_id,
                                         cache_salt=cache_salt, report_reused=report_reused))
    except EngineError as exc:
        for engine_id in engine_ids[:len(futures)]:
            target.abort(engine_id)
        return _error(400, str(exc), "messages" if chat else "prompt")
    created = int(time.time())
    if stream:
        include_usage = bool((options or {}).get("include_usage"))
        return _Stream(_stream_events(inst, target, request_id, futures[0], chat=chat,
                                      created=created, include_usage=include_usage))
    finished = asyncio.ensure_future(asyncio.wait_for(
        asyncio.gather(*(asyncio.wrap_future(future) for future in futures)),
        _REQUEST_TIMEOUT_S))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished.cancel()
    if not finished.done() or finished.cancelled() or finished.exception() is not None:
        for engine_id in engine_ids:
            target.abort(engine_id)
        if gone.done() and not gone.cancelled():
            inst.record(request_id, b"", aborted=True)
            return Response(status_code=499)  # nobody is left to read it
        return _error(503, "the simulated engine did not finish the request in time")
    outcomes = finished.result()
    payload = completion_body(chat, request_id, created, cfg.model, outcomes,
                              [detokenize(list(outcome.output_tokens)) for outcome in outcomes])
    inst.record(request_id, payload)
    return Response(payload, media_type="application/json")


async def _stream_events(inst: SimInstance, rank: SimRank, request_id: str,
                         fut: Future[RequestOutcome], *, chat: bool, created: int,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE events of one request; what was sent is recorded however the stream ends."""
    sent = bytearray()
    complete = False
    try:
        outcome = await asyncio.wait_for(asyncio.wrap_future(fut), _REQUEST_TIMEOUT_S)
        pieces = [detokenize([token]) for token in outcome.output_tokens]
        events = sse_events(chat, request_id, created, inst.config.model, outcome, pieces,
                            include_usage)
        for i, event in enumerate(events):
            if i and inst.config.stream_interval_s > 0:
                await asyncio.sleep(inst.config.stream_interval_s)
            sent += event
            yield event
        complete = True
    finally:
        if not complete:
            rank.abort(request_id)
        inst.record(request_id, bytes(sent), aborted=not complete)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


class _MetricsCollector:
    """vLLM's metric names, one ``engine`` label per data-parallel rank."""

    def __init__(self, inst: SimInstance) -> None:
        self._inst = inst

    def collect(self) -> Any:
        cfg = self._inst.config
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Running requests", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Waiting requests", labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage (0..1)",
                                  labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix-cache hit tokens",
                                   labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix-cache queried tokens",
                                      labels=labels)
        prompt = CounterMetricFamily("vllm:prompt_tokens", "Prefill tokens computed",
                                     labels=labels)
        generation = CounterMetricFamily("vllm:generation_tokens", "Generated tokens",
                                         labels=labels)
        ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds",
                                     "Time to first token", labels=labels)
        e2e = HistogramMetricFamily("vllm:e2e_request_latency_seconds",
                                    "End-to-end request latency", labels=labels)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Cache configuration",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
        )
        for rank in self._inst.ranks:
            eng = rank.engine
            key = [cfg.model, str(rank.rank)]
            with rank.lock:
                running.add_metric(key, eng.reported_running)
                waiting.add_metric(key, eng.reported_waiting)
                usage.add_metric(key, eng.reported_kv_usage)
                hits.add_metric(key, eng.prefix_cache_hits)
                queries.add_metric(key, eng.prefix_cache_queries)
                prompt.add_metric(key, eng.prompt_tokens_computed)
                generation.add_metric(key, eng.generation_tokens)
                # one bucket: kvroute reads only the sums and counts
                ttft.add_metric(key, [("+Inf", eng.requests_ended)], eng.ttft_seconds)
                e2e.add_metric(key, [("+Inf", eng.requests_ended)], eng.e2e_seconds)
            info.add_metric([str(cfg.block_size), str(cfg.num_blocks), "True", str(rank.rank)], 1)
        yield from (running, waiting, usage, hits, queries, prompt, generation, ttft, e2e, info)
