"""What a fleet that keeps changing leaves behind under the garbage-collector freezes of
`kvroute serve` (app.fleet.gc_freeze): instances added and removed through the API, over and
over, with what the process keeps measured after every cycle.

kvroute runs in this process (the real HTTP API on a free port, its fleet frozen as
`kvroute serve` freezes it), its instances' publishers too (simulated, one thread each);
the client that changes the fleet runs in a process of its own, so none of its objects is
frozen with kvroute's, and asks routes all through a cycle. Every cycle registers
INSTANCES instances of RANKS workers through `POST /v1/instances`, each with a `url`
whose HTTP server (in the client's process) answers /v1/models and /metrics, so the load
monitor scrapes them as it does real engines; waits until every one is live, and removes
them (`DELETE`). After each cycle, once the freezer is quiet: the objects in the
permanent generation (`gc.get_freeze_count()`), the objects the collector tracks besides,
and RSS. At the end the permanent generation is unfrozen and collected: the objects that
collection frees are cyclic garbage the freezes kept. Twice in one run: without
re-freezes (as before they were made), then with them (`gc_refreeze_interval`), waiting
after the last cycle for the first re-freeze (after 5 s of quiet) and timing its pause.
`--fleet` registers a standing fleet first, to time the re-freeze of a big one. Prints
JSON and a table (benchmarks.report).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from benchmarks.peer_sides import rss_bytes
from benchmarks.report import emit
from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.publisher import EventPublisher

INSTANCES = 8
RANKS = 2
PUBLISHERS = 4
FLEET_RANKS = 8  # of the standing fleet's instances


def _wait(check, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _quiet(server: BackgroundServer) -> bool:
    """Whether the freezer has nothing under way (no added worker still settling)."""
    freezer = server.freezer
    return freezer is not None and freezer.quiet()


def _route(url: str, routing: threading.Event) -> None:
    """Routes asked while a cycle runs (as a fleet's gateways keep asking)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        while routing.wait(1) or threading.main_thread().is_alive():
            if routing.is_set():
                http.post("/v1/route", json={"token_ids": list(range(1, 200))})


class _Engine(BaseHTTPRequestHandler):
    """What kvroute asks of an instance's HTTP server: its models and its /metrics."""

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = (b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
                if self.path == "/v1/models" else _METRICS)
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


_METRICS = (b'vllm:num_requests_running{model_name="m"} 1\n'
            b'vllm:num_requests_waiting{model_name="m"} 0\n'
            b'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')


def _register(http: httpx.Client, ids: list[str], ranks: int,
              endpoints: list[tuple[str, str]], url: str | None) -> None:
    for n, instance in enumerate(ids):
        chosen = [endpoints[(n * ranks + r) % len(endpoints)] for r in range(ranks)]
        answer = http.post("/v1/instances", json={
            "id": instance, "block_size": 16, "events": [e for e, _ in chosen],
            "replay": [r for _, r in chosen],
            **({"url": url, "model": "m"} if url else {})})
        assert answer.status_code == 201, answer.text
    _wait(lambda: all(i["state"] == "live" for i in
                      http.get("/v1/instances").json()["instances"]),
          "the registered instances to go live", 180)


def _drive(conn, url: str, endpoints: list[tuple[str, str]], with_url: bool,
           fleet: int) -> None:
    """In a process of its own (so that its objects are not frozen with kvroute's): the
    standing fleet first, then one cycle each time the parent asks, then "done"."""
    engine = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    engine_url = f"http://127.0.0.1:{engine.server_address[1]}" if with_url else None
    routing = threading.Event()
    router = threading.Thread(target=_route, args=(url, routing), daemon=True)
    router.start()
    with httpx.Client(base_url=url, timeout=60) as http:
        _register(http, [f"f{n:04d}" for n in range(fleet // FLEET_RANKS)], FLEET_RANKS,
                  endpoints, None)
        conn.send("ready")
        while (cycle := conn.recv()) is not None:
            routing.set()
            ids = [f"c{cycle}-{n}" for n in range(INSTANCES)]
            _register(http, ids, RANKS, endpoints, engine_url)
            for instance in ids:
                assert http.delete(f"/v1/instances/{instance}").status_code in (200, 204)
            routing.clear()
            conn.send("done")
    router.join(30)
    engine.shutdown()


def _answer(conn, driver, what: str) -> None:
    deadline = time.monotonic() + 300
    while not conn.poll(0.5):
        if not driver.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the driver did not say {what!r}")
    conn.recv()


def churn(cycles: int, settle: float, with_url: bool, refreeze_interval: float,
          fleet: int) -> dict:
    """`cycles` cycles with re-freezes every `refreeze_interval` seconds at most (0: none,
    as before re-freezes were made), beside a standing fleet of `fleet` workers; then,
    when re-freezing, until the first re-freeze after the last cycle."""
    publishers = [EventPublisher().start() for _ in range(PUBLISHERS)]
    endpoints = [(p.endpoint, p.replay_endpoint) for p in publishers]
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        # it also sizes the ZMQ context, as if each instance had one worker
                        max_instances=fleet + INSTANCES * RANKS + 16,
                        gc_refreeze_interval=refreeze_interval)
    rows = []
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    refreeze = None
    try:
        with BackgroundServer(settings, freeze_fleet=True) as server:
            _wait(lambda: server.freezer is not None and server.freezer.freezes >= 2,
                  "the start-up freezes")
            freezer = server.freezer
            driver = spawn.Process(target=_drive, args=(theirs, server.url, endpoints,
                                                         with_url, fleet))
            driver.start()
            try:
                _answer(ours, driver, "ready")
                for cycle in range(cycles):
                    ours.send(cycle)
                    _answer(ours, driver, "done")
                    _wait(lambda: _quiet(server), "the freezer to settle")
                    time.sleep(settle)
                    rows.append({"cycle": cycle + 1, "frozen": gc.get_freeze_count(),
                                 "tracked": len(gc.get_objects()),
                                 "rss_mb": rss_bytes(os.getpid()) / 2**20,
                                 "freezes": freezer.freezes,
                                 "refreezes": freezer.refreezes})
                longest = freezer.longest_freeze  # collection and freeze, before the re-freeze
                if refreeze_interval > 0:
                    done = freezer.refreezes
                    _wait(lambda: freezer.refreezes > done, "a re-freeze",
                          refreeze_interval + 60)
                    refreeze = {"frozen": gc.get_freeze_count(),
                                "pause_ms": freezer.last_refreeze_pause * 1000,
                                "freed": freezer.last_refreeze_freed}
            finally:
                ours.send(None)
                driver.join(30)
    finally:
        for pub in publishers:
            pub.close()
    gc.unfreeze()
    kept = gc.collect()
    first, last = rows[0], rows[-1]
    per_cycle = (last["frozen"] - first["frozen"]) / max(1, len(rows) - 1)
    return {"refreeze_interval": refreeze_interval, "fleet_workers": fleet, "rows": rows,
            "frozen_growth_per_cycle": per_cycle, "after_refreeze": refreeze,
            "longest_freeze_ms": longest * 1000,
            "cyclic_garbage_kept": kept}


def _table(result: dict) -> list[str]:
    interval = result["refreeze_interval"]
    table = [f"\nre-freeze: {f'at most every {interval:g} s' if interval else 'off'}, "
             f"beside {result['fleet_workers']:,} standing workers",
             "| cycle | frozen objects | tracked besides | RSS | freezes | re-freezes |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['cycle']} | {r['frozen']:,} | {r['tracked']:,} | {r['rss_mb']:.0f} MB | "
              f"{r['freezes']} | {r['refreezes']} |" for r in result["rows"]]
    table.append(f"frozen objects gained per cycle: {result['frozen_growth_per_cycle']:.0f}; "
                 f"longest freeze (its collection included): "
                 f"{result['longest_freeze_ms']:.1f} ms")
    after = result["after_refreeze"]
    if after is not None:
        table.append(f"the re-freeze after the last cycle: {after['pause_ms']:.1f} ms, "
                     f"{after['freed']:,} objects freed, {after['frozen']:,} frozen after it")
    table.append(f"cyclic garbage still kept at the end (freed once unfrozen): "
                 f"{result['cyclic_garbage_kept']:,} objects")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds of quiet after each cycle before measuring")
    parser.add_argument("--no-url", action="store_true",
                        help="changing instances without a `url` (no /metrics scrapes)")
    parser.add_argument("--fleet", type=int, default=0,
                        help=f"standing workers registered first ({FLEET_RANKS} per instance)")
    parser.add_argument("--refreeze", type=float, default=1.0,
                        help="gc_refreeze_interval of the second run (the first: 0, off)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/freeze-churn"))
    args = parser.parse_args()
    runs = [churn(args.cycles, args.settle, not args.no_url, interval, args.fleet)
            for interval in (0.0, args.refreeze)]
    table = [line for run in runs for line in _table(run)]
    emit({"benchmark": "freeze_churn", "instances_per_cycle": INSTANCES, "ranks": RANKS,
          "cycles": args.cycles, "runs": runs}, "\n".join(table),
         out_file=args.out / "freeze_churn.json")


if __name__ == "__main__":
    main()
