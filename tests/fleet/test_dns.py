"""Fleets: a DNS name whose addresses are the instances (a Kubernetes headless Service).

The name is resolved by a resolver the test controls (no DNS, no network): its answer is
changed between refreshes, and kvroute must follow with real simulated vLLM instances,
each on its own loopback address and the same port, as pods behind one Service are.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvroute.app.config import ConfigError, FleetConfig, InstanceConfig, Settings, load_settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.instance import SimInstance
from kvroute.sim.spec import SimInstanceSpec
from tests.support.metrics import metric
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16
ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
NAME = "vllm-headless.test"


class Answers:
    """What NAME resolves to now: a list of addresses, or an OSError to raise. Set from the
    test's thread, read on kvroute's loop; `asked` counts the resolutions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answer: list[str] | Exception = []
        self.asked = 0
        self.names: set[tuple[str, int]] = set()

    def set(self, answer: list[str] | Exception) -> None:
        with self._lock:
            self._answer = answer

    async def resolve(self, host: str, port: int) -> list[str]:
        await asyncio.sleep(0)  # a coroutine, as the real one is
        with self._lock:
            self.asked += 1
            self.names.add((host, port))
            answer = self._answer
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    def wait_for_more(self, n: int = 2) -> None:
        """Until `n` more resolutions have happened (so the current answer was seen)."""
        start = self.asked
        wait_for(lambda: self.asked >= start + n, f"{n} more resolutions")


@pytest.fixture(scope="module")
def pods() -> Iterator[tuple[int, list[SimInstance]]]:
    """Three simulated vLLM instances on 127.0.0.2-4, all on one HTTP port."""
    for _attempt in range(10):
        started: list[SimInstance] = []
        try:
            for address in ADDRESSES:
                port = int(started[0].url.rsplit(":", 1)[1]) if started else 0
                instance = SimInstance(SimInstanceSpec(block_size=BLOCK, num_blocks=128,
                                                       host=address, http_port=port))
                instance.start()
                started.append(instance)
        except OSError:  # the first one's port is taken on another address: try another
            for instance in started:
                instance.stop()
            continue
        try:
            yield int(started[0].url.rsplit(":", 1)[1]), started
        finally:
            for instance in started:
                instance.stop()
        return
    pytest.fail("could not start three simulated instances on one port")


def member(address: str) -> str:
    return f"vllm@{address}"


def instances(http: httpx.Client) -> dict[str, dict]:
    return {i["id"]: i for i in http.get("/v1/instances").json()["instances"]}


def fleet_status(http: httpx.Client) -> dict:
    (status,) = http.get("/v1/instances").json()["fleets"]
    return status


def live_members(http: httpx.Client) -> set[str]:
    return {i for i, body in instances(http).items() if body["state"] == "live"}


@contextlib.contextmanager
def following(port: int, answers: Answers) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", load_interval=0,
                        placement_ttl=0, dns_refresh_seconds=0.1,
                        fleets=(FleetConfig(url=f"http://{NAME}:{port}", id="vllm"),))
    with BackgroundServer(settings, resolver=answers.resolve) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        yield server, http


