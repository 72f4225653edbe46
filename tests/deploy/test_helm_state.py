"""Static checks of the Helm chart's saved state: which template text each set of values
selects (walked by tests.support.helm, as helm is not available), for each way to keep
state (a directory, the chart's Valkey, an external one), and the values that must fail.
"""

from __future__ import annotations

import re

import pytest

from kvroute.app.config import ConfigError, Settings, load_settings
from tests.support.helm import (
    CHART,
    EXTERNAL,
    MODES,
    TEMPLATES,
    VALKEY,
    TemplateFail,
    Walker,
    defined,
    env_entries,
    load_values,
    merged,
    rendered,
    state_mode,
    template_text,
)


def test_the_walker_renders_control_flow_like_helm() -> None:
    text = ('{{- $x := .Values.a }}{{ if eq $x "on" }}A{{ else if .Values.b }}B{{ else }}C'
            '{{ end }}|{{ with .Values.c }}{{ if eq . "-" }}dash{{ else }}{{ . }}{{ end }}'
            '{{ end }}|{{ range .Values.d }}[{{ .u }}]{{ end }}')
    assert Walker({"a": "on", "c": "-", "d": [{"u": 1}, {"u": 2}]}).render(text) == \
        "A|dash|[{{ .u }}][{{ .u }}]"
    assert Walker({"a": "off", "b": 1, "c": "x"}).render(text) == "B|{{ . }}|"
    assert Walker({}).render(text) == "C||"
    with pytest.raises(TemplateFail, match="no"):
        Walker({"a": 1}).render('{{ if .Values.a }}{{ fail "no" }}{{ end }}')
    with pytest.raises(NotImplementedError):
        Walker({}).render("{{ if unknownFunction .Values.a }}{{ end }}")


def test_new_templates_exist() -> None:
    names = {p.name for p in TEMPLATES}
    assert {"pvc.yaml", "state-secret.yaml", "valkey-deployment.yaml", "valkey-service.yaml",
            "valkey-networkpolicy.yaml"} <= names


@pytest.mark.parametrize("case", MODES)
def test_the_state_mode_follows_the_values(case: str) -> None:
    overrides, mode = MODES[case]
    assert state_mode(overrides) == mode


def test_the_walker_sees_the_current_chart() -> None:
    # The branch walker must understand every template it is used on, in every mode.
    for overrides, _ in MODES.values():
        for template in TEMPLATES:
            if template.name != "_helpers.tpl":
                rendered(template.name, overrides)


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"replicaCount": 2}, "replicaCount > 1 needs shared state"),
    ({"replicaCount": 5, "persistence": {"enabled": True}}, "replicaCount > 1 needs shared"),
    ({"valkey": {"enabled": True}, "externalValkey": {"url": "redis://r:6379/0"}},
     "choose one"),
    ({"valkey": {"enabled": True}, "persistence": {"enabled": True}},
     "set persistence.enabled=false"),
    ({"externalValkey": {"existingSecret": "s"}, "persistence": {"enabled": True}},
     "set persistence.enabled=false"),
    ({"externalValkey": {"url": "redis://r:6379/0", "existingSecret": "s"}}, "not both"),
    ({"valkey": {"enabled": True}, "externalValkey": {"caSecret": "ca"}},
     "externalValkey.caSecret is for an external"),
])
def test_inconsistent_state_values_fail_at_render_time(overrides: dict, needle: str) -> None:
    with pytest.raises(TemplateFail, match=re.escape(needle)):
        rendered("deployment.yaml", overrides)


def test_the_replica_message_names_both_ways_to_share_state() -> None:
    message = re.search(r'fail "(replicaCount > 1[^"]*)"', defined("kvroute.stateMode"))
    assert message, "no fail for replicas without shared state"
    assert "valkey.enabled" in message.group(1) and "externalValkey" in message.group(1)


def test_every_template_that_depends_on_the_state_mode_asks_the_checking_helper() -> None:
    for name in ("deployment.yaml", "config.yaml", "pvc.yaml", "state-secret.yaml",
                 "valkey-deployment.yaml", "valkey-service.yaml", "valkey-networkpolicy.yaml"):
        assert 'include "kvroute.stateMode" .' in template_text(name), name


