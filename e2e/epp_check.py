"""Check 11: kvroute as an Endpoint Picker in front of two real vLLM engines.

The harness plays the gateway (no Envoy binary can be installed here): for each completion
it opens an ext_proc stream to kvroute's EPP port, sends the request the way Envoy does
(headers, the body in chunks, end of stream), takes the endpoint and data-parallel rank
kvroute names, sends the body it got back to that endpoint, and then streams the response
through the picker as Envoy would (with the endpoint that served). The ground truth is
vLLM's `usage.prompt_tokens_details.cached_tokens` for that request: it must equal what
kvroute's index predicted for the engine the picker named, asked just before (a probe).
The TLS certificate is the one kvroute made at start, pinned from the handshake as a
gateway that does not verify it would simply accept it.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
from typing import Any

import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from e2e.checks import CheckResult, Cluster, Step, _mismatches
from e2e.ports import free_port
from e2e.workloads import Prompt, random_tokens, shared_prefix_workload
from tests.support.envoy_client import (
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    EnvoyStream,
    Pick,
    channel,
    metadata,
    pick,
)

STREAM_TIMEOUT = 60.0
DESTINATION = "x-gateway-destination-endpoint"


def check_epp(cl: Cluster, rng: random.Random, requests: int = 16) -> CheckResult:
    """11. Completions routed through the EPP client path land where kvroute's index says
    the prefix is, and vLLM's cached tokens there equal the prediction."""
    port = free_port()
    cl.kvroute.stop()
    cl.say(f"  restarting kvroute with its defaults and the Endpoint Picker on :{port}")
    cl.kvroute.start({"KVROUTE_EPP_PORT": str(port)})
    cl.ids.clear()
    # Both sides start empty and exact: after check 10 the engines' replay keeps only a
    # few batches, so a new kvroute cannot learn what they cached before (its workers come
    # up degraded); the reset's AllBlocksCleared makes them exact, and live, again.
    for name, engine in cl.engines.items():
        cl.ids[name] = cl.kvroute.register(engine.url)
    for name in cl.engines:
        cl.kvroute.wait_state(cl.ids[name], {"live", "degraded"}, 30.0, cl.say,
                              "after registering")
        cl.sync(name)
    for name in cl.engines:
        cl.reset_engine(name)
        cl.kvroute.wait_state(cl.ids[name], {"live"}, 30.0, cl.say, "after the reset")
    certificate = ssl.get_server_certificate(("127.0.0.1", port)).encode()
    model = str(next(iter(cl.engines.values())).spec.model_dir)
    by_endpoint = {engine.url.removeprefix("http://"): name
                   for name, engine in cl.engines.items()}
    prompts = shared_prefix_workload(rng, requests)
    # Last: a prompt held by one engine, asked with a subset hint naming only the other.
    held = random_tokens(rng, 150)
    return asyncio.run(_run(cl, port, certificate, model, by_endpoint, prompts, held))


