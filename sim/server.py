"""One simulated vLLM instance: ``dp_size`` engines behind one OpenAI-style HTTP server.

Ownership: a ``SimInstance`` owns its engines, one ``EventPublisher`` per data-parallel rank
(rank r publishes on ``kv_port + r`` and answers replays on ``replay_port + r``, as vLLM does),
one uvicorn server on a thread, and one stepping thread per rank. ``stop()`` releases all of
them; nothing outlives it.

Two ways to drive the engines, never mixed on one instance:

- HTTP (demo, end-to-end tests): ``POST /v1/completions`` and ``POST /v1/chat/completions``
  queue the request on a rank (the ``X-data-parallel-rank`` header's, as in vLLM, else the
  least loaded) and a stepping thread runs that rank's steps until every HTTP request on it is
  done, publishing each step's events. Steps do not sleep unless ``time_scale > 0`` (then a
  step takes ``time_scale`` times its modelled duration in real time).
- Directly (benchmarks): ``rank.lock`` held, call ``rank.engine`` and ``rank.publish``; the
  stepping thread only steps while HTTP requests are pending, so it stays out of the way.

Text prompts use a byte tokenizer: one token per UTF-8 byte (ids 0..255); chat messages go
through the template in ``kvroute.sim.openai`` first, and ``/tokenize`` accepts both, giving the
exact tokens the engine sees. Generated tokens are lowercase letters chosen deterministically
from the prompt, so responses are reproducible. Response ids are ``cmpl-``/``chatcmpl-`` plus the
``X-Request-Id`` header when given (as in vLLM), else a random hex.

Streaming (``"stream": true``): the engine runs the request as usual; the response is then sent
as one SSE event per generated token, ``stream_interval_s`` apart, so a client can go away
mid-stream. A client that goes away, streaming or not, gets its request aborted in the engine
if it is still there, as vLLM does. Observability for tests: ``responses`` holds the bytes of
the last ``RECORDED_RESPONSES`` generation responses by id (what was actually sent, also for a
response cut short), and ``aborted`` counts responses whose client went away before their end.

``/reset_prefix_cache`` behaves like vLLM's: refused (still 200) while blocks are in use, and the
``AllBlocksCleared`` event goes out with the rank's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvroute.app.wire import Event
from kvroute.sim.engine import Engine, EngineError, RequestOutcome, StepResult, TimeModel
from kvroute.sim.openai import chat_prompt, completion_body, sse_events, validate_messages
from kvroute.sim.publisher import EventPublisher

HOST = "127.0.0.1"
_REQUEST_TIMEOUT_S = 60.0
RECORDED_RESPONSES = 256


@dataclass(frozen=True)
class InstanceConfig:
    """How one simulated vLLM is set up. ``num_blocks`` counts vLLM's reserved null block."""

    model: str = "sim-model"
    block_size: int = 16
    num_blocks: int = 1024
    dp_size: int = 1
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    vocab_size: int = 32000
    time_model: TimeModel = field(default_factory=TimeModel)
    hash_format: str = "int"
    encoding: str = "map"  # "map" (vLLM >= ~0.26) or "array" (older)
    replay_format: str = "new"  # replay reply frames of 0.32.0 ("new") or older ("old")
    topic: str = "kv-events"
    time_scale: float = 0.0
    # /kv_event_sources answer shape: "v0.32" (vLLM 0.32.0: {rank: resolved config}, wildcard
    # bind host), "list" (a bare list of per-rank entries) or "sources" ({"sources": list}).
    sources_shape: str = "v0.32"
    # Seconds between two SSE events of a streamed response (0: as fast as the socket takes).
    stream_interval_s: float = 0.0
    # vLLM's --api-key: every /v1 path (models, completions, chat) needs
    # "Authorization: Bearer <key>".
    api_key: str | None = None


