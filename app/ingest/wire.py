"""Decoding and encoding of vLLM's KV-event wire format.

Facts this module relies on (docs/wire-protocol.md):

- A payload is a msgpack array ``[ts, events]`` or ``[ts, events, data_parallel_rank]``
  (a map ``{"ts", "events", "data_parallel_rank"}`` is accepted too).
- Events are msgpack maps tagged by ``"type"`` (vLLM >= ~0.26) or arrays with the tag first
  (older vLLM). Field order of the array form is the declaration order of the fields below,
  which is also the order vLLM added them in.
- Block hashes are unsigned 64-bit ints (values >= 2**63 occur), signed ints (older vLLM) or
  raw bytes.

Invariants:

- ``decode_batch`` raises ``WireError`` only when the payload as a whole is unusable (not
  msgpack, not an envelope, no event list). One bad event never costs the others: it is
  counted in ``EventBatch.malformed`` and left out; unknown event types are counted in
  ``EventBatch.unknown`` and left out; unknown fields are ignored. ``decode_envelope`` and
  then ``decode_events`` over consecutive slices of its events give the same events and
  counts, a slice at a time.
- Decoded events are always instances of the public ``BlockStored``, ``BlockRemoved`` and
  ``AllBlocksCleared`` classes, whichever encoding they came in.
- ``apply_batch`` applies each event to the index on its own; an event the index rejects
  (``ValueError``) is counted as malformed and the rest of the batch still applies.
- ``slices`` cuts an event into consecutive events that change an index exactly as the whole
  event would (see there); it never copies an event that fits in one slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, Protocol

import msgspec

Hash = int | bytes
Encoding = Literal["map", "array"]
#: A message's frame as received: bytes, or a big one read in place (app.ingest.sockets).
Payload = bytes | memoryview

#: The 8-byte seq frame vLLM's replay ROUTER sends after the last buffered batch.
END_SEQ = b"\xff" * 8
SEQ_BYTES = 8

MEDIUM_GPU = "GPU"


class WireError(ValueError):
    """A payload or frame that cannot be decoded at all."""


# --- events ---------------------------------------------------------------------------------
# gc=False: events hold only ints, strings, bytes and lists of them, never cycles; this keeps
# the garbage collector out of the hot path. omit_defaults keeps encoded maps as small as
# vLLM's own.


class BlockStored(
    msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False
):
    """A chain of blocks: block k holds ``token_ids[k*block_size:(k+1)*block_size]``."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    # vLLM 0.33: per block, the tokens after it that its hash covers too (speculative
    # decoding with block drop); none without lookahead.
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(
    msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True, gc=False
):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(
    msgspec.Struct, tag_field="type", tag="AllBlocksCleared", omit_defaults=True, gc=False
):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


# The older array encoding: same fields, same order, tag first. Subclasses, so a decoded
# event is an instance of the public class whatever its encoding.
class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class RawStored(
    msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False
):
    """A ``BlockStored`` as ``decode_events(..., raw_tokens=True)`` leaves it: the token ids
    still msgpack (``msgspec.Raw``), for the index to read straight into its keys without
    an int object per token (``index.runs``). ``stored(event)`` makes the public event.
    Fields as ``BlockStored``'s, in the same order."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty msgpack array
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: list[list[int]] | None = None


_token_list = msgspec.msgpack.Decoder(list[int])


def stored(event: RawStored) -> BlockStored | None:
    """The ``BlockStored`` ``decode_batch`` would have made of ``event``; None when its
    token ids are not a list of ints (``decode_batch`` counts such an event malformed)."""
    try:
        tokens = _token_list.decode(event.token_ids)
    except _DECODE_ERRORS:
        return None
    fields = msgspec.structs.asdict(event)
    fields["token_ids"] = tokens
    return BlockStored(**fields)


# Fields vLLM always wrote in the array form (no defaults there); later fields are written
# only up to the last one that is set, as an older vLLM would have.
_ARRAY_REQUIRED = {BlockStored: 6, BlockRemoved: 2, AllBlocksCleared: 0}
KNOWN_EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class EventBatch(msgspec.Struct):
    """One decoded payload. ``malformed`` and ``unknown`` count events left out."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None
    malformed: int = 0
    unknown: int = 0


# --- decoders -------------------------------------------------------------------------------
# Fast path: the whole batch in one typed decode (one C call). Mixed array/map tagged unions
# are not allowed by msgspec, so there is one decoder per event encoding. When both fail
# (a bad or unknown event somewhere), the slow path decodes event by event.


