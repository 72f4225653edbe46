"""Replaying real vLLM 0.32.0 traffic (tests/fixtures) leaves the index as the engine was.

The fixture's session (see its README): a 7-block chain of a prompt sharing a 200-token
prefix, five chains hanging off it by parent hash, twelve unrelated prompts whose stores
evict the earlier blocks, the shared prefix again, then reset_prefix_cache (AllBlocksCleared
and a BlockStored in one batch). The batches are decoded here with msgspec directly, and a
brute-force model of the engine's cache (hash -> token prefix, refcounts) is checked against
the index after every batch.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from kvroute.index import PrefixIndex
from tests.support.fixtures import END_SEQ, live_payloads, replay_payloads, session_frames

# Every test here runs with the compiled loops, then with the pure ones (the reference).
pytestmark = pytest.mark.usefixtures("index_implementation")

WORKER = ("vllm-cpu", 0)
BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 48


def _load() -> tuple[dict[int, bytes], dict[int, bytes]]:
    """(live payloads by seq, replay payloads by seq)."""
    assert any(kind == "replay" and frames[2] == END_SEQ for kind, frames in session_frames()), (
        "replay stream has no end marker")
    return live_payloads(), replay_payloads()


def _events(payload: bytes) -> list[dict]:
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) in (2, 3)
    return batch[1]


def _apply(index: PrefixIndex, event: dict) -> None:
    kind = event["type"]
    if kind == "BlockStored":
        index.apply_stored(
            WORKER,
            event["block_hashes"],
            event.get("parent_block_hash"),
            event.get("token_ids", []),
            event.get("block_size", 0),
            lora_name=event.get("lora_name"),
            extra_keys=event.get("extra_keys"),
            medium=event.get("medium"),
            group_idx=event.get("group_idx", 0),
            kv_cache_spec_kind=event.get("kv_cache_spec_kind"),
        )
    elif kind == "BlockRemoved":
        index.apply_removed(
            WORKER,
            event["block_hashes"],
            medium=event.get("medium"),
            group_idx=event.get("group_idx", 0),
        )
    elif kind == "AllBlocksCleared":
        index.clear_worker(WORKER)
    else:
        raise AssertionError(f"unexpected event type {kind!r} in the fixture")


class EngineModel:
    """What the engine holds, derived the slow way: hash -> full token prefix, refcounts."""

    def __init__(self) -> None:
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.refs: Counter[int] = Counter()

    def apply(self, event: dict) -> None:
        kind = event["type"]
        if kind == "BlockStored":
            parent = event.get("parent_block_hash")
            prefix = () if parent is None else self.prefix_of[parent]
            tokens = event["token_ids"]
            size = event["block_size"]
            for k, block_hash in enumerate(event["block_hashes"]):
                prefix = prefix + tuple(tokens[k * size : (k + 1) * size])
                self.prefix_of[block_hash] = prefix
                self.refs[block_hash] += 1
        elif kind == "BlockRemoved":
            for block_hash in event["block_hashes"]:
                assert self.refs[block_hash] > 0, "the fixture never removes an unheld hash"
                self.refs[block_hash] -= 1
                if not self.refs[block_hash]:
                    del self.refs[block_hash]
        else:
            self.refs.clear()

    def match(self, tokens: list[int]) -> int:
        held = {self.prefix_of[h] for h in self.refs}
        blocks = 0
        while (blocks + 1) * BLOCK_SIZE <= len(tokens):
            if tuple(tokens[: (blocks + 1) * BLOCK_SIZE]) not in held:
                break
            blocks += 1
        return blocks


def _stored_token_runs(live: dict[int, bytes]) -> list[list[int]]:
    """Every root chain's token ids: the prompts of the session, for queries."""
    runs = []
    for seq in sorted(live):
        for event in _events(live[seq]):
            if event["type"] == "BlockStored" and event.get("parent_block_hash") is None:
                runs.append(list(event["token_ids"]))
    return runs


def test_fixture_is_complete() -> None:
    live, replay = _load()
    assert sorted(live) == list(range(20))
    assert replay == live, "the replay buffer must hold exactly the live batches"


def test_live_stream_leaves_the_engine_state() -> None:
    live, _ = _load()
    index = PrefixIndex()
    model = EngineModel()
    prompts = _stored_token_runs(live)
    shared_chain = prompts[0]  # 7 blocks: the 200-token shared prefix + start of a tail
    assert len(shared_chain) == 7 * BLOCK_SIZE
    matched_after: dict[int, int] = {}
    for seq in sorted(live):
        for event in _events(live[seq]):
            _apply(index, event)
            model.apply(event)
        index._check()
        holdings = index.stats().holdings[WORKER]
        assert holdings["GPU"] == len(model.refs) <= NUM_GPU_BLOCKS, seq
        assert holdings["CPU"] == holdings["STORAGE"] == 0
        for prompt in prompts:
            got = index.match(prompt)[WORKER]
            assert got.blocks == model.match(prompt), (seq, len(prompt))
            assert got.tokens == got.blocks * BLOCK_SIZE
            assert got.by_medium == {"GPU": got.blocks, "CPU": 0, "STORAGE": 0}
        matched_after[seq] = index.match(shared_chain)[WORKER].blocks

    # The facts the session script implies, independent of the model above.
    assert matched_after[0] == 7  # the first prompt's chain
    assert matched_after[8] == 7  # three unrelated prompts fit beside it
    assert matched_after[9] == 6  # its tail block was evicted, the shared part still held
    assert matched_after[10] == 1  # the second half of the shared prefix is gone
    assert matched_after[11] == 0
    assert matched_after[18] == 6  # the shared prefix stored again, with another tail

    stats = index.stats()
    assert stats.orphaned_blocks == 0
    assert stats.unknown_removals == 0
    assert stats.ignored_blocks == stats.ignored_removals == 0
    # After reset_prefix_cache: exactly the first 96 tokens (3 blocks) of the prefix.
    assert stats.nodes == 3
    assert stats.holdings == {WORKER: {"GPU": 3, "CPU": 0, "STORAGE": 0}}
    final = index.match(shared_chain)[WORKER]
    assert (final.blocks, final.tokens, final.block_size) == (3, 96, BLOCK_SIZE)
    last_event = _events(live[19])[-1]
    assert index.match_hashes(last_event["block_hashes"])[WORKER].blocks == 3


def test_fixture_tail_chains_share_the_prefix_nodes() -> None:
    """The five chains that hang off the first one by parent hash add nodes, not copies."""
    live, _ = _load()
    index = PrefixIndex()
    for seq in range(6):
        for event in _events(live[seq]):
            _apply(index, event)
    assert index.stats().nodes == 7 + 1 + 2 + 2 + 2 + 3
    first_chain = _events(live[0])[0]["block_hashes"]
    tail = _events(live[5])[0]["block_hashes"]
    path = index.match_hashes(first_chain[:6] + tail)[WORKER]
    assert path.blocks == 9


def test_replay_rebuilds_the_same_index() -> None:
    live, replay = _load()
    from_live, from_replay = PrefixIndex(), PrefixIndex()
    for payloads, index in ((live, from_live), (replay, from_replay)):
        for seq in sorted(payloads):
            for event in _events(payloads[seq]):
                _apply(index, event)
    from_live._check()
    from_replay._check()
    for prompt in _stored_token_runs(live):
        assert from_live.match(prompt) == from_replay.match(prompt)
    assert from_live.stats().holdings == from_replay.stats().holdings