class SimRank:
    """One data-parallel rank: an engine, its publisher and its stepping thread."""

    def __init__(self, config: InstanceConfig, rank: int, endpoint: str, replay: str) -> None:
        self.rank = rank
        self.engine = Engine(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            seed=config.seed * 1009 + rank,  # a distinct hash seed per process, as in vLLM
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            time_model=config.time_model,
            hash_format=config.hash_format,  # type: ignore[arg-type]
        )
        self.publisher = EventPublisher(
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=config.topic,
            encoding=config.encoding,
            replay_format=config.replay_format,
            dp_rank=rank,
        )
        self.lock = threading.Lock()
        self._time_scale = config.time_scale
        self._wake = threading.Condition(self.lock)
        self._pending: dict[str, Future[RequestOutcome]] = {}
        self._closing = False
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"sim-rank-{rank}", daemon=True)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str:
        return self.publisher.replay_endpoint or ""

    def start(self) -> None:
        self.publisher.start()
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for fut in self._pending.values():
            fut.cancel()
        self.publisher.close()

    def publish(self, events: list[Event]) -> int | None:
        """Publish one step's batch (nothing when the step had no events, like vLLM)."""
        if not events:
            return None
        return self.publisher.publish(events, dp_rank=self.rank)

    def load(self) -> int:
        return self.engine.load()

    def submit(self, prompt: list[int], output: list[int],
               request_id: str) -> Future[RequestOutcome]:
        """Queue an HTTP request; the future resolves when it finishes. Raises EngineError."""
        fut: Future[RequestOutcome] = Future()
        with self._wake:
            now = time.monotonic() - self._t0
            self.engine.add_request(request_id, prompt, output, arrival_time=now)
            self._pending[request_id] = fut
            self._wake.notify_all()
        return fut

    def abort(self, request_id: str) -> bool:
        """The client went away: drop the request if the engine still has it."""
        with self._wake:
            self._pending.pop(request_id, None)
            return self.engine.abort_request(request_id)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                result = self.engine.step(now=time.monotonic() - self._t0)
                self.publish(result.events)
                done = [(self._pending.pop(o.request_id, None), o) for o in result.finished]
            for fut, outcome in done:
                if fut is not None:
                    fut.set_result(outcome)
            self._pace(result)

    def _pace(self, result: StepResult) -> None:
        if self._time_scale > 0:
            time.sleep((result.end - result.start) * self._time_scale)


class SimInstance:
    """A simulated vLLM server; ``start()`` binds free loopback ports, ``stop()`` frees them."""

    def __init__(self, config: InstanceConfig | None = None) -> None:
        self.config = config or InstanceConfig()
        if self.config.sources_shape not in ("v0.32", "list", "sources"):
            raise ValueError(f"sources_shape must be 'v0.32', 'list' or 'sources', "
                             f"not {self.config.sources_shape!r}")
        self.ranks: list[SimRank] = []
        self.url = ""
        self.kv_port = 0
        self.replay_port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._next_rank = 0
        self.responses: OrderedDict[str, bytes] = OrderedDict()
        self.aborted = 0
        self._record_lock = threading.Lock()

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for r in self.ranks]

    def __enter__(self) -> SimInstance:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_ranks()
            self._start_http()
        except BaseException:
            self.stop()
            raise

    def _start_ranks(self) -> None:
        n = self.config.dp_size
        rng = random.Random()
        for _attempt in range(50):
            # One rank binds port 0; several need consecutive ports, as vLLM uses: bind at a
            # random base, and take another base if any of them is taken.
            base, replay = ((0, 0) if n == 1 else
                            (rng.randrange(20000, 40000 - n), rng.randrange(40000, 60000 - n)))
            ranks = [
                SimRank(self.config, r, f"tcp://{HOST}:{base + r}", f"tcp://{HOST}:{replay + r}")
                for r in range(n)
            ]
            started: list[SimRank] = []
            try:
                for rank in ranks:
                    rank.start()
                    started.append(rank)
            except Exception:  # a port taken between probing and binding: try other ports
                for rank in started:
                    rank.close()
                with contextlib.suppress(Exception):
                    ranks[len(started)].publisher.close()
                continue
            self.ranks = ranks
            self.kv_port = int(ranks[0].endpoint.rsplit(":", 1)[1])
            self.replay_port = int(ranks[0].replay_endpoint.rsplit(":", 1)[1])
            return
        raise RuntimeError("could not bind KV-event ports on loopback after 50 attempts")

    def _start_http(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))
        self._sock = sock
        port = sock.getsockname()[1]
        self.url = f"http://{HOST}:{port}"
        config = uvicorn.Config(
            build_app(self), log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="sim-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the simulated vLLM HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        for rank in self.ranks:
            rank.close()
        self._server = self._thread = self._sock = None
        self.ranks = []

    # --- behaviour behind the HTTP routes -----------------------------------------------------

    def pick_rank(self, requested: int | None) -> SimRank:
        """The rank named by the caller, else the least loaded (vLLM's DP balancing)."""
        if requested is not None:
            return self.ranks[requested]
        return min(self.ranks, key=lambda r: (r.load(), r.rank))

    def kv_event_sources(self) -> list[dict[str, Any]]:
        """Each rank's endpoints as a subscriber dials them (loopback)."""
        return [
            {
                "data_parallel_rank": r.rank,
                "endpoint": r.endpoint,
                "replay_endpoint": r.replay_endpoint,
                "topic": self.config.topic,
            }
            for r in self.ranks
        ]

    def kv_event_sources_body(self) -> Any:
        """``GET /kv_event_sources`` in the configured shape. vLLM 0.32.0 returns each rank's
        resolved KVEventsConfig keyed by the rank as a string, with the bind host verbatim
        ("*" when bound to every interface, which is how it is usually configured)."""
        sources = self.kv_event_sources()
        shape = self.config.sources_shape
        if shape == "list":
            return sources
        if shape == "sources":
            return {"sources": sources}
        return {
            str(s["data_parallel_rank"]): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": _wildcard(s["endpoint"]),
                "replay_endpoint": _wildcard(s["replay_endpoint"]),
                "buffer_steps": 10_000,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": s["topic"],
            }
            for s in sources
        }

    def record(self, response_id: str, sent: bytes, *, aborted: bool = False) -> None:
        """Remember what a generation response sent (see the module docstring)."""
        with self._record_lock:
            self.responses[response_id] = sent
            while len(self.responses) > RECORDED_RESPONSES:
                self.responses.popitem(last=False)
            self.aborted += aborted

    def reset_prefix_cache(self) -> bool:
        ok = True
        for rank in self.ranks:
            with rank.lock:
                ok = rank.engine.reset_prefix_cache() and ok
        return ok


