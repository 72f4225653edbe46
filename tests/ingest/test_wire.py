"""app.ingest.wire against real vLLM 0.32.0 traffic, hand-built frames of the older array encoding,
and property tests (round trips in both encodings; garbage never raises anything but
WireError and never costs the well-formed events of a batch)."""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    apply_batch,
    apply_event,
    coalesced,
    decode_batch,
    decode_replay_frame,
    decode_seq,
    encode_batch,
    encode_seq,
    lora_key,
)
from kvroute.index import PrefixIndex
from tests.support.fixtures import session_frames
from tests.support.plain_events import decoded_for_runs

pack = msgspec.msgpack.encode


def comparable(event: Any) -> tuple[str, dict[str, Any]]:
    """Events compare across encodings by their public class and field values."""
    for cls in (BlockStored, BlockRemoved, AllBlocksCleared):
        if isinstance(event, cls):
            return cls.__name__, msgspec.structs.asdict(event)
    raise AssertionError(f"not an event: {event!r}")


class Recorder:
    """Records what apply_batch hands the index."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def apply_stored(self, worker, block_hashes, parent, token_ids, block_size, **kw):
        self.calls.append(("stored", worker, list(block_hashes), parent, list(token_ids),
                           block_size, kw))

    def apply_removed(self, worker, block_hashes, **kw):
        self.calls.append(("removed", worker, list(block_hashes), kw))

    def clear_worker(self, worker):
        self.calls.append(("cleared", worker))


# --- real vLLM 0.32.0 traffic ---------------------------------------------------------------


def test_every_captured_frame_decodes_cleanly():
    session = session_frames()
    live = [frames for kind, frames in session if kind == "live"]
    replay = [frames for kind, frames in session if kind == "replay"]
    assert len(live) == 20 and len(replay) == 21
    kinds: Counter[str] = Counter()
    big_hashes = 0
    for seq, (topic, seq_frame, payload) in enumerate(live):
        assert topic == b"kv-events" and decode_seq(seq_frame) == seq
        batch = decode_batch(payload)
        assert batch.malformed == 0 and batch.unknown == 0
        assert batch.data_parallel_rank == 0 and batch.ts > 1.7e9
        # Independent reading of the same bytes: every event came through, in order.
        untyped = msgspec.msgpack.decode(payload)[1]
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in untyped]
        assert batch.events
        for event in batch.events:
            kinds[type(event).__name__] += 1
            if isinstance(event, BlockStored | BlockRemoved):
                assert all(type(h) is int and 0 <= h < 2**64 for h in event.block_hashes)
                big_hashes += sum(h >= 2**63 for h in event.block_hashes)
            if isinstance(event, BlockStored):
                assert event.block_size == 32 and event.medium == "GPU"
                assert len(event.token_ids) == 32 * len(event.block_hashes)
                assert event.kv_cache_spec_kind == "full_attention"
                assert event.extra_keys == [None] * len(event.block_hashes)
    assert set(kinds) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert big_hashes > 0
    # The replay of the same session: the same payloads, then the 0.32.0 end marker.
    replies = [decode_replay_frame(frames) for frames in replay]
    assert [r.seq for r in replies] == [*range(20), None]
    assert [r.payload for r in replies[:-1]] == [frames[2] for frames in live]


def test_captured_session_applied_to_the_index_holds_what_the_engine_held():
    """Brute-force model: the engine holds each hash stored and not yet removed since the
    last AllBlocksCleared. The index must hold exactly those, and match the final prompt."""
    session = session_frames()
    index = PrefixIndex()
    worker = ("vllm-cpu", 0)
    held: Counter[int] = Counter()
    last_store: BlockStored | None = None
    for kind, frames in session:
        if kind != "live":
            continue
        batch = decode_batch(frames[2])
        applied = apply_batch(index, worker, batch)
        assert batch.malformed == 0
        assert applied == sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held.update(event.block_hashes)
                last_store = event
            else:
                held.subtract(event.block_hashes)
    still_held = {h for h, n in held.items() if n > 0}
    assert index.stats().holdings[worker]["GPU"] == len(still_held) == 3
    assert last_store is not None and last_store.parent_block_hash is None
    match = index.match(last_store.token_ids + [7] * 5)[worker]
    assert (match.blocks, match.tokens, match.block_size) == (3, 96, 32)


# --- the older array encoding, built by hand ------------------------------------------------


def test_array_events_in_a_two_element_batch_from_before_data_parallel_ranks():
    payload = pack([1_700_000_000.5, [
        ["BlockStored", [-5, 2**63 - 1], None, [1, 2, 3, 4], 2, None],
        ["BlockStored", [9], 2**63 - 1, [5, 6], 2, 3, "cpu"],
        ["BlockRemoved", [-5]],
        ["BlockRemoved", [9], "GPU"],
        ["AllBlocksCleared"],
    ]])
    batch = decode_batch(payload)
    assert (batch.ts, batch.data_parallel_rank, batch.malformed, batch.unknown) == (
        1_700_000_000.5, None, 0, 0)
    first, second, removed, removed_gpu, cleared = batch.events
    assert isinstance(first, BlockStored) and first.block_hashes == [-5, 2**63 - 1]
    assert first.parent_block_hash is None and first.medium is None and first.lora_id is None
    assert second.parent_block_hash == 2**63 - 1 and second.lora_id == 3
    assert second.medium == "cpu"
    assert isinstance(removed, BlockRemoved) and removed.medium is None
    assert removed_gpu.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)

    recorder = Recorder()
    assert apply_batch(recorder, "w", batch) == 5
    assert recorder.calls[1][6]["medium"] == "CPU"  # lowercase normalised
    assert recorder.calls[1][6]["lora_name"] == "lora-id:3"
    assert recorder.calls[2][3]["medium"] == "GPU"  # None means GPU
    assert recorder.calls[4] == ("cleared", "w")


def test_array_events_with_bytes_hashes_rank_and_trailing_fields_we_do_not_know():
    h16, h32 = bytes(range(16)), bytes(range(32))
    payload = pack([2.0, [
        ["BlockStored", [h16, h32], None, [1, 2], 1, None, "GPU", "adapter", [None, ["mm", 3]],
         1, "full_attention", None, "future-field", {"x": 1}],
        ["BlockRemoved", [h16], "GPU", 1, "future"],
        ["AllBlocksCleared", "future"],
        ["KVCacheResized", 1, 2],
    ], 3, "future-envelope-field"])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 3 and batch.unknown == 1 and batch.malformed == 0
    stored, removed, _ = batch.events
    assert stored.block_hashes == [h16, h32] and stored.lora_name == "adapter"
    assert stored.extra_keys == [None, ("mm", 3)] and stored.group_idx == 1
    assert removed.group_idx == 1
    assert lora_key(stored) == "adapter"


def test_map_events_skip_unknown_fields_and_types_and_count_bad_ones():
    payload = pack([3.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1], "block_size": 1, "brand_new_field": [1, 2, {"a": None}]},
        {"type": "BlockStored", "block_hashes": [2], "token_ids": ["x"], "block_size": 1},
        {"type": "BlockRemoved", "block_hashes": [1.5]},  # a float is no block hash
        {"type": "NewEventKind", "anything": 1},
        {"no_type": True},
        17,
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "storage", "group_idx": None},
    ], 0])
    batch = decode_batch(payload)
    assert (batch.malformed, batch.unknown) == (4, 1)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    recorder = Recorder()
    apply_batch(recorder, "w", batch)
    assert recorder.calls[1][3] == {"medium": "STORAGE", "group_idx": 0, "locality": None}


@pytest.mark.parametrize("raw_tokens", [False, True])
def test_a_string_that_is_not_utf8_costs_only_its_event(raw_tokens: bool) -> None:
    """msgspec decodes an ``Any`` field such as ``locality`` whatever it holds: a string in
    it that is not UTF-8 makes that event malformed (it raised UnicodeDecodeError out of
    decode_batch, past the applier's handling of bad payloads), and a value nested past
    msgspec's limit makes the payload undecodable."""
    store = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}
    payload = pack([3.0, [{**store, "locality": "x"}, store], 0]).replace(b"\xa1x", b"\xa1\x80")
    decode = decoded_for_runs if raw_tokens else decode_batch
    batch = decode(payload)
    assert batch.malformed == 1 and len(batch.events) == 1
    nested = pack([3.0, [{**store, "locality": None}], 0]).replace(
        b"\xa8locality\xc0", b"\xa8locality" + b"\x91" * 5000 + b"\xc0")
    with pytest.raises(WireError):
        decode(nested)


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",
    pack(5),
    pack([1.0]),
    pack(["yesterday", []]),
    pack([1.0, "not a list"]),
    pack([1.0, [], 0]) + b"\x00",
    pack([1.0, [{"type": "AllBlocksCleared"}], 0])[:-1],
    pack({"ts": 1.0}),
])
def test_payloads_that_are_not_a_batch_raise_wire_error(payload):
    with pytest.raises(WireError, match="undecodable event batch"):
        decode_batch(payload)


