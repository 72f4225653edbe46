"""Random batches of plain and not-quite-plain events, as runs of the index meet them: mostly
GPU stores and removals, now and then one a run must not take."""

from __future__ import annotations

import random

import msgspec

from kvroute.app.ingest.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Payload,
    RawStored,
    decode_envelope,
    decode_events,
)

BLOCK = 4


WORKERS = [("w0", 0), ("w1", 0), ("w2", 0)]


def decoded_for_runs(payload: Payload) -> EventBatch:
    """``payload`` as the applier's decoded path decodes it for the index's runs: stores of
    a map-encoded batch keep their token ids encoded (``RawStored``)."""
    batch = decode_envelope(payload)
    batch.events = decode_events(batch.events, batch, raw_tokens=True)
    return batch


def as_raw(event: BlockStored) -> RawStored:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=RawStored)


def random_events(rng: random.Random, held: list[int], next_hash: list[int]) -> list:
    """One batch: mostly plain stores and removals, now and then something that is not."""
    events: list = []
    for _ in range(rng.randint(1, 12)):
        roll = rng.random()
        if roll < 0.5:
            blocks = rng.choice([1, 2, 3, 8, 17, 45])  # 45: over max_event_blocks
            tokens = [rng.randrange(6) for _ in range(blocks * BLOCK)]
            hashes = list(range(next_hash[0], next_hash[0] + blocks))
            next_hash[0] += blocks
            if held and rng.random() < 0.1:
                hashes[0] = rng.choice(held)  # re-announced
            parent = rng.choice(held) if held and rng.random() < 0.5 else None
            fields: dict = {}
            odd = rng.random()
            if odd < 0.04:
                parent = 10**15  # an orphan
            elif odd < 0.08:
                fields["medium"] = rng.choice(["CPU", "gpu", "GPU"])
            elif odd < 0.11:
                fields["lora_name"] = "adapter"
            elif odd < 0.14:
                fields["extra_keys"] = [None] * blocks if rng.random() < 0.5 else [("x",)] * blocks
            elif odd < 0.17:
                tokens[-1] = rng.choice([2**32, -1, 2**40])
            elif odd < 0.2:
                hashes = [h + 2**63 - 2**64 for h in hashes]  # signed spellings
            elif odd < 0.22:
                fields["kv_cache_spec_kind"] = rng.choice(["full_attention", "sliding_window"])
            elif odd < 0.24:
                fields["group_idx"] = 1
            event = BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                token_ids=tokens, block_size=BLOCK, **fields)
            held.extend(h % 2**64 for h in hashes)
            if rng.random() < 0.5:
                event = as_raw(event)
                if rng.random() < 0.05:  # token ids that are not ints at all
                    event = msgspec.structs.replace(
                        event, token_ids=msgspec.Raw(msgspec.msgpack.encode(["a"] * 4)))
            events.append(event)
        elif roll < 0.92:
            count = rng.randint(1, 6)
            hashes = [held.pop(rng.randrange(len(held))) for _ in range(min(count, len(held)))]
            if rng.random() < 0.2:
                hashes.append(10**16 + rng.randrange(3))  # unknown
            medium = rng.choice([None, None, None, "GPU", "CPU"])
            events.append(BlockRemoved(block_hashes=hashes, medium=medium))
        else:
            events.append(AllBlocksCleared())
            held.clear()
    return events
