"""One simulated vLLM instance: ``dp_size`` ranks (``kvroute.sim.rank``) behind one HTTP server
(``kvroute.sim.api``).

Ownership: a ``SimInstance`` owns its ranks (each an engine, an ``EventPublisher`` and a
stepping thread) and one uvicorn server on a thread. ``stop()`` releases all of them; nothing
outlives it. HTTP requests go to the rank the ``X-data-parallel-rank`` header names, as in
vLLM, else to the least loaded; benchmarks drive the ranks' engines directly instead.

Observability for tests: ``responses`` holds the bytes of the last ``RECORDED_RESPONSES``
generation responses by id (what was actually sent, also for a response cut short), and
``aborted`` counts responses whose client went away before their end. ``received`` lists the
last ``RECORDED_RESPONSES`` generation requests as they arrived (path, headers, the rank that
ran each, the status it was answered with), refused ones included: who served what, as a
load balancer in front of the instances sent it.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import uvicorn

from kvroute.sim.api import ReceivedRequest, build_app
from kvroute.sim.engine import Engine
from kvroute.sim.rank import SimRank
from kvroute.sim.spec import SimInstanceSpec

__all__ = ["HOST", "RECORDED_RESPONSES", "ReceivedRequest", "SimInstance"]

HOST = "127.0.0.1"
RECORDED_RESPONSES = 256



class SimInstance:
    """A simulated vLLM server; ``start()`` binds free loopback ports, ``stop()`` frees them."""

    def __init__(self, config: SimInstanceSpec | None = None) -> None:
        self.config = config or SimInstanceSpec()
        if self.config.sources_shape not in ("v0.32", "list", "sources"):
            raise ValueError(f"sources_shape must be 'v0.32', 'list' or 'sources', "
                             f"not {self.config.sources_shape!r}")
        self.ranks: list[SimRank] = []
        self.url = ""
        self.kv_port = 0
        self.replay_port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._next_rank = 0
        self.responses: OrderedDict[str, bytes] = OrderedDict()
        self.aborted = 0
        self.received: deque[ReceivedRequest] = deque(maxlen=RECORDED_RESPONSES)
        self._record_lock = threading.Lock()

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for r in self.ranks]

    def __enter__(self) -> SimInstance:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_ranks()
            self._start_http()
        except BaseException:
            self.stop()
            raise

    def _start_ranks(self) -> None:
        n = self.config.dp_size
        host = self.config.host
        rng = random.Random()
        for _attempt in range(50):
            # One rank binds port 0; several need consecutive ports, as vLLM uses: bind at a
            # random base, and take another base if any of them is taken.
            base, replay = ((0, 0) if n == 1 else
                            (rng.randrange(20000, 40000 - n), rng.randrange(40000, 60000 - n)))
            ranks = [
                SimRank(self.config, r, f"tcp://{host}:{base + r}", f"tcp://{host}:{replay + r}")
                for r in range(n)
            ]
            started: list[SimRank] = []
            try:
                for rank in ranks:
                    rank.start()
                    started.append(rank)
            except Exception:  # a port taken between probing and binding: try other ports
                for rank in started:
                    rank.close()
                with contextlib.suppress(Exception):
                    ranks[len(started)].publisher.close()
                continue
            self.ranks = ranks
            self.kv_port = int(ranks[0].endpoint.rsplit(":", 1)[1])
            self.replay_port = int(ranks[0].replay_endpoint.rsplit(":", 1)[1])
            return
        raise RuntimeError("could not bind KV-event ports on loopback after 50 attempts")

    def _start_http(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.http_port))
        self._sock = sock
        port = sock.getsockname()[1]
        self.url = f"http://{self.config.host}:{port}"
        config = uvicorn.Config(
            build_app(self), log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="sim-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the simulated vLLM HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        for rank in self.ranks:
            rank.close()
        self._server = self._thread = self._sock = None
        self.ranks = []

    # --- behaviour behind the HTTP routes -----------------------------------------------------

    def pick_rank(self, requested: int | None) -> SimRank:
        """The rank named by the caller, else the least loaded (vLLM's DP balancing)."""
        if requested is not None:
            return self.ranks[requested]
        return min(self.ranks, key=lambda r: (r.load(), r.rank))

    def kv_event_sources(self) -> list[dict[str, Any]]:
        """Each rank's endpoints as a subscriber dials them (loopback)."""
        return [
            {
                "data_parallel_rank": r.rank,
                "endpoint": r.endpoint,
                "replay_endpoint": r.replay_endpoint,
                "topic": self.config.topic,
            }
            for r in self.ranks
        ]

    def kv_event_sources_body(self) -> Any:
        """``GET /kv_event_sources`` in the configured shape. vLLM 0.32.0 returns each rank's
        resolved KVEventsConfig keyed by the rank as a string, with the bind host verbatim
        ("*" when bound to every interface, which is how it is usually configured)."""
        sources = self.kv_event_sources()
        shape = self.config.sources_shape
        if shape == "list":
            return sources
        if shape == "sources":
            return {"sources": sources}
        return {
            str(s["data_parallel_rank"]): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": _wildcard(s["endpoint"]),
                "replay_endpoint": _wildcard(s["replay_endpoint"]),
                "buffer_steps": self.config.buffer_steps,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": s["topic"],
            }
            for s in sources
        }

    def record(self, response_id: str, sent: bytes, *, aborted: bool = False) -> None:
        """Remember what a generation response sent (see the module docstring)."""
        with self._record_lock:
            self.responses[response_id] = sent
            while len(self.responses) > RECORDED_RESPONSES:
                self.responses.popitem(last=False)
            self.aborted += aborted

    def note_received(self, request: ReceivedRequest) -> None:
        """Remember a generation request (see the module docstring)."""
        with self._record_lock:
            self.received.append(request)

    def received_with(self, header: str, value: str) -> list[ReceivedRequest]:
        """The recorded requests whose ``header`` is ``value`` (an X-Request-Id, say)."""
        with self._record_lock:
            return [r for r in self.received if r.header(header) == value]

    def reset_prefix_cache(self) -> bool:
        ok = True
        for rank in self.ranks:
            with rank.lock:
                ok = rank.engine.reset_prefix_cache() and ok
        return ok


def _wildcard(endpoint: str) -> str:
    return "tcp://*:" + endpoint.rsplit(":", 1)[1] if endpoint.startswith("tcp://") else endpoint
