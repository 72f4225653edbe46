"""The simulated engine against brute-force models of vLLM's prefix-cache semantics.

Two references, both keyed by token CONTENT (never by the engine's hashes):
- ``SequentialCache``: one request at a time, the free queue as a plain list; every detail of
  eviction order (least recently freed first, a request's tail before its prefix) is exact.
- ``EventModel``: what a consumer of the engine's events learns; it must always equal the
  engine's own cache, whatever the concurrency, chunking and preemption.
"""

from __future__ import annotations

from collections import Counter
from itertools import count

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.wire import AllBlocksCleared, BlockRemoved, BlockStored, apply_event
from kvroute.index import PrefixIndex
from kvroute.sim.engine import Engine, EngineError

Key = tuple[int, ...]


class SequentialCache:
    """vLLM's block pool for requests served strictly one after another."""

    def __init__(self, usable_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.queue: list[tuple[Key | None, int]] = [(None, 0)] * usable_blocks  # head first
        self.stamps = count(1)

    def cached(self) -> Counter[Key]:
        return Counter(key for key, _ in self.queue if key is not None)

    def lookup(self, tokens: list[int]) -> int:
        keys = self.cached()
        n = 0
        while (n + 1) * self.bs <= len(tokens) and tuple(tokens[: (n + 1) * self.bs]) in keys:
            n += 1
        return n * self.bs

    def serve(self, prompt: list[int], output: list[int]) -> tuple[int, Counter[Key]]:
        """Returns (cached tokens, contents evicted)."""
        bs = self.bs
        tokens = prompt + output
        computed = len(tokens) - 1  # the last sampled token is never fed back
        n_blocks = -(-computed // bs)
        keys = [tuple(tokens[: (j + 1) * bs]) for j in range(computed // bs)]
        held: list[tuple[Key | None, int]] = []
        max_hits = (len(prompt) - 1) // bs
        while len(held) < max_hits and keys[len(held)] in self.cached():
            key = keys[len(held)]
            # vLLM takes the holder that was cached first.
            entry = min((e for e in self.queue if e[0] == key), key=lambda e: e[1])
            self.queue.remove(entry)
            held.append(entry)
        hits = len(held)
        evicted: Counter[Key] = Counter()
        for j in range(hits, n_blocks):
            key, _ = self.queue.pop(0)
            if key is not None:
                evicted[key] += 1
            held.append((keys[j], next(self.stamps)) if j < len(keys) else (None, 0))
        self.queue.extend(reversed(held))  # freed tail first
        return hits * bs, evicted


class EventModel:
    """The cache as the engine's events describe it: hash -> content, and holder counts."""

    def __init__(self) -> None:
        self.content: dict[object, Key] = {}
        self.holders: Counter[object] = Counter()
        self.removed: Counter[Key] = Counter()  # every content ever evicted, with multiplicity

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                prefix = () if ev.parent_block_hash is None else self.content[ev.parent_block_hash]
                for k, h in enumerate(ev.block_hashes):
                    bs = ev.block_size
                    prefix = prefix + tuple(ev.token_ids[k * bs : (k + 1) * bs])
                    self.content[h] = prefix
                    self.holders[h] += 1
            elif isinstance(ev, BlockRemoved):
                (h,) = ev.block_hashes  # vLLM sends one hash per removal
                assert self.holders[h] > 0, "removal of a hash that is not held"
                self.holders[h] -= 1
                self.removed[self.content[h]] += 1
                if not self.holders[h]:
                    del self.holders[h]
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.holders.clear()

    def cached_contents(self) -> Counter[Key]:
        return Counter({self.content[h]: n for h, n in self.holders.items()})

    def lookup(self, tokens: list[int], bs: int) -> int:
        present = {self.content[h] for h in self.holders}
        n = 0
        while (n + 1) * bs <= len(tokens) and tuple(tokens[: (n + 1) * bs]) in present:
            n += 1
        return n * bs


def run_to_idle(engine: Engine, model: EventModel, max_steps: int = 10_000) -> list:
    finished = []
    for _ in range(max_steps):
        if not engine.has_work():
            return finished
        result = engine.step()
        model.apply(result.events)
        finished.extend(result.finished)
    raise AssertionError("engine did not go idle")


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=24)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 4),
    usable=st.integers(6, 14),
    requests=st.lists(st.tuples(tokens_st, st.lists(st.integers(0, 2), min_size=1, max_size=6)),
                      min_size=1, max_size=14),
    probes=st.lists(tokens_st, max_size=4),
)
def test_sequential_requests_match_the_brute_force_pool(block_size, usable, requests, probes):
    engine = Engine(num_blocks=usable + 1, block_size=block_size, seed=3,
                    max_num_seqs=1, max_num_batched_tokens=10_000)
    ref = SequentialCache(usable, block_size)
    events = EventModel()
    for i, (prompt, output) in enumerate(requests):
        if len(prompt) + len(output) > engine.max_model_len:
            continue
        engine.add_request(f"r{i}", prompt, output)
        removed_before = Counter(events.removed)
        (outcome,) = run_to_idle(engine, events)
        expected_cached, expected_evicted = ref.serve(prompt, output)
        assert outcome.cached_tokens == expected_cached
        assert outcome.output_tokens == tuple(output)
        assert events.cached_contents() == ref.cached()
        assert events.removed - removed_before == expected_evicted
    for probe in probes + [p for p, _ in requests]:
        assert engine.lookup(probe) == ref.lookup(probe) == events.lookup(probe, block_size)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 4),
    usable=st.integers(4, 12),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(2, 12),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), tokens_st, st.integers(1, 8)),
            st.tuples(st.just("step"), st.just(()), st.integers(1, 4)),
            st.tuples(st.just("reset"), st.just(()), st.just(0)),
        ),
        min_size=1, max_size=40,
    ),
)
def test_events_always_describe_the_cache(block_size, usable, max_num_seqs, budget, ops):
    """Concurrency, chunked prefill, preemption, duplicate stores and resets: whatever happens,
    a consumer of the events knows exactly what the engine caches, and no block leaks."""
    engine = Engine(num_blocks=usable + 1, block_size=block_size, seed=11,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    model = EventModel()
    planned: dict[str, tuple[list[int], list[int]]] = {}
    done = []

    def check() -> None:
        assert Counter(engine.cached_hashes()) == model.holders
        in_use = {id(b) for r in engine._running for b in r.blocks}
        assert engine.num_free_blocks + len(in_use) == usable
        for probe, _ in planned.values():
            assert engine.lookup(probe) == model.lookup(probe, block_size)

    for i, (op, tokens, n) in enumerate(ops):
        if op == "add":
            output = [7] * n
            if len(tokens) + n <= engine.max_model_len:
                engine.add_request(f"r{i}", tokens, output)
                planned[f"r{i}"] = (tokens, output)
        elif op == "step":
            for _ in range(n):
                if engine.has_work():
                    result = engine.step()
                    model.apply(result.events)
                    done.extend(result.finished)
                    check()
        else:
            idle_pool = engine.num_free_blocks == usable
            assert engine.reset_prefix_cache() == idle_pool
    done.extend(run_to_idle(engine, model))
    model.apply(engine.step().events)  # an idle step: a reset's AllBlocksCleared waits for one
    check()
    assert sorted(o.request_id for o in done) == sorted(planned)
    for outcome in done:
        prompt, output = planned[outcome.request_id]
        assert outcome.output_tokens == tuple(output)
        assert outcome.cached_tokens % block_size == 0
        assert 0 <= outcome.cached_tokens <= len(prompt) - 1
        assert outcome.first_token_time >= outcome.arrival_time


def test_a_shared_prefix_is_served_from_cache_and_announced_once():
    engine = Engine(num_blocks=64, block_size=4, seed=1)
    model = EventModel()
    prefix = list(range(100, 112))
    engine.add_request("a", prefix + [1, 2], [9])
    run_to_idle(engine, model)
    engine.add_request("b", prefix + [3, 4, 5, 6, 7], [9, 9])
    stored = []
    while engine.has_work():
        result = engine.step()
        stored += [e for e in result.events if isinstance(e, BlockStored)]
        if result.finished:
            assert result.finished[0].cached_tokens == 12
    # only b's own new block is announced, chained to the last shared block
    assert [len(e.block_hashes) for e in stored] == [1]
    assert stored[0].parent_block_hash == engine.block_hashes(prefix)[-1]
    assert stored[0].token_ids == [3, 4, 5, 6]


def test_eviction_takes_the_tail_of_the_least_recently_freed_request_first():
    engine = Engine(num_blocks=7, block_size=2, seed=5)  # 6 usable blocks
    model = EventModel()
    engine.add_request("old", [1, 1, 2, 2, 3, 3], [0])  # 3 blocks, freed first
    run_to_idle(engine, model)
    engine.add_request("new", [4, 4, 5, 5, 6, 6], [0])
    run_to_idle(engine, model)
    engine.add_request("big", [8, 8, 9], [0])  # needs 2 blocks: evicts old's tail, then middle
    result = engine.step()
    removed = [model.content[e.block_hashes[0]] for e in result.events
               if isinstance(e, BlockRemoved)]
    assert removed == [(1, 1, 2, 2, 3, 3), (1, 1, 2, 2)]
    assert isinstance(result.events[-1], BlockStored)  # the step's stores follow its removals
    assert engine.lookup([1, 1, 2, 2, 3, 3]) == 2


def test_full_prompt_hit_still_computes_the_last_token():
    engine = Engine(num_blocks=32, block_size=4, seed=2)
    model = EventModel()
    engine.add_request("a", list(range(8)), [1])
    run_to_idle(engine, model)
    engine.add_request("b", list(range(8)), [1])
    (outcome,) = run_to_idle(engine, model)
    assert engine.lookup(list(range(8))) == 8
    assert outcome.cached_tokens == 4  # vLLM caps hits at len(prompt) - 1
    # the recomputed last block is cached a second time: vLLM does not deduplicate
    assert max(model.holders.values()) == 2


def test_instances_hash_the_same_tokens_differently_and_bytes_hashes_work():
    tokens = list(range(32))
    a, b = Engine(num_blocks=8, seed=1), Engine(num_blocks=8, seed=2)
    assert a.block_hashes(tokens) != b.block_hashes(tokens)
    assert a.block_hashes(tokens) == Engine(num_blocks=8, seed=1).block_hashes(tokens)
    raw = Engine(num_blocks=8, seed=1, hash_format="bytes").block_hashes(tokens)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in raw)


