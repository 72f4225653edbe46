"""Runs of plain events (index.runs): applying a batch's events a run at a time, with any
budget, leaves the index exactly as applying them one by one through ``apply_event``; the
compiled and the pure run loops give the same answers and layouts (``TwinIndex``), and so
do runs of the compiled index's own reading of the payloads (``read_plain_batch``), on
streams mixing plain events with every kind that is not plain (other media, LoRA, extra
keys, orphans, signed hashes, bad token ids, clears, stores over the caps)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    RawStored,
    apply_event,
    decode_batch,
    encode_batch,
    stored,
)
from kvroute.index import PrefixIndex
from kvroute.index.runs import RunLimits
from tests.support.index_impl import TwinIndex, layout
from tests.support.plain_events import BLOCK, WORKERS, decoded_for_runs, random_events

LIMITS = RunLimits(stored=(BlockStored, RawStored), removed=BlockRemoved,
                   max_event_blocks=40, max_worker_blocks=400, max_work=64)






def one_by_one(index: PrefixIndex, worker: tuple, event) -> None:
    """What BatchApplier does with an event that is not plain (caps aside: the streams'
    over-cap stores are skipped here as it skips them)."""
    if isinstance(event, RawStored):
        event = stored(event)
        if event is None:
            return  # malformed: left out
    if isinstance(event, BlockStored) and (
            len(event.block_hashes) > LIMITS.max_event_blocks
            or index.blocks_held(worker) + len(event.block_hashes) > LIMITS.max_worker_blocks):
        return
    try:
        apply_event(index, worker, event)
    except ValueError:
        pass


def feed_in_runs(index, worker: tuple, events: list, rng: random.Random) -> int:
    """``events`` in runs of random bounds, each event no run takes one by one: how many
    the runs took."""
    position = taken = 0
    while position < len(events):
        work_left = rng.choice([0, 3, 16, 64])
        events_left = rng.choice([1, 2, 5, 256])
        done = index.apply_run(worker, events, position, work_left, events_left, LIMITS)
        assert done.error is None
        assert position <= done.next <= len(events)
        assert done.work <= work_left and done.next - position <= events_left
        assert done.blocks == sum(len(e.block_hashes) for e in events[position:done.next])
        if done.full and done.next == position:
            continue  # the caller yields, then asks again with a new budget
        taken += done.next - position
        position = done.next
        if not done.full and position < len(events):
            one_by_one(index, worker, events[position])
            position += 1
    return taken


def feed_plain(index: PrefixIndex, worker: tuple, events: list, rng: random.Random) -> int:
    """``events`` as a subscriber gives them: each longest stretch whose payload the index
    reads as plain (``read_plain_batch``) in runs of that reading, the rest as
    ``feed_in_runs`` gives decoded events. Returns how many events runs took from
    readings."""
    position = taken = 0
    while position < len(events):
        end = position
        while end < len(events) and index.read_plain_batch(
                encode_batch(events[position:end + 1], ts=0.0)) is not None:
            end += 1
        if end == position:
            feed_in_runs(index, worker, events[position:position + 1], rng)
            position += 1
            continue
        payload = encode_batch(events[position:end], ts=0.0)
        plain = index.read_plain_batch(payload)
        decoded = decoded_for_runs(payload).events
        at = 0
        while at < len(plain):
            done = index.apply_run(worker, plain, at, rng.choice([0, 3, 16, 64]),
                                   rng.choice([1, 2, 5, 256]), LIMITS)
            assert done.error is None and at <= done.next <= len(plain)
            if done.full and done.next == at:
                continue
            taken += done.next - at
            at = done.next
            if not done.full and at < len(plain):
                one_by_one(index, worker, decoded[at])
                at += 1
        position = end
    return taken


def guesses(index: PrefixIndex) -> dict:
    """The placement guesses left, per worker: key -> expiry."""
    return {worker: dict(keys) for worker, keys in index.placements._guessed.items()}


def guess_some(rng: random.Random, worker: tuple, events: list, indexes: list,
               ) -> list[int] | None:
    """Now and then, guesses on ``worker`` for the tokens of one of the root chains about to
    be stored (the store confirms them), or for tokens no event stores: the tokens guessed,
    if any."""
    if rng.random() < 0.4:
        return None
    chains = [e.token_ids for e in (stored(e) if isinstance(e, RawStored) else e
                                    for e in events)
              if isinstance(e, BlockStored) and e.parent_block_hash is None
              and e.lora_name is None and all(0 <= t < 2**32 for t in e.token_ids)]
    tokens = (rng.choice(chains) if chains and rng.random() < 0.8
              else [rng.randrange(50_000) for _ in range(3 * BLOCK)])
    for index in indexes:
        index.place(worker, tokens, block_size=BLOCK, expires=1e9)
    return tokens


def restart_some(rng: random.Random, worker: tuple, indexes: list) -> None:
    """Now and then, ``worker``'s holdings as a restart that no replay could vouch for
    leaves them: cleared, and held again unconfirmed (so later stores and removals that
    name them end them, in runs as one by one)."""
    if rng.random() > 0.08:
        return
    capture = indexes[-1].capture(worker)
    pieces = [] if capture is None else list(capture.pieces(7))
    for index in indexes:
        index.clear_worker(worker)
        index.restore_unconfirmed(worker, pieces, expires=1e9)


def run_stream(seed: int, batches: int) -> None:
    """Random batches applied one event at a time to a pure index, and in runs to a
    compiled and a pure one and to a compiled one fed the payloads it reads (``feed_plain``),
    with placement guesses now and then on the worker a batch is
    for, and now and then its holdings made unconfirmed (``restart_some``): the same index,
    and the same guesses left, after every batch; and the same matches, guesses counted,
    for the prompts guessed lately and longer ones."""
    rng = random.Random(seed)
    twin, reference = TwinIndex(), PrefixIndex(compiled=False)
    read = PrefixIndex(compiled=True)  # fed what its reading takes as PlainBatches
    held = {w: [] for w in WORKERS}
    next_hash = [1]
    confirmed = runs_ended_unconfirmed = read_taken = 0
    prompts: list[list[int]] = []
    for _ in range(batches):
        worker = rng.choice(WORKERS)
        restart_some(rng, worker, [twin, reference, read])
        events = random_events(rng, held[worker], next_hash)
        guessed_tokens = guess_some(rng, worker, events, [twin, reference, read])
        if guessed_tokens is not None:
            prompts = [*prompts[-3:], guessed_tokens]
        guessed = sum(map(len, guesses(reference).values()))
        for event in events:
            one_by_one(reference, worker, event)
        confirmed += guessed - sum(map(len, guesses(reference).values()))
        unconfirmed = twin.unconfirmed_blocks(worker)
        taken = feed_in_runs(twin, worker, events, rng)
        read_taken += feed_plain(read, worker, events, rng)
        assert layout(read) == layout(reference)
        assert guesses(read) == guesses(reference)
        if unconfirmed and twin.unconfirmed_blocks(worker) < unconfirmed:
            runs_ended_unconfirmed += taken
        assert layout(twin.compiled) == layout(reference)
        assert guesses(twin.compiled) == guesses(twin.pure) == guesses(reference)
        for tokens in prompts:
            for prompt in (tokens, [*tokens, *range(7, 7 + BLOCK + 1)]):
                assert twin.compiled.match(prompt) == reference.match(prompt)
    twin._check()
    reference._check()
    read._check()
    if batches >= 100:
        assert confirmed > 0  # stores confirmed guesses, through runs and one by one
        assert runs_ended_unconfirmed > 0  # runs took batches that ended unconfirmed blocks
        assert read_taken > 0  # runs took events of payloads read as plain


@pytest.mark.parametrize("seed", range(12))
def test_runs_leave_the_index_as_events_one_by_one(seed: int) -> None:
    run_stream(seed, 120)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_runs_agree_with_events_one_by_one_on_any_stream(seed: int) -> None:
    run_stream(seed, 25)


def test_a_run_stops_at_the_first_event_that_is_not_plain() -> None:
    index = PrefixIndex()
    worker = WORKERS[0]
    index.clear_worker(worker)
    chain = BlockStored(block_hashes=[1, 2], token_ids=list(range(8)), block_size=BLOCK)
    other = BlockStored(block_hashes=[3], token_ids=[1, 2, 3, 4], block_size=BLOCK,
                        medium="CPU")
    events = [chain, BlockRemoved(block_hashes=[2]), other, BlockRemoved(block_hashes=[1])]
    done = index.apply_run(worker, events, 0, 64, 256, LIMITS)
    assert (done.next, done.blocks, done.work, done.full) == (2, 3, 3, False)
    assert index.blocks_held(worker) == 1
    done = index.apply_run(worker, events, 3, 0, 256, LIMITS)
    assert (done.next, done.full) == (3, True)  # fits no budget: the caller yields
    done = index.apply_run(worker, events, 3, 1, 256, LIMITS)
    assert (done.next, done.blocks) == (4, 1)
    assert index.blocks_held(worker) == 0


def test_raw_token_ids_decode_to_what_decode_batch_makes() -> None:
    events = [BlockStored(block_hashes=[5, 6], parent_block_hash=4,
                          token_ids=[0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1],
                          block_size=BLOCK, lora_id=3),
              BlockRemoved(block_hashes=[5]), AllBlocksCleared()]
    payload = encode_batch(events, ts=1.0, dp_rank=2)
    raw = decoded_for_runs(payload)
    assert isinstance(raw.events[0], RawStored)
    assert [stored(raw.events[0]), *raw.events[1:]] == decode_batch(payload).events
    assert raw.data_parallel_rank == 2
    # The array encoding (older vLLM) decodes as it always did.
    old = decoded_for_runs(encode_batch(events, encoding="array"))
    assert old.events == decode_batch(encode_batch(events, encoding="array")).events
