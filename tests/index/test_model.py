"""The prefix index against a brute-force model, over random interleavings of events.

The model knows nothing of content keys or bitmasks: per worker it keeps engine hash ->
(token content from the root, per-medium reference counts), and answers queries by
checking every prefix of the query against the contents a worker holds. Every worker hashes
with its own seed (and its own hash type: unsigned, signed, bytes), so only content can
connect them. Queries (tokens and hash paths) and statistics are compared after every step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvroute.index import Match
from kvroute.index.holdings import Holdings
from tests.support.index_impl import TwinIndex
from tests.support.index_state import assert_empty

TIERS = ("GPU", "CPU", "STORAGE")
# Weighted towards GPU: the fast paths of the index serve GPU-only workers.
MEDIUMS = (None, None, None, None, "GPU", "gpu", "CPU", "cpu", "STORAGE", "storage")
LORA = "x"


@dataclass(frozen=True)
class WorkerSpec:
    block_size: int
    hash_type: str  # "uint" | "int" | "bytes"
    seed: str


SPECS = {
    ("a", 0): WorkerSpec(2, "uint", "seed-a0"),
    ("a", 1): WorkerSpec(2, "int", "seed-a1"),
    ("b", 0): WorkerSpec(4, "bytes", "seed-b0"),
    ("c", 0): WorkerSpec(4, "uint", "seed-c0"),
}
NOT_A_WORKER = ("nobody", 0)

# A block as vLLM describes it: (tokens, raw extra keys or None). The model's *content* of
# a block drops a leading LoRA name from the extras (the LoRA is part of the domain).
RawBlock = tuple[tuple[int, ...], tuple[str, ...] | None]
Content = tuple[int, str | None, tuple[tuple[tuple[int, ...], tuple[str, ...] | None], ...]]


def tier_of(medium: str | None) -> int:
    return 0 if medium is None else TIERS.index(medium.upper())


def visible_extra(extra: tuple[str, ...] | None, lora: str | None) -> tuple[str, ...] | None:
    if extra is None:
        return None
    if lora is not None and extra and extra[0] == lora:
        extra = extra[1:]
    return extra or None


def engine_hash(worker: tuple[str, int], raw: tuple, variant: int) -> int | bytes:
    spec = SPECS[worker]
    digest = hashlib.blake2b(repr((spec.seed, raw, variant)).encode(), digest_size=16).digest()
    if spec.hash_type == "bytes":
        return digest
    value = int.from_bytes(digest[:8], "little")
    if spec.hash_type == "int" and value >= 1 << 63:
        return value - (1 << 64)
    return value


@dataclass
class ModelWorker:
    block_size: int = 0
    refs: dict = field(default_factory=dict)  # hash -> [gpu, cpu, storage] counts
    content_of: dict = field(default_factory=dict)  # hash -> Content (only while held)
    raw_of: dict = field(default_factory=dict)  # hash -> raw chain, to hash children
    groups: dict = field(default_factory=dict)  # group_idx -> indexed?
    ever: set = field(default_factory=set)  # every hash it ever announced

    def held_contents(self) -> dict[Content, list[int]]:
        """content -> per-tier counts summed over this worker's handles of it."""
        out: dict[Content, list[int]] = {}
        for block_hash, counts in self.refs.items():
            total = out.setdefault(self.content_of[block_hash], [0, 0, 0])
            for tier in range(3):
                total[tier] += counts[tier]
        return out


