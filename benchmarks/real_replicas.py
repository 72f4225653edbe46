"""Kvroute replicas for the real-vLLM benchmark (``benchmarks.real_hitrate``): the
``kvroute-2r*`` routers.

``RedisServer`` is the redis-server the replicas share state through; ``Replicas`` starts
them in front of the same engines and knows which are in service; ``rolling_restart``
restarts them one at a time while the clients go on sending.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from benchmarks.real_fleet import Fleet
from e2e.processes import ManagedProcess, ProcessSet
from e2e.service import Kvroute, KvrouteError

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A redis-server for one run's replicas: a unix socket in a short temporary directory
    (a socket path must stay under ~100 bytes), TCP off, no persistence. Ready once it
    answers with the pid started here; stopped by that process group, like the rest."""

    def __init__(self, procs: ProcessSet, log_dir: Path, timeout: float = 30.0) -> None:
        if not os.access(REDIS_SERVER, os.X_OK):
            raise RuntimeError(f"{REDIS_SERVER} is missing: the replica routers share state "
                               "through a redis-server (Debian: apt-get install redis-server)")
        self.directory = Path(tempfile.mkdtemp(prefix="kvr-redis-"))
        self.socket = self.directory / "redis.sock"
        argv = [REDIS_SERVER, "--port", "0", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--daemonize", "no"]
        self.proc = procs.start(ManagedProcess("redis-server", argv, dict(os.environ),
                                               log_dir / "redis.log"))
        deadline = time.monotonic() + timeout
        while not self._ours():
            code = self.proc.exited()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not come up (exit {code}):\n"
                                   f"{self.proc.log_tail()}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def _ours(self) -> bool:
        if not self.socket.exists():
            return False
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2.0)
        try:
            return int(client.info("server")["process_id"]) == self.proc.pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class Replicas:
    """Kvroute replicas in front of the same engines, and which of them are in service.

    ``in_service`` is what a load balancer's readiness checks would say: a replica leaves it
    before it is stopped and comes back once every engine's worker serves again."""

    def __init__(self, procs: ProcessSet, fleet: Fleet, log_dir: Path, count: int,
                 state_url: str | None, say: Callable[[str], None],
                 tokenizer: str | None = None) -> None:
        self.fleet = fleet
        self.say = say
        self.kvs = [Kvroute(procs, log_dir / f"replica-{i}") for i in range(count)]
        self.settings = {"KVROUTE_PROXY": "false", "KVROUTE_STATE_DIR": ""}
        if tokenizer:  # text prompts: "instance" or a tokenizer.json folder
            self.settings["KVROUTE_TOKENIZER"] = tokenizer
        if state_url is not None:
            self.settings["KVROUTE_STATE_URL"] = state_url
        self.in_service = [False] * count
        self.ids: dict[str, str] = {}
        self.restarts: list[dict[str, Any]] = []

    def start(self, i: int, states: set[str]) -> dict[str, dict[str, Any]]:
        """Start replica ``i``, register the engines, wait until every worker is in one of
        ``states``, put it in service; its workers' state and restore counters."""
        kv = self.kvs[i]
        kv.start(self.settings)
        self.ids = {e.name: kv.register(e.url) for e in self.fleet.engines}
        for iid in self.ids.values():
            kv.wait_state(iid, states, 60.0, self.say, f"replica {i} after registering")
        workers = {}
        for name, iid in self.ids.items():
            worker = kv.worker(iid)
            stats = worker.get("stats", {})
            workers[name] = {"state": worker.get("state"),
                             "restored_blocks": stats.get("restored_blocks", 0),
                             "restored_unconfirmed": stats.get("restored_unconfirmed", 0),
                             "holdings": sum(int(v) for v in
                                             worker.get("holdings", {}).values())}
        self.in_service[i] = True
        return workers

    def start_all(self) -> None:
        for i in range(len(self.kvs)):
            self.start(i, {"live"})
        # The engines were reset before the replicas started: whatever they replay ends empty.
        deadline = time.monotonic() + 15.0
        while any(kv.holdings(iid) for kv in self.kvs for iid in self.ids.values()):
            if time.monotonic() > deadline:
                raise KvrouteError("a replica still holds blocks of reset engines")
            time.sleep(0.1)

    def restart(self, i: int, after: int) -> dict[str, Any]:
        """Out of service, SIGTERM, start again (same port and settings), back in service."""
        self.in_service[i] = False
        started = time.monotonic()
        kv = self.kvs[i]
        kv.stop()
        code = kv.proc.returncode if kv.proc else None
        stopped = time.monotonic() - started
        workers = self.start(i, {"live", "degraded"})
        record = {"replica": i, "after_requests": after, "exit": code,
                  "stop_s": round(stopped, 2),
                  "out_of_service_s": round(time.monotonic() - started, 2), "workers": workers}
        self.restarts.append(record)
        return record

    def stop(self) -> None:
        for kv in self.kvs:
            kv.stop()
            kv.close()


async def rolling_restart(replicas: Replicas, points: list[int], progress: dict[str, Any],
                          say: Callable[[str], None], label: str) -> None:
    """Restart replica i once ``points[i]`` requests are done, one at a time (on a thread:
    the clients go on sending meanwhile)."""
    for i, point in enumerate(points):
        while progress["done"] < point and not progress.get("finished"):
            await asyncio.sleep(0.05)
        if progress.get("finished"):  # the requests ran out first: noted by run_one
            return
        say(f"  {label}: restarting replica {i} after {progress['done']} requests")
        record = await asyncio.to_thread(replicas.restart, i, progress["done"])
        workers = ", ".join(f"{name} {w['state']} restored {w['restored_blocks']}"
                            f"+{w['restored_unconfirmed']} unconfirmed, holds {w['holdings']}"
                            for name, w in record["workers"].items())
        say(f"  {label}: replica {i} back in service after {record['out_of_service_s']}s "
            f"(exit {record['exit']}): {workers}")
