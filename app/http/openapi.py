"""The OpenAPI 3.1 document of a kvroute app, built from app.api.contract and the msgspec
types it names.

`openapi_document(app, settings)` describes exactly the operations `app` routes (the
proxy's and instance management depend on the settings), with the settings' limits in the
request schemas and a bearer security scheme on each operation whose token is configured.
Every JSON Schema comes from `msgspec.json.schema_components` over the types the code
decodes and encodes with. A route without a contract entry is an error, not a gap.

`reference_settings()` is the deployment docs/openapi.json describes: every endpoint,
both tokens set, a tokenizer, default limits. `kvroute openapi` prints that document.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.routing import APIRoute

from kvroute.app.api.answers import Error
from kvroute.app.api.contract import CONTRACT, JSON, Answer, Operation, Relayed
from kvroute.app.config import Settings
from kvroute.app.patterns import INSTANCE_ID

__all__ = ["markdown_table", "openapi_document", "reference_settings", "render"]

REF = "#/components/schemas/{name}"
TOKENS = {
    "api_token": "`api_token`: routing, the proxy, the instance list and the dashboard's "
                 "data.",
    "admin_token": "`admin_token`: registering and removing instances (`api_token` when "
                   "only that one is set).",
}
DESCRIPTION = (
    "kvroute follows the KV-cache events of a fleet of vLLM instances and tells a gateway "
    "which worker holds the longest cached prefix of a prompt (`POST /v1/route`), or "
    "forwards OpenAI requests there itself (`proxy` on).\n\n"
    "Bodies are JSON sent as `application/json`. Every refusal is JSON "
    "`{\"error\": message, \"field\": name-or-null}` with the status listed for its reason; "
    "a method a path does not serve is a 405 with an `Allow` header.")


def reference_settings() -> Settings:
    """The deployment the committed document describes (the tokens' values never appear)."""
    return Settings(proxy=True, api_token="reference", admin_token="reference",
                    tokenizer="instance", decision_log=10_000)


def _token_of(operation: Operation, settings: Settings) -> str | None:
    """The security scheme guarding `operation` under `settings` (app.http.auth's rule)."""
    if operation.guard == "admin" and settings.admin_token:
        return "admin_token"
    if operation.guard is not None and settings.api_token:
        return "api_token"
    return None


class _Schemas:
    """Collects the types the document names; `components()` turns them into JSON Schema
    once, all together, and every placeholder into its schema."""

    def __init__(self) -> None:
        self.types: list[Any] = []
        self._places: list[tuple[dict[str, Any], int]] = []

    def of(self, kind: Any) -> dict[str, Any]:
        """A placeholder for `kind`'s schema, filled in by `components()`."""
        if isinstance(kind, Relayed):
            return {"description": kind.description}
        if isinstance(kind, tuple):
            return {"anyOf": [self.of(each) for each in kind]}
        holder: dict[str, Any] = {}
        if kind not in self.types:
            self.types.append(kind)
        self._places.append((holder, self.types.index(kind)))
        return holder

    def components(self) -> dict[str, Any]:
        schemas, components = msgspec.json.schema_components(self.types, ref_template=REF)
        for holder, number in self._places:
            holder.update(schemas[number])
        for component in components.values():  # docstrings, without their indentation
            if "description" in component:
                component["description"] = inspect.cleandoc(component["description"])
        return components


def _sentence(reasons: tuple[str, ...]) -> str:
    texts = [reason[:1].upper() + reason[1:] for reason in reasons]
    return texts[0] + "." if len(texts) == 1 else "\n".join(f"- {text}." for text in texts)


def _response(answer: Answer, schemas: _Schemas) -> dict[str, Any]:
    out: dict[str, Any] = {"description": _sentence(answer.reasons)}
    if answer.headers:
        out["headers"] = {name: {"description": text, "required": True,
                                 "schema": {"type": "string"}}
                          for name, text in answer.headers.items()}
    if answer.links:
        out["links"] = {name: {"operationId": operation, "parameters": dict(parameters)}
                        for name, (operation, parameters) in answer.links.items()}
    if isinstance(answer.body, Relayed):
        out["content"] = {JSON: {"schema": {"type": "object"}},
                          "text/event-stream": {"schema": {"type": "string"}}}
    elif answer.body is not None:
        out["content"] = {answer.media_type: {"schema": schemas.of(answer.body)}}
    return out


UNAUTHORIZED = Answer(("the `Authorization: Bearer` token is missing or not this one",),
                      headers={"www-authenticate": "`Bearer`"})


def _operation(name: str, path: str, operation: Operation, settings: Settings,
               schemas: _Schemas) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": name, "summary": operation.summary,
                           "description": operation.description, "tags": [operation.tag]}
    parameters = [
        {"name": parameter, "in": "path", "required": True,
         "description": operation.parameters[parameter],
         "schema": {"type": "string", "pattern": INSTANCE_ID}}
        for parameter in re.findall(r"{(\w+)}", path)]
    parameters += [{"name": name, "in": "query", "required": False, "description": what,
                    "schema": schema} for name, (what, schema) in operation.query.items()]
    if parameters:
        out["parameters"] = parameters
    if operation.body is not None:
        out["requestBody"] = {"required": True, "content": {
            JSON: {"schema": schemas.of(operation.body(settings))}}}
    answers: Mapping[int | str, Answer] = operation.answers
    token = _token_of(operation, settings)
    if token is not None:
        out["security"] = [{token: []}]
        answers = {**answers, 401: UNAUTHORIZED}
    out["responses"] = {str(status): _response(answers[status], schemas)
                        for status in sorted(answers, key=str)}
    return out


def openapi_document(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`, built with `settings`."""
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    used_tokens: set[str] = set()
    for route in app.routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        for method in sorted(route.methods):
            operation = CONTRACT.get((method, route.path))
            if operation is None:
                raise LookupError(f"{method} {route.path} has no entry in app.api.contract")
            described = _operation(route.name, route.path, operation, settings, schemas)
            used_tokens.update(*(requirement for requirement in described.get("security", ())))
            paths.setdefault(route.path, {})[method.lower()] = described
    schemas.of(Error)  # the error shape is a component even where only 401 names it
    components: dict[str, Any] = {"schemas": schemas.components()}
    if used_tokens:
        components["securitySchemes"] = {
            token: {"type": "http", "scheme": "bearer", "description": TOKENS[token]}
            for token in sorted(used_tokens)}
    tags = dict.fromkeys(operation["tags"][0] for methods in paths.values()
                         for operation in methods.values())
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvroute", "version": version("kvroute"),
                 "summary": "KV-cache-aware routing for vLLM fleets",
                 "description": DESCRIPTION,
                 "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}},
        "tags": [{"name": tag} for tag in tags],
        "paths": paths,
        "components": components,
    }


def render(document: Mapping[str, Any]) -> str:
    """The document as docs/openapi.json holds it: indented, keys in document order."""
    return msgspec.json.format(msgspec.json.encode(document), indent=2).decode() + "\n"


def markdown_table(document: Mapping[str, Any]) -> str:
    """docs/api.md's table of operations: what each does and every status it answers."""
    rows = ["| method and path | what it does | statuses |", "|---|---|---|"]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            text = f"**{operation['summary']}.** {operation['description']}"
            statuses = ", ".join(status for status in operation["responses"]
                                 if status != "default")
            if "default" in operation["responses"]:
                statuses += ", and any status of the instance's own answer"
            rows.append(f"| `{method.upper()} {path}` | {text.replace('|', '/')} | {statuses} |")
    return "\n".join(rows) + "\n"