def test_reset_is_refused_while_blocks_are_in_use_and_cleared_with_the_next_step():
    engine = Engine(num_blocks=16, block_size=4, seed=1)
    engine.add_request("a", list(range(9)), [1, 2])
    engine.step()  # prefill: a now holds blocks
    assert engine.reset_prefix_cache() is False
    run_to_idle(engine, EventModel())
    assert engine.reset_prefix_cache() is True
    assert engine.lookup(list(range(9))) == 0
    engine.add_request("b", [5, 5, 5, 5, 5], [1])
    events = engine.step().events
    assert isinstance(events[0], AllBlocksCleared) and isinstance(events[1], BlockStored)


def test_time_model_gives_cached_prompts_a_shorter_ttft():
    engine = Engine(num_blocks=512, block_size=16, seed=1)
    prompt = list(range(1000, 3000))
    model = EventModel()
    engine.add_request("cold", prompt, [1])
    (cold,) = run_to_idle(engine, model)
    engine.add_request("warm", prompt, [1], arrival_time=engine.clock + 1)
    (warm,) = run_to_idle(engine, model)
    assert warm.cached_tokens == 1984
    assert warm.ttft < cold.ttft


@pytest.mark.parametrize(
    ("prompt", "output", "message"),
    [([], [1], "at least one token"), ([1], [], "generate at least one"),
     (list(range(200)), [1], "exceeds max_model_len")],
)
def test_bad_requests_are_refused_with_a_reason(prompt, output, message):
    engine = Engine(num_blocks=8, block_size=16, seed=1)
    with pytest.raises(EngineError, match=message):
        engine.add_request("x", prompt, output)


