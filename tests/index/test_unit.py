"""Edge cases of the prefix index, one by one (the property test covers their interleavings)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvroute.index import IndexStats, Match, PrefixIndex
from kvroute.index.keys import token_bytes
from tests.support.index_state import assert_empty

# Every test here runs with the compiled loops, then with the pure ones (the reference).
pytestmark = pytest.mark.usefixtures("index_implementation")

A, B, C = ("a", 0), ("b", 0), ("c", 1)
TOKENS = list(range(100, 116))  # 16 tokens: 4 blocks of 4, 8 blocks of 2


def gpu(blocks: int, block_size: int, cpu: int = 0, storage: int = 0) -> Match:
    return Match(blocks, blocks * block_size, block_size,
                 {"GPU": blocks - cpu - storage, "CPU": cpu, "STORAGE": storage})


def store(index: PrefixIndex, worker, hashes, parent, tokens, block_size=4, **kw) -> None:
    index.apply_stored(worker, hashes, parent, tokens, block_size, **kw)



# ---------------------------------------------------------------- content, not hashes


def test_instances_with_different_hash_seeds_match_the_same_tokens() -> None:
    index = PrefixIndex()
    store(index, A, [11, 12, 13], None, TOKENS[:12])
    store(index, B, [2**63 + 5, 7, 9], None, TOKENS[:12])  # other seed, other values
    assert index.match(TOKENS) == {A: gpu(3, 4), B: gpu(3, 4)}
    assert index.stats().nodes == 3  # one node per content block, two holders each


def test_tokens_given_as_their_bytes_match_and_guess_as_the_ids_do() -> None:
    index = PrefixIndex()
    store(index, A, [11, 12], None, TOKENS[:8])
    as_bytes = token_bytes(TOKENS)
    assert index.match(as_bytes) == index.match(TOKENS) == {A: gpu(2, 4)}
    assert index.place(B, as_bytes, block_size=4, expires=1e9) == 4
    assert index.match(TOKENS, workers=[B])[B].pending == 4


def test_chains_hang_off_their_parent_hash() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    store(index, A, [2, 3], 1, TOKENS[4:12])
    store(index, A, [4], 3, TOKENS[12:16])
    assert index.match(TOKENS)[A] == gpu(4, 4)
    assert index.match(TOKENS[:4] + [0] * 12)[A] == gpu(1, 4)


def test_each_worker_is_matched_at_its_own_block_size() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8], block_size=4)
    store(index, B, [1, 2, 3], None, TOKENS[:6], block_size=2)
    query = TOKENS[:7]  # 1 full block of 4 (+3), 3 full blocks of 2 (+1)
    assert index.match(query) == {A: gpu(1, 4), B: gpu(3, 2)}
    assert index.block_size(A) == 4 and index.block_size(B) == 2
    assert index.block_size(("never", 0)) is None


def test_the_trailing_partial_block_never_matches() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8])
    assert index.match(TOKENS[:7])[A] == gpu(1, 4)
    assert index.match(TOKENS[:3])[A] == gpu(0, 4)
    assert index.match([])[A] == gpu(0, 4)


def test_a_match_stops_at_the_first_missing_block() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2, 3, 4], None, TOKENS)
    index.apply_removed(A, [2])
    assert index.match(TOKENS)[A] == gpu(1, 4)  # blocks 3 and 4 are held but unreachable


def test_lora_names_separate_the_same_tokens() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8], lora_name="sql")
    store(index, B, [1, 2], None, TOKENS[:8])
    assert index.match(TOKENS[:8]) == {A: gpu(0, 4), B: gpu(2, 4)}
    assert index.match(TOKENS[:8], lora_name="sql") == {A: gpu(2, 4), B: gpu(0, 4)}


def test_vllm_lora_extra_keys_are_the_lora_itself() -> None:
    """vLLM puts the LoRA name first in every block's extra keys: that must still match."""
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8], lora_name="sql",
          extra_keys=[["sql"], ("sql",)])
    assert index.match(TOKENS[:8], lora_name="sql")[A] == gpu(2, 4)


def test_other_extra_keys_cannot_be_matched_by_tokens_alone() -> None:
    """A multimodal hash or cache salt is part of the content: tokens alone are not it."""
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8], extra_keys=[None, ["image-hash-1"]])
    store(index, B, [5, 6], None, TOKENS[:8], extra_keys=[None, ["image-hash-2"]])
    assert index.match(TOKENS[:8]) == {A: gpu(1, 4), B: gpu(1, 4)}
    assert index.match_hashes([1, 2]) == {A: gpu(2, 4), B: gpu(1, 4)}
    assert index.stats().nodes == 3


