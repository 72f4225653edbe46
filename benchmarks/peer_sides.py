"""The two indexers of benchmarks/peer_bench.py behind one interface: started as processes
of their own, told about the workers, asked how much of a prompt each worker holds.

Like with like: Dynamo's indexer counts the block that holds a prompt's last token, vLLM
and kvroute do not (the engine must compute at least one token). Every prompt therefore
goes to Dynamo as it is and to kvroute with one token more: both then match the same full
blocks, and both answers are in matched tokens of those blocks.

The peer is Dynamo's standalone KV indexer (PyPI ``ai-dynamo``), installed into a venv of
its own on first use (``ensure_peer``): its runtime's dependencies are not kvroute's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

PEER_VERSION = "1.6.1"
BLOCK = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peer_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_peer(venv: Path) -> Path:
    """The peer's interpreter, installing ``ai-dynamo`` into ``venv`` when it is not there.
    The runtime wheel brings the indexer; the ``ai-dynamo`` package itself only adds the
    ``dynamo.indexer`` entry point, and its other dependencies (the serving stack) are not
    needed for it, hence ``--no-deps``."""
    python = peer_python(venv)
    if python.exists() and subprocess.run([str(python), "-c", "import dynamo.indexer"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"installing ai-dynamo {PEER_VERSION} into {venv} (first use)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, f"ai-dynamo-runtime=={PEER_VERSION}"], check=True)
    subprocess.run([*pip, "--no-deps", f"ai-dynamo=={PEER_VERSION}"], check=True)
    return python


class Answer:
    """A timed request's answer: its status and body."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> Any:
        return json.loads(self.content)

    def raise_for_status(self) -> None:
        if not 200 <= self.status_code < 300:
            raise RuntimeError(f"HTTP {self.status_code}: {self.content[:200]!r}")


