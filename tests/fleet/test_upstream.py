"""A slow, huge or hostile instance answer costs a bounded wait and a bounded buffer:
the bounded fetch refuses it, discovery and text routing fail with a JSON error instead
of hanging, and the load scraper leaves routes answering. Everything through real sockets,
against a hostile HTTP server on a free loopback port."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.fleet.upstream import DISCOVERY_MAX_BYTES, UpstreamError, fetch
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from kvroute.sim.publisher import EventPublisher
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, run_async, wait_for

# In every hostile answer, so a test can tell the instance's bytes were not echoed.
MARK = b"HOSTILE-BYTES"
DRIP_INTERVAL = 0.2
DRIP_BYTES = 1000  # a drip would take 200 s to finish: any deadline here ends it first


@dataclass(frozen=True)
class Answer:
    """How the hostile server answers one path. `kind`: "ok" (status and body), "huge"
    (`size` bytes of body, declared or not), "drip" (headers, then the body one byte per
    DRIP_INTERVAL), "stall" (a status line, then header bytes one at a time, never ending),
    "garbage" (not HTTP), "gzip" (a compressed body the client did not ask for)."""

    kind: str
    status: int = 200
    body: bytes = b""
    size: int = 0
    declared: bool = True


def ok(payload: object) -> Answer:
    return Answer("ok", body=json.dumps(payload).encode())


@contextmanager
def hostile_http(routes: dict[str, Answer]) -> Iterator[str]:
    """Serve `routes` (path -> Answer; unknown paths: 404) on a free loopback port; yields
    the base URL. On exit every connection's thread stops writing and the server closes."""
    stopping = threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            try:
                self._answer()
            except OSError:  # the client gave up: what a refusal looks like from here
                pass

        def _answer(self) -> None:
            request_line = self.rfile.readline(8192).decode("latin-1")
            length = 0
            while (line := self.rfile.readline(8192)) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            self.rfile.read(length)
            path = request_line.split(" ")[1] if request_line.count(" ") >= 2 else "/"
            answer = routes.get(path, Answer("ok", 404, b"not found"))
            send = self.wfile.write
            if answer.kind == "ok":
                # One request per connection: the client must not reuse it.
                send(b"HTTP/1.1 %d X\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (answer.status, len(answer.body), answer.body))
            elif answer.kind == "huge":
                length_header = b"Content-Length: %d\r\n" % answer.size if answer.declared \
                    else b"Connection: close\r\n"
                send(b"HTTP/1.1 200 OK\r\n" + length_header + b"\r\n")
                chunk = (MARK * (65536 // len(MARK) + 1))[:65536]
                for _ in range(answer.size // len(chunk)):
                    if stopping.is_set():
                        return
                    send(chunk)
            elif answer.kind == "drip":
                send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % DRIP_BYTES)
                self._drip((MARK * DRIP_BYTES)[:DRIP_BYTES])
            elif answer.kind == "stall":
                send(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                self._drip((MARK * DRIP_BYTES)[:DRIP_BYTES])
            elif answer.kind == "garbage":
                send(b"HTTP/1.1 2x0 " + MARK + b"\r\n\r\n")
            elif answer.kind == "gzip":
                send(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(MARK), MARK))

        def _drip(self, data: bytes) -> None:
            for byte in data:
                if stopping.wait(DRIP_INTERVAL):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


# --- the bounded fetch --------------------------------------------------------------------

LIMIT = 64 * 1024
DEADLINE = 2.0

HOSTILE = {
    "huge, declared": (Answer("huge", size=8 * LIMIT), "too_large", f"{LIMIT} bytes"),
    "huge, streamed": (Answer("huge", size=8 * LIMIT, declared=False), "too_large",
                       f"{LIMIT} bytes"),
    "dripping body": (Answer("drip"), "too_slow", f"{DEADLINE:g} s deadline"),
    "headers never finishing": (Answer("stall"), "too_slow", f"{DEADLINE:g} s deadline"),
    "not HTTP": (Answer("garbage"), "broken", "RemoteProtocolError"),
    "compressed, not asked": (Answer("gzip"), "broken", "compressed"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_bounded_fetch_refuses_each_hostile_answer_without_echoing_it(case: str):
    answer, kind, limit = HOSTILE[case]

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            with pytest.raises(UpstreamError) as caught:
                await fetch(client, "GET", f"{url}/metrics?x=1", max_bytes=LIMIT,
                            deadline=DEADLINE)
        error = caught.value
        assert error.kind == kind
        assert str(error).startswith("GET /metrics failed: ") and limit in str(error)
        assert MARK.decode() not in str(error) and "HOSTILE" not in repr(error.args)

    with hostile_http({"/metrics?x=1": answer}) as url:
        run_async(scenario, timeout=60)


def test_the_bounded_fetch_returns_any_status_with_its_body_and_names_connect_errors(
        dead_url: str):
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            found = await fetch(client, "POST", f"{url}/tokenize", json={"prompt": "x"},
                                max_bytes=LIMIT, deadline=DEADLINE)
            missing = await fetch(client, "GET", f"{url}/nowhere", max_bytes=LIMIT,
                                  deadline=DEADLINE)
            exact = await fetch(client, "GET", f"{url}/exact", max_bytes=LIMIT,
                                deadline=DEADLINE)
            with pytest.raises(UpstreamError, match="GET /v1/models failed: ConnectError") as dead:
                await fetch(client, "GET", f"{dead_url}/v1/models", max_bytes=LIMIT,
                            deadline=DEADLINE)
        assert (found.status, json.loads(found.body)) == (200, {"tokens": [1, 2]})
        assert (missing.status, missing.body) == (404, b"not found")
        assert exact.status == 200 and len(exact.body) == LIMIT  # the limit itself is allowed
        assert dead.value.kind == "unreachable"

    with hostile_http({"/tokenize": ok({"tokens": [1, 2]}),
                       "/exact": Answer("ok", body=b"x" * LIMIT)}) as url:
        run_async(scenario, timeout=60)


# --- through the service ------------------------------------------------------------------

SOURCES = {"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                 "topic": "kv-events"}}


def start_service(**overrides: object) -> BackgroundServer:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        **{"placement_ttl": 0.0, **overrides})
    return BackgroundServer(settings).start()


@pytest.mark.parametrize(("routes", "path", "limit"), [
    ({"/kv_event_sources": Answer("huge", size=4 * DISCOVERY_MAX_BYTES, declared=False)},
     "/kv_event_sources", f"{DISCOVERY_MAX_BYTES} bytes"),
    ({"/kv_event_sources": ok(SOURCES), "/v1/models": Answer("drip")},
     "/v1/models", "s deadline"),
], ids=["huge /kv_event_sources", "dripping /v1/models"])
def test_registering_a_hostile_instance_is_a_json_error_not_a_hang(routes, path, limit):
    server = start_service()
    try:
        with hostile_http(routes) as url, httpx.Client(base_url=server.url,
                                                       timeout=HTTP_TIMEOUT) as client:
            answer = client.post("/v1/instances", json={"url": url})
            assert answer.status_code == 502, answer.text
            error = answer.json()
            assert error["field"] == "url"
            assert f"GET {path} failed" in error["error"] and limit in error["error"]
            assert MARK.decode() not in answer.text
            assert client.get("/v1/instances").json()["instances"] == []
    finally:
        server.stop()


@contextmanager
def live_instance_at(client: httpx.Client, url: str, instance_id: str) -> Iterator[None]:
    """Register `url` as a live instance whose events come from a simulated publisher, so
    kvroute asks its HTTP server (/tokenize, /metrics) like any other."""
    with EventPublisher() as events:
        answer = client.post("/v1/instances", json={
            "id": instance_id, "url": url, "model": "sim-model",
            "events": [events.endpoint], "replay": [events.replay_endpoint]})
        assert answer.status_code == 201, answer.text
        wait_for(lambda: client.get(f"/v1/instances/{instance_id}").json()["state"] == "live",
                 f"{instance_id}'s events to go live")
        yield


@pytest.mark.parametrize(("tokenize", "status"), [
    (Answer("drip"), 502),
    (Answer("huge", size=64 * 1024 * 1024, declared=False), 413),
    (Answer("ok", 400, MARK + b" is no vLLM error answer"), 400),
    (Answer("ok", 500, MARK), 502),
], ids=["dripping /tokenize", "huge /tokenize", "400 not JSON", "500"])
def test_a_text_prompt_tokenized_by_a_hostile_instance_is_refused_not_held(tokenize, status):
    """A drip is the instance's failure (502, after the tokenizer's deadline); an answer
    larger than max_prompt_tokens tokens can be is the prompt's (413), as counting would."""
    server = start_service(tokenizer="instance", max_prompt_tokens=4096, load_interval=0)
    try:
        with hostile_http({"/tokenize": tokenize}) as url, httpx.Client(
                base_url=server.url, timeout=HTTP_TIMEOUT) as client, \
                live_instance_at(client, url, "hostile"):
            answer = client.post("/v1/route", json={"prompt": "hello there", "probe": True})
            assert answer.status_code == status, answer.text
            error = answer.json()
            assert error["field"] == "prompt" and "/tokenize" in error["error"]
            assert MARK.decode() not in answer.text
    finally:
        server.stop()


def test_only_the_message_of_a_vllm_error_answer_reaches_the_client():
    server = start_service(tokenizer="instance", load_interval=0)
    refusal = {"error": {"message": "'messages' must be a non-empty list", "code": 400},
               "internal": MARK.decode()}
    try:
        with hostile_http({"/tokenize": Answer("ok", 400, json.dumps(refusal).encode())}) \
                as url, httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client, \
                live_instance_at(client, url, "refuses"):
            answer = client.post("/v1/route", json={"prompt": "hello there", "probe": True})
            assert answer.status_code == 400, answer.text
            assert "'messages' must be a non-empty list" in answer.json()["error"]
            assert MARK.decode() not in answer.text
    finally:
        server.stop()


@pytest.mark.parametrize("metrics", [
    Answer("drip"), Answer("stall"), Answer("huge", size=64 * 1024 * 1024, declared=False),
], ids=["dripping", "headers never finishing", "huge"])
def test_routes_keep_answering_while_an_instances_metrics_are_hostile(metrics: Answer):
    with SimCluster(n=1, block_size=16, num_blocks=64) as sim, \
            hostile_http({"/metrics": metrics}) as url:
        server = start_service(load_interval=0.2)
        try:
            with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client, \
                    live_instance_at(client, url, "hostile"):
                healthy = client.post("/v1/instances", json={"url": sim.urls[0]})
                assert healthy.status_code == 201, healthy.text
                healthy_id = healthy.json()["id"]
                wait_for(lambda: client.get(f"/v1/instances/{healthy_id}").json()["state"]
                         == "live", "the healthy instance to go live")
                monitor = server.service.load
                reason = wait_for(lambda: monitor.failure("hostile"),
                                  "the scraper to record the hostile instance's failure")
                assert reason.startswith("GET /metrics failed: ")
                assert MARK.decode() not in reason
                # Operators see it in the instance list.
                listed = wait_for(lambda: client.get("/v1/instances/hostile").json().get(
                    "load_error"), "the instance detail to show the scrape failure")
                assert listed.startswith("GET /metrics failed: ")

                prompt = unique_tokens(4242, 40)
                for _ in range(30):
                    answer = client.post("/v1/route", json={"token_ids": prompt, "probe": True})
                    assert answer.status_code == 200, answer.text
                    assert {s["instance"] for s in answer.json()["scores"]} == {
                        healthy_id, "hostile"}

                def loads() -> dict[str, object]:
                    scores = client.post("/v1/route", json={"token_ids": prompt,
                                                            "probe": True}).json()["scores"]
                    return {s["instance"]: s["load"]["kv_usage"] for s in scores}

                # The healthy instance is still read; the hostile one has no reading.
                wait_for(lambda: loads()[healthy_id] is not None,
                         "the healthy instance's load to be read", detail=loads)
                assert loads()["hostile"] is None and monitor.failure("hostile")
        finally:
            server.stop()

