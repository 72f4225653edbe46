"""The benchmark workloads: seeded, well-formed, and with the sharing each one promises."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvroute.sim.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    generate_mooncake_trace,
    load_mooncake,
    mooncake_block,
    mooncake_trace,
    multi_turn_chat,
    shared_system_prompts,
)
from tests.support.paths import REPO

SAMPLE = REPO / "benchmarks" / "traces" / "sample_mooncake.jsonl"


def test_shared_system_prompts_have_the_llm_d_shape():
    sessions = shared_system_prompts(groups=6, prompts_per_group=5, system_tokens=100,
                                     question_tokens=20, output_tokens=3, seed=1)
    assert len(sessions) == 30
    starts = [s.start for s in sessions]
    assert starts == sorted(starts) and starts[0] > 0
    prefixes = Counter(s.turns[0].prompt[:100] for s in sessions)
    assert sorted(prefixes.values()) == [5] * 6
    assert all(len(s.turns[0].prompt) == 120 and len(s.turns[0].output) == 3 for s in sessions)
    assert shared_system_prompts(groups=6, system_tokens=100, question_tokens=20, seed=1) \
        == shared_system_prompts(groups=6, system_tokens=100, question_tokens=20, seed=1)


def test_every_chat_turn_extends_the_previous_prompt_and_answer():
    sessions = multi_turn_chat(sessions=5, turns=4, system_tokens=30, seed=2)
    for session in sessions:
        assert len(session.turns) == 4 and session.think_s > 0
        for prev, turn in zip(session.turns, session.turns[1:], strict=False):
            history = prev.prompt + prev.output
            assert turn.prompt[: len(history)] == history
            assert len(turn.prompt) > len(history)


def test_mooncake_hash_ids_stand_for_fixed_token_blocks():
    lines = [
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5,
                    "hash_ids": [7, 8]}),
        json.dumps({"timestamp": 1500, "input_length": 1024, "output_length": 9,
                    "hash_ids": [7, 8, 9]}),
    ]
    a, b = mooncake_trace(lines, time_scale=2.0)
    assert a.start == 0.0 and b.start == 3.0
    assert a.turns[0].prompt == tuple(mooncake_block(7) + mooncake_block(8)[:88])
    assert b.turns[0].prompt[:MOONCAKE_BLOCK_TOKENS * 2] == tuple(
        mooncake_block(7) + mooncake_block(8))
    assert len(b.turns[0].prompt) == 1024 and len(b.turns[0].output) == 9
    assert mooncake_block(7) != mooncake_block(9)
    (capped,) = mooncake_trace(lines[1:], max_output_tokens=4)
    assert len(capped.turns[0].output) == 4


@pytest.mark.parametrize(
    ("line", "needle"),
    [("not json", "line 2: not a Mooncake record"),
     ('{"timestamp": 0, "input_length": 5}', "line 2: not a Mooncake record"),
     ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}',
      "line 2: input_length 2000 needs 4 hash ids, got 1")],
)
def test_malformed_trace_lines_are_named(line, needle):
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    with pytest.raises(ValueError, match=needle):
        mooncake_trace([good, line])


def test_the_shipped_sample_trace_parses_and_shares_prefixes():
    sessions = load_mooncake(SAMPLE)
    assert len(sessions) == 400
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    firsts = Counter(r["hash_ids"][0] for r in records)
    assert max(firsts.values()) > 10  # app system prompts are shared by many requests
    assert records == generate_mooncake_trace(requests=400, apps=10, rate_per_s=8.0, seed=0)
