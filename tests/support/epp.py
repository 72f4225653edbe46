"""Shared machinery of the Endpoint Picker tests (tests/test_epp*.py): a kvroute with its
EPP on in front of simulated vLLM, the one event loop the gRPC clients run on, and what the
protocol says the picker's answers are (see tests/epp/test_protocol.py for the protocol's rules)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.envoy_client import LB_NAMESPACE, EnvoyStream, channel
from tests.support.following import instance_ids, registered
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for

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



def epp_fleet() -> Iterator[Fleet]:
    """A kvroute with its EPP on, following two simulated instances of two ranks each."""
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, dp_size=2) as cluster, \
            BackgroundServer(epp_settings()) as server, registered(server, cluster) as http:
        yield Fleet(server, http, cluster, instance_ids(cluster, http))


def client_loop() -> Iterator[None]:
    """The module's ClientLoop, for `scenario`; stopped when the module is done."""
    global CLIENTS
    CLIENTS = ClientLoop()
    try:
        yield
    finally:
        CLIENTS.stop()
        CLIENTS = None
