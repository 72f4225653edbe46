"""The e2e harness's own event tap: its holdings model is what kvroute is held to.

`make e2e` fails when kvroute's holdings differ from the tap's count, so the tap
must count like vLLM holds: a hash stored twice is held until removed twice,
AllBlocksCleared and an engine restart (seq going back) empty it. Real sockets:
the project's wire-exact test publisher on loopback.
"""

from __future__ import annotations

import pytest

from e2e.tap import EventTap, replay_seqs
from kvroute.app.ingest.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.sim.publisher import EventPublisher
from tests.support.waiting import scaled, wait_for


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                       token_ids=list(range(4 * len(hashes))), block_size=4)


def subscribed(publisher: EventPublisher, tap: EventTap) -> None:
    """Publish harmless batches until the tap receives one (ZMQ's slow joiner)."""

    def received() -> bool:
        publisher.publish([AllBlocksCleared()])
        return tap.wait_for_count(1, 0.05)

    wait_for(received, "the tap to receive a batch", interval=0)


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


def test_a_removal_ends_a_hash_however_often_it_was_stored(publisher, tap) -> None:
    """kvroute's rule (a reuse report is a store no removal pairs), so the tap's count is
    what kvroute's index should hold."""
    subscribed(publisher, tap)
    publisher.publish([stored(1, 2, 3)])
    publisher.publish([stored(2**64 - 1, 2)])  # 2 stored a second time; a hash above 2**63
    wait_for(lambda: tap.held_blocks == 4, "4 blocks held")
    # Counted before the three batches go out: counted after the first two, a slow tap
    # that had not received them yet let the wait end at the first one.
    count = tap.count
    publisher.publish([BlockRemoved(block_hashes=[2])])
    publisher.publish([BlockRemoved(block_hashes=[3]), BlockRemoved(block_hashes=[99])])
    publisher.publish([BlockRemoved(block_hashes=[2**64 - 1])])
    assert tap.wait_for_count(count + 3, scaled(30))
    assert tap.held_blocks == 1  # 1 alone: 2 went with its first removal
    publisher.publish([BlockRemoved(block_hashes=[1])])
    wait_for(lambda: tap.held_blocks == 0, "nothing held")
    counts = tap.event_counts()
    assert counts["BlockStored"] == 2 and counts["BlockRemoved"] == 5


def test_all_blocks_cleared_empties_and_later_stores_count(publisher, tap) -> None:
    subscribed(publisher, tap)
    publisher.publish([stored(5, 6)])
    wait_for(lambda: tap.held_blocks == 2, "2 blocks held")
    count = tap.count
    publisher.publish([AllBlocksCleared(), stored(7)])  # vLLM sends both in one batch
    assert tap.wait_for_count(count + 1, scaled(30))
    assert tap.held_blocks == 1
    assert tap.last_seq == tap.batches_since(count)[-1].seq


def test_a_restarted_engine_starts_empty(publisher, tap) -> None:
    subscribed(publisher, tap)
    publisher.publish([stored(1, 2)])
    old_seq = 2000  # the old engine got far
    for _ in range(old_seq):
        publisher.publish([stored(3)])
    wait_for(lambda: tap.held_blocks == 3 and tap.last_seq >= old_seq, "the old engine's seq")
    endpoint = publisher.endpoint
    publisher.close()
    with EventPublisher(endpoint=endpoint, replay_endpoint=None) as restarted:
        # The new engine's seq starts at 0 again; its first batches may be lost while the
        # tap reconnects, so publish until one arrives, while still well below the old seq.
        def restart_seen() -> bool:
            assert restarted.next_seq < old_seq // 2, "the tap did not reconnect in time"
            restarted.publish([stored(9)])
            return tap.restarts == 1

        wait_for(restart_seen, "the tap to see the engine restart")
        wait_for(lambda: tap.held_blocks == 1, "only the new engine's block held")


def test_replay_seqs_lists_what_the_buffer_still_holds() -> None:
    with EventPublisher(buffer_steps=5) as pub:
        for _ in range(8):
            pub.publish([stored(1)])
        wait_for(lambda: replay_seqs(pub.replay_endpoint, 0, scaled(5)) == [3, 4, 5, 6, 7],
                 "the buffer's last 5 batches")
        assert replay_seqs(pub.replay_endpoint, 6, scaled(5)) == [6, 7]
        assert replay_seqs(pub.replay_endpoint, 8, scaled(5)) == []


def test_forget_epoch_forgets_the_stopped_engines_last_seq(publisher, tap) -> None:
    subscribed(publisher, tap)
    publisher.publish([stored(1)])
    wait_for(lambda: tap.held_blocks == 1, "1 block held")
    assert tap.last_seq is not None
    tap.forget_epoch()
    assert tap.last_seq is None and tap.held_blocks == 0
    count = tap.count
    publisher.publish([stored(2)])
    assert tap.wait_for_count(count + 1, scaled(30))
    assert tap.last_seq == tap.batches_since(count)[-1].seq and tap.held_blocks == 1
