"""A method a path does not serve is a 405 whose Allow header lists every method the path
does serve (RFC 9110), in the service's JSON error shape; a trailing slash is a 404, never a
redirect. Through real HTTP, against every route the app has."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from tests.support.waiting import HTTP_TIMEOUT

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "QUERY")
# A concrete path for each route template.
PATHS = {"/v1/instances/{instance_id}": "/v1/instances/gpu-a"}


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True)
    with BackgroundServer(settings) as running:
        yield running


def served_methods(server: BackgroundServer) -> dict[str, set[str]]:
    """Path -> the methods its routes declare, from the running app itself."""
    served: dict[str, set[str]] = {}
    for route in server._config.app.routes:  # type: ignore[union-attr]
        if getattr(route, "include_in_schema", False):
            path = PATHS.get(route.path, route.path)
            served.setdefault(path, set()).update(route.methods)
    return served


def test_every_undeclared_method_is_a_405_listing_the_declared_ones(server: BackgroundServer):
    served = served_methods(server)
    assert {"/v1/route", "/v1/instances", "/v1/instances/gpu-a", "/v1/completions",
            "/healthz", "/metrics"} <= set(served)
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        for path, declared in served.items():
            for method in sorted(set(METHODS) - declared):
                answer = http.request(method, path)
                assert answer.status_code == 405, (method, path, answer.text)
                allowed = {m.strip() for m in answer.headers["allow"].split(",")}
                assert allowed == declared, (method, path)
                if method != "HEAD":
                    assert answer.json()["field"] is None
                    assert method in answer.json()["error"]


def test_instance_management_switched_off_leaves_only_the_list():
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", manage_instances=False)
    with BackgroundServer(settings) as server, \
            httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        refused = http.post("/v1/instances", json={"url": "http://127.0.0.1:9"})
        assert refused.status_code == 405 and refused.headers["allow"] == "GET"
        gone = http.delete("/v1/instances/x")
        assert gone.status_code == 405 and gone.headers["allow"] == "GET"


def test_a_trailing_slash_is_not_redirected(server: BackgroundServer):
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        for method, path in (("GET", "/v1/instances/"), ("POST", "/v1/route/"),
                             ("GET", "/healthz/")):
            answer = http.request(method, path)
            assert answer.status_code == 404, (method, path)
            assert answer.json() == {"error": "Not Found", "field": None}
