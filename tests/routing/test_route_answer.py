"""The route answer's shape on a fleet larger than its default list of scores, and the
cheap path that weighs idle, unmatched workers as one group (`routing.choose`)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.routing.cost import (
    CostWeights,
    Score,
    TieBreaker,
    WorkerGroup,
    WorkerView,
    best_of,
    choose,
    prefill_cost,
    ranked,
    score_workers,
)
from kvroute.index import Match
from kvroute.sim.cluster import SimCluster
from tests.support.following import following
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for

W = CostWeights()
BLOCK = 16


def _fleet(rng: random.Random, size: int) -> tuple[list[WorkerView], dict, set]:
    """Random views (block sizes 8 and 16) and matches, many sharing a match; returns
    (views, matches, keys that carry no load)."""
    views, matches, unloaded = [], {}, set()
    for n in range(size):
        key = (f"w{n:03d}", n % 2)
        size_of = rng.choice([BLOCK, BLOCK, BLOCK // 2])
        blocks = rng.choice([0, 0, 0, 2, 5, 8])
        cpu = rng.choice([0, 0, 1]) if blocks else 0
        loaded = rng.random() < 0.3
        load = dict(running=rng.choice([0, 1, 3]), waiting=rng.choice([0, 2, 80]),
                    kv_usage=rng.choice([0.1, 0.99]), inflight=rng.choice([0, 1])) \
            if loaded else {}
        views.append(WorkerView(key=key, block_size=size_of, state="live", **load))
        if blocks:
            matches[key] = Match(blocks, blocks * size_of, size_of,
                                 {"GPU": blocks - cpu, "CPU": cpu, "STORAGE": 0})
        if not loaded:
            unloaded.add(key)
    return views, matches, unloaded


def _grouped(views: list[WorkerView], matches: dict, unloaded: set, prompt_tokens: int,
             rng: random.Random) -> tuple[list, list[WorkerGroup], int | None]:
    """What the service weighs: loaded workers scored, the others grouped by prefill cost
    (matched ones by their match, idle ones together), and the smallest block size."""
    by_key = {v.key: v for v in views}

    def score(key):
        return score_workers([by_key[key]], matches, W, prompt_tokens=prompt_tokens)[0]

    scored = score_workers([v for v in views if v.key not in unloaded], matches, W,
                           prompt_tokens=prompt_tokens)
    by_cost: dict[float, list] = {}
    for key in sorted(unloaded, key=lambda k: rng.random()):
        match = matches.get(key)
        size = (match.block_size if match else None) or by_key[key].block_size
        cost = prefill_cost(W, prompt_tokens, match.tokens if match else 0,
                            match.by_medium["CPU"] if match else 0, 0, size)
        by_cost.setdefault(cost, []).append(key)
    groups = [WorkerGroup.of(keys, cost, score) for cost, keys in by_cost.items()]
    sizes = [s.block_size for s in scored] + [
        (matches[k].block_size if k in matches else by_key[k].block_size) for k in unloaded]
    return scored, groups, min(sizes, default=None)


@pytest.mark.parametrize("seed", range(60))
def test_choose_picks_what_scoring_every_worker_picks(seed: int):
    rng = random.Random(seed)
    views, matches, unloaded = _fleet(rng, rng.randint(1, 40))
    tokens = unique_tokens(seed, 160)
    everyone = score_workers(views, matches, W, prompt_tokens=len(tokens))
    expected = best_of(everyone, TieBreaker(tokens=tokens))
    scored, groups, block_size = _grouped(views, matches, unloaded, len(tokens), rng)
    assert all(s.cost == g.cost for g in groups for s in map(g.score, g.keys()))
    best, shown = choose(scored, groups, TieBreaker(tokens=tokens), keep=4,
                         block_size=block_size)
    assert best == expected
    assert len(shown) == min(4, len(views))
    assert best in shown
    ranking = ranked(everyone)
    top = ranking[:4]
    assert shown == (top if best in top else ranked([*top[:3], best]))
    _, every = choose(scored, groups, TieBreaker(tokens=tokens), keep=None,
                      block_size=block_size)
    assert every == ranking


def test_a_cold_prompt_on_an_idle_fleet_ties_every_worker_as_before():
    views = [WorkerView(key=(f"i{n}", 0), block_size=BLOCK, state="live") for n in range(50)]
    by_key = {v.key: v for v in views}
    for seed in range(20):
        tokens = unique_tokens(1000 + seed, 64)
        expected = best_of(score_workers(views, {}, W, prompt_tokens=64), TieBreaker(tokens=tokens))
        idle = WorkerGroup.of(list(by_key), 64.0, lambda k: score_workers(
            [by_key[k]], {}, W, prompt_tokens=64)[0])
        best, shown = choose([], [idle], TieBreaker(tokens=tokens), keep=4, block_size=BLOCK)
        assert best == expected and best in shown and len(shown) == 4


def test_an_answer_scores_only_the_grouped_workers_it_shows():
    """Each group's workers cost its cost: their places among the shown ones follow from
    their keys, so a route scores the `keep` shown ones and no other: a tie's pick that
    ranks below them takes the last place before that place's worker is scored."""
    views = [WorkerView(key=(f"i{n:02d}", 0), block_size=BLOCK, state="live") for n in range(40)]
    by_key = {v.key: v for v in views}
    scored: list[tuple[str, int]] = []

    def score(key: tuple[str, int]) -> Score:
        scored.append(key)
        return score_workers([by_key[key]], {}, W, prompt_tokens=64)[0]

    keys = list(by_key)
    groups = [WorkerGroup.of(keys[:20], 64.0, score), WorkerGroup.of(keys[20:], 64.0, score)]
    best, shown = choose([], groups, TieBreaker(tokens=unique_tokens(7, 64)), keep=4,
                         block_size=BLOCK)
    assert len(shown) == 4 and best in shown
    assert [s.instance for s in shown[:3]] == ["i00", "i01", "i02"]
    assert best.instance > "i03"  # the pick ranks below the first four: it took the fourth's place
    assert sorted(scored) == sorted((s.instance, s.dp_rank) for s in shown)  # each once


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimCluster]:
    with SimCluster(n=6, block_size=BLOCK, num_blocks=64, model="sim-model") as sim:
        yield sim


