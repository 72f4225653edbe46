"""The kvroute service under test: its process and the HTTP calls the checks make.

kvroute is started from the project's own virtual environment (the
``kvroute`` console script beside the running interpreter) and learns about
the engines only through ``POST /v1/instances {"url": ...}``: discovery of
the event and replay endpoints is part of what the harness tests.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from e2e.ports import free_port
from e2e.processes import ManagedProcess, ProcessSet


class KvrouteError(RuntimeError):
    """kvroute answered something the contract does not allow."""


class Kvroute:
    def __init__(self, procs: ProcessSet, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._procs = procs
        self._log = log_dir / "kvroute.log"
        self.proc: ManagedProcess | None = None
        self.settings: dict[str, str] = {}
        self.http = httpx.Client(base_url=self.url, timeout=30.0)

    def start(self, settings: dict[str, str] | None = None, timeout: float = 60.0) -> None:
        """Start ``kvroute serve``; ``settings`` are KVROUTE_* environment overrides."""
        binary = Path(sys.executable).parent / "kvroute"
        argv = [str(binary), "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        env = dict(os.environ)
        env.update(settings or {})
        self.settings = dict(settings or {})
        self.proc = self._procs.start(ManagedProcess("kvroute", argv, env, self._log))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.exited()
            if code is not None:
                raise RuntimeError(f"kvroute exited with code {code}:\n{self.proc.log_tail()}")
            try:
                if self.http.get("/healthz", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"kvroute not healthy within {timeout:.0f}s:\n{self.proc.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def register(self, url: str) -> str:
        response = self.http.post("/v1/instances", json={"url": url})
        if response.status_code != 201:
            raise KvrouteError(
                f"POST /v1/instances {url} -> {response.status_code}: {response.text}")
        return str(response.json()["id"])

    def instance(self, instance_id: str) -> dict[str, Any]:
        response = self.http.get(f"/v1/instances/{instance_id}")
        if response.status_code != 200:
            raise KvrouteError(
                f"GET /v1/instances/{instance_id} -> {response.status_code}: {response.text}")
        return response.json()

    def worker(self, instance_id: str, dp_rank: int = 0) -> dict[str, Any]:
        for worker in self.instance(instance_id).get("workers", []):
            if worker.get("dp_rank") == dp_rank:
                return worker
        raise KvrouteError(f"instance {instance_id} has no worker with dp_rank {dp_rank}")

    def last_seq(self, instance_id: str) -> int | None:
        return self.worker(instance_id)["stats"].get("last_seq")

    def holdings(self, instance_id: str) -> int:
        """Blocks the index holds for the instance's rank-0 worker, all media together."""
        return sum(int(v) for v in self.worker(instance_id).get("holdings", {}).values())

    def route(self, token_ids: list[int], *, probe: bool = False,
              cache_salt: str | None = None) -> dict[str, Any]:
        """kvroute's answer; a probe is a question only (the prompt will not be sent)."""
        body: dict[str, Any] = {"token_ids": token_ids, "probe": probe}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = self.http.post("/v1/route", json=body)
        if response.status_code != 200:
            raise KvrouteError(f"POST /v1/route -> {response.status_code}: {response.text}")
        return response.json()

    def matched(self, token_ids: list[int], cache_salt: str | None = None) -> dict[str, int]:
        """matched_tokens per instance id (rank 0) for this prompt (a tenant's)."""
        return {
            score["instance"]: int(score["matched_tokens"])
            for score in self.route(token_ids, probe=True, cache_salt=cache_salt)["scores"]
            if score.get("dp_rank", 0) == 0
        }

    def models(self) -> list[str]:
        response = self.http.get("/v1/models")
        if response.status_code != 200:
            raise KvrouteError(f"GET /v1/models -> {response.status_code}: {response.text}")
        return [str(m["id"]) for m in response.json().get("data", [])]

    def proxied_completion(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """POST /v1/completions through kvroute's proxy: (instance id it chose, vLLM's JSON)."""
        response = self.http.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise KvrouteError(
                f"proxied POST /v1/completions -> {response.status_code}: {response.text}")
        return response.headers.get("x-kvroute-instance", ""), response.json()

    def inflight(self) -> dict[str, int]:
        """The proxy's open requests per instance id, as the routing scores report them."""
        scores = self.route([3, 4, 5], probe=True)["scores"]
        return {score["instance"]: int(score["load"]["inflight"]) for score in scores}

    def proxied_stream(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """A streamed completion through the proxy: (instance id, the SSE data payloads)."""
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise KvrouteError(f"proxied streamed POST /v1/completions -> "
                                   f"{response.status_code}: {response.text}")
            data = [line[len("data: "):] for line in response.iter_lines()
                    if line.startswith("data: ")]
            return response.headers.get("x-kvroute-instance", ""), data

    def wait_state(self, instance_id: str, states: set[str], timeout: float,
                   say=print, what: str = "") -> str:
        """Poll until the rank-0 worker's state is one of ``states``; return it."""
        deadline = time.monotonic() + timeout
        last_report = time.monotonic()
        state = "?"
        while True:
            try:
                state = str(self.worker(instance_id).get("state"))
            except (KvrouteError, httpx.HTTPError):
                state = "?"
            if state in states:
                return state
            now = time.monotonic()
            if now > deadline:
                raise KvrouteError(
                    f"{instance_id}: worker state {state!r}, expected {sorted(states)} "
                    f"within {timeout:.0f}s {what}")
            if now - last_report >= 5.0:
                last_report = now
                say(f"  waiting for kvroute: {instance_id} is {state!r}, want {sorted(states)}")
            time.sleep(0.05)

    def close(self) -> None:
        self.http.close()

