"""`kvroute serve --proxy` end to end: real HTTP from a client to kvroute, from kvroute to
simulated vLLM instances, and real ZMQ events back.

Which instance served a request is read three ways: the cached tokens vLLM reports, the
instance's own record of the responses it sent (by id, from the X-Request-Id header), and
the `x-kvroute-instance` header the proxy adds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.http.proxy import MAX_CONNECT_ATTEMPTS
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from kvroute.sim.instance import SimInstance
from kvroute.sim.spec import SimInstanceSpec
from tests.support.following import following, instance_ids
from tests.support.scores import inflight_counts
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, refusing_urls, scaled, wait_for

BLOCK = 16
_ids = itertools.count()




def request_id() -> str:
    return f"t{next(_ids)}-{time.monotonic_ns()}"


@dataclass
class Fleet:
    """A proxying kvroute (its client) and the simulated instances registered in it."""

    http: httpx.Client
    cluster: SimCluster | None = None
    ids: list[str] = field(default_factory=list)

    def register(self, **body: object) -> str:
        answer = self.http.post("/v1/instances", json=body)
        assert answer.status_code == 201, answer.text
        instance_id = answer.json()["id"]
        wait_for(lambda: self.http.get(f"/v1/instances/{instance_id}").json()["state"] == "live",
                 f"{instance_id} to go live")
        return instance_id

    def route_until_best(self, instance_id: str, **body: object) -> dict:
        """Route until `instance_id` wins with a non-zero match (events are asynchronous)."""

        def check() -> dict | None:
            answer = self.http.post("/v1/route", json={**body, "probe": True}).json()
            won = answer.get("instance") == instance_id and answer.get("matched_tokens")
            return answer if won else None

        return wait_for(check, f"kvroute to learn {instance_id}'s prefix")

    def inflight(self) -> dict[tuple[str, int], int]:
        return inflight_counts(self.http)

    def assert_nothing_in_flight(self) -> None:
        wait_for(lambda: not any(self.inflight().values()), "in-flight counts back to zero")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # The tests probe /v1/route without following the answers; placement guesses assume
    # answers are followed, so they are off here (tested in test_api).
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        proxy=True, tokenizer="instance", placement_ttl=0.0)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, stream_interval_s=0.02) as cluster, \
            following(cluster, settings) as http:
        yield Fleet(http, cluster, instance_ids(cluster, http))


def post(fleet: Fleet, path: str, body: dict, **headers: str) -> httpx.Response:
    return fleet.http.post(path, json=body, headers=headers)


def cached_tokens(answer: httpx.Response) -> int:
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# --- routing ------------------------------------------------------------------------------------


def test_completions_land_on_the_instance_holding_the_prefix(fleet: Fleet):
    prompt = unique_tokens(1, 20 * BLOCK + 5)
    fleet.cluster.complete(1, prompt, max_tokens=1)
    fleet.route_until_best(fleet.ids[1], token_ids=prompt)
    rid = request_id()
    answer = post(fleet, "/v1/completions",
                  {"model": "sim-model", "prompt": prompt, "max_tokens": 2},
                  **{"X-Request-Id": rid})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-instance"] == fleet.ids[1]
    assert answer.headers["x-kvroute-dp-rank"] == "0"
    assert answer.headers["x-kvroute-attempts"] == "1"
    assert cached_tokens(answer) == 20 * BLOCK
    assert f"cmpl-{rid}" in fleet.cluster.instances[1].responses
    assert f"cmpl-{rid}" not in fleet.cluster.instances[0].responses

    # A text prompt is tokenized by an instance's /tokenize, as the engine will see it.
    text = "The quick brown fox jumps over the lazy dog. " * 8
    fleet.cluster.complete(0, text, max_tokens=1)
    fleet.route_until_best(fleet.ids[0], prompt=text)
    answer = post(fleet, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-instance"] == fleet.ids[0]
    assert cached_tokens(answer) == (len(text) - 1) // BLOCK * BLOCK
    fleet.assert_nothing_in_flight()


def test_chat_lands_on_the_instance_holding_the_conversation(fleet: Fleet):
    messages = [{"role": "system", "content": "You answer in one word. " * 10},
                {"role": "user", "content": "Which instance holds this conversation?"}]
    warm = httpx.post(f"{fleet.cluster.urls[1]}/v1/chat/completions",
                      json={"messages": messages, "max_tokens": 1}, timeout=HTTP_TIMEOUT)
    assert warm.status_code == 200, warm.text
    prompt_tokens = warm.json()["usage"]["prompt_tokens"]
    fleet.route_until_best(fleet.ids[1], messages=messages)
    answer = post(fleet, "/v1/chat/completions",
                  {"model": "sim-model", "messages": messages, "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-instance"] == fleet.ids[1]
    assert answer.json()["object"] == "chat.completion"
    # the whole conversation was reused (all full blocks but the one holding the last token)
    assert cached_tokens(answer) == (prompt_tokens - 1) // BLOCK * BLOCK > 0


def test_a_batch_of_prompts_is_routed_by_its_first_prompt(fleet: Fleet):
    first, second = unique_tokens(2, 12 * BLOCK), unique_tokens(3, 12 * BLOCK)
    fleet.cluster.complete(0, first, max_tokens=1)
    fleet.route_until_best(fleet.ids[0], token_ids=first)
    answer = post(fleet, "/v1/completions", {"prompt": [first, second], "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-instance"] == fleet.ids[0]
    assert [choice["index"] for choice in answer.json()["choices"]] == [0, 1]
    assert answer.json()["usage"]["prompt_tokens"] == len(first) + len(second)


def test_token_ids_written_as_integral_numbers_are_token_ids(fleet: Fleet):
    """JSON Schema (and vLLM) read 5.0 as the integer 5; kvroute refused it."""
    answer = post(fleet, "/v1/completions", {"prompt": [5.0, 6.0, 7], "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 3
    fraction = post(fleet, "/v1/completions", {"prompt": [5.5], "max_tokens": 1})
    assert fraction.status_code == 400 and fraction.json()["field"] == "prompt[0]"


def test_models_lists_the_union_of_the_registered_instances_models(fleet: Fleet):
    with SimInstance(SimInstanceSpec(model="other-model", num_blocks=64, seed=77)) as other:
        other_id = fleet.register(url=other.url)
        try:
            listing = fleet.http.get("/v1/models").json()
            assert listing["object"] == "list"
            assert sorted(card["id"] for card in listing["data"]) == ["other-model", "sim-model"]
            assert all(card["object"] == "model" and card["owned_by"] == "vllm"
                       for card in listing["data"])
            answer = post(fleet, "/v1/completions",
                          {"model": "other-model", "prompt": [5] * 40, "max_tokens": 1})
            assert answer.status_code == 200 and answer.headers["x-kvroute-instance"] == other_id
        finally:
            fleet.http.delete(f"/v1/instances/{other_id}")
    assert [c["id"] for c in fleet.http.get("/v1/models").json()["data"]] == ["sim-model"]


# --- relaying -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_is_relayed_byte_for_byte(fleet: Fleet, chat: bool):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 6, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "stream it"}]} if chat
               else {"prompt": unique_tokens(4, 3 * BLOCK)})}
    rid = request_id()
    with fleet.http.stream("POST", path, json=body, headers={"X-Request-Id": rid}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        served_by = resp.headers["x-kvroute-instance"]
        relayed = b"".join(resp.iter_raw())
    instance = fleet.cluster.instances[fleet.ids.index(served_by)]
    response_id = ("chatcmpl-" if chat else "cmpl-") + rid
    assert relayed == instance.responses[response_id]  # exactly what the upstream sent
    events = relayed.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 6 + chat + 3
    assert json.loads(events[-3][len(b"data: "):])["usage"]["completion_tokens"] == 6

    # Straight from the instance, the same request streams the same bytes (ids aside).
    again = request_id()
    with httpx.stream("POST", f"{instance.url}{path}", json=body, timeout=HTTP_TIMEOUT,
                      headers={"X-Request-Id": again}) as resp:
        direct = b"".join(resp.iter_raw())

    def comparable(raw: bytes) -> list[object]:
        payloads = [json.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]
        for p in payloads:
            p.pop("id"), p.pop("created")
            p.get("usage", {}).pop("prompt_tokens_details", None)  # the 2nd run hits the cache
        return payloads

    assert comparable(direct) == comparable(relayed)
    fleet.assert_nothing_in_flight()


def test_a_client_that_leaves_mid_stream_aborts_the_upstream_request(fleet: Fleet):
    rid = request_id()
    body = {"prompt": unique_tokens(5, 2 * BLOCK), "max_tokens": 1000, "stream": True}
    with fleet.http.stream("POST", "/v1/completions", json=body,
                           headers={"X-Request-Id": rid}) as resp:
        instance = fleet.cluster.instances[fleet.ids.index(resp.headers["x-kvroute-instance"])]
        aborted_before = instance.aborted
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        # while the stream runs, the proxy counts it against its worker
        assert fleet.inflight()[(resp.headers["x-kvroute-instance"], 0)] == 1
    wait_for(lambda: instance.aborted == aborted_before + 1, "the instance to see the abort")
    sent = instance.responses[f"cmpl-{rid}"]
    assert b"[DONE]" not in sent and sent.count(b"\n\n") < 1000
    fleet.assert_nothing_in_flight()


def test_a_client_that_leaves_before_the_answer_cancels_the_upstream_request():
    # Steps take real time here (time_scale), so a long non-streamed request is still
    # running in the engine when the client gives up.
    cfg = {"block_size": BLOCK, "num_blocks": 128, "time_scale": 1.0}
    with SimInstance(SimInstanceSpec(**cfg)) as inst:
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True)
        with BackgroundServer(settings) as server, \
                httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            fleet = Fleet(http)
            fleet.register(url=inst.url)
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json={"prompt": [7] * 40, "max_tokens": 1500},
                          headers={"X-Request-Id": "impatient"},
                          timeout=httpx.Timeout(10.0, read=0.5))
            wait_for(lambda: inst.aborted == 1, "the instance to see the client go")
            assert inst.responses == {"cmpl-impatient": b""}  # it never answered
            engine = inst.engines[0]
            assert engine.num_running == engine.num_waiting == 0  # the engine dropped it
            fleet.assert_nothing_in_flight()


def test_upstream_errors_come_back_as_they_came(fleet: Fleet):
    body = {"prompt": [1, 2, 40_000], "max_tokens": 1}  # out of the simulator's vocabulary
    direct = httpx.post(f"{fleet.cluster.urls[0]}/v1/completions", json=body, timeout=HTTP_TIMEOUT)
    relayed = post(fleet, "/v1/completions", body)
    assert direct.status_code == relayed.status_code == 400
    assert relayed.content == direct.content
    assert relayed.headers["content-type"] == direct.headers["content-type"]
    too_long = post(fleet, "/v1/completions", {"prompt": [300] * 5000, "max_tokens": 1})
    assert too_long.status_code == 400
    assert "max_model_len" in too_long.json()["error"]["message"]
    fleet.assert_nothing_in_flight()


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"max_tokens": 1}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": [1, "x"]}', 400, "prompt[1]"),
        ("/v1/completions", b'{"prompt": [1, true]}', 400, "prompt[1]"),
        ("/v1/completions", b'{"prompt": [[1, -2]]}', 400, "prompt[0][1]"),
        ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
        # The whole batch is checked, not only the prompt it is routed by; and an empty
        # prompt asks nothing to route.
        ("/v1/completions", b'{"prompt": ["a", 5]}', 400, "prompt[1]"),
        ("/v1/completions", b'{"prompt": ["a", ""]}', 400, "prompt[1]"),
        ("/v1/completions", b'{"prompt": [[1], [2, "x"]]}', 400, "prompt[1][1]"),
        ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "model": 5}', 400, "model"),
        ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404, "model"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages[0].role"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "continue_final_message": '
                                 b'true}', 400, "add_generation_prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "tools": {}}', 400, "tools"),
        ("/v1/chat/completions", b'{"messages": [{"role": 1}]}', 400, "messages[0].role"),
    ],
)
def test_bad_bodies_get_a_clear_error_naming_the_field(fleet: Fleet, path: str, body: bytes,
                                                       status: int, field: str | None):
    answer = fleet.http.post(path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert error["field"] == field and error["error"]
    assert "x-kvroute-instance" not in answer.headers


def test_oversized_bodies_are_refused_before_routing():
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                        max_body_bytes=1024, max_prompt_tokens=8)
    with BackgroundServer(settings) as server:
        answer = httpx.post(f"{server.url}/v1/completions", timeout=HTTP_TIMEOUT,
                            json={"prompt": [1] * 1000})
        assert answer.status_code == 413 and "limit" in answer.json()["error"]
        # Within the body limit, over max_prompt_tokens: refused like any bad prompt, and
        # named as the OpenAI body names it.
        for prompt, field in (([1] * 9, "prompt"), ([[1] * 9, [1]], "prompt[0]")):
            long = httpx.post(f"{server.url}/v1/completions", timeout=HTTP_TIMEOUT,
                              json={"prompt": prompt})
            assert long.status_code == 400 and long.json()["field"] == field, long.text
            assert "<= 8" in long.json()["error"]
        models = httpx.get(f"{server.url}/v1/models", timeout=HTTP_TIMEOUT)
        assert models.json() == {"object": "list", "data": []}
        nobody = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1]},
                            timeout=HTTP_TIMEOUT)
        assert nobody.status_code == 503 and "no registered instance" in nobody.json()["error"]


# --- failures -----------------------------------------------------------------------------------


def test_a_worker_that_refuses_connections_is_retried_elsewhere(fleet: Fleet):
    # "Ghost" workers: their events come from a live simulated engine, so kvroute believes
    # they hold a prefix, but nothing listens at their URL.
    with SimInstance(SimInstanceSpec(block_size=BLOCK, num_blocks=128, seed=99)) as source:
        (events,) = source.kv_event_sources()
        prompt = unique_tokens(6, 16 * BLOCK + 3)
        warm = httpx.post(f"{source.url}/v1/completions",
                          json={"prompt": prompt, "max_tokens": 1}, timeout=HTTP_TIMEOUT)
        assert warm.status_code == 200
        ghosts = []
        models = ["sim-model"] + ["ghost-model"] * (MAX_CONNECT_ATTEMPTS + 1)
        with contextlib.ExitStack() as held:
            urls = held.enter_context(refusing_urls(len(models)))
            held.callback(lambda: [fleet.http.delete(f"/v1/instances/{g}") for g in ghosts])
            for i, (model, url) in enumerate(zip(models, urls, strict=True)):
                ghosts.append(fleet.register(
                    id=f"ghost-{i}", url=url, model=model,
                    block_size=BLOCK, events=[events["endpoint"]],
                    replay=[events["replay_endpoint"]]))
            # ghost-0 is the best of the workers serving sim-model ...
            fleet.route_until_best("ghost-0", token_ids=prompt, model="sim-model")
            # ... so the proxy tries it first, is refused, and goes elsewhere.
            answer = post(fleet, "/v1/completions",
                          {"model": "sim-model", "prompt": prompt, "max_tokens": 1})
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvroute-attempts"] == "2"
            assert answer.headers["x-kvroute-instance"] in fleet.ids

            # Only ghosts serve ghost-model: attempts are bounded, then a clear 503.
            answer = post(fleet, "/v1/completions",
                          {"model": "ghost-model", "prompt": prompt, "max_tokens": 1})
            assert answer.status_code == 503
            message = answer.json()["error"]
            assert f"after {MAX_CONNECT_ATTEMPTS} attempts" in message
            assert message.count("ghost-") == MAX_CONNECT_ATTEMPTS
            fleet.assert_nothing_in_flight()


def test_a_worker_that_dies_gets_no_new_traffic(fleet: Fleet):
    doomed = SimInstance(SimInstanceSpec(block_size=BLOCK, num_blocks=128, seed=123))
    doomed.start()
    doomed_id = None
    try:
        doomed_id = fleet.register(url=doomed.url)
        prompt = unique_tokens(7, 16 * BLOCK)
        httpx.post(f"{doomed.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                   timeout=HTTP_TIMEOUT)
        fleet.route_until_best(doomed_id, token_ids=prompt)
        doomed.stop()
        wait_for(lambda: fleet.http.get(f"/v1/instances/{doomed_id}").json()["state"] == "down",
                 "kvroute to notice the instance went away")
        for _ in range(3):
            answer = post(fleet, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert answer.status_code == 200, answer.text
            # not chosen at all: the first connection attempt already went elsewhere
            assert answer.headers["x-kvroute-attempts"] == "1"
            assert answer.headers["x-kvroute-instance"] in fleet.ids
        fleet.assert_nothing_in_flight()
    finally:
        doomed.stop()
        if doomed_id is not None:
            fleet.http.delete(f"/v1/instances/{doomed_id}")


def test_the_data_parallel_rank_is_passed_as_vllm_reads_it(fleet: Fleet):
    cfg = SimInstanceSpec(block_size=BLOCK, num_blocks=128, dp_size=2, seed=55)
    with SimInstance(cfg) as inst:
        instance_id = fleet.register(url=inst.url)
        try:
            prompt = unique_tokens(8, 10 * BLOCK + 1)
            warm = httpx.post(f"{inst.url}/v1/completions", timeout=HTTP_TIMEOUT,
                              json={"prompt": prompt, "max_tokens": 1},
                              headers={"X-data-parallel-rank": "1"})
            assert warm.status_code == 200
            fleet.route_until_best(instance_id, token_ids=prompt)
            # the client's own rank header is replaced by the routing decision
            answer = post(fleet, "/v1/completions", {"prompt": prompt, "max_tokens": 1},
                          **{"X-data-parallel-rank": "0"})
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvroute-instance"] == instance_id
            assert answer.headers["x-kvroute-dp-rank"] == "1"
            assert cached_tokens(answer) == 10 * BLOCK  # rank 1 served it: rank 0 holds nothing
            assert inst.engines[0].lookup(prompt) == 0
        finally:
            fleet.http.delete(f"/v1/instances/{instance_id}")


def test_the_clients_credentials_reach_the_instance(fleet: Fleet):
    cfg = SimInstanceSpec(block_size=BLOCK, num_blocks=64, seed=66, model="guarded-model",
                         api_key="s3cret")
    with SimInstance(cfg) as inst:
        unkeyed = fleet.http.post("/v1/instances", json={"url": inst.url})
        assert unkeyed.status_code == 502 and "401" in unkeyed.json()["error"]
        instance_id = fleet.register(url=inst.url, api_key="s3cret")
        assert "s3cret" not in fleet.http.get(f"/v1/instances/{instance_id}").text
        try:
            body = {"model": "guarded-model", "prompt": [9] * 20, "max_tokens": 1}
            refused = post(fleet, "/v1/completions", body)
            assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
            answer = post(fleet, "/v1/completions", body, authorization="Bearer s3cret")
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvroute-instance"] == instance_id
        finally:
            fleet.http.delete(f"/v1/instances/{instance_id}")


class BreaksMidStream:
    """An upstream whose completions start a streamed answer, send one event and drop the
    connection. Anything else (kvroute's load scrapes of /metrics) gets a 404, so the one
    completion the test sends is always the one that breaks."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.completions = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed: done
            while True:
                conn, _ = self.listener.accept()
                with conn:
                    self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(scaled(30))
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = conn.recv(65536)
            if not chunk:
                return
            request += chunk
        if not request.startswith(b"POST /v1/completions "):
            conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n"
                         b"connection: close\r\n\r\n")
            return
        self.completions += 1
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n"
                     b"f\r\ndata: {\"a\":1}\n\n\r\n")
        time.sleep(0.2)

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would not.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(scaled(30))
        assert not self.thread.is_alive()


def test_an_upstream_that_breaks_mid_stream_is_not_passed_off_as_complete(fleet: Fleet):
    with SimInstance(SimInstanceSpec(block_size=BLOCK, num_blocks=64, seed=88)) as source:
        (events,) = source.kv_event_sources()
        broken = BreaksMidStream()
        instance_id = None
        try:
            instance_id = fleet.register(id="broken", url=broken.url, model="broken-model",
                                         block_size=BLOCK, events=[events["endpoint"]],
                                         replay=[events["replay_endpoint"]])
            received = b""
            with pytest.raises(httpx.RemoteProtocolError), fleet.http.stream(
                    "POST", "/v1/completions",
                    json={"model": "broken-model", "prompt": [1, 2, 3], "stream": True}) as resp:
                assert resp.status_code == 200
                for chunk in resp.iter_raw():
                    received += chunk
            assert received == b'data: {"a":1}\n\n'  # what came before the break, then an error
            assert broken.completions == 1
            fleet.assert_nothing_in_flight()
        finally:
            broken.close()
            if instance_id is not None:
                fleet.http.delete(f"/v1/instances/{instance_id}")
