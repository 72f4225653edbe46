"""The harness's own view of one engine's KV-event stream.

kvroute is the system under test, so the harness does not ask it when the
engine has finished publishing: it subscribes to the engine's PUB socket
itself. That gives "the last seq the engine published", which kvroute's
``last_seq`` must reach before the next question is fair (the index trails
the engine by one step), and it shows which event types the engine really
sent (evictions, AllBlocksCleared) so a check can tell "vLLM did not evict"
apart from "kvroute missed the eviction".
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import msgspec
import zmq


@dataclass(frozen=True, slots=True)
class TappedBatch:
    seq: int
    arrived: float  # time.monotonic()
    event_types: tuple[str, ...]


def _event_type(event: object) -> str:
    if isinstance(event, dict):
        return str(event.get("type", "?"))
    if isinstance(event, list | tuple) and event:
        return str(event[0])
    return "?"


class EventTap:
    """A SUB socket on one engine's PUB endpoint, read by a daemon thread.

    The socket reconnects by itself when the engine restarts on the same port;
    a seq below the last one seen starts a new epoch (:attr:`restarts`).
    """

    def __init__(self, name: str, endpoint: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._batches: list[TappedBatch] = []
        self._types: Counter[str] = Counter()
        self.restarts = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            try:
                payload = decoder.decode(frames[2])
                events = payload[1]
            except (msgspec.DecodeError, IndexError, TypeError):
                events = []
            batch = TappedBatch(seq, time.monotonic(), tuple(_event_type(e) for e in events))
            with self._lock:
                if self._batches and seq <= self._batches[-1].seq:
                    self.restarts += 1
                self._batches.append(batch)
                self._types.update(batch.event_types)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._batches)

    @property
    def last_seq(self) -> int | None:
        with self._lock:
            return self._batches[-1].seq if self._batches else None

    def event_counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self._types)

    def batches_since(self, count: int) -> list[TappedBatch]:
        with self._lock:
            return list(self._batches[count:])

    def wait_for_count(self, count: int, timeout: float) -> bool:
        """Wait until at least ``count`` batches arrived in total."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count >= count:
                return True
            time.sleep(0.005)
        return self.count >= count

    def wait_quiet(self, window: float, timeout: float) -> None:
        """Wait until no batch has arrived for ``window`` seconds (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                last = self._batches[-1].arrived if self._batches else 0.0
            if time.monotonic() - last >= window:
                return
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()
