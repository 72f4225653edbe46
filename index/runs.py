"""Runs of plain events: a batch's common events applied in one call, not one call each.

A fleet's steady stream is almost only *plain* events: GPU stores of whole blocks with no
LoRA, no extra keys and a parent the worker holds (or none), and GPU removals of hashes,
in KV-cache group 0. ``apply_run`` applies consecutive plain events of a decoded batch
from ``start`` and stops at the first one that is not plain (the caller applies that one
through ``PrefixIndex.apply_stored``/``apply_removed`` itself, with whatever else it does
for such events: caps, slices, counting) or that does not fit the caller's budget. The
compiled index also takes, instead of decoded events, its own reading of a payload whose
every event passes this module's checks of an event alone (``read_plain_batch``).

Invariants:

- Applying a run leaves the index exactly as calling ``apply_stored``/``apply_removed``
  once per event, in order, would (this module's pure loop does just that; the compiled
  ``index._fast.apply_run`` does the same work inline, and the tests check they agree).
- Whether an event is plain is decided before anything changes for it, from the event and
  the worker's state: an event ``apply_stored`` would reject (``ValueError`` before any
  change) is never plain, nor is one that would be refused for a cap.
- The run stops *before* an event whose work (``RunLimits.work``) does not fit in
  ``work_left``, or after ``events_left`` events, and says so (``Run.full``): the caller
  lets its event loop run, then calls again from ``Run.next``.
- A failure while applying event k (only an internal limit, such as a reference count
  overflow, can raise then) ends the run at k + 1 with the exception in ``Run.error``:
  event k may be half applied, as it would be through ``apply_stored``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from kvroute.index.prefix_index import PrefixIndex

#: A store's work counts a block per this many tokens at least (its hashing grows with them).
TOKENS_PER_WORK = 16
_TOKEN_LIMIT = 2**32
#: The KV-cache spec kinds the index indexes (``prefix_index.INDEXED_KINDS``).
PLAIN_KINDS = (None, "full_attention", "mla_attention", "sink_full_attention")
#: A bigger block size is never plain (it keeps the compiled loop's sizes in machine ints).
MAX_PLAIN_BLOCK_SIZE = 2**20


@dataclass(frozen=True, slots=True)
class RunLimits:
    """What the caller's events are and what it refuses: its store and removal event
    classes (attributes as vLLM's ``BlockStored``/``BlockRemoved``; a class or a tuple of
    them, as ``isinstance`` takes), the most blocks one
    event (or slice of work) may have, and the most blocks a worker may hold."""

    stored: type | tuple[type, ...]
    removed: type | tuple[type, ...]
    max_event_blocks: int
    max_worker_blocks: int
    max_work: int


@dataclass(slots=True)
class Run:
    """What ``apply_run`` did: events ``[start, next)`` applied, ``blocks`` stored or
    removed by them, ``work`` they cost; ``full`` when it stopped for the budget."""

    next: int
    blocks: int = 0
    work: int = 0
    full: bool = False
    error: BaseException | None = None


def work_of(blocks: int, tokens: int) -> int:
    """A store's or removal's work: its blocks, or its tokens / ``TOKENS_PER_WORK``."""
    return max(blocks, tokens // TOKENS_PER_WORK)


def _plain_hashes(hashes: Any) -> bool:
    return type(hashes) is list and all(type(h) is int and h >= 0 for h in hashes)


_token_list = msgspec.msgpack.Decoder(list[int])


def token_list(tokens: Any) -> Any:
    """A store's token ids as a list: ``msgspec.Raw`` ones (still msgpack) decoded, None when
    they are not a list of ints; anything else as it is."""
    if type(tokens) is not msgspec.Raw:
        return tokens
    try:
        return _token_list.decode(tokens)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def on_gpu_group_zero(event: Any) -> bool:
    """Whether a store or removal names the GPU tier (or none), KV-cache group 0 (or none)
    and no locality: the only place a run applies."""
    return (event.medium in (None, "GPU") and event.group_idx in (None, 0)
            and getattr(event, "locality", None) is None)


def plain_store(index: PrefixIndex, worker: Hashable, event: Any, limits: RunLimits) -> bool:
    """Whether a store event is plain for ``worker`` now (module docstring). Its token ids
    may be a list or ``msgspec.Raw`` (a msgpack array of ints)."""
    if not on_gpu_group_zero(event):
        return False
    if (event.kv_cache_spec_kind not in PLAIN_KINDS or event.lora_name is not None
            or event.lora_id is not None
            or getattr(event, "lookahead_token_ids", None) is not None):
        return False
    hashes, tokens, size = event.block_hashes, token_list(event.token_ids), event.block_size
    blocks = len(hashes) if type(hashes) is list else -1
    extra = event.extra_keys
    if extra is not None and (type(extra) is not list or len(extra) != blocks
                              or extra.count(None) != blocks):
        return False
    if (blocks <= 0 or blocks > limits.max_event_blocks or type(size) is not int
            or not 0 < size <= MAX_PLAIN_BLOCK_SIZE
            or type(tokens) is not list or len(tokens) != blocks * size):
        return False
    if work_of(blocks, len(tokens)) > limits.max_work or not _plain_hashes(hashes):
        return False
    if not all(type(t) is int and 0 <= t < _TOKEN_LIMIT for t in tokens):
        return False
    w = index._workers.get(worker)
    # A worker whose engine hashes lookahead: its store without them means another engine.
    if w is None or w.lookahead or len(w.handles) + blocks > limits.max_worker_blocks:
        return False
    parent = event.parent_block_hash
    if parent is None:
        return True
    return type(parent) is int and parent >= 0 and parent in w.handles


def plain_removal(index: PrefixIndex, worker: Hashable, event: Any, limits: RunLimits) -> bool:
    """Whether a removal event is plain for ``worker`` now (module docstring)."""
    if not on_gpu_group_zero(event):
        return False
    hashes = event.block_hashes
    if not _plain_hashes(hashes) or len(hashes) > limits.max_work:
        return False
    w = index._workers.get(worker)
    return (w is not None and w.groups.get(0) is not False and not w.counts
            and not w.node_counts)


def runnable(index: PrefixIndex, worker: Hashable) -> bool:
    """Whether runs apply to ``worker`` at all: it is known. Placement guesses do not stop
    a run: the blocks it stores are confirmed, as ``apply_stored`` confirms them. Nor do
    unconfirmed blocks (``restore_unconfirmed``): a store or removal naming one ends it, as
    ``apply_stored``/``apply_removed`` end it; only a store whose parent is unconfirmed is
    not plain (``plain_store``)."""
    return worker in index._workers


def apply_run(index: PrefixIndex, worker: Hashable, events: Sequence[Any], start: int,
              work_left: int, events_left: int, limits: RunLimits) -> Run:
    """The reference loop: each plain event through the index's own methods."""
    run = Run(start)
    if not runnable(index, worker):
        return run
    for k in range(start, len(events)):
        if k - start >= events_left:
            run.full = True
            return run
        event = events[k]
        if isinstance(event, limits.stored):
            if not plain_store(index, worker, event, limits):
                return run
            tokens = token_list(event.token_ids)
            work = work_of(len(event.block_hashes), len(tokens))
            if work > work_left:
                run.full = True
                return run
            try:
                index.apply_stored(worker, event.block_hashes, event.parent_block_hash,
                                   tokens, event.block_size, medium="GPU",
                                   group_idx=0, kv_cache_spec_kind=event.kv_cache_spec_kind,
                                   extra_keys=event.extra_keys)
            except Exception as exc:  # only an internal limit: handed to the caller
                run.next, run.error = k + 1, exc
                return run
        elif isinstance(event, limits.removed):
            if not plain_removal(index, worker, event, limits):
                return run
            work = len(event.block_hashes)
            if work > work_left:
                run.full = True
                return run
            index.apply_removed(worker, event.block_hashes, medium="GPU", group_idx=0)
        else:
            return run
        run.next = k + 1
        run.blocks += len(event.block_hashes)
        run.work += work
        work_left -= work
    return run

