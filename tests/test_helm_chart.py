"""Static checks of the Helm chart (no helm binary is available to render it).

What can break silently in a chart: a template naming a value that values.yaml
does not define (helm renders it as empty), an unbalanced control block, a
helper that does not exist, probes pointing at paths the service does not
serve, and a config file whose keys kvroute does not accept.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
import yaml

from kvroute.app.config import ConfigError, InstanceConfig, Settings, load_settings

CHART = Path(__file__).resolve().parent.parent / "helm" / "kvroute"
TEMPLATES = sorted((CHART / "templates").glob("*"))
VALUES_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
OPENERS = ("if ", "range ", "with ", "define ")


def load_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def template_text(name: str) -> str:
    return (CHART / "templates" / name).read_text()


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
    top_keys = set(re.findall(r"^\s*([a-z_]+) = ", top, re.M))
    instance_keys = set(re.findall(r"^\s*([a-z_]+) = ", instance, re.M))
    assert {"host", "port"} <= top_keys
    assert "url" in instance_keys
    assert top_keys <= {f.name for f in msgspec.structs.fields(Settings)}
    assert instance_keys <= {f.name for f in msgspec.structs.fields(InstanceConfig)}


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


# --- Saved state: which template text each set of values selects --------------------------
#
# Helm is not available, so the checks below walk a template's control flow themselves:
# `if`/`else if`/`else`/`with`/`range` conditions, `$x := ...` assignments, `fail` and
# `include "kvroute.stateMode"` are evaluated against values.yaml plus overrides; every
# other action is kept verbatim. An expression the walker does not know raises, so a
# template change shows up here instead of passing unchecked.

class TemplateFail(Exception):
    """A `fail` action was reached: the message helm would print."""


class _Unknown:
    """An assignment whose value the walker cannot compute (a pipeline)."""


EXPR_TOKEN = re.compile(r'\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+')


def merged(overrides: dict, base: dict | None = None) -> dict:
    """`overrides` deep-merged onto `base` (values.yaml when not given), as `--values` does."""
    result = dict(load_values() if base is None else base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(value, result[key])
        else:
            result[key] = value
    return result


def defined(name: str) -> str:
    """The body of `{{ define name }}` in _helpers.tpl."""
    helpers = template_text("_helpers.tpl")
    start = re.search(r'\{\{-?\s*define "' + re.escape(name) + r'"\s*-?\}\}', helpers)
    assert start, f"helper {name} is not defined"
    depth = 1
    for match in ACTION.finditer(helpers, start.end()):
        action = match.group(1)
        if action.startswith(OPENERS):
            depth += 1
        elif action == "end":
            depth -= 1
            if depth == 0:
                return helpers[start.end():match.start()]
    raise AssertionError(f"helper {name} never ends")


class Walker:
    """Renders a template's control flow for some values (see the comment above)."""

    FUNCTIONS = frozenset({"and", "or", "not", "eq", "gt", "int", "include", "lookup",
                           "randAlphaNum", "regexMatch"})

    def __init__(self, values: dict) -> None:
        self.root = {"Values": values, "Release": {"Name": "kvroute", "Namespace": "default"}}
        self.variables: dict[str, object] = {}

    def render(self, text: str) -> str:
        return self._render(self._parse(text), self.root)

    @staticmethod
    def _parse(text: str) -> list:
        """Nodes: ("text", s), ("action", source, action), ("block", kind, branches, else)
        where branches is [(condition, nodes), ...] (`else if` adds one)."""
        top: list = []
        stack: list[tuple[list | None, list]] = [(None, top)]
        position = 0
        for match in ACTION.finditer(text):
            stack[-1][1].append(("text", text[position:match.start()]))
            position = match.end()
            action = match.group(1)
            word = action.split(" ", 1)[0]
            if action.startswith("/*"):
                continue
            if word in ("if", "with", "range"):
                block = [word, [(action[len(word):].strip(), [])], None]
                stack[-1][1].append(("block", block))
                stack.append((block, block[1][0][1]))
            elif word == "else":
                block = stack[-1][0]
                assert block is not None, "`else` outside a block"
                body: list = []
                condition = action[len("else"):].strip()
                if condition.startswith("if "):
                    block[1].append((condition[3:], body))
                else:
                    block[2] = body
                stack[-1] = (block, body)
            elif action == "end":
                stack.pop()
                assert stack, "`end` without an opening block"
            else:
                stack[-1][1].append(("action", match.group(0), action))
        stack[-1][1].append(("text", text[position:]))
        assert len(stack) == 1, "unbalanced blocks"
        return top

    def _render(self, nodes: list, dot: object) -> str:
        out = []
        for node in nodes:
            if node[0] == "text":
                out.append(node[1])
            elif node[0] == "action":
                out.append(self._action(node[1], node[2], dot))
            else:
                out.append(self._block(*node[1], dot=dot))
        return "".join(out)

    def _block(self, kind: str, branches: list, otherwise: list | None, dot: object) -> str:
        condition, body = branches[0]
        value = self.evaluate(condition, dot)
        if kind == "range":
            items = list(value.values()) if isinstance(value, dict) else list(value or ())
            if items:
                return "".join(self._render(body, item) for item in items)
        elif value:
            return self._render(body, value if kind == "with" else dot)
        for condition, body in branches[1:]:
            if self.evaluate(condition, dot):
                return self._render(body, dot)
        return self._render(otherwise, dot) if otherwise is not None else ""

    def _action(self, source: str, action: str, dot: object) -> str:
        assignment = re.match(r"(\$\w+) :?= (.*)", action, re.S)
        if assignment:
            try:
                self.variables[assignment.group(1)] = self.evaluate(assignment.group(2), dot)
            except NotImplementedError:
                self.variables[assignment.group(1)] = _Unknown()
            return ""
        if action.startswith("fail "):
            raise TemplateFail(json.loads(action[len("fail "):]))
        return source

    def evaluate(self, expression: str, dot: object = None) -> object:
        dot = self.root if dot is None else dot
        result, rest = self._call(EXPR_TOKEN.findall(expression), dot)
        if rest:
            raise NotImplementedError(f"cannot evaluate {expression!r}")
        return result

    def _call(self, tokens: list[str], dot: object) -> tuple[object, list[str]]:
        head, *rest = tokens
        if head not in self.FUNCTIONS:
            return self._atom(tokens, dot)
        if head == "lookup":  # as under `helm template`: the cluster has nothing
            depth = 0
            while rest and (depth or rest[0] != ")"):
                depth += {"(": 1, ")": -1}.get(rest[0], 0)
                rest = rest[1:]
            return {}, rest
        args = []
        while rest and rest[0] != ")":
            arg, rest = self._atom(rest, dot)
            args.append(arg)
        if head == "and":
            result = next((a for a in args if not a), args[-1])
        elif head == "or":
            result = next((a for a in args if a), args[-1])
        elif head == "not":
            result = not args[0]
        elif head == "eq":
            result = args[0] == args[1]
        elif head == "gt":
            result = args[0] > args[1]
        elif head == "int":
            result = int(args[0])
        elif head == "randAlphaNum":
            result = "x" * args[0]
        elif head == "regexMatch":
            result = re.search(args[0], args[1]) is not None
        elif args[0] == "kvroute.stateMode":
            helper = Walker(self.root["Values"])
            result = helper._render(helper._parse(defined(args[0])), args[1]).strip()
        else:
            raise NotImplementedError(f"include {args[0]}")
        return result, rest

    def _atom(self, tokens: list[str], dot: object) -> tuple[object, list[str]]:
        head, *rest = tokens
        if head == "(":
            result, rest = self._call(rest, dot)
            assert rest and rest[0] == ")", tokens
            return result, rest[1:]
        if head.startswith('"') or re.fullmatch(r"-?\d+", head):
            return json.loads(head), rest
        if head == ".":
            return dot, rest
        if head.startswith((".", "$.")):
            node: object = self.root if head.startswith("$") else dot
            for key in head.lstrip("$").strip(".").split("."):
                node = node.get(key) if isinstance(node, dict) else None
            return node, rest
        if head in self.variables:
            value = self.variables[head]
            if isinstance(value, _Unknown):
                raise NotImplementedError(f"{head} is a pipeline")
            return value, rest
        raise NotImplementedError(f"cannot evaluate {head!r}")


def rendered(name: str, overrides: dict | None = None) -> str:
    return Walker(merged(overrides or {})).render(template_text(name))


def env_entries(deployment: str) -> list[tuple[str, str]]:
    """(name, entry text) of each environment variable of the kvroute container."""
    env = deployment.split("env:")[1].split("ports:")[0]
    parts = re.split(r"^\s*- name: (\S+)\s*$", env, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


VALKEY = {"replicaCount": 3, "valkey": {"enabled": True}}
EXTERNAL = {"replicaCount": 2, "externalValkey": {"existingSecret": "state", "caSecret": "ca"}}
MODES = {
    "dir": ({}, "dir"),
    "dir-persistent": ({"persistence": {"enabled": True}}, "dir"),
    "valkey": (VALKEY, "valkey"),
    "valkey-no-password": (merged({"valkey": {"auth": {"enabled": False}}}, VALKEY), "valkey"),
    "external-url": ({"replicaCount": 2, "externalValkey": {"url": "redis://r:6379/0"}},
                     "external"),
    "external-secret": (EXTERNAL, "external"),
}


def state_mode(overrides: dict) -> str:
    return Walker(merged(overrides)).evaluate('include "kvroute.stateMode" .')


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
