"""The simulated vLLM instance through real HTTP and real ZeroMQ sockets."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import zmq

from kvroute.app.ingest.wire import BlockStored, decode_batch, decode_replay_frame
from kvroute.sim.cluster import SimCluster
from kvroute.sim.instance import SimInstance
from kvroute.sim.spec import SimInstanceSpec
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for


def replay_all(endpoint: str, timeout_s: float = scaled(30)) -> list[tuple[int, object]]:
    """Every buffered batch of one rank, through a DEALER as a subscriber would ask."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not dealer.poll(int(1000 * (deadline - time.monotonic())) + 1):
                break
            frame = decode_replay_frame(dealer.recv_multipart())
            if frame.seq is None:
                return out
            out.append((frame.seq, decode_batch(frame.payload)))
        raise AssertionError("replay did not end in time")
    finally:
        dealer.close(0)


def contents(batches) -> dict[object, tuple[int, ...]]:
    """hash -> token content of every block the batches stored."""
    content: dict[object, tuple[int, ...]] = {}
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                prefix = () if ev.parent_block_hash is None else content[ev.parent_block_hash]
                for k, h in enumerate(ev.block_hashes):
                    prefix += tuple(ev.token_ids[k * ev.block_size : (k + 1) * ev.block_size])
                    content[h] = prefix
    return content


def port_is_free(port: int, within_s: float = scaled(30)) -> bool:
    """Nothing listens on the port (TIME_WAIT leftovers do not count: SO_REUSEADDR). ZMQ
    unbinds in its I/O thread after close returns, so allow it a moment."""
    deadline = time.monotonic() + within_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.05)


@pytest.fixture
def instance():
    with SimInstance(SimInstanceSpec(block_size=16, num_blocks=128, seed=4)) as inst:
        yield inst


def test_models_tokenize_health_and_metrics_answer_like_vllm(instance):
    with httpx.Client(base_url=instance.url, timeout=HTTP_TIMEOUT) as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "sim-model"
        assert models["data"][0]["max_model_len"] == 127 * 16
        assert http.get("/health").status_code == 200
        tok = http.post("/tokenize", json={"prompt": "hé"}).json()
        assert tok["tokens"] == list("hé".encode()) and tok["count"] == 3
        http.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 2})
        http.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 2})
        text = http.get("/metrics").text
    assert 'vllm:cache_config_info{block_size="16"' in text
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim-model"} 80.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-model"} 32.0' in text
    # As in vLLM, the gauges are the last step's: the last request was still running then.
    assert 'vllm:num_requests_running{engine="0",model_name="sim-model"} 1.0' in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="sim-model"} 4.0' in text
    assert "vllm:kv_cache_usage_perc" in text and "vllm:num_requests_waiting" in text


def test_completions_report_cached_tokens_that_agree_with_the_events(instance):
    prompt = list(range(1000, 1100))
    with httpx.Client(base_url=instance.url, timeout=HTTP_TIMEOUT) as http:
        first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3}).json()
        second = http.post("/v1/completions",
                           json={"model": "sim-model", "prompt": prompt + [5] * 20}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["completion_tokens"] == 3 and first["choices"][0]["text"].isalpha()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    body = httpx.get(f"{instance.url}/kv_event_sources").json()
    assert list(body) == ["0"]  # vLLM 0.32.0: resolved config per rank, keyed by "0", "1" ...
    source = body["0"]
    assert source["publisher"] == "zmq" and source["topic"] == "kv-events"
    assert source["endpoint"].startswith("tcp://*:") and source["buffer_steps"] == 10_000
    replay = source["replay_endpoint"].replace("*", "127.0.0.1")
    batches = replay_all(replay)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    assert all(b.data_parallel_rank == 0 and not b.malformed for _, b in batches)
    cached = set(contents(batches).values())
    engine = instance.engines[0]
    assert engine.lookup(prompt) == 96
    assert tuple(prompt[:96]) in cached and tuple(prompt[:112]) not in cached


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": [1, 2, 32000]}, 400, "out of vocabulary"),
        ({"prompt": [1, "2"]}, 400, "token ids"),
        ({"prompt": []}, 400, "cannot be empty"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "model": "other"}, 404, "does not exist"),
        ({"prompt": [1] * 5000}, 400, "max_model_len"),
        ([1, 2], 400, "JSON object"),
    ],
)
def test_bad_completions_get_a_clear_error(instance, body, status, needle):
    resp = httpx.post(f"{instance.url}/v1/completions", json=body, timeout=HTTP_TIMEOUT)
    assert resp.status_code == status
    assert needle in resp.json()["error"]["message"]