# ---------------------------------------------------------------- stores of a held hash
#
# vLLM stores a held hash again for a reuse report (kv_cache_report_mode "full": no removal
# ever pairs it) and for a second real copy (computed twice before either was cached: each
# copy is removed once). The wire cannot tell them apart; a removal ends the holding, so the
# error is an under-report of a second copy, never a block held after its eviction.


def test_a_reported_block_is_gone_when_it_is_evicted() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8])
    store(index, A, [1, 2], None, TOKENS[:8])  # a reuse report of both
    assert index.match(TOKENS)[A] == gpu(2, 4)
    index.apply_removed(A, [2])  # the engine evicts its one copy
    assert index.match(TOKENS)[A] == gpu(1, 4)
    assert index.stats().unknown_removals == 0


def test_a_report_between_two_stores_and_their_removals_never_over_reports() -> None:
    """Two real copies, a report, then each copy removed: held until the first removal,
    then not (the engine still has one: an under-report), and the second removal is
    counted unknown."""
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    store(index, A, [1], None, TOKENS[:4])  # a second real copy
    store(index, A, [1], None, TOKENS[:4])  # a reuse report
    index.apply_removed(A, [1])
    assert index.match(TOKENS)[A].blocks == 0
    index.apply_removed(A, [1])
    assert index.stats().unknown_removals == 1
    store(index, A, [1], None, TOKENS[:4])  # reported again while a copy is held
    assert index.match(TOKENS)[A] == gpu(1, 4)


def test_unknown_removals_are_counted_not_fatal() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    index.apply_removed(A, [99, 1, 98])
    index.apply_removed(A, [1], medium="CPU")
    stats = index.stats()
    assert stats.unknown_removals == 3
    assert stats.nodes == 0
    assert index.match(TOKENS)[A] == gpu(0, 4)


def test_removing_a_medium_the_hash_is_not_held_in_is_an_unknown_removal() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    index.apply_removed(A, [1], medium="STORAGE")
    assert index.stats().unknown_removals == 1
    assert index.match(TOKENS)[A] == gpu(1, 4)


def test_one_content_under_two_engine_hashes_of_one_worker() -> None:
    """An engine can hash in things the events do not carry; both handles count."""
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8])
    store(index, A, [31, 32], None, TOKENS[:8], medium="CPU")
    assert index.match(TOKENS)[A] == gpu(2, 4)
    index.apply_removed(A, [1, 2])
    assert index.match(TOKENS)[A] == gpu(2, 4, cpu=2)
    index.apply_removed(A, [31], medium="cpu")
    assert index.match(TOKENS)[A] == gpu(0, 4)
    assert index.stats().holdings[A] == {"GPU": 0, "CPU": 1, "STORAGE": 0}


def test_a_hash_reannounced_for_other_content_is_counted_and_the_newer_wins() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8])
    store(index, A, [2], None, TOKENS[8:12])
    stats = index.stats()
    assert stats.hash_conflicts == 1
    assert stats.holdings[A]["GPU"] == 2
    assert index.match(TOKENS)[A] == gpu(1, 4)
    assert index.match(TOKENS[8:12])[A] == gpu(1, 4)


# ---------------------------------------------------------------- orphans and offload


def test_a_chain_with_an_unknown_parent_is_orphaned_not_guessed() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    store(index, A, [3, 4], 2, TOKENS[8:16])  # parent 2 was never announced
    stats = index.stats()
    assert stats.orphaned_blocks == 2
    assert stats.nodes == 1
    assert stats.holdings[A]["GPU"] == 1
    index.apply_removed(A, [3])  # the engine evicts what we never placed
    assert index.stats().unknown_removals == 1


def test_a_parent_removed_before_its_child_is_stored_orphans_the_child() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    index.apply_removed(A, [1])
    store(index, A, [2], 1, TOKENS[4:8])
    assert index.stats().orphaned_blocks == 1


