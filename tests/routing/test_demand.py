"""Recent demand per worker (app.routing.demand) against a brute-force model of its definition."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.app.routing.demand import FORGET_AFTER, RecentDemand

HALF = 10.0


def model_of(history: list[tuple[tuple[str, int], bytes, int, float]], limit: int,
             key: tuple[str, int], now: float, without: bytes | None = None) -> float:
    """The definition: after each route, the pairs whose latest prompt is more than
    FORGET_AFTER half-lives old are forgotten, then the least recently routed beyond
    `limit`; `key`'s demand is the sum of its remembered pairs' latest prompts, each
    decayed since it was sent (`without`: leaving that prefix's pair out)."""
    latest: dict[tuple[tuple[str, int], bytes], tuple[int, float]] = {}
    for worker, prefix, tokens, at in history:
        latest.pop((worker, prefix), None)  # re-routed: most recent again
        latest[(worker, prefix)] = (tokens, at)
        latest = {pair: prompt for pair, prompt in latest.items()
                  if prompt[1] > at - FORGET_AFTER * HALF}
        latest = dict(list(latest.items())[-limit:])
    return sum(tokens * 0.5 ** ((now - at) / HALF)
               for (worker, prefix), (tokens, at) in latest.items()
               if worker == key and prefix != without)


def test_a_prefix_counts_its_latest_prompt_once():
    demand = RecentDemand(half_life=HALF)
    a = ("a", 0)
    for turn in range(1, 6):  # one chat session, growing
        demand.add(a, b"session", 100 * turn, now=0.0)
    assert demand.of(a, 0.0) == 500.0
    for _ in range(1000):  # a hot prefix asked a thousand times weighs one prompt
        demand.add(a, b"hot", 300, now=0.0)
    assert demand.of(a, 0.0) == 800.0
    assert demand.of(("b", 0), 0.0) == 0.0


def test_demand_halves_every_half_life_and_a_new_prompt_replaces_the_old():
    demand = RecentDemand(half_life=HALF)
    a = ("a", 0)
    demand.add(a, b"p", 400, now=0.0)
    assert math.isclose(demand.of(a, HALF), 200.0)
    assert math.isclose(demand.of(a, 3 * HALF), 50.0)
    demand.add(a, b"p", 600, now=HALF)  # the same prefix again: only the latest counts
    assert math.isclose(demand.of(a, HALF), 600.0)
    assert math.isclose(demand.of(a, 2 * HALF), 300.0)


def test_a_prompt_long_past_is_forgotten_with_what_it_added():
    demand = RecentDemand(half_life=HALF)
    a = ("a", 0)
    demand.add(a, b"old", 1000, now=0.0)
    demand.add(a, b"new", 100, now=FORGET_AFTER * HALF + 1)
    assert len(demand._prompts) == 1
    assert demand.of(a, FORGET_AFTER * HALF + 1) == 100.0


def test_memory_is_bounded_and_a_forgotten_prompt_takes_its_tokens_along():
    demand = RecentDemand(half_life=HALF, limit=3)
    a, b = ("a", 0), ("b", 0)
    demand.add(a, b"1", 100, now=0.0)
    demand.add(b, b"2", 200, now=0.0)
    demand.add(a, b"3", 300, now=0.0)
    demand.add(b, b"4", 400, now=0.0)  # a's "1" is forgotten
    assert (demand.of(a, 0.0), demand.of(b, 0.0)) == (300.0, 600.0)
    assert len(demand._prompts) == 3
    demand.add(a, b"5", 500, now=0.0)
    demand.add(a, b"6", 600, now=0.0)
    assert (demand.of(a, 0.0), demand.of(b, 0.0)) == (1100.0, 400.0)
    demand.add(a, b"7", 700, now=0.0)  # b's last one forgotten: b is gone
    assert demand.of(b, 0.0) == 0.0 and b not in demand._workers
    assert demand.of(a, 0.0) == 1800.0


routes = st.lists(st.tuples(st.sampled_from([("a", 0), ("b", 0), ("b", 1)]),
                            st.sampled_from([b"p", b"q", b"r", b"s", b"t"]),
                            st.integers(1, 4096), st.floats(0, 50)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(routes, st.integers(1, 8), st.floats(0, 200))
def test_demand_matches_the_definition(steps, limit, later):
    demand = RecentDemand(half_life=HALF, limit=limit)
    history = []
    now = 0.0
    for worker, prefix, tokens, wait in steps:
        now += wait
        demand.add(worker, prefix, tokens, now)
        history.append((worker, prefix, tokens, now))
        for key in (("a", 0), ("b", 0), ("b", 1)):
            expected = model_of(history, limit, key, now)
            assert math.isclose(demand.of(key, now), expected, rel_tol=1e-9, abs_tol=1e-6)
            others = model_of(history, limit, key, now, without=prefix)
            assert math.isclose(demand.of(key, now) - demand.latest(key, prefix, now), others,
                                rel_tol=1e-9, abs_tol=1e-6)
    for key in (("a", 0), ("b", 0), ("b", 1)):
        assert math.isclose(demand.of(key, now + later), model_of(history, limit, key, now + later),
                            rel_tol=1e-9, abs_tol=1e-6)
