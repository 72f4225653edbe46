"""The Endpoint Picker past its answer, and around it: a gateway cancelling a stream, the
response side with the endpoint the gateway reports as served, gRPC health, TLS, a gateway
configured with the wrong body mode, instances registered with an endpoint. Driven the way
Envoy drives a picker (tests.support.envoy_client); the protocol's rules are in
tests/epp/test_protocol.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import trustme
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.app.config import InstanceConfig
from kvroute.app.server import BackgroundServer
from tests.support.envoy_client import (
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    channel,
    metadata,
    pick,
)
from tests.support.epp import (
    BLOCK,
    DESTINATION,
    EXT_PROC,
    STREAM_TIMEOUT,
    Fleet,
    client_loop,
    completion,
    epp_fleet,
    epp_settings,
    scenario,
    streamed,
    streams_to,
)
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for, wait_until


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    yield from epp_fleet()


@pytest.fixture(scope="module", autouse=True)
def clients() -> Iterator[None]:
    yield from client_loop()


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


def test_a_salted_request_leaves_its_guess_in_its_tenants_domain(fleet: Fleet) -> None:
    """The picker reads `cache_salt` from the body as the proxy does: the guess it leaves
    counts for that tenant's next request only."""
    prompt = unique_tokens(1408, 8 * BLOCK)
    full_blocks = (len(prompt) - 1) // BLOCK

    async def run() -> None:
        async with streams_to(fleet.server) as open_stream:
            stream = open_stream()
            answer = await pick(stream, "/v1/completions",
                                completion(prompt, cache_salt="tenant-e"))
            chosen = [fleet.endpoint(0), fleet.endpoint(1)].index(answer.endpoint)
            key = (fleet.ids[chosen], int(answer.headers["x-data-parallel-rank"]))
            salted = fleet.scores(token_ids=prompt, cache_salt="tenant-e")
            assert salted[key]["pending_blocks"] == full_blocks
            assert all(s["pending_blocks"] == 0 for s in fleet.scores(token_ids=prompt).values())
            assert all(s["pending_blocks"] == 0 for s in fleet.scores(
                token_ids=prompt, cache_salt="tenant-f").values())
            await stream.response_headers(200)
            assert (await stream.read()).WhichOneof("response") == "response_headers"
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
