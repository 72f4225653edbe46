"""Both implementations of the prefix index's loops under test: the compiled one
(``index/_fast.pyx``) and the pure-Python reference.

``index_implementation`` (a module-scoped fixture, parametrized) makes every ``PrefixIndex()``
of the tests that use it take one implementation, then the other. ``TwinIndex`` drives one
index of each at once with the same calls and fails on the first call whose answers, or
whose containers afterwards, differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvroute.index import PrefixIndex, prefix_index
from kvroute.index.prefix_index import HoldingsCapture
from kvroute.index.results import IndexStats

IMPLEMENTATIONS = ("compiled", "pure")


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def index_implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """``PrefixIndex()`` uses ``request.param`` while the module's tests run with it. A
    test environment without the compiled loops fails here: ``make test`` builds them."""
    if request.param == "compiled" and not prefix_index.COMPILED_AVAILABLE:
        pytest.fail("the compiled index loops are not built: run `pip install -e .`")
    before = prefix_index.IMPLEMENTATION
    prefix_index.IMPLEMENTATION = request.param
    try:
        yield request.param
    finally:
        prefix_index.IMPLEMENTATION = before


def layout(index: PrefixIndex) -> dict[str, Any]:
    """Everything an index keeps, as plain values (dict order left out)."""
    return {
        "nodes": dict(index._nodes),
        "tiered": {key: tuple(entry) for key, entry in index._tiered.items()},
        "slots": [None if w is None else w.worker for w in index._by_slot],
        "free": sorted(index._free_slots),
        "counters": (index._orphaned_blocks, index._unknown_removals, index._ignored_blocks,
                     index._ignored_removals, index._hash_conflicts),
        "unconfirmed_until": dict(index._unconfirmed_until),
        "workers": {
            w.worker: (w.slot, w.block_size, dict(w.handles), dict(w.counts),
                       dict(w.node_counts), list(w.held), dict(w.groups),
                       dict(w.unconfirmed), dict(w.unconfirmed_keys))
            for w in index._workers.values()
        },
    }


def held(capture: HoldingsCapture) -> tuple[Any, ...]:
    """What a capture's pieces say, in no particular order (a table's order is its own)."""
    pieces = list(capture.pieces(3))
    blocks = [(block_hash, key, flag, piece.counts.get(i))
              for piece in pieces for i, (block_hash, key, flag)
              in enumerate(zip(piece.hashes, piece.keys, piece.flags, strict=True))]
    blocks.sort(key=repr)
    return pieces[0].block_size, pieces[0].groups, blocks


class TwinIndex:
    """A compiled and a pure ``PrefixIndex`` fed the same calls. Every call returns the
    compiled index's answer after checking that the pure one answered the same (or raised
    the same exception type) and that both hold the same containers afterwards."""

    def __init__(self) -> None:
        self.compiled = PrefixIndex(compiled=True)
        self.pure = PrefixIndex(compiled=False)

    @property
    def _workers(self) -> dict:
        return self.compiled._workers

    def _check(self) -> None:
        self.compiled._check()
        self.pure._check()
        assert layout(self.compiled) == layout(self.pure)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        compiled_method = getattr(self.compiled, name)
        pure_method = getattr(self.pure, name)

        def both(*args: Any, **kwargs: Any) -> Any:
            outcomes = []
            for method in (compiled_method, pure_method):
                try:
                    outcomes.append((None, method(*args, **kwargs)))
                except Exception as error:  # compared below, then re-raised
                    outcomes.append((error, None))
            (compiled_error, answer), (pure_error, pure_answer) = outcomes
            assert type(compiled_error) is type(pure_error), (name, outcomes)
            if isinstance(answer, HoldingsCapture):
                assert held(answer) == held(pure_answer), name
            elif isinstance(answer, IndexStats):  # the memory estimate is each one's own
                assert replace(answer, estimated_bytes=0) == replace(
                    pure_answer, estimated_bytes=0), (name, answer, pure_answer)
            else:
                assert answer == pure_answer, (name, answer, pure_answer)
            assert layout(self.compiled) == layout(self.pure), f"layouts differ after {name}"
            if compiled_error is not None:
                raise compiled_error
            return answer

        return both
