"""Whatever a client sends to the routing and registration endpoints, the answer is a
JSON 2xx or 4xx: never a 5xx, a reset or a hang.

Bodies are drawn from arbitrary JSON, from requests shaped like the real ones with
hostile values in every field, and from raw bytes. The service runs for real (HTTP on
loopback, a simulated vLLM instance behind it); one client is shared across examples so
a reset connection would fail the example that caused it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.app.config import Settings
from kvroute.sim.cluster import SimCluster
from tests.support.following import following

NO_5XX = settings(max_examples=150, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    settings = Settings(host="127.0.0.1", port=0, log_level="critical", tokenizer="instance",
                        placement_ttl=0.0, max_prompt_tokens=2048, max_body_bytes=64 * 1024)
    with SimCluster(n=1, block_size=16, num_blocks=64, model="sim-model") as sim, \
            following(sim, settings) as client:
        yield client


SCALARS = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                        max_leaves=30)
TOKENS = st.lists(st.integers(min_value=-5, max_value=2**33), max_size=80)
HASHES = st.lists(st.integers(min_value=-2**65, max_value=2**65)
                  | st.text(alphabet="0123456789abcdefxyz-", max_size=20), max_size=20)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "", "x"]) | ANY_JSON},
    optional={"content": st.text(max_size=60) | ANY_JSON}), max_size=4)
ROUTE_FIELDS = {
    "token_ids": TOKENS | ANY_JSON,
    "block_hashes": HASHES | ANY_JSON,
    "prompt": st.text(max_size=200) | ANY_JSON,
    "messages": MESSAGES | ANY_JSON,
    "model": st.sampled_from(["sim-model", "absent", ""]) | ANY_JSON,
    "lora_name": st.text(max_size=10) | ANY_JSON,
    "candidates": st.lists(st.sampled_from(["127.0.0.1", "nope", ""]), max_size=3) | ANY_JSON,
    "probe": st.booleans() | ANY_JSON,
}
INPUTS = ("token_ids", "block_hashes", "prompt", "messages")
# Exactly one prompt input (what the endpoint accepts) gets past the first check into
# tokenizing, matching and scoring; several or none are drawn by the looser strategy.
ONE_INPUT_BODY = st.sampled_from(INPUTS).flatmap(lambda name: st.fixed_dictionaries(
    {name: ROUTE_FIELDS[name]},
    optional={k: v for k, v in ROUTE_FIELDS.items() if k not in INPUTS}))
ROUTE_BODY = ONE_INPUT_BODY | st.fixed_dictionaries({}, optional=ROUTE_FIELDS)

# Only loopback or malformed URLs: a fuzzed registration must not reach the network.
URLS = st.sampled_from([
    "http://127.0.0.1:9", "http://127.0.0.1:0", "http://127.0.0.1:99999", "http://[::1",
    "http://[::1]:9", "ftp://127.0.0.1", "http://u:p@127.0.0.1:9", "http://127.0.0.1:9/x",
    "http://127.0.0.1:9?q", "http://127.0.0.1:9#f", "127.0.0.1:9", "http://", "", " ",
    "http://127.0.0.1:9" + "/" * 3, "HTTP://127.0.0.1:9",
])
ENDPOINTS = st.lists(st.sampled_from([
    "tcp://127.0.0.1:9", "tcp://127.0.0.2:9", "tcp://*:9", "tcp://127.0.0.1:0",
    "tcp://127.0.0.1", "ipc:///tmp/x", "tcp://[::1]:9", "",
]), max_size=3)
INSTANCE_FIELDS = {
    "url": URLS | ANY_JSON,
    "id": st.text(max_size=12) | ANY_JSON,
    "model": st.text(max_size=12) | ANY_JSON,
    "events": ENDPOINTS | ANY_JSON,
    "replay": ENDPOINTS | ANY_JSON,
    "topic": st.text(max_size=8) | ANY_JSON,
    "block_size": st.integers(min_value=-2, max_value=2**40) | ANY_JSON,
    "api_key": st.text(max_size=8) | ANY_JSON,
    "unknown": ANY_JSON,
}
INSTANCE_BODY = st.fixed_dictionaries({}, optional=INSTANCE_FIELDS)


def post(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def assert_answered_as_json(answer: httpx.Response) -> None:
    assert answer.status_code < 500, answer.text
    payload = answer.json()  # every answer, refusals included, is JSON
    if answer.status_code >= 400:
        assert isinstance(payload["error"], str) and payload["error"]


def encoded(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# A match query takes a route's prompt and selection: the same bodies.
ASKING = pytest.mark.parametrize("path", ["/v1/route", "/v1/match"])


@ASKING
@NO_5XX
@given(body=ROUTE_BODY | ANY_JSON)
def test_route_answers_any_json_with_a_2xx_or_a_named_4xx(http: httpx.Client, path: str,
                                                          body: object):
    assert_answered_as_json(post(http, path, encoded(body)))


@ASKING
@NO_5XX
@given(body=st.binary(max_size=300))
def test_route_answers_any_bytes_with_a_4xx(http: httpx.Client, path: str, body: bytes):
    answer = post(http, path, body)
    assert_answered_as_json(answer)


@NO_5XX
@given(body=INSTANCE_BODY | ANY_JSON | st.binary(max_size=200))
def test_registration_answers_anything_without_a_5xx_other_than_discovery(
        http: httpx.Client, body: object):
    answer = post(http, "/v1/instances", body if isinstance(body, bytes) else encoded(body))
    if answer.status_code == 502:
        # Discovery reached the named instance and it failed: the instance's fault, not
        # the request's. Only valid registrations get that far.
        assert answer.json()["field"] == "url" and "discovery failed" in answer.json()["error"]
        return
    assert_answered_as_json(answer)
    if answer.status_code == 201:  # explicit endpoints on loopback: take it away again
        instance_id = answer.json()["id"]
        assert instance_id.isprintable()
        assert http.delete(f"/v1/instances/{quote(instance_id, safe='')}").status_code == 200
