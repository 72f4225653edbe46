"""The one publisher process of benchmarks/peer_bench.py: ``--workers`` vLLM-style event
streams (an XPUB socket each, ``[topic, seq, payload]`` frames, seq from 0) and a replay
ROUTER each answering from everything already sent, exactly as vLLM's does.

XPUB rather than PUB: it reports each subscription, so the bench can wait until both
indexers are subscribed to every stream before anything is sent (a PUB drops what it sends
before a subscription arrives). No send high-water mark: nothing is dropped here, so a
batch an indexer misses is its own loss.

Protocol on stdin/stdout, one JSON line each:
- at start it prints ``{"endpoints": [[events, replay], ...]}``;
- ``{"wait": n, "timeout": s}``: answers ``{"subscribed": [count per stream]}`` once every
  stream has n subscriptions (or the timeout passed);
- ``{"send": path}``: sends the ``peer_stream.Mix`` pickled there, the workers' batches
  interleaved, as fast as ZeroMQ takes them; answers ``{"started": t, "sent": t}``
  (``time.monotonic()``, the same clock as the bench's on Linux). With ``"unpublished": k``,
  the first k batches of each worker (all but its last, at most) only go to the replay
  buffer, as batches the subscribers missed: the next live one is a gap of k batches,
  which a subscriber fills from the replay ROUTER (benchmarks.ingest_bench);
- end of stdin: close and exit.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import zmq

from benchmarks.peer_stream import Mix
from kvroute.app.ingest.wire import END_SEQ, encode_seq

TOPIC = b"kv-events"


class _Streams:
    def __init__(self, workers: int) -> None:
        self.ctx = zmq.Context()
        self.pubs: list[zmq.Socket] = []
        self.routers: list[zmq.Socket] = []
        self.sent: list[list[bytes]] = [[] for _ in range(workers)]
        self.subscribed = [0] * workers
        for _ in range(workers):
            pub = self.ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind("tcp://127.0.0.1:0")
            self.pubs.append(pub)
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.SNDHWM, 0)
            router.setsockopt(zmq.LINGER, 0)
            router.bind("tcp://127.0.0.1:0")
            self.routers.append(router)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the XPUB sockets: sender and subscription reader
        self._replayer = threading.Thread(target=self._serve_replays, daemon=True)
        self._replayer.start()

    def endpoints(self) -> list[list[str]]:
        return [[p.getsockopt_string(zmq.LAST_ENDPOINT), r.getsockopt_string(zmq.LAST_ENDPOINT)]
                for p, r in zip(self.pubs, self.routers, strict=True)]

    def read_subscriptions(self) -> None:
        with self._lock:
            for n, pub in enumerate(self.pubs):
                while pub.poll(0):
                    message = pub.recv()
                    if message[:1] == b"\x01":
                        self.subscribed[n] += 1
                    elif message[:1] == b"\x00":
                        self.subscribed[n] -= 1

    def wait(self, count: int, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read_subscriptions()
            if min(self.subscribed) >= count:
                break
            time.sleep(0.05)
        return list(self.subscribed)

    def send(self, mix: Mix, unpublished: int = 0) -> tuple[float, float]:
        for w, payloads in enumerate(mix.payloads):
            self.sent[w] += payloads[:min(unpublished, len(payloads) - 1)]
        started = time.monotonic()
        longest = max(len(p) for p in mix.payloads)
        with self._lock:
            for i in range(longest):
                for w, payloads in enumerate(mix.payloads):
                    if min(unpublished, len(payloads) - 1) <= i < len(payloads):
                        sent = self.sent[w]
                        self.pubs[w].send_multipart([TOPIC, encode_seq(len(sent)), payloads[i]])
                        sent.append(payloads[i])
        return started, time.monotonic()

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        for router in self.routers:
            poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                frames = sock.recv_multipart()
                identity, start = frames[0], int.from_bytes(frames[-1], "big")
                sent = self.sent[self.routers.index(sock)]
                for seq in range(start, len(sent)):
                    sock.send_multipart([identity, b"", TOPIC, encode_seq(seq), sent[seq]])
                sock.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._replayer.join(5)
        for sock in [*self.pubs, *self.routers]:
            sock.close(0)
        self.ctx.term()


def main() -> None:
    workers = int(sys.argv[1])
    streams = _Streams(workers)
    print(json.dumps({"endpoints": streams.endpoints()}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if "wait" in ask:
            answer: dict[str, object] = {"subscribed": streams.wait(ask["wait"], ask["timeout"])}
        else:
            started, sent = streams.send(Mix.load(Path(ask["send"])), ask.get("unpublished", 0))
            answer = {"started": started, "sent": sent}
        print(json.dumps(answer), flush=True)
    streams.close()


if __name__ == "__main__":
    main()
