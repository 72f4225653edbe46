"""An instance whose /metrics fails is scraped less and less often, and read again at the
interval once it answers: a fleet without metrics (or with many down) costs kvroute little.
A real HTTP server on 127.0.0.1, a real registry and subscriber."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from kvroute.app.config import InstanceConfig
from kvroute.app.load import LoadMonitor
from kvroute.app.registry import Registry
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.conftest import run_async, wait_until

PAGE = b'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_waiting{engine="0"} 1\n'


class _Metrics:
    def __init__(self) -> None:
        self.healthy = False
        self.asked = 0


@contextmanager
def metrics_server(state: _Metrics) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            state.asked += 1
            body = PAGE if state.healthy else b"no metrics here"
            self.send_response(200 if state.healthy else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_failing_scrapes_back_off_and_a_success_reads_again():
    state = _Metrics()
    with EventPublisher() as pub, metrics_server(state) as url:
        async def scenario() -> None:
            async with httpx.AsyncClient() as client:
                registry = Registry(PrefixIndex(), client, max_instances=4)
                await registry.add(InstanceConfig(id="quiet", url=url, events=(pub.endpoint,)),
                                   wait_for_discovery=False)
                monitor = LoadMonitor(registry, client, interval=0.05)
                monitor.start()
                try:
                    await wait_until(lambda: monitor.failure("quiet"), "a failed scrape")
                    await asyncio.sleep(1.5)
                    # Every 0.05 s would be about 30 requests; doubling delays from 0.05 s
                    # make it about 6 (fewer on a slow machine: this cannot fail for that).
                    assert state.asked < 12, state.asked
                    assert monitor.failure("quiet").startswith("GET /metrics answered HTTP 503")
                    state.healthy = True
                    reading = await wait_until(lambda: monitor.get(("quiet", 0)),
                                               "the instance's load read again")
                    assert (reading.running, reading.waiting) == (2.0, 1.0)
                    assert monitor.failure("quiet") is None
                finally:
                    await monitor.stop()
                    await registry.close()

        run_async(scenario, timeout=60)
