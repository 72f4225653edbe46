"""schemathesis, with every check it has, against a real `kvroute serve` and its own
/openapi.json: the service answers as its OpenAPI document says.

The deployment: a simulated vLLM instance that accepts every prompt kvroute's schema lets
through (a 2**32 vocabulary, a context longer than any body), `kvroute serve` following it
with a token, text prompts tokenized by the instance, the proxy and the docs on. The run:
all four phases (the schema's examples, coverage, fuzzing, stateful sequences along the
links from a registration to reading and removing it), every check, a bounded number of
cases per operation, deterministic generation. It must find nothing: no failure, no
error, no warning of any kind (missing test data, validation mismatches and low valid
rates included). tests/support/fuzz_hooks.py keeps registrations on the simulated instance.
"""

from __future__ import annotations

import collections
import json
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvroute.sim.cluster import SimCluster
from tests.support.lines import Lines
from tests.support.paths import REPO
from tests.support.waiting import scaled, wait_for

MAX_EXAMPLES = 30  # per operation and phase: about 700 requests in all
# Every check `st run --checks all` runs (max_response_time only with a limit: given one that
# only a hang reaches, it asserts no speed).
CHECKS = {
    "not_a_server_error", "status_code_conformance", "content_type_conformance",
    "response_headers_conformance", "response_schema_conformance", "negative_data_rejection",
    "positive_data_acceptance", "missing_required_header", "unsupported_method",
    "allow_header_conformance", "use_after_free", "ensure_resource_availability",
    "ignored_auth", "object_level_authorization", "max_response_time",
}
WARNINGS = (
    "missing_auth,missing_test_data,base_url_mismatch,validation_mismatch,missing_deserializer,"
    "unused_openapi_auth,unsupported_regex,method_not_allowed,constants_extraction,"
    "unmatched_filter,unresolvable_reference,low_valid_rate,rate_limited,dictionary_mismatch,"
    "timeout_units")


class Served:
    def __init__(self, url: str, token: str, sim: SimCluster, log: Lines) -> None:
        self.url, self.token, self.sim, self.log = url, token, sim, log


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    token = secrets.token_urlsafe(16)
    with SimCluster(n=1, block_size=16, num_blocks=8193, model="sim-model",
                    vocab_size=2**32, max_model_len=131072) as sim:
        config = tmp_path / "kvroute.toml"
        config.write_text('host = "127.0.0.1"\ntokenizer = "instance"\nproxy = true\n'
                          f'docs = true\n[[instances]]\nid = "sim"\nurl = "{sim.urls[0]}"\n')
        # Only this test's settings: no KVROUTE_* of the caller's environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        process = subprocess.Popen(
            [sys.executable, "-m", "kvroute.app.cli", "serve", "--config", str(config),
             "--port", "0", "--log-level", "info"],
            env={**env, "KVROUTE_API_TOKEN": token}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        log = Lines(process.stderr)
        try:
            running = wait_for(lambda: log.find(r"running on http://127\.0\.0\.1:(\d+)")
                               or process.poll() is not None, "kvroute serve to name its port",
                               detail=log.text)
            assert process.poll() is None, log.text()
            url = f"http://127.0.0.1:{running.group(1)}"

            def ready() -> bool:
                try:
                    return httpx.get(f"{url}/readyz", timeout=scaled(2)).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(ready, "kvroute serve to be ready (the instance live)")
            yield Served(url, token, sim, log)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=scaled(30))
        assert process.returncode == 0, log.text()


def checks_run(ndjson: Path) -> collections.Counter[tuple[str, str]]:
    """(check, status) -> how many times, from the run's event stream."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in ndjson.read_text().splitlines():
        finished = json.loads(line).get("ScenarioFinished") or {}
        for checks in (finished.get("recorder") or {}).get("checks", {}).values():
            counts.update((check["name"], check["status"]) for check in checks)
    return counts


@pytest.mark.timeout(600)
def test_schemathesis_finds_nothing(served: Served, tmp_path: Path):
    (source,) = served.sim.instances[0].kv_event_sources()
    report, events = tmp_path / "report.json", tmp_path / "events.ndjson"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCHEMATHESIS_HOOKS": "tests.support.fuzz_hooks",
           "KVROUTE_FUZZ_URL": served.sim.urls[0], "KVROUTE_FUZZ_EVENTS": source["endpoint"],
           "KVROUTE_FUZZ_REPLAY": source["replay_endpoint"]}
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{served.url}/openapi.json",
         "--header", f"Authorization: Bearer {served.token}",
         "--checks", "all", "--max-response-time", str(scaled(30)),
         # Deterministic: derandomized, and no example database carried between runs.
         "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--workers", "1",
         "--request-timeout", str(scaled(60)), "--warnings", WARNINGS, "--no-color",
         "--report", "json,ndjson", "--report-json-path", str(report),
         "--report-ndjson-path", str(events)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=scaled(480))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    summary = json.loads(report.read_text())
    assert summary["complete"] and summary["stop_reason"] == "completed", output
    assert {name: phase["status"] for name, phase in summary["phases"].items()} == {
        "examples": "success", "coverage": "success", "fuzzing": "success",
        "stateful": "success"}, output
    operations = summary["operations"]
    assert operations["tested"] == operations["selected"] == operations["total"] == 16
    cases = summary["test_cases"]
    assert (cases["with_failures"], cases["unique_failures"], cases["errored"]) == (0, 0, 0)
    assert summary["failures"] == summary["errors"] == [], output
    assert {name: found for name, found in summary["warnings"].items() if found} == {}, output
    # The stateful phase followed every link, the registration's to GET and DELETE included.
    links = re.search(r"API Links:\s+(\d+) covered / (\d+) selected / (\d+) total", output)
    assert links is not None and links[1] == links[3] and int(links[3]) >= 2, output
    # Every check ran, and none failed.
    counts = checks_run(events)
    assert {name for name, _ in counts} == CHECKS
    assert {status for _, status in counts} == {"success"}, counts
    assert cases["generated"] >= 11 * MAX_EXAMPLES
    assert "Traceback" not in served.log.text()
    print(f"schemathesis: {cases['generated']} cases, {sum(counts.values())} checks passed "
          f"({len(CHECKS)} kinds), {links[1]}/{links[3]} links, 0 failures, 0 warnings")