@pytest.mark.parametrize("case", MODES)
def test_each_mode_wires_exactly_one_of_state_dir_and_state_url(case: str) -> None:
    overrides, mode = MODES[case]
    deployment = rendered("deployment.yaml", overrides)
    entries = env_entries(deployment)
    names = [name for name, _ in entries]
    assert len(names) == len(set(names)), f"repeated env: {names}"
    env = dict(entries)
    # The image sets KVROUTE_STATE_DIR; the pod always says what it wants instead.
    state_dir = env["KVROUTE_STATE_DIR"]
    if mode == "dir":
        assert "KVROUTE_STATE_URL" not in env
        assert "value: {{ .Values.persistence.mountPath | quote }}" in state_dir
        mounts = deployment.split("volumeMounts:")[1].split("volumes:")[0]
        assert "- name: state\n              mountPath: {{ .Values.persistence.mountPath }}" \
            in mounts
    else:
        assert 'value: ""' in state_dir, "the image's state directory is not cleared"
        assert "valueFrom" not in state_dir
        assert "- name: state\n" not in deployment
        url = env["KVROUTE_STATE_URL"]
        if mode == "external":
            assert "secretKeyRef" in url
            assert 'include "kvroute.stateUrlSecretName"' in url
            assert 'include "kvroute.stateUrlSecretKey"' in url
        elif merged(overrides)["valkey"]["auth"]["enabled"]:
            assert names.index("VALKEY_PASSWORD") < names.index("KVROUTE_STATE_URL")
            assert "secretKeyRef" in env["VALKEY_PASSWORD"]
            assert 'value: "redis://:$(VALKEY_PASSWORD)@{{ include "kvroute.valkeyFullname" . ' \
                   '}}:{{ .Values.valkey.port }}/0"' in url
        else:
            assert "VALKEY_PASSWORD" not in env
            assert 'value: "redis://{{ include "kvroute.valkeyFullname" . }}:' \
                   '{{ .Values.valkey.port }}/0"' in url
    # Neither ever goes through the config file (the URL may carry a password).
    config = rendered("config.yaml", overrides)
    assert not re.search(r"^\s*state_(dir|url) = ", config, re.M)


def test_an_empty_state_dir_variable_clears_the_images_default() -> None:
    # What the shared-state modes rely on: kvroute takes an empty variable as not given.
    settings = load_settings(environ={"KVROUTE_STATE_DIR": "",
                                      "KVROUTE_STATE_URL": "redis://kvroute-valkey:6379/0"})
    assert settings.state_dir is None and settings.state_url == "redis://kvroute-valkey:6379/0"
    with pytest.raises(ConfigError):
        load_settings(environ={"KVROUTE_STATE_DIR": "/var/lib/kvroute",
                               "KVROUTE_STATE_URL": "redis://kvroute-valkey:6379/0"})


@pytest.mark.parametrize("case", MODES)
def test_a_persistent_state_volume_uses_recreate_and_a_claim(case: str) -> None:
    overrides, mode = MODES[case]
    deployment = rendered("deployment.yaml", overrides)
    pvc = rendered("pvc.yaml", overrides)
    persistent = mode == "dir" and merged(overrides)["persistence"]["enabled"]
    assert ("type: Recreate" in deployment) is persistent
    assert ("kind: PersistentVolumeClaim" in pvc) is persistent
    volumes = deployment.split("volumes:")[1]
    if persistent:
        claim = '{{ .Values.persistence.existingClaim | default (printf "%s-state" ' \
                '(include "kvroute.fullname" .)) }}'
        assert f"claimName: {claim}" in volumes
        assert 'name: {{ include "kvroute.fullname" . }}-state' in pvc
    elif mode == "dir":
        assert "emptyDir: {{ .Values.persistence.emptyDir | toJson }}" in volumes
    # Recreate is explained where it is set.
    assert "two writers" in template_text("deployment.yaml")


def test_a_storage_class_of_dash_means_none() -> None:
    claim = rendered("pvc.yaml", {"persistence": {"enabled": True, "storageClass": "-"}})
    assert 'storageClassName: ""' in claim
    claim = rendered("pvc.yaml", {"persistence": {"enabled": True, "storageClass": "fast"}})
    assert "storageClassName: {{ . | quote }}" in claim
    assert "storageClassName" not in rendered("pvc.yaml", {"persistence": {"enabled": True}})


