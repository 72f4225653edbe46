"""What the hostile-publisher and huge-store tests share: a worker, chains and random events,
an index that watches the loop, and the truth a ledger of published batches implies."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
from typing import Any

from hypothesis import strategies as st

from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.index import PrefixIndex
from tests.support.events import Ledger
from tests.support.waiting import wait_until

WORKER = ("vllm-a", 0)
SERVING = ("live", "degraded")


def snapshot(index: PrefixIndex, *, counters: bool = True) -> dict[str, Any]:
    """A deep copy of everything a PrefixIndex holds, comparable between two indexes whose
    workers arrived in the same order. ``counters=False`` leaves out the cumulative counters
    (orphaned blocks, unknown removals, ...), which a clear does not reset; the estimate of
    memory is always left out (a dict's table size depends on its history)."""
    workers = {name: (w.slot, w.block_size, w.handles, w.counts, w.node_counts, w.held,
                      w.groups) for name, w in index._workers.items()}
    state: dict[str, Any] = {"nodes": index._nodes, "tiered": index._tiered,
                             "workers": workers, "guesses": index.placements._guessed}
    stats = dataclasses.replace(index.stats(), estimated_bytes=0)
    state["stats"] = stats if counters else (stats.nodes, stats.workers, stats.holdings)
    return copy.deepcopy(state)


def chain(first_hash: int, blocks: int, *, parent: int | None = None, block_size: int = 4,
          seed: int = 0, **fields: Any) -> BlockStored:
    """A BlockStored of ``blocks`` blocks hashed first_hash, first_hash + 1, ..."""
    rng = random.Random(seed)
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + blocks)), parent_block_hash=parent,
        token_ids=[rng.randrange(50_000) for _ in range(blocks * block_size)],
        block_size=block_size, **fields)


async def settled(sub: Subscriber, ledger: Ledger, states: tuple[str, ...] = SERVING,
                  what: str = "the last batch") -> None:
    """Until the subscriber is in one of ``states`` with the ledger's last batch applied."""
    await wait_until(lambda: sub.status.state in states and sub.status.last_seq == ledger.last,
                     what, detail=lambda: sub.status)


def truth_of(ledger: Ledger, seqs: list[int] | None = None) -> PrefixIndex:
    """A fresh PrefixIndex given the ledger's batches (all, or ``seqs``) whole, in order."""
    truth = PrefixIndex()
    ledger.apply_to(truth, WORKER, seqs)
    return truth


class LoopWatchingIndex(PrefixIndex):
    """A PrefixIndex that records the most blocks applied between two turns of the event
    loop; ``count_turns`` (a concurrent task) counts the turns."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0
        self.turns_with_work: set[int] = set()
        self.most_between_turns = 0
        self._since_turn = 0
        self._in_run = False

    def _applying(self, blocks: int) -> None:
        if self.turns not in self.turns_with_work:
            self.turns_with_work.add(self.turns)
            self._since_turn = 0
        self._since_turn += blocks
        self.most_between_turns = max(self.most_between_turns, self._since_turn)

    def apply_stored(self, worker, block_hashes, *args, **kwargs) -> None:
        if not self._in_run:
            self._applying(len(block_hashes))
        super().apply_stored(worker, block_hashes, *args, **kwargs)

    def apply_removed(self, worker, block_hashes, **kwargs) -> None:
        if not self._in_run:
            self._applying(len(block_hashes))
        super().apply_removed(worker, block_hashes, **kwargs)

    def apply_run(self, *args, **kwargs):
        """A run of plain events (index.runs) is one call, whichever loops apply it (the
        pure one calls the two methods above): its blocks count once, all in this turn."""
        self._in_run = True
        try:
            done = super().apply_run(*args, **kwargs)
        finally:
            self._in_run = False
        if done.blocks:
            self._applying(done.blocks)
        return done

    async def count_turns(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.turns += 1
            await asyncio.sleep(0)


POOL = st.integers(0, 30)  # few hashes: repeats, conflicts, held hashes at slice boundaries


BLOCK_SIZES = st.sampled_from([2, 4, 64])  # 64: a slice is bounded by tokens, not blocks


@st.composite
def stores(draw) -> BlockStored:
    blocks = draw(st.integers(1, 12))
    block_size = draw(BLOCK_SIZES)
    fits = draw(st.sampled_from([True] * 9 + [False]))  # sometimes a malformed event
    tokens = draw(st.lists(st.integers(0, 3), min_size=blocks * block_size - (not fits),
                           max_size=blocks * block_size - (not fits)))
    bad_token = draw(st.sampled_from([None] * 8 + [-1, 2**32]))  # the index refuses these
    if bad_token is not None and tokens:
        tokens[draw(st.integers(0, len(tokens) - 1))] = bad_token
    extra = draw(st.none() | st.lists(st.sampled_from([None, None, ("img",), ("x", "salt")]),
                                      min_size=blocks, max_size=blocks))
    offload = draw(st.sampled_from([False] * 5 + [True]))
    return BlockStored(
        block_hashes=draw(st.lists(POOL, min_size=blocks, max_size=blocks)),
        parent_block_hash=draw(st.none() | POOL),
        token_ids=[] if offload else tokens, block_size=0 if offload else block_size,
        extra_keys=None if offload else extra,
        medium=draw(st.sampled_from([None, None, "GPU", "CPU", "TAPE"])),
        lora_name=draw(st.sampled_from([None, None, "x"])),
        group_idx=draw(st.sampled_from([0, 0, 1])),
        kv_cache_spec_kind=draw(st.sampled_from([None, None, "sliding_window"])))


removals = st.builds(BlockRemoved, block_hashes=st.lists(POOL, min_size=1, max_size=15),
                     medium=st.sampled_from([None, "CPU"]), group_idx=st.sampled_from([0, 1]))


events = st.one_of(stores(), stores(), removals, st.just(AllBlocksCleared()))


def outcome(apply: Any) -> str | None:
    """None if ``apply()`` went through, the ValueError's message if the index refused."""
    try:
        apply()
    except ValueError as exc:
        return str(exc)
    return None
