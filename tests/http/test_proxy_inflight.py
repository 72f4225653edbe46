"""The proxy's in-flight accounting under overlapping requests: every forwarded request is
released exactly once, however its response ends.

Real simulated vLLM instances behind the proxy; the clients are real HTTP clients (through
uvicorn) or, where the ASGI server itself must cancel the request, the ASGI app driven
directly with its lifespan running, as a server would drive it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import anyio
import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.http.app import create_app
from kvroute.sim.cluster import SimCluster
from tests.support.following import following
from tests.support.scores import inflight_counts
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, run_async, scaled, wait_for, wait_until

BLOCK = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    # Steps take real time, so requests really overlap inside the engines.
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, stream_interval_s=0.01,
                    time_scale=1.0) as sim:
        yield sim


def proxy_settings() -> Settings:
    # Some tests below address the app in-process as http://kvroute.
    return Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                    placement_ttl=0.0, load_interval=0.0, allowed_hosts=("kvroute", "127.0.0.1"))


def test_overlapping_requests_that_end_every_way_are_all_released(cluster: SimCluster):
    """Streamed and non-streamed, complete, abandoned mid-stream and abandoned before the
    answer, 16 at a time: afterwards every worker's count is back at zero."""
    with following(cluster, proxy_settings()) as http:
        rng = random.Random(17)
        outcomes: dict[str, int] = {}

        async def one(client: httpx.AsyncClient, i: int) -> None:
            stream = i % 2 == 0
            ending = rng.choice(["complete", "complete", "leave-early", "leave-mid-stream"])
            body = {"model": "sim-model", "prompt": unique_tokens(i % 6, 12 * BLOCK)
                    + unique_tokens(100 + i, 3 * BLOCK), "max_tokens": 40, "stream": stream}
            try:
                if ending == "leave-early":  # gone before the (first byte of the) answer
                    await client.post("/v1/completions", json=body, timeout=0.05)
                elif stream:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        assert resp.status_code == 200
                        async for _ in resp.aiter_raw():
                            if ending == "leave-mid-stream":
                                break
                else:
                    resp = await client.post("/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
            except httpx.TimeoutException:
                pass
            outcomes[ending] = outcomes.get(ending, 0) + 1

        async def traffic() -> None:
            limits = httpx.Limits(max_connections=16)
            async with httpx.AsyncClient(base_url=http.base_url, timeout=HTTP_TIMEOUT,
                                         limits=limits) as client:
                gate = asyncio.Semaphore(16)

                async def gated(i: int) -> None:
                    async with gate:
                        await one(client, i)

                await asyncio.gather(*(gated(i) for i in range(64)))

        run_async(traffic, timeout=240)
        assert set(outcomes) == {"complete", "leave-early", "leave-mid-stream"}
        wait_for(lambda: not any(inflight_counts(http).values()),
                 "every in-flight count back at zero", detail=lambda: inflight_counts(http))


@pytest.mark.parametrize("cancel", ["anyio cancel scope", "asyncio task cancelled twice"])
def test_a_request_cancelled_inside_the_asgi_server_is_released(cluster: SimCluster, cancel):
    """The server cancels the request's task while the answer streams (as a server does on
    shutdown or when its own timeout fires); the count still returns to zero."""
    app = create_app(proxy_settings())

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            service = app.state.service
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvroute") as c:
                for url in cluster.urls:
                    assert (await c.post("/v1/instances", json={"url": url})).status_code == 201
            await wait_until(lambda: all(w.state == "live" for w in service.registry.workers()),
                             "both instances live")
            for i in range(6):
                body = json.dumps({"model": "sim-model", "prompt": unique_tokens(200 + i, 40),
                                   "max_tokens": 200, "stream": True}).encode()
                await _streamed_then_cancelled(app, body, cancel)
                assert service.inflight.total() == 0, f"request {i} left {service.inflight}"

    run_async(scenario, timeout=120)


async def _streamed_then_cancelled(app, body: bytes, cancel: str) -> None:
    """Call the ASGI app for one streamed completion; cancel it after two body chunks."""
    request_sent = False
    forever = asyncio.Event()
    chunks = 0
    enough = asyncio.Event()

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await forever.wait()  # the client never leaves: only the server cancels
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body" and message.get("body"):
            chunks += 1
            if chunks >= 2:
                enough.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "headers": [(b"host", b"kvroute"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    with anyio.fail_after(scaled(30)):
        if cancel == "anyio cancel scope":
            async with anyio.create_task_group() as group:
                group.start_soon(app, scope, receive, send)
                await enough.wait()
                group.cancel_scope.cancel()
        else:
            task = asyncio.create_task(app(scope, receive, send))
            await enough.wait()
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()  # and again, while it cleans up
            await asyncio.gather(task, return_exceptions=True)
