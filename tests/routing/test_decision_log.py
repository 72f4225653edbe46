"""The decision log (app.routing.decision_log): bounded, ordered, off by default, and through
real HTTP
it names each weighed worker's cost terms, the choice and, for proxied requests, the cached
tokens the engine reported."""

from __future__ import annotations

import httpx
import pytest

from kvroute.app.api.answers import LoadReadings
from kvroute.app.api.contract import DECISIONS_PAGE
from kvroute.app.config import ConfigError, Settings, load_settings
from kvroute.app.routing.cost import Score
from kvroute.app.routing.decision_log import LOGGED_SCORES, DecisionLog
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.following import following
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16


def score(instance: str, matched: int, cost: float) -> Score:
    return Score(instance=instance, dp_rank=0, matched_blocks=matched // BLOCK,
                 matched_tokens=matched, block_size=BLOCK, by_medium={}, state="live",
                 prefill_cost=cost, copy_cost=0.0, queue_cost=0.0, queued_prefill=0.0,
                 running=0.0, overloaded=False,
                 load=LoadReadings(running=None, waiting=None, kv_usage=None, inflight=0,
                                   answered=0, queued_prefill=0, recent_demand=0))


def test_the_log_keeps_the_newest_entries_in_order_and_each_outcome_once():
    log = DecisionLog(3)
    ids = [log.record(at=float(i), mode="route", prefix=bytes([i]) * 16, prompt_tokens=100,
                      chosen=score("a", 32, 68.0), scores=[score("a", 32, 68.0),
                                                           score("b", 0, 100.0)], eligible=2)
           for i in range(5)]
    assert ids == [1, 2, 3, 4, 5]
    kept = log.entries()
    assert [e.id for e in kept] == [3, 4, 5] and len(log) == 3
    assert [e.id for e in log.entries(since=3)] == [4, 5]
    assert [e.id for e in log.entries(limit=1)] == [3]
    assert (kept[0].chosen.instance, kept[0].chosen.matched_tokens) == ("a", 32)
    assert [s.instance for s in kept[0].scores] == ["a", "b"]
    assert kept[0].scores[1].prefill == 100.0
    log.outcome(4, 32)
    log.outcome(4, 0)  # a second report of one request changes nothing
    log.outcome(1, 16)  # dropped already: ignored
    assert [e.cached_tokens for e in log.entries()] == [None, 32, None]
    with pytest.raises(ValueError):
        DecisionLog(0)


def test_the_setting_is_bounded():
    assert Settings().decision_log == 0
    assert load_settings(environ={"KVROUTE_DECISION_LOG": "500"}).decision_log == 500
    with pytest.raises(ConfigError):
        load_settings(environ={"KVROUTE_DECISION_LOG": "-1"})
    with pytest.raises(ConfigError):
        load_settings(environ={"KVROUTE_DECISION_LOG": "1000000000"})


def test_the_log_is_off_by_default():
    server = BackgroundServer(Settings(host="127.0.0.1", port=0, log_level="warning")).start()
    try:
        assert httpx.get(f"{server.url}/v1/decisions", timeout=HTTP_TIMEOUT).status_code == 404
    finally:
        server.stop()


def test_proxied_and_routed_decisions_are_logged_with_what_the_engine_cached():
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                        tokenizer="instance", decision_log=50)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, stream_interval_s=0.02) as cluster, \
            following(cluster, settings) as http:
        prompt = unique_tokens(7, 10 * BLOCK + 3)
        first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert first.status_code == 200, first.text
        # Once the first answer's blocks are indexed, a second one hits them.
        wait_for(lambda: http.post("/v1/match", json={"token_ids": prompt})
                 .json()["matches"], "the prompt's blocks indexed")
        second = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert second.status_code == 200, second.text
        routed = http.post("/v1/route", json={"token_ids": prompt})
        assert routed.status_code == 200, routed.text
        probed = http.post("/v1/route", json={"token_ids": prompt, "probe": True})
        assert probed.status_code == 200

        log = http.get("/v1/decisions").json()
        assert log["capacity"] == 50
        entries = log["decisions"]
        assert [e["mode"] for e in entries] == ["proxy", "proxy", "route"]  # no probe
        assert [e["id"] for e in entries] == [
            int(first.headers["x-kvroute-decision"]),
            int(second.headers["x-kvroute-decision"]), entries[2]["id"]]
        assert entries[0]["cached_tokens"] == 0
        assert entries[1]["cached_tokens"] == 10 * BLOCK
        assert entries[1]["chosen"]["instance"] == second.headers["x-kvroute-instance"]
        assert entries[1]["chosen"]["matched_tokens"] == 10 * BLOCK
        assert entries[2]["cached_tokens"] is None  # the caller heard the engine
        assert len({e["prefix"] for e in entries}) == 1  # one prompt, one prefix key
        for entry in entries:
            assert entry["prompt_tokens"] == len(prompt)
            assert {s["instance"] for s in entry["scores"]} == {
                i["id"] for i in http.get("/v1/instances").json()["instances"]}
            assert {"prefill", "copy", "crowding", "queue", "recent_demand"} <= set(
                entry["scores"][0])
        assert [e["id"] for e in http.get(
            "/v1/decisions", params={"since": entries[1]["id"]}).json()["decisions"]
                ] == [entries[2]["id"]]
        for bad in ({"since": -1}, {"limit": 0}, {"limit": DECISIONS_PAGE + 1},
                    {"since": "x"}):
            answer = http.get("/v1/decisions", params=bad)
            assert answer.status_code == 422, (bad, answer.text)
            assert answer.json()["error"]


def test_an_entry_keeps_at_most_a_few_scores_and_paging_follows_the_ids():
    log = DecisionLog(1000)
    many = [score(f"w{i}", 0, 100.0 + i) for i in range(50)]
    for i in range(30):
        log.record(at=float(i), mode="route", prefix=b"p" * 16, prompt_tokens=100,
                   chosen=many[0], scores=many, eligible=50)
    assert all(len(e.scores) == LOGGED_SCORES for e in log.entries())
    assert [e.id for e in log.entries(since=27)] == [28, 29, 30]
    assert [e.id for e in log.entries(since=5, limit=2)] == [6, 7]
    assert log.entries(since=30) == [] and log.entries(since=10_000) == []
    small = DecisionLog(3)
    for i in range(10):
        small.record(at=float(i), mode="proxy", prefix=b"p" * 16, prompt_tokens=None,
                     chosen=many[0], scores=many[:1], eligible=1)
    assert [e.id for e in small.entries()] == [8, 9, 10]
    assert [e.id for e in small.entries(since=2)] == [8, 9, 10]  # older ones are gone
    assert [e.id for e in small.entries(since=8, limit=1)] == [9]