def test_cpu_offload_without_tokens_resolves_through_announced_hashes() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2, 3], None, TOKENS[:12])
    index.apply_stored(A, [2, 3, 77], None, [], 0, medium="CPU")
    assert index.stats().orphaned_blocks == 1  # 77 was never announced
    assert index.match(TOKENS)[A] == gpu(3, 4)  # GPU is the fastest tier of all three
    index.apply_removed(A, [2, 3])  # evicted from GPU, still in CPU
    assert index.match(TOKENS)[A] == gpu(3, 4, cpu=2)
    assert index.stats().holdings[A] == {"GPU": 1, "CPU": 2, "STORAGE": 0}
    assert index.held_by_medium(A) == {"GPU": 1, "CPU": 2, "STORAGE": 0}
    assert index.held_by_medium(B) == {}  # a worker the index does not know
    index.apply_removed(A, [3], medium="CPU")
    assert index.match(TOKENS)[A] == gpu(2, 4, cpu=1)


def test_by_medium_counts_each_block_at_its_fastest_tier() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4], medium="storage")
    store(index, A, [2], 1, TOKENS[4:8], medium="cpu")
    store(index, A, [3], 2, TOKENS[8:12], medium=None)
    index.apply_stored(A, [1], None, [], 0, medium="CPU")
    index.apply_stored(B, [5], None, TOKENS[:4], 4, medium="STORAGE")
    assert index.match(TOKENS) == {A: gpu(3, 4, cpu=2), B: gpu(1, 4, storage=1)}
    for match in index.match(TOKENS).values():
        assert sum(match.by_medium.values()) == match.blocks


def test_unknown_medium_is_rejected_without_changing_anything() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    with pytest.raises(ValueError, match="unknown medium 'DISK'"):
        store(index, A, [2], 1, TOKENS[4:8], medium="DISK")
    with pytest.raises(ValueError, match="unknown medium"):
        index.apply_removed(A, [1], medium="tape")
    assert index.match(TOKENS)[A] == gpu(1, 4)


# ---------------------------------------------------------------- hybrid models


def test_non_full_attention_groups_are_ignored_and_their_removals_too() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8], group_idx=0, kv_cache_spec_kind="full_attention")
    store(index, A, [51, 52], None, TOKENS[:8], group_idx=1,
          kv_cache_spec_kind="sliding_window")
    index.apply_removed(A, [1, 2], group_idx=1)  # same hashes, but the sliding-window group
    stats = index.stats()
    assert (stats.ignored_blocks, stats.ignored_removals, stats.unknown_removals) == (2, 2, 0)
    assert index.match(TOKENS)[A] == gpu(2, 4)
    index.apply_removed(A, [2], group_idx=0)
    assert index.match(TOKENS)[A] == gpu(1, 4)


def test_mla_and_unnamed_kinds_are_indexed() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4], kv_cache_spec_kind="mla_attention")
    store(index, B, [1], None, TOKENS[:4], kv_cache_spec_kind=None, group_idx=3)
    assert index.match(TOKENS) == {A: gpu(1, 4), B: gpu(1, 4)}


# ---------------------------------------------------------------- clear and drop


def test_blocks_held_counts_hashes_held_in_any_medium() -> None:
    index = PrefixIndex()
    assert index.blocks_held(A) == 0 and not index.holds_hash(A, 1)
    store(index, A, [1, 2], None, TOKENS[:8])
    store(index, A, [1, 2], None, TOKENS[:8])  # stored again: still two blocks
    index.apply_stored(A, [2], None, [], 0, medium="CPU")  # offloaded: a medium more
    assert index.blocks_held(A) == 2 and index.holds_hash(A, 2)
    index.apply_removed(A, [2])  # the GPU copy gone (however often stored), the CPU one stays
    assert index.blocks_held(A) == 2
    index.apply_removed(A, [2], medium="CPU")
    assert index.blocks_held(A) == 1 and not index.holds_hash(A, 2)
    store(index, A, [-3], 1, TOKENS[8:12])
    assert index.holds_hash(A, (1 << 64) - 3) and index.holds_hash(A, -3)
    assert not index.holds_hash(A, 1.5)  # type: ignore[arg-type]
    index.clear_worker(A)
    assert index.blocks_held(A) == 0 and index.blocks_held(B) == 0


