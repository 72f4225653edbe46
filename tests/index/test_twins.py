"""The compiled loops agree with the pure ones on random event streams shaped like a fleet's:
long chains from the root and under held blocks, content shared between workers, stores
repeated or re-announced under other hashes, runs of removals (some of unknown hashes),
tiered stores and clears, with queries between them. ``TwinIndex`` compares every answer
and the whole layout after every call; both layouts pass ``_check``."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.index import PrefixIndex, prefix_index
from tests.support.index_impl import TwinIndex, layout

BLOCK = 4
WORKERS = [(f"w{n}", 0) for n in range(5)]


def test_the_compiled_loops_are_built_for_the_test_environment() -> None:
    """`make test` builds them (pip install -e . compiles index/_fast.pyx); without them the
    compiled half of every index test would silently be the pure one."""
    assert prefix_index.COMPILED_AVAILABLE
    twin = TwinIndex()
    assert twin.compiled._fast is not None and twin.pure._fast is None


def run_stream(seed: int, steps: int, workers: list[tuple[str, int]] = WORKERS) -> TwinIndex:
    """A random stream over `workers`; every one stores a block first, so each has its slot
    (bit) from the start, and a fleet of over 36 has bits past 64 in every walk."""
    rng = random.Random(seed)
    index = TwinIndex()
    for number, worker in enumerate(workers):
        index.apply_stored(worker, [10**14 + number], None, [number] * BLOCK, BLOCK)
    prompts = [[rng.randrange(50) for _ in range(BLOCK * rng.randint(1, 24))] for _ in range(6)]
    held: dict[tuple[str, int], list[int]] = {w: [10**14 + n] for n, w in enumerate(workers)}
    next_hash = iter(range(1, 10**9))
    for _ in range(steps):
        worker = rng.choice(workers)
        mine = held[worker]
        action = rng.random()
        if action < 0.45:  # a chain: a shared prompt, maybe a private tail, root or not
            tokens = list(rng.choice(prompts))
            if rng.random() < 0.5:
                tokens += [rng.randrange(50) for _ in range(BLOCK * rng.randint(1, 40))]
            parent = rng.choice(mine) if mine and rng.random() < 0.3 else None
            if rng.random() < 0.1:  # an orphan: a parent nobody holds
                parent = 10**12 + rng.randrange(5)
            hashes = [next(next_hash) for _ in range(len(tokens) // BLOCK)]
            if mine and rng.random() < 0.15:  # a hash re-announced (held, or other content)
                hashes[rng.randrange(len(hashes))] = rng.choice(mine)
            if rng.random() < 0.1:  # signed spellings of unsigned hashes
                hashes = [h - 2**64 if h % 2 else h for h in (x + 2**63 for x in hashes)]
            medium = rng.choice([None, None, None, None, "GPU", "CPU", "STORAGE"])
            index.apply_stored(worker, hashes, parent, tokens, BLOCK, medium=medium)
            mine.extend(h & (2**64 - 1) for h in hashes)
        elif action < 0.8:  # a run of removals, like vLLM's one-hash events coalesced
            count = rng.randint(1, 30)
            chosen = [mine.pop(rng.randrange(len(mine))) for _ in range(min(count, len(mine)))]
            if rng.random() < 0.2:
                chosen.append(10**13 + rng.randrange(3))  # unknown
            medium = rng.choice([None, None, None, "CPU"])
            index.apply_removed(worker, chosen, medium=medium)
        elif action < 0.85 and mine:  # offload of held blocks (a token-less store)
            index.apply_stored(worker, rng.sample(mine, min(3, len(mine))), None, [], 0,
                               medium="CPU")
        elif action < 0.88:
            index.clear_worker(worker)
            mine.clear()
        else:  # queries: a prompt with a tail, all workers and a subset
            tokens = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randint(0, 9))]
            index.match(tokens)
            index.match(tokens, workers=rng.sample(workers, 2), matched_only=True)
    index._check()
    return index


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), steps=st.integers(1, 120))
def test_compiled_and_pure_loops_agree_on_random_streams(seed: int, steps: int) -> None:
    index = run_stream(seed, steps)
    for worker in WORKERS:
        index.drop_worker(worker)
    index._check()
    assert not index.compiled._nodes and not index.pure._nodes


def test_keys_are_made_in_c_here_and_the_python_fallback_gives_the_same_index() -> None:
    """index/_keys.pxi hashes in C when the xxhash package's library checks out (it does
    with the wheels this project installs); the fallback calls xxhash from Python."""
    from kvroute.index import _fast

    assert _fast.c_hashing()
    try:
        assert not _fast.c_hashing(False)
        slow = run_stream(7, 150)
    finally:
        assert _fast.c_hashing(True)
    fast = run_stream(7, 150)
    assert layout(slow.compiled) == layout(fast.compiled) == layout(fast.pure)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), steps=st.integers(1, 120))
def test_the_loops_agree_in_a_fleet_wider_than_64_bits(seed: int, steps: int) -> None:
    """40 workers: holder bits past bit 64, where the compiled walk leaves C integers for
    Python ints (and a walk of a few of them stays on C integers)."""
    wide = [(f"w{n}", 0) for n in range(40)]
    index = run_stream(seed, steps, wide)
    assert max(w.bit for w in index.compiled._workers.values()).bit_length() > 64
    for worker in wide:
        index.drop_worker(worker)
    index._check()
    assert not index.compiled._nodes and not index.pure._nodes


def test_kvroute_pure_index_selects_the_pure_loops() -> None:
    code = ("from kvroute.index import PrefixIndex, prefix_index; "
            "print(prefix_index.IMPLEMENTATION, PrefixIndex().implementation)")
    answers = {}
    for value in ("1", "0", ""):
        env = {**os.environ, "KVROUTE_PURE": value}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        answers[value] = result.stdout.split()
    assert answers == {"1": ["pure", "pure"], "0": ["compiled", "compiled"],
                       "": ["compiled", "compiled"]}


def test_asking_for_missing_compiled_loops_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(prefix_index, "_compiled", None)
    with pytest.raises(ValueError, match="not built"):
        PrefixIndex(compiled=True)
    assert PrefixIndex(compiled=False).implementation == "pure"


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       cut=st.integers(0, 70), tail=st.integers(0, BLOCK - 1),
       medium=st.sampled_from([None, "CPU", "STORAGE"]))
def test_long_walks_agree_wherever_they_end(lengths: list[int], cut: int, tail: int,
                                            medium: str | None) -> None:
    """Workers holding one chain to different depths (up to 70 blocks, past several of the
    compiled walk's look-ahead runs of 16 blocks), one of them on a slower tier; queries
    that leave the chain at any block, or follow it past every holder: both loops answer
    the same matches."""
    index = TwinIndex()
    chain = [n % 50 for n in range(BLOCK * 70)]
    for number, blocks in enumerate(lengths):
        index.apply_stored((f"w{number}", 0), [10**6 * (number + 1) + b for b in range(blocks)],
                           None, chain[:BLOCK * blocks], BLOCK,
                           medium=medium if number == 0 else None)
    query = chain[:BLOCK * cut] + [99] * BLOCK + chain[:tail]  # leaves the chain at `cut`
    index.match(query)
    index.match(chain + [1] * tail, matched_only=True)
    index._check()
