"""kvroute as an Endpoint Picker, driven over gRPC the way Envoy drives one.

No Envoy binary can be installed here, so `e2e.envoy_client` plays Envoy's part of the
Gateway API Inference Extension's picker protocol: request headers without end of stream,
the body in chunks (FULL_DUPLEX_STREAMED), end of stream or trailers, then the response's
messages with the endpoint that served. The answers are held to the protocol itself:

- the request headers are answered with one HeadersResponse whose CommonResponse has
  clear_route_cache and sets `x-gateway-destination-endpoint: IP:PORT` (the same value in
  dynamic_metadata under `envoy.lb`) and Content-Length for the body sent on;
- the body comes back unchanged as StreamedBodyResponse chunks of at most 62,000 bytes,
  end_of_stream on the last one only when the request ended with its body; a request
  ended by trailers gets a TrailersResponse after its body (Envoy's ext_proc contract);
- no eligible endpoint: ImmediateResponse 503; load shed: 429;
- gRPC health answers for `liveness`, `readiness` and the ext_proc service name.

The kvroute under test follows simulated vLLM instances (two ranks each) through their
real KV events, and a request the picker routed is then really sent to the endpoint it
named, with its X-data-parallel-rank: the instance's cached tokens show the prefix was
there.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
import trustme
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.envoy_client import (
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    EnvoyStream,
    channel,
    metadata,
    pick,
)
from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.conftest import HTTP_TIMEOUT, scaled, wait_for, wait_until
from tests.support.tokens import unique_tokens

BLOCK = 16
DESTINATION = "x-gateway-destination-endpoint"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_CHUNK = 62_000
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
STREAM_TIMEOUT = scaled(30.0)
BODY_TIMEOUT = scaled(5.0)
MAX_BODY = 1_000_000


@dataclass
class Fleet:
    """A kvroute answering as an Endpoint Picker, and the simulated instances it follows."""

    server: BackgroundServer
    http: httpx.Client
    cluster: SimCluster | None = None
    ids: list[str] = field(default_factory=list)

    def register(self, url: str) -> str:
        answer = self.http.post("/v1/instances", json={"url": url})
        assert answer.status_code == 201, answer.text
        instance_id = answer.json()["id"]
        wait_for(lambda: self.http.get(f"/v1/instances/{instance_id}").json()["state"] == "live",
                 f"{instance_id} to go live")
        return instance_id

    def endpoint(self, i: int) -> str:
        """Instance i's IP:PORT: the host and port of the URL it was registered with."""
        assert self.cluster is not None
        parts = urlsplit(self.cluster.urls[i])
        return f"{parts.hostname}:{parts.port}"

    def learn(self, instance: int, rank: int, **question: Any) -> None:
        """Wait until kvroute's best worker for the prompt is (instance, rank), matched."""

        def check() -> bool:
            answer = self.http.post("/v1/route", json={**question, "probe": True}).json()
            return (answer.get("instance") == self.ids[instance]
                    and answer.get("dp_rank") == rank and answer.get("matched_tokens", 0) > 0)

        wait_for(check, f"kvroute to learn that instance {instance} rank {rank} holds it")

    def scores(self, **question: Any) -> dict[tuple[str, int], dict]:
        answer = self.http.post("/v1/route", json={**question, "probe": True}).json()
        return {(s["instance"], s["dp_rank"]): s for s in answer["scores"]}

    def inflight(self) -> dict[tuple[str, int], int]:
        return {key: s["load"]["inflight"] for key, s in self.scores(token_ids=[1, 2]).items()}

    def gauge(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise AssertionError(f"no {name} in /metrics")

    def streams(self) -> float:
        """The picker's open ext_proc streams."""
        return self.gauge("kvroute_epp_streams")

    def assert_nothing_left(self) -> None:
        wait_for(lambda: self.streams() == 0 and not any(self.inflight().values()),
                 "every stream closed and every in-flight count back at zero",
                 detail=lambda: (self.streams(), self.inflight()))


def epp_settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "epp_port": 0,
                            "log_level": "warning", "tokenizer": "instance",
                            "placement_ttl": 120.0, "max_body_bytes": MAX_BODY,
                            "body_timeout": BODY_TIMEOUT}
    return Settings(**(base | overrides))


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, dp_size=2) as cluster:
        server = BackgroundServer(epp_settings()).start()
        try:
            with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
                fleet = Fleet(server, http, cluster)
                fleet.ids = [fleet.register(url) for url in cluster.urls]
                yield fleet
        finally:
            server.stop()