class KeepAlive:
    """One HTTP/1.1 keep-alive connection over a plain socket, for the timed requests (the
    health round trips and the queries). An httpx request spends some 0.5-1 ms of the
    client's own Python, as much as either server's work on a 1k prompt, and more when
    the machine is busy; this client spends tens of microseconds. It reads a
    ``content-length`` or chunked body, and connects again when the server closed the
    connection. Used by one thread at a time (a lock)."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self.port, self.timeout = port, timeout
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: bytes = b"",
                content_type: str | None = None) -> tuple[float, Answer]:
        """(seconds from the request's first byte sent to the answer's last byte read,
        the answer)."""
        head = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1"]
        if body or method == "POST":
            head.append(f"content-length: {len(body)}")
        if content_type:
            head.append(f"content-type: {content_type}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    sock = self._connect()
                    started = time.perf_counter()
                    sock.sendall(message)
                    status, content, close = self._read(sock)
                    took = time.perf_counter() - started
                except (ConnectionError, _Closed):
                    self.close()
                    if fresh or attempt:
                        raise
                    continue  # the server closed an idle connection: once more, anew
                if close:
                    self.close()
                return took, Answer(status, content)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buffer = None, b""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.create_connection(("127.0.0.1", self.port), self.timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._sock

    def _fill(self, sock: socket.socket) -> None:
        data = sock.recv(1 << 16)
        if not data:
            raise _Closed
        self._buffer += data

    def _take(self, sock: socket.socket, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill(sock)
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _line(self, sock: socket.socket, end: bytes = b"\r\n") -> bytes:
        while end not in self._buffer:
            self._fill(sock)
        line, _, self._buffer = self._buffer.partition(end)
        return line

    def _read(self, sock: socket.socket) -> tuple[int, bytes, bool]:
        head = self._line(sock, b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip().lower()
        if fields.get("transfer-encoding") == "chunked":
            parts = []
            while size := int(self._line(sock).split(b";")[0], 16):
                parts.append(self._take(sock, size))
                self._take(sock, 2)
            while self._line(sock):  # trailers, up to the empty line
                pass
            content = b"".join(parts)
        else:
            content = self._take(sock, int(fields.get("content-length", "0")))
        return status, content, fields.get("connection") == "close"


class _Closed(Exception):
    """The server closed the connection."""


class Side:
    """One indexer process, an HTTP client for it, and a keep-alive connection for the timed
    requests."""

    name = ""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.port = free_port()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        self.timed = KeepAlive(self.port)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def cpu_seconds(self) -> float:
        """User + system CPU time the process (all its threads) has used so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")  # type: ignore[union-attr]
            try:
                if self.http.get(path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer {path} within {timeout:g} s")

    def health(self) -> float:
        took, answer = self.timed.request("GET", self.health_path)
        answer.raise_for_status()
        return took

    health_path = "/healthz"

    def query(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        """(seconds, worker -> matched tokens) for ``tokens`` (see the module docstring)."""
        raise NotImplementedError

    def questions(self) -> dict[str, Callable[[list[int]], tuple[float, dict[int, int]]]]:
        """The timed queries to compare, by name; the first is ``query``, the last
        ``empty``: ``query`` of a one-token prompt, which matches nothing (a baseline on
        the same server path as the queries)."""
        return {"query": self.query, "empty": self.empty}

    def empty(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        return self.query(tokens[:1])[0], {}

    def timed_post(self, path: str, payload: dict[str, Any]) -> tuple[float, Answer]:
        """(seconds, answer) of a JSON POST on the keep-alive connection, timed from the
        request's first byte sent to its answer's last byte read: the body is encoded
        before the clock starts (this client's own JSON encoding of 32k ids takes some 2
        ms, the same for either side, and would be counted as the server's work
        otherwise)."""
        return self.timed.request("POST", path, json.dumps(payload).encode(),
                                  "application/json")

    def holding(self, tokens: list[int]) -> dict[int, int]:
        """Every worker's matched tokens (0 left out), however slow that is to ask."""
        return self.query(tokens)[1]

    def stop(self) -> None:
        self.http.close()
        self.timed.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Kvroute(Side):
    name = "kvroute"

    def __init__(self, workers: int, settings: tuple[str, ...] = ()) -> None:
        super().__init__(workers)
        self.settings = settings  # more lines of its TOML configuration (top-level keys)

    def start(self, endpoints: list[list[str]], workdir: Path) -> None:
        lines = [f"port = {self.port}", 'log_level = "warning"', "load_interval = 0",
                 *self.settings]
        for w, (events, replay) in enumerate(endpoints):
            lines += ["[[instances]]", f'id = "w{w:03d}"', f"block_size = {BLOCK}",
                      f'events = ["{events}"]', f'replay = ["{replay}"]']
        config = workdir / "kvroute.toml"
        config.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvroute.app.cli", "serve",
                                      "--config", str(config)])
        self.wait_http("/healthz", 60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            listed = self.http.get("/v1/instances").json()["instances"]
            if len(listed) == len(endpoints) and all(i["state"] == "live" for i in listed):
                return
            time.sleep(0.1)
        raise RuntimeError("kvroute's workers did not all go live within 120 s")

    def query(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        took, answer = self.timed_post("/v1/route", {"token_ids": [*tokens, 0], "probe": True})
        answer.raise_for_status()
        return took, self._scores(answer.json())

    def match(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        """The like of the peer's query: what the index holds, nothing weighed."""
        took, answer = self.timed_post("/v1/match", {"token_ids": [*tokens, 0]})
        answer.raise_for_status()
        return took, self._matched(answer.json())

    def questions(self) -> dict[str, Callable[[list[int]], tuple[float, dict[int, int]]]]:
        return {"route": self.query, "match": self.match, "empty": self.empty}

    def empty(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        return self.match(tokens[:1])[0], {}

    def holding(self, tokens: list[int]) -> dict[int, int]:
        answer = self.http.post("/v1/match", json={"token_ids": [*tokens, 0]})
        answer.raise_for_status()
        return self._matched(answer.json())

    @staticmethod
    def _scores(body: dict) -> dict[int, int]:
        return {int(s["instance"][1:]): s["matched_tokens"] for s in body["scores"]
                if s["matched_tokens"]}

    @staticmethod
    def _matched(body: dict) -> dict[int, int]:
        return {int(m["instance"][1:]): m["matched_tokens"] for m in body["matches"]}

    def stall_since(self, before: tuple[float, dict[float, float]]) -> float:
        """The worst loop lag since ``before`` (a ``loop_lag()``): exact when it set a new
        worst since start, otherwise the smallest histogram bound under which every lag
        since ``before`` fell."""
        worst, buckets = self.loop_lag()
        if worst > before[0]:
            return worst
        grown = {b: n - before[1].get(b, 0) for b, n in buckets.items()}
        total = max(grown.values(), default=0)
        return min((b for b, n in grown.items() if n == total), default=0.0)

    def loop_lag(self) -> tuple[float, dict[float, float]]:
        """(worst lag since start, cumulative count per histogram bucket bound)."""
        worst, buckets = 0.0, {}
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("kvroute_event_loop_lag_worst_seconds "):
                worst = float(line.split()[1])
            elif line.startswith("kvroute_event_loop_lag_seconds_bucket"):
                bound = line.split('le="')[1].split('"')[0]
                buckets[float(bound)] = float(line.split()[1])
        return worst, buckets


class Dynamo(Side):
    name = "dynamo"
    health_path = "/health"

    def __init__(self, workers: int, python: Path, threads: int | None) -> None:
        super().__init__(workers)
        self.python = python
        self.threads = threads

    def start(self, endpoints: list[list[str]], workdir: Path) -> None:
        args = [str(self.python), "-m", "dynamo.indexer", "--port", str(self.port),
                "--block-size", str(BLOCK)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        log = (workdir / "dynamo.log").open("wb")
        env = {**os.environ, "RUST_LOG": "warn"}
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.wait_http("/health", 60)
        for w, (events, replay) in enumerate(endpoints):
            self.http.post("/register", json={
                "instance_id": w, "endpoint": events, "replay_endpoint": replay,
                "model_name": "bench",
                "block_size": BLOCK, "dp_rank": 0}).raise_for_status()

    def query(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        took, answer = self.timed_post("/query", {"token_ids": tokens, "model_name": "bench"})
        answer.raise_for_status()
        scores = answer.json().get("scores", {})
        return took, {int(w): n for w, ranks in scores.items() for n in ranks.values() if n}
