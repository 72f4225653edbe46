"""The prefix index: which worker holds which content blocks, and how far a prompt matches.

Layout (chosen for CPython: few objects, work batched per event):

- ``_nodes: dict[key, int]`` maps every content key (see ``index.keys``) held by at least
  one worker to one packed int:
  bit 0 ``TIERED`` - some holder's fastest tier is not GPU (details in ``_tiered``);
  bit 1 ``FIRST`` - the block is the first of its sequence (its parent is a root key);
  bits 2..27 - a 26-bit fingerprint of the parent's key, to check hash paths;
  bit ``SLOT_SHIFT + s`` - the worker in slot ``s`` holds the block in some medium.
  A flat dict keyed by chained content keys needs no explicit tree: a key already stands
  for its whole prefix, and a match walks the keys of the query from the first block.
- ``_sized: dict[block_size, mask]``: the bits of the workers of each block size, so a
  match over every worker walks each size once and visits only the workers it finds.
- ``_tiered: dict[key, [cpu_mask, storage_mask]]`` only for blocks some worker holds
  with CPU or STORAGE as its fastest tier (same bit positions as the holder mask).
- Per worker (``_Worker``): ``handles: dict[engine_hash, key]`` for every engine hash it
  holds in any medium; ``counts: dict[engine_hash, packed]`` and
  ``node_counts: dict[key, packed]`` hold per-tier reference counts (``index.mediums``)
  only where they differ from "stored once on GPU", so both are empty in a GPU-only
  fleet. ``node_counts`` sums the counts of all the worker's handles of one key (two
  engine hashes for one content happen when the engine hashes something the events do
  not carry).

The compiled implementation keeps ``_nodes`` and every ``handles`` in compiled tables
(``NodeMap``, ``HandleMap``: index/_tables.pxi) instead of dicts: one 24-byte record per
entry where a dict keeps a slot, a key object and a value object (about 70 bytes per
holding instead of about 200). They answer the dict methods used here, so this module's
code is the same for both; only their iteration order is their own.

Invariants (``PrefixIndex._check()`` verifies them; the property tests call it):
- a node exists iff its holder mask is not empty; a worker's bit is set on a node iff one
  of its handles maps to that key; ``TIERED`` is set iff the node has a ``_tiered`` entry,
  and such an entry is never all zero;
- a worker's aggregated count for a key is ``node_counts.get(key, GPU_ONCE)`` while its bit
  is set, and is what decides its fastest tier;
- a worker's bit is in ``_sized[size]`` iff its block size is ``size`` (never 0);
- a worker has a handle for an engine hash iff it holds that hash in some medium (stored
  counts are never zero); so ``len(handles)`` is the number of blocks it holds, which
  ``blocks_held`` reports in O(1) and store, remove, clear and drop keep exact;
- after ``drop_worker`` of every worker all containers are empty; ``clear_worker`` leaves
  only the worker's slot, block size and group kinds.
- Unconfirmed blocks (``restore_unconfirmed``: saved holdings no replay could vouch for)
  live apart from real ones, in ``_Worker.unconfirmed``: no hash is in both; they count as
  placement guesses do (``Match.pending``), never as held; a real store of a hash, or a
  removal of it, ends its unconfirmed entry; ``clear_worker`` ends them all, and so does
  their expiry (a worker has them iff it is in ``_unconfirmed_until``).
- Nothing is mutated before an event has been validated: a ``ValueError`` (bad medium,
  token/hash count mismatch, token id out of range) leaves the index as it was.
"""

from __future__ import annotations

import heapq
import os
import sys
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

from xxhash import xxh3_128_digest

from kvroute.index.holdings import Holdings
from kvroute.index.keys import (
    TOKEN_BYTES,
    block_splitter,
    extra_suffix,
    lookahead_suffix,
    root_key,
    salt_of,
    token_bytes,
)
from kvroute.index.mediums import (
    CPU,
    FIELD_MASK,
    GPU,
    GPU_ONCE,
    STORAGE,
    TIER_NAMES,
    TIER_OF,
    UNITS,
    count_in,
    fastest,
    tier_of,
)
from kvroute.index.placement import Placements, chain_keys
from kvroute.index.results import IndexStats, Match
from kvroute.index.runs import Run, RunLimits
from kvroute.index.runs import apply_run as _apply_run_reference

WorkerKey = Hashable
BlockHash = int | bytes

TIERED = 1
FIRST = 2
FP_SHIFT = 2
FP_BITS = 26
FP_FIELD = ((1 << FP_BITS) - 1) << FP_SHIFT  # where the parent fingerprint sits
POSITION = FIRST | FP_FIELD  # the bits a node's key decides alone (what a save keeps)
SLOT_SHIFT = FP_SHIFT + FP_BITS
HOLDERS_MIN = 1 << SLOT_SHIFT  # a node value below this has no holder left
UINT64_MASK = (1 << 64) - 1
INDEXED_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})


def held_here(locality: Any) -> bool:
    """Whether an event with this ``locality`` is about the publishing worker's own cache:
    none given, or "LOCAL". A block held "REMOTE" relative to the publisher is another
    tier's, and one of a locality this index does not know may be too: neither is ever
    counted as the worker's own (a false hit costs a request its whole prefill), and a
    removal of either leaves the worker's own copy of the hash alone."""
    return locality is None or locality == "LOCAL"

try:  # the compiled loops (index/_fast.pyx), built at install time when a C compiler is there
    from kvroute.index import _fast as _compiled
except ImportError:  # not built (no compiler, or a source tree without the build step)
    _compiled = None

#: Whether the compiled loops are importable (built for this interpreter).
COMPILED_AVAILABLE = _compiled is not None
#: What a ``PrefixIndex()`` uses by default: "compiled", or "pure" when the compiled loops
#: are missing or ``KVROUTE_PURE`` is set to anything but "" or "0" (the pure loops
#: are the reference; both keep the same containers and give the same answers). The
#: service's other compiled paths (the route body's token reader, the live drain) follow
#: this choice, so ``KVROUTE_PURE=1`` runs all of kvroute on its pure references.
IMPLEMENTATION = ("compiled" if COMPILED_AVAILABLE
                  and os.environ.get("KVROUTE_PURE", "") in ("", "0") else "pure")


def _fingerprint_bits(parent: bytes) -> int:
    """The parent fingerprint as stored in a node value: bits of the parent key itself (its
    first four bytes, little-endian). A key is a uniform hash already, and its bytes are the
    same in every process, so a saved fingerprint still holds after a restart (Python's own
    hash of bytes is seeded anew in each process)."""
    return int.from_bytes(parent[:4], "little") & FP_FIELD


def _has_negative(block_hashes: Sequence[BlockHash]) -> bool:
    """Whether a list of int hashes needs ``_normalized_hashes`` (one C-level ``min``)."""
    try:
        return min(block_hashes) < 0  # type: ignore[type-var,operator]
    except TypeError:
        return True  # ints mixed with other things: normalized (and checked) one by one


