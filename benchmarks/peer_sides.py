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
import time
from pathlib import Path
from typing import Any

import httpx

_JSON = {"content-type": "application/json"}

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


class Side:
    """One indexer process and an HTTP client for it."""

    name = ""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.port = free_port()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
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
        started = time.perf_counter()
        self.http.get(self.health_path).raise_for_status()
        return time.perf_counter() - started

    health_path = "/healthz"

    def query(self, tokens: list[int]) -> tuple[float, dict[int, int]]:
        """(seconds, worker -> matched tokens) for ``tokens`` (see the module docstring)."""
        raise NotImplementedError

    def timed_post(self, path: str, payload: dict[str, Any]) -> tuple[float, httpx.Response]:
        """(seconds, answer) of a JSON POST, timed from the request's first byte sent to
        its answer's last byte read: the body is encoded before the clock starts (this
        client's own JSON encoding of 32k ids takes some 2 ms, the same for either side,
        and would be counted as the server's work otherwise)."""
        body = json.dumps(payload).encode()
        started = time.perf_counter()
        answer = self.http.post(path, content=body, headers=_JSON)
        return time.perf_counter() - started, answer

    def holding(self, tokens: list[int]) -> dict[int, int]:
        """Every worker's matched tokens (0 left out), however slow that is to ask."""
        return self.query(tokens)[1]

    def stop(self) -> None:
        self.http.close()
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

    def holding(self, tokens: list[int]) -> dict[int, int]:
        answer = self.http.post("/v1/route", json={"token_ids": [*tokens, 0], "probe": True,
                                                   "all_scores": True})
        answer.raise_for_status()
        return self._scores(answer.json())

    @staticmethod
    def _scores(body: dict) -> dict[int, int]:
        return {int(s["instance"][1:]): s["matched_tokens"] for s in body["scores"]
                if s["matched_tokens"]}

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
