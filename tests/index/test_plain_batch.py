"""The compiled index's reading of a whole payload (``PrefixIndex.read_plain_batch``): it
takes a payload only when every event is plain in form, and then it reads exactly what
``decode_batch`` decodes, event for event; applied through ``BatchApplier``, a stream leaves
the index as the decoding path leaves the pure index, also where a run stops mid-batch and
the decoded events take over."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import random
import threading
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvroute.app.ingest import apply as batch_apply
from kvroute.app.ingest.apply import NOT_PLAIN, BatchApplier, BatchOutcome, Begun
from kvroute.app.ingest.plain_slices import event_slices
from kvroute.app.ingest.wire import (
    BlockRemoved,
    BlockStored,
    RawStored,
    apply_event,
    decode_batch,
    encode_batch,
    slices,
    stored,
)
from kvroute.app.workers import SubscriberOptions
from kvroute.index import PrefixIndex
from kvroute.index.runs import MAX_PLAIN_BLOCK_SIZE, PLAIN_KINDS, RunLimits
from tests.support.events import TEST_OPTIONS
from tests.support.index_impl import layout
from tests.support.plain_events import WORKERS, decoded_for_runs, random_events
from tests.support.waiting import run_async

pytestmark = pytest.mark.skipif(PrefixIndex().implementation != "compiled",
                                reason="the payload reader is part of the compiled index")

READER = PrefixIndex(compiled=True)
encode = msgspec.msgpack.encode


def as_shown(event: Any) -> tuple:
    """A decoded event as ``PlainBatch.event`` shows one."""
    if isinstance(event, BlockRemoved):
        return ("BlockRemoved", list(event.block_hashes), None, [], 0)
    full = stored(event) if not isinstance(event, BlockStored) else event
    assert full is not None
    return ("BlockStored", list(full.block_hashes), full.parent_block_hash,
            list(full.token_ids), full.block_size)


def plain_in_form(event: Any) -> bool:
    """``index.runs``' checks of an event alone, on a decoded event (the reference)."""
    if not hasattr(event, "block_hashes"):  # a clear
        return False
    if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
        return False
    if (event.locality, event.ownership) != (None, None):  # decoded, whatever they hold
        return False
    hashes = event.block_hashes
    if not all(type(h) is int and 0 <= h < 2**64 for h in hashes):
        return False
    if isinstance(event, BlockRemoved):
        return True
    if not isinstance(event, BlockStored):
        event = stored(event)
        if event is None:
            return False
    tokens, size, extra = event.token_ids, event.block_size, event.extra_keys
    parent = event.parent_block_hash
    return (event.kv_cache_spec_kind in PLAIN_KINDS and event.lora_id is None
            and event.lora_name is None and len(hashes) >= 1
            and (extra is None or extra == [None] * len(hashes))
            and 0 < size <= MAX_PLAIN_BLOCK_SIZE and len(tokens) == len(hashes) * size
            and all(0 <= t < 2**32 for t in tokens)
            and (parent is None or type(parent) is int and 0 <= parent < 2**64)
            and event.session_id is None)


def check_reading(payload: bytes) -> bool:
    """The reader against ``decode_batch`` on one payload; whether it took it."""
    plain = READER.read_plain_batch(payload)
    try:
        batch = decoded_for_runs(payload)
    except ValueError:
        assert plain is None
        return False
    if plain is None:
        return False
    assert batch.malformed == 0 and batch.unknown == 0
    assert len(plain) == len(batch.events)
    assert plain.ts == batch.ts or math.isnan(plain.ts) and math.isnan(batch.ts)
    assert plain.data_parallel_rank == batch.data_parallel_rank
    for k, event in enumerate(batch.events):
        assert plain.event(k) == as_shown(event)
        assert plain_in_form(event)
    return True


# --- payloads --------------------------------------------------------------------------------

hashes_st = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1),
                               st.binary(min_size=1, max_size=4)), min_size=0, max_size=5)
odd_values = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3), st.booleans(),
                       st.floats(allow_nan=False), st.lists(st.integers(0, 3), max_size=2))


