"""kvroute as an Endpoint Picker, driven over gRPC the way Envoy drives one.

No Envoy binary can be installed here, so `tests.support.envoy_client` plays Envoy's part of the
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

import json
from collections.abc import Iterator

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from kvroute.app.server import BackgroundServer
from tests.support.envoy_client import (
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    metadata,
    pick,
)
from tests.support.epp import (
    BLOCK,
    DESTINATION,
    MAX_BODY,
    MAX_CHUNK,
    Fleet,
    assert_immediate,
    body_back,
    client_loop,
    completion,
    epp_fleet,
    epp_settings,
    expected_routed,
    header_values,
    same_headers,
    scenario,
    send_request,
    send_to,
    streamed,
    streams_to,
)
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for, wait_until


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    yield from epp_fleet()


@pytest.fixture(scope="module", autouse=True)
def clients() -> Iterator[None]:
    yield from client_loop()


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
    # A KV-cache usage limit of 0 makes every worker whose load was read saturated; one
    # stream routed at a time.
    settings = epp_settings(overload_kv_usage=0.0, max_concurrent_requests=1,
                            load_interval=0.1)
    with BackgroundServer(settings) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        other = Fleet(server, http)
        other.register(fleet.cluster.urls[0])
        wait_for(lambda: all(s["load"]["kv_usage"] is not None for s in other.scores(
            token_ids=[5, 6, 7], all_scores=True).values()), "every worker's load to be read")

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
