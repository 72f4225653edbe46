"""POST /v1/route and /v1/match answered by the lean ASGI path (app.http.route_asgi) as the
declared FastAPI endpoints answer them: two real servers on the same settings and instance,
one of them with the lean path taken out, asked the same requests (answers and every kind
of refusal)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from kvroute.app.config import Settings
from kvroute.app.http.route_asgi import RouteFastPath
from kvroute.app.server import BackgroundServer
from kvroute.sim.instance import SimInstance
from kvroute.sim.spec import SimInstanceSpec
from tests.support.waiting import HTTP_TIMEOUT, wait_for

TOKEN = "route-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "content-type": "application/json"}

# (headers, body): an answer and each way a route request is refused.
REQUESTS: list[tuple[dict[str, str], bytes]] = [
    (JSON, b'{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}'),
    (JSON, b'{"token_ids": [1, 2, 3], "probe": true, "all_scores": true}'),
    (JSON, b'{"block_hashes": [12, "0xff"]}'),
    ({"content-type": "application/json"}, b'{"token_ids": [1]}'),  # no token: 401
    ({**JSON, "authorization": "Bearer wrong"}, b'{"token_ids": [1]}'),
    ({**AUTH, "content-type": "text/plain"}, b'{"token_ids": [1]}'),  # 415
    (JSON, b'{"token_ids": [1], "pad": "' + b"x" * 5000 + b'"}'),  # over max_body_bytes: 413
    (JSON, b"{not json"),  # 400
    (JSON, b'{"token_ids": [1, -2]}'),  # 422 naming token_ids[1]
    (JSON, b'{"token_ids": [1.0, 2]}'),  # integral floats are integers to the schema
    (JSON, b'{"token_ids": [1], "prompt": "hi"}'),  # 422: two inputs
    (JSON, b'{"token_ids": [1], "candidates": ["nobody"]}'),  # 404
    (JSON, b'{"token_ids": [1], "model": "other"}'),  # 404: no instance serves it
    (JSON, b"{}"),  # 422: no input
]


@pytest.fixture(scope="module")
def instance() -> Iterator[SimInstance]:
    with SimInstance(SimInstanceSpec(block_size=16, num_blocks=64, seed=7, model="m")) as sim:
        yield sim


def _server(stack: ExitStack, lean: bool) -> httpx.Client:
    # No load scraping: a scrape that lands between two requests on one server and not on
    # the other (a loaded machine) changes the later answers' load figures on one only.
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", placement_ttl=0.0,
                        api_token=TOKEN, max_body_bytes=4096, load_interval=0.0)
    server = BackgroundServer(settings)
    if not lean:  # the stack is built at the first request: take the lean path out first
        app = server._config.app
        app.user_middleware = [m for m in app.user_middleware if m.cls is not RouteFastPath]
    stack.enter_context(server)
    return stack.enter_context(httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT))


def _seen(answer: httpx.Response) -> tuple[int, str, str | None, object]:
    body = answer.json()
    # The one figure that depends on when a route came: the demand routed to a worker
    # lately decays with time, and the two servers are asked one after the other.
    for score in body.get("scores", []) if isinstance(body, dict) else []:
        score["load"]["recent_demand"] = "decays"
    return (answer.status_code, answer.headers["content-type"],
            answer.headers.get("www-authenticate"), body)


@pytest.mark.parametrize("path, statuses", [
    ("/v1/route", [503, 200, 200, 200, 401, 401, 415, 413, 400, 422, 200, 422, 404, 404, 422]),
    # A match query takes neither `probe` nor `all_scores`: the second request is a 422.
    ("/v1/match", [503, 200, 422, 200, 401, 401, 415, 413, 400, 422, 200, 422, 404, 404, 422]),
])
def test_the_lean_path_answers_as_the_declared_endpoint(instance: SimInstance, path: str,
                                                        statuses: list[int]) -> None:
    with ExitStack() as stack:
        lean, declared = _server(stack, lean=True), _server(stack, lean=False)
        answers: dict[str, list[tuple[int, str, str | None, object]]] = {}
        for name, http in (("lean", lean), ("declared", declared)):
            no_instance = http.post(path, content=b'{"token_ids": [1]}', headers=JSON)
            assert no_instance.status_code == 503  # nothing registered yet
            added = http.post("/v1/instances", json={"url": instance.url}, headers=AUTH)
            assert added.status_code == 201, added.text
            wait_for(lambda http=http: http.get("/v1/instances", headers=AUTH).json()[
                "instances"][0]["state"] == "live", "live")
            answers[name] = [_seen(no_instance)] + [
                _seen(http.post(path, content=body, headers=headers))
                for headers, body in REQUESTS]
        assert answers["lean"] == answers["declared"]
        assert [status for status, *_ in answers["lean"]] == statuses
        assert answers["lean"][4][2] == "Bearer"  # the 401 says how to authenticate
        # Each path's refusals are counted in its own metric, by either path.
        metrics = lean.get("/metrics").text
        name = "kvroute_route_errors" if path == "/v1/route" else "kvroute_match_errors"
        assert f'{name}_total{{status="401"}} 2.0' in metrics, metrics
        # Other methods still reach the app: a 405 naming the allowed one.
        refused = lean.get(path, headers=AUTH)
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"