def mostly(draw: st.DrawFn, plain: st.SearchStrategy, odd: st.SearchStrategy) -> Any:
    """A draw from ``plain`` most times (a batch is read only when every event is plain);
    left to hypothesis, ``odd`` would be drawn about as often."""
    return draw(odd if draw(st.integers(0, 24)) == 13 else plain)


@st.composite
def store_maps(draw: st.DrawFn) -> dict:
    blocks = mostly(draw, st.integers(1, 4), st.just(0))
    size = mostly(draw, st.sampled_from([1, 2, 16]), st.sampled_from([0, -1, 2**20 + 1]))
    hashes = mostly(draw, st.lists(st.integers(0, 2**64 - 1), min_size=blocks,
                                   max_size=blocks), hashes_st)
    count = max(blocks * size, 0) if size <= 16 else blocks  # too many to draw: not plain
    tokens = mostly(draw, st.lists(st.integers(0, 2**32 - 1), min_size=count, max_size=count),
                    st.lists(st.one_of(st.integers(-3, 2**33), st.text(max_size=1)),
                             max_size=6))
    parent = mostly(draw, st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.integers(-9, -1))
    event: dict = {"type": "BlockStored", "block_hashes": hashes,
                   "parent_block_hash": parent, "token_ids": tokens, "block_size": size}
    optional = {  # (plain values, odd ones)
        "lora_id": (st.none(), st.integers(0, 3)),
        "medium": (st.sampled_from([None, "GPU"]), st.sampled_from(["CPU", "gpu"])),
        "lora_name": (st.none(), st.just("adapter")),
        "extra_keys": (st.sampled_from([None, [None] * len(hashes)]),
                       st.sampled_from([[["x"]] * len(hashes), [None] * 7])),
        "group_idx": (st.sampled_from([None, 0]), st.just(1)),
        "kv_cache_spec_kind": (st.sampled_from([None, "full_attention", "mla_attention"]),
                               st.just("sliding_window")),
        "kv_cache_spec_sliding_window": (st.one_of(st.none(), st.integers(0, 4096)),
                                         st.just("x")),
        "locality": (st.none(), odd_values), "ownership": (st.none(), odd_values),
        "session_id": (st.none(), odd_values), "some_future_field": (odd_values, odd_values),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        event[name] = mostly(draw, *optional[name])
    return event


@st.composite
def removal_maps(draw: st.DrawFn) -> dict:
    event: dict = {"type": "BlockRemoved",
                   "block_hashes": mostly(draw, st.lists(st.integers(0, 2**64 - 1),
                                                         max_size=5), hashes_st)}
    if draw(st.booleans()):
        event["medium"] = mostly(draw, st.sampled_from([None, "GPU"]), st.just("CPU"))
    if draw(st.booleans()):
        event["group_idx"] = mostly(draw, st.sampled_from([None, 0]), st.just(2))
    if draw(st.booleans()):
        event["token_ids"] = [1, 2]  # not a removal's field: skipped as unknown
    return event


_STORE_FIELDS = list(BlockStored.__struct_fields__)
_REMOVAL_FIELDS = list(BlockRemoved.__struct_fields__)


def as_array(event: dict) -> list:
    """The older array encoding of a map event, trailing defaults left off."""
    fields = _STORE_FIELDS if event["type"] == "BlockStored" else _REMOVAL_FIELDS
    values = [event.get(name) for name in fields]
    defaults = {"token_ids": [], "block_size": 0}
    while values and values[-1] is None and fields[len(values) - 1] not in defaults:
        values.pop()
    return [event["type"], *values]


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    events = [mostly(draw, st.one_of(store_maps(), removal_maps()),
                     st.just({"type": "AllBlocksCleared"}))
              for _ in range(draw(st.integers(0, 5)))]
    encoding = draw(st.sampled_from(["map", "array", "mixed"]))
    if encoding != "map":
        events = [as_array(e) if encoding == "array" or draw(st.booleans()) else e
                  for e in events if e["type"] != "AllBlocksCleared"]
    ts = draw(st.one_of(st.floats(allow_nan=False), st.integers(0, 2**40)))
    envelope: list = [ts, events]
    rank = mostly(draw, st.sampled_from(["none", "nil", 0, 3]), st.sampled_from([-1, True]))
    if rank != "none":
        envelope.append(None if rank == "nil" else rank)
    return encode(envelope)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads())
