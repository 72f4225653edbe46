"""The dashboard over real HTTP: its static files, and `GET /v1/dashboard` over a proxying
kvroute in front of simulated vLLM, behind an API token."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.http.dashboard import PAGES
from kvroute.app.routing.activity import RouteActivity
from kvroute.sim.cluster import SimCluster
from tests.support.following import following, instance_ids
from tests.support.tokens import unique_tokens
from tests.support.waiting import wait_for

TOKEN = "dashboard-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def kvroute() -> Iterator[tuple[httpx.Client, list[str]]]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                        tokenizer="instance", api_token=TOKEN, placement_ttl=0.0)
    with SimCluster(n=2, block_size=16, num_blocks=256, stream_interval_s=0.01) as cluster, \
            following(cluster, settings, headers=AUTH) as http:
        yield http, instance_ids(cluster, http, headers=AUTH)


def snapshot(http: httpx.Client) -> dict:
    answer = http.get("/v1/dashboard", headers=AUTH)
    assert answer.status_code == 200, answer.text
    return answer.json()


def workers(answer: dict) -> dict[str, dict]:
    return {instance["id"]: worker for instance in answer["instances"]
            for worker in instance["workers"]}


def test_the_pages_are_served_without_a_token_and_fetch_nothing_elsewhere(kvroute):
    http, _ = kvroute
    for path, page in PAGES.items():
        answer = http.get(path)
        assert answer.status_code == 200, path
        assert answer.headers["content-type"] == page.media_type
        assert "default-src 'none'" in answer.headers["content-security-policy"]
        # Nothing from another origin: no absolute URL at all in the files.
        assert "://" not in answer.text, path
    page = http.get("/dashboard").text
    assert 'src="dashboard/app.js"' in page and 'href="dashboard/style.css"' in page
    assert re.search(r'fetch\("v1/dashboard"', http.get("/dashboard/app.js").text)
    assert http.get("/dashboard/").status_code == 404  # no redirect, no directory listing
    assert http.get("/dashboard/other.js").status_code == 404


def test_the_data_needs_the_api_token(kvroute):
    http, _ = kvroute
    refused = http.get("/v1/dashboard")
    assert refused.status_code == 401
    assert refused.json()["field"] == "authorization"
    assert http.get("/v1/dashboard", headers={"authorization": "Bearer wrong"}).status_code == 401


def test_the_snapshot_follows_the_fleet_and_the_proxied_requests(kvroute):
    http, ids = kvroute
    wait_for(lambda: all(w["state"] == "live" for w in workers(snapshot(http)).values())
             and len(workers(snapshot(http))) == 2, "both workers live on the dashboard")
    before = snapshot(http)
    prompt = unique_tokens(51, 5 * 16 + 3)

    def proxied() -> str:
        answer = http.post("/v1/completions", headers=AUTH,
                           json={"model": "sim-model", "prompt": prompt, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        return answer.headers["x-kvroute-instance"]

    chosen = proxied()
    # Its blocks indexed (probes: decisions, not routed), the next two go to them too.
    wait_for(lambda: http.post("/v1/route", headers=AUTH, json={
        "token_ids": prompt, "probe": True}).json()["matched_blocks"] == 5, "blocks indexed")
    assert [proxied(), proxied()] == [chosen, chosen]

    def settled() -> dict | None:
        now = snapshot(http)
        recorded = sum(w["hits"]["requests"] + w["hits"]["unavailable"]
                       for w in workers(now).values())
        was = sum(w["hits"]["requests"] + w["hits"]["unavailable"]
                  for w in workers(before).values())
        return now if recorded == was + 3 else None

    after = wait_for(settled, "the three proxied requests recorded")
    assert after["proxy"] is True and after["ready"] is True
    assert after["routes"]["decisions"] >= before["routes"]["decisions"] + 4
    assert after["routes"]["routed"] == before["routes"]["routed"] + 3  # the probe is not
    assert after["routes"]["recent_p50_ms"] > 0
    assert after["routes"]["recent_p99_ms"] >= after["routes"]["recent_p50_ms"]
    routed = sum(w["routed"] for w in workers(after).values()) - sum(
        w["routed"] for w in workers(before).values())
    assert routed == 3
    worker = workers(after)[chosen]
    assert worker["holdings"]["GPU"] >= 5 and worker["stats"]["events"] > 0
    assert worker["inflight"] == 0
    # The same prompt three times: all compared; the 2nd and 3rd found its 5 blocks.
    hits = {k: v - workers(before)[chosen]["hits"][k] for k, v in worker["hits"].items()}
    assert hits["requests"] == 3 and hits["exact"] == 3
    assert hits["predicted"] == hits["actual"] == 2 * 5 * 16
    assert after["index_nodes"] >= 5 and after["index_bytes"] > 0
    assert {i["id"] for i in after["instances"]} == set(ids)


def test_route_activity_keeps_a_bounded_window():
    activity = RouteActivity()
    assert activity.percentiles_ms() == (None, None)
    for n in range(2000):
        activity.decided(("a", 0), n / 1000, probe=n % 2 == 0)
    assert activity.decisions == 2000 and activity.routed == 1000
    assert activity.per_worker == {("a", 0): 1000}
    p50, p99 = activity.percentiles_ms()
    assert len(activity._recent) == 512
    assert 1488 * 1000 / 1000 <= p50 <= 2000 and p50 < p99 <= 1999
    activity.forget({("b", 0)})
    assert activity.per_worker == {}
