"""The compiled index's tables (index/_tables.pxi) against a plain dict: the same answers to
every dict method the index uses, through growth, removal (probe runs shifted back),
compaction and entries that do not fit a record."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.index import prefix_index

if not prefix_index.COMPILED_AVAILABLE:  # make test builds them; a missing build is a failure
    pytest.fail("the compiled index loops are not built: run `pip install -e .`",
                allow_module_level=True)

from kvroute.index._fast import HandleMap, NodeMap  # noqa: E402

# Few distinct keys, so operations meet earlier entries; values across the 64-bit edge.
NODE_KEYS = st.one_of(st.integers(0, 40).map(lambda n: n.to_bytes(16, "little")),
                      st.binary(min_size=15, max_size=17))
NODE_VALUES = st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64, 2**70),
                        st.integers(-5, -1))
HANDLE_KEYS = st.one_of(st.integers(0, 40), st.integers(2**64 - 3, 2**64 + 3),
                        st.integers(-3, -1), st.binary(min_size=16, max_size=16))
HANDLE_VALUES = st.one_of(st.integers(0, 40).map(lambda n: n.to_bytes(16, "big")),
                          st.binary(min_size=15, max_size=17))


def operations(keys: st.SearchStrategy, values: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.one_of(
        st.tuples(st.just("set"), keys, values),
        st.tuples(st.just("del"), keys),
        st.tuples(st.just("pop"), keys),
        st.tuples(st.just("setdefault"), keys, values),
        st.tuples(st.just("popitem")),
        st.tuples(st.just("fill"), st.integers(0, 3000)),
        st.tuples(st.just("drain"), st.integers(0, 3000)),
    ), max_size=60)


def run(table: dict, reference: dict, ops: list[tuple], value_of) -> None:
    for op, *args in ops:
        if op == "set":
            table[args[0]] = args[1]
            reference[args[0]] = args[1]
        elif op == "del":
            outcomes = []
            for target in (table, reference):
                try:
                    del target[args[0]]
                    outcomes.append(None)
                except KeyError:
                    outcomes.append(KeyError)
            assert outcomes[0] == outcomes[1]
        elif op == "pop":
            assert table.pop(args[0], "none") == reference.pop(args[0], "none")
        elif op == "setdefault":
            assert table.setdefault(args[0], args[1]) == reference.setdefault(args[0], args[1])
        elif op == "popitem":
            if reference:
                key, value = table.popitem()
                assert reference.pop(key) == value
            else:
                with pytest.raises(KeyError):
                    table.popitem()
        elif op == "fill":  # many entries: the tables grow past their first sizes
            for n in range(args[0]):
                key, value = value_of(n)
                table[key] = value
                reference[key] = value
        else:  # drain: remove most of them again (shrinking, compaction)
            for key in list(reference)[: args[0]]:
                del table[key]
                del reference[key]
        assert len(table) == len(reference)
        table.check_slots()
    assert dict(table.items()) == reference
    assert sorted(table.keys(), key=repr) == sorted(reference, key=repr)
    assert sorted(table.values(), key=repr) == sorted(reference.values(), key=repr)
    assert sorted(table, key=repr) == sorted(reference, key=repr)
    for key, value in reference.items():
        assert key in table and table[key] == value and table.get(key) == value
    assert table == reference
    assert table.copy() == reference and copy.deepcopy(table) == reference
    assert pickle.loads(pickle.dumps(table)) == reference


@settings(max_examples=150, deadline=None)
@given(operations(NODE_KEYS, NODE_VALUES))
def test_node_map_answers_as_a_dict(ops: list[tuple]) -> None:
    run(NodeMap(), {}, ops, lambda n: ((1000 + n).to_bytes(16, "big"), n * 2**40 + 7))


@settings(max_examples=150, deadline=None)
@given(operations(HANDLE_KEYS, HANDLE_VALUES))
def test_handle_map_answers_as_a_dict(ops: list[tuple]) -> None:
    run(HandleMap(), {}, ops, lambda n: (n * 7919 + 1000, n.to_bytes(16, "little")))


def test_a_value_that_stops_fitting_moves_beside_the_records_and_back() -> None:
    nodes = NodeMap()
    key = b"k" * 16
    nodes[key] = 5
    nodes[key] = 2**70  # a holder bit past bit 63
    assert nodes[key] == 2**70 and len(nodes) == 1 and nodes._other == {key: 2**70}
    nodes[key] = 9
    assert nodes[key] == 9 and len(nodes) == 1 and nodes._other == {}


def test_missing_keys_raise_as_a_dict_does() -> None:
    for table in (NodeMap(), HandleMap()):
        with pytest.raises(KeyError):
            table[b"x" * 16]
        with pytest.raises(KeyError):
            del table[3]
        with pytest.raises(KeyError):
            table.pop(3)
        with pytest.raises(TypeError):  # unhashable, as in a dict
            table[[1]] = 2


def test_emptied_tables_give_their_memory_back() -> None:
    handles = HandleMap()
    empty = handles.__sizeof__()
    for n in range(100_000):
        handles[n] = (n + 1).to_bytes(16, "big")
    full = handles.__sizeof__()
    assert full > 100_000 * 24
    for n in range(99_000):
        del handles[n]
    assert handles.__sizeof__() < full // 10  # compacted
    assert all(handles[n] == (n + 1).to_bytes(16, "big") for n in range(99_000, 100_000))
    for n in range(99_000, 100_000):
        del handles[n]
    assert handles.__sizeof__() == empty


@pytest.mark.parametrize("live", [3, 5, 30, 200])
def test_churn_at_a_steady_size_keeps_every_entry_findable(live: int) -> None:
    """Inserts and removals in random order around a fixed size: probe runs wrap around
    the end of the slot table and are shifted back over many removals."""
    rng = random.Random(live)
    nodes, reference = NodeMap(), {}
    for step in range(20_000):
        if len(reference) < live or rng.random() < 0.5:
            key = rng.getrandbits(128).to_bytes(16, "big")
            nodes[key] = reference[key] = step
        else:
            key = rng.choice(list(reference))
            del nodes[key], reference[key]
        if step % 97 == 0:
            assert all(nodes.get(k) == v for k, v in reference.items())
            assert len(nodes) == len(reference)
            nodes.check_slots()
    assert nodes == reference


_M64 = (1 << 64) - 1


def _engine_hash_of(mixed: int) -> int:
    """The engine hash whose table hash (murmur3's 64-bit finalizer, ``_mix``) is ``mixed``:
    the finalizer is a bijection, undone step by step."""
    x = mixed
    for multiplier in (0xC4CEB9FE1A85EC53, 0xFF51AFD7ED558CCD):
        x ^= x >> 33
        x = (x * pow(multiplier, -1, 1 << 64)) & _M64
    return x ^ (x >> 33)


@pytest.mark.parametrize("others", [0, 5_000])
def test_keys_whose_slot_tags_agree_are_told_apart_by_their_records(others: int) -> None:
    """A slot's tag holds only some bits of the key's hash: two keys whose hashes differ in
    none of the bits the home and the tag use (bit 31 of the hash only: under the tag's
    bits, above any home of a table this size) share a probe run and a tag, and the record
    still tells them apart."""
    first, second = _engine_hash_of(0x0123_4567_0000_0001), _engine_hash_of(0x0123_4567_8000_0001)
    handles, reference = HandleMap(), {}
    for n in range(others):  # a bigger table: narrower tags, a wider home
        handles[n * 7919 + 10**6] = reference[n * 7919 + 10**6] = n.to_bytes(16, "big")
    handles[first], handles[second] = b"a" * 16, b"b" * 16
    reference[first], reference[second] = b"a" * 16, b"b" * 16
    assert handles == reference and handles[first] == b"a" * 16 and handles[second] == b"b" * 16
    del handles[first], reference[first]
    assert first not in handles and handles[second] == b"b" * 16 and handles == reference


@pytest.mark.parametrize("order", ["first_in", "last_in", "shuffled"])
def test_a_long_probe_run_is_shifted_back_right_however_far_its_slots_lie(order: str) -> None:
    """Forty keys with one home, among others: slots lie up to 40 past their home, past
    what a slot's distance field holds (15, then the record says), and every removal
    shifts the run back over the hole; every key left stays findable after each one."""
    rng = random.Random(order)
    crowd = [_engine_hash_of((k << 40) | 0x5A5) for k in range(1, 41)]  # one home in any table
    others = [rng.getrandbits(64) for _ in range(300)]
    handles, reference = HandleMap(), {}
    for n, key in enumerate([*crowd, *others]):
        handles[key] = reference[key] = n.to_bytes(16, "big")
    gone = {"first_in": crowd, "last_in": crowd[::-1],
            "shuffled": rng.sample(crowd + others[:40], 80)}[order]
    for key in gone:
        del handles[key], reference[key]
        assert all(handles.get(k) == v for k, v in reference.items())
        assert len(handles) == len(reference)
    assert handles == reference


def test_a_long_probe_run_survives_growth_compaction_and_copies() -> None:
    """The forty keys of one home again, while the table grows past many widths of record
    number (every slot placed again each time), is copied, and is compacted: their
    distances, exact or "15 or more", are made again each time and the run still shifts
    back right."""
    rng = random.Random(40)
    crowd = [_engine_hash_of((k << 40) | 0x3C3) for k in range(1, 41)]
    others = [rng.getrandbits(64) for _ in range(5_000)]
    handles, reference = HandleMap(), {}
    for n, key in enumerate([*crowd, *others]):
        handles[key] = reference[key] = n.to_bytes(16, "big")
    copied, copied_reference = handles.copy(), dict(reference)
    assert copied == reference and pickle.loads(pickle.dumps(handles)) == reference
    full = handles.__sizeof__()
    for key in others[:4_000]:  # under a quarter of the records left live: compacted
        del handles[key], reference[key]
    assert handles.__sizeof__() < full // 2
    for table, expected in ((handles, reference), (copied, copied_reference)):
        for key in crowd[::2]:
            del table[key], expected[key]
        assert all(table.get(k) == expected[k] for k in crowd[1::2])
        assert table == expected


@pytest.mark.parametrize("kind", ["nodes", "handles"])
def test_entries_stay_right_while_a_grown_table_is_filled(kind: str) -> None:
    """A grown slot table is filled a few records per call while the old one answers for
    the rest: additions, removals of moved and unmoved entries, entries added back and
    values changed meanwhile all read back as a dict's do, through several growths."""
    rng = random.Random(kind)
    if kind == "nodes":
        table, key_of = NodeMap(), lambda n: n.to_bytes(16, "big")
    else:
        table, key_of = HandleMap(), lambda n: n * 0x9E3779B97F4A7C15 % 2**64
    value_of = (lambda n: n + 1) if kind == "nodes" else (lambda n: (n + 1).to_bytes(16, "big"))
    reference: dict = {}
    gone: list = []
    checks_while_moving = 0
    for step in range(60_000):
        roll = rng.random()
        # The oldest entry's record was moved first; the newest may wait, or have come
        # after the move began.
        either_end = next(iter(reference) if rng.random() < 0.5 else reversed(reference), None)
        if roll < 0.6 or len(reference) < 10:
            key = key_of(step)
            table[key] = reference[key] = value_of(step)
        elif roll < 0.8:
            del table[either_end], reference[either_end]
            gone.append(either_end)
        elif roll < 0.9 and gone:
            key = gone.pop(rng.randrange(len(gone)))
            table[key] = reference[key] = value_of(step)
        else:
            table[either_end] = reference[either_end] = value_of(step)
        if table.moving and step % 25 == 0:
            checks_while_moving += 1
            sample = rng.sample(list(reference), min(100, len(reference)))
            assert all(table.get(k) == reference[k] for k in sample)
            assert all(table.get(k) is None for k in gone[-50:])
            assert len(table) == len(reference)
            if checks_while_moving % 10 == 0:
                table.check_slots()
    assert checks_while_moving > 50  # the moves happened, and were looked into
    table.check_slots()
    assert table == reference and table.copy() == reference


@pytest.mark.parametrize("then", ["copy", "pickle", "clear", "drain"])
def test_a_table_copied_cleared_or_drained_while_it_is_filled(then: str) -> None:
    """What a table does mid-move, it does as a settled one: a copy or a pickle holds every
    entry, a cleared table starts afresh, and removing nearly all entries (compaction,
    smaller slot tables) leaves the rest findable."""
    nodes, reference = NodeMap(), {}
    n = 0
    while not nodes.moving or len(reference) < 1000:
        key = n.to_bytes(16, "little")
        nodes[key] = reference[key] = n + 1
        n += 1
        assert n < 100_000
    if then == "copy":
        copied = nodes.copy()
        assert copied == reference and not copied.moving
    elif then == "pickle":
        assert pickle.loads(pickle.dumps(nodes)) == reference
    elif then == "clear":
        nodes.clear()
        reference.clear()
        assert not nodes.moving and len(nodes) == 0
    else:
        for key in list(reference)[:-20]:
            del nodes[key], reference[key]
        assert len(nodes) == 20
    for m in range(n, n + 3_000):  # and it goes on as a dict
        key = m.to_bytes(16, "little")
        nodes[key] = reference[key] = m + 1
    nodes.check_slots()
    assert nodes == reference
