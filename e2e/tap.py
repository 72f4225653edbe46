"""The harness's own view of one engine's KV-event stream.

kvroute is the system under test, so the harness does not ask it when the
engine has finished publishing: it subscribes to the engine's PUB socket
itself. That gives "the last seq the engine published", which kvroute's
``last_seq`` must reach before the next question is fair (the index trails
the engine by one step), and it shows which event types the engine really
sent (evictions, AllBlocksCleared) so a check can tell "vLLM did not evict"
apart from "kvroute missed the eviction".

It also keeps a brute-force model of what the engine holds: a reference
count per block hash (vLLM stores a hash again when it recomputes a block and
removes each copy separately), emptied by AllBlocksCleared and by an engine
restart. The number of distinct hashes held is what kvroute's holdings for
that worker must equal.
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


def _block_hashes(event: object) -> list[object]:
    """Hashes of a map-encoded BlockStored/BlockRemoved (vLLM 0.32.0's encoding)."""
    if isinstance(event, dict):
        hashes = event.get("block_hashes") or []
        return [bytes(h) if isinstance(h, bytearray) else h for h in hashes]
    return []


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
        self._held: Counter[object] = Counter()  # block hash -> stores of it since its removal
        self.restarts = 0
        self._epoch_start = 0  # index of the first batch of the engine now running
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
                    self._held.clear()  # a new engine starts with an empty cache
                self._batches.append(batch)
                self._types.update(batch.event_types)
                for event, kind in zip(events, batch.event_types, strict=False):
                    self._apply(event, kind)

    def _apply(self, event: object, kind: str) -> None:
        if kind == "BlockStored":
            self._held.update(_block_hashes(event))
        elif kind == "BlockRemoved":
            # kvroute's rule (docs/decisions.md): a removal ends the hash however often it
            # was stored, since a reuse report is a store no removal pairs.
            for block_hash in _block_hashes(event):
                self._held.pop(block_hash, None)
        elif kind == "AllBlocksCleared":
            self._held.clear()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._batches)

    @property
    def last_seq(self) -> int | None:
        """The last seq the engine now running published (None: none yet)."""
        with self._lock:
            return self._batches[-1].seq if len(self._batches) > self._epoch_start else None

    @property
    def held_blocks(self) -> int:
        """Distinct block hashes the engine holds, according to its own events."""
        with self._lock:
            return len(self._held)

    def forget_epoch(self) -> None:
        """The engine was stopped: whatever it held is gone with it, and the seqs it
        published say nothing about the engine that comes next."""
        with self._lock:
            self._held.clear()
            self._epoch_start = len(self._batches)

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


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay_seqs(endpoint: str, start_seq: int = 0, timeout: float = 5.0) -> list[int]:
    """The seqs an engine's replay endpoint sends for a request from ``start_seq``: what
    its buffer still holds (vLLM keeps the last ``buffer_steps`` batches).

    The harness asks the engine itself, so a check can show that a kvroute starting from
    nothing could not have learned a batch from the replay. Raises TimeoutError when the
    answer does not end (with vLLM's end marker) within ``timeout`` seconds."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        seqs: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise TimeoutError(f"{endpoint}: the replay from seq {start_seq} did not end "
                                   f"within {timeout:.0f}s ({len(seqs)} batches received)")
            frames = sock.recv_multipart()
            if len(frames) != 4:  # empty delimiter, topic, seq, payload
                continue
            if frames[2] == END_SEQ:
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        sock.close(linger=0)
        ctx.term()