@asynccontextmanager
async def streams_to(server: BackgroundServer, root: bytes | None = None, **tls: bytes
                     ) -> AsyncIterator[Callable[[], EnvoyStream]]:
    """A channel to the server's picker, trusting `root` (default: the picker's own
    certificate, as a client that pins a self-signed one); yields a maker of streams."""
    epp = server.epp
    assert epp is not None
    certificate = epp.identity.certificate if epp.identity is not None else None
    async with channel(epp.port, root or certificate, **tls) as chan:
        stub = ext_proc_grpc.ExternalProcessorStub(chan)
        yield lambda: EnvoyStream(stub, STREAM_TIMEOUT)


class ClientLoop:
    """The one event loop every gRPC client of these tests runs on, on its own thread.

    grpc.aio binds each event loop it has served and may hand a late completion (of a call
    cancelled when its channel closed) to that loop; on a loop already closed that raises
    inside gRPC's poller and can stall other calls. So the clients share one loop that
    lives as long as the module: stopped at its end, never closed."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="epp-clients",
                                       daemon=True)
        self.thread.start()

    def run(self, fn: Callable[[], Awaitable[None]], timeout: float = 90.0) -> None:
        async def bounded() -> None:
            await asyncio.wait_for(fn(), scaled(timeout))

        asyncio.run_coroutine_threadsafe(bounded(), self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(scaled(10.0))


CLIENTS: ClientLoop | None = None


@pytest.fixture(scope="module", autouse=True)
def client_loop() -> Iterator[None]:
    global CLIENTS
    CLIENTS = ClientLoop()
    try:
        yield
    finally:
        CLIENTS.stop()
        CLIENTS = None


def scenario(fn: Callable[[], Awaitable[None]]) -> None:
    assert CLIENTS is not None
    CLIENTS.run(fn)


def completion(prompt: Any, **extra: Any) -> bytes:
    return json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 1,
                       **extra}).encode()


def expected_routed(endpoint: str, rank: int, length: int | None) -> ext_proc.ProcessingResponse:
    """The HeadersResponse the protocol asks for (header order aside: see `same_headers`)."""
    headers = [(DESTINATION, endpoint), ("x-data-parallel-rank", str(rank))]
    if length is not None:
        headers.append(("content-length", str(length)))
    dynamic = struct_pb2.Struct()
    dynamic.update({LB_NAMESPACE: {DESTINATION: endpoint}})
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
            clear_route_cache=True,
            header_mutation=ext_proc.HeaderMutation(set_headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                    append_action=OVERWRITE)
                for name, value in headers]))),
        dynamic_metadata=dynamic)


def same_headers(got: ext_proc.ProcessingResponse, want: ext_proc.ProcessingResponse) -> None:
    """Equal messages, the set headers compared as a set (their order means nothing)."""
    assert got.WhichOneof("response") == "request_headers", got

    def key(option: base_pb2.HeaderValueOption) -> bytes:
        return option.SerializeToString(deterministic=True)

    got_set = got.request_headers.response.header_mutation.set_headers
    want_set = want.request_headers.response.header_mutation.set_headers
    assert sorted(map(key, got_set)) == sorted(map(key, want_set)), got
    got_rest, want_rest = ext_proc.ProcessingResponse(), ext_proc.ProcessingResponse()
    got_rest.CopyFrom(got)
    want_rest.CopyFrom(want)
    del got_rest.request_headers.response.header_mutation.set_headers[:]
    del want_rest.request_headers.response.header_mutation.set_headers[:]
    assert got_rest == want_rest


def streamed(message: ext_proc.ProcessingResponse, side: str) -> ext_proc.StreamedBodyResponse:
    """The StreamedBodyResponse of a request_body or response_body answer, which must carry
    nothing else."""
    assert message.WhichOneof("response") == side, message
    body = getattr(message, side)
    bare = ext_proc.BodyResponse()
    bare.response.body_mutation.streamed_response.CopyFrom(
        body.response.body_mutation.streamed_response)
    assert body == bare, message
    return body.response.body_mutation.streamed_response


async def body_back(stream: EnvoyStream, length: int, *, ends_stream: bool) -> list[bytes]:
    """The request body chunks the picker sends on, `length` bytes in all: the last one
    with end_of_stream when `ends_stream`, none with it otherwise (trailers follow)."""
    chunks: list[bytes] = []
    while True:
        message = await stream.read()
        assert message is not None, "the picker ended the stream in the middle of the body"
        part = streamed(message, "request_body")
        assert len(part.body) <= MAX_CHUNK
        chunks.append(part.body)
        received = sum(map(len, chunks))
        assert received <= length, "more body came back than was sent"
        if part.end_of_stream:
            assert ends_stream, "end_of_stream on a body that trailers follow"
            assert received == length
            return chunks
        if not ends_stream and received == length:
            return chunks


async def send_request(stream: EnvoyStream, path: str, body: bytes, pieces: list[int], *,
                       trailers: bool = False, context: base_pb2.Metadata | None = None,
                       headers: tuple[tuple[str, str], ...] = ()) -> None:
    """Envoy's request side: headers, then the body cut at `pieces` (sizes), then end of
    stream on the last chunk, or trailers."""
    await stream.request_headers("POST", path, end_of_stream=False, context=context, headers=[
        ("content-type", "application/json"), ("content-length", str(len(body))), *headers])
    start = 0
    cuts = [*pieces, len(body)]
    for number, size in enumerate(cuts):
        end = len(body) if number == len(cuts) - 1 else min(start + size, len(body))
        await stream.request_body(body[start:end], end_of_stream=not trailers and
                                  number == len(cuts) - 1)
        start = end
    if trailers:
        await stream.request_trailers([("x-checksum", "abc")])


def assert_immediate(message: ext_proc.ProcessingResponse | None, status: int) -> dict:
    """An ImmediateResponse with `status`, a JSON content type and kvroute's error shape;
    returns the JSON body."""
    assert message is not None and message.WhichOneof("response") == "immediate_response", \
        message
    reply = message.immediate_response
    assert reply.status.code == status, reply
    assert [(h.header.key, h.header.raw_value) for h in reply.headers.set_headers] == \
        [("content-type", b"application/json")]
    payload = json.loads(reply.body)
    assert set(payload) >= {"error", "field"} and isinstance(payload["error"], str)
    return payload


async def send_to(endpoint: str, path: str, body: bytes, rank: str) -> dict:
    """What the gateway does with the answer: the body, unchanged, to the endpoint named."""
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
        answer = await http.post(f"http://{endpoint}{path}", content=body, headers={
            "content-type": "application/json", "x-data-parallel-rank": rank})
    assert answer.status_code == 200, answer.text
    return answer.json()


def header_values(message: ext_proc.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in message.request_headers.response.header_mutation.set_headers}


# --- the request side -------------------------------------------------------------------------


def test_a_completion_goes_to_the_worker_holding_its_prefix(fleet: Fleet) -> None:
    prompt = unique_tokens(1401, 20 * BLOCK + 5)
    fleet.cluster.complete(1, prompt, max_tokens=1, dp_rank=1)
    fleet.learn(1, 1, token_ids=prompt)
    body = completion(prompt)

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await send_request(stream, "/v1/completions", body, [100, 333])
            routed = await stream.read()
            same_headers(routed, expected_routed(fleet.endpoint(1), 1, len(body)))
            assert b"".join(await body_back(stream, len(body), ends_stream=True)) == body
            # Routed, not yet answered: the request counts on the worker it went to.
            assert fleet.inflight()[(fleet.ids[1], 1)] == 1
            answer = await send_to(fleet.endpoint(1), "/v1/completions", body,
                                   header_values(routed)["x-data-parallel-rank"])
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BLOCK
            # The response side, as the gateway streams it through the picker.
            await stream.response_headers(200, served=fleet.endpoint(1))
            assert await stream.read() == ext_proc.ProcessingResponse(
                response_headers=ext_proc.HeadersResponse())
            raw = json.dumps(answer).encode()
            for piece, last in ((raw[:10], False), (raw[10:], True)):
                await stream.response_body(piece, end_of_stream=last)
                echoed = streamed(await stream.read(), "response_body")
                assert (echoed.body, echoed.end_of_stream) == (piece, last)
            assert await stream.finish() == grpc.StatusCode.OK

    scenario(run)
    fleet.assert_nothing_left()


def test_a_chat_request_goes_to_the_worker_holding_the_conversation(fleet: Fleet) -> None:
    messages = [{"role": "system", "content": "You answer as briefly as you can. " * 6},
                {"role": "user", "content": "Which worker holds this conversation?"}]
    warm = httpx.post(f"{fleet.cluster.urls[0]}/v1/chat/completions", timeout=HTTP_TIMEOUT,
                      json={"messages": messages, "max_tokens": 1},
                      headers={"x-data-parallel-rank": "0"})
    assert warm.status_code == 200, warm.text
    fleet.learn(0, 0, messages=messages)
    body = json.dumps({"model": "sim-model", "messages": messages, "max_tokens": 1}).encode()

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await send_request(stream, "/v1/chat/completions", body, [7])
            same_headers(await stream.read(), expected_routed(fleet.endpoint(0), 0, len(body)))
            assert b"".join(await body_back(stream, len(body), ends_stream=True)) == body
            assert await stream.finish() == grpc.StatusCode.OK

    scenario(run)
    fleet.assert_nothing_left()


def test_a_large_body_comes_back_byte_identical_in_chunks_of_at_most_62000_bytes(
        fleet: Fleet) -> None:
    prompt = unique_tokens(1402, 8 * BLOCK)
    body = completion(prompt, user="u" * 300_000)  # an OpenAI field kvroute does not read

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            # Envoy's own chunking: what arrives from the client, in pieces of any size.
            await send_request(stream, "/v1/completions", body, [1, 16_384, 65_536, 3, 100_000])
            routed = await stream.read()
            endpoint = routed.request_headers.response.header_mutation.set_headers
            assert routed.request_headers.response.clear_route_cache and endpoint
            values = header_values(routed)
            assert values["content-length"] == str(len(body))
            chunks = await body_back(stream, len(body), ends_stream=True)
            assert len(chunks) >= -(-len(body) // MAX_CHUNK) >= 5
            assert all(len(c) <= MAX_CHUNK for c in chunks)
            assert b"".join(chunks) == body
            assert await stream.finish() == grpc.StatusCode.OK

    scenario(run)
    fleet.assert_nothing_left()


def test_a_request_ended_by_trailers_gets_its_body_then_a_trailers_response(
        fleet: Fleet) -> None:
    prompt = unique_tokens(1403, 6 * BLOCK)
    fleet.cluster.complete(0, prompt, max_tokens=1, dp_rank=1)
    fleet.learn(0, 1, token_ids=prompt)
    body = completion(prompt)

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await send_request(stream, "/v1/completions", body, [50, 50], trailers=True)
            same_headers(await stream.read(), expected_routed(fleet.endpoint(0), 1, len(body)))
            # No end_of_stream on the body: the trailers end the request.
            assert b"".join(await body_back(stream, len(body), ends_stream=False)) == body
            assert await stream.read() == ext_proc.ProcessingResponse(
                request_trailers=ext_proc.TrailersResponse())
            await stream.response_headers(200, served=fleet.endpoint(0))
            assert (await stream.read()).WhichOneof("response") == "response_headers"
            await stream.response_body(b"{}", end_of_stream=False)
            assert streamed(await stream.read(), "response_body").body == b"{}"
            await stream.response_trailers([("grpc-status", "0")])
            assert await stream.read() == ext_proc.ProcessingResponse(
                response_trailers=ext_proc.TrailersResponse())
            assert await stream.finish() == grpc.StatusCode.OK

    scenario(run)
    fleet.assert_nothing_left()


def test_a_request_without_a_body_is_routed_at_its_headers(fleet: Fleet) -> None:
    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await stream.request_headers("GET", "/v1/models", end_of_stream=True)
            routed = await stream.read()
            endpoint = header_values(routed)[DESTINATION]
            assert endpoint in (fleet.endpoint(0), fleet.endpoint(1))
            same_headers(routed, expected_routed(
                endpoint, int(header_values(routed)["x-data-parallel-rank"]), None))
            await stream.response_headers(200, served=endpoint, end_of_stream=True)
            assert (await stream.read()).WhichOneof("response") == "response_headers"
            assert await stream.finish() == grpc.StatusCode.OK

    scenario(run)
    fleet.assert_nothing_left()


def test_the_subset_hint_limits_the_choice(fleet: Fleet) -> None:
    prompt = unique_tokens(1404, 10 * BLOCK)
    fleet.cluster.complete(1, prompt, max_tokens=1, dp_rank=0)
    fleet.learn(1, 0, token_ids=prompt)
    body = completion(prompt)

    def hint(*endpoints: str) -> base_pb2.Metadata:
        return metadata({SUBSET_NAMESPACE: {SUBSET_KEY: list(endpoints)}})

    async def endpoint_for(context: base_pb2.Metadata) -> str | None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            answer = await pick(stream, "/v1/completions", body, context=context)
            if answer.immediate is None:
                assert answer.body == body
                assert answer.dynamic_metadata == {LB_NAMESPACE: {DESTINATION: answer.endpoint}}
            stream.cancel()
            return answer.endpoint

    async def run() -> None:
        # Both listed: the holder. Only the other: the other, though it holds nothing.
        assert await endpoint_for(hint(fleet.endpoint(0), fleet.endpoint(1))) == \
            fleet.endpoint(1)
        assert await endpoint_for(hint(fleet.endpoint(0))) == fleet.endpoint(0)
        # Only endpoints kvroute does not know: nothing eligible, 503.
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await send_request(stream, "/v1/completions", body, [],
                               context=hint("10.255.0.1:8000", "10.255.0.2:8000"))
            assert_immediate(await stream.read(), 503)
            assert await stream.read() is None  # the picker ends the stream

    scenario(run)
    fleet.assert_nothing_left()


def test_no_eligible_endpoint_is_an_immediate_503() -> None:
    with BackgroundServer(epp_settings()) as server:  # no instance registered

        async def run() -> None:
            async with streams_to(server) as open_stream:
                stream = open_stream()
                await send_request(stream, "/v1/completions", completion([1, 2, 3]), [2])
                payload = assert_immediate(await stream.read(), 503)
                assert "no eligible endpoint" in payload["error"]
                assert await stream.read() is None

        scenario(run)


def test_overload_is_shed_with_an_immediate_429(fleet: Fleet) -> None:
    # A KV-cache usage limit of 0 makes every worker overloaded; one stream routed at a time.
    settings = epp_settings(overload_kv_usage=0.0, max_concurrent_requests=1)
    with BackgroundServer(settings) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        other = Fleet(server, http)
        other.register(fleet.cluster.urls[0])

        async def run() -> None:
            async with streams_to(server) as open_stream:
                first = open_stream()
                await first.request_headers("POST", "/v1/completions", end_of_stream=False)
                await wait_until(lambda: other.gauge("kvroute_epp_routing") == 1,
                                 "the first request to be waiting for its body")
                # A second request while the first is still being routed: over capacity.
                second = open_stream()
                await send_request(second, "/v1/completions", completion([5, 6, 7]), [])
                payload = assert_immediate(await second.read(), 429)
                assert "max_concurrent_requests" in payload["error"]
                # The first one, complete: every worker is overloaded, so it is shed too.
                await first.request_body(completion([5, 6, 7]), end_of_stream=True)
                payload = assert_immediate(await first.read(), 429)
                assert "overloaded" in payload["error"]

        scenario(run)
        other.assert_nothing_left()


@pytest.mark.parametrize(("body", "status", "field"), [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": [1, -2]}).encode(), 400, "prompt[1]"),
    (json.dumps({"prompt": []}).encode(), 400, "prompt"),
    (json.dumps({"model": 7, "prompt": [1]}).encode(), 400, "model"),
    (json.dumps({"model": "no-such-model", "prompt": [1, 2]}).encode(), 404, "model"),
    (b"", 400, None),
])
def test_a_bad_body_is_a_4xx_in_kvroutes_error_shape(fleet: Fleet, body: bytes, status: int,
                                                      field: str | None) -> None:
    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await send_request(stream, "/v1/completions", body, [3])
            assert assert_immediate(await stream.read(), status)["field"] == field
            assert await stream.read() is None

    scenario(run)
    fleet.assert_nothing_left()


def test_a_body_over_the_limit_is_refused_as_soon_as_it_is_known(fleet: Fleet) -> None:
    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            # Declared too long: refused at the headers, before any body arrives.
            stream = open_stream()
            await stream.request_headers("POST", "/v1/completions", end_of_stream=False,
                                         headers=[("content-length", str(MAX_BODY + 1))])
            assert "limit" in assert_immediate(await stream.read(), 413)["error"]
            # Not declared: refused once the chunks pass the limit, not at the end.
            stream = open_stream()
            await stream.request_headers("POST", "/v1/completions", end_of_stream=False)
            for _ in range(3):
                await stream.request_body(b" " * (MAX_BODY // 2), end_of_stream=False)
            assert_immediate(await stream.read(), 413)
            # A body that stops arriving: 408 after body_timeout.
            stream = open_stream()
            await stream.request_headers("POST", "/v1/completions", end_of_stream=False)
            await stream.request_body(b'{"prompt": [1', end_of_stream=False)
            assert assert_immediate(await stream.read(), 408)["field"] == "body"

    scenario(run)
    fleet.assert_nothing_left()


# --- cancellation and the response side -------------------------------------------------------


def test_a_stream_cancelled_before_its_answer_leaves_nothing(fleet: Fleet) -> None:
    prompt = unique_tokens(1405, 12 * BLOCK)
    body = completion(prompt)

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            await stream.request_headers("POST", "/v1/completions", end_of_stream=False)
            await stream.request_body(body[:40], end_of_stream=False)
            await wait_until(lambda: fleet.streams() == 1, "the stream to reach the picker")
            stream.cancel()

    scenario(run)
    fleet.assert_nothing_left()
    # Nothing was routed: no worker is guessed to hold the prompt.
    assert all(s["pending_blocks"] == 0 for s in fleet.scores(token_ids=prompt).values())


def test_a_stream_cancelled_after_its_answer_releases_its_in_flight_count(fleet: Fleet) -> None:
    prompt = unique_tokens(1406, 12 * BLOCK)
    body = completion(prompt)

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            answer = await pick(stream, "/v1/completions", body)
            assert answer.body == body
            await stream.response_headers(200, served=answer.endpoint)
            assert (await stream.read()).WhichOneof("response") == "response_headers"
            assert sum(fleet.inflight().values()) == 1
            stream.cancel()  # the client went away mid-response

    scenario(run)
    fleet.assert_nothing_left()
    # The request was sent, so the guess that its worker will hold the prompt stays.
    assert any(s["pending_blocks"] > 0 for s in fleet.scores(token_ids=prompt).values())


def test_guesses_and_in_flight_follow_the_endpoint_the_gateway_served(fleet: Fleet) -> None:
    prompt = unique_tokens(1407, 12 * BLOCK)
    body = completion(prompt)
    full_blocks = (len(prompt) - 1) // BLOCK  # vLLM always computes the last token

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            answer = await pick(stream, "/v1/completions", body)
            chosen = [fleet.endpoint(0), fleet.endpoint(1)].index(answer.endpoint)
            rank = int(answer.headers["x-data-parallel-rank"])
            other = 1 - chosen
            chosen_key, other_key = (fleet.ids[chosen], rank), (fleet.ids[other], rank)
            assert fleet.scores(token_ids=prompt)[chosen_key]["pending_blocks"] == full_blocks
            assert fleet.inflight()[chosen_key] == 1
            # The gateway retried elsewhere and says so on the response.
            await stream.response_headers(200, served=fleet.endpoint(other))
            assert (await stream.read()).WhichOneof("response") == "response_headers"
            scores = fleet.scores(token_ids=prompt)
            assert scores[chosen_key]["pending_blocks"] == 0
            assert scores[other_key]["pending_blocks"] == full_blocks
            inflight = fleet.inflight()
            assert (inflight[chosen_key], inflight[other_key]) == (0, 1)
            await stream.response_body(b"{}", end_of_stream=True)
            assert streamed(await stream.read(), "response_body").end_of_stream
            assert await stream.finish() == grpc.StatusCode.OK

    scenario(run)
    fleet.assert_nothing_left()


# --- health and TLS ---------------------------------------------------------------------------


async def health_of(server: BackgroundServer, service: str) -> int | str:
    """The status the picker's health service gives `service`, or the gRPC error code."""
    epp = server.epp
    assert epp is not None and epp.identity is not None
    async with channel(epp.port, epp.identity.certificate) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                     timeout=STREAM_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return reply.status