class _MapEnvelope(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayEnvelope(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class _RawEnvelope(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


class _RawMapEnvelope(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


_map_batch = msgspec.msgpack.Decoder(_MapEnvelope)
_array_batch = msgspec.msgpack.Decoder(_ArrayEnvelope)
_raw_batch = msgspec.msgpack.Decoder(_RawEnvelope)
_raw_map_batch = msgspec.msgpack.Decoder(_RawMapEnvelope)
_map_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_array_event = msgspec.msgpack.Decoder(
    _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared
)
_map_events = msgspec.msgpack.Decoder(list[BlockStored | BlockRemoved | AllBlocksCleared])
_raw_tokens_events = msgspec.msgpack.Decoder(list[RawStored | BlockRemoved | AllBlocksCleared])
_array_events = msgspec.msgpack.Decoder(
    list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
)
_any = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()

# msgspec raises UnicodeDecodeError for a string that is not UTF-8 in a field it decodes
# (an ``Any`` field such as ``locality``), and RecursionError past its nesting limit.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                  RecursionError)


def decode_batch(payload: Payload) -> EventBatch:
    """Decode one payload frame; see the module docstring for what raises and what is counted."""
    for decoder in (_map_batch, _array_batch):
        try:
            env = decoder.decode(payload)
        except _DECODE_ERRORS:
            continue
        return EventBatch(env.ts, env.events, env.data_parallel_rank)  # type: ignore[arg-type]
    return _decode_event_by_event(payload)


def _decode_event_by_event(payload: Payload) -> EventBatch:
    batch = decode_envelope(payload)
    raws, batch.events = batch.events, []
    batch.events = _decode_each(raws, batch)
    return batch


def decode_envelope(payload: Payload) -> EventBatch:
    """A payload's envelope with its events left encoded: ``events`` holds one
    ``msgspec.Raw`` per event, for ``decode_events`` to decode a slice at a time (a big
    payload in one ``decode_batch`` call would hold the caller that long). Costs one pass
    over the bytes that builds no event. Raises ``WireError`` where ``decode_batch`` does;
    a garbled rank is counted in ``malformed``."""
    env: _RawEnvelope | _RawMapEnvelope | None = None
    error: Exception | None = None
    for decoder in (_raw_batch, _raw_map_batch):
        try:
            env = decoder.decode(payload)
            break
        except _DECODE_ERRORS as exc:
            error = error or exc  # the array envelope's complaint is the informative one
    if env is None:
        raise WireError(f"undecodable event batch ({len(payload)} bytes): {error}")
    rank = env.data_parallel_rank
    batch = EventBatch(env.ts, env.events, rank if type(rank) is int else None)
    if rank is not None and type(rank) is not int:
        batch.malformed += 1  # a garbled rank is a defect of the batch, not of its events
    return batch


def decode_events(raws: Sequence[msgspec.Raw], batch: EventBatch, *,
                  raw_tokens: bool = False) -> list[Event]:
    """Some of ``decode_envelope``'s raw events, decoded as ``decode_batch`` decodes them:
    malformed and unknown ones are counted in ``batch`` and left out. One C call when they
    all decode in one encoding; event by event otherwise. ``raw_tokens``: map-encoded
    stores keep their token ids encoded (``RawStored``, not checked to be ints: ``stored``
    says, where ``decode_batch`` would have counted the event malformed)."""
    joined = _array_header(len(raws)) + b"".join(raws)
    for decoder in ((_raw_tokens_events, _array_events) if raw_tokens
                    else (_map_events, _array_events)):
        try:
            return decoder.decode(joined)  # type: ignore[no-any-return]
        except _DECODE_ERRORS:
            continue
    return _decode_each(raws, batch)


def _array_header(length: int) -> bytes:
    """The msgpack header of an array of ``length`` elements."""
    if length < 16:
        return bytes((0x90 | length,))
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def _decode_each(raws: Iterable[msgspec.Raw], batch: EventBatch) -> list[Event]:
    events: list[Event] = []
    for raw in raws:
        event = _decode_one(raw)
        if event is not None:
            events.append(event)
        elif _is_unknown_type(raw):
            batch.unknown += 1
        else:
            batch.malformed += 1
    return events


def _decode_one(raw: msgspec.Raw) -> Event | None:
    for decoder in (_map_event, _array_event):
        try:
            return decoder.decode(raw)
        except _DECODE_ERRORS:
            continue
    return None


def _is_unknown_type(raw: msgspec.Raw) -> bool:
    """An event well-formed enough to name a type we do not know (a newer vLLM's event)."""
    try:
        obj = _any.decode(raw)
    except _DECODE_ERRORS:
        return False
    if isinstance(obj, dict):
        tag = obj.get("type")
    elif isinstance(obj, list) and obj:
        tag = obj[0]
    else:
        return False
    return isinstance(tag, str) and tag not in KNOWN_EVENT_TYPES


def encode_batch(
    events: Iterable[Event],
    *,
    ts: float | None = None,
    dp_rank: int | None = None,
    encoding: Encoding = "map",
) -> bytes:
    """Encode events as vLLM would: ``encoding="map"`` like 0.26+, ``"array"`` like older vLLM."""
    if encoding == "map":
        body: list[Any] = list(events)
    elif encoding == "array":
        body = [_as_array_event(ev) for ev in events]
    else:
        raise ValueError(f"unknown encoding {encoding!r}: expected 'map' or 'array'")
    envelope: list[Any] = [time.time() if ts is None else ts, body]
    if dp_rank is not None:
        envelope.append(dp_rank)
    return _encoder.encode(envelope)


def _as_array_event(event: Event) -> list[Any]:
    base = next(c for c in (BlockStored, BlockRemoved, AllBlocksCleared) if isinstance(event, c))
    fields = list(msgspec.structs.astuple(event))
    keep = _ARRAY_REQUIRED[base]
    for i in range(len(fields) - 1, keep - 1, -1):
        if fields[i] is not None:
            keep = i + 1
            break
    return [base.__struct_config__.tag, *fields[:keep]]


# --- frames ---------------------------------------------------------------------------------


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number frame."""
    if len(frame) != SEQ_BYTES:
        raise WireError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


class ReplayFrame(msgspec.Struct, frozen=True):
    """One reply from the replay ROUTER as a DEALER sees it; ``seq is None`` ends the replay."""

    seq: int | None
    payload: Payload


def decode_replay_frame(frames: Sequence[Payload]) -> ReplayFrame:
    """Understand both reply formats.

    0.32.0: ``[b"", topic, seq, payload]``, ended by ``[b"", b"", END_SEQ, b""]``;
    before mid-2026: ``[b"", seq, payload]``, ended by ``[b"", END_SEQ, b""]``.
    """
    if len(frames) == 4 and frames[0] == b"":
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq_frame, payload = frames[1], frames[2]
    else:
        raise WireError(f"unexpected replay reply with {len(frames)} frames")
    if seq_frame == END_SEQ:
        return ReplayFrame(None, b"")
    return ReplayFrame(decode_seq(seq_frame), payload)


# --- applying to the index ------------------------------------------------------------------


class IndexWriter(Protocol):
    def apply_stored(self, worker: Any, block_hashes: Any, parent_block_hash: Any,
                     token_ids: Any, block_size: int, **kwargs: Any) -> None: ...

    def apply_removed(self, worker: Any, block_hashes: Any, **kwargs: Any) -> None: ...

    def clear_worker(self, worker: Any) -> None: ...


def normalise_medium(medium: str | None) -> str:
    """None means GPU (vLLM's default); some connectors send lowercase names."""
    return MEDIUM_GPU if medium is None else medium.upper()


def lora_key(event: BlockStored) -> str | None:
    """The LoRA identity a block's content key carries.

    Old vLLM sends only the numeric ``lora_id``; such blocks must never match base-model
    blocks with the same tokens, so they get a name of their own (a query by adapter name
    will not match them either: no answer is better than a wrong one).
    """
    if event.lora_name is not None:
        return event.lora_name
    if event.lora_id is not None:
        return f"lora-id:{event.lora_id}"
    return None


def apply_event(index: IndexWriter, worker: Any, event: Event) -> int:
    """Apply one decoded event; returns the blocks it stored or removed. The index raises
    ``ValueError`` for an event it cannot take, and then must have changed nothing."""
    if isinstance(event, BlockStored):
        index.apply_stored(
            worker,
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            lora_name=lora_key(event),
            extra_keys=event.extra_keys,
            medium=normalise_medium(event.medium),
            group_idx=event.group_idx or 0,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            locality=event.locality,
            lookahead_token_ids=event.lookahead_token_ids,
        )
        return len(event.block_hashes)
    if isinstance(event, BlockRemoved):
        index.apply_removed(
            worker,
            event.block_hashes,
            medium=normalise_medium(event.medium),
            group_idx=event.group_idx or 0,
            locality=event.locality,
        )
        return len(event.block_hashes)
    index.clear_worker(worker)
    return 0


def coalesced(events: Iterable[Event]) -> Iterator[Event]:
    """``events`` with each run of consecutive BlockRemoved events of one medium, KV-cache
    group and locality merged into one event.

    vLLM sends one hash per BlockRemoved event, so in a steady state half of all events
    are single removals. Removals of one medium, group and locality next to each other
    commute, so one index call per run is the same change at a fraction of the per-call
    cost; stores and clears keep their place between the runs.
    """
    run: list[Hash] = []
    kind: tuple[Any, ...] = ()
    for event in events:
        if isinstance(event, BlockRemoved):
            of = (event.medium, event.group_idx, event.locality)
            if run and of == kind:
                run.extend(event.block_hashes)
                continue
            if run:
                yield _removal(run, kind)
            run, kind = list(event.block_hashes), of
            continue
        if run:
            yield _removal(run, kind)
            run = []
        yield event
    if run:
        yield _removal(run, kind)


def _removal(hashes: list[Hash], kind: tuple[Any, ...]) -> BlockRemoved:
    medium, group, locality = kind
    return BlockRemoved(hashes, medium=medium, group_idx=group, locality=locality)


#: A slice of a store holds at most this many tokens per block it may hold (blocks of
#: vLLM's default size): the index's work per block grows with the block's tokens.
SLICE_TOKENS_PER_BLOCK = 16
_TOKEN_LIMIT = 2**32  # the index takes token ids in [0, 2**32) (index.keys)


def slices(event: BlockStored | BlockRemoved, max_blocks: int,
           holds: Callable[[Hash], bool] | None = None) -> Iterator[BlockStored | BlockRemoved]:
    """``event`` as consecutive events of at most ``max_blocks`` blocks each (a store's also
    of at most ``max_blocks * SLICE_TOKENS_PER_BLOCK`` tokens, but one block at least) that,
    applied in order to a ``PrefixIndex``, leave it exactly as ``event`` applied whole.

    - A store's slice after the first hangs off the previous slice's last hash, with the
      token ids, extra keys and lookahead tokens of its own blocks (block k keeps
      ``token_ids[k*block_size:(k+1)*block_size]`` whichever slice it is in).
    - When the worker does not hold the event's parent (``holds(parent)`` is false; asked
      only when the event is split, None means it does), the whole chain is orphaned:
      every slice then names that parent, so none is placed under a slice boundary's hash
      the worker might happen to hold from before.
    - A store without tokens (CPU offload) resolves each hash on its own, and removals are
      independent per hash: their slices split the hashes, nothing else.
    - A store the index would reject for its token ids (not filling its blocks, or
      outside ``[0, 2**32)``; checked only when the store is split: one pass over its
      tokens), its block size, or its extra keys' or lookahead lists' count is yielded
      whole: the index rejects it before changing anything. Nothing else can be rejected
      half-way: a decoded event's hashes are ints or bytes and its extra keys plain
      msgpack values.

    An event that fits in one slice is yielded as it is (no copy).
    """
    hashes = event.block_hashes
    count = len(hashes)
    if isinstance(event, BlockRemoved) or not event.token_ids:
        if count <= max_blocks:
            yield event
            return
        for start in range(0, count, max_blocks):
            yield msgspec.structs.replace(event, block_hashes=hashes[start:start + max_blocks])
        return
    tokens, block_size, extra = event.token_ids, event.block_size, event.extra_keys
    ahead = event.lookahead_token_ids
    if (type(block_size) is not int or block_size <= 0 or len(tokens) != count * block_size
            or (extra is not None and len(extra) != count)
            or (ahead is not None and len(ahead) != count)):
        yield event
        return
    per_slice = max(1, min(max_blocks, max_blocks * SLICE_TOKENS_PER_BLOCK // block_size))
    if count <= per_slice or min(tokens) < 0 or max(tokens) >= _TOKEN_LIMIT:
        yield event
        return
    parent = event.parent_block_hash
    chained = parent is None or holds is None or holds(parent)
    for start in range(0, count, per_slice):
        end = start + per_slice
        piece = hashes[start:end]
        yield msgspec.structs.replace(
            event, block_hashes=piece, parent_block_hash=parent,
            token_ids=tokens[start * block_size:end * block_size],
            extra_keys=None if extra is None else extra[start:end],
            lookahead_token_ids=None if ahead is None else ahead[start:end])
        if chained:
            parent = piece[-1]


def apply_batch(index: IndexWriter, worker: Any, batch: EventBatch) -> int:
    """Apply a decoded batch to ``index`` for ``worker``; returns the number of blocks stored
    or removed. An event the index rejects is counted in ``batch.malformed``; the others
    still apply. Synchronous on purpose: nothing else can interleave within the batch."""
    blocks = 0
    for event in coalesced(batch.events):
        try:
            blocks += apply_event(index, worker, event)
        except ValueError:
            batch.malformed += 1
    return blocks
