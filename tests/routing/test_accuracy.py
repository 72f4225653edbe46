"""Predicted against actual cached tokens (app.routing.accuracy): the scanner on its own, and
through `kvroute serve --proxy` over real HTTP against simulated vLLM, whose usage reports
the cached tokens its own prefix cache served."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvroute.app.config import Settings
from kvroute.app.routing.accuracy import CARRY, HitAccuracy, UsageScanner
from kvroute.sim.cluster import SimCluster
from tests.support.following import following, instance_ids
from tests.support.metrics import metric
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16

USAGE = (b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi"}],'
         b'"usage":{"prompt_tokens":70,"total_tokens":72,"completion_tokens":2,'
         b'"prompt_tokens_details":{"cached_tokens":48}}}')


def scan(*chunks: bytes) -> UsageScanner:
    scanner = UsageScanner()
    for chunk in chunks:
        scanner.feed(chunk)
    return scanner


# --- the scanner -------------------------------------------------------------------------------


def test_the_usage_is_found_however_the_body_is_cut():
    for cut in range(len(USAGE) + 1):
        scanner = scan(USAGE[:cut], USAGE[cut:])
        assert (scanner.saw_usage, scanner.prompt_tokens, scanner.cached_tokens) == (
            True, 70, 48), cut
    one_by_one = scan(*(USAGE[i:i + 1] for i in range(len(USAGE))))
    assert (one_by_one.prompt_tokens, one_by_one.cached_tokens) == (70, 48)


def test_a_long_answer_keeps_only_a_bounded_tail():
    text = "x" * 200_000
    body = USAGE.replace(b'"hi"', json.dumps(text).encode())
    scanner = UsageScanner()
    for start in range(0, len(body), 4096):
        scanner.feed(body[start:start + 4096])
        assert len(scanner._carry) <= CARRY
    assert scanner.cached_tokens == 48


def test_generated_text_quoting_the_usage_is_not_taken_for_it():
    fake = '"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":999}}'
    body = (b'{"choices":[{"text":' + json.dumps(fake).encode() + b'}]}')
    scanner = scan(body)
    assert (scanner.saw_usage, scanner.prompt_tokens, scanner.cached_tokens) == (
        False, None, None)


def test_the_last_usage_of_a_stream_wins_and_null_details_are_none():
    events = [b'data: {"choices":[],"usage":{"prompt_tokens":70,"prompt_tokens_details":'
              b'{"cached_tokens":16}}}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":70,"prompt_tokens_details":'
              b'{"cached_tokens":32}}}\n\n', b"data: [DONE]\n\n"]
    assert scan(*events).cached_tokens == 32
    no_details = scan(b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}')
    assert (no_details.saw_usage, no_details.cached_tokens) == (True, None)


def test_each_watched_request_is_recorded_once_with_one_outcome():
    registry = CollectorRegistry()
    accuracy = HitAccuracy(registry)
    key = ("a", 0)
    cases = [  # (status, encoding, chunks, complete, predicted, prompt tokens) -> outcome
        ((200, None, [USAGE], True, 48, 70), "compared"),
        ((200, None, [USAGE], True, 32, 70), "compared"),
        ((200, None, [USAGE], True, 48, 71), "prompt_mismatch"),
        ((200, None, [b'{"usage":{"prompt_tokens":70}}'], True, 0, 70), "no_details"),
        ((200, None, [b"data: [DONE]\n\n"], True, 0, 70), "no_usage"),
        ((200, None, [USAGE[:40]], False, 0, 70), "incomplete"),
        ((400, None, [b'{"error":"no"}'], True, 0, 70), "error"),
        ((200, "gzip", [b"\x1f\x8b"], True, 0, 70), "compressed"),
    ]
    for (status, encoding, chunks, complete, predicted, prompt), _ in cases:
        watch = accuracy.watch(key, predicted, prompt)
        watch.start(status, encoding)
        for chunk in chunks:
            watch.feed(chunk)
        watch.finish(complete)
        watch.finish(complete)  # a second finish records nothing
    totals = accuracy.totals[key]
    assert (totals.requests, totals.exact, totals.predicted, totals.actual,
            totals.unavailable) == (2, 1, 80, 96, 6)
    labels = {"instance": "a", "dp_rank": "0"}
    for reason in ("prompt_mismatch", "no_details", "no_usage", "incomplete", "error",
                   "compressed"):
        assert registry.get_sample_value("kvroute_cached_tokens_unavailable_total",
                                         {**labels, "reason": reason}) == 1.0, reason
    assert registry.get_sample_value("kvroute_predicted_cached_tokens_total", labels) == 80
    assert registry.get_sample_value("kvroute_actual_cached_tokens_total", labels) == 96
    # 0 is a bucket of its own: one difference of 0, one of +16.
    assert registry.get_sample_value("kvroute_cached_tokens_difference_bucket",
                                     {**labels, "le": "-0.5"}) == 0
    assert registry.get_sample_value("kvroute_cached_tokens_difference_bucket",
                                     {**labels, "le": "0.5"}) == 1
    assert registry.get_sample_value("kvroute_cached_tokens_difference_bucket",
                                     {**labels, "le": "16.5"}) == 2
    # No _sum: the client library leaves it out of a histogram with negative buckets.
    assert registry.get_sample_value("kvroute_cached_tokens_difference_count", labels) == 2


# --- through the proxy -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[httpx.Client, SimCluster, list[str]]]:
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", proxy=True,
                        tokenizer="instance", placement_ttl=0.0)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=256, stream_interval_s=0.01) as cluster, \
            following(cluster, settings) as http:
        yield http, cluster, instance_ids(cluster, http)


def learned(http: httpx.Client, instance_id: str, prompt: list[int], tokens: int) -> None:
    def check() -> bool:
        answer = http.post("/v1/route", json={"token_ids": prompt, "probe": True}).json()
        return answer["instance"] == instance_id and answer["matched_tokens"] == tokens
    wait_for(check, f"kvroute to learn {instance_id} holds {tokens} tokens")


def test_proxied_answers_agree_exactly_streamed_or_not(proxy):
    http, cluster, ids = proxy
    labels = {"instance": ids[1], "dp_rank": "0"}
    exact_before = metric(http, "kvroute_cached_tokens_difference_bucket", 0.0, **labels, le="0.5")
    predicted_before = metric(http, "kvroute_predicted_cached_tokens_total", 0.0, **labels)
    prompt = unique_tokens(31, 12 * BLOCK + 3)
    cluster.complete(1, prompt, max_tokens=1)
    learned(http, ids[1], prompt, 12 * BLOCK)
    plain = http.post("/v1/completions", json={"model": "sim-model", "prompt": prompt,
                                               "max_tokens": 2})
    assert plain.status_code == 200
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"cached_tokens":192' in events[-2]
    wait_for(lambda: metric(http, "kvroute_cached_tokens_difference_bucket", 0.0, **labels,
                            le="0.5") == exact_before + 2, "two exact comparisons")
    assert metric(http, "kvroute_predicted_cached_tokens_total", 0.0, **labels) == \
        predicted_before + 2 * 12 * BLOCK
    assert metric(http, "kvroute_cached_tokens_difference_bucket", 0.0, **labels,
                  le="-0.5") == 0


def test_a_stream_without_usage_and_an_error_are_counted_unavailable(proxy):
    http, cluster, ids = proxy

    def unavailable(reason: str) -> float:
        return sum(metric(http, "kvroute_cached_tokens_unavailable_total", 0.0, instance=i,
                          dp_rank="0", reason=reason) for i in ids)

    before = unavailable("no_usage"), unavailable("error")
    body = {"model": "sim-model", "prompt": unique_tokens(32, 40), "max_tokens": 2,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as streamed:
        assert streamed.status_code == 200
        streamed.read()
    refused = http.post("/v1/completions", json={"model": "sim-model",
                                                 "prompt": unique_tokens(33, 40),
                                                 "max_tokens": -1})
    assert refused.status_code == 400 and "x-kvroute-instance" in refused.headers
    wait_for(lambda: (unavailable("no_usage"), unavailable("error")) ==
             (before[0] + 1, before[1] + 1), "the stream without usage and the 400 counted")


def test_a_cache_changed_behind_kvroutes_back_shows_a_difference(proxy):
    http, cluster, ids = proxy
    labels = {"instance": ids[0], "dp_rank": "0"}
    prompt = unique_tokens(34, 8 * BLOCK + 1)
    cluster.complete(0, prompt, max_tokens=1)
    learned(http, ids[0], prompt, 8 * BLOCK)
    below = metric(http, "kvroute_cached_tokens_difference_bucket", 0.0, **labels, le="-64.5")
    # The engine forgets its cache; it announces that only with its next step, which is
    # the proxied request's own: kvroute still predicts the 128 tokens it knew of.
    assert httpx.post(f"{cluster.urls[0]}/reset_prefix_cache", timeout=HTTP_TIMEOUT).is_success
    answer = http.post("/v1/completions", json={"model": "sim-model", "prompt": prompt,
                                                "max_tokens": 1})
    assert answer.headers["x-kvroute-instance"] == ids[0]
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: metric(http, "kvroute_cached_tokens_difference_bucket", 0.0, **labels,
                            le="-64.5") == below + 1, "the difference of -128 counted")


def test_a_stream_the_client_leaves_is_counted_incomplete(proxy):
    http, cluster, ids = proxy

    def incomplete() -> float:
        return sum(metric(http, "kvroute_cached_tokens_unavailable_total", 0.0, instance=i,
                          dp_rank="0", reason="incomplete") for i in ids)

    before = incomplete()
    body = {"model": "sim-model", "prompt": unique_tokens(35, 40), "max_tokens": 400,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=str(http.base_url), timeout=HTTP_TIMEOUT) as leaving:
        with leaving.stream("POST", "/v1/completions", json=body) as streamed:
            assert streamed.status_code == 200
            next(streamed.iter_lines())  # the first event, then the client goes away
    wait_for(lambda: incomplete() == before + 1, "the abandoned stream counted incomplete")
