"""The tests' pytest plugin (loaded with `-p tests.support.plugin`, pyproject.toml): the
deadline knob's checks and the per-test limit it stretches, and the fixtures every suite
shares. Helpers are imported from their modules in tests/support, never from here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# The index tests run against both implementations of the index's loops (compiled, pure).
from tests.support.index_impl import index_implementation  # noqa: F401
from tests.support.waiting import SCALE_ERROR, SCALE_VARIABLE, TIMEOUT_SCALE, refusing_urls


@pytest.fixture
def dead_url() -> Iterator[str]:
    """One of `refusing_urls`, held for the test."""
    with refusing_urls(1) as (url,):
        yield url


def pytest_configure(config: pytest.Config) -> None:
    if SCALE_ERROR is not None:
        raise pytest.UsageError(SCALE_ERROR)


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvroute: deadlines scaled by {TIMEOUT_SCALE:g} ({SCALE_VARIABLE})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TIMEOUT_SCALE == 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        base = default
        if marker is not None:
            base = float(marker.args[0] if marker.args else marker.kwargs.get("timeout", 0))
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * TIMEOUT_SCALE), append=False)
