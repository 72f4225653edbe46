"""A client of kvroute in a process of its own: routes (a 1k-token probe) and ``/healthz``
back to back until its stdin closes, then their round trips in ms (and when each route
began, ``time.monotonic()``: the clock of the benchmark's other stamps) as one JSON line.

Its own process because in the benchmark's process the probe shared the GIL with the
thread that watches ingest (it parses every worker's scores): a round trip then included
waiting for that thread, up to the interpreter's 5 ms switch interval, which is no part of
what kvroute answers.

With ``--placing`` its routes are real ones (no ``probe``), each for another prompt: every
answer leaves a placement guess on the worker it names, as a gateway's routes do.

Usage: python -m benchmarks.route_probe PORT [--placing] (ingest_bench.Prober starts it).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main() -> None:
    port = int(sys.argv[1])
    placing = "--placing" in sys.argv[2:]
    stop = threading.Event()
    # The owner closes stdin to stop the probe; reading it to the end waits for that.
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    body: dict = {"token_ids": list(range(1024)), "probe": not placing}
    routes: list[float] = []
    began: list[float] = []
    health: list[float] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        print(json.dumps({"ready": True}), flush=True)
        while not stop.is_set():
            began.append(time.monotonic())
            if placing:  # another prompt each time: guesses spread over the workers
                body["token_ids"] = list(range(len(began) << 10, (len(began) + 1) << 10))
            started = time.perf_counter()
            http.post("/v1/route", json=body).raise_for_status()
            middle = time.perf_counter()
            http.get("/healthz").raise_for_status()
            routes.append(1000 * (middle - started))
            health.append(1000 * (time.perf_counter() - middle))
    print(json.dumps({"routes": routes, "began": began[:len(routes)], "health": health}),
          flush=True)


if __name__ == "__main__":
    main()