def test_live_subscriber_receives_each_step_with_its_seq(instance):
    source = instance.kv_event_sources()[0]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source["endpoint"])
    prompts: list[list[int]] = []
    try:
        # ZMQ's slow joiner: batches sent before the subscription lands are lost, so keep
        # sending (bounded) until one arrives live.
        for n in range(40):
            prompts.append([n] * 64)
            httpx.post(f"{instance.url}/v1/completions",
                       json={"prompt": prompts[-1], "max_tokens": 1}, timeout=HTTP_TIMEOUT)
            if sub.poll(250):
                break
        else:
            raise AssertionError("no live batch arrived")
        topic, seq, payload = sub.recv_multipart()
    finally:
        sub.close(0)
    (event,) = decode_batch(payload).events
    assert topic == b"kv-events" and event.block_size == 16
    # one step per request, so the batch's seq is the index of the prompt it stored
    assert prompts[int.from_bytes(seq, "big")] == event.token_ids


def test_data_parallel_ranks_publish_on_consecutive_ports_and_serve_the_rank_asked():
    cfg = SimInstanceSpec(block_size=16, num_blocks=64, dp_size=2, seed=9, encoding="array",
                         replay_format="old", sources_shape="list")
    with SimInstance(cfg) as inst:
        sources = httpx.get(f"{inst.url}/kv_event_sources").json()
        assert [s["data_parallel_rank"] for s in sources] == [0, 1]
        ports = [int(s["endpoint"].rsplit(":", 1)[1]) for s in sources]
        assert ports[1] == ports[0] + 1
        prompt = list(range(500, 548))
        for _ in range(2):
            resp = httpx.post(f"{inst.url}/v1/completions", json={"prompt": prompt},
                              headers={"X-data-parallel-rank": "1"}, timeout=HTTP_TIMEOUT)
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert inst.engines[0].lookup(prompt) == 0 and inst.engines[1].lookup(prompt) == 48
        batches = replay_all(sources[1]["replay_endpoint"])
        assert batches and all(b.data_parallel_rank == 1 for _, b in batches)
        assert replay_all(sources[0]["replay_endpoint"]) == []
        bad = httpx.post(f"{inst.url}/v1/completions", json={"prompt": prompt},
                         headers={"X-data-parallel-rank": "2"}, timeout=HTTP_TIMEOUT)
        assert bad.status_code == 400


def test_sources_shape_can_be_the_wrapped_list_of_other_vllm_revisions():
    with SimInstance(SimInstanceSpec(num_blocks=16, sources_shape="sources")) as inst:
        (source,) = httpx.get(f"{inst.url}/kv_event_sources").json()["sources"]
        assert source["data_parallel_rank"] == 0
        assert source["endpoint"] == inst.ranks[0].endpoint


def test_reset_clears_the_cache_and_announces_it_with_the_next_step(instance):
    with httpx.Client(base_url=instance.url, timeout=HTTP_TIMEOUT) as http:
        http.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": 1})
        assert http.post("/reset_prefix_cache").status_code == 200
        assert instance.engines[0].lookup(list(range(40))) == 0
        http.post("/v1/completions", json={"prompt": [7] * 20, "max_tokens": 1})
    batches = replay_all(instance.kv_event_sources()[0]["replay_endpoint"])
    kinds = [type(ev).__name__ for _, b in batches for ev in b.events]
    assert kinds == ["BlockStored", "AllBlocksCleared", "BlockStored"]


def test_cluster_starts_distinct_instances_and_frees_every_port_on_stop():
    with SimCluster(n=3, block_size=16, num_blocks=64, seed=1) as cluster:
        assert len(set(cluster.urls)) == 3
        prompt = list(range(300, 364))
        bodies = cluster.drive([(i, prompt) for i in range(3)] * 2, max_tokens=1, concurrency=3)
        assert sorted(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies) \
            == [0, 0, 0, 48, 48, 48]
        hashes = [e.block_hashes(prompt) for e in cluster.engines]
        assert len({tuple(h) for h in hashes}) == 3  # same tokens, different hash values
        ports = [int(u.rsplit(":", 1)[1]) for u in cluster.urls]
        for _, rank in cluster.ranks:
            ports += [int(rank.endpoint.rsplit(":", 1)[1]),
                      int(rank.replay_endpoint.rsplit(":", 1)[1])]
        assert not any(port_is_free(p, within_s=0) for p in ports)  # the check can fail
    assert cluster.instances == []
    assert all(port_is_free(p) for p in ports)


