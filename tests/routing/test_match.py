"""POST /v1/match through real HTTP against a simulated fleet: each eligible worker holding
part of the prompt, with the counts a route's scores show for it, and nothing weighed or
left behind."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.sim.cluster import SimCluster
from tests.support.following import following, instance_ids
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16
MATCHED_ONLY = ("instance", "dp_rank", "matched_blocks", "matched_tokens", "block_size",
                "by_medium", "pending_blocks")


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimCluster]:
    with SimCluster(n=4, block_size=BLOCK, num_blocks=64, model="sim-model") as sim:
        yield sim


@pytest.fixture(scope="module")
def client(fleet: SimCluster) -> Iterator[httpx.Client]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", placement_ttl=60.0)
    with following(fleet, settings) as http:
        yield http


def cache(fleet: SimCluster, instance: int, prompt: list[int]) -> None:
    answer = httpx.post(f"{fleet.urls[instance]}/v1/completions", timeout=HTTP_TIMEOUT,
                        json={"model": "sim-model", "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text


def test_the_holders_most_first_with_the_counts_their_scores_show(fleet: SimCluster,
                                                                   client: httpx.Client):
    ids = instance_ids(fleet, client)
    prompt = unique_tokens(31, 4 * BLOCK + 3)
    cache(fleet, 1, prompt)
    cache(fleet, 3, prompt[:2 * BLOCK + 5])

    def learned() -> dict | None:
        body = client.post("/v1/match", json={"token_ids": prompt}).json()
        return body if [m["matched_blocks"] for m in body["matches"]] == [4, 2] else None

    body = wait_for(learned, "kvroute to learn both prefixes from the instances' events")
    assert body["prompt_tokens"] == len(prompt) and body["prompt_blocks"] is None
    assert body["eligible_workers"] == 4
    assert [(m["instance"], m["matched_tokens"]) for m in body["matches"]] == [
        (ids[1], 4 * BLOCK), (ids[3], 2 * BLOCK)]
    first = body["matches"][0]
    assert first["by_medium"] == {"GPU": 4, "CPU": 0, "STORAGE": 0}
    assert first["pending_blocks"] == 0 and first["block_size"] == BLOCK
    # The same counts as the route's score of each worker; the others hold nothing.
    every = client.post("/v1/route", json={"token_ids": prompt, "probe": True,
                                           "all_scores": True}).json()
    assert every["instance"] == ids[1]
    scored = {s["instance"]: {k: s[k] for k in MATCHED_ONLY} for s in every["scores"]}
    assert [scored[m["instance"]] for m in body["matches"]] == body["matches"]
    assert all(scored[i]["matched_blocks"] == 0 for i in (ids[0], ids[2]))

    # Only the eligible workers: the candidates given.
    among = client.post("/v1/match", json={"token_ids": prompt, "candidates": [ids[3], ids[0]]})
    assert among.status_code == 200, among.text
    assert among.json()["eligible_workers"] == 2
    assert [m["instance"] for m in among.json()["matches"]] == [ids[3]]


def test_a_match_leaves_nothing_behind_and_shows_a_routes_guess(fleet: SimCluster,
                                                                client: httpx.Client):
    prompt = unique_tokens(47, 2 * BLOCK + 8)
    for _ in range(2):  # asked twice: the first left no placement guess
        body = client.post("/v1/match", json={"token_ids": prompt}).json()
        assert body["matches"] == [] and body["eligible_workers"] == 4
    # A route (not a probe) leaves its guess on the chosen worker until its events arrive.
    chosen = client.post("/v1/route", json={"token_ids": prompt}).json()["instance"]
    (guessed,) = client.post("/v1/match", json={"token_ids": prompt}).json()["matches"]
    assert guessed["instance"] == chosen
    assert guessed["matched_blocks"] == guessed["pending_blocks"] == 2
    assert guessed["by_medium"] == {"GPU": 0, "CPU": 0, "STORAGE": 0}


def test_block_hashes_and_refusals(client: httpx.Client):
    body = client.post("/v1/match", json={"block_hashes": [7, "0xff"]}).json()
    assert body == {"prompt_tokens": None, "prompt_blocks": 2, "matches": [],
                    "eligible_workers": 4}
    for request, status, field in (
            ({"token_ids": [1], "probe": True}, 422, "probe"),  # a route's, not a match's
            ({"token_ids": [1], "prompt": "hi"}, 422, "prompt"),
            ({}, 422, "token_ids"),
            ({"token_ids": [1], "model": "other"}, 404, "model"),
            ({"token_ids": [1], "candidates": ["nobody"]}, 404, "candidates"),
            ({"prompt": "hi"}, 422, "prompt")):  # no tokenizer configured
        refused = client.post("/v1/match", json=request)
        assert (refused.status_code, refused.json()["field"]) == (status, field), refused.text
    metrics = client.get("/metrics").text
    assert 'kvroute_match_errors_total{status="422"} 4.0' in metrics
    assert 'kvroute_match_latency_seconds_count{input="token_ids"}' in metrics