# --- HTTP ---------------------------------------------------------------------------------------


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


def _wildcard(endpoint: str) -> str:
    return "tcp://*:" + endpoint.rsplit(":", 1)[1] if endpoint.startswith("tcp://") else endpoint


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    body = {"message": message, "type": kinds.get(status, "Error"), "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


def _prompt_tokens(body: dict[str, Any]) -> list[int] | str:
    """A completion's prompt as token ids, or an error message."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenize_text(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return "'prompt' must be a string or a list of token ids (integers)"


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
            problem = validate_messages(body["messages"])
            if problem:
                return _error(400, problem, "messages")
            generation_prompt = body.get("add_generation_prompt", True)
            if not isinstance(generation_prompt, bool):
                return _error(400, "'add_generation_prompt' must be a boolean",
                              "add_generation_prompt")
            tokens = tokenize_text(chat_prompt(body["messages"], generation_prompt))
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
        return await _generate(inst, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(inst, request, chat=True)

    return app


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
        problem = validate_messages(body.get("messages"))
        if problem:
            return _error(400, problem, "messages")
        tokens: list[int] | str = tokenize_text(chat_prompt(body["messages"]))
        limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        tokens = _prompt_tokens(body)
        limit = "max_tokens"
    problem = tokens if isinstance(tokens, str) else _check_tokens(tokens, cfg.vocab_size)
    if problem:
        return _error(400, problem, "messages" if chat else "prompt")
    assert not isinstance(tokens, str)
    max_tokens = body.get(limit, 16)
    if type(max_tokens) is not int or max_tokens < 1:
        return _error(400, f"'{limit}' must be a positive integer", limit)
    stream, options = body.get("stream", False), body.get("stream_options")
    if not isinstance(stream, bool):
        return _error(400, "'stream' must be a boolean", "stream")
    if options is not None and (not stream or not isinstance(options, dict)):
        return _error(400, "'stream_options' must be an object, and only with stream=true",
                      "stream_options")
    rank_header = request.headers.get("x-data-parallel-rank")
    rank: int | None = None
    if rank_header is not None:
        if not rank_header.isdigit() or int(rank_header) >= len(inst.ranks):
            return _error(400, f"no data-parallel rank {rank_header!r}")
        rank = int(rank_header)
    target = inst.pick_rank(rank)
    request_id = ("chatcmpl-" if chat else "cmpl-") + (
        request.headers.get("x-request-id") or uuid.uuid4().hex)
    try:
        fut = target.submit(tokens, planned_output(tokens, max_tokens), request_id)
    except EngineError as exc:
        return _error(400, str(exc), "messages" if chat else "prompt")
    created = int(time.time())
    if stream:
        include_usage = bool((options or {}).get("include_usage"))
        return _Stream(_stream_events(inst, target, request_id, fut, chat=chat,
                                      created=created, include_usage=include_usage))
    finished = asyncio.ensure_future(asyncio.wait_for(asyncio.wrap_future(fut),
                                                      _REQUEST_TIMEOUT_S))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished.cancel()
    if not finished.done() or finished.cancelled() or finished.exception() is not None:
        target.abort(request_id)
        if gone.done() and not gone.cancelled():
            inst.record(request_id, b"", aborted=True)
            return Response(status_code=499)  # nobody is left to read it
        return _error(503, "the simulated engine did not finish the request in time")
    outcome = finished.result()
    payload = completion_body(chat, request_id, created, cfg.model, outcome,
                              detokenize(list(outcome.output_tokens)))
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
            info.add_metric([str(cfg.block_size), str(cfg.num_blocks), "True", str(rank.rank)], 1)
        yield from (running, waiting, usage, hits, queries, prompt, generation, info)
