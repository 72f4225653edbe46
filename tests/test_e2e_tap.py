"""The e2e harness's own event tap: its holdings model is what kvroute is held to.

`make e2e` fails when kvroute's holdings differ from the tap's count, so the tap
must count like vLLM holds: a hash stored twice is held until removed twice,
AllBlocksCleared and an engine restart (seq going back) empty it. Real sockets:
the project's wire-exact test publisher on loopback.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from app.sim.publisher import EventPublisher
from app.wire import AllBlocksCleared, BlockRemoved, BlockStored


def _load_tap_module():
    """e2e/ is the harness, not an installed package: load its tap module by path."""
    path = Path(__file__).resolve().parent.parent / "e2e" / "tap.py"
    spec = importlib.util.spec_from_file_location("e2e_tap_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


EventTap = _load_tap_module().EventTap


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                       token_ids=list(range(4 * len(hashes))), block_size=4)


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def subscribed(publisher: EventPublisher, tap: EventTap) -> None:
    """Publish harmless batches until the tap receives one (ZMQ's slow joiner), bounded."""
    for _ in range(100):
        publisher.publish([AllBlocksCleared()])
        if tap.wait_for_count(1, 0.05):
            return
    pytest.fail("the tap never received a batch")


@pytest.fixture
def publisher():
    pub = EventPublisher(replay_endpoint=None).start()
    yield pub
    pub.close()


@pytest.fixture
def tap(publisher):
    tap = EventTap("test", publisher.endpoint)
    yield tap
    tap.close()


def test_holdings_are_reference_counted_per_hash(publisher, tap) -> None:
    subscribed(publisher, tap)
    publisher.publish([stored(1, 2, 3)])
    publisher.publish([stored(2**64 - 1, 2)])  # 2 stored a second time; a hash above 2**63
    assert wait_until(lambda: tap.held_blocks == 4)
    publisher.publish([BlockRemoved(block_hashes=[2])])
    publisher.publish([BlockRemoved(block_hashes=[3]), BlockRemoved(block_hashes=[99])])
    count = tap.count
    publisher.publish([BlockRemoved(block_hashes=[2**64 - 1])])
    assert tap.wait_for_count(count + 1, 5.0)
    assert tap.held_blocks == 2  # 1, and the second copy of 2
    publisher.publish([BlockRemoved(block_hashes=[2])])
    assert wait_until(lambda: tap.held_blocks == 1)
    counts = tap.event_counts()
    assert counts["BlockStored"] == 2 and counts["BlockRemoved"] == 5


def test_all_blocks_cleared_empties_and_later_stores_count(publisher, tap) -> None:
    subscribed(publisher, tap)
    publisher.publish([stored(5, 6)])
    assert wait_until(lambda: tap.held_blocks == 2)
    count = tap.count
    publisher.publish([AllBlocksCleared(), stored(7)])  # vLLM sends both in one batch
    assert tap.wait_for_count(count + 1, 5.0)
    assert tap.held_blocks == 1
    assert tap.last_seq == tap.batches_since(count)[-1].seq


def test_a_restarted_engine_starts_empty(publisher, tap) -> None:
    subscribed(publisher, tap)
    publisher.publish([stored(1, 2)])
    for _ in range(60):  # the old engine got far: seq ~60
        publisher.publish([stored(3)])
    assert wait_until(lambda: tap.held_blocks == 3 and tap.last_seq >= 60)
    endpoint = publisher.endpoint
    publisher.close()
    with EventPublisher(endpoint=endpoint, replay_endpoint=None) as restarted:
        # The new engine's seq starts at 0 again; its first batches may be lost while the
        # tap reconnects, so publish until one arrives (bounded, well below seq 60).
        for _ in range(200):
            restarted.publish([stored(9)])
            if wait_until(lambda: tap.restarts == 1, 0.05):
                break
        assert tap.restarts == 1
        assert wait_until(lambda: tap.held_blocks == 1)