def test_an_existing_claim_is_used_instead_of_a_new_one() -> None:
    overrides = {"persistence": {"enabled": True, "existingClaim": "mine"}}
    assert "kind: PersistentVolumeClaim" not in rendered("pvc.yaml", overrides)
    assert "type: Recreate" in rendered("deployment.yaml", overrides)


def test_the_ca_bundle_is_mounted_where_the_config_file_says() -> None:
    config = rendered("config.yaml", EXTERNAL)
    path = re.search(r'^\s*state_ca_file = "([^"]+)"', config, re.M).group(1)
    deployment = rendered("deployment.yaml", EXTERNAL)
    mount = deployment.split("- name: state-ca\n")[1].split("\n")[0]
    assert f"mountPath: {path.rsplit('/', 1)[0]}" in mount
    items = deployment.split("volumes:")[1].split("- name: state-ca")[1]
    assert "secretName: {{ .Values.externalValkey.caSecret }}" in items
    assert f"path: {path.rsplit('/', 1)[1]}" in items
    for overrides in ({}, VALKEY, {"replicaCount": 2, "externalValkey": {"url": "redis://r:1/0"}}):
        assert "state_ca_file" not in rendered("config.yaml", overrides)
        assert "state-ca" not in rendered("deployment.yaml", overrides)


def test_the_state_secret_holds_what_the_deployment_reads() -> None:
    valkey = rendered("state-secret.yaml", VALKEY)
    assert "valkey-password:" in valkey and "state-url:" not in valkey
    assert "lookup" in template_text("state-secret.yaml"), "the password must survive upgrades"
    url = rendered("state-secret.yaml", MODES["external-url"][0])
    assert "state-url: {{ .Values.externalValkey.url | quote }}" in url
    assert "valkey-password" not in url
    # Secrets of yours: the chart writes none.
    for overrides in ({}, EXTERNAL, merged({"valkey": {"auth": {"existingSecret": "v"}}}, VALKEY),
                      MODES["valkey-no-password"][0]):
        assert "kind: Secret" not in rendered("state-secret.yaml", overrides)
    helpers = template_text("_helpers.tpl")
    assert "else }}valkey-password{{ end }}" in helpers
    assert "else }}state-url{{ end }}" in helpers
    values = load_values()
    assert values["externalValkey"]["existingSecretKey"] == "state-url"
    assert values["valkey"]["auth"]["existingSecretKey"] == "valkey-password"


def test_a_valkey_password_that_would_break_the_url_fails() -> None:
    bad = merged({"valkey": {"auth": {"password": "p@ss/word"}}}, VALKEY)
    with pytest.raises(TemplateFail, match="letters, digits"):
        rendered("state-secret.yaml", bad)
    good = merged({"valkey": {"auth": {"password": "Pass.word-1_~"}}}, VALKEY)
    assert "valkey-password:" in rendered("state-secret.yaml", good)


def test_the_chart_valkey_is_only_rendered_when_enabled() -> None:
    for name in ("valkey-deployment.yaml", "valkey-service.yaml", "valkey-networkpolicy.yaml"):
        for overrides in ({}, EXTERNAL):
            assert "kind:" not in rendered(name, overrides), name
        assert "kind:" in rendered(name, VALKEY), name


