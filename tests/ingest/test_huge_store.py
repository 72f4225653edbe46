"""One huge BlockStored decoded and applied a slice at a time (app.ingest.huge_store).

Without sockets: over random histories and events (both encodings, malformed ones among
them), the huge-store path, with its fallback to the ordinary decode, leaves a PrefixIndex
exactly as the event decoded and applied whole. Through real ZMQ sockets: a store over
``HUGE_EVENT_BYTES`` is applied with the loop running between slices, routes asked
meanwhile see a growing prefix of its chain (never a block it does not hold), and the
index ends exactly as the whole event leaves it. Nothing here measures time.
"""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.huge_store import HUGE_EVENT_BYTES, HugeStore
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import BlockStored, apply_event, decode_events, encode_batch
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import TEST_OPTIONS, Ledger, Running, endpoint_of, run
from tests.support.hostile import (
    WORKER,
    LoopWatchingIndex,
    chain,
    events,
    outcome,
    settled,
    snapshot,
    stores,
    truth_of,
)
from tests.support.waiting import wait_until


def raw_event(event: BlockStored, encoding: str) -> msgspec.Raw:
    """``event`` encoded alone, as it sits inside a vLLM payload."""
    payload = encode_batch([event], ts=0.0, encoding=encoding)  # type: ignore[arg-type]
    envelope = msgspec.msgpack.decode(payload, type=tuple[float, list[msgspec.Raw]])
    return envelope[1][0]


def apply_lazily(index: PrefixIndex, raw: msgspec.Raw, max_blocks: int) -> None:
    """What BatchApplier does with an event over HUGE_EVENT_BYTES, without the loop."""
    store = HugeStore.open(raw, max_blocks)
    if store is not None and store.valid:
        for _ in store.decode_steps():
            pass
    if store is None or not store.valid:  # the ordinary way, as the applier falls back
        for event in decode_events([raw], _batch()):
            apply_event(index, WORKER, event)
        return
    for piece in store.slices(lambda h: index.holds_hash(WORKER, h)):
        apply_event(index, WORKER, piece)


def _batch():  # a scratch EventBatch for decode_events' counters
    from kvroute.app.ingest.wire import EventBatch
    return EventBatch(0.0, [])


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(history=st.lists(events, max_size=10), event=stores(), max_blocks=st.integers(1, 5),
       encoding=st.sampled_from(["map", "array"]))
def test_a_store_decoded_and_applied_a_slice_at_a_time_leaves_the_index_as_one_call(
        history, event, max_blocks, encoding):
    whole, sliced = PrefixIndex(), PrefixIndex()
    for index in (whole, sliced):
        for earlier in history:
            outcome(lambda index=index, earlier=earlier: apply_event(index, WORKER, earlier))
    raw = raw_event(event, encoding)
    decoded = decode_events([raw], _batch())

    def in_one_call() -> None:
        for e in decoded:
            apply_event(whole, WORKER, e)

    assert outcome(lambda: apply_lazily(sliced, raw, max_blocks)) == outcome(in_one_call)
    assert snapshot(sliced) == snapshot(whole)
    sliced._check()


def test_slices_carry_every_field_and_chain_through_the_previous_slice():
    event = chain(1, 10, parent=99, block_size=4, medium="CPU", lora_name="x", group_idx=1)
    store = HugeStore.open(raw_event(event, "map"), 4)
    assert store is not None and store.valid and store.blocks == 10
    assert len(list(store.decode_steps())) == 3
    pieces = list(store.slices(lambda h: True))
    assert [p.block_hashes for p in pieces] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [p.parent_block_hash for p in pieces] == [99, 4, 8]
    assert [t for p in pieces for t in p.token_ids] == event.token_ids
    assert {(p.medium, p.lora_name, p.group_idx, p.block_size) for p in pieces} == {
        ("CPU", "x", 1, 4)}
    # The worker does not hold the parent: every slice names it, all orphaned like the whole.
    orphan = HugeStore.open(raw_event(event, "array"), 4)
    assert orphan is not None
    list(orphan.decode_steps())
    assert [p.parent_block_hash for p in orphan.slices(lambda h: False)] == [99, 99, 99]


def test_the_lists_are_read_a_piece_at_a_time_across_the_reads():
    """The unpacker reads a list's encoding as it needs it (``_READ_BYTES`` at a time), so
    a step's elements straddle the reads: every hash and token id arrives, in order."""
    blocks = 9_000  # 144,000 token ids of 5 bytes: eleven reads of the token ids
    event = chain(1, blocks, block_size=16)
    event = msgspec.structs.replace(event, token_ids=[2**32 - 1 - t for t in event.token_ids])
    store = HugeStore.open(raw_event(event, "array"), 1000)
    assert store is not None and store.valid
    assert len(list(store.decode_steps())) == 9 and store.valid
    pieces = list(store.slices(lambda h: True))
    assert [h for p in pieces for h in p.block_hashes] == event.block_hashes
    assert [t for p in pieces for t in p.token_ids] == event.token_ids


