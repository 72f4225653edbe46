"""One event of the compiled index's reading of a payload (``read_plain_batch``), rebuilt
as the decoder's events a slice at a time.

A payload too big to decode in one call is read by the index into its C arrays in one
pass instead (``app.ingest.apply``), and runs apply its events from there. An event no run
takes (a parent the worker does not hold, a worker not known yet, more work than a run
may do) is applied the ordinary way, from these slices: its Python objects are made one
slice at a time, never for the whole event at once.

Invariants:

- Every event of such a reading is plain in form (``index._batch``): a GPU (or unnamed)
  store or removal in KV-cache group 0 (or none), of an indexed kind, with no LoRA and no
  extra keys but nils. Rebuilt with those fields at their defaults, an event changes the
  index exactly as the decoder's event would (``wire.apply_event``: no medium is GPU, no
  group is 0, every indexed kind alike, all-nil extra keys as none).
- The slices are ``wire.slices``' slices of the decoded event, cut at the same blocks:
  applied in order, they leave the index exactly as the whole event would. A chain whose
  parent the worker does not hold (asked once, before the first slice) names that parent
  in every slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvroute.app.ingest.wire import SLICE_TOKENS_PER_BLOCK, BlockRemoved, BlockStored, Hash

__all__ = ["event_slices"]


def event_slices(plain: Any, k: int, max_blocks: int, holds: Callable[[Hash], bool],
                 ) -> Iterator[BlockStored | BlockRemoved]:
    """Event ``k`` of ``plain`` (a ``PlainBatch``) as slices of at most ``max_blocks``
    blocks (a store's also of at most ``max_blocks * SLICE_TOKENS_PER_BLOCK`` tokens, one
    block at least); ``holds(parent)`` says whether the worker holds a split store's
    parent."""
    kind, blocks, parent, block_size = plain.head(k)
    if kind == "BlockRemoved":
        for start in range(0, max(blocks, 1), max_blocks):
            hashes, _ = plain.piece(k, start, min(blocks, start + max_blocks))
            yield BlockRemoved(block_hashes=hashes)
        return
    per_slice = max(1, min(max_blocks, max_blocks * SLICE_TOKENS_PER_BLOCK // block_size))
    chained = blocks <= per_slice or parent is None or holds(parent)
    for start in range(0, blocks, per_slice):
        hashes, tokens = plain.piece(k, start, min(blocks, start + per_slice))
        yield BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                          block_size=block_size)
        if chained:
            parent = hashes[-1]
