"""Cache against load, through the real service: a hot prefix's holder gets busy (long
requests running on a simulated instance whose steps take real time, seen through its
/metrics), the prefix spreads once that queue has lasted (app.routing.steady_queue: a swing shorter
than its window does not move a prefix); the requests go away, it comes back."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx

from kvroute.app.config import Settings
from kvroute.app.routing.steady_queue import WINDOW
from kvroute.sim.cluster import SimCluster
from tests.support.following import following, instance_ids
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for

BLOCK = 16
BUSY = 24  # requests kept running on the holder
LONG = 20_000  # tokens: a minute or more of steps, whatever the machine's speed




class Streams:
    """`n` long streaming completions (`max_tokens` each, a few ms a step) held open on one
    instance until `close()`."""

    def __init__(self, url: str, n: int, max_tokens: int = 1000) -> None:
        self._url, self._n, self._max_tokens = url, n, max_tokens
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            async def one(i: int) -> None:
                body = {"model": "sim-model", "prompt": [9000 + i] * 40,
                        "max_tokens": self._max_tokens, "stream": True}
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("POST", f"{self._url}/v1/completions",
                                             json=body) as response:
                        async for _ in response.aiter_raw():
                            if self._stop.is_set():
                                return
            tasks = [asyncio.create_task(one(i)) for i in range(self._n)]
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_hot_prefix_spreads_when_its_holder_is_busy_and_returns_when_load_falls():
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        load_interval=0.1, placement_ttl=0.0)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=40_000, time_scale=1.0) as sim:
        with following(sim, settings) as client:
            holder, other = instance_ids(sim, client)
            hot = [(i * 31) % 20000 + 1 for i in range(20 * BLOCK + 3)]
            sim.complete(0, hot, max_tokens=1)

            def best() -> dict:
                return client.post("/v1/route", json={"token_ids": hot, "probe": True}).json()

            # Before its subscriber is live the holder is refused (503, no "instance").
            wait_for(lambda: (a := best()).get("instance") == holder
                     and a["matched_tokens"] == 20 * BLOCK, "the holder to be known")
            # Requests that last (in a cache that holds them all and the prefix): a queue
            # moves a held prefix only once it has stood for about
            # app.routing.steady_queue's window.
            with Streams(sim.urls[0], BUSY, LONG):
                last: list[dict] = [{}]

                def spread() -> dict | None:
                    last[0] = best()
                    costs = {s["instance"]: s["cost"] for s in last[0]["scores"]}
                    # Strictly: at equal costs a tie's pick may go either way.
                    return last[0] if (last[0]["instance"] == other
                                       and costs[holder] > costs[other]) else None

                busy = wait_for(spread, "the hot prefix to spread away from its busy holder",
                                timeout=scaled(20 * WINDOW), detail=lambda: last[0].get("scores"))
                scores = {s["instance"]: s for s in busy["scores"]}
                # The holder still has the prefix; its queue is what costs more now.
                assert scores[holder]["matched_tokens"] == 20 * BLOCK
                assert scores[holder]["load"]["running"] >= 1
                assert scores[holder]["cost_terms"]["prefill"] < scores[other]["cost_terms"][
                    "prefill"]
                assert scores[holder]["cost"] > scores[other]["cost"]
            back = wait_for(lambda: (a := best())["instance"] == holder and a,
                            "the hot prefix to come back once the holder's load fell")
            assert back["matched_tokens"] == 20 * BLOCK


def test_under_load_new_tokens_pay_for_space_where_other_prefixes_were_sent():
    """Both instances busy, so each is scored with its load: a prompt sent to one makes the
    next new prefix pay `crowding` there (its tokens x 2 x the share of that worker's demand
    above the other's), while the same prompt asked again pays none anywhere: a worker's own
    prefix is not counted against it."""
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        load_interval=0.1, placement_ttl=0.0)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=2048, time_scale=1.0) as sim:
        with following(sim, settings) as client, \
                Streams(sim.urls[0], 2, LONG), Streams(sim.urls[1], 2, LONG):
            first = [(i * 37) % 20000 + 1 for i in range(10 * BLOCK)]
            second = [(i * 41) % 20000 + 7 for i in range(6 * BLOCK)]

            def scores(tokens: list[int]) -> dict[str, dict]:
                answer = client.post("/v1/route", json={"token_ids": tokens, "probe": True})
                return {s["instance"]: s for s in answer.json().get("scores", [])}

            wait_for(lambda: len(s := scores(second)) == 2
                     and all((w["load"]["running"] or 0) >= 1 for w in s.values()),
                     "both instances to be scored with their running requests")
            sent = client.post("/v1/route", json={"token_ids": first}).json()["instance"]
            crowded = scores(second)
            assert crowded[sent]["cost_terms"]["crowding"] == 2.0 * len(second)
            assert [w["cost_terms"]["crowding"] for i, w in crowded.items() if i != sent] == [0.0]
            again = scores(first)
            assert [w["cost_terms"]["crowding"] for w in again.values()] == [0.0, 0.0]
