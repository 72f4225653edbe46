"""kvroute's index, fed only the simulated engines' events, agrees with the engines' caches.

Several engines (different hash seeds, like different vLLM processes) serve random traffic
with evictions, preemptions and resets; every step's batch goes through the wire encoding
(both event encodings) and ``apply_batch`` into one fresh ``PrefixIndex``. After every step
the index's match for each engine is never above ``engine.lookup`` (no false hit), and
equals what the engine's events say by kvroute's rule: a hash is held from a store of it
until a removal of it, however often it was stored (a second real copy of a hash is then
under-reported after the first copy's eviction; docs/decisions.md). Without duplicate
copies the two are the same.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    apply_batch,
    decode_batch,
    encode_batch,
)
from kvroute.index import PrefixIndex
from kvroute.sim.engine import Engine

tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4, 16]),
    num_blocks=st.integers(6, 20),
    encoding=st.sampled_from(["map", "array"]),
    hash_format=st.sampled_from(["int", "bytes"]),
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["add", "step", "reset"]), tokens_st,
                  st.integers(1, 6)),
        min_size=1, max_size=50,
    ),
)
def test_index_fed_by_events_matches_every_engine(block_size, num_blocks, encoding,
                                                  hash_format, ops):
    engines = [
        Engine(num_blocks=num_blocks, block_size=block_size, seed=100 + i,
               max_num_seqs=3, max_num_batched_tokens=24, hash_format=hash_format)
        for i in range(3)
    ]
    workers = [(f"sim-{i}", 0) for i in range(3)]
    index = PrefixIndex()
    probes: list[list[int]] = [[0] * 40, [1, 2, 3] * 10]
    held: list[set] = [set() for _ in engines]  # each engine's hashes by kvroute's rule

    def follow(i: int, events: list) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                if parent is None or parent in held[i]:  # an orphan chain is not placed
                    held[i].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held[i].difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held[i].clear()

    def by_rule(i: int, probe: list[int]) -> int:
        blocks = 0
        for block_hash in engines[i].block_hashes(probe):
            if block_hash not in held[i]:
                break
            blocks += 1
        return blocks * engines[i].block_size

    def step(i: int) -> None:
        result = engines[i].step()
        if result.events:
            batch = decode_batch(encode_batch(result.events, dp_rank=0, encoding=encoding))
            assert batch.malformed == 0
            apply_batch(index, workers[i], batch)
            assert batch.malformed == 0, "the index refused an event the engine emitted"
            follow(i, result.events)
        for probe in probes:
            matches = index.match(probe)
            for j, engine in enumerate(engines):
                if engine.unpublished_events:
                    continue  # a reset not yet announced: the index cannot know it yet
                got = matches[workers[j]].tokens if workers[j] in matches else 0
                assert got == by_rule(j, probe) <= engine.lookup(probe), (j, probe)

    for n, (i, op, tokens, count) in enumerate(ops):
        engine = engines[i]
        if op == "add" and len(tokens) + count <= engine.max_model_len:
            engine.add_request(f"r{n}", tokens, [3] * count)
            probes.append(tokens + [3] * count)
        elif op == "step":
            for _ in range(count):
                step(i)
        elif op == "reset":
            engine.reset_prefix_cache()
    for i, engine in enumerate(engines):
        for _ in range(2000):
            if not engine.has_work():
                break
            step(i)
        step(i)  # one idle step publishes a pending AllBlocksCleared
    assert not any(engine.unpublished_events for engine in engines)
    step(0)  # every engine checked against the index with nothing left unannounced
