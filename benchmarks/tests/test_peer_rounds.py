"""The peer bench's rounds (benchmarks.peer_bench ``--rounds``): each round's ratio of the
two ingest rates per mix, a round where a side never reached the final state left out of
the median, and the table's line for them."""

from __future__ import annotations

from benchmarks.peer_bench import ratios, table


def row(mix: str, mine: float | None, theirs: float | None) -> dict:
    side = {"blocks_per_s": None, "query_1k_during_ingest_p99_ms": None,
            "cpu_us_per_block": 1.0, "cores": None, "error": None, "wrong_answers": [],
            "worst_loop_lag_ms": 1.0}
    return {"mix": mix, "stored_blocks": 100, "kvroute": {**side, "blocks_per_s": mine},
            "dynamo": {**side, "blocks_per_s": theirs}}


def test_each_round_s_ratio_and_the_median_of_those_known() -> None:
    rounds = [[row("roots", 120.0, 100.0), row("deep", 90.0, 100.0)],
              [row("roots", 150.0, 100.0), row("deep", None, 100.0)],
              [row("roots", 100.0, 100.0), row("deep", 130.0, 100.0)]]
    got = ratios(rounds)
    assert got["roots"] == {"each": [1.2, 1.5, 1.0], "median": 1.2}
    assert got["deep"] == {"each": [0.9, None, 1.3], "median": 1.1}
    lines = table({"peer": True, "decode_floor": {"roots": 1.0, "deep": 1.0},
                   "ingest": rounds[-1], "ingest_ratio": got}).splitlines()
    assert "| ingest roots, kvroute's rate over the peer's, each round | 1.20, 1.50, 1.00;" \
           " median 1.20x | | |" in lines
    assert any(line.startswith("| ingest deep, kvroute's rate") and "0.90, -, 1.30" in line
               for line in lines)


def test_a_mix_no_round_finished_has_no_median() -> None:
    got = ratios([[row("deep", None, 100.0)], [row("deep", 100.0, None)]])
    assert got["deep"] == {"each": [None, None], "median": None}