def _normalized_hashes(block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
    """Engine hashes as handles: signed 64-bit ints become their unsigned twins."""
    return [_normalized_hash(h) for h in block_hashes]


def _lookahead_of(lookahead_token_ids: Any, blocks: int) -> int:
    """L, the tokens after each block that a store's lookahead lists give (0: none).
    Raises ``ValueError`` unless there is one list of L >= 1 token ids per block."""
    if lookahead_token_ids is None:
        return 0
    if (not isinstance(lookahead_token_ids, list | tuple)
            or len(lookahead_token_ids) != blocks or not blocks):
        raise ValueError(f"lookahead_token_ids must hold one list per block ({blocks})")
    first = lookahead_token_ids[0]
    lookahead = len(first) if isinstance(first, list | tuple) else 0
    if not lookahead or any(not isinstance(ahead, list | tuple) or len(ahead) != lookahead
                            for ahead in lookahead_token_ids):
        raise ValueError("lookahead_token_ids must be lists of one length, at least 1")
    for ahead in lookahead_token_ids:
        token_bytes(ahead)  # ints in [0, 2**32), or ValueError
    return lookahead


def _normalized_hash(block_hash: BlockHash) -> BlockHash:
    if type(block_hash) is int:
        return block_hash & UINT64_MASK if block_hash < 0 else block_hash
    if type(block_hash) is bytes:
        return block_hash
    raise ValueError(f"a block hash must be an int or bytes, not {type(block_hash).__name__}")


class _Worker:
    """Everything the index keeps about one worker; owned by ``PrefixIndex`` only."""

    __slots__ = (
        "worker",
        "slot",
        "bit",
        "keep",
        "block_size",
        "handles",
        "counts",
        "node_counts",
        "held",
        "groups",
        "unconfirmed",
        "unconfirmed_keys",
        "lookahead",
    )

    def __init__(self, worker: WorkerKey, slot: int, handles: dict[BlockHash, bytes]) -> None:
        self.worker = worker
        self.slot = slot
        self.bit = 1 << (SLOT_SHIFT + slot)
        self.keep = ~self.bit  # node value & keep: the value without this worker
        self.block_size = 0
        self.handles = handles
        self.counts: dict[BlockHash, int] = {}
        self.node_counts: dict[bytes, int] = {}
        self.held = [0, 0, 0]  # handles with a non-zero count, per tier
        self.groups: dict[int, bool] = {}  # group_idx -> indexed (full attention)?
        # Restored blocks no replay confirmed (``restore_unconfirmed``): engine hash -> key,
        # and how many of those hashes name each key.
        self.unconfirmed: dict[BlockHash, bytes] = {}
        self.unconfirmed_keys: dict[bytes, int] = {}
        # Tokens after a block that its engine hashes with it (vLLM 0.33's lookahead); 0:
        # none. Learned from the worker's stores; a change means another engine.
        self.lookahead = 0


class PrefixIndex:
    """Content-keyed prefix index over many workers. Not thread-safe: one writer at a time.

    Workers are opaque hashables (kvroute uses ``(instance_id, dp_rank)``). A worker is
    known from its first event (or ``clear_worker``) until ``drop_worker``.

    Choices where vLLM's protocol leaves room:
    - A worker's block size is the one it last stored with; its matches use that size.
    - Several full-attention groups of one worker announce the same hashes; their stores
      and removals count on the same (worker, hash, medium) reference, so a block stays
      held while any of them holds it.
    - A hash the worker re-announces for other content (an engine restart the caller did
      not report, or a hash collision in the engine) replaces the older binding and is
      counted in ``hash_conflicts``.
    - A removal that brings a hash to zero forgets the handle: a later chain naming it as
      parent is orphaned (vLLM never stores a child of an evicted block, so this only
      happens after lost events).
    """

    def __init__(self, *, compiled: bool | None = None) -> None:
        """``compiled``: use the compiled loops (True; ``ValueError`` when they are not
        built), the pure ones (False), or the module's ``IMPLEMENTATION`` (None)."""
        if compiled is None:
            compiled = IMPLEMENTATION == "compiled"
        if compiled and _compiled is None:
            raise ValueError("the compiled prefix-index loops are not built")
        self._fast = _compiled if compiled else None
        # The compiled loops keep nodes and handles in compact tables (index/_tables.pxi)
        # that answer the dict methods the rest of this class uses; the pure ones in dicts.
        self._nodes: dict[bytes, int] = {} if self._fast is None else self._fast.NodeMap()
        self._tiered: dict[bytes, list[int]] = {}
        self._workers: dict[WorkerKey, _Worker] = {}
        self._by_slot: list[_Worker | None] = []
        self._free_slots: list[int] = []
        # block size -> the bits of the workers of that size: a match walks each size's
        # workers at once without visiting the fleet (``_set_block_size`` keeps it).
        self._sized: dict[int, int] = {}
        # The workers whose engines hash lookahead tokens (few: speculative decoding with
        # block drop); a query walks them apart, each by its own lookahead.
        self._lookers: dict[WorkerKey, _Worker] = {}
        self._lookers_mask = 0
        self._orphaned_blocks = 0
        self._unknown_removals = 0
        self._ignored_blocks = 0
        self._ignored_removals = 0
        self._hash_conflicts = 0
        # Guesses of blocks workers are about to hold; the caller places them.
        self.placements = Placements()
        # worker -> when its unconfirmed blocks expire
        self._unconfirmed_until: dict[WorkerKey, float] = {}

    @property
    def implementation(self) -> str:
        """Which loops this index runs: "compiled" or "pure" (see ``IMPLEMENTATION``)."""
        return "pure" if self._fast is None else "compiled"

    # ------------------------------------------------------------------ ingestion

    def apply_stored(
        self,
        worker: WorkerKey,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        medium: str | None = None,
        group_idx: int = 0,
        kv_cache_spec_kind: str | None = None,
        locality: Any = None,
        lookahead_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Apply one BlockStored event: a chain of blocks hanging off ``parent_block_hash``.

        Block k holds ``token_ids[k*block_size:(k+1)*block_size]``. A chain whose parent
        hash this worker does not hold is counted as orphaned and not placed. A store with
        no tokens (CPU offload: ``block_size`` 0) adds the medium to hashes the worker
        already holds; hashes it does not hold are counted as orphaned.
        A store of a group that does not hold a full prefix (``INDEXED_KINDS``) is counted
        and skipped, and so is one with a ``locality`` other than "LOCAL" (``held_here``).
        ``lookahead_token_ids`` (one list of L tokens per block) are hashed into each
        block's key; a worker whose L changes is another engine, and its holdings are
        cleared first.
        Raises ``ValueError`` (before changing anything) for a malformed event.
        """
        if kv_cache_spec_kind not in INDEXED_KINDS:
            self._worker(worker).groups[group_idx] = False
            self._ignored_blocks += len(block_hashes)
            return
        if not held_here(locality):
            self._ignored_blocks += len(block_hashes)
            return
        try:
            tier = TIER_OF[medium]
        except (KeyError, TypeError):
            tier = tier_of(medium)  # other letter cases, or a ValueError
        blocks = len(block_hashes)
        if blocks:
            first = block_hashes[0]
            if type(first) is not int or (
                first < 0 if blocks == 1 else _has_negative(block_hashes)
            ):
                block_hashes = _normalized_hashes(block_hashes)
        if not token_ids:
            w = self._worker(worker)
            w.groups[group_idx] = True
            self._hold_announced(w, block_hashes, tier)
            return
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if len(token_ids) != blocks * block_size:
            raise ValueError(
                f"{len(token_ids)} token ids do not fill {blocks} blocks of {block_size}"
            )
        if extra_keys is not None and len(extra_keys) != blocks:
            raise ValueError(f"{len(extra_keys)} extra_keys entries for {blocks} blocks")
        lookahead = _lookahead_of(lookahead_token_ids, blocks)
        tokens = token_bytes(token_ids)
        parent_hash = None if parent_block_hash is None else _normalized_hash(parent_block_hash)
        suffixes = None
        salt = None
        if extra_keys is not None and extra_keys.count(None) != blocks:
            suffixes = [extra_suffix(extra, lora_name) for extra in extra_keys]
            if parent_hash is None and blocks:
                salt = salt_of(extra_keys[0], lora_name)
                if salt is not None:  # the salt is the root's (index.keys)
                    suffixes[0] = b""
            if not any(suffixes):
                suffixes = None
        if lookahead:
            if suffixes is None:
                suffixes = [b""] * blocks
            suffixes = [suffix + lookahead_suffix(ahead)
                        for suffix, ahead in zip(suffixes, lookahead_token_ids, strict=True)]
        w = self._workers.get(worker)
        if w is None:
            w = self._worker(worker)
        if w.lookahead != lookahead:
            self._set_lookahead(w, lookahead)
        w.groups[group_idx] = True
        if w.block_size != block_size:
            self._set_block_size(w, block_size)
        if parent_hash is None:
            parent_key = root_key(block_size, lora_name, salt)
            flag = FIRST
        else:
            found = w.handles.get(parent_hash)
            if found is None:
                # vLLM stores a child only of a block it holds: an unconfirmed parent is
                # enough to place the chain.
                found = w.unconfirmed.get(parent_hash)
            if found is None:
                self._orphaned_blocks += blocks
                return
            parent_key = found
            flag = 0
        if w.unconfirmed:
            self._end_unconfirmed(w, block_hashes)
        step = block_size * TOKEN_BYTES
        if self.placements.has(worker):
            # Real blocks replace guesses, so a later eviction of one shows at once. Guesses
            # are chains of plain token keys: only the blocks before the first one with extra
            # keys can be guessed (every key after it hashes that block's suffix in). This
            # also makes a chain stored in consecutive pieces confirm what it would whole.
            plain = blocks if suffixes is None else next(k for k, s in enumerate(suffixes) if s)
            if plain:
                self.placements.confirm(
                    worker, self._chain_keys(tokens[: plain * step], block_size, parent_key))
        if suffixes is not None or tier != GPU:
            self._store_chain(w, block_hashes, parent_key, flag, tokens, step, suffixes, tier)
            return

        fast = self._fast
        if fast is not None and type(block_hashes) is list:
            held_before = fast.store_gpu_chain(self, w, block_hashes, parent_key, tokens, step,
                                               w.bit, flag, FP_FIELD)
            w.held[GPU] += blocks - held_before
            return

        # Hot path: one pass over the chain, hashing and placing each block. setdefault
        # binds a new handle in one dict operation; anything but a new handle (a duplicate
        # store, a changed hash) goes through _hold, which keeps its own counts.
        digest = xxh3_128_digest
        bind = w.handles.setdefault
        nodes = self._nodes
        place = nodes.setdefault
        bit = w.bit
        seed = bit | flag  # a new node's value before its parent fingerprint
        held_before = 0
        # Lengths agree (checked above); strict=True would cost a raised StopIteration.
        for block_hash, (block,) in zip(block_hashes, block_splitter(step)(tokens)):  # noqa: B905
            key = digest(parent_key + block)
            if bind(block_hash, key) is key:
                fresh = seed | _fingerprint_bits(parent_key)
                value = place(key, fresh)  # a new node in one dict operation
                if value is not fresh:
                    if not value & bit:
                        nodes[key] = value | bit
                    else:
                        self._add_second_handle(w, key)
            else:
                held_before += 1
                self._hold(w, block_hash, key, GPU, (seed ^ bit) | _fingerprint_bits(parent_key))
            parent_key = key
            seed = bit
        w.held[GPU] += blocks - held_before

    def apply_run(self, worker: WorkerKey, events: Sequence[Any], start: int, work_left: int,
                  events_left: int, limits: RunLimits) -> Run:
        """Apply the plain events of ``events`` from ``start`` on, in one call: exactly as
        ``apply_stored``/``apply_removed`` once per event would (``index.runs``)."""
        fast = self._fast
        if fast is not None and (type(events) is list or type(events) is fast.PlainBatch):
            return fast.apply_run(self, worker, events, start, work_left,  # type: ignore[no-any-return]
                                  events_left, limits, FP_FIELD, FIRST, HOLDERS_MIN, GPU)
        return _apply_run_reference(self, worker, events, start, work_left, events_left,
                                    limits)

    def read_plain_batch(self, payload: bytes | memoryview) -> Sequence[Any] | None:
        """A vLLM event batch (its msgpack payload) read for ``apply_run`` without an object
        per event, when every one of its events is plain in form (``index.runs``) and the
        compiled loops are in use; else None, and the caller decodes the payload itself.
        An accepted payload decodes (``app.ingest.wire.decode_batch``) to as many events, each
        the same, none left out: a run that stops at event k continues from event k of
        those. The result has ``ts``, ``data_parallel_rank`` and a length."""
        fast = self._fast
        return None if fast is None else fast.read_plain_batch(payload)  # type: ignore[no-any-return]

    def _add_second_handle(self, w: _Worker, key: bytes) -> None:
        """A new GPU handle of ``w`` for a block it already holds through another one."""
        before = w.node_counts.get(key, GPU_ONCE)
        w.node_counts[key] = before + GPU_ONCE
        old_tier = fastest(before)
        if old_tier != GPU:
            self._retier(key, w.bit, old_tier, GPU)

    def _store_chain(
        self,
        w: _Worker,
        block_hashes: Sequence[BlockHash],
        parent_key: bytes,
        flag: int,
        tokens: bytes,
        step: int,
        suffixes: list[bytes] | None,
        tier: int,
    ) -> None:
        """The general path of ``apply_stored``: every block through ``_hold``."""
        for k, block_hash in enumerate(block_hashes):
            data = parent_key + tokens[k * step : (k + 1) * step]
            key = xxh3_128_digest(data + suffixes[k] if suffixes else data)
            self._hold(w, block_hash, key, tier, flag | _fingerprint_bits(parent_key))
            parent_key = key
            flag = 0

    def _hold_announced(self, w: _Worker, block_hashes: Iterable[BlockHash], tier: int) -> None:
        """A token-less store (CPU offload): resolve each hash through the worker's handles."""
        handles = w.handles
        for block_hash in block_hashes:
            key = handles.get(block_hash)
            if key is None:
                self._orphaned_blocks += 1
            else:
                self._hold(w, block_hash, key, tier, 0)

    def _hold(self, w: _Worker, block_hash: BlockHash, key: bytes, tier: int,
              node_bits: int) -> None:
        """Add one reference (worker, engine hash, tier); ``node_bits`` seed a new node."""
        unit = UNITS[tier]
        handles = w.handles
        bound = handles.get(block_hash)
        if bound is not None and bound != key:
            # The engine re-announced a hash for other content: the newer one wins.
            self._hash_conflicts += 1
            self._drop_handle(w, block_hash)
            bound = None
        if bound is None:
            handles[block_hash] = key
            if tier != GPU:
                w.counts[block_hash] = unit
            w.held[tier] += 1
        else:
            packed = w.counts.get(block_hash, GPU_ONCE)
            current = count_in(packed, tier)
            if current == FIELD_MASK:
                raise ValueError("reference count overflow")
            if not current:
                w.held[tier] += 1
            w.counts[block_hash] = packed + unit

        nodes = self._nodes
        value = nodes.get(key)
        bit = w.bit
        if value is None:
            value = node_bits
            before = 0
        elif value & bit:
            before = w.node_counts.get(key, GPU_ONCE)
        else:
            before = 0
        after = before + unit
        if after == GPU_ONCE:
            w.node_counts.pop(key, None)
        else:
            w.node_counts[key] = after
        nodes[key] = value | bit
        old_tier = fastest(before)
        new_tier = fastest(after)
        if old_tier != new_tier:
            self._retier(key, bit, old_tier, new_tier)

    def apply_removed(
        self,
        worker: WorkerKey,
        block_hashes: Sequence[BlockHash],
        *,
        medium: str | None = None,
        group_idx: int = 0,
        locality: Any = None,
    ) -> None:
        """Apply one BlockRemoved event: each hash is no longer held in ``medium``, however
        many stores of it there were (``_release``: reuse reports).

        Removals of hashes (in that medium) the worker does not hold are counted, not
        fatal; removals in a group whose stores announced a non-full-attention kind, and
        removals of a copy held elsewhere (``held_here``), are ignored (and counted).
        """
        if not held_here(locality):
            self._ignored_removals += len(block_hashes)
            return
        try:
            tier = TIER_OF[medium]
        except (KeyError, TypeError):
            tier = tier_of(medium)
        w = self._workers.get(worker)
        if w is None:
            w = self._worker(worker)
        if not block_hashes:
            return
        first = block_hashes[0]
        if type(first) is not int or (
            first < 0 if len(block_hashes) == 1 else _has_negative(block_hashes)
        ):
            block_hashes = _normalized_hashes(block_hashes)
        if w.groups.get(group_idx) is False:
            self._ignored_removals += len(block_hashes)
            return
        if tier or w.counts or w.node_counts:
            for block_hash in block_hashes:
                self._release(w, block_hash, tier)
            return
        # Hot path: every holding of this worker is "once on GPU", so no tier bookkeeping.
        fast = self._fast
        if fast is not None and type(block_hashes) is list:
            removed, unknown = fast.remove_gpu(self, w, block_hashes, HOLDERS_MIN)
            self._unknown_removals += unknown
            if removed:
                w.held[GPU] -= removed
            return
        pop_handle = w.handles.pop
        nodes = self._nodes
        removed = 0
        for block_hash in block_hashes:
            key = pop_handle(block_hash, None)
            if key is None:
                if not self._end_unconfirmed(w, (block_hash,)):
                    self._unknown_removals += 1
                continue
            value = nodes[key] & w.keep
            if value >= HOLDERS_MIN:
                nodes[key] = value
            else:
                del nodes[key]
            removed += 1
        if removed:
            w.held[GPU] -= removed

    def _release(self, w: _Worker, block_hash: BlockHash, tier: int) -> None:
        """Remove (worker, engine hash, tier) whatever its reference count, counting
        unknown ones. A store of a hash the worker holds may be a reuse report (vLLM's
        ``kv_cache_report_mode: "full"``), which no removal ever pairs, or a second real
        copy, which its own removal follows; the wire cannot tell them apart, so the first
        removal ends the holding: a second copy is under-reported until it is stored
        again, and a reported block never outlives its eviction (docs/decisions.md)."""
        key = w.handles.get(block_hash)
        if key is None:
            if not self._end_unconfirmed(w, (block_hash,)):
                self._unknown_removals += 1
            return
        packed = w.counts.get(block_hash, GPU_ONCE)
        current = count_in(packed, tier)
        if not current:
            self._unknown_removals += 1
            return
        unit = UNITS[tier] * current
        packed -= unit
        w.held[tier] -= 1
        if not packed:
            del w.handles[block_hash]
            w.counts.pop(block_hash, None)
        elif packed == GPU_ONCE:
            w.counts.pop(block_hash, None)
        else:
            w.counts[block_hash] = packed
        self._unhold_node(w, key, unit)

    def _unhold_node(self, w: _Worker, key: bytes, unit: int) -> None:
        """Take ``unit`` off the worker's aggregated count for ``key``."""
        before = w.node_counts.get(key, GPU_ONCE)
        after = before - unit
        if after == GPU_ONCE:
            w.node_counts.pop(key, None)
        elif after:
            w.node_counts[key] = after
        else:
            w.node_counts.pop(key, None)
        old_tier = fastest(before)
        new_tier = fastest(after)
        if old_tier != new_tier:
            self._retier(key, w.bit, old_tier, new_tier)
        if not after:
            value = self._nodes[key] & ~w.bit
            if value >= HOLDERS_MIN:
                self._nodes[key] = value
            else:
                del self._nodes[key]

    def _drop_handle(self, w: _Worker, block_hash: BlockHash) -> None:
        """Forget a handle with all its references (used when its content changed)."""
        key = w.handles.pop(block_hash)
        packed = w.counts.pop(block_hash, GPU_ONCE)
        for tier in (GPU, CPU, STORAGE):
            if count_in(packed, tier):
                w.held[tier] -= 1
        self._unhold_node(w, key, packed)

    def _retier(self, key: bytes, bit: int, old_tier: int | None,
                new_tier: int | None) -> None:
        """Move a worker's bit between the CPU/STORAGE masks of a node."""
        entry = self._tiered.get(key)
        if old_tier is not None and old_tier != GPU and entry is not None:
            entry[old_tier - 1] &= ~bit
        if new_tier is not None and new_tier != GPU:
            if entry is None:
                entry = self._tiered[key] = [0, 0]
            entry[new_tier - 1] |= bit
        if entry is None:
            return
        if entry[0] or entry[1]:
            self._nodes[key] |= TIERED
        else:
            del self._tiered[key]
            value = self._nodes.get(key)
            if value is not None:
                self._nodes[key] = value & ~TIERED

    def clear_worker(self, worker: WorkerKey) -> None:
        """AllBlocksCleared: the worker holds nothing, real, guessed or unconfirmed (its slot
        and block size stay)."""
        self.placements.forget(worker)
        w = self._worker(worker)
        if self._fast is not None:
            self._fast.clear_handles(self, w, TIERED, HOLDERS_MIN)
        else:
            for key in w.handles.values():
                self._let_go(w, key)
        w.handles = self._new_handles()
        w.counts = {}
        w.node_counts = {}
        w.held = [0, 0, 0]
        self._forget_unconfirmed(w)

    def _new_handles(self) -> dict[BlockHash, bytes]:
        """An empty handle table of this index's implementation (see ``_nodes``)."""
        return {} if self._fast is None else self._fast.HandleMap()  # type: ignore[no-any-return]

    def _let_go(self, w: _Worker, key: bytes) -> None:
        """Take ``w``'s bit off ``key``'s node and tier entry, for ``clear_worker`` (which
        then forgets all of the worker's handles and counts)."""
        value = self._nodes.get(key)
        if value is None or not value & w.bit:
            return  # a second handle of the same content, already let go
        if value & TIERED:
            entry = self._tiered[key]
            entry[0] &= w.keep
            entry[1] &= w.keep
            if not (entry[0] or entry[1]):
                del self._tiered[key]
                value &= ~TIERED
        value &= w.keep
        if value >= HOLDERS_MIN:
            self._nodes[key] = value
        else:
            del self._nodes[key]

    def drop_worker(self, worker: WorkerKey) -> None:
        """Forget a worker entirely; nothing of it stays in memory. Unknown: no-op."""
        w = self._workers.get(worker)
        if w is None:
            return
        self.clear_worker(worker)
        self._set_block_size(w, 0)
        self._set_lookahead(w, 0)
        del self._workers[worker]
        self._by_slot[w.slot] = None
        heapq.heappush(self._free_slots, w.slot)
        if self._by_slot[-1] is None:
            while self._by_slot and self._by_slot[-1] is None:
                self._by_slot.pop()
            self._free_slots = [s for s in self._free_slots if s < len(self._by_slot)]
            heapq.heapify(self._free_slots)

    def _set_lookahead(self, w: _Worker, lookahead: int) -> None:
        """A worker's engine hashes ``lookahead`` tokens after each block from now on: an
        engine other than the one whose blocks it holds, which are cleared."""
        if w.handles or w.unconfirmed:
            self.clear_worker(w.worker)
        w.lookahead = lookahead
        if lookahead:
            self._lookers[w.worker] = w
            self._lookers_mask |= w.bit
        elif self._lookers.pop(w.worker, None) is not None:
            self._lookers_mask &= w.keep

    def _set_block_size(self, w: _Worker, size: int) -> None:
        """The one way a worker's block size changes (0: none), so ``_sized`` follows."""
        sized = self._sized
        if w.block_size:
            rest = sized[w.block_size] & w.keep
            if rest:
                sized[w.block_size] = rest
            else:
                del sized[w.block_size]
        w.block_size = size
        if size:
            sized[size] = sized.get(size, 0) | w.bit

    def _worker(self, worker: WorkerKey) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = len(self._by_slot)
                self._by_slot.append(None)
            w = _Worker(worker, slot, self._new_handles())
            self._by_slot[slot] = self._workers[worker] = w
        return w

    # ------------------------------------------------------------------ saving and restoring

    def capture(self, worker: WorkerKey) -> HoldingsCapture | None:
        """What ``worker`` really holds now, to be saved (None: a worker the index does
        not know). Costs C-level copies of its tables, no Python loop per block. Its
        unconfirmed blocks are not included."""
        w = self._workers.get(worker)
        if w is None:
            return None
        return HoldingsCapture(self._nodes, w.handles.copy(), w.counts.copy(),
                               w.block_size, list(w.groups.items()))

    def capture_unconfirmed(self, worker: WorkerKey,
                            size: int) -> tuple[list[Holdings], float] | None:
        """The worker's unconfirmed blocks in pieces of at most ``size`` (their flags are
        not kept: unconfirmed blocks have no node) and when they expire; None when it has
        none. One pass over them: they only exist for a while after a resume."""
        w = self._workers.get(worker)
        if w is None or not w.unconfirmed:
            return None
        hashes = list(w.unconfirmed)
        keys = list(w.unconfirmed.values())
        pieces = [Holdings(w.block_size, list(w.groups.items()), hashes[i:i + size],
                           keys[i:i + size], [0] * len(hashes[i:i + size]))
                  for i in range(0, len(hashes), size)]
        return pieces, self._unconfirmed_until[worker]

    def restore(self, worker: WorkerKey, pieces: Iterable[Holdings]) -> int:
        """Make ``worker`` hold the saved blocks, as if their stores had been applied;
        returns how many. A worker's pieces may be restored in several calls (a caller
        yielding to its loop between them); none may name a hash the worker holds already.
        Raises ``ValueError`` (before changing anything) for pieces that break
        ``Holdings``' invariants or that name a hash the worker holds."""
        pieces = list(pieces)
        self._check_pieces(pieces)
        w = self._workers.get(worker)
        if w is not None and w.handles and any(
                h in w.handles for piece in pieces for h in piece.hashes):
            raise ValueError(f"worker {worker!r} already holds a hash being restored")
        if w is not None and w.handles and pieces and pieces[0].block_size != w.block_size:
            raise ValueError("restored pieces disagree with the worker's block size")
        w = w or self._worker(worker)
        if not pieces:
            return 0
        self._set_block_size(w, pieces[0].block_size)
        w.groups = dict(pieces[0].groups)
        nodes = self._nodes
        place = nodes.setdefault
        bit = w.bit
        restored = 0
        for piece in pieces:
            bind = w.handles.setdefault
            for block_hash, key, bits in zip(piece.hashes, piece.keys, piece.flags):  # noqa: B905
                bind(block_hash, key)
                fresh = bits | bit
                value = place(key, fresh)
                if value is not fresh:
                    if not value & bit:
                        nodes[key] = value | bit
                    else:
                        self._add_second_handle(w, key)
            for position, per_tier in piece.counts.items():
                self._recount(w, piece.hashes[position], piece.keys[position],
                              _packed(per_tier))
            w.held[GPU] += len(piece) - len(piece.counts)
            restored += len(piece)
        return restored

    def _recount(self, w: _Worker, block_hash: BlockHash, key: bytes, packed: int) -> None:
        """A restored handle whose counts are not "once on GPU": ``restore`` bound it as
        if they were; set its real counts and the tiers they decide."""
        before = w.node_counts.get(key, GPU_ONCE)
        after = before - GPU_ONCE + packed
        w.counts[block_hash] = packed
        for tier in (CPU, STORAGE):
            if count_in(packed, tier):
                w.held[tier] += 1
        if count_in(packed, GPU):
            w.held[GPU] += 1
        if after == GPU_ONCE:
            w.node_counts.pop(key, None)
        else:
            w.node_counts[key] = after
        old_tier, new_tier = fastest(before), fastest(after)
        if old_tier != new_tier:
            self._retier(key, w.bit, old_tier, new_tier)

    def restore_unconfirmed(self, worker: WorkerKey, pieces: Iterable[Holdings],
                            expires: float) -> int:
        """Hold the saved blocks unconfirmed until ``expires`` (see the module invariants):
        they count like placement guesses, so a stale save can cost a miss but never pins
        routing to blocks the engine evicted long ago. Hashes the worker really holds are
        left out; returns how many were kept. Replaces earlier unconfirmed blocks.
        Raises ``ValueError`` (before changing anything) for malformed pieces."""
        pieces = list(pieces)
        self._check_pieces(pieces)
        w = self._worker(worker)
        self._forget_unconfirmed(w)
        if not pieces:
            return 0
        if not w.block_size:
            self._set_block_size(w, pieces[0].block_size)
        real = w.handles
        unconfirmed = w.unconfirmed
        for piece in pieces:
            unconfirmed.update(zip(piece.hashes, piece.keys))  # noqa: B905
        for block_hash in [h for h in unconfirmed if h in real] if real else ():
            del unconfirmed[block_hash]
        counts: dict[bytes, int] = {}
        for key in unconfirmed.values():
            counts[key] = counts.get(key, 0) + 1
        w.unconfirmed_keys = counts
        if unconfirmed:
            self._unconfirmed_until[worker] = expires
        return len(unconfirmed)

    def unconfirmed_blocks(self, worker: WorkerKey) -> int:
        """How many restored blocks of ``worker`` no replay or event has confirmed yet."""
        w = self._workers.get(worker)
        return 0 if w is None else len(w.unconfirmed)

    def expire_unconfirmed(self, now: float) -> None:
        """End the unconfirmed blocks of every worker whose time ran out by ``now``."""
        for worker, until in list(self._unconfirmed_until.items()):
            if until <= now:
                self._forget_unconfirmed(self._workers[worker])

    def _forget_unconfirmed(self, w: _Worker) -> None:
        if w.unconfirmed:
            w.unconfirmed = {}
            w.unconfirmed_keys = {}
        self._unconfirmed_until.pop(w.worker, None)

    def _end_unconfirmed(self, w: _Worker, block_hashes: Iterable[BlockHash]) -> bool:
        """A real event names these hashes: whatever was unconfirmed about them is over.
        Returns whether any of them was unconfirmed."""
        unconfirmed = w.unconfirmed
        if not unconfirmed:
            return False
        keys = w.unconfirmed_keys
        ended = False
        for block_hash in block_hashes:
            key = unconfirmed.pop(block_hash, None)
            if key is None:
                continue
            ended = True
            left = keys[key] - 1
            if left:
                keys[key] = left
            else:
                del keys[key]
        if not unconfirmed:
            self._forget_unconfirmed(w)
        return ended

    @staticmethod
    def _check_pieces(pieces: list[Holdings]) -> None:
        """``Holdings``' invariants, before anything is changed."""
        if not pieces:
            return
        first = pieces[0]
        if type(first.block_size) is not int or first.block_size < 0:
            raise ValueError(f"saved block_size {first.block_size!r} is not an int >= 0")
        seen = 0
        for piece in pieces:
            if piece.block_size != first.block_size or piece.groups != first.groups:
                raise ValueError("the pieces of one worker disagree on block_size or groups")
            blocks = len(piece.hashes)
            if len(piece.keys) != blocks or len(piece.flags) != blocks:
                raise ValueError("a piece's hashes, keys and flags differ in length")
            if any(len(key) != 16 for key in piece.keys):
                raise ValueError("a saved content key is not 16 bytes")
            if piece.flags and (min(piece.flags) < 0 or max(piece.flags) & ~POSITION):
                raise ValueError("a saved node flag has bits besides its position")
            if any(type(h) is int and not 0 <= h <= UINT64_MASK for h in piece.hashes):
                raise ValueError("a saved block hash is not an unsigned 64-bit int")
            for position, per_tier in piece.counts.items():
                if not 0 <= position < blocks or not all(
                        type(c) is int and 0 <= c <= FIELD_MASK for c in per_tier):
                    raise ValueError("a saved reference count is out of place or range")
                packed = _packed(per_tier)
                if not packed or packed == GPU_ONCE:
                    raise ValueError("a saved reference count is zero or implicit")
            seen += blocks
        if len({h for piece in pieces for h in piece.hashes}) != seen:
            raise ValueError("a block hash is saved twice")

    # ------------------------------------------------------------------ queries

    def blocks_held(self, worker: WorkerKey) -> int:
        """How many blocks (engine hashes) ``worker`` holds in at least one medium; 0 for a
        worker the index does not know.

        O(1): it is the size of the worker's handle table, which every store, removal, clear
        and drop keeps exact (see the module's invariants), so no second count can drift
        from it. All the index keeps for a worker (handles, reference counts, its nodes)
        grows with this number, which makes it the measure for a cap on one worker.
        """
        w = self._workers.get(worker)
        return 0 if w is None else len(w.handles)

    def held_by_medium(self, worker: WorkerKey) -> dict[str, int]:
        """``worker``'s blocks per tier name, as ``stats().holdings`` has them (empty for a
        worker the index does not know). O(1): one worker's counters, not every worker's
        (an instance's detail, asked once per registration, must not cost the fleet)."""
        w = self._workers.get(worker)
        return {} if w is None else dict(zip(TIER_NAMES, w.held, strict=True))

    def holds_hash(self, worker: WorkerKey, block_hash: BlockHash) -> bool:
        """Whether ``worker`` holds ``block_hash`` (signed and unsigned spellings alike) in
        some medium: exactly when a chain naming it as parent would be placed."""
        w = self._workers.get(worker)
        if w is None:
            return False
        try:
            return _normalized_hash(block_hash) in w.handles
        except ValueError:
            return False  # not a hash at all: nobody holds it

    def block_size(self, worker: WorkerKey) -> int | None:
        """The block size the worker last stored with, None before its first store."""
        w = self._workers.get(worker)
        if w is None or not w.block_size:
            return None
        return w.block_size

    def match(
        self,
        token_ids: Sequence[int] | bytes,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        following: Sequence[int] | bytes = b"",
        workers: Iterable[WorkerKey] | None = None,
        now: float | None = None,
        matched_only: bool = False,
    ) -> dict[WorkerKey, Match]:
        """Every (selected, known) worker's consecutive cached blocks from the first block.

        With ``matched_only``, only the workers that match at least one block (held,
        guessed or unconfirmed) are answered: building the answer then costs the matched
        workers, not the selection (the walk itself follows bit masks, whatever the fleet).

        Each worker is matched at its own block size; the trailing partial block never
        matches. Blocks stored under a cache salt match only a query with that
        ``cache_salt`` (and it matches nothing else); blocks stored with other extra keys
        (multimodal) cannot be matched by tokens alone. A worker whose engine hashes L
        lookahead tokens with each block matches a block only when the prompt has its next
        L tokens: from ``token_ids``, then ``following`` (tokens of the prompt that are not
        matched themselves, such as the last one vLLM always computes). Raises
        ``ValueError`` for token ids outside ``[0, 2**32)``.
        ``token_ids`` may be given as their ``keys.token_bytes`` (converted once by a caller
        that also ``place``s them).
        Placement guesses count as held (``Match.pending``); with ``now`` given, those
        expired by then are removed first.
        """
        if now is not None:
            self.placements.expire(now)
            if self._unconfirmed_until:
                self.expire_unconfirmed(now)
        tokens = token_bytes(token_ids)
        after = token_bytes(following) if following else b""
        result: dict[WorkerKey, Match] = {}
        if workers is None and matched_only:
            # Every worker, each size's at once: the walk and the answer cost the holders.
            for block_size, alive in self._sized.items():
                ended, tiered_hits = self._walk_all(
                    root_key(block_size, lora_name, cache_salt), tokens, after, block_size,
                    alive)
                self._assemble_holders(result, ended, tiered_hits, block_size)
            if self.placements or self._unconfirmed_until:
                self._add_guesses(result, self._guessed_among(None), tokens, lora_name,
                                  cache_salt)
            return result
        targets = self._select(workers)
        by_size: dict[int, list[_Worker]] = {}
        for w in targets:
            by_size.setdefault(w.block_size, []).append(w)
        for block_size, members in by_size.items():
            if not block_size:
                if not matched_only:
                    self._assemble(result, members, [], [], 0)
                continue
            alive = 0
            for w in members:
                alive |= w.bit
            ended, tiered_hits = self._walk_all(
                root_key(block_size, lora_name, cache_salt), tokens, after, block_size, alive)
            if matched_only:
                self._assemble_holders(result, ended, tiered_hits, block_size)
            else:
                self._assemble(result, members, ended, tiered_hits, block_size)
        if self.placements or self._unconfirmed_until:
            guessed = targets
            if matched_only and len(targets) > 1:
                guessed = self._guessed_among({w.worker for w in targets})
            self._add_guesses(result, guessed, tokens, lora_name, cache_salt)
        return result

    def _guessed_among(self, selected: set[WorkerKey] | None) -> list[_Worker]:
        """The known workers (of ``selected``; None: all) with placement guesses or
        unconfirmed blocks: the only ones a match over many can gain blocks from them."""
        known = self._workers
        return [known[key] for key in {*self.placements.workers(), *self._unconfirmed_until}
                if key in known and (selected is None or key in selected)]

    def place(self, worker: WorkerKey, token_ids: Sequence[int] | bytes, *,
              block_size: int | None = None, lora_name: str | None = None,
              cache_salt: str | None = None, expires: float) -> int:
        """Guess that ``worker`` will hold the full blocks of ``token_ids`` until
        ``expires`` (see ``index.placement``); blocks it already holds are not guessed.

        ``block_size`` is needed only for a worker that has not stored yet (it then
        becomes the worker's block size). Returns the number of blocks guessed.
        """
        w = self._workers.get(worker)
        if (w is None or not w.block_size) and not block_size:
            return 0
        w = w or self._worker(worker)
        if not w.block_size:
            self._set_block_size(w, block_size)
        tokens, root = token_bytes(token_ids), root_key(w.block_size, lora_name, cache_salt)
        keys = self._chain_keys(tokens, w.block_size, root)
        # The blocks it holds from the first: a walk of its bit alone (in C, for the
        # compiled index; a loop over the keys here would be a Python step per block).
        ((_, held),), _ = self._walk_tokens(root, tokens, w.block_size, w.bit)
        self.placements.place(worker, keys[held:], expires)
        return len(keys) - held

    def withdraw(self, worker: WorkerKey, token_ids: Sequence[int], *,
                 lora_name: str | None = None, cache_salt: str | None = None,
                 expires: float) -> int:
        """Take back the guess ``place`` made for these tokens with this ``expires`` (the
        request was served by another worker); returns the number of blocks taken back."""
        w = self._workers.get(worker)
        if w is None or not w.block_size:
            return 0
        keys = self._chain_keys(token_bytes(token_ids), w.block_size,
                                root_key(w.block_size, lora_name, cache_salt))
        return self.placements.withdraw(worker, keys, expires)

    def _chain_keys(self, tokens: bytes, block_size: int, parent: bytes) -> list[bytes]:
        """``placement.chain_keys`` of token bytes under ``parent``, made by the compiled
        index's C hashing when it has it (one xxh3 call from Python per block otherwise,
        and a route that leaves a guess makes the keys twice)."""
        if self._fast is not None:
            return self._fast.chain_keys(tokens, block_size, parent)  # type: ignore[no-any-return]
        return chain_keys(tokens, block_size, parent=parent)

    def _add_guesses(self, result: dict[WorkerKey, Match], targets: list[_Worker],
                     tokens: bytes, lora_name: str | None, cache_salt: str | None) -> None:
        """Extend the matches of workers with placement guesses and unconfirmed blocks: a
        block counts while the worker really holds it, is guessed to, or holds it
        unconfirmed; blocks past the real match that it does hold (beyond a pending gap)
        are counted as GPU."""
        keys_by_size: dict[int, list[bytes]] = {}
        nodes = self._nodes
        for w in targets:
            if not w.block_size or not (w.unconfirmed or self.placements.has(w.worker)):
                continue
            keys = keys_by_size.get(w.block_size)
            if keys is None:
                keys = keys_by_size[w.block_size] = self._chain_keys(
                    tokens, w.block_size, root_key(w.block_size, lora_name, cache_salt))
            real = result.get(w.worker)
            if self._fast is not None and w.bit <= UINT64_MASK:
                # The match walked the same keys: the worker really holds its blocks.
                held = real.blocks if real is not None and real.block_size == w.block_size else 0
                blocks, pending = self._fast.extent(
                    nodes, keys, w.bit, self.placements.guessed(w.worker), w.unconfirmed_keys,
                    held)
            else:
                blocks, pending = self.placements.extent(
                    w.worker, keys, lambda key, bit=w.bit: bool(nodes.get(key, 0) & bit),
                    w.unconfirmed_keys)
            if real is None:  # matched nothing held (the caller asked for matches only)
                real = _new_match(0, 0, w.block_size,
                                  {"GPU": 0, "CPU": 0, "STORAGE": 0})
            if blocks <= real.blocks:
                continue
            by_medium = dict(real.by_medium)
            by_medium["GPU"] += blocks - pending - real.blocks
            result[w.worker] = Match(blocks, blocks * w.block_size, w.block_size, by_medium,
                                     pending)

    def _walk_all(self, root: bytes, tokens: bytes, after: bytes, block_size: int,
                  alive: int) -> tuple[list[tuple[int, int]], list[tuple[bytes, int]]]:
        """``_walk_tokens`` for the workers of ``alive``, those whose engines hash lookahead
        tokens walked apart, by each one's lookahead (``_walk_ahead``)."""
        looking = alive & self._lookers_mask
        if not looking:
            return self._walk_tokens(root, tokens, block_size, alive)
        ended: list[tuple[int, int]] = []
        tiered_hits: list[tuple[bytes, int]] = []
        if alive & ~looking:
            ended, tiered_hits = self._walk_tokens(root, tokens, block_size, alive & ~looking)
        by_lookahead: dict[int, int] = {}
        for w in self._lookers.values():
            if w.bit & looking:
                by_lookahead[w.lookahead] = by_lookahead.get(w.lookahead, 0) | w.bit
        for lookahead, mask in by_lookahead.items():
            more, hits = self._walk_ahead(root, tokens, after, block_size, lookahead, mask)
            ended += more
            tiered_hits += hits
        return ended, tiered_hits

    def _walk_ahead(self, parent_key: bytes, tokens: bytes, after: bytes, block_size: int,
                    lookahead: int, alive: int,
                    ) -> tuple[list[tuple[int, int]], list[tuple[bytes, int]]]:
        """``_walk_tokens`` for workers whose engines hash the ``lookahead`` tokens after
        each block with it: a block of ``tokens`` is walked only when ``tokens + after``
        holds its next ``lookahead`` tokens (vLLM hashes it only then). Python: such
        workers are few, and their keys end with those tokens (``keys.lookahead_suffix``)."""
        step = block_size * TOKEN_BYTES
        ahead = lookahead * TOKEN_BYTES
        full = tokens + after
        blocks = min(len(tokens) // step, max(0, len(full) - ahead) // step)
        digest = xxh3_128_digest

        def keys() -> Iterator[bytes]:
            key = parent_key
            for start in range(0, blocks * step, step):
                end = start + step
                key = digest(key + full[start:end] + lookahead_suffix(full[end:end + ahead]))
                yield key

        return self._walk_keys(keys(), alive)

    def _walk_tokens(self, parent_key: bytes, tokens: bytes, block_size: int,
                     alive: int) -> tuple[list[tuple[int, int]], list[tuple[bytes, int]]]:
        """Hash the query block by block, dropping workers at their first miss.

        Returns ``ended``: (mask of workers, number of blocks they matched) and the
        (key, holders) of matched blocks that have non-GPU holders.
        """
        step = block_size * TOKEN_BYTES
        if self._fast is not None:
            return self._fast.walk_tokens(self._nodes, parent_key, tokens, step, alive,
                                          bool(self._tiered), TIERED)
        digest = xxh3_128_digest
        if len(tokens) % step:
            tokens = tokens[: len(tokens) - len(tokens) % step]  # the partial block never matches
        if self._tiered:
            def keys() -> Iterator[bytes]:
                key = parent_key
                for (block,) in block_splitter(step)(tokens):
                    key = digest(key + block)
                    yield key

            return self._walk_keys(keys(), alive)
        # A GPU-only fleet: the same walk without looking for other tiers.
        get_node = self._nodes.get
        ended: list[tuple[int, int]] = []
        position = -1
        for position, (block,) in enumerate(block_splitter(step)(tokens)):
            parent_key = digest(parent_key + block)
            held = get_node(parent_key, 0) & alive
            if held != alive:
                ended.append((alive ^ held, position))
                alive = held
                if not alive:
                    return ended, []
        ended.append((alive, position + 1))
        return ended, []

    def _walk_keys(self, keys: Iterable[bytes], alive: int,
                   ) -> tuple[list[tuple[int, int]], list[tuple[bytes, int]]]:
        """``_walk_tokens``' answer for a query's block keys, in order (a token walk's, a
        lookahead walk's, or the keys a hash path resolved to)."""
        get_node = self._nodes.get
        ended: list[tuple[int, int]] = []
        tiered_hits: list[tuple[bytes, int]] = []
        position = -1
        for position, key in enumerate(keys):
            value = get_node(key, 0)
            held = value & alive
            if held != alive:
                ended.append((alive ^ held, position))
                alive = held
                if not alive:
                    return ended, tiered_hits
            if value & TIERED:
                tiered_hits.append((key, alive))
        ended.append((alive, position + 1))
        return ended, tiered_hits

    def match_hashes(
        self,
        block_hashes: Sequence[BlockHash],
        *,
        workers: Iterable[WorkerKey] | None = None,
    ) -> dict[WorkerKey, Match]:
        """Like ``match`` for a prompt given as vLLM block hashes (first block first).

        Each hash is resolved to content through any worker's handles; the resolved block
        must be a first block for the first hash and a child of the previous block after
        that (checked by the parent fingerprint, so a hash that means something else in
        another worker's hash space is not taken). The path stops at the first hash that
        does not resolve; then every selected worker is answered as for tokens.
        """
        targets = self._select(workers)
        path = self._resolve_path(_normalized_hashes(block_hashes)) if block_hashes else []
        alive = 0
        for w in targets:
            alive |= w.bit
        if not alive:
            return {}
        ended, tiered_hits = self._walk_keys(path, alive)
        result: dict[WorkerKey, Match] = {}
        self._assemble(result, targets, ended, tiered_hits, None)
        return result

    def _resolve_path(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """The content keys a hash path leads to; the worker that resolved the previous
        hash is asked first (a path usually comes from one hash space)."""
        path: list[bytes] = []
        everyone = list(self._workers.values())
        recent: _Worker | None = None
        expected = None  # the fingerprint bits the next block's node must carry
        for block_hash in block_hashes:
            found = None
            if recent is not None:
                found = self._linked_key(recent, block_hash, expected)
            if found is None:
                for w in everyone:
                    found = self._linked_key(w, block_hash, expected)
                    if found is not None:
                        recent = w
                        break
                else:
                    break
            path.append(found)
            expected = _fingerprint_bits(found)
        return path

    def _linked_key(self, w: _Worker, block_hash: BlockHash,
                    expected: int | None) -> bytes | None:
        """The key ``w`` holds under ``block_hash`` if it continues the path (``expected``
        None: if it is a first block), else None."""
        key = w.handles.get(block_hash)
        if key is None:
            return None
        value = self._nodes[key]
        if expected is None:
            return key if value & FIRST else None
        return key if not value & FIRST and value & FP_FIELD == expected else None

    def _assemble(self, result: dict[WorkerKey, Match], members: list[_Worker],
                  ended: list[tuple[int, int]], tiered_hits: list[tuple[bytes, int]],
                  block_size: int | None) -> None:
        """Turn a walk into one ``Match`` per member (``block_size`` None: each its own).

        ``ended`` holds (workers, blocks matched) in walk order, every member in one entry.
        """
        slow = self._slow_tiers(tiered_hits)
        make = _new_match
        for w in members:
            bit = w.bit
            blocks = 0
            for mask, count in ended:
                if mask & bit:
                    blocks = count
                    break
            size = w.block_size if block_size is None else block_size
            cpu, storage = slow.get(bit, _NO_SLOW_TIERS) if slow else _NO_SLOW_TIERS
            result[w.worker] = make(
                blocks, blocks * size, size,
                {"GPU": blocks - cpu - storage, "CPU": cpu, "STORAGE": storage},
            )

    def _assemble_holders(self, result: dict[WorkerKey, Match], ended: list[tuple[int, int]],
                          tiered_hits: list[tuple[bytes, int]], block_size: int) -> None:
        """``_assemble`` for the workers that matched a block, found from ``ended`` alone.
        Those that ended together with every block on GPU share one ``Match`` (immutable):
        the holders of a shared prefix cost one, not one each."""
        slow = self._slow_tiers(tiered_hits)
        by_slot = self._by_slot
        make = _new_match
        for mask, blocks in ended:
            if blocks <= 0:
                continue
            on_gpu = None
            while mask:
                low = mask & -mask
                mask ^= low
                w = by_slot[low.bit_length() - 1 - SLOT_SHIFT]
                if w is None:
                    continue
                cpu, storage = slow.get(low, _NO_SLOW_TIERS) if slow else _NO_SLOW_TIERS
                if cpu or storage:
                    result[w.worker] = make(
                        blocks, blocks * block_size, block_size,
                        {"GPU": blocks - cpu - storage, "CPU": cpu, "STORAGE": storage})
                else:
                    if on_gpu is None:
                        on_gpu = make(blocks, blocks * block_size, block_size,
                                      {"GPU": blocks, "CPU": 0, "STORAGE": 0})
                    result[w.worker] = on_gpu

    def _slow_tiers(self, tiered_hits: list[tuple[bytes, int]]) -> dict[int, list[int]]:
        """Per worker bit, [CPU, STORAGE] blocks among a walk's ``tiered_hits``: tallied
        per distinct holder mask, then spread over the bits."""
        slow: dict[int, list[int]] = {}
        if tiered_hits:
            tally: Counter[tuple[int, int]] = Counter()
            tiered = self._tiered
            for key, holders in tiered_hits:
                cpu_mask, storage_mask = tiered[key]
                tally[(cpu_mask & holders, storage_mask & holders)] += 1
            for (cpu_mask, storage_mask), count in tally.items():
                for tier_index, mask in ((0, cpu_mask), (1, storage_mask)):
                    while mask:
                        low = mask & -mask
                        mask ^= low
                        slow.setdefault(low, [0, 0])[tier_index] += count
        return slow

    def _select(self, workers: Iterable[WorkerKey] | None) -> list[_Worker]:
        if workers is None:
            return list(self._workers.values())
        known = self._workers
        return [known[w] for w in dict.fromkeys(workers) if w in known]

    # ------------------------------------------------------------------ statistics

    def stats(self) -> IndexStats:
        """Counts, holdings and an estimate of the index's memory.

        ``estimated_bytes`` adds the exact table sizes of every dict and compiled table
        (``sys.getsizeof``; a compiled table's records are in its size) to the objects they
        reference, each sized from a sample of its entries (64 of the nodes; 8 of each of up
        to 64 workers' tables): per node kept as objects one packed value; per handle kept as
        objects one engine hash and one key object (a handle made by the worker that created
        the node shares the node's key, so this errs high by up to one key per node). Costs
        O(workers), not O(nodes).
        """
        loose_nodes = _as_objects(self._nodes)
        size = sys.getsizeof(self._nodes) + sys.getsizeof(self._tiered)
        size += len(loose_nodes) * _mean_size(loose_nodes.values())
        size += len(self._tiered) * (sys.getsizeof([0, 0]) + 2 * _mean_size(
            v for entry in islice(self._tiered.values(), 32) for v in entry))
        key_size = sys.getsizeof(b"\0" * 16)
        # Entry sizes from a sample of the workers' tables (entries are alike across
        # workers): sampling each worker's would make a /metrics scrape grow with the fleet.
        sample = list(islice(self._workers.values(), 64))
        handle_size = _mean_size(
            (h for w in sample for h in islice(_as_objects(w.handles).keys(), 8)), 512)
        count_size = _mean_size((c for w in sample for c in islice(w.counts.values(), 8)), 512)
        node_count_size = _mean_size(
            (c for w in sample for c in islice(w.node_counts.values(), 8)), 512)
        holdings: dict[Hashable, dict[str, int]] = {}
        for w in self._workers.values():
            holdings[w.worker] = dict(zip(TIER_NAMES, w.held, strict=True))
            size += sys.getsizeof(w) + sys.getsizeof(w.held) + sys.getsizeof(w.groups)
            for table in (w.handles, w.counts, w.node_counts):
                size += sys.getsizeof(table)
            size += (len(_as_objects(w.handles)) * (handle_size + key_size)
                     + len(w.counts) * count_size + len(w.node_counts) * node_count_size)
        size += sys.getsizeof(self._workers) + sys.getsizeof(self._by_slot)
        return IndexStats(
            nodes=len(self._nodes),
            workers=len(self._workers),
            holdings=holdings,
            orphaned_blocks=self._orphaned_blocks,
            unknown_removals=self._unknown_removals,
            ignored_blocks=self._ignored_blocks,
            ignored_removals=self._ignored_removals,
            hash_conflicts=self._hash_conflicts,
            estimated_bytes=size,
        )

    # ------------------------------------------------------------------ self-check

    def _check(self) -> None:
        """Verify the layout invariants stated in this module's docstring; raises
        ``AssertionError`` naming the first one broken. Walks everything: for tests and
        debugging, never on a serving path."""

        def require(condition: object, message: str) -> None:
            if not condition:
                raise AssertionError(f"prefix index layout: {message}")

        nodes, tiered = self._nodes, self._tiered
        for key, value in nodes.items():
            require(value >= HOLDERS_MIN, f"node {key.hex()} has no holder")
            require(bool(value & TIERED) == (key in tiered),
                    f"node {key.hex()}: TIERED bit disagrees with the tier table")
        for key, (cpu_mask, storage_mask) in tiered.items():
            require(cpu_mask or storage_mask, f"tier entry {key.hex()} is empty")
            require(not cpu_mask & storage_mask,
                    f"tier entry {key.hex()} names a worker in two tiers")
        for w in self._workers.values():
            name = repr(w.worker)
            require(self._by_slot[w.slot] is w, f"{name} is not in its slot {w.slot}")
            keys = set(w.handles.values())
            require(keys == {k for k, v in nodes.items() if v & w.bit},
                    f"{name}: holder bits differ from its handles")
            require(set(w.counts) <= set(w.handles), f"{name}: counts without a handle")
            require(set(w.node_counts) <= keys, f"{name}: node counts without a handle")
            require(all(packed and packed != GPU_ONCE for packed in w.counts.values()),
                    f"{name}: a stored count that should be implicit")
            for tier in (GPU, CPU, STORAGE):
                held = sum(1 for h in w.handles if count_in(w.counts.get(h, GPU_ONCE), tier))
                require(w.held[tier] == held, f"{name}: held[{TIER_NAMES[tier]}] is "
                        f"{w.held[tier]}, its handles say {held}")
            summed: dict[bytes, int] = {}
            for block_hash, key in w.handles.items():
                summed[key] = summed.get(key, 0) + w.counts.get(block_hash, GPU_ONCE)
            for key, total in summed.items():
                require(w.node_counts.get(key, GPU_ONCE) == total,
                        f"{name}: node count of {key.hex()} is not the sum of its handles")
                tier = fastest(total)
                cpu_mask, storage_mask = tiered.get(key, (0, 0))
                require(bool(cpu_mask & w.bit) == (tier == CPU)
                        and bool(storage_mask & w.bit) == (tier == STORAGE),
                        f"{name}: tier masks of {key.hex()} disagree with its counts")
        for w in self._workers.values():
            name = repr(w.worker)
            require(not set(w.unconfirmed) & set(w.handles),
                    f"{name}: a hash both held and unconfirmed")
            require(w.unconfirmed_keys == dict(Counter(w.unconfirmed.values())),
                    f"{name}: unconfirmed key counts differ from its unconfirmed hashes")
            require(bool(w.unconfirmed) == (w.worker in self._unconfirmed_until),
                    f"{name}: unconfirmed blocks without an expiry, or the reverse")
        require(sorted(self._free_slots)
                == [slot for slot, w in enumerate(self._by_slot) if w is None],
                "free slots differ from the empty ones")
        sized: dict[int, int] = {}
        for w in self._workers.values():
            if w.block_size:
                sized[w.block_size] = sized.get(w.block_size, 0) | w.bit
        require(self._sized == sized, "the workers of each block size differ from _sized")


class HoldingsCapture:
    """One worker's holdings as ``PrefixIndex.capture`` copied them, made into ``Holdings``
    pieces later, a piece at a time (the caller yields to its loop between pieces).

    A node's position bits depend on its key alone, so they are read from the live index
    when a piece is made and are what they were at the capture. A block whose every holder
    dropped it since then has no node to read them from: it is left out. It was evicted
    after the capture, so the events that follow the capture's seq remove it anyway (as a
    removal of an unknown block).
    """

    __slots__ = ("_nodes", "_handles", "_counts", "block_size", "groups")

    def __init__(self, nodes: dict[bytes, int], handles: dict[BlockHash, bytes],
                 counts: dict[BlockHash, int], block_size: int,
                 groups: list[tuple[int, bool]]) -> None:
        self._nodes = nodes
        self._handles = handles
        self._counts = counts
        self.block_size = block_size
        self.groups = groups

    def __len__(self) -> int:
        return len(self._handles)

    def pieces(self, size: int) -> Iterator[Holdings]:
        """The holdings in pieces of at most ``size`` blocks (one empty piece for a worker
        that holds nothing)."""
        get = self._nodes.get
        counts = self._counts
        if not self._handles:  # still says the block size and groups
            yield Holdings(self.block_size, self.groups, [], [], [], {})
        # A piece's worth at a time, so that no step lists the whole capture (the copy is
        # this object's own: nothing changes it while it is walked).
        items = iter(self._handles.items())
        while chunk := list(islice(items, size)):
            piece_hashes = [block_hash for block_hash, _ in chunk]
            piece_keys = [key for _, key in chunk]
            values = [get(key) for key in piece_keys]
            if None in values:  # evicted since the capture
                kept = [i for i, value in enumerate(values) if value is not None]
                piece_hashes = [piece_hashes[i] for i in kept]
                piece_keys = [piece_keys[i] for i in kept]
                values = [values[i] for i in kept]
            piece_counts = {}
            if counts:
                piece_counts = {i: _per_tier(counts[h])
                                for i, h in enumerate(piece_hashes) if h in counts}
            yield Holdings(self.block_size, self.groups, piece_hashes, piece_keys,
                           [value & POSITION for value in values], piece_counts)


def _per_tier(packed: int) -> tuple[int, int, int]:
    """A packed count as (GPU, CPU, STORAGE): msgpack ints stop at 64 bits."""
    return (count_in(packed, GPU), count_in(packed, CPU), count_in(packed, STORAGE))


def _packed(per_tier: Sequence[int]) -> int:
    return sum(count * unit for count, unit in zip(per_tier, UNITS, strict=True))


_NO_SLOW_TIERS = (0, 0)
_new_object = object.__new__
_set_blocks = Match.__dict__["blocks"].__set__
_set_tokens = Match.__dict__["tokens"].__set__
_set_block_size = Match.__dict__["block_size"].__set__
_set_by_medium = Match.__dict__["by_medium"].__set__
_set_pending = Match.__dict__["pending"].__set__


def _new_match(blocks: int, tokens: int, block_size: int, by_medium: dict[str, int]) -> Match:
    """``Match(...)`` at half the cost: a frozen dataclass's __init__ goes through
    object.__setattr__ per field; the slot descriptors set the same fields directly."""
    match = _new_object(Match)
    _set_blocks(match, blocks)
    _set_tokens(match, tokens)
    _set_block_size(match, block_size)
    _set_by_medium(match, by_medium)
    _set_pending(match, 0)
    return match


def _as_objects(table: dict[Any, Any]) -> dict[Any, Any]:
    """The entries of a node or handle table kept as Python objects: all of a dict's, the
    ``_other`` dict of a compiled table (index/_tables.pxi)."""
    return table if type(table) is dict else table._other  # type: ignore[attr-defined]


def _mean_size(values: Iterable[object], limit: int = 64) -> int:
    sample = list(islice(values, limit))
    if not sample:
        return 0
    return sum(sys.getsizeof(v) for v in sample) // len(sample)


__all__ = ["HoldingsCapture", "PrefixIndex"]