# --- chat, streaming and aborted streams ------------------------------------------------------


def sse_payloads(raw: bytes) -> list[object]:
    """The JSON payloads of an SSE body, with "[DONE]" kept as the string."""
    events = raw.decode().split("\n\n")
    assert events[-1] == "", "an SSE body ends with a blank line"
    out: list[object] = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour"}]}]


def test_chat_uses_the_template_tokenize_applies(instance):
    with httpx.Client(base_url=instance.url, timeout=HTTP_TIMEOUT) as http:
        tokens = http.post("/tokenize", json={"messages": CHAT,
                                              "add_generation_prompt": True}).json()["tokens"]
        assert bytes(tokens).decode() == ("<|system|>\nYou are terse.\n<|user|>\nName a colour\n"
                                          "<|assistant|>\n")
        bare = http.post("/tokenize", json={"messages": CHAT,
                                            "add_generation_prompt": False}).json()["tokens"]
        assert tokens[:len(bare)] == bare and len(bare) < len(tokens)
        first = http.post("/v1/chat/completions",
                          json={"model": "sim-model", "messages": CHAT, "max_tokens": 3}).json()
        again = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3},
                          headers={"X-Request-Id": "abc"}).json()
    assert first["object"] == "chat.completion" and again["id"] == "chatcmpl-abc"
    message = first["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) == 3
    assert first["usage"]["prompt_tokens"] == len(tokens)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the engine cached exactly the tokens /tokenize gave: vLLM's cap of (n - 1) // bs blocks
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(tokens) - 1) // 16 * 16
    assert instance.engines[0].lookup(tokens) == len(tokens) // 16 * 16


@pytest.mark.parametrize("chat", [False, True])
def test_streams_one_event_per_token_and_records_what_it_sent(instance, chat):
    path, field = ("/v1/chat/completions", "messages") if chat else ("/v1/completions", "prompt")
    body = {field: CHAT if chat else "stream me", "max_tokens": 5}
    with httpx.Client(base_url=instance.url, timeout=HTTP_TIMEOUT) as http:
        whole = http.post(path, json=body).json()
        with http.stream("POST", path, headers={"X-Request-Id": f"s{chat}"},
                         json={**body, "stream": True,
                               "stream_options": {"include_usage": True}}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(resp.iter_raw())
    prefix = "chatcmpl-" if chat else "cmpl-"
    assert instance.responses[f"{prefix}s{chat}"] == raw and instance.aborted == 0
    *chunks, usage, done = sse_payloads(raw)
    assert done == "[DONE]" and usage["choices"] == []
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["usage"]["completion_tokens"] == 5
    # the streamed request came second: it reused the prompt's full blocks
    cached = (whole["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert {c["id"] for c in chunks} == {f"{prefix}s{chat}"}
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert len(chunks) == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_a_client_that_leaves_mid_stream_is_counted_as_aborted():
    cfg = SimInstanceSpec(block_size=16, num_blocks=64, stream_interval_s=0.05)
    with SimInstance(cfg) as inst, httpx.Client(base_url=inst.url, timeout=HTTP_TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", headers={"X-Request-Id": "gone"},
                         json={"prompt": "abc", "max_tokens": 200, "stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: inst.aborted, "the engine to count the abort")
        assert inst.aborted == 1
        sent = inst.responses["cmpl-gone"]
        assert sent.startswith(b"data: ") and b"[DONE]" not in sent
        assert len(sse_payloads(sent)) < 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": 1}, "add_generation_prompt"),
        ("/tokenize", {"messages": "hi"}, "messages"),
    ],
)
def test_bad_chat_and_stream_requests_get_a_clear_error(instance, path, body, param):
    resp = httpx.post(f"{instance.url}{path}", json=body, timeout=HTTP_TIMEOUT)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
