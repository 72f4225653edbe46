"""Registration is validated: how many instances, which event endpoints, which models.

An instance's KV events decide where prompts go, so kvroute takes them only from the
instance's own host (or hosts the operator allows), and its models from the instance's
own /v1/models, never from what the registration claims.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from kvroute.sim.instance import SimInstance
from kvroute.sim.publisher import EventPublisher
from kvroute.sim.spec import SimInstanceSpec
from tests.support.canned_http import canned_http
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    with SimCluster(n=2, block_size=BLOCK, num_blocks=64, model="sim-model") as sim:
        yield sim


def served(**overrides: object) -> BackgroundServer:
    return BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning",
                                     **overrides))


def client_of(server: BackgroundServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT)


def test_one_instance_past_max_instances_is_refused_until_one_leaves(cluster: SimCluster):
    with served(max_instances=1) as server, client_of(server) as http:
        first = http.post("/v1/instances", json={"url": cluster.urls[0]})
        assert first.status_code == 201, first.text
        second = http.post("/v1/instances", json={"url": cluster.urls[1]})
        assert second.status_code == 409
        assert second.json()["field"] == "url" and "max_instances" in second.json()["error"]
        assert [i["id"] for i in http.get("/v1/instances").json()["instances"]] == [
            first.json()["id"]]
        assert http.delete(f"/v1/instances/{first.json()['id']}").status_code == 200
        assert http.post("/v1/instances", json={"url": cluster.urls[1]}).status_code == 201


def test_explicit_endpoints_on_another_host_are_refused_unless_allowed():
    # 127.0.0.2 is loopback too, but another host as written: the comparison is textual.
    body = {"id": "a", "url": "http://127.0.0.1:9", "events": ["tcp://127.0.0.2:5557"]}
    with served() as server, client_of(server) as http:
        # Well-formed, and not allowed by the operator's configuration: 403.
        refused = http.post("/v1/instances", json=body)
        assert refused.status_code == 403
        assert refused.json()["field"] == "events"
        assert "tcp://127.0.0.2:5557" in refused.json()["error"]
        replay = {**body, "events": ["tcp://127.0.0.1:5557"], "replay": ["tcp://127.0.0.2:1"]}
        assert http.post("/v1/instances", json=replay).status_code == 403
        assert http.get("/v1/instances").json()["instances"] == []
    with served(zmq_endpoint_hosts=("127.0.0.2",)) as server, client_of(server) as http:
        allowed = http.post("/v1/instances", json=body)
        assert allowed.status_code == 201, allowed.text


def test_endpoints_without_a_url_are_the_instance():
    with EventPublisher() as events, served() as server, client_of(server) as http:
        answer = http.post("/v1/instances", json={"id": "bare", "events": [events.endpoint]})
        assert answer.status_code == 201, answer.text
        wait_for(lambda: http.get("/v1/instances/bare").json()["state"] == "live", "live")


def sources(endpoint: str) -> str:
    return json.dumps([{"endpoint": endpoint, "enable_kv_cache_events": True,
                        "publisher": "zmq", "topic": ""}])


MODELS = json.dumps({"object": "list", "data": [{"id": "real-model", "object": "model"}]})


def test_discovered_endpoints_on_another_host_are_refused():
    routes = {"/kv_event_sources": (200, sources("tcp://127.0.0.2:5557")),
              "/v1/models": (200, MODELS)}
    with canned_http(routes) as url, served() as server, client_of(server) as http:
        refused = http.post("/v1/instances", json={"url": url})
        assert refused.status_code == 502
        assert refused.json()["field"] == "url"
        assert "tcp://127.0.0.2:5557" in refused.json()["error"]
        assert "zmq_endpoint_hosts" in refused.json()["error"]
        # A wildcard bind address is the instance's own host.
        routes["/kv_event_sources"] = (200, sources("tcp://*:5557"))
        answer = http.post("/v1/instances", json={"url": url})
        assert answer.status_code == 201, answer.text
        assert answer.json()["workers"][0]["events_endpoint"] == "tcp://127.0.0.1:5557"


def test_models_come_from_the_instance_not_the_registration(cluster: SimCluster):
    with served() as server, client_of(server) as http:
        # The instance answers and contradicts the registration: a conflict with its state
        # (409), not a failing instance (502); it can succeed once the instance serves it.
        claimed = http.post("/v1/instances", json={"url": cluster.urls[0], "model": "gpt-9"})
        assert claimed.status_code == 409 and claimed.json()["field"] == "model"
        assert "gpt-9" in claimed.json()["error"] and "sim-model" in claimed.json()["error"]
        named = http.post("/v1/instances", json={"url": cluster.urls[0], "model": "sim-model"})
        assert named.status_code == 201, named.text
        assert named.json()["models"] == ["sim-model"]


def test_explicit_endpoints_take_their_models_from_the_instance_when_it_answers():
    spec = SimInstanceSpec(block_size=BLOCK, num_blocks=64, model="sim-model")
    with SimInstance(spec) as sim, served() as server, client_of(server) as http:
        (sources,) = sim.kv_event_sources()
        body = {"url": sim.url, "events": [sources["endpoint"]],
                "replay": [sources["replay_endpoint"]]}
        claimed = http.post("/v1/instances", json={**body, "model": "gpt-9"})
        assert claimed.status_code == 409 and "sim-model" in claimed.json()["error"]
        answer = http.post("/v1/instances", json=body)
        assert answer.status_code == 201, answer.text
        assert answer.json()["models"] == ["sim-model"]
    # Whose HTTP server does not answer: the registration's model stands.
    with EventPublisher() as events, served() as server, client_of(server) as http:
        answer = http.post("/v1/instances", json={"url": "http://127.0.0.1:9", "model": "m",
                                                  "events": [events.endpoint]})
        assert answer.status_code == 201, answer.text
        assert answer.json()["models"] == ["m"]