def test_a_fleet_follows_its_name_as_addresses_come_go_and_fail(
        pods: tuple[int, list[SimInstance]]) -> None:
    port, sims = pods
    answers = Answers()
    answers.set(ADDRESSES[:2])
    with following(port, answers) as (server, http):
        # Two addresses: two instances, discovered by URL, live, named <fleet>@<address>.
        wait_for(lambda: live_members(http) == {member(a) for a in ADDRESSES[:2]},
                 "both members live", detail=lambda: instances(http))
        first = instances(http)[member("127.0.0.2")]
        assert first["url"] == f"http://127.0.0.2:{port}"
        assert first["fleet"] == "vllm"
        assert answers.names == {(NAME, port)}
        assert fleet_status(http)["addresses"] == ADDRESSES[:2]
        assert http.get("/readyz").status_code == 200

        # What 127.0.0.2 caches reaches the index through its own subscriber.
        prompt = list(range(1000, 1000 + 4 * BLOCK))
        assert httpx.post(f"{sims[0].url}/v1/completions", timeout=HTTP_TIMEOUT, json={
            "model": "sim-model", "prompt": prompt, "max_tokens": 1}).status_code == 200
        wait_for(lambda: http.get(f"/v1/instances/{member('127.0.0.2')}").json()[
            "workers"][0]["holdings"]["GPU"] >= 4, "127.0.0.2's blocks indexed")
        routed = http.post("/v1/route", json={"token_ids": prompt}).json()
        assert routed["instance"] == member("127.0.0.2") and routed["matched_blocks"] == 3

        # An unchanged answer changes nothing: the same instance objects, not restarted.
        kept = {i: server.service.registry.get(i) for i in instances(http)}
        answers.wait_for_more()
        assert set(instances(http)) == set(kept)
        assert all(kept[i] is server.service.registry.get(i) for i in kept)

        # A new address: a new instance; the others stay as they were.
        answers.set(ADDRESSES)
        wait_for(lambda: live_members(http) == {member(a) for a in ADDRESSES},
                 "the third member live", detail=lambda: instances(http))
        assert all(kept[i] is server.service.registry.get(i) for i in kept)

        # An address gone: its instance leaves, with its subscriber and its index entries.
        answers.set(ADDRESSES[1:])
        wait_for(lambda: set(instances(http)) == {member(a) for a in ADDRESSES[1:]},
                 "127.0.0.2 removed", detail=lambda: instances(http))
        gone = kept[member("127.0.0.2")]
        # (The registry forgets it first, then stops its subscriber and drops its entries.)
        wait_for(lambda: all(w.task is not None and w.task.done() for w in gone.workers),
                 "its subscriber stopped")
        assert http.get(f"/v1/instances/{member('127.0.0.2')}").status_code == 404
        rerouted = http.post("/v1/route", json={"token_ids": prompt}).json()
        assert rerouted["matched_blocks"] == 0
        assert {s["instance"] for s in rerouted["scores"]} == {member(a) for a in ADDRESSES[1:]}
        # Nothing of it is left: no holdings, no state, no counters.
        assert f'instance="{member("127.0.0.2")}"' not in http.get("/metrics").text
        assert metric(http, "kvroute_fleet_members", None, fleet="vllm") == 2.0

        # A failed resolution keeps the last known members and says why.
        answers.set(OSError("[Errno -2] Name or service not known"))
        wait_for(lambda: "error" in fleet_status(http), "the error reported")
        status = fleet_status(http)
        assert "Name or service not known" in status["error"] and NAME in status["error"]
        assert status["resolve_failures"] >= 1
        assert status["instances"] == [member(a) for a in ADDRESSES[1:]]
        assert live_members(http) == {member(a) for a in ADDRESSES[1:]}
        assert metric(http, "kvroute_fleet_ok", None, fleet="vllm") == 0.0
        failures = metric(http, "kvroute_fleet_resolve_failures_total", None, fleet="vllm")
        assert failures is not None and failures >= 1
        # ... as does an answer with no address at all.
        answers.set([])
        answers.wait_for_more()
        assert fleet_status(http)["error"].endswith("the name resolved to no address")
        assert live_members(http) == {member(a) for a in ADDRESSES[1:]}

        # Resolving again clears the error, and follows the answer.
        answers.set(ADDRESSES[:1])
        wait_for(lambda: live_members(http) == {member("127.0.0.2")}
                 and "error" not in fleet_status(http), "recovered",
                 detail=lambda: (instances(http), fleet_status(http)))
        assert metric(http, "kvroute_fleet_ok", None, fleet="vllm") == 1.0

        # A member cannot be deleted through the API: the next refresh would add it back.
        refused = http.delete(f"/v1/instances/{member('127.0.0.2')}")
        assert refused.status_code == 409 and refused.json()["field"] == "instance_id"
        assert "fleet" in refused.json()["error"]


