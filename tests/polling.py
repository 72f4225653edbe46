"""Waiting in tests: poll a condition with a deadline, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(check: Callable[[], T], what: str, timeout: float = 15.0,
             detail: Callable[[], object] | None = None) -> T:
    """Poll `check` until it returns something truthy and return that; fail naming `what`
    (and what `detail` says about the last state, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            said = f"; last seen: {detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout} s waiting for {what}{said}")
        time.sleep(0.05)
