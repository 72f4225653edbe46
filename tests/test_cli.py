"""The `kvroute` command as a user runs it: a real process, real signals, real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from app.demo import run_demo
from app.server import free_port
from app.sim.cluster import SimCluster

KVROUTE = [sys.executable, "-m", "app.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_bad_configuration_is_one_clear_line(tmp_path):
    config = tmp_path / "kvroute.toml"
    config.write_text("port = 'eighty'\n")
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "configuration error" in result.stderr and "port must be a positive integer" in (
        result.stderr)
    assert "Traceback" not in result.stderr

    result = run("serve", env={"KVROUTE_INSTANCES": "nope://x"})
    assert result.returncode == 2 and "instances[0].url" in result.stderr


def test_serve_follows_instances_and_stops_cleanly_on_sigterm():
    port = free_port()
    with SimCluster(n=1, block_size=16, num_blocks=64) as sim:
        process = subprocess.Popen([*KVROUTE, "serve", "--port", str(port),
                                    "--instance", sim.urls[0], "--log-level", "warning"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert process.poll() is None, process.stderr.read()
                assert time.monotonic() < deadline, "kvroute serve never became ready"
                time.sleep(0.1)
            (instance,) = httpx.get(f"{base}/v1/instances").json()["instances"]
            assert instance["url"] == sim.urls[0] and instance["state"] == "live"
        finally:
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr
        assert "Traceback" not in stderr


def test_serve_reports_a_busy_port():
    with SimCluster(n=1, block_size=16, num_blocks=64) as sim:
        port = sim.urls[0].rsplit(":", 1)[1]
        result = run("serve", "--port", port, "--log-level", "error")
    assert result.returncode != 0
    assert "address already in use" in result.stderr.lower()


def test_tail_is_wired_in():
    result = run("tail", "--help")
    assert result.returncode == 0 and "--replay" in result.stdout


@pytest.mark.timeout(90)
def test_demo_routes_a_workload_and_prints_a_summary(capsys):
    assert run_demo(port=0, instances=2, duration=3.0, seed=1) == 0
    out = capsys.readouterr().out
    assert out.count("registered http://127.0.0.1:") == 2
    assert "curl -s http://127.0.0.1:" in out and "/v1/route" in out
    summary = [line for line in out.splitlines() if "prefix-cache hit rate" in line][-1]
    requests = int(summary.split("]")[1].split()[0])
    hit_rate = float(summary.split("hit rate ")[1].split("%")[0])
    assert requests > 5
    # Shared system prompts routed by prefix: most prompt tokens are cache hits.
    assert hit_rate > 40.0