def test_a_fleet_that_never_resolved_keeps_readiness_waiting(
        pods: tuple[int, list[SimInstance]]) -> None:
    port, _ = pods
    answers = Answers()
    answers.set(OSError("[Errno -3] Temporary failure in name resolution"))
    with following(port, answers) as (_, http):
        answers.wait_for_more()
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert f"fleet vllm: resolving {NAME}" in ready.json()["reason"]
        assert "Temporary failure" in ready.json()["reason"]
        assert instances(http) == {}
        answers.set(ADDRESSES[2:])
        wait_for(lambda: http.get("/readyz").status_code == 200, "ready once resolved")
        assert live_members(http) == {member("127.0.0.4")}


def test_a_refresh_that_fails_unexpectedly_does_not_end_the_following(
        pods: tuple[int, list[SimInstance]]) -> None:
    port, _ = pods
    answers = Answers()
    answers.set(RuntimeError("a resolver bug"))
    with following(port, answers) as (_, http):
        wait_for(lambda: "error" in fleet_status(http), "the failure reported")
        assert fleet_status(http)["error"] == "refresh failed: RuntimeError"
        answers.set(ADDRESSES[2:])  # the next refreshes still run
        wait_for(lambda: live_members(http) == {member("127.0.0.4")}
                 and "error" not in fleet_status(http), "following again",
                 detail=lambda: (instances(http), fleet_status(http)))


def test_an_address_taken_by_a_configured_instance_is_reported(
        pods: tuple[int, list[SimInstance]]) -> None:
    port, sims = pods
    answers = Answers()
    answers.set(ADDRESSES[:2])
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", load_interval=0,
                        dns_refresh_seconds=0.1, instances=(
                            InstanceConfig(url=sims[0].url, id=member("127.0.0.2")),),
                        fleets=(FleetConfig(url=f"http://{NAME}:{port}", id="vllm"),))
    with BackgroundServer(settings, resolver=answers.resolve) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        wait_for(lambda: "error" in fleet_status(http), "the clash reported")
        status = fleet_status(http)
        assert "registered under that id already" in status["error"]
        assert status["instances"] == [member("127.0.0.3")]
        assert instances(http)[member("127.0.0.2")].get("fleet") is None


def test_fleets_come_from_the_file_the_environment_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "kvroute.toml"
    config.write_text('dns_refresh_seconds = 5\n[[fleets]]\n'
                      'url = "http://vllm.default.svc:8000/"\nid = "gpu"\nmodel = "m"\n')
    settings = load_settings(config, environ={"KVROUTE_FLEETS": "http://b.svc:8000,",
                                              "KVROUTE_DNS_REFRESH_SECONDS": "2.5"},
                             flags={"fleets": [{"url": "https://c.svc"}]})
    assert [(f.url, f.id, f.model) for f in settings.fleets] == [
        ("http://vllm.default.svc:8000", "gpu", "m"), ("http://b.svc:8000", "b.svc", None),
        ("https://c.svc", "c.svc", None)]
    assert settings.dns_refresh_seconds == 2.5
    with pytest.raises(ConfigError, match=r"fleets\[0\]\.url: .* is not an http"):
        load_settings(environ={"KVROUTE_FLEETS": "http://a.svc:8000/v1"})
    with pytest.raises(ConfigError, match=r"fleets\[0\]\.id: must be printable ASCII"):
        load_settings(flags={"fleets": [{"url": "http://a.svc", "id": "a/b"}]})
    with pytest.raises(ConfigError, match=r"fleets\[0\]\.events: unknown setting"):
        load_settings(flags={"fleets": [{"url": "http://a.svc", "events": ["tcp://a:1"]}]})
    with pytest.raises(ConfigError, match="fleet id.* a.svc configured more than once"):
        load_settings(environ={"KVROUTE_FLEETS": "http://a.svc:1,http://a.svc:2"})
    with pytest.raises(ConfigError, match="dns_refresh_seconds"):
        load_settings(environ={"KVROUTE_DNS_REFRESH_SECONDS": "0"})
