"""Real vLLM instances on loopback, and the few HTTP calls the checks make to them.

An instance keeps its three ports (HTTP, KV-event PUB, replay ROUTER) across
restarts, so kvroute sees the same endpoints come back with a fresh engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from e2e.ports import free_port
from e2e.processes import ManagedProcess, ProcessSet

TOPIC = "kv-events"


@dataclass
class EngineSpec:
    name: str
    venv: Path
    model_dir: Path
    log_dir: Path
    block_size: int = 32
    num_blocks: int = 64
    max_model_len: int = 1024
    # KV-event batches the replay endpoint keeps (vLLM's default, 10,000, when None).
    buffer_steps: int | None = None
    # The cores the engine and the processes it spawns may run on (None: the caller's).
    cpus: frozenset[int] | None = None
    # Load the model folder's tokenizer (text prompts, /tokenize); off: token ids only.
    tokenizer: bool = False
    http_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": TOPIC,
        }
        if self.buffer_steps is not None:
            events["buffer_steps"] = self.buffer_steps
        prefix = ["taskset", "-c", ",".join(map(str, sorted(self.cpus)))] if self.cpus else []
        return [
            *prefix,
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model_dir),
            "--host", "127.0.0.1",
            "--port", str(self.http_port),
            "--load-format", "dummy",
            *(() if self.tokenizer else ("--skip-tokenizer-init",)),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_blocks),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(events),
            "--enable-prompt-tokens-details",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",  # enables POST /reset_prefix_cache
            OMP_NUM_THREADS="1",  # two engines share 2 cores
            # vLLM's CPU build pins its OpenMP thread to a core it picks ("auto"): every
            # engine on this machine picks the same one, and then each request to all but
            # one engine waits about a second for that core. The kernel places them better.
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
        )
        return env


class Engine:
    """One vLLM instance the harness owns; restartable on the same ports."""

    def __init__(self, spec: EngineSpec, procs: ProcessSet) -> None:
        self.spec = spec
        self._procs = procs
        self.proc: ManagedProcess | None = None
        self.http = httpx.Client(base_url=spec.url, timeout=60.0)
        self.boot_seconds: float | None = None
        self._started_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self) -> None:
        self.proc = self._procs.start(
            ManagedProcess(
                self.spec.name,
                self.spec.argv(),
                self.spec.env(),
                self.spec.log_dir / f"{self.spec.name}.log",
            )
        )
        self._started_at = time.monotonic()
        self.boot_seconds = None

    def terminate(self) -> None:
        """SIGTERM without waiting, so several engines shut down at once; then stop()."""
        if self.proc is not None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def move_front_end(self, cpus: frozenset[int]) -> None:
        """Run the engine's HTTP front end (the `vllm serve` process: HTTP, tokenizing,
        streaming) on `cpus` from now on, every thread of it; its engine-core and worker
        processes stay where they were started. On a GPU machine the front end runs on the
        host's cores and only the forward pass on the accelerator. Call once it serves."""
        assert self.proc is not None and self.proc.pid is not None
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(int(task), cpus)

    def poll_ready(self) -> bool:
        """True once /health answers 200; raises if the process died."""
        assert self.proc is not None
        code = self.proc.exited()
        if code is not None:
            raise RuntimeError(
                f"{self.name} exited with code {code} while booting; last log lines:\n"
                f"{self.proc.log_tail()}"
            )
        try:
            ok = self.http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False
        if ok and self.boot_seconds is None:
            self.boot_seconds = time.monotonic() - self._started_at
        return ok

    def complete(self, token_ids: list[int], max_tokens: int = 1, **extra: Any) -> dict:
        """One completion (``extra``: more fields of the body, such as ``cache_salt``);
        returns the response JSON."""
        response = self.http.post(
            "/v1/completions",
            json={
                "model": str(self.spec.model_dir),
                "prompt": token_ids,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                **extra,
            },
        )
        response.raise_for_status()
        return response.json()

    def cached_tokens(self, token_ids: list[int], **extra: Any) -> int:
        """Send the prompt; return the prefix-cache hit vLLM reports for it."""
        usage = self.complete(token_ids, **extra)["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def reset_prefix_cache(self) -> None:
        response = self.http.post("/reset_prefix_cache")
        response.raise_for_status()

    def prefix_cache_hits(self) -> float:
        """vllm:prefix_cache_hits_total summed over its label sets."""
        text = self.http.get("/metrics").text
        total = 0.0
        for match in re.finditer(
            r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M
        ):
            total += float(match.group(1))
        return total

    def close(self) -> None:
        self.http.close()


def wait_ready(engines: list[Engine], timeout: float, say=print) -> None:
    """Poll until every engine answers /health; print progress, never sleep blindly."""
    deadline = time.monotonic() + timeout
    pending = {e.name: e for e in engines}
    last_report = 0.0
    start = time.monotonic()
    while pending:
        for name, engine in list(pending.items()):
            if engine.poll_ready():
                say(f"  {name} ready at {engine.url} after {engine.boot_seconds:.0f}s")
                del pending[name]
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            tails = "\n".join(
                f"--- {e.name} log tail:\n{e.proc.log_tail() if e.proc else ''}"
                for e in pending.values()
            )
            raise RuntimeError(
                f"vLLM not ready within {timeout:.0f}s: {', '.join(pending)}\n{tails}"
            )
        if now - last_report >= 10.0:
            last_report = now
            say(
                f"  waiting for vLLM to boot: {', '.join(pending)} "
                f"({now - start:.0f}s elapsed, limit {timeout:.0f}s)"
            )
        time.sleep(0.5)