def test_a_map_shaped_envelope_is_accepted():
    batch = decode_batch(pack({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}],
                               "data_parallel_rank": 2}))
    assert batch.data_parallel_rank == 2 and isinstance(batch.events[0], AllBlocksCleared)


def test_a_garbled_rank_is_counted_and_dropped_but_events_still_decode():
    batch = decode_batch(pack([1.0, [["AllBlocksCleared"]], "zero"]))
    assert batch.data_parallel_rank is None and batch.malformed == 1 and len(batch.events) == 1


def test_an_event_the_index_rejects_is_counted_and_the_rest_of_the_batch_applies():
    index = PrefixIndex()
    batch = EventBatch(0.0, [
        BlockStored(block_hashes=[1, 2], token_ids=[1, 2, 3], block_size=2),  # 3 != 2*2
        BlockStored(block_hashes=[3], token_ids=[1, 2], block_size=2),
    ])
    assert apply_batch(index, "w", batch) == 1
    assert batch.malformed == 1
    assert index.match([1, 2])["w"].blocks == 1


def test_blocks_of_an_old_numeric_lora_never_match_base_model_queries():
    index = PrefixIndex()
    lora = EventBatch(0.0, [BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=2,
                                        lora_id=4)])
    apply_batch(index, "w", lora)
    assert index.match([1, 2])["w"].blocks == 0
    assert index.match([1, 2], lora_name="lora-id:4")["w"].blocks == 1