def test_health_services_answer_on_the_epp_port(fleet: Fleet) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING

    async def run() -> None:
        for service in ("", "liveness", "readiness", EXT_PROC):
            status = await wait_until_status(fleet.server, service, serving)
            assert status == serving, service
        assert await health_of(fleet.server, "kvroute.nothing") == "NOT_FOUND"

    scenario(run)


async def wait_until_status(server: BackgroundServer, service: str, want: int) -> int | str:
    last: list[int | str] = []

    async def poll() -> None:
        while True:
            last.append(await health_of(server, service))
            if last[-1] == want:
                return
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(poll(), scaled(30.0))
    except TimeoutError:
        pass
    return last[-1]


def test_readiness_waits_for_the_configured_workers(dead_url: str) -> None:
    settings = epp_settings(instances=(InstanceConfig(url=dead_url),), ready_grace_seconds=300.0)
    with BackgroundServer(settings) as server:

        async def run() -> None:
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert await health_of(server, "liveness") == health_pb2.HealthCheckResponse.SERVING
            assert await health_of(server, "readiness") == not_serving
            assert await health_of(server, EXT_PROC) == not_serving

        scenario(run)
        assert httpx.get(f"{server.url}/readyz", timeout=HTTP_TIMEOUT).status_code == 503