def test_storing_confirms_the_guesses_its_plain_blocks_stand_for() -> None:
    """Blocks before the first one with extra keys are plain token keys, which guesses
    are made of: storing them ends those guesses even when later blocks carry extras."""
    index = PrefixIndex()
    assert index.place(A, TOKENS[:12], block_size=4, expires=10.0) == 3
    store(index, A, [1, 2, 3], None, TOKENS[:12], extra_keys=[None, None, ["img"]])
    # Block 2 is the only guess left: block 3 as stored has an image in it.
    assert len(index.placements) == 1
    assert index.match(TOKENS[:12])[A].pending == 1


def test_clear_leaves_the_worker_known_and_holding_nothing() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8], medium="CPU")
    store(index, B, [1, 2], None, TOKENS[:8])
    index.clear_worker(A)
    assert index.match(TOKENS) == {A: gpu(0, 4), B: gpu(2, 4)}
    assert index.stats().holdings[A] == {"GPU": 0, "CPU": 0, "STORAGE": 0}
    index.apply_removed(A, [1])  # after a clear, old hashes are unknown
    assert index.stats().unknown_removals == 1


def test_dropped_workers_leave_nothing_behind() -> None:
    index = PrefixIndex()
    for worker, medium in ((A, None), (B, "CPU"), (C, "STORAGE")):
        store(index, worker, [1, 2, 3], None, TOKENS[:12], medium=medium)
        store(index, worker, [1], None, TOKENS[:4])
        store(index, worker, [4], 3, TOKENS[12:16], extra_keys=[["mm"]])
    store(index, A, [9], None, TOKENS[:4], kv_cache_spec_kind="mamba", group_idx=2)
    index.drop_worker(B)
    assert set(index.match(TOKENS)) == {A, C}
    index.drop_worker(A)
    index.drop_worker(C)
    index.drop_worker(C)  # unknown by now: a no-op
    assert index.match(TOKENS) == {}
    assert_empty(index)


def test_a_new_worker_in_a_reused_slot_inherits_nothing() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8])
    store(index, B, [1], None, TOKENS[:4])
    index.drop_worker(A)
    index.clear_worker(C)  # takes A's slot
    assert index.match(TOKENS) == {B: gpu(1, 4), C: Match(0, 0, 0, {"GPU": 0, "CPU": 0,
                                                                    "STORAGE": 0})}


# ---------------------------------------------------------------- queries


def test_match_restricted_to_workers_omits_unknown_ones() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    store(index, B, [1], None, TOKENS[:4])
    assert index.match(TOKENS, workers=[B, ("ghost", 0)]) == {B: gpu(1, 4)}
    assert index.match(TOKENS, workers=[]) == {}
    assert index.match_hashes([1], workers=[("ghost", 0)]) == {}


def test_match_hashes_resolves_through_any_workers_handles() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2, 3], None, TOKENS[:12])
    store(index, B, [21, 22], None, TOKENS[:8])
    # B's hashes for the first two blocks, then A's for the third: one content path.
    assert index.match_hashes([21, 22, 3]) == {A: gpu(3, 4), B: gpu(2, 4)}
    assert index.match_hashes([1, 2, 3]) == index.match_hashes([21, 22, 3])


def test_match_hashes_stops_at_the_first_unresolved_hash() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2, 3], None, TOKENS[:12])
    assert index.match_hashes([1, 404, 3])[A] == gpu(1, 4)
    assert index.match_hashes([404, 1])[A] == gpu(0, 4)


def test_match_hashes_requires_each_hash_to_chain_from_the_previous() -> None:
    index = PrefixIndex()
    store(index, A, [1, 2], None, TOKENS[:8])
    store(index, B, [7, 8], None, TOKENS[8:16])  # unrelated content
    assert index.match_hashes([2])[A] == gpu(0, 4)  # not a first block
    assert index.match_hashes([1, 8]) == {A: gpu(1, 4), B: gpu(0, 4)}  # 8 does not follow 1
    assert index.match_hashes([1, 2, 2])[A] == gpu(2, 4)


def test_match_hashes_for_a_subset_ends_when_its_last_worker_misses() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    store(index, B, [5, 6, 7], None, TOKENS[:12])
    assert index.match_hashes([5, 6, 7], workers=[A]) == {A: gpu(1, 4)}
    assert index.match_hashes([5, 6, 7]) == {A: gpu(1, 4), B: gpu(3, 4)}


