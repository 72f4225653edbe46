"""A swing of load does not move a held prefix (app.steady_queue): the queue cost of a worker
that holds the prompt counts at most its recent average.

The cause it answers, as seen on real engines (docs/decisions.md, "Routing under concurrent
clients"): when concurrent clients' requests pile onto the engine that holds their prefix
for a moment, that engine's queue, priced as it stood, outweighed the prefill it saves
plus the copy a move makes, and the prefix was computed a second time on the other engine,
which evicted its own prefixes for it."""

from __future__ import annotations

import asyncio

import httpx

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.app.steady_queue import FORGOTTEN, SteadyQueue
from kvroute.sim.cluster import SimCluster
from tests.conftest import HTTP_TIMEOUT, wait_for

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
    steady.settle(weighed={A, B}, loaded={B}, now=5.0)
    assert steady.average(A, 5.0) > 490
    assert steady.average(A, 8.0) < 500 * 2.72 ** -2.9
    assert steady.average(C, 8.0) > 499
    steady.settle(weighed={A, B}, loaded={B}, now=30.0)
    assert steady.average(A, 30.0) == 0.0 and len(steady) == 2  # A forgotten
    assert steady.observe(A, 0.0, 31.0) == 0.0 and len(steady) == 2
    assert FORGOTTEN > 0


async def _open_streams(url: str, prompt: list[int], count: int,
                        instances: list[str]) -> None:
    """`count` streamed completions of `prompt` through kvroute's proxy, opened one after
    another and all held open until the last one's headers arrived; the instance that
    served each goes to `instances`."""
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT) as client:
        streams = []
        try:
            for _ in range(count):
                stream = client.stream("POST", "/v1/completions", json={
                    "model": "sim-model", "prompt": prompt, "max_tokens": 5000,
                    "stream": True})
                response = await stream.__aenter__()
                streams.append(stream)
                assert response.status_code == 200
                instances.append(response.headers["x-kvroute-instance"])
        finally:
            for stream in reversed(streams):
                await stream.__aexit__(None, None, None)


def test_requests_piling_onto_a_prefix_holder_stay_there():
    """22 requests of a held prompt at once, each one weighed with the ones before it in
    flight on the holder: priced as it stood, the holder's queue passed the prefill it saves
    plus the copy around the 20th, and the rest computed the prompt on the other worker."""
    with SimCluster(n=2, block_size=BLOCK, num_blocks=2048, time_scale=1.0) as sim:
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                            load_interval=0.0)
        with BackgroundServer(settings) as server, httpx.Client(
                base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            ids = [client.post("/v1/instances", json={"url": url}).json()["id"]
                   for url in sim.urls]
            hot = [(i * 31) % 20000 + 1 for i in range(20 * BLOCK + 3)]
            sim.complete(0, hot, max_tokens=1)
            wait_for(lambda: (a := client.post("/v1/route", json={
                "token_ids": hot, "probe": True}).json()).get("instance") == ids[0]
                and a["matched_tokens"] == 20 * BLOCK, "the holder to be known")
            served: list[str] = []
            asyncio.run(_open_streams(server.url, hot, 22, served))
            assert served == [ids[0]] * 22


async def _open_mixed(url: str, prompts: list[list[int]],
                      served: list[tuple[int, str]]) -> httpx.AsyncClient:
    """One streamed completion through kvroute's proxy per prompt, opened in order and left
    open; `served` gets (prompt's place, instance). Returns the client holding them."""
    client = httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT)
    streams = []
    for place, prompt in enumerate(prompts):
        stream = client.stream("POST", "/v1/completions", json={
            "model": "sim-model", "prompt": prompt, "max_tokens": 5000, "stream": True})
        response = await stream.__aenter__()
        assert response.status_code == 200
        streams.append(stream)
        served.append((place, response.headers["x-kvroute-instance"]))
    client.streams = streams  # type: ignore[attr-defined]
    return client


