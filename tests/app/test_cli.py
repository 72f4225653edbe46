"""The `kvroute` command as a user runs it: a real process, real signals, real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from kvroute.sim.cluster import SimCluster
from kvroute.sim.demo import run_demo
from tests.support.lines import Lines
from tests.support.waiting import scaled, wait_for

KVROUTE = [sys.executable, "-m", "kvroute.app.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=scaled(60),
                          env={**os.environ, **(env or {})})


def test_bad_configuration_is_one_clear_line(tmp_path):
    config = tmp_path / "kvroute.toml"
    config.write_text("port = 'eighty'\n")
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "configuration error" in result.stderr and "port: expected `int`, got 'eighty'" in (
        result.stderr)
    assert "Traceback" not in result.stderr

    result = run("serve", env={"KVROUTE_INSTANCES": "nope://x"})
    assert result.returncode == 2 and "instances[0].url" in result.stderr


def test_an_exposed_address_without_a_token_does_not_start():
    # The check runs before anything binds, so no port is ever opened here.
    result = run("serve", "--host", "0.0.0.0", "--port", "0",
                 env={"KVROUTE_API_TOKEN": "", "KVROUTE_ADMIN_TOKEN": ""})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--allow-unauthenticated" in result.stderr and "0.0.0.0" in result.stderr


def test_serve_follows_instances_and_stops_cleanly_on_sigterm():
    with SimCluster(n=1, block_size=16, num_blocks=64) as sim:
        process = subprocess.Popen([*KVROUTE, "serve", "--port", "0", "--instance", sim.urls[0],
                                    "--log-level", "info"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stderr = Lines(process.stderr)
        try:
            # Port 0: the server binds a free port itself and names it in its log.
            running = wait_for(lambda: stderr.find(r"running on http://127\.0\.0\.1:(\d+)")
                               or process.poll() is not None, "kvroute serve to name its port",
                               detail=stderr.text)
            assert process.poll() is None, stderr.text()
            base = f"http://127.0.0.1:{running.group(1)}"

            def ready() -> bool:
                try:
                    return httpx.get(f"{base}/readyz", timeout=scaled(2)).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(ready, "kvroute serve to be ready")
            (instance,) = httpx.get(f"{base}/v1/instances").json()["instances"]
            assert instance["url"] == sim.urls[0] and instance["state"] == "live"
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=scaled(30))
        assert process.returncode == 0, stderr.text()
        assert "Traceback" not in stderr.text()


def test_serve_reports_a_busy_port():
    with SimCluster(n=1, block_size=16, num_blocks=64) as sim:
        port = sim.urls[0].rsplit(":", 1)[1]
        result = run("serve", "--port", port, "--log-level", "error")
    assert result.returncode != 0
    assert "address already in use" in result.stderr.lower()


def test_tail_is_wired_in():
    result = run("tail", "--help")
    assert result.returncode == 0 and "--replay" in result.stdout


@pytest.mark.timeout(180)
def test_demo_routes_a_workload_and_prints_a_summary(capsys):
    # A count of requests, not a duration: a busy machine serves fewer in the same time.
    assert run_demo(port=0, instances=2, requests=40, seed=1) == 0
    out = capsys.readouterr().out
    assert out.count("registered http://127.0.0.1:") == 2
    assert "all 2 instances live" in out
    assert "curl -s http://127.0.0.1:" in out and "/v1/route" in out
    assert "live dashboard: http://127.0.0.1:" in out
    summary = [line for line in out.splitlines() if "prefix-cache hit rate" in line][-1]
    requests = int(summary.split("]")[1].split()[0])
    hit_rate = float(summary.split("hit rate ")[1].split("%")[0])
    assert requests == 40
    # Shared system prompts routed by prefix: most prompt tokens are cache hits.
    assert hit_rate > 40.0
