"""Static checks of the Helm chart (no helm binary is available to render it).

What can break silently in a chart: a template naming a value that values.yaml
does not define (helm renders it as empty), an unbalanced control block, a
helper that does not exist, probes pointing at paths the service does not
serve, and a config file whose keys kvroute does not accept.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import yaml

from kvroute.app.config import FleetConfig, InstanceConfig, Settings
from tests.support.helm import ACTION, CHART, OPENERS, TEMPLATES, load_values, template_text

VALUES_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def test_chart_yaml_is_a_v2_application_chart() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "kvroute"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", str(chart["version"]))
    assert chart["appVersion"]


def test_values_yaml_parses_to_a_mapping() -> None:
    values = load_values()
    assert isinstance(values, dict)
    assert isinstance(values["instances"], list)
    assert values["serviceMonitor"]["enabled"] is False


def test_templates_exist() -> None:
    names = {p.name for p in TEMPLATES}
    assert {"_helpers.tpl", "deployment.yaml", "service.yaml", "config.yaml",
            "servicemonitor.yaml", "networkpolicy.yaml", "secret.yaml",
            "inferencepool.yaml"} <= names


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_every_values_path_used_by_a_template_exists(template: Path) -> None:
    values = load_values()
    missing = []
    for match in VALUES_PATH.finditer(template.read_text()):
        node: object = values
        for key in match.group(1).strip(".").split("."):
            if not isinstance(node, dict) or key not in node:
                missing.append(match.group(0))
                break
            node = node[key]
    assert not missing, f"{template.name} uses values not in values.yaml: {sorted(set(missing))}"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_control_blocks_are_balanced(template: Path) -> None:
    depth = 0
    for action in ACTION.findall(template.read_text()):
        if action.startswith("/*"):
            continue
        if action.startswith(OPENERS):
            depth += 1
        elif action == "end":
            depth -= 1
            assert depth >= 0, f"{template.name}: `end` without an opening block"
    assert depth == 0, f"{template.name}: {depth} block(s) never closed"


def test_every_included_helper_is_defined() -> None:
    helpers = template_text("_helpers.tpl")
    defined = set(re.findall(r'define "([^"]+)"', helpers))
    used = set()
    for template in TEMPLATES:
        used |= set(re.findall(r'include "([^"]+)"', template.read_text()))
    assert used, "templates include no helpers at all"
    assert used <= defined, f"undefined helpers: {sorted(used - defined)}"


def test_probes_use_the_health_and_readiness_endpoints() -> None:
    deployment = template_text("deployment.yaml")
    liveness = deployment.split("livenessProbe:")[1].split("readinessProbe:")[0]
    readiness = deployment.split("readinessProbe:")[1].split("resources:")[0]
    assert "path: /healthz" in liveness
    assert "path: /readyz" in readiness


def test_config_is_mounted_and_passed_with_config_flag() -> None:
    deployment = template_text("deployment.yaml")
    assert "mountPath: /etc/kvroute" in deployment
    args = deployment.split("args:")[1].split("ports:")[0]
    assert re.findall(r"^\s*-\s+(\S+)\s*$", args, re.M) == [
        "kvroute", "serve", "--config", "/etc/kvroute/config.toml"]
    assert "config.toml: |" in template_text("config.yaml")


def test_config_file_writes_only_keys_kvroute_accepts() -> None:
    body = template_text("config.yaml").split("config.toml: |")[1]
    top, _, instance = body.partition("[[instances]]")
    instance, _, fleet = instance.partition("[[fleets]]")
    top_keys = set(re.findall(r"^\s*([a-z_]+) = ", top, re.M))
    instance_keys = set(re.findall(r"^\s*([a-z_]+) = ", instance, re.M))
    fleet_keys = set(re.findall(r"^\s*([a-z_]+) = ", fleet, re.M))
    assert {"host", "port", "dns_refresh_seconds"} <= top_keys
    assert "url" in instance_keys and "url" in fleet_keys
    assert top_keys <= {f.name for f in msgspec.structs.fields(Settings)}
    assert instance_keys <= {f.name for f in msgspec.structs.fields(InstanceConfig)}
    assert fleet_keys <= {f.name for f in msgspec.structs.fields(FleetConfig)}


def test_config_file_binds_every_interface_on_the_container_port() -> None:
    body = template_text("config.yaml")
    assert 'host = "0.0.0.0"' in body
    assert "port = {{ .Values.containerPort }}" in body
    assert "containerPort: {{ .Values.containerPort }}" in template_text("deployment.yaml")


def test_service_monitor_is_optional_and_scrapes_metrics() -> None:
    monitor = template_text("servicemonitor.yaml")
    assert monitor.lstrip().startswith("{{- if .Values.serviceMonitor.enabled }}")
    assert "path: /metrics" in monitor


def test_tokens_come_from_a_secret_never_from_the_config_file() -> None:
    deployment = template_text("deployment.yaml")
    for variable, key in (("KVROUTE_API_TOKEN", "api-token"),
                          ("KVROUTE_ADMIN_TOKEN", "admin-token")):
        entry = deployment.split(f"name: {variable}")[1].split("- name:")[0]
        assert "secretKeyRef" in entry and f"key: {key}" in entry
    secret = template_text("secret.yaml")
    assert "kind: Secret" in secret and "api-token:" in secret and "admin-token:" in secret
    assert "Token" not in template_text("config.yaml")
    assert load_values()["auth"]["allowUnauthenticated"] is False


def test_the_config_file_is_a_secret_because_instances_carry_api_keys() -> None:
    config = template_text("config.yaml")
    assert "kind: Secret" in config and "kind: ConfigMap" not in config
    assert "api_key = {{ . | toJson }}" in config.split("{{- with .apiKey }}")[1]
    volume = template_text("deployment.yaml").split("volumes:")[1]
    assert "secretName: {{ include \"kvroute.fullname\" . }}-config" in volume
    assert "configMap" not in volume


def test_network_policy_admits_listed_peers_to_the_http_port_only() -> None:
    policy = template_text("networkpolicy.yaml")
    assert policy.split("*/ -}}")[1].lstrip().startswith(
        "{{- if .Values.networkPolicy.enabled }}")
    assert "kind: NetworkPolicy" in policy
    assert 'include "kvroute.selectorLabels"' in policy.split("podSelector:")[1]
    ingress = policy.split("ingress:")[1].split("egress:")[0]
    assert "toYaml .Values.networkPolicy.ingressFrom" in ingress
    assert "port: {{ .Values.containerPort }}" in ingress
    # Egress is restricted only when the operator lists it (then DNS stays open).
    assert "{{- if .Values.networkPolicy.egress }}\n    - Egress" in policy
    values = load_values()["networkPolicy"]
    assert values["enabled"] is True and values["egress"] == []


def test_the_pod_runs_as_non_root_on_a_read_only_root_filesystem() -> None:
    values = load_values()
    assert values["podSecurityContext"]["runAsNonRoot"] is True
    assert values["securityContext"]["readOnlyRootFilesystem"] is True
    assert values["securityContext"]["allowPrivilegeEscalation"] is False
    assert values["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_every_template_a_checksum_includes_exists() -> None:
    names = {p.name for p in TEMPLATES}
    included = re.findall(r'\.Template\.BasePath "/([^"]+)"', template_text("deployment.yaml"))
    assert included and set(included) <= names
