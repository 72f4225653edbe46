"""The OpenAPI document: printed by `kvroute openapi`, committed as docs/openapi.json,
served at /openapi.json only with `docs` on, and true to the app it describes.

Whether the running service answers as the document says is tests/api/test_openapi_fuzz.py's
question; here: the document's own consistency with the code and the settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from fastapi.routing import APIRoute

from kvroute.app.api.contract import CONTRACT
from kvroute.app.config import Settings
from kvroute.app.http.app import create_app
from kvroute.app.http.openapi import markdown_table, openapi_document, reference_settings, render
from kvroute.app.server import BackgroundServer
from tests.support.paths import REPO
from tests.support.waiting import HTTP_TIMEOUT, scaled

COMMITTED = REPO / "docs" / "openapi.json"
KVROUTE = [sys.executable, "-m", "kvroute.app.cli"]


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True,
                          timeout=scaled(60), env=os.environ.copy())


def operations(document: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, methods in document["paths"].items()
            for method in methods}


def test_kvroute_openapi_prints_the_committed_document():
    printed = kvroute("openapi")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == COMMITTED.read_text(), (
        "docs/openapi.json is not what `kvroute openapi` prints: regenerate it with "
        "`kvroute openapi > docs/openapi.json` and review the difference")


def test_the_reference_document_describes_every_operation_the_contract_has():
    document = json.loads(COMMITTED.read_text())
    assert operations(document) == set(CONTRACT)
    assert document["openapi"] == "3.1.0"
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            where = f"{method.upper()} {path}"
            assert operation["responses"], where
            for status, response in operation["responses"].items():
                assert response["description"], (where, status)
                if status != "default" and int(status) >= 400:
                    assert "application/json" in response["content"], (where, status)
            # The dashboard's static files hold no data; its JSON needs the token.
            if path not in ("/healthz", "/readyz", "/metrics") and not path.startswith(
                    "/dashboard"):
                assert operation["security"] in ([{"api_token": []}], [{"admin_token": []}])
                assert "401" in operation["responses"], where
    assert document["components"]["securitySchemes"]["api_token"] == {
        "type": "http", "scheme": "bearer",
        "description": document["components"]["securitySchemes"]["api_token"]["description"]}
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    # The links from a registration to reading and removing the same instance.
    ids = {operation["operationId"] for methods in document["paths"].values()
           for operation in methods.values()}
    links = document["paths"]["/v1/instances"]["post"]["responses"]["201"]["links"]
    assert {link["operationId"] for link in links.values()} == {"get_instance",
                                                                 "delete_instance"} <= ids


def test_every_route_has_a_contract_entry_and_the_reverse():
    app = create_app(reference_settings())
    routed = {(method, route.path) for route in app.routes
              if isinstance(route, APIRoute) for method in route.methods}
    assert routed == set(CONTRACT)


def test_the_served_document_follows_the_settings():
    plain = Settings(manage_instances=False, max_prompt_tokens=77, max_block_hashes=5,
                     max_prompt_chars=9)
    document = openapi_document(create_app(plain), plain)
    # No proxy, no instance management, no decision log: their operations are not described.
    assert operations(document) == set(CONTRACT) - {
        ("POST", "/v1/instances"), ("DELETE", "/v1/instances/{instance_id}"),
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
        ("GET", "/v1/decisions")}
    # No token: no security scheme and no 401.
    assert "securitySchemes" not in document["components"]
    route = document["paths"]["/v1/route"]["post"]
    assert "security" not in route and "401" not in route["responses"]
    # The limits are the settings'.
    fields = document["components"]["schemas"]["RouteRequest"]["properties"]
    assert fields["token_ids"]["anyOf"][0]["maxItems"] == 77
    assert fields["block_hashes"]["anyOf"][0]["maxItems"] == 5
    assert fields["prompt"]["anyOf"][0]["maxLength"] == 9
    # Without a tokenizer, text and chat prompts are refused: the schema allows only null.
    body = route["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"] == {"messages": {"type": "null"}, "prompt": {"type": "null"}}
    # Only an admin token: the instance list still needs none, registering does.
    admin = Settings(admin_token="a")
    guarded = openapi_document(create_app(admin), admin)
    assert "security" not in guarded["paths"]["/v1/instances"]["get"]
    assert guarded["paths"]["/v1/instances"]["post"]["security"] == [{"admin_token": []}]


def test_kvroute_openapi_with_a_config_prints_that_deployment(tmp_path):
    config = tmp_path / "kvroute.toml"
    config.write_text('api_token = "t"\nmax_prompt_tokens = 1234\n')
    printed = kvroute("openapi", "--config", str(config))
    assert printed.returncode == 0, printed.stderr
    document = json.loads(printed.stdout)
    assert ("POST", "/v1/completions") not in operations(document)
    assert document["paths"]["/v1/route"]["post"]["security"] == [{"api_token": []}]
    assert "t" not in {scheme.get("description") for scheme in
                       document["components"]["securitySchemes"].values()}
    fields = document["components"]["schemas"]["RouteRequest"]["properties"]
    assert fields["token_ids"]["anyOf"][0]["maxItems"] == 1234


@pytest.mark.parametrize("docs", [False, True])
def test_the_document_and_the_docs_page_are_served_only_with_docs_on(docs: bool):
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", docs=docs,
                        api_token="t", proxy=True, decision_log=10)
    with BackgroundServer(settings) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        served = http.get("/openapi.json")
        page = http.get("/docs")
        if not docs:
            assert served.status_code == page.status_code == 404
            return
        assert served.status_code == 200 and page.status_code == 200
        assert "/openapi.json" in page.text
        app = server._config.app  # the running app: its routes and settings
        assert served.json() == json.loads(render(openapi_document(app, settings)))
        assert operations(served.json()) == set(CONTRACT)


@pytest.mark.parametrize("body", [
    {}, {"url": None}, {"events": []}, {"events": ""}, {"url": "http://h:1"},
    {"events": "tcp://h:1"}, {"events": ["tcp://h:1"], "replay": ["tcp://h:2"]},
    {"url": "http://h:1", "id": " x"}, {"url": "http://h:1", "block_size": 0},
    {"url": "http://h:1", "block_size": 16.0}, {"url": "ftp://h"}, {"url": "http://h:1", "x": 1},
])
def test_the_registration_schema_accepts_what_registration_accepts(body: dict):
    """The rules JSON Schema can state are in the schema: a body is valid to it exactly when
    InstanceConfig takes it ("url or events" was missing: {} was schema-valid)."""
    import jsonschema_rs

    from kvroute.app.api.json_body import integral_numbers
    from kvroute.app.config import ConfigError, parse_instance

    document = json.loads(COMMITTED.read_text())
    schema = document["paths"]["/v1/instances"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    valid = jsonschema_rs.Draft202012Validator(
        {**schema, "components": document["components"]}).is_valid(body)
    try:
        parse_instance(integral_numbers(json.loads(json.dumps(body))), "body")
    except ConfigError:
        accepted = False
    else:
        accepted = True
    assert valid == accepted


def test_every_request_example_is_valid_to_its_schema():
    import jsonschema_rs

    document = json.loads(COMMITTED.read_text())
    seen = 0
    for methods in document["paths"].values():
        for operation in methods.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            schema = (body or {}).get("schema", {})
            validator = jsonschema_rs.Draft202012Validator(
                {**schema, "components": document["components"]})
            for example in schema.get("examples", ()):
                assert validator.is_valid(example), (operation["operationId"], example)
                seen += 1
    assert seen >= 4


def test_the_api_pages_table_is_the_documents():
    """docs/api.md's table of operations is generated between markers; regenerate it with
    `kvroute openapi --markdown` when this fails."""
    readme = (COMMITTED.parent / "api.md").read_text()
    begin = "<!-- BEGIN generated by `kvroute openapi --markdown` -->\n"
    end = "<!-- END generated -->"
    assert readme.count(begin) == readme.count(end) == 1
    table = readme.split(begin)[1].split(end)[0]
    printed = kvroute("openapi", "--markdown")
    assert printed.returncode == 0, printed.stderr
    assert table == printed.stdout, "docs/api.md's table is stale: paste `kvroute openapi " \
                                    "--markdown` between its markers"
    assert table == markdown_table(json.loads(COMMITTED.read_text()))
    # Every operation has its row, with every status the document lists for it.
    for path, methods in json.loads(COMMITTED.read_text())["paths"].items():
        for method, operation in methods.items():
            (row,) = [line for line in table.splitlines()
                      if line.startswith(f"| `{method.upper()} {path}` |")]
            statuses = row.rsplit("|", 2)[1]
            for status in operation["responses"]:
                assert status == "default" or status in statuses, (method, path, status)
