"""Tenants on one fleet: a request's ``cache_salt`` through the route and match APIs and the
proxy, against simulated engines that key a salted request's first block with its salt as
vLLM does. A tenant is matched on its own blocks, never on another's or unsalted ones."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.api.route_request import CACHE_SALT_MAX_CHARS
from kvroute.app.config import Settings
from kvroute.sim.cluster import SimCluster
from tests.support.following import following, instance_ids
from tests.support.tokens import unique_tokens
from tests.support.waiting import wait_for

BLOCK = 16


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[SimCluster, httpx.Client, list[str]]]:
    # Probing routes leave no guesses; the proxied requests' guesses are the tenant's own.
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                        decision_log=100)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=512, stream_interval_s=0.02) as sim, \
            following(sim, settings) as http:
        yield sim, http, instance_ids(sim, http)


def logged(http: httpx.Client, answer: httpx.Response) -> dict:
    """The decision log's entry of a proxied answer, once it holds what the engine cached
    (recorded as the answer ends)."""
    wanted = int(answer.headers["x-kvroute-decision"])

    def entry() -> dict | None:
        for found in http.get("/v1/decisions").json()["decisions"]:
            if found["id"] == wanted and found["cached_tokens"] is not None:
                return found
        return None

    return wait_for(entry, "the engine's cached tokens in the decision log")


def matched(http: httpx.Client, tokens: list[int], **query) -> dict[str, int]:
    answer = http.post("/v1/match", json={"token_ids": tokens, **query})
    assert answer.status_code == 200, answer.text
    return {m["instance"]: m["matched_tokens"] for m in answer.json()["matches"]
            if m["matched_tokens"]}


def test_each_tenant_is_routed_on_its_own_blocks(fleet):
    sim, http, ids = fleet
    prompt = unique_tokens(31, 8 * BLOCK + 1)
    sim.complete(0, prompt, max_tokens=1, cache_salt="tenant-a")
    sim.complete(1, prompt, max_tokens=1)  # the same prompt, unsalted, on the other
    wait_for(lambda: matched(http, prompt, cache_salt="tenant-a") == {ids[0]: 8 * BLOCK}
             and matched(http, prompt) == {ids[1]: 8 * BLOCK}, "both copies indexed")
    assert matched(http, prompt, cache_salt="tenant-b") == {}
    routed = http.post("/v1/route", json={"token_ids": prompt, "cache_salt": "tenant-a",
                                          "probe": True}).json()
    assert (routed["instance"], routed["matched_tokens"]) == (ids[0], 8 * BLOCK)
    plain = http.post("/v1/route", json={"token_ids": prompt, "probe": True}).json()
    assert (plain["instance"], plain["matched_tokens"]) == (ids[1], 8 * BLOCK)
    # What the engines say agrees: a salt of its own is a miss everywhere.
    assert sim.instances[0].ranks[0].engine.lookup(prompt, "tenant-a") == 8 * BLOCK
    assert sim.instances[0].ranks[0].engine.lookup(prompt) == 0


def test_the_proxy_routes_a_salted_request_on_its_tenants_blocks(fleet):
    sim, http, ids = fleet
    prompt = unique_tokens(32, 6 * BLOCK + 3)
    body = {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-c"}
    first = http.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-instance"]
    wait_for(lambda: matched(http, prompt, cache_salt="tenant-c") == {holder: 6 * BLOCK},
             "the tenant's blocks indexed")
    second = http.post("/v1/completions", json=body)
    assert second.status_code == 200, second.text
    assert second.headers["x-kvroute-instance"] == holder
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK
    entry = logged(http, second)
    assert entry["chosen"]["matched_tokens"] == entry["cached_tokens"] == 6 * BLOCK
    # Unsalted, the same prompt is new to every engine, and kvroute says so.
    third = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    entry = logged(http, third)
    assert entry["chosen"]["matched_tokens"] == entry["cached_tokens"] == 0


@pytest.mark.parametrize("salt", ["", "x" * (CACHE_SALT_MAX_CHARS + 1), 7, ["a"]])
def test_a_cache_salt_that_is_not_a_short_string_is_refused(fleet, salt):
    _, http, _ = fleet
    for path in ("/v1/route", "/v1/match"):
        answer = http.post(path, json={"token_ids": [1, 2, 3], "cache_salt": salt})
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] == "cache_salt"
    proxied = http.post("/v1/completions", json={"prompt": [1, 2, 3], "cache_salt": salt})
    assert proxied.status_code == 400, proxied.text
    assert proxied.json()["field"] == "cache_salt"