def test_plaintext_and_mutual_tls(tmp_path: Any, fleet: Fleet) -> None:
    ca = trustme.CA()
    served = ca.issue_cert("localhost")
    cert, key, ca_file = tmp_path / "epp.pem", tmp_path / "epp.key", tmp_path / "ca.pem"
    served.private_key_pem.write_to_path(str(key))
    served.cert_chain_pems[0].write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(ca_file))
    client = ca.issue_cert("gateway.example")
    body = completion(unique_tokens(1408, 3 * BLOCK))

    async def routed(server: BackgroundServer, **tls: bytes) -> str | None:
        root = ca.cert_pem.bytes() if server is mutual else None
        async with streams_to(server, root, **tls) as open_stream:
            stream = open_stream()
            answer = await pick(stream, "/v1/completions", body)
            stream.cancel()
            return answer.endpoint

    with BackgroundServer(epp_settings(epp_tls=False)) as plain, \
            BackgroundServer(epp_settings(epp_tls_certfile=str(cert), epp_tls_keyfile=str(key),
                                          epp_client_ca=str(ca_file))) as mutual:
        for server in (plain, mutual):
            with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
                Fleet(server, http).register(fleet.cluster.urls[0])
        assert plain.epp is not None and plain.epp.identity is None
        assert mutual.epp is not None and mutual.epp.identity is not None
        assert not mutual.epp.identity.self_signed
        assert mutual.epp.identity.certificate == served.cert_chain_pems[0].bytes()

        async def run() -> None:
            assert await routed(plain) == fleet.endpoint(0)
            # The configured certificate, and a client certificate from the CA: routed.
            assert await routed(mutual, client_key=client.private_key_pem.bytes(),
                                client_chain=client.cert_chain_pems[0].bytes()) == \
                fleet.endpoint(0)
            # Without one, the handshake fails: nothing reaches the picker.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await routed(mutual)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        scenario(run)


