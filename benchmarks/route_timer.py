"""Routes and `/healthz` timed from a process of their own, while the benchmark does other
things (adds and removes instances with a pool of threads, lists the fleet).

Why a process: timed from a thread of the process that also sends the fleet changes, a
route's answer waited for Python's global interpreter lock whenever another thread held it
(decoding a listing of a thousand instances, say), up to the 5 ms switch interval, and
that wait was counted as kvroute's latency. A process of its own has the lock to itself:
what it measures is kvroute, the network stack and the machine.

Protocol: `RouteTimer.start()` returns once the process is ready (connected, one route
answered); `go()` starts the timing; `finish()` stops it and returns the latencies, the
process still running (so its CPU can be read), and `close()` ends it.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import httpx

__all__ = ["RouteTimer", "time_routes"]


def time_routes(http: httpx.Client, prompt: list[int],
                keep_going: Any) -> tuple[list[float], list[float]]:
    """Route the prompt (a probe), then GET /healthz, while `keep_going()`; latencies, ms."""
    routes, health = [], []
    while keep_going():
        t = time.perf_counter()
        answer = http.post("/v1/route", json={"token_ids": prompt, "probe": True})
        routes.append((time.perf_counter() - t) * 1000)
        assert answer.status_code == 200, answer.text
        t = time.perf_counter()
        http.get("/healthz")
        health.append((time.perf_counter() - t) * 1000)
    return routes, health


def _child(base: str, prompt: list[int], go: Any, stop: Any, leave: Any, out: Any) -> None:
    with httpx.Client(base_url=base, timeout=60) as http:
        http.post("/v1/route", json={"token_ids": prompt, "probe": True})
        out.put("ready")
        go.wait()
        out.put(time_routes(http, prompt, lambda: not stop.is_set()))
    leave.wait(60)


class RouteTimer:
    def __init__(self, base: str, prompt: list[int]) -> None:
        context = multiprocessing.get_context("spawn")  # no copy of this one's threads
        self._go, self._stop, self._leave = context.Event(), context.Event(), context.Event()
        self._out = context.Queue()
        self._process = context.Process(
            target=_child, args=(base, prompt, self._go, self._stop, self._leave, self._out),
            daemon=True)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None, "not started"
        return self._process.pid

    def start(self) -> RouteTimer:
        self._process.start()
        said = self._out.get(timeout=60)
        assert said == "ready", said
        return self

    def go(self) -> None:
        self._go.set()

    def finish(self) -> tuple[list[float], list[float]]:
        self._stop.set()
        return self._out.get(timeout=60)

    def close(self) -> None:
        self._stop.set()
        self._go.set()
        self._leave.set()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