def test_a_payload_is_read_exactly_as_decoded_or_not_at_all(payload: bytes) -> None:
    taken = check_reading(payload)
    # And it is taken whenever every event is plain in form (the lane is not left unused).
    try:
        batch = decoded_for_runs(payload)
    except ValueError:
        return
    body = msgspec.msgpack.decode(payload)
    rank_ok = len(body) == 2 or body[2] is None or type(body[2]) is int and body[2] >= 0
    ts_ok = type(body[0]) is float or body[0] >= 0
    if (rank_ok and ts_ok and not batch.malformed and not batch.unknown
            and all(plain_in_form(e) for e in batch.events)):
        assert taken, msgspec.msgpack.decode(payload)


@settings(max_examples=300, deadline=None)
@given(payloads(), st.data())
@example(encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}]]), None)
def test_a_cut_or_damaged_payload_is_never_read_as_something_else(payload: bytes,
                                                                 data: Any) -> None:
    if data is None:
        variants = [payload[:-1], payload + b"\x00"]
    else:
        cut = data.draw(st.integers(0, max(len(payload) - 1, 0)))
        flipped = bytearray(payload)
        if flipped:
            at = data.draw(st.integers(0, len(flipped) - 1))
            flipped[at] = data.draw(st.integers(0, 255))
        variants = [payload[:cut], bytes(flipped)]
    for variant in variants:
        check_reading(variant)


def test_what_the_reader_refuses_rather_than_interprets() -> None:
    store = {"type": "BlockStored", "block_hashes": [7], "token_ids": [1, 2], "block_size": 2}
    assert check_reading(encode([1.0, [store], 0]))
    refused = [
        {b"ts": 1.0, b"events": [store]},                     # a map envelope
        [1.0, [store], 0, "more"],                            # a longer envelope
        [1.0, [{**store, "type": "BlockStored"}, {"type": "AllBlocksCleared"}]],
        [1.0, [dict(reversed(list(store.items())))]],         # the tag not first
        [1.0, [["BlockStored", [7], None, [1, 2], 2] + [None] * 11]],  # past its fields
        [-1, [store]],                                        # a negative ts
    ]
    for envelope in refused:
        assert READER.read_plain_batch(encode(envelope)) is None, envelope
    # A locality the decoder cannot decode (not UTF-8): that event is malformed to it.
    bad_text = encode([1.0, [{**store, "locality": "x"}]]).replace(b"\xa1x", b"\xa1\x80")
    assert decode_batch(bad_text).malformed == 1
    assert READER.read_plain_batch(bad_text) is None
    twice = encode([1.0, [store]]).replace(b"\x84\xa4type", b"\x85\xa4type", 1)
    twice += encode("block_size") + encode(2)  # block_size given twice
    assert READER.read_plain_batch(twice) is None


def test_real_vllm_traffic_is_read_as_decoded() -> None:
    """Every live batch of the vLLM 0.32.0 capture that has no clear is taken."""
    from tests.support.fixtures import live_payloads

    taken = refused = 0
    for payload in live_payloads().values():
        if check_reading(payload):
            taken += 1
        else:
            refused += 1
            assert b"AllBlocksCleared" in payload
    assert taken > 10


# --- through BatchApplier ------------------------------------------------------------------

def applier(index: PrefixIndex, worker: tuple,
            options: SubscriberOptions = TEST_OPTIONS) -> BatchApplier:
    return BatchApplier(index, worker, options, check=lambda: None,
                        refused=lambda counter, reason: None)


def _counts(outcome: BatchOutcome) -> tuple:
    return (outcome.events, outcome.blocks, outcome.malformed, outcome.unknown,
            outcome.data_parallel_rank, outcome.rejected is None)