def test_a_gateway_that_buffers_bodies_is_told_what_is_wrong(fleet: Fleet) -> None:
    # In BUFFERED mode Envoy waits for the headers' answer before it sends the body, which
    # the picker needs to answer: the stream is refused at once instead of timing out.
    async def run() -> None:
        epp = fleet.server.epp
        async with channel(epp.port, epp.identity.certificate) as chan:
            call = ext_proc_grpc.ExternalProcessorStub(chan).Process()
            request = ext_proc.ProcessingRequest(
                request_headers=ext_proc.HttpHeaders(end_of_stream=False))
            request.protocol_config.request_body_mode = \
                processing_mode_pb2.ProcessingMode.BUFFERED
            await call.write(request)
            assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "FULL_DUPLEX_STREAMED" in await call.details()

    scenario(run)
    fleet.assert_nothing_left()


def test_an_instance_registered_with_an_endpoint_is_named_by_it(fleet: Fleet) -> None:
    # The same simulated instance again, registered as a gateway would reach it elsewhere.
    answer = fleet.http.post("/v1/instances", json={
        "url": fleet.cluster.urls[0], "id": "behind-nat", "endpoint": "10.9.8.7:8000"})
    assert answer.status_code == 201, answer.text
    assert answer.json()["endpoint"] == "10.9.8.7:8000"
    try:
        wait_for(lambda: fleet.http.get("/v1/instances/behind-nat").json()["state"] == "live",
                 "behind-nat to go live")
        hint = metadata({SUBSET_NAMESPACE: {SUBSET_KEY: ["10.9.8.7:8000"]}})

        async def run() -> None:
            async with streams_to(fleet.server) as open_stream:
                stream = open_stream()
                picked = await pick(stream, "/v1/completions", completion([9, 8, 7]),
                                    context=hint)
                assert picked.endpoint == "10.9.8.7:8000"
                assert picked.dynamic_metadata == {LB_NAMESPACE: {DESTINATION: "10.9.8.7:8000"}}
                stream.cancel()

        scenario(run)
    finally:
        fleet.http.delete("/v1/instances/behind-nat")
    fleet.assert_nothing_left()