def test_aborted_requests_free_their_blocks_and_keep_what_they_cached():
    engine = Engine(num_blocks=16, block_size=4, seed=1, max_num_seqs=1)
    engine.add_request("long", list(range(10)), [1] * 20)
    engine.add_request("queued", [5, 5], [1])
    engine.step()
    assert engine.num_free_blocks < 15
    assert engine.abort_request("long") and engine.abort_request("queued")
    assert not engine.abort_request("long") and not engine.has_work()
    assert engine.num_free_blocks == 15
    assert engine.lookup(list(range(10))) == 8


def test_duplicate_request_ids_are_refused():
    engine = Engine(num_blocks=8, block_size=16, seed=1)
    engine.add_request("x", [1], [1])
    with pytest.raises(EngineError, match="already in flight"):
        engine.add_request("x", [2], [1])


def test_a_salted_request_is_cached_apart_and_announced_with_its_salt():
    """vLLM's rule: `cache_salt` goes into the first block's extra keys, so the same prompt
    under two salts, and unsalted, is cached three times; an index fed the events matches
    each tenant exactly as the engine looks it up."""
    engine = Engine(num_blocks=64, block_size=4, seed=5)
    prompt = list(range(1, 14))  # three full blocks and a partial one
    for number, salt in enumerate(["tenant-a", "tenant-b", None]):
        engine.add_request(f"r{number}", prompt, [1], cache_salt=salt)
    stores = []
    index = PrefixIndex()
    while engine.has_work():
        for event in engine.step().events:
            apply_event(index, ("w", 0), event)
            if isinstance(event, BlockStored) and event.parent_block_hash is None:
                stores.append(event)
    assert sorted(str(s.extra_keys[0]) for s in stores) == sorted(
        ["['tenant-a']", "['tenant-b']", "None"])
    assert all(extra is None for s in stores for extra in s.extra_keys[1:])
    for salt in ("tenant-a", "tenant-b", None):
        assert engine.lookup(prompt, salt) == 12
        assert index.match(prompt, cache_salt=salt)[("w", 0)].blocks == 3
    assert engine.lookup(prompt, "tenant-c") == 0
    assert index.match(prompt, cache_salt="tenant-c")[("w", 0)].blocks == 0


