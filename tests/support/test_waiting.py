"""The tests' own waiting helpers: they return what the check returned, and fail naming
what they waited for, after the scaled deadline and not before."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.waiting import TIMEOUT_SCALE, run_async, scaled, wait_for, wait_until


def test_wait_for_returns_the_first_truthy_value():
    values = iter([0, None, "", {"ready": True}])
    assert wait_for(lambda: next(values), "a value", interval=0) == {"ready": True}


def test_wait_for_fails_naming_what_and_the_last_state_after_the_scaled_deadline():
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for(lambda: False, "the moon", timeout=0.2, detail=lambda: "still new")
    assert time.monotonic() - started >= scaled(0.2)
    message = str(failure.value)
    assert "waiting for the moon" in message and "last seen: still new" in message


def test_wait_until_lets_the_loop_run_between_checks():
    async def scenario() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        try:
            assert await wait_until(lambda: ticks >= 5 and ticks, "five ticks") >= 5
        finally:
            task.cancel()

    run_async(scenario)


def test_scale_stretches_deadlines():
    assert TIMEOUT_SCALE >= 1
    assert scaled(2.0) == 2.0 * TIMEOUT_SCALE


def test_the_per_test_limit_is_scaled_too(request):
    default = float(request.config.getini("timeout"))
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None else default
    assert limit == default * TIMEOUT_SCALE
