"""The Helm chart's Endpoint Picker: the EPP port, its TLS and client CA, and the optional
InferencePool that points a gateway at it (rendered by the walker in tests/support/helm.py)."""

from __future__ import annotations

import re

import pytest

from kvroute.app.config import load_settings
from tests.support.helm import CHART, TemplateFail, load_values, merged, rendered, template_text

# --- kvroute as an Endpoint Picker, and its InferencePool ----------------------------------------

EPP = {"epp": {"enabled": True, "allowUnauthenticated": True}}
POOL = merged({"inferencePool": {"enabled": True, "selector": {"app": "vllm"}}}, merged(EPP))


def test_the_epp_and_the_pool_are_off_by_default() -> None:
    values = load_values()
    assert values["epp"]["enabled"] is False and values["inferencePool"]["enabled"] is False
    assert values["epp"]["port"] == 9002 and values["inferencePool"]["failureMode"] == "FailClose"
    assert "kind:" not in rendered("inferencepool.yaml")
    for name in ("deployment.yaml", "service.yaml", "networkpolicy.yaml", "config.yaml"):
        assert "epp" not in rendered(name).replace("enableServiceLinks", ""), name


def test_an_enabled_epp_is_configured_exposed_and_reachable() -> None:
    config = rendered("config.yaml", EPP)
    assert "epp_port = {{ .Values.epp.port }}" in config
    assert "epp_allow_unauthenticated = true" in config
    ports = rendered("deployment.yaml", EPP).split("ports:")[1].split("livenessProbe:")[0]
    assert "- name: epp\n              containerPort: {{ .Values.epp.port }}" in ports
    service = rendered("service.yaml", EPP)
    assert "- name: epp\n      port: {{ .Values.epp.port }}\n      targetPort: epp" in service
    # The NetworkPolicy admits the gateway (epp.ingressFrom) to the EPP port, and only there.
    ingress = rendered("networkpolicy.yaml", EPP).split("ingress:")[1].split("egress:")[0]
    rules = ingress.split("- from:")[1:]
    assert len(rules) == 2
    assert "toYaml .Values.epp.ingressFrom" in rules[1]
    assert "port: {{ .Values.epp.port }}" in rules[1] and "containerPort" not in rules[1]
    assert "port: {{ .Values.epp.port }}" not in rules[0]
    # What kvroute makes of the rendered config: the settings exist and start-up accepts them.
    settings = load_settings(environ={"KVROUTE_HOST": "0.0.0.0", "KVROUTE_API_TOKEN": "t",
                                      "KVROUTE_EPP_PORT": str(load_values()["epp"]["port"]),
                                      "KVROUTE_EPP_ALLOW_UNAUTHENTICATED": "true"})
    assert settings.epp_port == 9002 and settings.epp_tls


def test_an_epp_without_client_certificates_or_a_waiver_fails_to_render() -> None:
    with pytest.raises(TemplateFail, match="epp.allowUnauthenticated=true"):
        rendered("deployment.yaml", {"epp": {"enabled": True}})
    # Mutual TLS: no waiver needed, and the CA bundle is mounted where the config says.
    mutual = {"epp": {"enabled": True, "clientCaSecret": "gateway-ca", "tlsSecret": "epp-tls"}}
    deployment = rendered("deployment.yaml", mutual)
    config = rendered("config.yaml", mutual)
    assert "epp_allow_unauthenticated" not in config
    for volume, setting, secret in (("epp-ca", "epp_client_ca", ".Values.epp.clientCaSecret"),
                                    ("epp-tls", "epp_tls_certfile", ".Values.epp.tlsSecret"),
                                    ("epp-tls", "epp_tls_keyfile", ".Values.epp.tlsSecret")):
        path = re.search(rf'^\s*{setting} = "([^"]+)"', config, re.M).group(1)
        folder, file = path.rsplit("/", 1)
        mount = deployment.split(f"- name: {volume}\n              mountPath:")[1].split("\n")[0]
        assert mount.strip() == folder
        items = deployment.split("volumes:")[1].split(f"- name: {volume}\n")[1]
        assert f"secretName: {{{{ {secret} }}}}" in items and f"path: {file}" in items
    assert "epp-tls" not in rendered("deployment.yaml", EPP)
    assert "epp-ca" not in rendered("deployment.yaml", EPP)


def test_the_inference_pool_points_at_kvroutes_epp_service() -> None:
    pool = rendered("inferencepool.yaml", POOL)
    assert "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool" in pool
    spec = pool.split("spec:")[1]
    assert "matchLabels:\n      {{- toYaml .Values.inferencePool.selector | nindent 6 }}" in spec
    assert "targetPorts:\n    - number: {{ .Values.inferencePool.targetPort }}" in spec
    picker = spec.split("endpointPickerRef:")[1]
    assert "kind: Service" in picker
    # The same name as the Service that exposes the EPP port, on that port.
    assert 'name: {{ include "kvroute.fullname" . }}' in picker
    assert 'name: {{ include "kvroute.fullname" . }}' in template_text("service.yaml")
    assert "port:\n      number: {{ .Values.epp.port }}" in picker
    assert "failureMode: {{ .Values.inferencePool.failureMode }}" in picker
    assert "appProtocol" not in pool
    assert "appProtocol: {{ . | quote }}" in rendered(
        "inferencepool.yaml", merged({"inferencePool": {"appProtocol": "http"}}, POOL))
    assert "kind: InferencePool" in rendered(
        "inferencepool.yaml", merged({"inferencePool": {"failureMode": "FailOpen"}}, POOL))


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"inferencePool": {"enabled": True, "selector": {"app": "vllm"}}}, "needs epp.enabled"),
    (merged({"inferencePool": {"enabled": True}}, merged(EPP)), "inferencePool.selector"),
    (merged({"inferencePool": {"failureMode": "Sometimes"}}, POOL), "FailClose or FailOpen"),
])
def test_an_inconsistent_pool_fails_to_render(overrides: dict, needle: str) -> None:
    with pytest.raises(TemplateFail, match=re.escape(needle)):
        rendered("inferencepool.yaml", overrides)


def test_an_instance_endpoint_reaches_the_config_file() -> None:
    config = template_text("config.yaml").split("[[instances]]")[1]
    assert "{{- with .endpoint }}\n    endpoint = {{ . | toJson }}" in config


def test_the_epp_values_are_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for section, keys in (("epp", ("enabled", "port", "tlsSecret", "clientCaSecret",
                                   "allowUnauthenticated", "ingressFrom")),
                          ("inferencePool", ("enabled", "name", "selector", "targetPort",
                                             "appProtocol", "failureMode"))):
        start = lines.index(f"{section}:")
        assert lines[start - 1].startswith("#"), section
        block = lines[start + 1:]
        block = block[:next(i for i, line in enumerate(block) if line and not line[0].isspace())]
        for key in keys:
            number = next(i for i, line in enumerate(block) if line.startswith(f"  {key}:"))
            assert block[number - 1].lstrip().startswith("#"), \
                f"{section}.{key} has no comment above it"
