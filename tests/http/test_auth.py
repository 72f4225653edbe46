"""Bearer tokens through real HTTP: who may route, who may change the instance list, and
what the proxy sends on to an instance."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
from starlette.requests import Request

from kvroute.app.config import Settings
from kvroute.app.http.proxy import _forwarded_headers
from kvroute.app.server import BackgroundServer
from kvroute.sim.instance import SimInstance
from kvroute.sim.spec import SimInstanceSpec
from tests.support.waiting import HTTP_TIMEOUT, wait_for

API, ADMIN = "route-token", "admin-token"


@contextmanager
def kvroute(**overrides: object) -> Iterator[httpx.Client]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", placement_ttl=0.0,
                        **overrides)
    server = BackgroundServer(settings).start()
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            yield http
    finally:
        server.stop()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def assert_refused(answer: httpx.Response) -> None:
    assert answer.status_code == 401, answer.text
    assert answer.json()["field"] == "authorization" and answer.json()["error"]
    assert answer.headers["www-authenticate"] == "Bearer"


@pytest.fixture(scope="module")
def instance() -> Iterator[SimInstance]:
    with SimInstance(SimInstanceSpec(block_size=16, num_blocks=64, seed=5, model="m")) as sim:
        yield sim


def test_each_token_guards_its_endpoints(instance: SimInstance) -> None:
    with kvroute(api_token=API, admin_token=ADMIN) as http:
        route = {"token_ids": list(range(40))}
        for headers in ({}, bearer("wrong"), {"authorization": API}, bearer(ADMIN)):
            assert_refused(http.post("/v1/route", json=route, headers=headers))
            assert_refused(http.post("/v1/match", json=route, headers=headers))
            assert_refused(http.get("/v1/instances", headers=headers))
        # The route token cannot change which instances kvroute follows.
        assert_refused(http.post("/v1/instances", json={"url": instance.url},
                                 headers=bearer(API)))
        added = http.post("/v1/instances", json={"url": instance.url}, headers=bearer(ADMIN))
        assert added.status_code == 201, added.text
        instance_id = added.json()["id"]
        wait_for(lambda: http.get(f"/v1/instances/{instance_id}",
                                  headers=bearer(API)).json()["state"] == "live", "live")
        answer = http.post("/v1/route", json=route, headers=bearer(API))
        assert answer.status_code == 200 and answer.json()["instance"] == instance_id
        asked = http.post("/v1/match", json=route, headers=bearer(API))
        assert asked.status_code == 200 and asked.json()["eligible_workers"] == 1
        assert_refused(http.delete(f"/v1/instances/{instance_id}", headers=bearer(API)))
        assert http.delete(f"/v1/instances/{instance_id}",
                           headers=bearer(ADMIN)).status_code == 200
        # Probes and scrapers need no token.
        for path in ("/healthz", "/readyz", "/metrics"):
            assert http.get(path).status_code in (200, 503), path


def test_one_api_token_also_guards_instance_management(instance: SimInstance) -> None:
    with kvroute(api_token=API) as http:
        assert_refused(http.post("/v1/instances", json={"url": instance.url}))
        assert_refused(http.delete("/v1/instances/anything"))
        assert http.delete("/v1/instances/anything", headers=bearer(API)).status_code == 404


def test_instance_management_can_be_switched_off(instance: SimInstance) -> None:
    with kvroute(manage_instances=False) as http:
        assert http.post("/v1/instances", json={"url": instance.url}).status_code == 405
        assert http.delete("/v1/instances/x").status_code == 405
        assert http.get("/v1/instances").json() == {"instances": []}


def test_api_docs_are_off_unless_asked_for() -> None:
    with kvroute() as http:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 404, path
    with kvroute(docs=True) as http:
        assert http.get("/openapi.json").json()["info"]["title"] == "kvroute"
        assert http.get("/docs").status_code == 200


def test_the_proxy_sends_the_instances_key_not_kvroutes_token() -> None:
    spec = SimInstanceSpec(block_size=16, num_blocks=64, seed=6, model="guarded",
                           api_key="vllm-key")
    with SimInstance(spec) as guarded, kvroute(api_token=API, admin_token=ADMIN,
                                               proxy=True) as http:
        added = http.post("/v1/instances", json={"url": guarded.url, "api_key": "vllm-key"},
                          headers=bearer(ADMIN))
        assert added.status_code == 201, added.text
        instance_id = added.json()["id"]
        wait_for(lambda: http.get(f"/v1/instances/{instance_id}",
                                  headers=bearer(API)).json()["state"] == "live", "live")
        body = {"model": "guarded", "prompt": [7] * 20, "max_tokens": 1}
        assert_refused(http.post("/v1/completions", json=body))
        # The instance only accepts its own key: a 200 shows kvroute's token was replaced.
        answer = http.post("/v1/completions", json=body, headers=bearer(API))
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvroute-instance"] == instance_id


def _request(headers: list[tuple[str, str]]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.encode(), v.encode()) for k, v in headers],
                    "client": ("10.0.0.9", 5000), "query_string": b""})


def _worker(api_key: str | None) -> SimpleNamespace:
    return SimpleNamespace(instance=SimpleNamespace(config=SimpleNamespace(api_key=api_key)),
                           endpoint=SimpleNamespace(dp_rank=2))


def test_forwarded_headers() -> None:
    request = _request([("authorization", "Bearer client"), ("connection", "close, x-secret"),
                        ("x-secret", "hop"), ("x-forwarded-for", "1.2.3.4"),
                        ("x-request-id", "r1"), ("host", "kvroute")])
    sent = dict(_forwarded_headers(request, _worker("vllm-key"), instance_key=False))
    assert sent["authorization"] == "Bearer client"  # passed through by default
    assert "x-secret" not in sent and "connection" not in sent and "host" not in sent
    assert sent["x-forwarded-for"] == "1.2.3.4, 10.0.0.9"
    assert sent["forwarded"] == "for=10.0.0.9"
    assert sent["x-request-id"] == "r1" and sent["x-data-parallel-rank"] == "2"
    replaced = _forwarded_headers(request, _worker("vllm-key"), instance_key=True)
    assert [v for k, v in replaced if k == "authorization"] == ["Bearer vllm-key"]
    dropped = _forwarded_headers(request, _worker(None), instance_key=True)
    assert not [v for k, v in dropped if k == "authorization"]
