"""A tenant's cache salt, the locality of a block and the sink attention groups: what the
index keys, matches and skips (both implementations).

vLLM puts a request's ``cache_salt`` in its first block's extra keys (after the LoRA name),
so a salted sequence shares no block with another salt's or with the unsalted one; the
index reads the salt into the chain's root (``index.keys.salt_of``) so that a query naming
it walks the same keys. A block held with a ``locality`` other than "LOCAL" is not the
publisher's own cache."""

from __future__ import annotations

import pytest

from kvroute.index import PrefixIndex

pytestmark = pytest.mark.usefixtures("index_implementation")

W = ("w", 0)
OTHER = ("v", 0)
BS = 4
PROMPT = list(range(1, 13))  # three blocks


def blocks(index: PrefixIndex, tokens=PROMPT, **query) -> dict:
    return {worker: m.blocks for worker, m in index.match(tokens, **query).items()
            if m.blocks}


def store(index: PrefixIndex, worker, hashes, tokens, *, parent=None, extra=None, **fields):
    index.apply_stored(worker, hashes, parent, tokens, BS, extra_keys=extra, **fields)


def test_a_salted_chain_matches_only_a_query_with_its_salt():
    index = PrefixIndex()
    store(index, W, [1, 2, 3], PROMPT, extra=[["tenant-a"], None, None])
    store(index, OTHER, [7, 8, 9], PROMPT)  # the same tokens, unsalted
    assert blocks(index, cache_salt="tenant-a") == {W: 3}
    assert blocks(index) == {OTHER: 3}
    assert blocks(index, cache_salt="tenant-b") == {}


def test_a_chain_stored_in_pieces_stays_in_its_salt():
    """Later stores hang off the salted first block by its engine hash: no salt there."""
    index = PrefixIndex()
    store(index, W, [1], PROMPT[:4], extra=[["tenant-a"]])
    store(index, W, [2, 3], PROMPT[4:], parent=1)
    assert blocks(index, cache_salt="tenant-a") == {W: 3}
    assert blocks(index) == {}


def test_with_a_lora_the_salt_follows_the_adapters_name():
    index = PrefixIndex()
    store(index, W, [1, 2, 3], PROMPT, lora_name="adapter",
          extra=[["adapter", "tenant-a"], ["adapter"], ["adapter"]])
    assert blocks(index, lora_name="adapter", cache_salt="tenant-a") == {W: 3}
    assert blocks(index, lora_name="adapter") == {}
    assert blocks(index, cache_salt="tenant-a") == {}


def test_extra_keys_that_are_not_a_salt_alone_are_never_matched_by_tokens():
    """A multimodal pair beside the salt, or an extra key on a block that does not start
    the sequence: nothing a token query can reproduce, so nothing matches (no false hit)."""
    index = PrefixIndex()
    store(index, W, [1, 2, 3], PROMPT, extra=[[["mm-hash", 0], "tenant-a"], None, None])
    assert blocks(index, cache_salt="tenant-a") == {}
    assert blocks(index) == {}
    store(index, OTHER, [4, 5, 6], PROMPT, extra=[None, ["tenant-a"], None])
    assert blocks(index) == {OTHER: 1}
    assert blocks(index, cache_salt="tenant-a") == {}


def test_placement_guesses_are_a_tenants_own():
    index = PrefixIndex()
    store(index, W, [1], [90, 91, 92, 93])  # the worker is known, its block size too
    assert index.place(W, PROMPT, cache_salt="tenant-a", expires=1e12) == 3
    assert blocks(index, cache_salt="tenant-a") == {W: 3}
    assert blocks(index) == {}
    assert index.withdraw(W, PROMPT, cache_salt="tenant-a", expires=1e12) == 3
    assert blocks(index, cache_salt="tenant-a") == {}


@pytest.mark.parametrize("locality", ["REMOTE", "elsewhere", 7])
def test_a_block_held_elsewhere_is_never_the_workers_own(locality):
    index = PrefixIndex()
    store(index, W, [1, 2, 3], PROMPT, locality=locality)
    assert blocks(index) == {}
    assert index.stats().ignored_blocks == 3
    store(index, W, [1, 2, 3], PROMPT, locality="LOCAL")
    assert blocks(index) == {W: 3}
    # The other copy going away leaves the worker's own alone.
    index.apply_removed(W, [1, 2, 3], locality=locality)
    assert blocks(index) == {W: 3}
    assert index.stats().ignored_removals == 3
    index.apply_removed(W, [1, 2, 3], locality="LOCAL")
    assert blocks(index) == {}


def test_sink_attention_groups_hold_a_full_prefix_and_are_indexed():
    index = PrefixIndex()
    store(index, W, [1, 2, 3], PROMPT, kv_cache_spec_kind="sink_full_attention")
    store(index, OTHER, [4, 5, 6], PROMPT, kv_cache_spec_kind="sliding_window")
    assert blocks(index) == {W: 3}
    assert index.stats().ignored_blocks == 3
