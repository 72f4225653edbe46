"""How the tests wait: one knob for every deadline, one helper to poll (sync and async).

A test never sleeps a fixed time and never asserts speed. It polls a cheap condition until
it holds or a generous deadline passes, then asserts behaviour once. Every deadline goes
through ``scaled()``, so a slow or busy machine stretches all of them with one setting:

    KVROUTE_TEST_TIMEOUT_SCALE=3 make test

The per-test limit of pytest-timeout (``timeout`` in pyproject.toml, or a test's own
``@pytest.mark.timeout``) is stretched by the same factor.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from contextlib import ExitStack, contextmanager
from typing import TypeVar

import pytest

T = TypeVar("T")

SCALE_VARIABLE = "KVROUTE_TEST_TIMEOUT_SCALE"


def _timeout_scale() -> tuple[float, str | None]:
    """The knob's value, or 1 and the reason it is not usable (reported by pytest_configure)."""
    raw = os.environ.get(SCALE_VARIABLE, "").strip() or "1"
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not 1.0 <= scale < float("inf"):
        return 1.0, f"{SCALE_VARIABLE} must be a finite number >= 1, got {raw!r}"
    return scale, None


TIMEOUT_SCALE, SCALE_ERROR = _timeout_scale()

# Long enough for a replay on a loaded 2-core machine; a condition that holds returns at once.
DEFAULT_WAIT = 30.0


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on a quiet machine, stretched by KVROUTE_TEST_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


# For every HTTP client in the tests: an answer that takes this long is a hang, not a slow
# machine.
HTTP_TIMEOUT = scaled(30.0)


def _polls(check: Callable[[], T], what: str, timeout: float,
           detail: Callable[[], object] | None) -> Generator[None, None, T]:
    """Checks once per step; returns check's first truthy value, fails once scaled(timeout)
    has passed. The caller sleeps between steps, the way its thread or loop can."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            said = f"; last seen: {detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {limit:.1f} s waiting for {what}{said}")
        yield


def wait_for(check: Callable[[], T], what: str, timeout: float = DEFAULT_WAIT,
             detail: Callable[[], object] | None = None, interval: float = 0.05) -> T:
    """Poll `check` (on this thread) until it returns something truthy and return that.

    Fails the test naming `what`, and what `detail` says about the last state, once
    ``scaled(timeout)`` has passed. `check` must be cheap: compare with a heavy truth model
    once, after the wait, not inside it."""
    polls = _polls(check, what, timeout, detail)
    try:
        while True:
            next(polls)
            time.sleep(interval)
    except StopIteration as done:
        return done.value


async def wait_until(check: Callable[[], T], what: str, timeout: float = DEFAULT_WAIT,
                     detail: Callable[[], object] | None = None, interval: float = 0.02) -> T:
    """`wait_for` inside an event loop: the loop keeps running between checks."""
    polls = _polls(check, what, timeout, detail)
    try:
        while True:
            next(polls)
            await asyncio.sleep(interval)
    except StopIteration as done:
        return done.value


def run_async(scenario: Callable[[], Awaitable[None]], timeout: float = 90.0) -> None:
    """Run one async scenario to its end on a fresh event loop, bounded by a scaled deadline."""

    async def bounded() -> None:
        await asyncio.wait_for(scenario(), scaled(timeout))

    asyncio.run(bounded())


@contextmanager
def refusing_ports(n: int) -> Iterator[list[int]]:
    """`n` loopback ports where nothing answers: each is bound (so no other process can
    take it while the block runs) but never listens, so connections are refused at once.
    Unlike a socket that listened and was closed, nothing can still accept on them."""
    with ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        yield [sock.getsockname()[1] for sock in socks]


@contextmanager
def refusing_urls(n: int) -> Iterator[list[str]]:
    """`refusing_ports` as http:// URLs."""
    with refusing_ports(n) as ports:
        yield [f"http://127.0.0.1:{port}" for port in ports]
