"""The event streams of benchmarks/peer_bench.py, deterministic, with what each worker holds
at the end (to check both indexers' answers against).

Two mixes (issue: ingest faster than the strongest peer):

- ``roots``: every batch stores 8 root chains of 8 blocks (16-token blocks, content of its
  own), and removes, one hash per event as vLLM does, the blocks the worker stored ``lag``
  batches earlier. At the end each worker holds its last ``lag`` batches' chains.
- ``deep``: a pool of documents of ``doc_blocks`` blocks; each worker holds
  ``docs_per_worker`` of them (about 7 workers share each), stored 4 chains at a time in
  segments of 16 blocks that hang off the previous segment. Hashes and tokens depend on
  the content only, so every worker holding a document announces the same hashes.

Every mix's last batch of every worker also stores a marker block the same for all workers:
when an indexer shows all workers holding it, it has applied everything before it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.app.ingest.wire import BlockRemoved, BlockStored, Event, encode_batch

BLOCK = 16
CHAINS_PER_BATCH = 8
CHAIN_BLOCKS = 8
SEGMENTS_AT_ONCE = 4
SEGMENT_BLOCKS = 16
_ROOT_HASHES = 1 << 40
_DEEP_HASHES = 1 << 44
_DEEP_TOKENS = 100_000_000
_DOC_TOKENS = 40_000  # token ids per document (a 2,048-block one needs 32,768)
_MARKER_HASH = 1 << 50
_MARKER_TOKENS = 4_000_000_000


@dataclass
class Mix:
    """One mix: ``payloads[w]`` are worker w's batches in order; ``stored`` counts stored
    blocks (what blocks/s counts); ``marker`` is the marker block's tokens."""

    name: str
    payloads: list[list[bytes]]
    stored: int
    marker: list[int]
    # roots: (worker, chain tokens, held at the end?) samples to check answers against
    samples: list[tuple[int, list[int], bool]] = field(default_factory=list)
    # deep: document -> workers holding it; tokens of a document
    holders: dict[int, list[int]] = field(default_factory=dict)
    held_at_end: int = 0

    def save(self, path: Path) -> None:
        path.write_bytes(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))

    @staticmethod
    def load(path: Path) -> Mix:
        mix = pickle.loads(path.read_bytes())
        assert isinstance(mix, Mix)
        return mix


def marker_store(number: int) -> BlockStored:
    return BlockStored(block_hashes=[_MARKER_HASH + number], parent_block_hash=None,
                       token_ids=marker_tokens(number), block_size=BLOCK)


def marker_tokens(number: int) -> list[int]:
    return list(range(_MARKER_TOKENS + number * BLOCK, _MARKER_TOKENS + (number + 1) * BLOCK))


def doc_tokens(doc: int, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of a ``deep`` document."""
    start = _DEEP_TOKENS + doc * _DOC_TOKENS
    return list(range(start, start + tokens))


def roots(workers: int, blocks: int, lag: int, number: int = 0, first_chain: int = 0) -> Mix:
    """Root chains: ``first_chain`` numbers the first (another mix of other content after
    one of N chains: ``first_chain=N``)."""
    per_batch = CHAINS_PER_BATCH * CHAIN_BLOCKS
    batches = max(lag + 1, blocks // (workers * per_batch))
    payloads: list[list[bytes]] = []
    samples: list[tuple[int, list[int], bool]] = []
    for w in range(workers):
        mine: list[bytes] = []
        for i in range(batches):
            events: list[Event] = []
            for j in range(CHAINS_PER_BATCH):
                chain = first_chain + (w * batches + i) * CHAINS_PER_BATCH + j
                first = _ROOT_HASHES + chain * CHAIN_BLOCKS
                tokens = list(range(chain * CHAIN_BLOCKS * BLOCK,
                                    (chain + 1) * CHAIN_BLOCKS * BLOCK))
                events.append(BlockStored(block_hashes=list(range(first, first + CHAIN_BLOCKS)),
                                          parent_block_hash=None, token_ids=tokens,
                                          block_size=BLOCK))
                if j == 0 and i % max(1, batches // 4) == 0 and w % 8 == 0:
                    samples.append((w, tokens, i >= batches - lag))
            if i >= lag:
                old = first_chain * CHAIN_BLOCKS + (w * batches + i - lag) * per_batch
                events += [BlockRemoved(block_hashes=[_ROOT_HASHES + old + k])
                           for k in range(per_batch)]
            if i == batches - 1:
                events.append(marker_store(number))
            mine.append(encode_batch(events, ts=float(i), dp_rank=0))
        payloads.append(mine)
    return Mix("roots", payloads, workers * batches * per_batch, marker_tokens(number),
               samples=samples, held_at_end=workers * (lag * per_batch + 1))


def docs_of(worker: int, docs_per_worker: int, pool: int) -> list[int]:
    return [(worker + 4 * j) % pool for j in range(docs_per_worker)]


def deep(workers: int, docs_per_worker: int, doc_blocks: int, number: int = 1) -> Mix:
    pool = 2 * workers
    payloads: list[list[bytes]] = []
    holders: dict[int, list[int]] = {}
    for w in range(workers):
        docs = docs_of(w, docs_per_worker, pool)
        for d in docs:
            holders.setdefault(d, []).append(w)
        events: list[Event] = []
        for g in range(0, len(docs), SEGMENTS_AT_ONCE):
            for s in range(0, doc_blocks, SEGMENT_BLOCKS):
                for d in docs[g:g + SEGMENTS_AT_ONCE]:
                    first = _DEEP_HASHES + d * 4096
                    base = _DEEP_TOKENS + d * _DOC_TOKENS
                    tokens = list(range(base + s * BLOCK, base + (s + SEGMENT_BLOCKS) * BLOCK))
                    events.append(BlockStored(
                        block_hashes=list(range(first + s, first + s + SEGMENT_BLOCKS)),
                        parent_block_hash=None if s == 0 else first + s - 1,
                        token_ids=tokens, block_size=BLOCK))
        batches = [events[k:k + SEGMENTS_AT_ONCE] for k in range(0, len(events),
                                                                  SEGMENTS_AT_ONCE)]
        batches[-1].append(marker_store(number))
        payloads.append([encode_batch(b, ts=float(i), dp_rank=0) for i, b in enumerate(batches)])
    return Mix("deep", payloads, workers * docs_per_worker * doc_blocks, marker_tokens(number),
               holders=holders, held_at_end=workers * (docs_per_worker * doc_blocks + 1))
