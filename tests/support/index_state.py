"""Checks on a PrefixIndex's internal state that more than one test module makes."""

from __future__ import annotations

from kvroute.index import PrefixIndex


def assert_empty(index: PrefixIndex) -> None:
    """Every container the index owns is empty (nothing of a dropped worker remains)."""
    containers = {k: v for k, v in vars(index).items() if hasattr(v, "__len__")}
    assert containers, "the index keeps its state in containers"
    assert all(len(v) == 0 for v in containers.values()), containers