def test_a_prefix_its_home_evicted_goes_back_home_through_a_swing():
    """A prompt's prefix was sent to H lately and nobody holds it any more (H evicted it).
    Both workers carry load, H a little more for the moment: priced as it stood, that
    swing sent the prefix to the other worker, which then held one prefix more than its
    share (a copy once H computed it again for its next request)."""
    with SimCluster(n=2, block_size=BLOCK, num_blocks=4096, time_scale=1.0) as sim:
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                            load_interval=0.0, placement_ttl=0.0)
        with BackgroundServer(settings) as server, httpx.Client(
                base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            home, other = [client.post("/v1/instances", json={"url": url}).json()["id"]
                           for url in sim.urls]
            evicted = [(i * 37) % 20000 + 5 for i in range(20 * BLOCK + 3)]
            on_home = [(i * 41) % 20000 + 7 for i in range(10 * BLOCK + 3)]
            on_other = [(i * 43) % 20000 + 9 for i in range(10 * BLOCK + 3)]
            wait_for(lambda: all(i["state"] == "live" for i in client.get(
                "/v1/instances").json()["instances"]), "both instances live")
            # The prefix's last route named H (and nothing was stored: H evicted it).
            sent = client.post("/v1/route", json={"token_ids": evicted, "candidates": [home]})
            assert sent.status_code == 200 and sent.json()["instance"] == home
            sim.complete(0, on_home, max_tokens=1)
            sim.complete(1, on_other, max_tokens=1)
            for prompt, holder in ((on_home, home), (on_other, other)):
                wait_for(lambda p=prompt, h=holder: (a := client.post("/v1/route", json={
                    "token_ids": p, "probe": True}).json()).get("instance") == h
                    and a["matched_tokens"] == 10 * BLOCK, f"{holder}'s prompt indexed")
            # Both get busy at once: 10 requests on H, 6 on the other, interleaved.
            prompts = [on_home, on_other] * 6 + [on_home] * 4
            served: list[tuple[int, str]] = []

            async def scenario() -> dict:
                streams = await _open_mixed(server.url, prompts, served)
                try:
                    async with httpx.AsyncClient(base_url=server.url,
                                                 timeout=HTTP_TIMEOUT) as probe:
                        answer = await probe.post("/v1/route", json={
                            "token_ids": evicted, "probe": True, "all_scores": True})
                        return answer.json()
                finally:
                    for stream in reversed(streams.streams):  # type: ignore[attr-defined]
                        await stream.__aexit__(None, None, None)
                    await streams.aclose()

            answer = asyncio.run(scenario())
            assert [i for _, i in served] == [home if p is on_home else other
                                              for p in prompts]
            scores = {s["instance"]: s for s in answer["scores"]}
            assert scores[home]["matched_tokens"] == scores[other]["matched_tokens"] == 0
            # The swing: H's queue stands higher than the other's, and counts less.
            assert scores[home]["load"]["inflight"] > scores[other]["load"]["inflight"]
            assert answer["instance"] == home, answer["scores"]


def test_an_idle_worker_that_holds_more_prefixes_does_not_take_a_busy_homes_prefix():
    """H's prefix was evicted there under load; the other worker is idle for the moment but
    was sent two prefixes lately against H's one. Without the crowding term for idle
    workers the idle one took the prefix (cheaper by H's queue) and held three."""
    with SimCluster(n=2, block_size=BLOCK, num_blocks=4096, time_scale=1.0) as sim:
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                            load_interval=0.0, placement_ttl=0.0)
        with BackgroundServer(settings) as server, httpx.Client(
                base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            home, other = [client.post("/v1/instances", json={"url": url}).json()["id"]
                           for url in sim.urls]
            wait_for(lambda: all(i["state"] == "live" for i in client.get(
                "/v1/instances").json()["instances"]), "both instances live")
            evicted = [(i * 37) % 20000 + 5 for i in range(20 * BLOCK + 3)]
            on_home = [(i * 41) % 20000 + 7 for i in range(20 * BLOCK + 3)]
            on_other = [[(i * m) % 20000 + 11 for i in range(20 * BLOCK + 3)] for m in (47, 53)]
            for prompt, holder in ((evicted, home), *((p, other) for p in on_other)):
                sent = client.post("/v1/route", json={"token_ids": prompt,
                                                      "candidates": [holder]})
                assert sent.status_code == 200 and sent.json()["instance"] == holder
            sim.complete(0, on_home, max_tokens=1)
            wait_for(lambda: (a := client.post("/v1/route", json={
                "token_ids": on_home, "probe": True}).json()).get("instance") == home
                and a["matched_tokens"] == 20 * BLOCK, "H's prompt indexed")
            served: list[tuple[int, str]] = []

            async def scenario() -> dict:
                streams = await _open_mixed(server.url, [on_home] * 8, served)
                try:
                    async with httpx.AsyncClient(base_url=server.url,
                                                 timeout=HTTP_TIMEOUT) as probe:
                        answer = await probe.post("/v1/route", json={
                            "token_ids": evicted, "probe": True, "all_scores": True})
                        return answer.json()
                finally:
                    for stream in reversed(streams.streams):  # type: ignore[attr-defined]
                        await stream.__aexit__(None, None, None)
                    await streams.aclose()

            answer = asyncio.run(scenario())
            assert [i for _, i in served] == [home] * 8
            scores = {s["instance"]: s for s in answer["scores"]}
            assert scores[other]["load"]["inflight"] == 0 < scores[home]["load"]["inflight"]
            assert scores[other]["cost_terms"]["crowding"] > 0
            assert answer["instance"] == home, answer["scores"]
