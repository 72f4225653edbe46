"""Saving and restoring a worker's holdings, and unconfirmed blocks (index level).

The model test (test_index_model.py) restores whole indexes mid-run; these cases pin the
edges: malformed pieces, restoring over blocks, blocks evicted between a capture and its
pieces, and everything unconfirmed blocks do.
"""

from __future__ import annotations

import pytest

from kvroute.index import PrefixIndex
from kvroute.index.holdings import Holdings

# Every test here runs with the compiled loops, then with the pure ones (the reference).
pytestmark = pytest.mark.usefixtures("index_implementation")

A = ("a", 0)
B = ("b", 0)
BS = 4
PROMPT = list(range(100, 116))  # four blocks of four


def stored(index: PrefixIndex, worker=A, tokens=PROMPT, first_hash=1, parent=None) -> list[int]:
    hashes = list(range(first_hash, first_hash + len(tokens) // BS))
    index.apply_stored(worker, hashes, parent, tokens, BS)
    return hashes


def saved_pieces(index: PrefixIndex, worker=A, size=2) -> list[Holdings]:
    capture = index.capture(worker)
    assert capture is not None
    return list(capture.pieces(size))


def blocks(index: PrefixIndex, tokens=PROMPT, worker=A, now=None) -> tuple[int, int]:
    match = index.match(tokens, workers=[worker], now=now)[worker]
    return match.blocks, match.pending


def test_restore_gives_the_same_answers_and_layout() -> None:
    old = PrefixIndex()
    stored(old)
    old.apply_stored(A, [9], None, [7, 7, 7, 7], BS, medium="CPU")
    old.apply_stored(B, [50, 51], None, PROMPT[:8], BS)
    new = PrefixIndex()
    for worker in (A, B):
        new.restore(worker, saved_pieces(old, worker))
    new._check()
    for tokens in (PROMPT, PROMPT[:8], [7, 7, 7, 7]):
        assert new.match(tokens) == old.match(tokens)
    assert new.match_hashes([1, 2, 3]) == old.match_hashes([1, 2, 3])
    assert new.stats().holdings == old.stats().holdings


def test_restore_refuses_a_hash_the_worker_holds_and_takes_pieces_one_call_each() -> None:
    index = PrefixIndex()
    stored(index)
    with pytest.raises(ValueError, match="already holds"):
        index.restore(A, saved_pieces(index))
    restored = PrefixIndex()
    pieces = saved_pieces(index, size=1)
    for piece in pieces:
        restored.restore(A, [piece])
    restored._check()
    assert restored.match(PROMPT) == index.match(PROMPT)


@pytest.mark.parametrize("broken", [
    dict(keys=[b"short"]),
    dict(flags=[1 << 40]),
    dict(hashes=[2**64]),
    dict(hashes=[1, 2]),  # lengths differ
    dict(counts={5: (2, 0, 0)}),  # position out of the piece
    dict(counts={0: (1, 0, 0)}),  # implicit
])
def test_malformed_pieces_change_nothing(broken) -> None:
    index = PrefixIndex()
    fields = dict(block_size=BS, groups=[], hashes=[1], keys=[b"k" * 16], flags=[2], counts={})
    fields.update(broken)
    with pytest.raises(ValueError):
        index.restore(B, [Holdings(**fields)])
    with pytest.raises(ValueError):
        index.restore_unconfirmed(B, [Holdings(**fields)], expires=10.0)
    assert index.stats().workers == 0


def test_a_hash_saved_twice_is_refused() -> None:
    piece = Holdings(BS, [], [1], [b"k" * 16], [2])
    with pytest.raises(ValueError, match="twice"):
        PrefixIndex().restore(A, [piece, piece])


def test_blocks_evicted_after_the_capture_are_left_out() -> None:
    index = PrefixIndex()
    hashes = stored(index)
    capture = index.capture(A)
    index.apply_removed(A, hashes[2:])
    pieces = list(capture.pieces(10))
    assert [h for p in pieces for h in p.hashes] == hashes[:2]
    restored = PrefixIndex()
    restored.restore(A, pieces)
    assert blocks(restored) == (2, 0)


def test_an_empty_worker_keeps_its_block_size_and_groups() -> None:
    index = PrefixIndex()
    stored(index)
    index.apply_stored(A, [70], None, [1, 2, 3, 4], BS, group_idx=1,
                       kv_cache_spec_kind="sliding_window")
    index.clear_worker(A)
    restored = PrefixIndex()
    restored.restore(A, saved_pieces(index))
    assert restored.block_size(A) == BS
    restored.apply_removed(A, [70], group_idx=1)
    assert restored.stats().ignored_removals == 1  # group 1 is still known not indexed


# ------------------------------------------------------------------ unconfirmed blocks

def unconfirmed_index(expires=100.0) -> tuple[PrefixIndex, list[int]]:
    old = PrefixIndex()
    hashes = stored(old)
    index = PrefixIndex()
    assert index.restore_unconfirmed(A, saved_pieces(old), expires) == 4
    index._check()
    return index, hashes


def test_unconfirmed_blocks_count_as_pending_not_held() -> None:
    index, _ = unconfirmed_index()
    assert blocks(index) == (4, 4)
    assert index.blocks_held(A) == 0
    assert index.unconfirmed_blocks(A) == 4


def test_a_real_store_confirms_and_a_later_removal_is_seen_at_once() -> None:
    index, hashes = unconfirmed_index()
    index.apply_stored(A, hashes[:2], None, PROMPT[:8], BS)
    assert blocks(index) == (4, 2)
    assert index.unconfirmed_blocks(A) == 2
    index.apply_removed(A, hashes[:1])
    assert blocks(index) == (0, 0)
    assert index.stats().unknown_removals == 0
    index._check()


def test_a_removal_ends_an_unconfirmed_block_without_counting_it_unknown() -> None:
    index, hashes = unconfirmed_index()
    index.apply_removed(A, [hashes[2]])
    assert blocks(index) == (2, 2)
    assert index.stats().unknown_removals == 0
    index.apply_removed(A, [999])
    assert index.stats().unknown_removals == 1
    index._check()


def test_a_chain_under_an_unconfirmed_parent_is_placed() -> None:
    index, hashes = unconfirmed_index()
    longer = PROMPT + [5, 6, 7, 8]
    index.apply_stored(A, [42], hashes[-1], [5, 6, 7, 8], BS)
    assert index.stats().orphaned_blocks == 0
    assert blocks(index, longer) == (5, 4)
    index._check()


def test_unconfirmed_blocks_expire() -> None:
    index, _ = unconfirmed_index(expires=10.0)
    assert blocks(index, now=9.0) == (4, 4)
    assert blocks(index, now=10.0) == (0, 0)
    assert index.unconfirmed_blocks(A) == 0
    index._check()


def test_a_clear_ends_unconfirmed_blocks() -> None:
    index, _ = unconfirmed_index()
    index.clear_worker(A)
    assert blocks(index) == (0, 0)
    index._check()


def test_hashes_really_held_are_not_restored_unconfirmed() -> None:
    old = PrefixIndex()
    stored(old)
    index = PrefixIndex()
    hashes = stored(index, tokens=PROMPT[:8])
    assert index.restore_unconfirmed(A, saved_pieces(old), expires=50.0) == 2
    assert blocks(index) == (4, 2)
    assert index.blocks_held(A) == len(hashes)
    index._check()
    index.drop_worker(A)
    index._check()


_SAVE = """
import sys, msgspec
from kvroute.index import PrefixIndex
index = PrefixIndex()
index.apply_stored(("a", 0), [1, 2, 3, 4], None, list(range(100, 116)), 4)
capture = index.capture(("a", 0))
sys.stdout.buffer.write(msgspec.msgpack.encode(list(capture.pieces(2))))
"""
_RESTORE = """
import sys, msgspec
from kvroute.index import PrefixIndex
from kvroute.index.holdings import Holdings
pieces = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=list[Holdings])
index = PrefixIndex()
index.restore(("a", 0), pieces)
print(index.match_hashes([1, 2, 3, 4])[("a", 0)].blocks)
"""


def test_blocks_saved_by_one_process_match_by_hash_in_another(index_implementation: str) -> None:
    """A restart restores holdings into a process whose string hashing is seeded anew: the
    parent fingerprints a match by vLLM block hashes checks must not depend on it."""
    import os
    import subprocess
    import sys

    def run(code: str, seed: str, stdin: bytes | None = None) -> bytes:
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "KVROUTE_PURE": "1" if index_implementation == "pure" else "0"}
        done = subprocess.run([sys.executable, "-c", code], input=stdin, env=env,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return done.stdout

    saved = run(_SAVE, "1")
    assert run(_RESTORE, "2", saved).strip() == b"4"
