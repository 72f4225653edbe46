"""Proxy mode takes text out of the box: with no `tokenizer` set, text and chat prompts
are tokenized by the instances' own /tokenize, and routed by those tokens.

Real HTTP throughout: an OpenAI-style client -> kvroute's proxy -> simulated vLLM, and the
instances' KV events back over ZMQ."""

from __future__ import annotations

import logging

import httpx
import pytest

from kvroute.app.config import Settings, load_settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16


def test_the_proxy_defaults_to_the_instances_tokenizer() -> None:
    assert load_settings(environ={}, flags={"proxy": True}).tokenizer == "instance"
    assert load_settings(environ={"KVROUTE_PROXY": "true"}).tokenizer == "instance"
    assert load_settings(environ={}).tokenizer is None  # route mode: text still refused
    given = load_settings(environ={"KVROUTE_TOKENIZER": "/models/tokenizer.json"},
                          flags={"proxy": True})
    assert given.tokenizer == "/models/tokenizer.json"


def test_text_through_the_proxy_is_routed_by_its_tokens_with_no_tokenizer_set(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.api")
    texts = [f"You are assistant number {n}. " * 6 + "Answer briefly." for n in range(3)]
    with SimCluster(n=3, block_size=BLOCK, num_blocks=256, model="sim-model") as cluster:
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                            load_interval=0)
        assert settings.tokenizer == "instance"
        with BackgroundServer(settings) as server, \
                httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            ids = []
            for url in cluster.urls:
                answer = http.post("/v1/instances", json={"url": url})
                assert answer.status_code == 201, answer.text
                ids.append(answer.json()["id"])
            wait_for(lambda: all(i["state"] == "live" for i in
                                 http.get("/v1/instances").json()["instances"]), "live")
            # Each text is cached on one instance, behind kvroute's back: only its events
            # tell kvroute where it is.
            for number, text in enumerate(texts):
                cluster.complete(number, text, max_tokens=1)
            for number, text in enumerate(texts):
                wait_for(lambda text=text, number=number: http.post("/v1/route", json={
                    "prompt": text, "probe": True}).json().get("instance") == ids[number],
                    f"text {number}'s prefix learnt")
            for number, text in enumerate(texts):
                answer = http.post("/v1/completions", json={
                    "model": "sim-model", "prompt": text, "max_tokens": 2})
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-kvroute-instance"] == ids[number]
                cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= BLOCK * 4  # the instance reused the prefix kvroute saw
            chat = http.post("/v1/chat/completions", json={
                "model": "sim-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hello there"}]})
            assert chat.status_code == 200, chat.text
    assert any("text and chat prompts are tokenized by the instances' /tokenize"
               in record.getMessage() for record in caplog.records)


# A chat an agent sends: tools offered, an earlier tool call and its result, a named user,
# template arguments, and the assistant's answer begun (continue_final_message). Every one
# of these changes the prompt the engine renders and caches.
AGENT_CHAT = {
    "model": "sim-model", "max_tokens": 2,
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}],
    "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": False, "continue_final_message": True,
    "messages": [
        {"role": "system", "content": "You plan trips. " * 8},
        {"role": "user", "name": "ana", "content": "Weather in Lisbon?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"city\": \"Lisbon\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
        {"role": "assistant", "content": "It is"},
    ],
}


def test_a_chat_is_tokenized_with_every_field_its_template_renders() -> None:
    """kvroute asks the instance to tokenize the chat as the engine renders it: all of each
    message and the request's template arguments, not only roles and text. So the proxy
    sends an agent's chat where it is cached, and predicts exactly what the engine reuses."""
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, model="sim-model") as cluster:
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                            load_interval=0, placement_ttl=0)
        with BackgroundServer(settings) as server, \
                httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            ids = [http.post("/v1/instances", json={"url": url}).json()["id"]
                   for url in cluster.urls]
            wait_for(lambda: all(i["state"] == "live" for i in
                                 http.get("/v1/instances").json()["instances"]), "live")
            # The chat is cached on the second instance, behind kvroute's back.
            direct = httpx.post(f"{cluster.urls[1]}/v1/chat/completions", json=AGENT_CHAT,
                                timeout=HTTP_TIMEOUT)
            assert direct.status_code == 200, direct.text
            prompt_tokens = direct.json()["usage"]["prompt_tokens"]
            question = {key: value for key, value in AGENT_CHAT.items() if key != "max_tokens"}
            wait_for(lambda: http.post("/v1/route", json={**question, "probe": True}).json()[
                "matched_tokens"] >= prompt_tokens - BLOCK, "the chat's blocks learnt")
            routed = http.post("/v1/route", json={**question, "probe": True}).json()
            assert routed["instance"] == ids[1] and routed["prompt_tokens"] == prompt_tokens

            answer = http.post("/v1/chat/completions", json=AGENT_CHAT)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvroute-instance"] == ids[1]
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == routed["matched_tokens"] > 0
            hits = server.service.metrics.hits.totals  # recorded once the relay has ended
            wait_for(lambda: (ids[1], 0) in hits, "the comparison recorded")
            assert (hits[(ids[1], 0)].requests, hits[(ids[1], 0)].exact) == (1, 1)

            # Without its template arguments the same messages are another prompt.
            plain = {"messages": AGENT_CHAT["messages"][:-1], "probe": True}
            assert http.post("/v1/route", json=plain).json()["matched_tokens"] == 0
