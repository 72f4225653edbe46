"""A BlockStored too big to decode in one call: its hashes and token ids decoded a slice at
a time, then applied as slices, so the event loop never waits for the whole event.

One call of msgspec over a 300,000-block store (4.8M token ids) holds the loop for the
whole decode, and a pass over its tokens (``wire.slices``' range check) for another long
stretch. Here the event is decoded with both lists left encoded (``msgspec.Raw``); then
``decode_steps`` turns them into lists of at most one slice each, a bounded piece of
work per step (msgpack's streaming unpacker reads a list a piece at a time: msgspec
has no such reader), and ``slices`` yields the events to apply (their token ids as uint32
arrays, which the index takes as it takes lists).

Invariants:

- Nothing is applied before every piece is decoded and checked: a store the typed decoder
  or the index would refuse whole (a token id not an int or outside ``[0, 2**32)``, a
  hash neither int nor bytes, token ids that do not fill the blocks, a bad block size,
  extra keys) is not ``valid``, and its caller decodes it the ordinary way, which refuses
  it exactly as before (one long call, for a broken publisher's event only).
- ``slices`` are those of ``wire.slices``: applied in order, they leave the index exactly
  as the whole event would. Between two slices, a route sees the worker holding a prefix
  of the event's chain (blocks its engine does hold): never a block it does not.
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import msgspec

from kvroute.app.ingest.wire import SLICE_TOKENS_PER_BLOCK, BlockStored, Hash
from kvroute.index.keys import TOKEN_TYPECODE

#: An encoded event over this size goes this way (every real vLLM event is far smaller).
HUGE_EVENT_BYTES = 1 << 20
_TOKEN_LIMIT = 2**32  # the index takes token ids in [0, 2**32) (index.keys)
_LAZY_FIELDS = ("block_hashes", "token_ids")


def _lazy_struct(array_like: bool) -> type[msgspec.Struct]:
    """BlockStored's fields in BlockStored's order, with its two lists left encoded."""
    fields: list[tuple[str, Any, Any]] = []
    for field in msgspec.structs.fields(BlockStored):
        if field.name == "block_hashes":
            fields.append((field.name, msgspec.Raw, msgspec.NODEFAULT))
        elif field.name == "token_ids":
            fields.append((field.name, msgspec.Raw, msgspec.Raw(b"\x90")))  # []
        else:
            default = (field.default if field.default is not msgspec.NODEFAULT
                       else field.default_factory())
            fields.append((field.name, field.type, default))
    return msgspec.defstruct("LazyBlockStored", fields, tag_field="type", tag="BlockStored",
                             array_like=array_like, omit_defaults=True, gc=False)


_lazy_decoders = (msgspec.msgpack.Decoder(_lazy_struct(False)),
                  msgspec.msgpack.Decoder(_lazy_struct(True)))
_OTHER_FIELDS = tuple(f for f in BlockStored.__struct_fields__ if f not in _LAZY_FIELDS)


class HugeStore:
    """One encoded BlockStored, decoded in bounded steps (module docstring)."""

    def __init__(self, lazy: Any, max_blocks: int) -> None:
        self._lazy = lazy
        self._hashes = _unpacker(lazy.block_hashes)
        self._tokens = _unpacker(lazy.token_ids)
        self.blocks = self._hashes.read_array_header()
        self._token_count = self._tokens.read_array_header()
        block_size = lazy.block_size
        self.has_tokens = self._token_count > 0
        self.per_slice = (max(1, min(max_blocks, max_blocks * SLICE_TOKENS_PER_BLOCK
                                     // block_size))
                          if self.has_tokens and type(block_size) is int and block_size > 0
                          else max_blocks)
        # Decoded pieces of one slice each, taken from the front by `slices`.
        self._hash_pieces: deque[list[Hash]] = deque()
        self._token_pieces: deque[array[int] | list[int]] = deque()
        self._decoded = False  # every step ran and the event is valid
        self.valid = (lazy.extra_keys is None and lazy.lookahead_token_ids is None
                      and self.blocks > 0 and (
            not self.has_tokens or (type(block_size) is int and block_size > 0
                                    and self._token_count == self.blocks * block_size)))

    @staticmethod
    def open(raw: bytes, max_blocks: int) -> HugeStore | None:
        """``raw`` (one encoded event) as a HugeStore; None when it is not a BlockStored
        this can read (decode it the ordinary way then)."""
        for decoder in _lazy_decoders:
            try:
                return HugeStore(decoder.decode(raw), max_blocks)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
        return None

    def decode_steps(self) -> Iterator[None]:
        """Decode one slice's hashes and tokens per step; stops early when the event turns
        out not ``valid``. Each step is one bounded piece of work."""
        left = self.blocks
        block_size = self._lazy.block_size if self.has_tokens else 0
        while left and self.valid:
            count = min(left, self.per_slice)
            left -= count
            try:
                hashes = _take(self._hashes, count)
                tokens = _take(self._tokens, count * block_size) if block_size else []
            except (ValueError, msgpack.UnpackException):
                self.valid = False
                return
            self.valid = set(map(type, hashes)) <= {int, bytes} and (not block_size or (
                set(map(type, tokens)) == {int} and min(tokens) >= 0
                and max(tokens) < _TOKEN_LIMIT))
            self._hash_pieces.append(hashes)
            # Kept as uint32 arrays until applied: the collector never scans an array's
            # items, while every pass over the young objects walked all 4.8M ints of a
            # 300,000-block store held as lists (several passes per such store).
            self._token_pieces.append(array(TOKEN_TYPECODE, tokens) if tokens and self.valid
                                      else [])
            yield
        self._decoded = self.valid

    def slices(self, holds: Callable[[Hash], bool]) -> Iterator[BlockStored]:
        """The event as ``wire.slices`` would cut it (only once every step ran and the
        event is ``valid``); each piece is dropped once it is yielded."""
        assert self._decoded, "every decode step first, and only for a valid event"
        others = {name: getattr(self._lazy, name) for name in _OTHER_FIELDS}
        parent = others.pop("parent_block_hash")
        # An orphaned chain (its parent not held) names that parent in every slice; a store
        # without tokens (an offload) resolves each hash on its own: split, nothing else.
        chained = self.has_tokens and (parent is None or holds(parent))
        while self._hash_pieces:
            hashes = self._hash_pieces.popleft()
            yield BlockStored(block_hashes=hashes, parent_block_hash=parent,
                              token_ids=self._token_pieces.popleft(), **others)
            if chained:
                parent = hashes[-1]


#: How much of a list's encoding the unpacker reads at a time, as it needs it.
_READ_BYTES = 1 << 16


class _Chunks:
    """``raw`` as a file the unpacker reads a piece at a time: fed the whole list at once,
    it copied it in one call, the loop waiting for the whole list."""

    __slots__ = ("_view", "_at")

    def __init__(self, raw: bytes) -> None:
        self._view = memoryview(raw)
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        start = self._at
        end = len(self._view) if size < 0 else min(start + size, len(self._view))
        self._at = end
        return bytes(self._view[start:end])


def _unpacker(raw: bytes) -> msgpack.Unpacker:
    return msgpack.Unpacker(_Chunks(raw), read_size=_READ_BYTES, strict_map_key=False)


def _take(unpacker: msgpack.Unpacker, count: int) -> list[Any]:
    """The next ``count`` elements of the list being read (ValueError if fewer)."""
    items = list(itertools.islice(unpacker, count))
    if len(items) != count:
        raise ValueError("the list ended early")
    return items
