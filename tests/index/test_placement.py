"""Placement guesses against a brute-force model, and inside the index's answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.index import PrefixIndex
from kvroute.index.placement import Placements, chain_keys

# Every test here runs with the compiled loops, then with the pure ones (the reference).
pytestmark = pytest.mark.usefixtures("index_implementation")

WORKERS = ("a", "b")


def test_chain_keys_are_the_index_keys():
    """A guess must match exactly what the real blocks would match."""
    index = PrefixIndex()
    tokens = list(range(1, 4 * 4 + 3))
    index.apply_stored("w", [11, 12, 13, 14], None, tokens[:16], 4)
    keys = chain_keys(tokens, 4)
    assert len(keys) == 4
    assert chain_keys(tokens, 4, "lora") != keys
    assert chain_keys(tokens[:8], 4) == keys[:2]
    assert index.place("v", tokens, block_size=4, expires=10.0) == 4
    assert index.place("w", tokens, expires=10.0) == 0  # w holds them all already
    match = index.match(tokens, now=0.0)
    assert match["v"].blocks == 4 and match["v"].pending == 4
    assert match["w"].blocks == 4 and match["w"].pending == 0


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80), block_size=st.integers(1, 9),
       lora=st.sampled_from([None, "adapter"]), c_hashing=st.booleans())
def test_the_compiled_chain_keys_are_the_reference_keys(tokens, block_size, lora,
                                                        c_hashing) -> None:
    """``_fast.chain_keys`` (which the compiled index places, confirms and extends guesses
    with) gives ``placement.chain_keys``' keys byte for byte, with xxh3 called from C or
    through Python, under the root key or another parent; a parent not 16 bytes long is
    refused."""
    from kvroute.index import _fast
    from kvroute.index.keys import root_key, token_bytes
    root = root_key(block_size, lora)
    data = token_bytes(tokens)
    try:
        _fast.c_hashing(c_hashing)
        assert _fast.chain_keys(data, block_size, root) == chain_keys(tokens, block_size, lora)
        other = b"\x07" * 16
        assert (_fast.chain_keys(data, block_size, other)
                == chain_keys(tokens, block_size, parent=other))
        with pytest.raises(ValueError, match="16 bytes"):
            _fast.chain_keys(data, block_size, root[:8])
    finally:
        _fast.c_hashing(True)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.sampled_from(WORKERS), st.integers(1, 6),
                  st.integers(0, 2), st.integers(1, 5)),
        st.tuples(st.just("confirm"), st.sampled_from(WORKERS), st.integers(0, 5),
                  st.integers(0, 2), st.integers(1, 5)),
        st.tuples(st.just("expire"), st.sampled_from(WORKERS), st.integers(0, 0),
                  st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("forget"), st.sampled_from(WORKERS), st.integers(0, 0),
                  st.integers(0, 0), st.integers(0, 0)),
    ),
    max_size=40,
)


KEY_NUMBERS = st.lists(st.integers(0, 11), max_size=12, unique=True)


@settings(max_examples=300, deadline=None)
@given(held=KEY_NUMBERS, guessed=KEY_NUMBERS, unconfirmed=KEY_NUMBERS, wide=KEY_NUMBERS,
       bit_index=st.integers(0, 63), others=st.integers(0, 2**66), order=st.permutations(
           range(12)), walked_count=st.integers(0, 12), known=st.integers(0, 12))
def test_the_compiled_extent_is_the_reference_extent(held, guessed, unconfirmed, wide,
                                                     bit_index, others, order,
                                                     walked_count, known) -> None:
    """``_fast.extent`` (how far the compiled index extends a match with a worker's
    guesses) answers as ``Placements.extent`` does with the worker's bit on a key's node
    for ``really_holds``: keys held, guessed, unconfirmed, several of these or none, walked
    in any order; other workers' bits beside the worker's, and node values past 64 bits
    (kept apart, in the node table's dict). Told that the first keys are held (as many as
    are, or fewer), it answers the same."""
    from kvroute.index import _fast
    keys = chain_keys(list(range(48)), 4)
    bit = 1 << bit_index
    nodes = _fast.NodeMap()
    for i, key in enumerate(keys):
        value = (others & ~bit) | (bit if i in held else 0) | (1 << 70 if i in wide else 0)
        if value:
            nodes[key] = value
    placements = Placements()
    placements.place("w", [keys[i] for i in guessed], 10.0)
    pending_keys = {keys[i]: 1 for i in unconfirmed}
    walked = [keys[i] for i in order[:walked_count]]
    expected = placements.extent("w", walked, lambda key: bool(nodes.get(key, 0) & bit),
                                 pending_keys)
    assert _fast.extent(nodes, walked, bit, placements.guessed("w"), pending_keys) == expected
    leading = next((n for n, key in enumerate(walked) if not nodes.get(key, 0) & bit),
                   len(walked))
    assert _fast.extent(nodes, walked, bit, placements.guessed("w"), pending_keys,
                        min(known, leading)) == expected
    with pytest.raises(ValueError, match="more keys"):
        _fast.extent(nodes, walked, bit, placements.guessed("w"), pending_keys,
                     len(walked) + 1)
    with pytest.raises(ValueError, match="below bit 64"):
        _fast.extent(nodes, walked, 1 << 64, placements.guessed("w"), pending_keys)
    with pytest.raises(ValueError, match="16 bytes"):
        _fast.extent(nodes, [b"short"], bit, placements.guessed("w"), pending_keys)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_guesses_follow_a_brute_force_model(operations):
    """Model: per worker, key -> expiry of the guess that placed it (a guess of a key
    already guessed changes nothing); confirm and expiry delete keys."""
    chains = {p: chain_keys(list(range(p * 100, p * 100 + 24)), 4) for p in range(3)}
    placements = Placements()
    model: dict[str, dict[bytes, float]] = {}
    really: dict[str, set[bytes]] = {w: set() for w in WORKERS}
    now = 0.0
    for op, worker, n, prompt, ttl in operations:
        if op == "place":
            keys = chains[prompt][:n]
            placements.place(worker, keys, now + ttl)
            held = model.setdefault(worker, {})
            for key in keys:
                held.setdefault(key, now + ttl)
        elif op == "confirm":
            keys = chains[prompt][:n]
            placements.confirm(worker, keys)
            really[worker].update(keys)
            for key in keys:
                model.get(worker, {}).pop(key, None)
        elif op == "expire":
            now += 1.0
            placements.expire(now)
            for held in model.values():
                for key in [k for k, e in held.items() if e <= now]:
                    del held[key]
        else:
            placements.forget(worker)
            model.pop(worker, None)
        model = {w: held for w, held in model.items() if held}
        assert len(placements) == sum(len(h) for h in model.values())
        for w in WORKERS:
            assert placements.has(w) == (w in model)
            for keys in chains.values():
                expected = pending = 0
                for key in keys:
                    if key in really[w]:
                        expected += 1
                    elif key in model.get(w, {}):
                        expected += 1
                        pending += 1
                    else:
                        break
                assert placements.extent(w, keys, really[w].__contains__) == (expected, pending)
    placements.expire(now + 100.0)
    assert len(placements) == 0 and not placements


def test_index_answers_with_guesses_until_they_expire_or_are_replaced():
    index = PrefixIndex()
    tokens = list(range(1, 33))
    index.apply_stored("b", [1], None, tokens[:8], 8)  # b's block size is known
    assert index.place("b", tokens, expires=5.0) == 3
    before = index.match(tokens, now=1.0)["b"]
    assert (before.blocks, before.pending, before.tokens) == (4, 3, 32)
    assert before.by_medium["GPU"] == 1

    # The real stores arrive: the guess is replaced by them.
    index.apply_stored("b", [2, 3, 4], 1, tokens[8:32], 8)
    assert not index.placements.has("b")
    # An eviction right after is seen at once: no guess keeps the block alive.
    index.apply_removed("b", [3])
    after = index.match(tokens, now=1.0)["b"]
    assert (after.blocks, after.pending) == (2, 0)

    assert index.place("b", tokens, expires=5.0) == 2  # blocks 0 and 1 are really held
    assert index.match(tokens, now=4.9)["b"].blocks == 4
    assert index.match(tokens, now=5.0)["b"].blocks == 2  # expired: no trace
    assert len(index.placements) == 0

    index.place("b", tokens, expires=50.0)
    index.clear_worker("b")
    assert len(index.placements) == 0
    index.place("b", tokens, expires=50.0)
    index.drop_worker("b")
    assert len(index.placements) == 0
    assert index.place("new", tokens, expires=50.0) == 0  # no block size known: no guess
    assert index.stats().workers == 0


def test_a_guess_is_not_kept_alive_by_answers_that_follow_it():
    """Routing answers that follow a guess place it again; that must not renew it, or a
    worker that never stores the prompt would keep attracting it forever."""
    index = PrefixIndex()
    tokens = list(range(1, 33))
    index.apply_stored("b", [1], None, tokens[:8], 8)  # b's block size is known
    assert index.place("b", tokens, expires=2.0) == 3
    assert index.place("b", tokens, expires=3.0) == 3  # the same blocks, guessed again
    assert index.place("b", tokens + list(range(40, 48)), expires=3.5) == 4  # one more block
    assert index.match(tokens, now=1.9)["b"].blocks == 4
    assert index.match(tokens, now=2.0)["b"].blocks == 1  # the first guess ran out
    longer = index.match(tokens + list(range(40, 48)), now=2.0)["b"]
    assert longer.blocks == 1  # the newer block hangs off expired guesses: unreachable
    assert index.match(tokens + list(range(40, 48)), now=3.5)["b"].blocks == 1
    assert len(index.placements) == 0