def test_the_chart_valkey_runs_unprivileged_in_memory_behind_its_own_labels() -> None:
    deployment = rendered("valkey-deployment.yaml", VALKEY)
    assert 'image: "{{ .Values.valkey.image.repository }}:{{ .Values.valkey.image.tag }}"' \
        in deployment
    assert load_values()["valkey"]["image"]["repository"] == "valkey/valkey"
    args = deployment.split("args:")[1].split("ports:")[0]
    assert '- --save\n            - ""' in args and '- --appendonly\n            - "no"' in args
    assert "- --requirepass\n            - $(VALKEY_PASSWORD)" in args
    assert "$(VALKEY_PASSWORD)" not in rendered("valkey-deployment.yaml",
                                                MODES["valkey-no-password"][0])
    # The image refuses to start unless its working directory /data is writable.
    assert "mountPath: /data" in deployment and "emptyDir: {}" in deployment
    assert "type: Recreate" in deployment and "replicas: 1" in deployment
    values = load_values()["valkey"]
    assert values["podSecurityContext"]["runAsNonRoot"] is True
    assert values["securityContext"]["readOnlyRootFilesystem"] is True
    assert values["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # Valkey's pods must never match kvroute's selector (its Service and NetworkPolicy).
    labels = defined("kvroute.valkeySelectorLabels")
    assert "-valkey" in labels.split("app.kubernetes.io/name:")[1].split("\n")[0]
    for name in ("valkey-deployment.yaml", "valkey-service.yaml", "valkey-networkpolicy.yaml"):
        text = template_text(name)
        assert 'include "kvroute.selectorLabels"' not in text.split("ingress:")[0], name
    service = rendered("valkey-service.yaml", VALKEY)
    assert 'name: {{ include "kvroute.valkeyFullname" . }}' in service
    assert "port: {{ .Values.valkey.port }}" in service


def test_only_kvroute_reaches_the_chart_valkey() -> None:
    policy = rendered("valkey-networkpolicy.yaml", VALKEY)
    assert "kind: NetworkPolicy" in policy
    assert 'include "kvroute.valkeySelectorLabels"' in policy.split("podSelector:")[1]
    ingress = policy.split("ingress:")[1]
    assert ingress.count("- from:") == 1 and ingress.count("podSelector:") == 1
    assert 'include "kvroute.selectorLabels"' in ingress
    assert "port: {{ .Values.valkey.port }}" in ingress
    # Valkey dials nowhere: Egress with no rule.
    assert "- Egress" in policy and "egress:" not in policy
    off = merged({"networkPolicy": {"enabled": False}}, merged(VALKEY))
    assert "kind:" not in Walker(off).render(template_text("valkey-networkpolicy.yaml"))
    # When kvroute's own egress is restricted, the chart's Valkey stays reachable.
    restricted = merged({"networkPolicy": {"egress": [{"to": [{"podSelector": {}}]}]}}, VALKEY)
    egress = rendered("networkpolicy.yaml", restricted).split("egress:")[1]
    assert 'include "kvroute.valkeySelectorLabels" $' in egress
    assert "port: {{ $.Values.valkey.port }}" in egress


def test_pods_get_no_service_links_and_time_to_save() -> None:
    # A Service named `kvroute` would put KVROUTE_PORT=tcp://... into every pod's
    # environment, where kvroute reads it as its port.
    with pytest.raises(ConfigError, match="port"):
        load_settings(environ={"KVROUTE_PORT": "tcp://10.96.0.1:8080"})
    for name in ("deployment.yaml", "valkey-deployment.yaml"):
        assert "enableServiceLinks: false" in template_text(name), name
    assert "terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}" \
        in template_text("deployment.yaml")


def test_state_settings_reach_the_config_file() -> None:
    config = rendered("config.yaml")
    assert "state_save_interval = {{ .Values.config.stateSaveInterval }}" in config
    assert "unconfirmed_ttl = {{ .Values.config.unconfirmedTtl }}" in config
    defaults = Settings()
    values = load_values()["config"]
    assert values["stateSaveInterval"] == defaults.state_save_interval
    assert values["unconfirmedTtl"] == defaults.unconfirmed_ttl


def test_new_values_are_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()

    def commented(key: str, indent: int) -> bool:
        """Some `key:` at this indentation has a comment line right above it."""
        prefix = " " * indent + f"{key}:"
        return any(line.startswith(prefix) and lines[number - 1].lstrip().startswith("#")
                   for number, line in enumerate(lines) if number)

    for key in ("replicaCount", "terminationGracePeriodSeconds", "persistence", "valkey",
                "externalValkey"):
        assert commented(key, 0), f"{key} has no comment above it"
    for key in ("stateSaveInterval", "unconfirmedTtl", "enabled", "mountPath", "existingClaim",
                "storageClass", "size", "annotations", "emptyDir", "url", "existingSecret",
                "caSecret", "extraArgs", "podSecurityContext"):
        assert commented(key, 2), f"{key} has no comment above it"
    for key in ("enabled", "password", "existingSecret"):
        assert commented(key, 4), f"valkey.auth.{key} has no comment above it"
    values = load_values()
    assert values["persistence"]["enabled"] is False
    assert values["valkey"]["enabled"] is False
    assert values["externalValkey"]["url"] == "" and values["replicaCount"] == 1