@pytest.fixture(scope="module")
def client(fleet: SimCluster) -> Iterator[httpx.Client]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", placement_ttl=0.0)
    with following(fleet, settings) as http:
        yield http


def test_the_answer_shows_the_chosen_worker_and_the_cheapest_few(fleet: SimCluster,
                                                                 client: httpx.Client):
    prompt = unique_tokens(77, 4 * BLOCK + 3)
    answer = httpx.post(f"{fleet.urls[4]}/v1/completions", timeout=HTTP_TIMEOUT,
                        json={"model": "sim-model", "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text

    def routed() -> dict | None:
        body = client.post("/v1/route", json={"token_ids": prompt, "probe": True}).json()
        return body if body.get("matched_blocks") == 4 else None

    body = wait_for(routed, "kvroute to learn the prompt from instance 4's events")
    assert body["eligible_workers"] == 6
    assert len(body["scores"]) == 4
    assert body["scores"][0]["instance"] == body["instance"]
    assert body["scores"][0]["matched_blocks"] == 4
    assert all(s["matched_blocks"] == 0 for s in body["scores"][1:])
    costs = [s["cost"] for s in body["scores"]]
    assert costs == sorted(costs)

    every = client.post("/v1/route", json={"token_ids": prompt, "probe": True,
                                           "all_scores": True}).json()
    assert every["instance"] == body["instance"] and every["eligible_workers"] == 6
    assert len(every["scores"]) == 6
    assert len({(s["instance"], s["dp_rank"]) for s in every["scores"]}) == 6
    assert every["scores"][:1] == body["scores"][:1]

    refused = client.post("/v1/route", json={"token_ids": prompt, "all_scores": "yes"})
    assert refused.status_code == 422 and refused.json()["field"] == "all_scores"


def test_a_cold_prompt_shows_its_pick_among_tied_idle_workers(client: httpx.Client):
    picks = set()
    for seed in range(12):
        body = client.post("/v1/route", json={"token_ids": unique_tokens(500 + seed, 40),
                                              "probe": True}).json()
        assert len(body["scores"]) == 4 and body["eligible_workers"] == 6
        shown = {s["instance"] for s in body["scores"]}
        assert body["instance"] in shown
        picks.add(body["instance"])
    assert len(picks) > 1  # rendezvous spreads cold prompts over the tied workers