# --- frames ---------------------------------------------------------------------------------


def test_seq_frames_and_both_replay_reply_formats():
    assert decode_seq(encode_seq(2**63 + 5)) == 2**63 + 5
    for bad in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(WireError, match="8 bytes"):
            decode_seq(bad)
    new = decode_replay_frame([b"", b"kv-events", encode_seq(7), b"payload"])
    old = decode_replay_frame([b"", encode_seq(7), b"payload"])
    assert (new.seq, new.payload) == (old.seq, old.payload) == (7, b"payload")
    assert decode_replay_frame([b"", b"", END_SEQ, b""]).seq is None
    assert decode_replay_frame([b"", END_SEQ, b""]).seq is None
    for bad in ([b"", b"x"], [b"x", encode_seq(1), b"p"], [b"", b"t", b"\x01", b"p"]):
        with pytest.raises(WireError):
            decode_replay_frame(bad)


def test_encode_batch_rejects_an_unknown_encoding():
    with pytest.raises(ValueError, match="unknown encoding"):
        encode_batch([], encoding="json")  # type: ignore[arg-type]


def test_array_encoding_writes_what_an_older_vllm_wrote():
    payload = encode_batch([BlockStored(block_hashes=[1], token_ids=[1], block_size=1),
                            BlockRemoved(block_hashes=[1]), AllBlocksCleared()],
                           ts=1.0, encoding="array")
    assert msgspec.msgpack.decode(payload) == [1.0, [
        ["BlockStored", [1], None, [1], 1, None, None],
        ["BlockRemoved", [1], None],
        ["AllBlocksCleared"],
    ]]


# --- properties -----------------------------------------------------------------------------

hashes = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=32, max_size=32),
)
maybe = st.none
extra_key = st.one_of(st.none(), st.tuples(st.text(max_size=5), st.integers(0, 10**6)))


@st.composite
def stored_events(draw) -> BlockStored:
    n = draw(st.integers(0, 4))
    block_size = draw(st.integers(0, 4))
    return BlockStored(
        block_hashes=draw(st.lists(hashes, min_size=n, max_size=n)),
        parent_block_hash=draw(st.one_of(maybe(), hashes)),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=n * block_size)),
        block_size=block_size,
        lora_id=draw(st.one_of(maybe(), st.integers(0, 100))),
        medium=draw(st.sampled_from([None, "GPU", "CPU", "STORAGE", "cpu"])),
        lora_name=draw(st.one_of(maybe(), st.text(max_size=8))),
        extra_keys=draw(st.one_of(maybe(), st.lists(extra_key, min_size=n, max_size=n))),
        group_idx=draw(st.one_of(maybe(), st.integers(0, 3))),
        kv_cache_spec_kind=draw(st.sampled_from(
            [None, "full_attention", "mla_attention", "sliding_window"])),
        kv_cache_spec_sliding_window=draw(st.one_of(maybe(), st.integers(1, 4096))),
        session_id=draw(st.one_of(maybe(), st.text(max_size=4))),
    )


removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.one_of(maybe(), st.integers(0, 3)),
)
events = st.one_of(stored_events(), removed_events, st.just(AllBlocksCleared()))
finite_ts = st.floats(allow_nan=False, allow_infinity=False)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(events, max_size=6), finite_ts, st.one_of(st.none(), st.integers(0, 64)),
       st.sampled_from(["map", "array"]))
def test_round_trip_in_both_encodings(evs, ts, rank, encoding):
    batch = decode_batch(encode_batch(evs, ts=ts, dp_rank=rank, encoding=encoding))
    assert (batch.malformed, batch.unknown, batch.data_parallel_rank) == (0, 0, rank)
    assert batch.ts == ts or (math.isnan(ts) and math.isnan(batch.ts))
    assert [comparable(e) for e in batch.events] == [comparable(e) for e in evs]


