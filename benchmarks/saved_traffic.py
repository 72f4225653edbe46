"""The traffic of the saved-state benchmark (``benchmarks.saved_state``): what each
simulated vLLM rank publishes.

Each rank's batches store 16-token blocks with random uint64 hashes, requests of 1 to 64
blocks hanging off shared system prompts (each rank its own hashes for them), a fraction
of the content also cached by another rank; ``before`` fills the rank to the size asked
for, ``after`` goes on at capacity (stores and the evictions that match them).
"""

from __future__ import annotations

import random
from array import array
from collections import deque
from dataclasses import dataclass, field

from kvroute.app.ingest.wire import BlockRemoved, BlockStored, Event, encode_batch

BLOCK = 16
SYSTEM_PROMPTS = 32
SHARED = 0.2  # fraction of a rank's requests whose content another rank caches too
AFTER_BATCHES = 20  # batches each rank publishes between the save and the second kvroute


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return array("H", rng.randbytes(2 * count)).tolist()


def random_hashes(rng: random.Random, count: int) -> list[int]:
    """Unsigned 64-bit block hashes, as vLLM's (about half of them >= 2**63)."""
    return array("Q", rng.randbytes(8 * count)).tolist()


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    """A BlockStored with every field vLLM 0.32.0 fills."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BLOCK, medium="GPU", extra_keys=[None] * len(hashes),
                       group_idx=0, kv_cache_spec_kind="full_attention")


@dataclass
class Rank:
    """One vLLM rank's traffic: the batches up to the save, and those after it."""

    instance: str
    before: list[bytes] = field(default_factory=list)
    after: list[bytes] = field(default_factory=list)
    blocks: int = 0  # blocks held after ``before`` (and after ``after``: evictions match)


class RankTraffic:
    """Makes one rank's requests: its own hashes for the shared system prompts, which of
    those it cached already, and its request blocks oldest first (what evictions take)."""

    def __init__(self, rng: random.Random, system: list[list[int]],
                 pool: list[tuple[int, list[int]]]) -> None:
        self.rng = rng
        self.system = system
        self.pool = pool
        self.system_hashes = [random_hashes(rng, len(p) // BLOCK) for p in system]
        self.shared_order = rng.sample(range(len(pool)), len(pool))
        self.cached: set[int] = set()
        self.fifo: deque[int] = deque()

    def request(self, events: list[Event]) -> int:
        """Stores one request's blocks (and its system prompt's, the first time); returns
        how many blocks it stored."""
        rng = self.rng
        if rng.random() < SHARED and self.shared_order:
            which, tail = self.pool[self.shared_order.pop()]
        else:
            which, tail = pick_prompt(rng), random_tokens(rng, BLOCK * rng.randint(1, 64))
        hashes = random_hashes(rng, len(tail) // BLOCK)
        prompt_hashes = self.system_hashes[which]
        self.fifo.extend(hashes)
        if which in self.cached:
            events.append(stored(hashes, prompt_hashes[-1], tail))
            return len(hashes)
        self.cached.add(which)
        events.append(stored(prompt_hashes + hashes, None, self.system[which] + tail))
        return len(prompt_hashes) + len(hashes)


def pick_prompt(rng: random.Random) -> int:
    """Which system prompt a request starts with (a few are far more common)."""
    return min(int(rng.paretovariate(1.2)) - 1, SYSTEM_PROMPTS - 1)


def build_traffic(workers: int, blocks_per_worker: int, seed: int = 19) -> list[Rank]:
    rng = random.Random(seed)
    system = [random_tokens(rng, BLOCK * rng.randint(2, 32)) for _ in range(SYSTEM_PROMPTS)]
    # Content several ranks cache: each entry is used by about two ranks.
    requests_per_rank = blocks_per_worker / 32.5
    pool = [(pick_prompt(rng), random_tokens(rng, BLOCK * rng.randint(1, 64)))
            for _ in range(max(8, int(requests_per_rank * SHARED * workers / 2)))]
    ranks = []
    for w in range(workers):
        rank = Rank(f"vllm-{w}")
        traffic = RankTraffic(rng, system, pool)
        ts = 1_700_000_000.0 + w
        while rank.blocks < blocks_per_worker:
            events: list[Event] = []
            for _ in range(rng.randint(1, 4)):
                rank.blocks += traffic.request(events)
            ts += 0.01
            rank.before.append(encode_batch(events, ts=ts, dp_rank=0))
        for _ in range(AFTER_BATCHES):  # the engine goes on at capacity: stores and evictions
            events = []
            added = sum(traffic.request(events) for _ in range(rng.randint(1, 4)))
            events[:0] = [BlockRemoved(block_hashes=[traffic.fifo.popleft()], medium="GPU",
                                       group_idx=0) for _ in range(added)]
            ts += 0.01
            rank.after.append(encode_batch(events, ts=ts, dp_rank=0))
        ranks.append(rank)
    return ranks
