"""Content keys: the identity of a cached block, independent of any engine's hash function.

A block's key is ``xxh3_128(parent_key || token bytes || extra suffix)``, where the first
block's parent is a *root key* derived from the block size, the LoRA name and the cache
salt. So a key stands for the whole token content from the start of the sequence to the
end of the block, in one (block size, LoRA, salt) domain, and two instances that cached
the same tokens produce the same keys whatever their vLLM hash seeds are.

Invariants:
- Keys are 16-byte ``bytes`` objects (their Python hash is cached in the object, which
  makes them cheap dict keys).
- Token ids are encoded as unsigned 32-bit ints (native byte order); anything outside
  ``[0, 2**32)`` or not an int is rejected with ``ValueError``, never truncated.
- Why 128 bits: a key stands in for its whole prefix, so two different prefixes with one
  key would make the index answer "held" for a block nobody holds. With n live keys the
  chance that any two collide is about n**2 / 2**129: for 10**9 keys that is ~10**-21,
  against ~3 * 10**-2 for a 64-bit key. xxh3 is not a cryptographic hash; the index trusts
  its inputs (the vLLM fleet it subscribes to), so resistance to chosen collisions is not
  a goal, while speed is (a chain of 16-token blocks hashes at several M blocks/s).
- The block size is part of the root, so keys of different block sizes never meet; the
  token bytes of a block then have a fixed length, which makes the extra suffix
  unambiguous (it is empty, or starts right after the tokens).
- With lookahead (vLLM 0.33's speculative decoding with block drop), an engine hashes each
  block together with the L tokens after it; its key then ends with those tokens
  (``lookahead_suffix``), after any extra suffix, so a block matches only a prompt whose
  next L tokens are the same too.
- A request's ``cache_salt`` is a domain, like a LoRA: vLLM puts it in the first block's
  extra keys only, and every later block's hash chains from that one, so a salted
  sequence shares no block with any other salt's or with the unsalted one. The index
  reads it out of a first block's extra keys (``salt_of``) into the root, so a query that
  names the salt walks the same keys; a query without it never reaches them.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

import msgspec
from xxhash import xxh3_128_digest

KEY_BYTES = 16
TOKEN_TYPECODE = "I"
TOKEN_BYTES = 4
assert array(TOKEN_TYPECODE).itemsize == TOKEN_BYTES, "token ids are 32-bit unsigned ints"

_ROOT_TAG = b"kvroute/root/v1\x00"
_SALTED_ROOT_TAG = b"kvroute/salted-root/v1\x00"
_NO_LORA = b"\x00"
_LORA = b"\x01"
_EXTRA_TAG = b"\xff"
_LOOKAHEAD_TAG = b"\xfe"

_extra_encoder = msgspec.msgpack.Encoder()


@lru_cache(maxsize=1024)
def root_key(block_size: int, lora_name: str | None, cache_salt: str | None = None) -> bytes:
    """The parent key of every first block in the (block size, LoRA, cache salt) domain
    (memoized in a bounded module-level cache of derived constants, not index state). A
    salted root has a tag of its own and the LoRA name's length before it, so no LoRA name
    and salt make another domain's root bytes."""
    lora = _NO_LORA if lora_name is None else _LORA + lora_name.encode("utf-8", "surrogatepass")
    size = block_size.to_bytes(4, "little")
    if cache_salt is None:
        return xxh3_128_digest(_ROOT_TAG + size + lora)
    return xxh3_128_digest(_SALTED_ROOT_TAG + size + len(lora).to_bytes(4, "little") + lora
                           + cache_salt.encode("utf-8", "surrogatepass"))


@lru_cache(maxsize=64)
def block_splitter(block_bytes: int) -> Callable[[bytes], Iterator[tuple[bytes]]]:
    """``split(tokens)`` yields each full block's bytes as a 1-tuple, in one C loop (faster
    than slicing block by block); a trailing partial block is left out."""
    return struct.Struct(f"{block_bytes}s").iter_unpack


def token_bytes(token_ids: Sequence[int] | bytes) -> bytes:
    """Token ids as uint32 bytes (native order: keys never leave the process); block k of
    size bs is ``[k*4*bs:(k+1)*4*bs]``. Bytes are taken as such bytes already (a caller
    that walks and guesses one prompt converts it once)."""
    if isinstance(token_ids, bytes):
        return token_ids
    if isinstance(token_ids, array) and token_ids.typecode == TOKEN_TYPECODE:
        return token_ids.tobytes()  # already uint32 (a route body's ids, app.api.route_decode)
    try:
        return array(TOKEN_TYPECODE, token_ids).tobytes()
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    except TypeError:
        raise ValueError("token ids must be a sequence of ints") from None


def lookahead_suffix(tokens: Sequence[int] | bytes) -> bytes:
    """The bytes a block's lookahead tokens add to its key (after its extra suffix)."""
    return _LOOKAHEAD_TAG + token_bytes(tokens)


def _items(extra: Any, lora_name: str | None) -> list[Any]:
    """A block's extra keys without the leading LoRA name a LoRA request puts first."""
    items = list(extra) if isinstance(extra, list | tuple) else [extra]
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    return items


def salt_of(extra: Any, lora_name: str | None) -> str | None:
    """The cache salt a sequence's first block carries in its extra keys, or None.

    vLLM adds ``cache_salt`` to the first block's extra keys only, after the LoRA name;
    multimodal keys are pairs and prompt-embedding keys bytes, so a first block whose
    extra keys are one string alone (after the LoRA name) is a salted text block. Any
    other mix stays a suffix: blocks that no token query can reproduce, never a false hit.
    """
    if extra is None:
        return None
    items = _items(extra, lora_name)
    if len(items) == 1 and type(items[0]) is str and items[0]:
        return items[0]
    return None


def extra_suffix(extra: Any, lora_name: str | None) -> bytes:
    """The bytes one block's vLLM ``extra_keys`` add to its key ("" when there are none).

    vLLM puts the LoRA name first in every block's extra keys of a LoRA request; the LoRA
    is already part of the key's domain (the root), so that leading name is dropped, which
    lets a plain token query with ``lora_name`` reproduce the key. Whatever remains
    (multimodal hashes, prompt-embedding hashes; a cache salt is read into the root
    instead, ``salt_of``) a token query cannot know, so blocks carrying it match only
    through ``match_hashes`` - never a false hit.
    """
    if extra is None:
        return b""
    items = _items(extra, lora_name)
    if not items:
        return b""
    try:
        return _EXTRA_TAG + _extra_encoder.encode(items)
    except (TypeError, ValueError, msgspec.EncodeError):
        raise ValueError(f"extra_keys entry {extra!r} is not made of plain values") from None