@given(st.binary(max_size=200))
def test_random_bytes_raise_only_wire_error(data):
    try:
        batch = decode_batch(data)
    except WireError:
        return
    assert all(isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared)
               for e in batch.events)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(events, min_size=1, max_size=4), st.sampled_from(["map", "array"]), st.data())
def test_truncated_msgpack_raises_wire_error(evs, encoding, data):
    payload = encode_batch(evs, ts=1.0, dp_rank=0, encoding=encoding)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(WireError):
        decode_batch(payload[:cut])


plain = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), finite_ts,
              st.text(max_size=6), st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
known_tag_objects = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved"])},
                          optional={"block_hashes": plain, "token_ids": plain,
                                    "block_size": plain, "medium": plain}),
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved"]), plain, plain).map(list),
)
garbage_events = st.one_of(plain, known_tag_objects)


def _is_valid_event(obj: Any) -> bool:
    try:
        return bool(decode_batch(pack([0.0, [obj]])).events)
    except WireError:
        return False


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(events, max_size=5), st.lists(garbage_events, min_size=1, max_size=5),
       st.sampled_from(["map", "array"]), st.randoms(use_true_random=False))
def test_bad_events_cost_only_themselves_and_never_reach_the_index(good, bad, encoding, rnd):
    for obj in bad:
        assume(not _is_valid_event(obj))
    good_objs = msgspec.msgpack.decode(encode_batch(good, ts=0.0, encoding=encoding))[1]
    mixed: list[Any] = list(good_objs)
    for obj in bad:  # anywhere, keeping the good events' order
        mixed.insert(rnd.randint(0, len(mixed)), obj)
    batch = decode_batch(pack([5.0, mixed, 1]))
    assert batch.malformed + batch.unknown == len(bad)
    assert [comparable(e) for e in batch.events] == [comparable(e) for e in good]
    # What the index sees is exactly the good events, in order.
    seen, expected = Recorder(), Recorder()
    apply_batch(seen, "w", batch)
    apply_batch(expected, "w", EventBatch(0.0, list(good)))
    assert seen.calls == expected.calls


@settings(max_examples=60, deadline=None)
@given(st.lists(plain, max_size=4), st.one_of(plain, st.lists(plain, max_size=3)))
def test_wrong_types_anywhere_in_the_envelope_never_raise_anything_but_wire_error(head, tail):
    index = PrefixIndex()
    for shape in ([*head, tail], {"ts": tail, "events": head}, [1.0, [tail, *head]]):
        try:
            batch = decode_batch(pack(shape))
        except WireError:
            continue
        apply_batch(index, "w", batch)  # the index gets only well-typed events


def test_events_are_grouped_by_class_whatever_the_encoding():
    both = defaultdict(list)
    for encoding in ("map", "array"):
        batch = decode_batch(encode_batch([AllBlocksCleared()], encoding=encoding))
        both[encoding] = [comparable(e) for e in batch.events]
    assert both["map"] == both["array"] == [("AllBlocksCleared", {})]


chain_tokens = list(range(100, 116))  # 8 blocks of 2 tokens
chain_events = st.one_of(
    st.builds(lambda n, medium: BlockStored(block_hashes=list(range(1, n + 1)),
                                            token_ids=chain_tokens[:2 * n], block_size=2,
                                            medium=medium),
              st.integers(1, 8), st.sampled_from([None, "CPU"])),
    st.builds(lambda h, medium, group: BlockRemoved(block_hashes=[h], medium=medium,
                                                    group_idx=group),
              st.integers(1, 9), st.sampled_from([None, "GPU", "CPU"]),
              st.sampled_from([None, 0])),
    st.just(AllBlocksCleared()),
)


@settings(deadline=None, max_examples=300)
@given(st.lists(chain_events, max_size=25))
def test_coalesced_removals_change_the_index_exactly_as_one_by_one(evs):
    one_by_one, merged = PrefixIndex(), PrefixIndex()
    for event in evs:
        apply_event(one_by_one, "w", event)
    assert apply_batch(merged, "w", EventBatch(ts=0.0, events=list(evs))) == sum(
        len(getattr(e, "block_hashes", ())) for e in evs)
    assert one_by_one.stats() == merged.stats()
    assert one_by_one.match(chain_tokens) == merged.match(chain_tokens)
    removals = [e for e in coalesced(evs) if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removals) == sum(
        len(e.block_hashes) for e in evs if isinstance(e, BlockRemoved))
    # Runs are merged: no two removals of one medium and group stand next to each other.
    out = list(coalesced(evs))
    for before, after in itertools.pairwise(out):
        assert not (isinstance(before, BlockRemoved) and isinstance(after, BlockRemoved)
                    and (before.medium, before.group_idx) == (after.medium, after.group_idx))
