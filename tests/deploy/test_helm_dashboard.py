"""The chart's Grafana dashboard: an optional ConfigMap for Grafana's sidecar, holding a
dashboard whose every query names metrics a running kvroute exports, so no panel can
silently point at nothing."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import yaml

from kvroute.app.config import FleetConfig, InstanceConfig, Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.helm import CHART, rendered
from tests.support.waiting import HTTP_TIMEOUT, wait_for

DASHBOARD = CHART / "dashboards" / "kvroute.json"
TEMPLATE = "grafana-dashboard.yaml"
ENABLED = {"grafana": {"dashboard": {"enabled": True}}}
# Predicted vs actual cached tokens, exported by the proxy (app.routing.accuracy).
COMPARISON = {"kvroute_predicted_cached_tokens_total", "kvroute_actual_cached_tokens_total",
              "kvroute_cached_tokens_difference_bucket", "kvroute_cached_tokens_difference_count",
              "kvroute_cached_tokens_unavailable_total"}
METRIC = re.compile(r"\bkvroute_[a-z0-9_]+\b")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panels' targets and template variables."""
    found = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    found += [variable["definition"] for variable in board["templating"]["list"]
              if variable["type"] == "query"]
    return found


def as_helm_would(text: str, values: dict) -> str:
    """The actions the walker keeps verbatim in this template, done as helm does them."""
    dashboard_values = values["grafana"]["dashboard"]
    text = text.replace("{{ .Values.grafana.dashboard.label }}: "
                        "{{ .Values.grafana.dashboard.labelValue | quote }}",
                        f'{dashboard_values["label"]}: "{dashboard_values["labelValue"]}"')
    text = text.replace('{{ include "kvroute.fullname" . }}', "kvroute")
    text = text.replace('{{- include "kvroute.labels" . | nindent 4 }}',
                        "\n    app.kubernetes.io/name: kvroute")
    text = text.replace("{{- toYaml . | nindent 4 }}", "\n    " + "\n    ".join(
        f"{k}: {v}" for k, v in dashboard_values["annotations"].items()))
    text = re.sub(r"\{\{ \. \}\}", dashboard_values["namespace"], text)
    # Last: the file is not a template (its legends' {{label}} are Grafana's).
    file_action = '{{ .Files.Get "dashboards/kvroute.json" | indent 4 }}'
    assert "{{" not in text.replace(file_action, ""), text
    return text.replace(file_action, "\n".join("    " + line if line else line
                                               for line in DASHBOARD.read_text().splitlines()))


def test_the_dashboard_configmap_is_rendered_only_when_enabled() -> None:
    assert rendered(TEMPLATE).strip() == ""
    text = rendered(TEMPLATE, ENABLED)
    manifest = yaml.safe_load(as_helm_would(text, {"grafana": {"dashboard": {
        "label": "grafana_dashboard", "labelValue": "1", "namespace": "", "annotations": {}}}}))
    assert manifest["kind"] == "ConfigMap"
    assert manifest["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(manifest["data"]["kvroute.json"]) == dashboard()


def test_the_sidecar_label_namespace_and_annotations_are_configurable() -> None:
    values = {"grafana": {"dashboard": {"enabled": True, "label": "dashboards",
                                        "labelValue": "kvroute", "namespace": "monitoring",
                                        "annotations": {"grafana_folder": "LLM"}}}}
    manifest = yaml.safe_load(as_helm_would(rendered(TEMPLATE, values), values))
    assert manifest["metadata"]["labels"]["dashboards"] == "kvroute"
    assert manifest["metadata"]["namespace"] == "monitoring"
    assert manifest["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "kvroute" and board["title"] == "kvroute"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    titles = " ".join(p["title"] for p in panels).lower()
    for subject in ("state", "medium", "events", "gaps", "route", "latency", "predicted"):
        assert subject in titles


def test_the_servicemonitor_keeps_kvroutes_instance_label() -> None:
    monitor = rendered("servicemonitor.yaml", {"serviceMonitor": {"enabled": True}})
    assert "honorLabels: true" in monitor


def exported_names(page: str) -> set[str]:
    """Every series name a Prometheus scrape of `page` can hold: the samples present, and
    those of each declared family that has none yet (a labelled family has no sample until
    first used). A family with samples shows exactly its series: a histogram with negative
    buckets, for one, has no `_sum`."""
    samples = {line.split("{")[0].split(" ")[0] for line in page.splitlines()
               if line and not line.startswith("#")}
    names = set(samples)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "summary": ("_sum", "_count", "")}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M):
        # (A labelled counter with no sample yet is declared with its _total already.)
        family = family.removesuffix("_total")
        series = {family + suffix for suffix in suffixes.get(kind, ("",))}
        if not series & samples:
            names |= series
    return names


@pytest.fixture(scope="module")
def metrics_page() -> str:
    """/metrics of a kvroute that follows an instance and a fleet, proxies, answers the
    Endpoint Picker protocol, and has routed and refused a request."""
    with SimCluster(n=2, block_size=16, num_blocks=64, model="sim-model") as cluster:
        port = int(cluster.urls[0].rsplit(":", 1)[1])

        async def resolve(host: str, port: int) -> list[str]:
            await asyncio.sleep(0)
            return ["127.0.0.1"]

        settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                            epp_port=0, dns_refresh_seconds=1,
                            instances=(InstanceConfig(url=cluster.urls[1]),),
                            fleets=(FleetConfig(url=f"http://sim.test:{port}", id="sim"),))
        with BackgroundServer(settings, resolver=resolve) as server, \
                httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            wait_for(lambda: [i["state"] for i in http.get("/v1/instances").json()[
                "instances"]] == ["live", "live"], "both live")
            cluster.complete(0, list(range(100, 164)), max_tokens=1)
            assert http.post("/v1/route", json={"token_ids": [1, 2, 3]}).status_code == 200
            assert http.post("/v1/route", json={"token_ids": ["x"]}).status_code == 422
            assert http.post("/v1/completions", json={
                "model": "sim-model", "prompt": "hello", "max_tokens": 1}).status_code == 200
            return http.get("/metrics").text


def test_every_metric_the_dashboard_queries_is_exported(metrics_page: str) -> None:
    used = {name for query in queries(dashboard()) for name in METRIC.findall(query)}
    assert COMPARISON <= used  # the predicted-vs-actual panels are there
    missing = used - exported_names(metrics_page)
    assert not missing, f"the dashboard queries metrics kvroute does not export: {missing}"
    # And the check has teeth: a typo would be caught.
    assert "kvroute_worker_states" not in exported_names(metrics_page)