class Model:
    def __init__(self) -> None:
        self.workers: dict[tuple[str, int], ModelWorker] = {}
        self.orphaned = 0
        self.unknown_removals = 0
        self.ignored_blocks = 0
        self.ignored_removals = 0

    def worker(self, name: tuple[str, int]) -> ModelWorker:
        return self.workers.setdefault(name, ModelWorker())

    def store(self, name, parent_hash, raw_blocks: list[RawBlock], lora, medium, variant,
              group_idx, kind) -> list:
        """Returns the engine hashes of the chain (also when it cannot be placed)."""
        w = self.worker(name)
        block_size = SPECS[name].block_size
        if parent_hash is None:
            raw: tuple = (block_size, lora)
            content: Content = (block_size, lora, ())
        else:
            raw = w.raw_of.get(parent_hash, ("unknown", parent_hash))
            content = w.content_of.get(parent_hash)  # type: ignore[assignment]
        hashes = []
        contents = []
        raws = []
        for tokens, extra in raw_blocks:
            raw = raw + ((tokens, extra),)
            hashes.append(engine_hash(name, raw, variant))
            raws.append(raw)
            if content is not None:
                content = (content[0], content[1],
                           content[2] + ((tokens, visible_extra(extra, content[1])),))
                contents.append(content)
        if kind not in (None, "full_attention", "mla_attention", "sink_full_attention"):
            w.groups[group_idx] = False
            self.ignored_blocks += len(hashes)
            return hashes
        w.groups[group_idx] = True
        w.block_size = block_size
        if parent_hash is not None and parent_hash not in w.refs:
            self.orphaned += len(hashes)
            return hashes
        tier = tier_of(medium)
        for block_hash, block_content, block_raw in zip(hashes, contents, raws, strict=True):
            w.refs.setdefault(block_hash, [0, 0, 0])[tier] += 1
            w.content_of[block_hash] = block_content
            w.raw_of[block_hash] = block_raw
            w.ever.add(block_hash)
        return hashes

    def offload(self, name, hashes, medium) -> None:
        w = self.worker(name)
        w.groups[0] = True
        for block_hash in hashes:
            if block_hash in w.refs:
                w.refs[block_hash][tier_of(medium)] += 1
            else:
                self.orphaned += 1

    def remove(self, name, hashes, medium, group_idx) -> None:
        w = self.worker(name)
        if w.groups.get(group_idx) is False:
            self.ignored_removals += len(hashes)
            return
        tier = tier_of(medium)
        for block_hash in hashes:
            counts = w.refs.get(block_hash)
            if counts is None or not counts[tier]:
                self.unknown_removals += 1
                continue
            counts[tier] = 0  # every store of it: reuse reports pair with no removal
            if not any(counts):
                del w.refs[block_hash]
                del w.content_of[block_hash]
                del w.raw_of[block_hash]

    def clear(self, name) -> None:
        w = self.worker(name)
        w.refs.clear()
        w.content_of.clear()
        w.raw_of.clear()

    def drop(self, name) -> None:
        self.workers.pop(name, None)

    def _answer(self, w: ModelWorker, path: list[Content], block_size: int) -> Match:
        held = w.held_contents()
        tiers = [0, 0, 0]
        blocks = 0
        for content in path:
            counts = held.get(content)
            if counts is None:
                break
            tiers[next(t for t in range(3) if counts[t])] += 1
            blocks += 1
        return Match(blocks, blocks * block_size, block_size, dict(zip(TIERS, tiers, strict=True)))

    def match(self, tokens: list[int], lora, workers=None, salt=None) -> dict:
        """vLLM's rule: a request's ``cache_salt`` is its first block's one extra key (after
        the LoRA name); a query names it or matches no salted block."""
        names = self.workers if workers is None else [n for n in workers if n in self.workers]
        out = {}
        for name in names:
            w = self.workers[name]
            size = w.block_size
            path: list[Content] = []
            if size:
                blocks: tuple = ()
                for k in range(len(tokens) // size):
                    extra = (salt,) if k == 0 and salt is not None else None
                    blocks = blocks + ((tuple(tokens[k * size : (k + 1) * size]), extra),)
                    path.append((size, lora, blocks))
            out[name] = self._answer(w, path, size)
        return out

    def match_hashes(self, hashes: list, workers=None) -> dict:
        path: list[Content] = []
        for block_hash in hashes:
            candidates = {
                w.content_of[block_hash]
                for w in self.workers.values()
                if block_hash in w.refs
            }
            chained = [
                c for c in candidates
                if len(c[2]) == len(path) + 1
                and (not path or (c[0], c[1], c[2][:-1]) == path[-1])
            ]
            if not chained:
                break
            assert len(chained) == 1, "engine hashes of the model never collide"
            path.append(chained[0])
        names = self.workers if workers is None else [n for n in workers if n in self.workers]
        return {name: self._answer(self.workers[name], path, self.workers[name].block_size)
                for name in names}

    def holdings(self) -> dict:
        return {
            name: {t: sum(1 for c in w.refs.values() if c[i]) for i, t in enumerate(TIERS)}
            for name, w in self.workers.items()
        }

    def node_count(self) -> int:
        return len({c for w in self.workers.values() for c in w.content_of.values()})


def _matched(matches: dict) -> dict:
    """What ``match(..., matched_only=True)`` answers of ``matches``: the workers with a
    block held or pending."""
    return {name: match for name, match in matches.items() if match.blocks or match.pending}


workers_st = st.sampled_from(sorted(SPECS))
token_st = st.integers(0, 2)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # The compiled and the pure loops at once: each is checked against the model, and
        # against the other after every call (answers and containers).
        self.index = TwinIndex()
        self.model = Model()
        self.stored_events: list[tuple] = []  # (name, parent, raw blocks, lora, variant)

    # ------------------------------------------------------------------ helpers

    def _draw_blocks(self, data, name, lora) -> list[RawBlock]:
        size = SPECS[name].block_size
        count = data.draw(st.integers(1, 4), label="blocks")
        blocks = []
        for _ in range(count):
            tokens = tuple(data.draw(st.lists(token_st, min_size=size, max_size=size)))
            extra_choices: list = [None]
            # ("img",): one string alone, as a salted request's first block carries its
            # salt; ("img", "x"): extra keys no token query can know.
            extra_choices += ([(LORA,), (LORA, "img"), (LORA, "img", "x")] if lora
                              else [("img",), ("img", "x")])
            extra = data.draw(st.sampled_from(extra_choices), label="extra")
            blocks.append((tokens, extra))
        return blocks

    def _store(self, name, parent, blocks, lora, medium, variant, group_idx=0,
               kind=None) -> None:
        hashes = self.model.store(name, parent, blocks, lora, medium, variant, group_idx, kind)
        tokens = [t for block_tokens, _ in blocks for t in block_tokens]
        extras = [list(extra) if extra is not None else None for _, extra in blocks]
        self.index.apply_stored(
            name, hashes, parent, tokens, SPECS[name].block_size, lora_name=lora,
            extra_keys=extras, medium=medium, group_idx=group_idx,
            kv_cache_spec_kind=kind,
        )
        if kind is None:
            self.stored_events.append((name, parent, blocks, lora, variant))

    def _held(self, name) -> list:
        w = self.model.workers.get(name)
        return sorted(w.refs, key=repr) if w else []

    def _holder(self, data) -> tuple[str, int] | None:
        """A worker that holds something (rules that need one would mostly idle otherwise)."""
        holders = sorted(name for name, w in self.model.workers.items() if w.refs)
        return data.draw(st.sampled_from(holders), label="holder") if holders else None

    # ------------------------------------------------------------------ rules

    @rule(data=st.data(), name=workers_st, lora=st.sampled_from([None, None, LORA]),
          medium=st.sampled_from(MEDIUMS), variant=st.sampled_from([0, 0, 0, 1]),
          kind=st.sampled_from([None, "full_attention", "mla_attention",
                                "sink_full_attention"]))
    def store_from_root(self, data, name, lora, medium, variant, kind):
        self._store(name, None, self._draw_blocks(data, name, lora), lora, medium, variant,
                    kind=kind)

    @rule(data=st.data(), medium=st.sampled_from(MEDIUMS), variant=st.sampled_from([0, 0, 1]))
    def store_under_held_block(self, data, medium, variant):
        name = self._holder(data)
        if name is None:
            return
        held = self._held(name)
        parent = data.draw(st.sampled_from(held), label="parent")
        lora = self.model.workers[name].content_of[parent][1]
        self._store(name, parent, self._draw_blocks(data, name, lora), lora, medium, variant)

    @rule(data=st.data(), medium=st.sampled_from(MEDIUMS))
    def store_what_another_worker_holds(self, data, medium):
        """The point of content keys: another seed, the same tokens, the same nodes."""
        source = self._holder(data)
        if source is None:
            return
        size = SPECS[source].block_size
        name = data.draw(st.sampled_from(
            [n for n in sorted(SPECS) if n != source and SPECS[n].block_size == size]))
        raw = data.draw(st.sampled_from(sorted(
            self.model.workers[source].raw_of.values(), key=repr)), label="chain")
        _size, lora, *blocks = raw
        self._store(name, None, blocks, lora, medium, 0)

    @rule(data=st.data(), name=workers_st)
    def store_orphan(self, data, name):
        w = self.model.workers.get(name)
        gone = sorted(w.ever - set(w.refs), key=repr) if w else []
        parent = data.draw(st.sampled_from(gone or [12345]), label="unknown parent")
        self._store(name, parent, self._draw_blocks(data, name, None), None, None, 0)

    @rule(data=st.data(), medium=st.sampled_from(MEDIUMS))
    def store_again(self, data, medium):
        """vLLM does not deduplicate: the same chain can be stored again."""
        if not self.stored_events:
            return
        name, parent, blocks, lora, variant = data.draw(
            st.sampled_from(self.stored_events), label="earlier store")
        self._store(name, parent, blocks, lora, medium, variant)

    @rule(data=st.data(), medium=st.sampled_from(["CPU", "cpu", "STORAGE", "GPU"]))
    def offload_without_tokens(self, data, medium):
        name = self._holder(data) or data.draw(workers_st)
        held = self._held(name)
        hashes = data.draw(st.lists(st.sampled_from(held), max_size=4), label="offloaded") \
            if held else []
        if data.draw(st.booleans(), label="with unknown"):
            hashes.append(999_999)
        self.model.offload(name, hashes, medium)
        self.index.apply_stored(name, hashes, None, [], 0, medium=medium)

    @rule(data=st.data(), medium=st.sampled_from(MEDIUMS))
    def store_again_with_other_hashes(self, data, medium):
        """Same content under other engine hashes (extra keys the events do not carry)."""
        if not self.stored_events:
            return
        name, parent, blocks, lora, variant = data.draw(
            st.sampled_from(self.stored_events), label="earlier store")
        if parent is None:
            self._store(name, parent, blocks, lora, medium, 1 - variant)

    @rule(data=st.data())
    def remove(self, data):
        name = self._holder(data) or data.draw(workers_st)
        held = self._held(name)
        hashes = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=5),
                           label="removed") if held else []
        # Mostly a medium the first hash is held in, sometimes any medium at all.
        w = self.model.workers.get(name)
        held_in = [TIERS[t] for t in range(3) if hashes and w and w.refs[hashes[0]][t]]
        medium = data.draw(st.sampled_from(held_in * 3 + list(MEDIUMS)), label="medium")
        if data.draw(st.booleans(), label="with unknown"):
            hashes.append(data.draw(st.sampled_from([424242, -5, b"\x01" * 16])))
        self.model.remove(name, hashes, medium, 0)
        self.index.apply_removed(name, hashes, medium=medium, group_idx=0)

    @rule(data=st.data(), name=workers_st,
          kind=st.sampled_from(["sliding_window", "mamba", "chunked_local_attention"]))
    def non_full_attention_group(self, data, name, kind):
        blocks = self._draw_blocks(data, name, None)
        self._store(name, None, blocks, None, None, 0, group_idx=1, kind=kind)
        hashes = [engine_hash(name, (SPECS[name].block_size, None, blocks[0]), 0)]
        self.model.remove(name, hashes, None, 1)
        self.index.apply_removed(name, hashes, group_idx=1)

    @rule(name=workers_st, now=st.integers(0, 2))
    def clear(self, name, now):
        if now:  # two times in three a no-op, so that workers get to hold something
            return
        self.model.clear(name)
        self.index.clear_worker(name)

    @rule(name=workers_st, now=st.integers(0, 2))
    def drop(self, name, now):
        if now:
            return
        self.model.drop(name)
        self.index.drop_worker(name)

    @rule(data=st.data(), piece_size=st.integers(1, 5), now=st.integers(0, 2))
    def save_and_restore_into_a_new_index(self, data, piece_size, now):
        """What a kvroute restart does with saved state: every worker captured, its pieces
        through msgpack, restored into a new index; from then on that index must agree
        with the model as the old one did (the counters start again from zero)."""
        if now:
            return
        saved = {}
        for name in sorted(self.index._workers, key=repr):
            capture = self.index.capture(name)
            saved[name] = msgspec.msgpack.decode(
                msgspec.msgpack.encode(list(capture.pieces(piece_size))), type=list[Holdings])
        self.index = TwinIndex()
        for name, pieces in saved.items():
            assert self.index.restore(name, pieces) == sum(len(p) for p in pieces)
        self.model.orphaned = self.model.unknown_removals = 0
        self.model.ignored_blocks = self.model.ignored_removals = 0

    # ------------------------------------------------------------------ checks

    def _queries(self) -> list[tuple[list[int], str | None, str | None]]:
        contents = sorted(
            {c for w in self.model.workers.values() for c in w.content_of.values()},
            key=lambda c: (-len(c[2]), repr(c)),
        )[:6]
        queries = []
        for _size, lora, blocks in contents:
            tokens = [t for block_tokens, _ in blocks for t in block_tokens]
            for salt in (None, "img"):
                queries.append((tokens, lora, salt))
                queries.append((tokens + [1], lora, salt))  # trailing partial block
                queries.append((tokens[: max(0, len(tokens) - 3)] + [2, 2, 2, 2, 2], lora,
                                salt))
        queries.append(([0, 1, 2, 0, 1, 2, 0, 1], None, None))
        queries.append(([], None, None))
        return queries

    @invariant()
    def token_queries_agree(self):
        subset = sorted(self.model.workers)[::2] + [NOT_A_WORKER]
        for tokens, lora, salt in self._queries():
            everyone = self.model.match(tokens, lora, salt=salt)
            assert self.index.match(tokens, lora_name=lora, cache_salt=salt) == everyone
            assert self.index.match(tokens, lora_name=lora, cache_salt=salt,
                                    matched_only=True) == _matched(everyone)
            chosen = self.model.match(tokens, lora, subset, salt=salt)
            assert self.index.match(tokens, lora_name=lora, cache_salt=salt,
                                    workers=subset) == chosen
            assert self.index.match(tokens, lora_name=lora, cache_salt=salt, workers=subset,
                                    matched_only=True) == _matched(chosen)
            assert self.index.match(tokens, lora_name=None if lora else LORA,
                                    cache_salt=salt) == \
                self.model.match(tokens, None if lora else LORA, salt=salt)

    @invariant()
    def hash_queries_agree(self):
        names = sorted(self.model.workers)
        for name in names:
            w = self.model.workers[name]
            longest = sorted(w.raw_of.values(), key=lambda r: (-len(r), repr(r)))[:2]
            for raw in longest:
                prefixes = [raw[: k + 1] for k in range(2, len(raw))]
                own = [engine_hash(name, p, 0) for p in prefixes]
                assert self.index.match_hashes(own) == self.model.match_hashes(own)
                for other in names:
                    if other != name and SPECS[other].block_size == SPECS[name].block_size:
                        half = len(prefixes) // 2
                        mixed = own[:half] + [engine_hash(other, p, 0) for p in prefixes[half:]]
                        assert self.index.match_hashes(mixed, workers=[other, name]) == \
                            self.model.match_hashes(mixed, [other, name])
        assert self.index.match_hashes([]) == self.model.match_hashes([])

    @invariant()
    def statistics_agree(self):
        stats = self.index.stats()
        assert stats.holdings == self.model.holdings()
        assert stats.nodes == self.model.node_count()
        assert stats.workers == len(self.model.workers)
        assert stats.orphaned_blocks == self.model.orphaned
        assert stats.unknown_removals == self.model.unknown_removals
        assert stats.ignored_blocks == self.model.ignored_blocks
        assert stats.ignored_removals == self.model.ignored_removals
        assert stats.hash_conflicts == 0
        for name in SPECS:
            model_size = self.model.workers[name].block_size if name in self.model.workers \
                else 0
            assert self.index.block_size(name) == (model_size or None)

    @invariant()
    def holdings_per_worker_agree(self):
        """The O(1) count a per-worker cap reads, and the parent test a sliced store uses."""
        for name in [*SPECS, NOT_A_WORKER]:
            w = self.model.workers.get(name)
            assert self.index.blocks_held(name) == (len(w.refs) if w else 0)
            for block_hash in sorted(w.ever, key=repr)[:8] if w else [12345]:
                assert self.index.holds_hash(name, block_hash) == (
                    w is not None and block_hash in w.refs)

    @invariant()
    def internal_layout_is_consistent(self):
        self.index._check()

    def teardown(self):
        for name in SPECS:
            self.index.drop_worker(name)
        assert_empty(self.index.compiled)
        assert_empty(self.index.pure)


IndexMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestIndexAgainstModel = IndexMachine.TestCase
# About 50 s alone on a 2-core machine, so the default 120 s limit leaves no room for a
# loaded one (CI beside a stress run timed it out): the limit is for a hang, not for speed.
TestIndexAgainstModel.pytestmark = [pytest.mark.timeout(600)]


def test_model_counts_tiers_like_the_index_on_a_known_case() -> None:
    """Guards the model itself: a hand-worked case with an offloaded middle block."""
    model = Model()
    name = ("a", 0)
    hashes = model.store(name, None, [((0, 1), None), ((2, 0), None)], None, None, 0, 0, None)
    model.offload(name, hashes[1:], "CPU")
    model.remove(name, hashes[1:], "GPU", 0)
    got = model.match([0, 1, 2, 0, 1], None)[name]
    assert got == Match(2, 4, 2, {"GPU": 1, "CPU": 1, "STORAGE": 0})
    assert model.holdings()[name] == {"GPU": 1, "CPU": 1, "STORAGE": 0}
