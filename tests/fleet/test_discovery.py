"""Discovery from an instance URL: vLLM 0.32.0's exact answers over real HTTP, the other
/kv_event_sources shapes of vLLM's history, explicit endpoints, and clear errors."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.app.fleet.discovery import (
    DiscoveryError,
    block_size_in,
    discover,
    offset_port,
    rewrite_host,
    workers_from_sources,
)
from kvroute.app.workers import WorkerEndpoint
from tests.support.canned_http import canned_http
from tests.support.waiting import HTTP_TIMEOUT

# Answers recorded from a real vLLM 0.32.0 (CPU build).
SOURCES_0_32 = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:18602", "replay_endpoint": "tcp://*:18603",
                      "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                      "topic": "kv-events"}}
MODELS_0_32 = {"object": "list", "data": [{
    "id": "/models/tiny-llama", "object": "model", "created": 1795259326, "owned_by": "vllm",
    "root": "/models/tiny-llama", "parent": None, "max_model_len": 1024, "permission": []}]}
METRICS_0_32 = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",'
    'enable_prefix_caching="True",engine="0",num_gpu_blocks="64"} 1.0\n'
    'vllm:prefix_cache_hits_total{engine="0",model_name="/models/tiny-llama"} 224.0\n'
)


@pytest.fixture
def http_instance() -> Iterator[tuple[str, dict[str, tuple[int, str]]]]:
    """A real HTTP server on a free loopback port answering canned bodies by path."""
    routes: dict[str, tuple[int, str]] = {
        "/kv_event_sources": (200, json.dumps(SOURCES_0_32)),
        "/v1/models": (200, json.dumps(MODELS_0_32)),
        "/metrics": (200, METRICS_0_32),
    }
    with canned_http(routes) as url:
        yield url, routes


async def _discover(url: str, **kwargs: Any):
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        return await discover(url, client, **kwargs)


def test_vllm_0_32_answers_over_real_http(http_instance):
    url, _ = http_instance
    info = asyncio.run(_discover(url + "/"))
    host_port = url.removeprefix("http://")
    assert info.url == url
    assert info.models == ["/models/tiny-llama"] and info.max_model_len == 1024
    assert info.block_size == 32
    assert info.workers == [WorkerEndpoint(host_port, 0, "tcp://127.0.0.1:18602",
                                           "tcp://127.0.0.1:18603", "kv-events")]
    assert info.notes == []


def test_missing_metrics_leave_the_block_size_unknown_with_a_note(http_instance):
    url, routes = http_instance
    del routes["/metrics"]
    info = asyncio.run(_discover(url))
    assert info.block_size is None and "block size unknown" in info.notes[0]
    assert info.workers[0].instance_id == url.removeprefix("http://")


@pytest.mark.parametrize(("path", "status", "body", "reason"), [
    ("/kv_event_sources", 404, "nope", "too old"),
    ("/kv_event_sources", 500, "boom", "HTTP 500"),
    ("/kv_event_sources", 200, "not json", "did not answer JSON"),
    ("/kv_event_sources", 200, "{}", "publishes no KV events"),
    ("/kv_event_sources", 200, '{"x": 1}', "expected rank -> config"),
    ("/kv_event_sources", 200, "42", "answered int"),
    ("/kv_event_sources", 200, '{"0": {"topic": "t"}}', "rank 0 of /kv_event_sources has no"),
    ("/v1/models", 200, '{"data": []}', "lists no model"),
    ("/v1/models", 200, "[]", "no 'data' list"),
    ("/v1/models", 200, "[" * 100_000, "did not answer JSON"),  # deeper than any decoder
])
def test_malformed_answers_are_clear_discovery_errors(http_instance, path, status, body, reason):
    url, routes = http_instance
    routes[path] = (status, body)
    with pytest.raises(DiscoveryError, match=reason) as caught:
        asyncio.run(_discover(url))
    assert caught.value.url == url and str(caught.value).startswith(url)


def test_an_unreachable_instance_is_a_discovery_error_naming_the_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"  # nothing listens there any more
    with pytest.raises(DiscoveryError, match="GET /kv_event_sources failed: ConnectError"):
        asyncio.run(_discover(url))
    with pytest.raises(DiscoveryError, match="must start with http"):
        asyncio.run(_discover("127.0.0.1:8000"))


def test_an_instance_without_a_replay_endpoint_gets_a_note(http_instance):
    url, routes = http_instance
    routes["/kv_event_sources"] = (200, json.dumps(
        {"0": {"endpoint": "tcp://*:7000", "topic": "t"}}))
    info = asyncio.run(_discover(url))
    assert [(w.endpoint, w.replay_endpoint, w.topic) for w in info.workers] == [
        ("tcp://127.0.0.1:7000", None, "t")]
    assert "no replay endpoint" in info.notes[0]


# --- the other shapes and the endpoint rules, without HTTP ----------------------------------


def test_later_vllm_list_shapes_bare_and_wrapped():
    listed = [
        {"data_parallel_rank": 1, "endpoint": "tcp://0.0.0.0:41002", "replay_endpoint": None,
         "topic": "kv-events"},
        {"data_parallel_rank": 0, "endpoint": "tcp://0.0.0.0:41001",
         "replay_endpoint": "tcp://0.0.0.0:41003", "topic": "kv-events"},
    ]
    for payload in (listed, {"sources": listed}):
        workers = workers_from_sources("http://vllm-0.svc:8000", payload)
        assert [(w.instance_id, w.dp_rank, w.endpoint, w.replay_endpoint) for w in workers] == [
            ("vllm-0.svc:8000", 0, "tcp://vllm-0.svc:41001", "tcp://vllm-0.svc:41003"),
            ("vllm-0.svc:8000", 1, "tcp://vllm-0.svc:41002", None),
        ]


def test_two_ranks_in_the_0_32_shape_and_disabled_ranks():
    payload = {
        "0": {**SOURCES_0_32["0"]},
        "1": {**SOURCES_0_32["0"], "endpoint": "tcp://*:18603", "replay_endpoint": None},
        "2": {**SOURCES_0_32["0"], "enable_kv_cache_events": False},
    }
    workers = workers_from_sources("http://[::1]:8000", payload)
    assert [(w.dp_rank, w.endpoint, w.replay_endpoint) for w in workers] == [
        (0, "tcp://[::1]:18602", "tcp://[::1]:18603"),
        (1, "tcp://[::1]:18603", None),
    ]


def test_a_single_config_is_expanded_to_ranks_by_port_offset():
    payload = {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}
    workers = workers_from_sources("http://h:1", payload, dp_size=3)
    assert [(w.endpoint, w.replay_endpoint) for w in workers] == [
        ("tcp://h:5557", "tcp://h:5558"), ("tcp://h:5558", "tcp://h:5559"),
        ("tcp://h:5559", "tcp://h:5560")]


def test_duplicate_or_bad_ranks_are_rejected():
    entry = {"endpoint": "tcp://*:1"}
    with pytest.raises(DiscoveryError, match="names a rank twice"):
        workers_from_sources("http://h:1", [{**entry, "data_parallel_rank": 0},
                                            {**entry, "data_parallel_rank": 0}])
    with pytest.raises(DiscoveryError, match="bad rank"):
        workers_from_sources("http://h:1", [{**entry, "data_parallel_rank": "0"}])
    with pytest.raises(DiscoveryError, match="entry 0 is not an object"):
        workers_from_sources("http://h:1", ["tcp://*:1"])
    with pytest.raises(DiscoveryError, match="topic must be a string"):
        workers_from_sources("http://h:1", [{**entry, "topic": 5}])


def test_endpoint_rules():
    assert rewrite_host("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert rewrite_host("tcp://0.0.0.0:5557", "h") == "tcp://h:5557"
    assert rewrite_host("tcp://[::]:5557", "fe80::1") == "tcp://[fe80::1]:5557"
    assert rewrite_host("tcp://10.0.0.9:5557", "h") == "tcp://10.0.0.9:5557"
    assert rewrite_host("ipc:///tmp/kv", "h") == "ipc:///tmp/kv"
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv"


def test_lora_adapters_are_the_models_with_a_parent(http_instance):
    url, routes = http_instance
    adapter = {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent":
               "/models/tiny-llama", "max_model_len": 1024}
    routes["/v1/models"] = (200, json.dumps(
        {"object": "list", "data": [*MODELS_0_32["data"], adapter]}))
    info = asyncio.run(_discover(url))
    assert info.models == ["/models/tiny-llama", "sql-lora"]
    assert info.lora_adapters == ["sql-lora"]


def test_the_block_size_is_read_from_the_first_cache_config_line_only():
    line = 'vllm:cache_config_info{block_size="16",engine="0"} 1.0'
    assert block_size_in(line) == 16
    assert block_size_in(METRICS_0_32) == 32
    assert block_size_in(f"# x\n{line}\n" + line.replace("16", "32")) == 16
    assert block_size_in("# vllm:cache_config_info{block_size=\"16\"} 1.0\n") is None
    assert block_size_in('vllm:cache_config_info{engine="0"} 1.0\n' + line) is None
    # Hostile pages: unclosed braces on every line, an endless line, an endless number.
    assert block_size_in("vllm:cache_config_info{\n" * 100_000) is None
    assert block_size_in("vllm:cache_config_info{" + "a" * 1_000_000 + 'block_size="8"') is None
    assert block_size_in('vllm:cache_config_info{block_size="' + "9" * 5000 + '"}') is None
