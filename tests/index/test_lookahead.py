"""vLLM 0.33's lookahead block hashes (speculative decoding with block drop): an engine
hashes each block together with the L tokens after it, so a prompt shares a cached block
only if its next L tokens are the same too. The index keys such a block with those tokens,
per worker by its own L, against a brute-force model of the engine's rule (both
implementations)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.wire import BlockStored, apply_event, decode_batch, encode_batch, slices
from kvroute.index import PrefixIndex

pytestmark = pytest.mark.usefixtures("index_implementation")

W = ("w", 0)
PLAIN = ("p", 0)


def cached(index: PrefixIndex, prompt: list[int], worker=W) -> int:
    """Blocks a route answers for ``prompt``: all but its last token matched, that token
    still usable as lookahead (as the service asks)."""
    return index.match(prompt[:-1], following=prompt[-1:])[worker].blocks


def stored_prefix(prompt: list[int], block_size: int, lookahead: int) -> BlockStored:
    """What an engine with lookahead ``lookahead`` publishes for ``prompt``: every block
    that has ``lookahead`` tokens after it, each with them."""
    blocks = max(0, len(prompt) - lookahead) // block_size
    return BlockStored(
        block_hashes=[hash((tuple(prompt[:(k + 1) * block_size]), lookahead)) & 0xFFFF_FFFF
                      for k in range(blocks)],
        token_ids=prompt[:blocks * block_size], block_size=block_size,
        lookahead_token_ids=[prompt[(k + 1) * block_size:(k + 1) * block_size + lookahead]
                             for k in range(blocks)])


def test_a_block_matches_only_with_the_tokens_after_it():
    """The issue's case: L = 2, 16-token blocks; a prompt whose fourth block is followed
    by other tokens shares three blocks (48 tokens), not four."""
    index = PrefixIndex()
    prompt = list(range(1, 100))
    apply_event(index, W, stored_prefix(prompt, 16, 2))
    assert cached(index, prompt) == 6
    other = prompt[:64] + [500, 501] + prompt[66:]
    assert cached(index, other) == 3
    assert cached(index, prompt[:65]) == 3  # block 4 needs tokens 65 and 66 to be hashed
    assert cached(index, prompt[:66]) == 4  # ... and the last token counts as lookahead


def test_engines_without_lookahead_answer_as_before_beside_one_with_it():
    index = PrefixIndex()
    prompt = list(range(1, 50))
    apply_event(index, W, stored_prefix(prompt, 4, 1))
    apply_event(index, PLAIN, BlockStored(block_hashes=list(range(100, 112)),
                                          token_ids=prompt[:48], block_size=4))
    answers = index.match(prompt[:-1], following=prompt[-1:])
    assert (answers[W].blocks, answers[PLAIN].blocks) == (12, 12)
    changed = prompt[:12] + [900] + prompt[13:]  # block 2's first token differs
    answers = index.match(changed[:-1], following=changed[-1:])
    assert (answers[W].blocks, answers[PLAIN].blocks) == (2, 3)  # block 2's lookahead: 900


def test_a_worker_whose_lookahead_changes_is_another_engine():
    index = PrefixIndex()
    prompt = list(range(1, 30))
    apply_event(index, W, stored_prefix(prompt, 4, 2))
    assert cached(index, prompt) == 6
    apply_event(index, W, BlockStored(block_hashes=[7], token_ids=[9, 9, 9, 9], block_size=4))
    assert cached(index, prompt) == 0
    assert index.blocks_held(W) == 1


@pytest.mark.parametrize("bad", [[[1, 2]], [[1, 2], [3]], [[], []], [[1, 2], [3, -4]]])
def test_lookahead_lists_that_do_not_fit_the_blocks_are_rejected_before_any_change(bad):
    index = PrefixIndex()
    with pytest.raises(ValueError):
        index.apply_stored(W, [1, 2], None, [1, 2, 3, 4], 2, lookahead_token_ids=bad)
    assert index.blocks_held(W) == 0


def test_the_wire_carries_the_lookahead_and_slices_cut_it_with_the_blocks():
    store = stored_prefix(list(range(1, 60)), 4, 2)
    payload = encode_batch([store], ts=1.0)
    assert PrefixIndex(compiled=True).read_plain_batch(payload) is None  # never plain
    (decoded,) = decode_batch(payload).events
    assert decoded.lookahead_token_ids == store.lookahead_token_ids
    whole, pieces = PrefixIndex(), PrefixIndex()
    apply_event(whole, W, decoded)
    for piece in slices(decoded, 3):
        apply_event(pieces, W, piece)
    prompt = list(range(1, 60))
    assert cached(pieces, prompt) == cached(whole, prompt) == 14


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([2, 4]), lookahead=st.integers(1, 5),
       prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1,
                        max_size=6),
       removed=st.lists(st.integers(0, 40), max_size=6),
       queries=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 24),
                                  st.lists(st.integers(0, 3), max_size=6)), max_size=8))
def test_matches_agree_with_the_engines_rule(block_size, lookahead, prompts, removed, queries):
    """The engine's rule, brute force: block k of a query is a hit while the query's first
    k+1 blocks and the L tokens after them are a cached block's, for every block up to k;
    a block is cached (and hashed at all) only with L tokens after it."""
    index = PrefixIndex()
    held: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for prompt in prompts:
        store = stored_prefix(prompt, block_size, lookahead)
        apply_event(index, W, store)
        for k, block_hash in enumerate(store.block_hashes):
            held[block_hash] = (tuple(prompt[:(k + 1) * block_size]),
                                tuple(store.lookahead_token_ids[k]))
    hashes = list(held)
    for r in removed:
        if hashes:
            gone = hashes[r % len(hashes)]
            index.apply_removed(W, [gone])
            held.pop(gone, None)
    contents = set(held.values())
    for which, cut, tail in queries:
        query = (prompts[which % len(prompts)][:cut] + tail) or [0]
        expected = 0
        while ((expected + 1) * block_size <= len(query) - 1
               and (expected + 1) * block_size + lookahead <= len(query)
               and (tuple(query[:(expected + 1) * block_size]),
                    tuple(query[(expected + 1) * block_size:
                                (expected + 1) * block_size + lookahead])) in contents):
            expected += 1
        assert cached(index, query) == expected, (query, expected)
