"""Events shaped as vLLM 0.33.0 sends them, made with structs of this test's own that mirror
the field lists vLLM 0.33.0 publishes (``vllm/distributed/kv_events.py``: ``BlockStored`` gains
``lookahead_token_ids``), map-encoded as vLLM encodes them, every field set. No CPU build of
vLLM 0.33 runs here: these stand in for its traffic."""

from __future__ import annotations

import msgspec
import pytest

from kvroute.app.ingest.wire import BlockRemoved, BlockStored, apply_batch, decode_batch
from kvroute.index import PrefixIndex

pytestmark = pytest.mark.usefixtures("index_implementation")

W = ("w", 0)
BS = 4


class V033BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type",
                      omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[list | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class V033BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type",
                       omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class V033Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[V033BlockStored | V033BlockRemoved]
    data_parallel_rank: int | None = None


PROMPT = list(range(1, 20))  # four blocks of 4 with two tokens after them: 18 tokens


def stored(hashes, *, locality="LOCAL", salt="tenant-a", **more) -> V033BlockStored:
    return V033BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=PROMPT[:4 * BS],
        block_size=BS, lora_id=None, medium="GPU", extra_keys=[[salt], None, None, None],
        group_idx=0, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
        locality=locality, ownership="gpu", session_id="request-1",
        lookahead_token_ids=[PROMPT[(k + 1) * BS:(k + 1) * BS + 2] for k in range(4)], **more)


def payload(*events) -> bytes:
    return msgspec.msgpack.encode(V033Batch(1.0, list(events), 0))


def test_a_vllm_033_store_with_every_field_is_decoded_and_applied_exactly():
    batch = decode_batch(payload(stored([11, 12, 13, 14])))
    (event,) = batch.events
    assert (batch.malformed, batch.unknown) == (0, 0) and isinstance(event, BlockStored)
    assert event.lookahead_token_ids == [[5, 6], [9, 10], [13, 14], [17, 18]]
    assert (event.locality, event.ownership, event.session_id) == ("LOCAL", "gpu", "request-1")
    assert PrefixIndex(compiled=True).read_plain_batch(payload(stored([1]))) is None
    index = PrefixIndex()
    apply_batch(index, W, batch)

    def blocks(tokens, **query) -> int:
        return index.match(tokens[:-1], following=tokens[-1:], **query)[W].blocks

    assert blocks(PROMPT, cache_salt="tenant-a") == 4
    assert blocks(PROMPT[:17], cache_salt="tenant-a") == 3  # block 3's lookahead is cut
    assert blocks(PROMPT) == 0 and blocks(PROMPT, cache_salt="tenant-b") == 0


def test_a_remote_copy_in_vllm_033_shape_is_never_the_workers_own():
    index = PrefixIndex()
    apply_batch(index, W, decode_batch(payload(stored([11, 12, 13, 14], locality="REMOTE"))))
    assert index.blocks_held(W) == 0
    apply_batch(index, W, decode_batch(payload(
        stored([11, 12, 13, 14]),
        V033BlockRemoved(block_hashes=[14], medium="GPU", group_idx=0, locality="REMOTE",
                         ownership="cpu"))))
    assert index.blocks_held(W) == 4  # the remote copy's removal left the worker's own
    apply_batch(index, W, decode_batch(payload(
        V033BlockRemoved(block_hashes=[14], medium="GPU", group_idx=0, locality="LOCAL"))))
    assert index.blocks_held(W) == 3
    assert isinstance(decode_batch(payload(V033BlockRemoved([1], "GPU"))).events[0],
                      BlockRemoved)
