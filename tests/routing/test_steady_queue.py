"""A swing of load does not move a held prefix (app.routing.steady_queue): the queue cost of a
worker
that holds the prompt counts at most its recent average.

The cause it answers, as seen on real engines (docs/decisions.md, "Routing under concurrent
clients"): when concurrent clients' requests pile onto the engine that holds their prefix
for a moment, that engine's queue, priced as it stood, outweighed the prefill it saves
plus the copy a move makes, and the prefix was computed a second time on the other engine,
which evicted its own prefixes for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import httpx

from kvroute.app.config import Settings
from kvroute.app.routing.steady_queue import FORGOTTEN, SteadyQueue
from kvroute.sim.cluster import SimCluster
from tests.support.following import following, instance_ids
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16
A, B, C = ("a", 0), ("b", 0), ("c", 0)


def test_a_swing_weighs_a_fraction_and_a_lasting_queue_weighs_in_full():
    steady = SteadyQueue(window=10.0)
    assert steady.observe(A, 800.0, 0.0) == 0.0  # it just began
    swing = steady.observe(A, 800.0, 1.0)
    assert 70 < swing < 80  # 800 * (1 - e^-0.1)
    assert steady.observe(A, 800.0, 100.0) > 799  # it lasted: in full
    assert steady.observe(A, 100.0, 100.0) == 100.0  # it drained: at once
    assert 100 < steady.average(A, 101.0) < 800


def test_a_worker_that_stopped_carrying_load_averages_down_and_is_forgotten():
    steady = SteadyQueue(window=1.0)
    steady.observe(A, 500.0, 0.0)
    steady.observe(B, 500.0, 0.0)
    steady.observe(C, 500.0, 0.0)
    steady.observe(A, 500.0, 5.0)
    steady.observe(B, 500.0, 5.0)
    steady.observe(C, 500.0, 5.0)
    # A carries no load from t=5 on; C was not weighed (another model's): it keeps its queue.
    steady.settle(lambda key: key == A, now=5.0)
    assert steady.average(A, 5.0) > 490
    assert steady.average(A, 8.0) < 500 * 2.72 ** -2.9
    assert steady.average(C, 8.0) > 499
    steady.settle(lambda key: key == A, now=30.0)
    assert steady.average(A, 30.0) == 0.0 and len(steady) == 2  # A forgotten
    assert steady.observe(A, 0.0, 31.0) == 0.0 and len(steady) == 2
    assert FORGOTTEN > 0


@contextlib.contextmanager
def _proxy_fleet() -> Iterator[tuple[SimCluster, str, httpx.Client, str, str]]:
    """Two simulated instances behind a proxying kvroute, both live: (cluster, kvroute's
    URL, client, first instance's id, second's). No /metrics scrapes (the proxy's own
    requests are the load) and no placement guesses (each test places what a prompt left)."""
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                        load_interval=0.0, placement_ttl=0.0)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=4096, time_scale=1.0) as sim, \
            following(sim, settings) as client:
        first, second = instance_ids(sim, client)
        yield sim, str(client.base_url).rstrip("/"), client, first, second


def _wait_held(client: httpx.Client, prompt: list[int], holder: str) -> None:
    """Until `holder` wins `prompt` with its full blocks matched (events are asynchronous)."""
    wait_for(lambda: (a := client.post("/v1/route", json={
        "token_ids": prompt, "probe": True}).json()).get("instance") == holder
        and a["matched_tokens"] == len(prompt) // BLOCK * BLOCK, f"{holder} to hold it")


@contextlib.asynccontextmanager
async def _held_open(url: str, prompts: list[list[int]]) -> AsyncIterator[list[str]]:
    """One streamed completion per prompt through kvroute's proxy, opened in order (each
    weighed with the ones before it in flight) and held open until the block ends; yields
    the instance that served each, in order."""
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT) as client, \
            contextlib.AsyncExitStack() as streams:
        served = []
        for prompt in prompts:
            response = await streams.enter_async_context(client.stream(
                "POST", "/v1/completions",
                json={"model": "sim-model", "prompt": prompt, "max_tokens": 5000,
                      "stream": True}))
            assert response.status_code == 200
            served.append(response.headers["x-kvroute-instance"])
        yield served


def _route_while_held(url: str, prompts: list[list[int]], asked: list[int]
                      ) -> tuple[list[str], dict]:
    """(who served each of `prompts`, the route answer for `asked`, every score shown),
    `asked` routed as a probe while the streams of `prompts` are held open."""
    async def scenario() -> tuple[list[str], dict]:
        async with _held_open(url, prompts) as served, httpx.AsyncClient(
                base_url=url, timeout=HTTP_TIMEOUT) as client:
            answer = await client.post("/v1/route", json={
                "token_ids": asked, "probe": True, "all_scores": True})
            return served, answer.json()

    return asyncio.run(scenario())


def test_requests_piling_onto_a_prefix_holder_stay_there():
    """22 requests of a held prompt at once, each one weighed with the ones before it in
    flight on the holder: priced as it stood, the holder's queue passed the prefill it saves
    plus the copy around the 20th, and the rest computed the prompt on the other worker."""
    with _proxy_fleet() as (sim, url, client, holder, _):
        hot = [(i * 31) % 20000 + 1 for i in range(20 * BLOCK + 3)]
        sim.complete(0, hot, max_tokens=1)
        _wait_held(client, hot, holder)
        served, answer = _route_while_held(url, [hot] * 22, hot)
        assert served == [holder] * 22
        assert answer["instance"] == holder


def test_a_prefix_its_home_evicted_goes_back_home_through_a_swing():
    """A prompt's prefix was sent to H lately and nobody holds it any more (H evicted it).
    Both workers carry load, H a little more for the moment: priced as it stood, that
    swing sent the prefix to the other worker, which then held one prefix more than its
    share (a copy once H computed it again for its next request)."""
    with _proxy_fleet() as (sim, url, client, home, other):
        evicted = [(i * 37) % 20000 + 5 for i in range(20 * BLOCK + 3)]
        on_home = [(i * 41) % 20000 + 7 for i in range(10 * BLOCK + 3)]
        on_other = [(i * 43) % 20000 + 9 for i in range(10 * BLOCK + 3)]
        # The prefix's last route named H (and nothing was stored: H evicted it).
        sent = client.post("/v1/route", json={"token_ids": evicted, "candidates": [home]})
        assert sent.status_code == 200 and sent.json()["instance"] == home
        sim.complete(0, on_home, max_tokens=1)
        sim.complete(1, on_other, max_tokens=1)
        _wait_held(client, on_home, home)
        _wait_held(client, on_other, other)
        # Both get busy at once: 10 requests on H, 6 on the other, interleaved.
        prompts = [on_home, on_other] * 6 + [on_home] * 4
        served, answer = _route_while_held(url, prompts, evicted)
        assert served == [home if p is on_home else other for p in prompts]
        scores = {s["instance"]: s for s in answer["scores"]}
        assert scores[home]["matched_tokens"] == scores[other]["matched_tokens"] == 0
        # The swing: H's queue stands higher than the other's, and counts less.
        assert scores[home]["load"]["inflight"] > scores[other]["load"]["inflight"]
        assert answer["instance"] == home, answer["scores"]


def test_an_idle_worker_that_holds_more_prefixes_does_not_take_a_busy_homes_prefix():
    """H's prefix was evicted there under load; the other worker is idle for the moment but
    was sent two prefixes lately against H's one. Without the crowding term for idle
    workers the idle one took the prefix (cheaper by H's queue) and held three."""
    with _proxy_fleet() as (sim, url, client, home, other):
        evicted = [(i * 37) % 20000 + 5 for i in range(20 * BLOCK + 3)]
        on_home = [(i * 41) % 20000 + 7 for i in range(20 * BLOCK + 3)]
        on_other = [[(i * m) % 20000 + 11 for i in range(20 * BLOCK + 3)] for m in (47, 53)]
        for prompt, holder in ((evicted, home), *((p, other) for p in on_other)):
            sent = client.post("/v1/route", json={"token_ids": prompt,
                                                  "candidates": [holder]})
            assert sent.status_code == 200 and sent.json()["instance"] == holder
        sim.complete(0, on_home, max_tokens=1)
        _wait_held(client, on_home, home)
        served, answer = _route_while_held(url, [on_home] * 8, evicted)
        assert served == [home] * 8
        scores = {s["instance"]: s for s in answer["scores"]}
        assert scores[other]["load"]["inflight"] == 0 < scores[home]["load"]["inflight"]
        assert scores[other]["cost_terms"]["crowding"] > 0
        assert answer["instance"] == home, answer["scores"]