def test_signed_unsigned_and_bytes_hashes() -> None:
    index = PrefixIndex()
    store(index, A, [-1, -2**63], None, TOKENS[:8])  # older vLLM: signed
    store(index, B, [b"\x01" * 32, b"\x02" * 32], None, TOKENS[:8])  # non-int hashes
    assert index.match_hashes([2**64 - 1, 2**63]) == {A: gpu(2, 4), B: gpu(2, 4)}
    assert index.match_hashes([b"\x01" * 32, -2**63]) == {A: gpu(2, 4), B: gpu(2, 4)}
    index.apply_removed(A, [2**63])
    assert index.match(TOKENS)[A] == gpu(1, 4)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("tokens", "block_size", "message"),
    [
        (TOKENS[:7], 4, "7 token ids do not fill 2 blocks of 4"),
        ([-1] + TOKENS[:7], 4, r"token ids must be in \[0, 2\*\*32\)"),
        ([2**32] + TOKENS[:7], 4, r"token ids must be in \[0, 2\*\*32\)"),
        ([1.5] + TOKENS[:7], 4, "token ids must be a sequence of ints"),
        (TOKENS[:8], 0, "block_size must be a positive int"),
    ],
)
def test_malformed_stores_raise_clear_errors_and_change_nothing(tokens, block_size,
                                                                message) -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    before = (index.stats(), index.match(TOKENS))
    with pytest.raises(ValueError, match=message):
        store(index, A, [2, 3], 1, tokens, block_size=block_size)
    assert (index.stats(), index.match(TOKENS)) == before


def test_malformed_extra_keys_and_hashes_raise() -> None:
    index = PrefixIndex()
    with pytest.raises(ValueError, match="1 extra_keys entries for 2 blocks"):
        store(index, A, [1, 2], None, TOKENS[:8], extra_keys=[None])
    with pytest.raises(ValueError, match="must be an int or bytes"):
        store(index, A, [1.5, 2], None, TOKENS[:8])
    with pytest.raises(ValueError, match="must be an int or bytes"):
        store(index, A, [1], [1], TOKENS[:4])
    assert index.stats().nodes == 0


def test_extra_keys_must_be_plain_values() -> None:
    index = PrefixIndex()
    with pytest.raises(ValueError, match="extra_keys entry .* is not made of plain values"):
        store(index, A, [1], None, TOKENS[:4], extra_keys=[[object()]])
    assert index.stats().nodes == 0


def test_bad_query_tokens_raise() -> None:
    index = PrefixIndex()
    store(index, A, [1], None, TOKENS[:4])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        index.match([-5])
    with pytest.raises(ValueError, match="sequence of ints"):
        index.match(["a", "b"])


# ---------------------------------------------------------------- stats and values


def test_stats_report_holdings_per_medium_and_an_estimate_of_memory() -> None:
    index = PrefixIndex()
    empty = index.stats()
    assert isinstance(empty, IndexStats) and empty.nodes == 0 and empty.holdings == {}
    store(index, A, list(range(1, 101)), None, list(range(400)))
    index.apply_stored(A, list(range(1, 11)), None, [], 0, medium="CPU")
    stats = index.stats()
    assert stats.nodes == 100 and stats.workers == 1
    assert stats.holdings == {A: {"GPU": 100, "CPU": 10, "STORAGE": 0}}
    # 100 keys (16 bytes + header) and 100 engine hashes at least; well under 1 KB each.
    assert 100 * 2 * 33 < stats.estimated_bytes - empty.estimated_bytes < 100 * 1024


def test_match_values_are_frozen() -> None:
    match = gpu(1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        match.blocks = 2  # type: ignore[misc]


def _held_index() -> PrefixIndex:
    index = PrefixIndex()
    store(index, "a", [1, 2], None, list(range(8)))
    store(index, "b", [7], None, list(range(4)), medium="CPU")
    index._check()
    return index


@pytest.mark.parametrize("corrupt, says", [
    (lambda ix: ix._nodes.popitem(), "holder bits differ"),
    (lambda ix: ix._workers["a"].held.__setitem__(0, 5), "held[GPU]"),
    (lambda ix: ix._tiered.clear(), "TIERED bit"),
    (lambda ix: ix._free_slots.append(0), "free slots"),
    (lambda ix: ix._workers["a"].counts.__setitem__(99, 1), "counts without a handle"),
])
def test_the_self_check_names_a_broken_invariant(corrupt, says) -> None:
    index = _held_index()
    corrupt(index)
    with pytest.raises(AssertionError, match=re.escape(says)):
        index._check()
