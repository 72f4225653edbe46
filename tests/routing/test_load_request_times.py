"""How long an engine's requests lately took, from its /metrics histograms: the mean of the
requests that ended since the previous reading. A real HTTP server on 127.0.0.1 serves the
pages; the monitor scrapes it as it scrapes vLLM."""

from __future__ import annotations

import pytest

from kvroute.sim.publisher import EventPublisher
from tests.support.canned_http import canned_http
from tests.support.load_monitor import watching
from tests.support.waiting import run_async


def approx(value: float | None) -> object:
    return None if value is None else pytest.approx(value)


def page(ttft_sum: float, e2e_sum: float, count: float) -> str:
    labels = '{engine="0",model_name="m"}'
    return (f"vllm:num_requests_running{labels} 1\n"
            f"vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"+Inf\"}} {count}\n"
            f"vllm:time_to_first_token_seconds_count{labels} {count}\n"
            f"vllm:time_to_first_token_seconds_sum{labels} {ttft_sum}\n"
            f"vllm:e2e_request_latency_seconds_count{labels} {count}\n"
            f"vllm:e2e_request_latency_seconds_sum{labels} {e2e_sum}\n")


# (page, then the reading's ttft_seconds and request_seconds)
STEPS = [
    (page(2.0, 5.0, 10), 0.2, 0.5),  # first reading: every request so far
    (page(2.6, 7.0, 12), 0.3, 1.0),  # two ended since: their mean
    (page(2.6, 7.0, 12), 0.3, 1.0),  # none ended since: the previous mean stands
    (page(0.1, 0.4, 1), 0.1, 0.4),  # fewer than before: the engine restarted
    (page(-1.0, -9.0, 2), None, None),  # negative times: no engine exports these
    ('vllm:num_requests_running{engine="0"} 1\n', None, None),  # not exported
]


def test_a_reading_keeps_the_mean_times_of_the_requests_that_ended_since_the_last():
    routes = {"/metrics": (200, STEPS[0][0])}
    with EventPublisher() as pub, canned_http(routes) as url:
        async def scenario() -> None:
            async with watching("e", url, pub.endpoint, interval=60.0) as (monitor, _):
                for text, ttft, request in STEPS:
                    routes["/metrics"] = (200, text)
                    await monitor.scrape_once()
                    reading = monitor.get(("e", 0))
                    assert reading is not None and reading.running == 1.0
                    assert (reading.ttft_seconds, reading.request_seconds) == (
                        approx(ttft), approx(request)), text

        run_async(scenario, timeout=60)


def test_a_failed_scrape_leaves_the_last_reading_for_what_it_says_of_the_past():
    """A busy engine can miss the scrape's deadline. Its gauges are then not current, but
    how long its requests took still is: answers sent to it end when its requests
    typically do, instead of counting for `stale_after` intervals."""
    routes = {"/metrics": (200, page(2.0, 5.0, 10))}
    with EventPublisher() as pub, canned_http(routes) as url:
        async def scenario() -> None:
            async with watching("e", url, pub.endpoint, interval=60.0) as (monitor, registry):
                assert monitor.typical() == (None, None)
                await monitor.scrape_once()
                first = monitor.get(("e", 0))
                assert first is not None and monitor.last(("e", 0)) == first
                assert monitor.typical() == (pytest.approx(0.2), pytest.approx(0.5))
                routes["/metrics"] = (503, "busy")
                await monitor.scrape_once()
                assert monitor.failure("e") and monitor.get(("e", 0)) is None
                assert monitor.last(("e", 0)) == first
                assert first.request_seconds == pytest.approx(0.5)
                await registry.remove("e")
                await monitor.scrape_once()
                assert monitor.last(("e", 0)) is None  # gone with its worker
                assert monitor.typical() == (None, None)

        run_async(scenario, timeout=60)
