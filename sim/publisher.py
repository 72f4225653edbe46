"""A stand-in for vLLM's ZMQ KV-event publisher, wire-exact, for tests and the simulator.

What it reproduces (facts from vLLM's ZmqEventPublisher, docs/wire-protocol.md):

- a PUB socket sending ``[topic, seq (8 bytes big-endian, from 0), payload]``;
- a ROUTER replay socket: a DEALER sends ``[b"", start_seq]`` and gets every buffered batch
  with ``seq >= start_seq``, then an end marker. ``replay_format="new"`` (vLLM 0.32.0) sends
  ``[b"", topic, seq, payload]`` and ends with ``[b"", b"", END_SEQ, b""]``; ``"old"`` sends
  ``[b"", seq, payload]`` and ends with ``[b"", END_SEQ, b""]``;
- a bounded replay buffer of the last ``buffer_steps`` batches; a batch is sent live first and
  buffered right after, by the same thread that answers replays, so a replay always contains
  every batch already sent live.

Ownership: one background thread owns both sockets (ZMQ sockets are not thread-safe); callers
only enqueue. ``publish`` assigns the seq in the caller's thread, so its return value is the
seq the batch goes out with.

Test hooks: ``drop_live`` (a batch is buffered but never sent live, like a high-water-mark
drop), ``drop_from_next_replay`` (the replay ROUTER's HWM drop), ``stall_replays``
(answers that never end, or trickle), ``publish_raw`` (any
payload bytes, e.g. garbage), ``restart`` (seq back to 0 and an empty buffer on the same
sockets, like an engine restart the subscriber did not see as a disconnect), and ``close``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Literal

import zmq

from kvroute.app.ingest.wire import END_SEQ, Encoding, Event, encode_batch, encode_seq

ReplayFormat = Literal["new", "old"]

_POLL_MS = 20
_STOP = object()
_RESTART = object()


class EventPublisher:
    """Publishes event batches exactly as one vLLM data-parallel rank does.

    Endpoints may use port 0 (``tcp://127.0.0.1:0``) to pick a free port; ``endpoint`` and
    ``replay_endpoint`` hold the bound addresses once ``start()`` returned.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "kv-events",
        encoding: Encoding = "map",
        replay_format: ReplayFormat = "new",
        buffer_steps: int = 10_000,
        *,
        dp_rank: int | None = 0,
        hwm: int = 100_000,
        ctx: zmq.Context | None = None,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', not {encoding!r}")
        if replay_format not in ("new", "old"):
            raise ValueError(f"replay_format must be 'new' or 'old', not {replay_format!r}")
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self.replay_format: ReplayFormat = replay_format
        self.buffer_steps = buffer_steps
        self.dp_rank = dp_rank
        self._hwm = hwm
        # A context of its own unless given one: terminating it when the publisher closes
        # waits until ZMQ has really released the ports (closing a socket alone returns
        # before its listener is gone), so a restarted engine can bind them again at once.
        self._owns_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._queue: queue.Queue[object] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._drop: set[int] = set()
        self._drop_replay: set[int] = set()
        self._cut_replay: int | None = None
        self._stalled = False
        self._frame_delay = 0.0
        self._replay_starts: list[int] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._replays_served = 0

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EventPublisher:
        """Bind both sockets (in the publisher thread) and return once they are bound."""
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            raise RuntimeError(f"publisher could not bind: {self._error}") from self._error
        if not self._ready.is_set():
            raise RuntimeError("publisher thread did not start within 10 s")
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close both sockets (subscribers see a disconnect)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publishing -----------------------------------------------------------------------------

    def publish(self, events: Iterable[Event], dp_rank: int | None = None) -> int:
        """Queue one batch; returns its seq. ``dp_rank`` defaults to the publisher's rank."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        payload = encode_batch(events, dp_rank=rank, encoding=self.encoding)
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Queue arbitrary payload bytes as one batch (fault tests send garbage this way)."""
        with self._seq_lock:
            seq = self._next_seq
            self._next_seq += 1
            self._queue.put((seq, payload))
        return seq

    def drop_live(self, seqs: Iterable[int]) -> None:
        """These seqs will be buffered for replay but never sent live (a silent HWM drop)."""
        with self._seq_lock:
            self._drop.update(seqs)

    def drop_from_next_replay(self, seqs: Iterable[int]) -> None:
        """The next replay answer leaves these seqs out (the ROUTER's own HWM drop)."""
        with self._seq_lock:
            self._drop_replay.update(seqs)

    def cut_next_replay(self, after: int) -> None:
        """The next replay answer stops after ``after`` batches, with no end marker (an
        answer that stalls: the subscriber's wait for the next frame times out)."""
        with self._seq_lock:
            self._cut_replay = after

    def stall_replays(self, stalled: bool = True, frame_delay: float = 0.0) -> None:
        """While ``stalled``, every replay answer sends its batches and never its end
        marker; ``frame_delay`` seconds pass before each replayed frame (an answer that
        trickles: the publisher's thread sleeps, so live batches wait too)."""
        with self._seq_lock:
            self._stalled = stalled
            self._frame_delay = frame_delay

    def restart(self) -> None:
        """Like an engine restart: seq back to 0 and the buffer emptied; same sockets."""
        with self._seq_lock:
            self._next_seq = 0
            self._drop.clear()
            self._queue.put(_RESTART)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything queued so far has been sent and buffered."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            raise TimeoutError("publisher did not drain its queue in time")

    def buffered_seqs(self) -> list[int]:
        """Seqs currently in the replay buffer (a snapshot; call ``flush`` first)."""
        return [seq for seq, _ in list(self._buffer)]

    def buffered(self) -> list[tuple[int, bytes]]:
        return list(self._buffer)

    @property
    def replay_starts(self) -> list[int]:
        """The start seq of every replay request served, in order."""
        with self._seq_lock:
            return list(self._replay_starts)

    @property
    def replays_served(self) -> int:
        return self._replays_served

    # --- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        pub = replay = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            self.endpoint = _bound(pub)
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = _bound(replay)
        except zmq.ZMQError as exc:
            self._error = exc
            self._release(pub, replay)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        finally:
            self._release(pub, replay)

    def _release(self, *sockets: zmq.Socket | None) -> None:
        for sock in sockets:
            if sock is not None:
                sock.close(0)
        if self._owns_ctx:
            self._ctx.term()

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._serve_replay(replay)
            try:
                item = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            if item is _RESTART:
                self._buffer.clear()
            elif isinstance(item, threading.Event):
                item.set()
            else:
                seq, payload = item  # type: ignore[misc]
                if seq in self._drop:
                    self._drop.discard(seq)
                else:
                    pub.send_multipart((self.topic, encode_seq(seq), payload))
                self._buffer.append((seq, payload))

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        # [identity, b"", start_seq]; vLLM ignores anything else, so do we.
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        identity, _, start_frame = frames
        start = int.from_bytes(start_frame, "big")
        self._replays_served += 1
        with self._seq_lock:
            self._replay_starts.append(start)
            skip, self._drop_replay = self._drop_replay, set()
            cut, self._cut_replay = self._cut_replay, None
            stalled, frame_delay = self._stalled, self._frame_delay
        for seq, payload in list(self._buffer):
            if seq < start or seq in skip:
                continue
            if cut is not None:
                if cut == 0:
                    return
                cut -= 1
            if frame_delay:
                time.sleep(frame_delay)
            if self.replay_format == "new":
                replay.send_multipart((identity, b"", self.topic, encode_seq(seq), payload))
            else:
                replay.send_multipart((identity, b"", encode_seq(seq), payload))
        if stalled:
            return
        if self.replay_format == "new":
            replay.send_multipart((identity, b"", b"", END_SEQ, b""))
        else:
            replay.send_multipart((identity, b"", END_SEQ, b""))


def _bound(sock: zmq.Socket) -> str:
    """The address a socket is bound to, with the real port when port 0 or * was asked for."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)