async def _run(cl: Cluster, port: int, certificate: bytes, model: str,
               by_endpoint: dict[str, str], prompts: list[Prompt], held: Prompt) -> CheckResult:
    details: list[str] = []
    steps: list[Step] = []
    agree_with_route = 0
    async with channel(port, certificate) as chan, httpx.AsyncClient(timeout=120.0) as http:
        stub = ext_proc_grpc.ExternalProcessorStub(chan)

        async def through_picker(prompt: Prompt, context: Any = None) -> tuple[str, Step]:
            predicted = cl.matched(prompt)
            routed = cl.kvroute.route(prompt, probe=True)["instance"]
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1,
                               "temperature": 0.0}).encode()
            stream = EnvoyStream(stub, STREAM_TIMEOUT)
            answer = await pick(stream, "/v1/completions", body, chunk_size=1000,
                                context=context)
            problem = _contract(answer, body)
            if problem:
                stream.cancel()
                raise AssertionError(problem)
            name = by_endpoint.get(str(answer.endpoint))
            if name is None:
                stream.cancel()
                raise AssertionError(f"the picker named {answer.endpoint}, not an engine")
            before = {n: t.count for n, t in cl.taps.items()}
            response = await http.post(
                f"http://{answer.endpoint}/v1/completions", content=answer.body,
                headers={"content-type": "application/json",
                         "x-data-parallel-rank": answer.headers["x-data-parallel-rank"]})
            # The response through the picker, as the gateway streams it.
            await stream.response_headers(response.status_code, served=answer.endpoint)
            await stream.response_body(response.content, end_of_stream=True)
            echoed = b""
            message = await stream.read()
            headers_answered = message is not None and \
                message.WhichOneof("response") == "response_headers"
            while message is not None:  # the body's echo, to its end
                message = await stream.read()
                if message is None or message.WhichOneof("response") != "response_body":
                    break
                part = message.response_body.response.body_mutation.streamed_response
                echoed += part.body
                if part.end_of_stream:
                    break
            code = await stream.finish()
            if not headers_answered:
                details.append("the response headers were not answered first")
            if echoed != response.content or code.name != "OK":
                details.append(f"response through the picker: echoed {len(echoed)} of "
                               f"{len(response.content)} bytes, stream {code.name}")
            if response.status_code != 200:
                raise AssertionError(f"{name} answered {response.status_code}: "
                                     f"{response.text[:200]}")
            usage = response.json()["usage"]
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            bs = cl.engines[name].spec.block_size
            cl.settle(name, before[name], expect_batch=len(prompt) // bs > cached // bs)
            return routed, Step(name, len(prompt), predicted[name], cached)

        for prompt in prompts:
            routed, step = await through_picker(prompt)
            steps.append(step)
            agree_with_route += routed == cl.ids[step.engine]
        # The subset hint: the holder of a prompt is left out, so the other engine serves it.
        holder, other = list(cl.engines)
        before = cl.taps[holder].count
        cl.engines[holder].cached_tokens(held)
        cl.settle(holder, before, expect_batch=True)
        if cl.matched(held)[holder] == 0:
            details.append(f"kvroute did not learn that {holder} holds the hinted prompt: "
                           "the subset hint proves nothing")
        hint = metadata({SUBSET_NAMESPACE: {
            SUBSET_KEY: [cl.engines[other].url.removeprefix("http://")]}})
        _, hinted = await through_picker(held, hint)
        if hinted.engine != other:
            details.append(f"the subset hint named only {other}; the picker chose "
                           f"{hinted.engine}")
        steps.append(hinted)
    details += _mismatches(steps)
    hits = sum(1 for s in steps if s.cached > 0)
    if hits < len(prompts) // 4:
        details.append(f"only {hits} requests hit the cache: the workload proves too little")
    if agree_with_route < len(prompts) * 3 // 4:
        details.append(f"the picker chose what POST /v1/route chose just before for only "
                       f"{agree_with_route} of {len(prompts)} requests")
    open_ = cl.kvroute.inflight()
    if any(open_.values()):
        details.append(f"in-flight counts not back at zero after the streams ended: {open_}")
    details += cl.holdings_disagree()
    per_engine = {n: sum(1 for s in steps if s.engine == n) for n in cl.engines}
    summary = (f"{sum(s.ok for s in steps)}/{len(steps)} requests routed by the EPP agree "
               f"with vLLM's cached_tokens ({hits} hits, "
               f"{sum(s.cached for s in steps)} tokens); named {per_engine}; same choice "
               f"as /v1/route {agree_with_route}/{len(prompts)}; subset hint -> "
               f"{hinted.engine} ({hinted.predicted}=={hinted.cached})")
    return CheckResult("11 epp", not details, summary, details=details)


def _contract(answer: Pick, body: bytes) -> str | None:
    """What is wrong with the picker's answer by the protocol, if anything."""
    if answer.immediate is not None:
        return (f"immediate response {answer.immediate.status.code}: "
                f"{answer.immediate.body[:200]!r}")
    if answer.body != body:
        return f"the body came back changed ({len(answer.body)} of {len(body)} bytes)"
    if answer.dynamic_metadata != {LB_NAMESPACE: {DESTINATION: answer.endpoint}}:
        return f"dynamic metadata {answer.dynamic_metadata} does not name {answer.endpoint}"
    if answer.headers.get("content-length") != str(len(body)):
        return f"content-length {answer.headers.get('content-length')} for {len(body)} bytes"
    if answer.headers.get("x-data-parallel-rank") != "0":
        return f"x-data-parallel-rank {answer.headers.get('x-data-parallel-rank')} (one rank)"
    return None
