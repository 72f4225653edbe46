"""The Helm chart as the tests see it (no helm binary is available to render it).

Its files (``CHART``, ``TEMPLATES``, ``load_values``, ``template_text``) and a walker of a
template's control flow: `if`/`else if`/`else`/`with`/`range` conditions, `$x := ...`
assignments, `fail` and `include "kvroute.stateMode"` are evaluated against values.yaml
plus overrides (``merged``, ``rendered``); every other action is kept verbatim. An
expression the walker does not know raises, so a template change shows up in the tests
instead of passing unchecked. ``MODES`` are the values of each way to keep saved state.
"""

from __future__ import annotations

import json
import re

import yaml

from tests.support.paths import REPO

CHART = REPO / "helm" / "kvroute"
TEMPLATES = sorted((CHART / "templates").glob("*"))
ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
OPENERS = ("if ", "range ", "with ", "define ")


def load_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def template_text(name: str) -> str:
    return (CHART / "templates" / name).read_text()


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
    """Renders a template's control flow for some values (see the module's docstring)."""

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