@pytest.mark.parametrize("lazily", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("seed", range(10))
def test_a_stream_through_the_applier_leaves_the_index_as_decoding_does(
        seed: int, lazily: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Payloads of the random run streams (plain events, and now and then one that is not:
    another medium, an orphan, a store over a cap), map- or array-encoded. The compiled
    index takes each batch as a subscriber does a live one (``apply_now``, then ``apply``
    for the rest), within bounds of work small enough that runs stop short for them too;
    the pure one through ``apply``. Same index, same counts, batch after batch.

    The compiled index rebuilds the events no run takes from its reading, a slice at a time
    (``app.ingest.plain_slices``). ``big``: every payload counts as too big to read on the
    loop's thread (the compiled index reads it on another), and every event as a huge one
    (the pure index decodes each store through ``app.ingest.huge_store``)."""
    rebuilt = collections.Counter()
    if lazily:
        monkeypatch.setattr(batch_apply, "_DECODE_WHOLE_BYTES", 0)
        monkeypatch.setattr(batch_apply, "HUGE_EVENT_BYTES", 0)

    def counted(plain, k, *args):
        rebuilt[plain.head(k)[0]] += 1
        return event_slices(plain, k, *args)
    monkeypatch.setattr(batch_apply, "event_slices", counted)
    rng = random.Random(seed)
    compiled, pure = PrefixIndex(compiled=True), PrefixIndex(compiled=False)
    # Caps that refuse some stores (of 45 blocks; past 400 held) for some seeds.
    small = dataclasses.replace(TEST_OPTIONS, chunk_events=rng.choice([3, 9, 256]),
                                slice_blocks=rng.choice([4, 16, 1024]),
                                max_blocks_per_event=rng.choice([40, 65_536]),
                                max_blocks_per_worker=rng.choice([400, 10**6]))
    appliers = {(w, i): applier(index, w, small) for w in WORKERS
                for i, index in enumerate((compiled, pure))}
    held: dict = {w: [] for w in WORKERS}
    next_hash = [1]
    read = 0
    answers: collections.Counter = collections.Counter()

    async def scenario() -> None:
        nonlocal read
        for seq in range(120):
            worker = rng.choice(WORKERS)
            events = random_events(rng, held[worker], next_hash)
            encoding = rng.choice(["map", "array"])
            if encoding == "array":  # the array encoding has no raw token ids
                events = [stored(e) if isinstance(e, RawStored) else e
                          for e in events if not isinstance(e, RawStored) or stored(e)]
            payload = encode_batch(events, ts=1.0, encoding=encoding)
            read += compiled.read_plain_batch(payload) is not None
            fast = appliers[(worker, 0)]
            pending = fast.apply_now(payload)
            answers["not plain" if pending is NOT_PLAIN else type(pending).__name__] += 1
            outcome = (pending if isinstance(pending, BatchOutcome)
                       else await fast.apply(seq, payload, pending))
            reference = await appliers[(worker, 1)].apply(seq, payload)
            for done in (outcome, reference):
                assert done.failed is None and done.garbage is None
            assert _counts(outcome) == _counts(reference)
            assert layout(compiled) == layout(pure)

    run_async(scenario)
    compiled._check()
    assert read > 0
    # the stores no run took (orphans, a cap, more work than a run's bound)
    assert rebuilt["BlockStored"] > 0
    if lazily:
        return
    # apply_now applied something, and left some batches to apply (every answer of it
    # shows for some of the seeds; the next test takes each one on purpose).
    assert answers["BatchOutcome"] + answers["Begun"] > 0 and answers["not plain"] > 0


def test_apply_now_takes_batches_whole_and_leaves_the_rest_to_apply() -> None:
    """A run that stops short (a worker the index does not know yet, an orphan, the work
    allowed between two yields used up) leaves the batch begun, and ``apply`` ends it; with
    no room left in the chunk, ``apply_now`` applies nothing."""
    store = BlockStored(block_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2)
    orphan = BlockStored(block_hashes=[3], parent_block_hash=99, token_ids=[5, 6],
                         block_size=2)
    after = BlockStored(block_hashes=[4], parent_block_hash=2, token_ids=[7, 8], block_size=2)
    more = BlockStored(block_hashes=[5, 6], parent_block_hash=4, token_ids=[9, 10, 11, 12],
                       block_size=2)

    async def begun_then_ended(taker: BatchApplier, seq: int, payload: bytes,
                               ) -> tuple[Begun, BatchOutcome]:
        begun = taker.apply_now(payload)
        assert isinstance(begun, Begun)
        return begun, await taker.apply(seq, payload, begun)

    async def scenario() -> None:
        index = PrefixIndex(compiled=True)
        taker = applier(index, WORKERS[0])
        _, first = await begun_then_ended(taker, 0, encode_batch([store], ts=1.0))
        assert (first.events, first.blocks) == (1, 2)  # the worker is known from then on
        whole = taker.apply_now(encode_batch([after], ts=1.0))
        assert isinstance(whole, BatchOutcome) and (whole.events, whole.blocks) == (1, 1)
        _, ended = await begun_then_ended(taker, 2, encode_batch([orphan, more], ts=1.0))
        assert (ended.events, ended.blocks) == (2, 3)
        assert index.holds_hash(WORKERS[0], 6)

        tight = applier(index, WORKERS[1], dataclasses.replace(TEST_OPTIONS, slice_blocks=1))
        await tight.apply(0, encode_batch([store], ts=1.0))
        begun, ended = await begun_then_ended(tight, 1, encode_batch([after, more], ts=1.0))
        assert begun.done.full and (ended.events, ended.blocks) == (2, 3)
        assert index.holds_hash(WORKERS[1], 6)

        spent = applier(PrefixIndex(compiled=True), WORKERS[0],
                        dataclasses.replace(TEST_OPTIONS, chunk_events=1))
        assert spent.apply_now(encode_batch([store], ts=1.0)) is None

    run_async(scenario)


# --- events of a big payload's reading, rebuilt a slice at a time --------------------------

@settings(max_examples=300, deadline=None)
@given(blocks=st.integers(0, 40), block_size=st.integers(1, 40),
       parent=st.sampled_from([None, 7, 2**64 - 1]), held=st.booleans(),
       max_blocks=st.integers(1, 12), removal=st.booleans(),
       encoding=st.sampled_from(["map", "array"]))
def test_a_read_event_is_rebuilt_in_the_slices_of_the_decoded_one(
        blocks: int, block_size: int, parent: int | None, held: bool, max_blocks: int,
        removal: bool, encoding: str) -> None:
    """``event_slices`` of an event of the index's reading gives ``wire.slices``' slices of
    the decoded event: the same hashes, parents (an orphan's named in every slice), token
    ids and block size, cut at the same blocks."""
    hashes = [10**6 + b for b in range(blocks)]
    if removal:
        event: Any = BlockRemoved(block_hashes=hashes)
    else:
        blocks = max(blocks, 1)
        hashes = [10**6 + b for b in range(blocks)]
        event = BlockStored(block_hashes=hashes, parent_block_hash=parent,
                            token_ids=[(7 * t) % 2**32 for t in range(blocks * block_size)],
                            block_size=block_size)
    payload = encode_batch([event], ts=1.0, encoding=encoding)
    plain = PrefixIndex(compiled=True).read_plain_batch(payload)
    assert plain is not None
    decoded = decode_batch(payload).events[0]

    def holds(block_hash: int) -> bool:
        assert block_hash == parent  # asked only of a split store's parent
        return held

    def shown(piece: Any) -> tuple:
        if isinstance(piece, BlockRemoved):
            return ("removed", list(piece.block_hashes))
        return ("stored", list(piece.block_hashes), piece.parent_block_hash,
                list(piece.token_ids), piece.block_size, piece.medium, piece.lora_name,
                piece.extra_keys, piece.group_idx, piece.kv_cache_spec_kind)

    rebuilt = [shown(p) for p in event_slices(plain, 0, max_blocks, holds)]
    assert rebuilt == [shown(p) for p in slices(decoded, max_blocks, holds)]
    assert len(rebuilt) >= 1


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_long_lists_are_left_in_the_payload_and_read_a_piece_at_a_time(encoding: str) -> None:
    """Lists of over 65,536 items are checked in the reading but left in the payload:
    every piece of them, in order or not, is the decoded event's, and no run takes such an
    event, however large its bound of work; through the applier the index ends as the
    decoded events leave it."""
    long_hashes = BlockStored(block_hashes=[2**63 + b for b in range(70_000)],
                              token_ids=[b % 2**32 for b in range(70_000)], block_size=1)
    long_tokens = BlockStored(block_hashes=[10 + b for b in range(5_000)],
                              parent_block_hash=2**63 + 69_999,
                              token_ids=[(b * 7919) % 2**32 for b in range(80_000)],
                              block_size=16)
    removal = BlockRemoved(block_hashes=[2**63 + b for b in range(0, 140_000, 2)])
    events = [long_hashes, long_tokens, removal]
    payload = encode_batch(events, ts=1.0, encoding=encoding)
    index = PrefixIndex(compiled=True)
    plain = index.read_plain_batch(payload)
    assert plain is not None
    assert [plain.left_in_payload(k) for k in range(3)] == [True, True, True]
    decoded = decode_batch(payload).events
    for k, event in enumerate(decoded):
        assert plain.event(k) == as_shown(event)
    # Checked all the same: cut short, or one token id not one, and it is not read.
    assert index.read_plain_batch(payload[:len(payload) // 2]) is None
    damaged = encode_batch([long_hashes, msgspec.structs.replace(
        long_tokens, token_ids=[*long_tokens.token_ids[:-7], 2**32,
                                *long_tokens.token_ids[-6:]])], ts=1.0, encoding=encoding)
    assert index.read_plain_batch(damaged) is None
    for start, end in [(4_000, 5_000), (0, 10), (10, 2_000), (1_000, 1_001), (4_999, 5_000)]:
        hashes, tokens = plain.piece(1, start, end)
        assert hashes == long_tokens.block_hashes[start:end]
        assert list(tokens) == long_tokens.token_ids[start * 16:end * 16]
    options = dataclasses.replace(TEST_OPTIONS, slice_blocks=10**6, chunk_events=10**6,
                                  max_blocks_per_event=10**6)
    pure = PrefixIndex(compiled=False)
    for twin in (index, pure):
        twin.apply_stored(WORKERS[0], [1], None, [5], 1)  # known: runs apply to it
    for event in decoded:
        apply_event(pure, WORKERS[0], event)
    run = index.apply_run(WORKERS[0], plain, 0, 10**7, 10**7, RunLimits(
        BlockStored, BlockRemoved, 10**6, 10**7, 10**7))
    assert run.next == 0 and run.blocks == 0  # a run does not take it

    async def scenario() -> None:
        outcome = await applier(index, WORKERS[0], options).apply(0, payload)
        assert outcome.failed is None and outcome.events == 3
        assert outcome.blocks == 70_000 + 5_000 + 70_000

    run_async(scenario)
    assert layout(index) == layout(pure)


def test_a_big_payload_is_read_on_another_thread_while_the_loop_runs() -> None:
    """A payload over ``_DECODE_WHOLE_BYTES`` is read off the loop: here the reading waits
    for a task of the loop's to see it has begun, which it could never do if the reading
    held the loop's thread. The batch is then applied from that reading, in order."""
    store = BlockStored(block_hashes=[2**63 + b for b in range(20_000)],
                        token_ids=[b % 50_000 for b in range(20_000 * 16)], block_size=16)
    payload = encode_batch([store], ts=1.0)
    assert len(payload) > batch_apply._DECODE_WHOLE_BYTES
    index = PrefixIndex(compiled=True)
    options = dataclasses.replace(TEST_OPTIONS, max_blocks_per_event=10**6,
                                  max_blocks_per_worker=10**6)
    reading_began, loop_saw_it = threading.Event(), threading.Event()
    read_on: list[int] = []
    read = index.read_plain_batch

    def waiting_read(data: Any) -> Any:
        read_on.append(threading.get_ident())
        reading_began.set()
        if not loop_saw_it.wait(30):
            raise AssertionError("the loop did not run while the payload was read")
        return read(data)

    async def watch() -> None:
        for _ in range(3000):  # 30 s at most
            if reading_began.is_set():
                loop_saw_it.set()
                return
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        taker = applier(index, WORKERS[0], options)
        taker._read_plain = waiting_read
        watcher = asyncio.create_task(watch())
        outcome = await taker.apply(0, payload)
        await watcher
        assert read_on and read_on[0] != threading.get_ident()
        assert outcome.failed is None and outcome.garbage is None
        assert (outcome.events, outcome.blocks) == (1, 20_000)

    run_async(scenario)
    assert index.blocks_held(WORKERS[0]) == 20_000