def test_an_engine_with_lookahead_hashes_each_block_with_the_tokens_after_it():
    """vLLM 0.33 with speculative decoding and block drop: a block is hashed (and cached)
    only once the L tokens after it exist, and a prompt hits it only with those tokens;
    the index fed its events answers as the engine looks up."""
    engine = Engine(num_blocks=64, block_size=4, seed=5, lookahead=2)
    prompt = list(range(1, 15))  # 14 tokens: blocks 0-2 have two tokens after them
    engine.add_request("a", prompt, [1])
    index = PrefixIndex()
    stores = []
    while engine.has_work():
        for event in engine.step().events:
            apply_event(index, ("w", 0), event)
            stores += [event] if isinstance(event, BlockStored) else []
    assert [len(s.lookahead_token_ids) for s in stores] == [len(s.block_hashes) for s in stores]
    assert stores[0].lookahead_token_ids[0] == [5, 6]
    for query in (prompt, prompt[:12] + [13, 99], prompt[:9] + [50] + prompt[10:], prompt[:10]):
        answer = index.match(query[:-1], following=query[-1:])[("w", 0)].tokens
        assert answer == min(engine.lookup(query), (len(query) - 1) // 4 * 4), query


def test_a_request_in_report_mode_full_announces_the_blocks_it_reused():
    engine = Engine(num_blocks=64, block_size=4, seed=5)
    prompt = list(range(1, 14))
    engine.add_request("a", prompt, [1])
    run_to_idle(engine, EventModel())
    engine.add_request("b", prompt, [1], report_reused=True)
    reported = []
    while engine.has_work():
        reported += [e for e in engine.step().events if isinstance(e, BlockStored)]
    assert [(r.parent_block_hash, r.block_hashes) for r in reported] == [
        (None, engine.block_hashes(prompt))]
