"""Replicas of kvroute sharing through Valkey: real kvroute servers over HTTP, following the
same simulated vLLM instances, and a real redis-server on a unix socket (never mocked).

What one replica decides shows in the other's answers (placement guesses, load); a cold
burst through both lands on one instance; losing the server leaves each replica routing
alone, still ready, and sharing resumes when it returns. Nothing here asserts speed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from kvroute.app.config import InstanceConfig, Settings, default_instance_id
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.metrics import metric
from tests.support.redis_server import RedisServer, running
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16


@pytest.fixture
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from running(RedisServer(tmp_path_factory.mktemp("valkey")))


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    with SimCluster(n=2, block_size=BLOCK, num_blocks=512, model="sim-model") as sim:
        yield sim


def replica(cluster: SimCluster, state_url: str, **overrides: object) -> BackgroundServer:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        instances=tuple(InstanceConfig(url=url) for url in cluster.urls),
                        state_url=state_url, **overrides)  # type: ignore[arg-type]
    server = BackgroundServer(settings).start()
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, "the replica to be ready")
    return server


def scores_of(answer: dict) -> dict[str, dict]:
    return {s["instance"]: s for s in answer["scores"]}


class Replicas:
    """Two kvroute replicas over the same instances and the same Valkey."""

    def __init__(self, cluster: SimCluster, state_url: str, **overrides: object) -> None:
        self._stack = ExitStack()
        self.servers = [replica(cluster, state_url, **overrides) for _ in range(2)]
        for server in self.servers:
            self._stack.callback(server.stop)
        self.a, self.b = (self._stack.enter_context(
            httpx.Client(base_url=s.url, timeout=HTTP_TIMEOUT)) for s in self.servers)

    def close(self) -> None:
        self._stack.close()

    def wait_until_sharing(self) -> None:
        for http in (self.a, self.b):
            wait_for(lambda http=http: metric(http, "kvroute_valkey_connected") == 1
                     and metric(http, "kvroute_peers") == 1, "the replicas to hear each other")


@pytest.fixture
def replicas(cluster: SimCluster, valkey: RedisServer) -> Iterator[Replicas]:
    # load_interval: route answers count as load until a later reading of the instance's
    # metrics; 100 s keeps them counted for the whole test.
    pair = Replicas(cluster, valkey.url(), load_interval=100.0)
    try:
        pair.wait_until_sharing()
        yield pair
    finally:
        pair.close()


def route(http: httpx.Client, tokens: list[int], *, probe: bool) -> dict:
    answer = http.post("/v1/route", json={"token_ids": tokens, "probe": probe})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_guess_and_the_load_of_one_replica_count_in_the_other(replicas: Replicas):
    prompt = unique_tokens(11, 6 * BLOCK + 5)
    chosen = route(replicas.a, prompt, probe=False)["instance"]  # A guesses, and counts it

    def seen_at_b() -> dict | None:
        score = scores_of(route(replicas.b, prompt, probe=True))[chosen]
        return score if score["pending_blocks"] == 6 and score["load"]["answered"] else None

    score = wait_for(seen_at_b, "A's guess and answer in B's scores")
    assert score["matched_tokens"] == 6 * BLOCK and score["load"]["answered"] == 1
    assert score["load"]["queued_prefill"] == len(prompt)  # A's answer: all of it uncached
    other = next(s for name, s in scores_of(route(replicas.b, prompt, probe=True)).items()
                 if name != chosen)
    assert other["load"]["answered"] == 0 and other["pending_blocks"] == 0
    assert metric(replicas.b, "kvroute_peer_guesses_total") >= 1
    assert metric(replicas.b, "kvroute_peer_load_updates_total") >= 1

    # A replica that stops: the other no longer counts its load once it has gone quiet.
    replicas.servers[0].stop()
    wait_for(lambda: scores_of(route(replicas.b, prompt, probe=True))[chosen]["load"]
             ["answered"] == 0, "A's load to run out at B")
    assert metric(replicas.b, "kvroute_peers") == 0


def test_a_concurrent_burst_of_one_cold_prefix_through_both_replicas_lands_on_one_instance(
        replicas: Replicas):
    """Alternating between the replicas, all at once: the first answers of each replica
    cannot have seen the other's guess, but both break the tie alike (and would even if
    they had answered different questions before: a tie-break state of their own, such as
    a rotation, would now disagree)."""
    route(replicas.a, unique_tokens(24, 4 * BLOCK), probe=True)
    prefix = unique_tokens(23, 40 * BLOCK)
    urls = [server.url for server in replicas.servers]

    async def burst() -> list[dict]:
        async with (httpx.AsyncClient(base_url=urls[0], timeout=HTTP_TIMEOUT) as a,
                    httpx.AsyncClient(base_url=urls[1], timeout=HTTP_TIMEOUT) as b):
            answers = await asyncio.gather(*(
                (a, b)[i % 2].post("/v1/route", json={"token_ids": prefix + [7, i]})
                for i in range(8)))
        assert all(answer.status_code == 200 for answer in answers)
        return [answer.json() for answer in answers]

    answers = asyncio.run(burst())
    assert len({answer["instance"] for answer in answers}) == 1, answers


def test_a_replica_that_loses_valkey_routes_alone_and_shares_again_when_it_returns(
        replicas: Replicas, valkey: RedisServer, cluster: SimCluster,
        caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="kvroute.valkey")
    both = (replicas.a, replicas.b)
    warm = unique_tokens(31, 5 * BLOCK + 2)
    cluster.complete(1, warm, max_tokens=1)
    holder = default_instance_id(InstanceConfig(url=cluster.urls[1]))
    for http in both:
        wait_for(lambda http=http: route(http, warm, probe=True)["matched_tokens"] == 5 * BLOCK,
                 "both replicas to learn the warm prompt from the instance's events")
    probes = [warm] + [unique_tokens(40 + i, 3 * BLOCK) for i in range(6)]
    before = [[route(http, tokens, probe=True)["instance"] for tokens in probes]
              for http in both]

    valkey.stop()
    for http in both:
        wait_for(lambda http=http: metric(http, "kvroute_valkey_connected") == 0,
                 "the replica to notice that Valkey is gone")
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert ready.json()["replicas"]["connected"] is False
        assert "unreachable" in ready.json()["replicas"]["detail"]
    # Each replica still answers, alike and as well as before.
    during = [[route(http, tokens, probe=True)["instance"] for tokens in probes]
              for http in both]
    assert during == before
    assert during[0][0] == during[1][0] == holder
    for i in range(4):  # real answers too: their guesses cannot be shared, and say so
        route(both[i % 2], unique_tokens(60 + i, 3 * BLOCK), probe=False)
    assert metric(replicas.a, "kvroute_peer_messages_dropped_total", reason="offline") >= 1

    valkey.start()  # the same socket path
    replicas.wait_until_sharing()
    for http in both:
        ready = http.get("/readyz").json()
        assert ready["replicas"]["connected"] is True
    prompt = unique_tokens(77, 4 * BLOCK + 1)
    chosen = route(replicas.a, prompt, probe=False)["instance"]
    wait_for(lambda: scores_of(route(replicas.b, prompt, probe=True))[chosen]
             ["pending_blocks"] == 4, "A's guesses to reach B again")

    messages = [r.getMessage() for r in caplog.records if r.name == "kvroute.valkey"]
    assert sum("unreachable" in m for m in messages) == 2, messages  # once per replica
    assert sum("is back" in m for m in messages) == 2, messages


def test_a_replica_without_valkey_at_start_routes_and_joins_when_it_appears(
        cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("valkey-late"))
    pair = Replicas(cluster, server.url())
    try:
        for http in (pair.a, pair.b):
            assert metric(http, "kvroute_valkey_connected") == 0
            route(http, unique_tokens(90, 2 * BLOCK), probe=False)
        server.start()
        pair.wait_until_sharing()
    finally:
        pair.close()
        server.stop()


def test_readyz_without_state_url_has_no_replicas_detail():
    settings = Settings(host="127.0.0.1", port=0, log_level="warning")
    server = BackgroundServer(settings).start()
    try:
        body = httpx.get(f"{server.url}/readyz", timeout=HTTP_TIMEOUT).json()
        assert "replicas" not in body
    finally:
        server.stop()


def test_a_new_replica_answers_like_a_warm_one_from_its_first_request(
        valkey: RedisServer) -> None:
    """The replay buffer is far shorter than the traffic, so only the saved state in
    Valkey can tell a new replica what the instances held before; a replica without it
    starts cold (the contrast shows the test means something)."""
    hot = [unique_tokens(500 + k, 8 * BLOCK + 3) for k in range(4)]
    with SimCluster(n=2, block_size=BLOCK, num_blocks=512, model="sim-model",
                    buffer_steps=8) as sim:
        first = replica(sim, valkey.url(), state_save_interval=0.2, placement_ttl=0.0)
        try:
            with httpx.Client(base_url=first.url, timeout=HTTP_TIMEOUT) as a:
                sim.drive([(k % 2, prompt) for k, prompt in enumerate(hot)], max_tokens=1)
                sim.drive([(k % 2, unique_tokens(900 + k, BLOCK + 1)) for k in range(40)],
                          max_tokens=1, concurrency=1)
                wait_for(lambda: all(max(s["matched_tokens"] for s in scores_of(
                    route(a, prompt, probe=True)).values()) == 8 * BLOCK for prompt in hot),
                    "the first replica to learn the hot prompts live")
                saves = metric(a, "kvroute_state_saves_total")
                wait_for(lambda: metric(a, "kvroute_state_saves_total") >= saves + 2,
                         "two saves after the first replica was live")
                before = [scores_of(route(a, prompt, probe=True)) for prompt in hot]
        finally:
            first.stop()

        second = replica(sim, valkey.url(), placement_ttl=0.0)
        cold = replica(sim, valkey.url(db=1), placement_ttl=0.0)  # nothing saved there
        try:
            with (httpx.Client(base_url=second.url, timeout=HTTP_TIMEOUT) as b,
                  httpx.Client(base_url=cold.url, timeout=HTTP_TIMEOUT) as c):
                after = [scores_of(route(b, prompt, probe=True)) for prompt in hot]
                assert [{name: s["matched_tokens"] for name, s in answer.items()}
                        for answer in after] == [
                    {name: s["matched_tokens"] for name, s in answer.items()}
                    for answer in before]
                assert all(s["state"] == "live" for answer in after for s in answer.values())
                assert all(s["pending_blocks"] == 0 for answer in after
                           for s in answer.values())
                assert sum(metric(b, "kvroute_restored_blocks_total", instance=name,
                                  dp_rank="0") for name in after[0]) > 0
                without = [max(s["matched_tokens"] for s in scores_of(
                    route(c, prompt, probe=True)).values()) for prompt in hot]
                assert without == [0] * len(hot)
        finally:
            second.stop()
            cold.stop()