@pytest.mark.parametrize("broken", [
    {"token_ids": [1, 2, 3]},                 # does not fill its blocks
    {"token_ids": [-1] + [0] * 39},           # the index refuses it whole
    {"token_ids": [2**32] + [0] * 39},
    {"extra_keys": [None] * 10},              # extra keys: the ordinary way
])
def test_what_the_ordinary_way_must_judge_is_not_taken(broken):
    event = msgspec.structs.replace(chain(1, 10, block_size=4), **broken)
    store = HugeStore.open(raw_event(event, "map"), 4)
    assert store is not None
    list(store.decode_steps())
    assert not store.valid
    garbage = msgspec.msgpack.encode({"type": "BlockStored", "block_hashes": [1, 2.5]})
    store = HugeStore.open(msgspec.Raw(garbage), 4)
    assert store is None or (list(store.decode_steps()) is not None and not store.valid)
    assert HugeStore.open(msgspec.Raw(msgspec.msgpack.encode({"type": "BlockRemoved",
                                                              "block_hashes": [1]})), 4) is None


class RouteWatchingIndex(LoopWatchingIndex):
    """Also asks, at every turn of the loop in which the worker's holding changed, how much
    of ``prompt`` a route sees it hold. (Asked at every turn, the match of the whole prompt,
    milliseconds of work, made most turns of the loop the watcher's own.)"""

    def __init__(self, prompt: list[int], block_size: int) -> None:
        super().__init__()
        self.prompt = prompt
        self.block_size = block_size
        self.answers: list[int] = []

    async def count_turns(self, stop: asyncio.Event) -> None:
        held = None
        while not stop.is_set():
            self.turns += 1
            if self.blocks_held(WORKER) != held:
                held = self.blocks_held(WORKER)
                match = self.match(self.prompt).get(WORKER)
                self.answers.append(0 if match is None else match.blocks)
            await asyncio.sleep(0)


@pytest.mark.parametrize("plain", [True, False], ids=["read", "decoded"])
def test_a_huge_store_over_the_wire_is_applied_a_slice_at_a_time_while_routes_are_answered(
        plain: bool):
    """A store whose encoded event is over HUGE_EVENT_BYTES: no turn of the loop does more
    than slice_blocks blocks of its work; routes asked at every turn see the worker hold
    a prefix of it that only grows, strictly between nothing and all of it at times; and
    the index ends exactly as the whole event leaves it.

    ``read``: a plain store, which the compiled index reads (``read_plain_batch``) and the
    applier rebuilds a slice at a time (``app.ingest.plain_slices``). ``decoded``: the same store
    with a session id, which the index does not read: it goes through ``HugeStore``."""
    slice_blocks = 512
    blocks = HUGE_EVENT_BYTES // 40 + 1_000  # a 16-token block encodes to over 40 bytes
    huge = chain(1, blocks, block_size=16, seed=3)
    if not plain:
        huge = msgspec.structs.replace(huge, session_id="request-7")
    assert len(raw_event(huge, "map")) > HUGE_EVENT_BYTES
    for encoding in ("map", "array"):
        payload = encode_batch([huge], ts=0.0, encoding=encoding)
        assert (PrefixIndex(compiled=True).read_plain_batch(payload) is not None) is plain

    async def scenario(ctx):
        options = dataclasses.replace(TEST_OPTIONS, slice_blocks=slice_blocks,
                                      max_blocks_per_event=2 * blocks)
        stop = asyncio.Event()
        index = RouteWatchingIndex([*huge.token_ids, 0], 16)
        watching: asyncio.Task[None] | None = None
        try:
            with EventPublisher() as pub:
                ledger = Ledger(pub)
                sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
                async with Running(sub):
                    await wait_until(lambda: sub.status.state == "live", "connection")
                    # Watched from here: a match of the whole prompt at every turn of the
                    # loop is milliseconds of work, which slowed the connection's replay
                    # past its deadline on a busy machine.
                    watching = asyncio.create_task(index.count_turns(stop))
                    ledger.publish([chain(900_000, 2, block_size=16)])
                    ledger.publish([huge])
                    ledger.publish([chain(blocks + 1, 2, parent=blocks, block_size=16)])
                    await settled(sub, ledger, ("live",), "the huge store")
        finally:
            stop.set()
            if watching is not None:
                await watching
        assert snapshot(index) == snapshot(truth_of(ledger))
        assert index.blocks_held(WORKER) == blocks + 4
        assert 0 < index.most_between_turns <= slice_blocks
        answers = index.answers
        assert answers == sorted(answers) and answers[-1] == blocks
        assert any(0 < n < blocks for n in answers)  # answered while the store was applied
        assert sub.status.malformed == 0 and sub.status.oversized_events == 0
    run(scenario)
