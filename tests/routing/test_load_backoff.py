"""An instance whose /metrics fails is scraped less and less often, and read again at the
interval once it answers: a fleet without metrics (or with many down) costs kvroute little.
A real HTTP server on 127.0.0.1, a real registry and subscriber."""

from __future__ import annotations

import asyncio
from collections import Counter

from kvroute.app.config import InstanceConfig
from kvroute.sim.publisher import EventPublisher
from tests.support.canned_http import canned_http
from tests.support.load_monitor import watching
from tests.support.waiting import run_async, wait_until

PAGE = 'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_waiting{engine="0"} 1\n'


def test_failing_scrapes_back_off_and_a_success_reads_again():
    routes = {"/metrics": (503, "no metrics here")}
    asked: Counter[str] = Counter()
    with EventPublisher() as pub, canned_http(routes, asked) as url:
        async def scenario() -> None:
            async with watching("quiet", url, pub.endpoint, interval=0.05) as (monitor, _):
                monitor.start()
                try:
                    await wait_until(lambda: monitor.failure("quiet"), "a failed scrape")
                    await asyncio.sleep(1.5)
                    # Every 0.05 s would be about 30 requests; three at the interval, then
                    # doubling delays from 0.05 s make it about 8 (fewer on a slow machine:
                    # this cannot fail for that).
                    assert asked["/metrics"] < 12, asked
                    assert monitor.failure("quiet").startswith("GET /metrics answered HTTP 503")
                    routes["/metrics"] = (200, PAGE)
                    reading = await wait_until(lambda: monitor.get(("quiet", 0)),
                                               "the instance's load read again")
                    assert (reading.running, reading.waiting) == (2.0, 1.0)
                    assert monitor.failure("quiet") is None
                finally:
                    await monitor.stop()

        run_async(scenario, timeout=60)


def test_a_few_failures_in_a_row_are_asked_again_at_the_interval_before_backing_off():
    """An engine busy enough to miss a scrape's deadline is not a dead one: its next
    readings are what route mode needs most. Three failures in a row are asked again at
    the interval; only then do the delays double."""
    routes = {"/metrics": (503, "busy")}
    with EventPublisher() as pub, canned_http(routes) as url:
        async def scenario() -> None:
            async with watching("busy", url, pub.endpoint, interval=0.02) as (monitor, _):
                delays = []
                for _ in range(6):
                    asked_before = len(delays)
                    for _ in range(500):  # until the instance is due again (bounded)
                        await monitor.scrape_once()
                        retry = monitor._retry.get("busy")
                        if retry is not None and retry[2] > asked_before:
                            delays.append(retry[1])
                            break
                        await asyncio.sleep(0.01)
                assert delays == [0.02, 0.02, 0.02, 0.04, 0.08, 0.16], delays

        run_async(scenario, timeout=60)


def test_an_instance_that_joins_is_read_at_once_not_at_the_next_round():
    """Until a worker's first reading, route answers sent to it count for `stale_after`
    intervals: a new instance is read as it joins (here with rounds a minute apart), for
    how long its requests take."""
    routes = {"/metrics": (200, PAGE)}
    asked: Counter[str] = Counter()
    with EventPublisher() as first, EventPublisher() as second, \
            canned_http(routes, asked) as url:
        async def scenario() -> None:
            async with watching("first", url, first.endpoint, interval=60.0) as (monitor,
                                                                                 registry):
                monitor.start()
                try:
                    await wait_until(lambda: monitor.get(("first", 0)), "the first round")
                    await registry.add(InstanceConfig(id="second", url=url,
                                                      events=(second.endpoint,)),
                                       wait_for_discovery=False)
                    reading = await wait_until(lambda: monitor.last(("second", 0)),
                                               "the instance that joined read", timeout=10.0)
                    assert (reading.running, reading.waiting) == (2.0, 1.0)
                    assert asked["/metrics"] == 2  # the round, then the one that joined
                    # Its gauges count from the next round: a first reading cannot tell an
                    # idle engine's leftovers from work.
                    assert monitor.get(("second", 0)) is None
                finally:
                    await monitor.stop()
                assert monitor._joined not in registry.instance_listeners

        run_async(scenario, timeout=60)


def test_an_instance_without_a_url_that_joins_leaves_the_monitor_running():
    """An instance registered with explicit event endpoints and no `url` has no /metrics to
    read: its joining is not a scrape (it once killed the monitor's task with a TypeError,
    seen only when kvroute stopped), and the instances that have one are still read."""
    routes = {"/metrics": (200, PAGE)}
    asked: Counter[str] = Counter()
    with EventPublisher() as first, EventPublisher() as second, EventPublisher() as third, \
            canned_http(routes, asked) as url:
        async def scenario() -> None:
            async with watching("first", url, first.endpoint, interval=60.0) as (monitor,
                                                                                 registry):
                monitor.start()
                try:
                    await wait_until(lambda: monitor.get(("first", 0)), "the first round")
                    await registry.add(InstanceConfig(id="no-url", events=(second.endpoint,)),
                                       wait_for_discovery=False)
                    await registry.add(InstanceConfig(id="third", url=url,
                                                      events=(third.endpoint,)),
                                       wait_for_discovery=False)
                    await wait_until(lambda: monitor.last(("third", 0)),
                                     "the instance with a url read as it joined",
                                     timeout=10.0)
                    assert monitor.last(("no-url", 0)) is None
                    assert not monitor._task.done()
                finally:
                    await monitor.stop()  # raised the TypeError before

        run_async(scenario, timeout=60)
