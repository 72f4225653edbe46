"""The pure parts of benchmarks.real_hitrate: no vLLM, no processes, no network."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.real_hitrate import parse_args, split_cores
from benchmarks.real_parts import (
    BALANCERS,
    BASELINES,
    CHAT,
    REPLICAS,
    ROUTERS,
    SHARED,
    Outcome,
    Request,
    RunRecord,
    add_added_latency,
    add_partition_share,
    cached_of,
    drive,
    failed_row,
    hit_rate,
    inflight_leaks,
    make_workload,
    median,
    merge,
    metric_delta,
    multi_turn_chat,
    parse_engine_metrics,
    parse_sse_line,
    percentile,
    replica_order,
    restart_points,
    restart_windows,
    runs_table,
    shared_system_prompts,
    summarize,
    table,
    window_hit_rate,
)
from e2e.model import VOCAB_SIZE
from tests.support.waiting import run_async

CACHE_TOKENS = 64 * 32  # one engine's KV cache in the benchmark


def _valid_ids(prompt: list[int]) -> bool:
    return all(3 <= t < VOCAB_SIZE for t in prompt)


@pytest.mark.parametrize("name", [SHARED, CHAT])
def test_workloads_are_deterministic_per_seed(name: str) -> None:
    a, b = make_workload(name, 7, 120), make_workload(name, 7, 120)
    assert [(r.prompt, r.group, r.after) for r in a.requests] == \
        [(r.prompt, r.group, r.after) for r in b.requests]
    other = make_workload(name, 8, 120)
    assert [r.prompt for r in other.requests] != [r.prompt for r in a.requests]


def test_shared_system_prompts_shape() -> None:
    wl = shared_system_prompts(seed=1, requests=120)
    assert len(wl.requests) == 120 and wl.groups == 6
    heads: dict[int, list[int]] = {}
    for i, r in enumerate(wl.requests):
        assert r.index == i and r.after is None and _valid_ids(r.prompt)
        assert 480 + 60 <= len(r.prompt) <= 480 + 120
        heads.setdefault(r.group, r.prompt[:480])
        assert r.prompt[:480] == heads[r.group]
    assert len(heads) == 6  # every system prompt is used
    assert len({tuple(h[:32]) for h in heads.values()}) == 6  # distinct from the first block
    assert sum(len(h) for h in heads.values()) > CACHE_TOKENS  # more than one engine holds


def test_multi_turn_chat_shape() -> None:
    wl = multi_turn_chat(seed=3, requests=120)
    assert len(wl.requests) == 120
    assert max(len(r.prompt) for r in wl.requests) < 900
    by_index = {r.index: r for r in wl.requests}
    followups = 0
    for r in wl.requests:
        assert _valid_ids(r.prompt)
        if r.after is None:
            continue
        followups += 1
        prev = by_index[r.after]
        assert prev.index < r.index and prev.group == r.group
        assert r.prompt[:len(prev.prompt)] == prev.prompt  # the conversation is resent
        assert len(r.prompt) > len(prev.prompt)
    assert followups > len(wl.requests) // 2
    assert wl.groups > 8  # sessions end and new ones open


def test_drive_keeps_order_concurrency_and_turns() -> None:
    requests = [Request(0, [5] * 4, 0), Request(1, [6] * 4, 1), Request(2, [5] * 8, 0, after=0),
                Request(3, [7] * 4, 2), Request(4, [5] * 12, 0, after=2), Request(5, [8] * 4, 3)]
    log: list[tuple[str, int]] = []
    running = {"now": 0, "max": 0}

    async def send(req: Request) -> Outcome:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        log.append(("start", req.index))
        for _ in range(3 if req.index == 0 else 1):
            await asyncio.sleep(0)
        log.append(("end", req.index))
        running["now"] -= 1
        return Outcome(req.index, len(req.prompt), engine="e")

    result: dict[str, object] = {}

    async def scenario() -> None:
        result["out"] = await drive(requests, 2, send, timeout=30.0)

    run_async(scenario)
    outcomes, timed_out = result["out"]  # type: ignore[misc]
    assert not timed_out
    assert [o.index for o in outcomes] == list(range(6))
    assert all(o.error is None for o in outcomes)
    assert running["max"] <= 2
    starts = [i for kind, i in log if kind == "start"]
    assert starts.index(1) < starts.index(3) < starts.index(5)  # taken in list order
    for turn, prev in ((2, 0), (4, 2)):
        assert log.index(("end", prev)) < log.index(("start", turn))


def test_drive_records_errors_and_the_deadline() -> None:
    never = asyncio.Event()

    async def send(req: Request) -> Outcome:
        if req.index == 0:
            raise RuntimeError("boom")
        await never.wait()
        return Outcome(req.index, 1)

    result: dict[str, object] = {}

    async def scenario() -> None:
        result["out"] = await drive([Request(0, [3], 0), Request(1, [3], 1)], 2, send,
                                    timeout=0.2)

    run_async(scenario)
    outcomes, timed_out = result["out"]  # type: ignore[misc]
    assert timed_out
    assert "boom" in (outcomes[0].error or "")
    assert "deadline" in (outcomes[1].error or "")


EXPOSITION = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 480.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0
# HELP vllm:prompt_tokens Number of prefill tokens processed.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
"""


def test_engine_metrics_and_deltas() -> None:
    before = parse_engine_metrics(EXPOSITION)
    assert before["queries"] == 1200.0  # _created samples are not counted
    assert before["hits"] == 512.0  # summed over label sets
    assert before["prompt_tokens"] == 1200.0 and before["running"] == 2.0
    assert before["waiting"] == 0.0 and before["preemptions"] == 0.0  # absent: 0
    after = parse_engine_metrics(EXPOSITION.replace(" 1200.0", " 2200.0")
                                 .replace(" 480.0", " 980.0"))
    delta = metric_delta(before, after)
    assert delta["queries"] == 1000.0 and delta["hits"] == 500.0
    assert delta["prompt_tokens"] == 1000.0
    assert hit_rate([delta, {"hits": 0.0, "queries": 1000.0}]) == pytest.approx(0.25)
    assert hit_rate([{"hits": 0.0, "queries": 0.0}]) is None
    with pytest.raises(ValueError, match="restart"):
        metric_delta(after, before)


def test_sse_and_usage_helpers() -> None:
    assert parse_sse_line('data: {"a": 1}') == '{"a": 1}'
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None
    assert cached_of({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}) == 32
    assert cached_of({"prompt_tokens": 9}) is None and cached_of(None) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 90) == 4.0
    assert percentile([], 50) is None


def _record(router: str, hits: float, inflight: dict | None = None,
            repeat: int = 0) -> RunRecord:
    outcomes = [Outcome(0, 600, engine="vllm-0", cached_tokens=480, ttft_s=0.1, latency_s=0.2),
                Outcome(1, 500, engine="vllm-1", cached_tokens=0, ttft_s=0.3, latency_s=0.4),
                Outcome(2, 500, error="HTTP 500: x")]
    deltas = {"vllm-0": {"hits": hits, "queries": 1000.0, "prompt_tokens": 600.0,
                         "requests_ok": 1.0, "preemptions": 0.0},
              "vllm-1": {"hits": 0.0, "queries": 1000.0, "prompt_tokens": 1000.0,
                         "requests_ok": 2.0, "preemptions": 0.0}}
    for outcome in outcomes:
        outcome.repeat = repeat
        outcome.sent_at = 100.0 * repeat + outcome.index
    return RunRecord(SHARED, router, 4, ["vllm-0", "vllm-1"], outcomes, deltas, 12.0,
                     inflight=inflight)


def _row(router: str, hits: float, inflight: dict | None = None) -> dict:
    return summarize(_record(router, hits, inflight))


def test_repetitions_pool_requests_and_counters_and_keep_each_hit_rate() -> None:
    leak = {"leak": True, "settled": [1, 0]}
    fine = {"leak": False, "settled": [0, 0]}
    merged = merge([_record("kvroute-proxy", 800.0, fine, 0),
                    _record("kvroute-proxy", 200.0, leak, 1)])
    row = summarize(merged)
    assert row["requests"] == 6 and row["errors"] == 2 and row["repeats"] == 2
    assert row["hit_rate"] == pytest.approx(1000 / 4000)  # pooled counters
    assert row["hit_rate_repeats"] == pytest.approx([0.4, 0.1])
    assert row["inflight"] is leak  # a leak in any repetition is the one reported
    assert row["wall_s"] == 24.0
    trace = row["trace"]
    assert trace["columns"][:4] == ["repeat", "index", "engine", "sent_ms"]
    # each repetition's requests timed from that repetition's start
    assert [r[3] for r in trace["rows"] if r[0] == 1] == [0.0, 1000.0, 2000.0]
    assert "10-40%" in table([row])


def test_each_repetition_keeps_its_own_ttft_p90() -> None:
    slow = _record("round-robin", 500.0, repeat=1)
    for outcome in slow.outcomes:
        if outcome.ttft_s is not None:
            outcome.ttft_s *= 10
    row = summarize(merge([_record("round-robin", 500.0), slow]))
    assert row["ttft_p90_repeats_ms"] == [300.0, 3000.0]
    assert "300-3000" in table([row])
    assert row["ttft_p90_ms"] == 3000.0  # pooled over both


def test_summary_share_and_table() -> None:
    leak = {"engines": ["vllm-0", "vllm-1"], "after_run": [1, 0], "settled": [1, 0],
            "waited_s": 10.0, "leak": True}
    fine = {"engines": ["vllm-0", "vllm-1"], "after_run": [1, 0], "settled": [0, 0],
            "waited_s": 0.3, "leak": False}
    rows = [_row("partition", 800.0), _row("round-robin", 200.0),
            _row("kvroute-proxy", 600.0, leak), _row("kvroute-route", 700.0, fine)]
    add_partition_share(rows)
    part, rr, proxy, route = rows
    assert part["hit_rate"] == pytest.approx(0.4) and part["share_of_partition"] == 1.0
    assert rr["share_of_partition"] == pytest.approx(0.25)
    assert part["errors"] == 1 and part["requests"] == 3
    assert part["sent_prompt_tokens"] == {"vllm-0": 600, "vllm-1": 500}
    assert part["hit_rate_usage"] == pytest.approx(480 / 1100)
    assert part["ttft_p50_ms"] == 100.0 and part["ttft_p90_ms"] == 300.0
    assert "inflight" not in part and proxy["inflight"]["leak"]
    leaks = inflight_leaks(rows)
    assert len(leaks) == 1 and "kvroute-proxy" in leaks[0]
    text = table(rows)
    lines = text.splitlines()
    assert len([ln for ln in lines if ln.startswith(SHARED)]) == 4
    assert "LEAK 1,0" in text and "1,0->0,0" in text
    assert "40.0%" in text and "0.6k/0.5k" in text
    assert all(len(line) <= 200 for line in lines)


def test_arguments() -> None:
    quick = parse_args(["--quick"])
    assert quick.concurrency == [1, 4] and quick.requests == 64
    full = parse_args(["--routers", "partition,kvroute-proxy", "--concurrency", "2,8",
                       "--requests", "10", "--engines", "3"])
    assert full.routers == ["partition", "kvroute-proxy"] and full.concurrency == [2, 8]
    assert full.engines == 3 and full.requests == 10 and full.repeat == 1
    assert parse_args(["--repeat", "3"]).repeat == 3
    for bad in (["--routers", "nope"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_failed_run_is_a_row_of_its_own() -> None:
    rows = [_row("partition", 800.0),
            failed_row(SHARED, "kvroute-proxy", 4, ["vllm-0", "vllm-1"],
                       "KvrouteError: POST /v1/instances -> 502\nmore")]
    add_partition_share(rows)
    assert rows[1]["hit_rate"] is None and rows[1]["share_of_partition"] is None
    text = table(rows)
    assert "kvroute-proxy   FAILED: KvrouteError: POST /v1/instances -> 502" in text
    assert "more" not in text


def _balancer_record(router: str, headers_ms: list[float], fallbacks: int = 0) -> RunRecord:
    outcomes = [Outcome(i, 500, engine="vllm-0", cached_tokens=0, ttft_s=0.1, latency_s=0.2,
                        headers_s=ms / 1000) for i, ms in enumerate(headers_ms)]
    for outcome in outcomes[:fallbacks]:
        outcome.engine, outcome.fallback = None, "kvroute HTTP 504"
    deltas = {"vllm-0": {"hits": 0.0, "queries": 1000.0, "prompt_tokens": 1000.0,
                         "requests_ok": 4.0, "preemptions": 0.0}}
    return RunRecord(SHARED, router, 4, ["vllm-0"], outcomes, deltas, 3.0)


def test_balancer_rows_and_their_added_latency() -> None:
    assert set(BALANCERS) <= set(ROUTERS) and set(BASELINES) <= set(ROUTERS)
    assert all(BASELINES[r] in ROUTERS for r in BASELINES)
    rr_record = _balancer_record("nginx-rr", [2.0, 3.0, 4.0, 30.0])
    for outcome in rr_record.outcomes:
        outcome.engine = None  # a balancer's round robin does not say where it went
    rr = summarize(rr_record)
    routed = summarize(_balancer_record("nginx-kvroute", [4.0, 5.0, 7.0, 50.0], fallbacks=1))
    alone = summarize(_balancer_record("haproxy-kvroute", [4.0, 4.0, 4.0, 4.0]))
    assert routed["headers_p50_ms"] == 5.0 and routed["headers_p99_ms"] == 50.0
    assert routed["fallbacks"] == 1 and routed["fallback_samples"] == ["kvroute HTTP 504"]
    columns = routed["trace"]["columns"]
    assert columns[-3:] == ["headers_ms", "fallback", "scores"]
    assert all(len(row) == len(columns) for row in routed["trace"]["rows"])
    rows = [rr, routed, alone]
    add_added_latency(rows)
    assert routed["added_p50_ms"] == 2.0 and routed["added_p99_ms"] == 20.0
    assert rr["added_p50_ms"] is None  # a baseline has none
    assert alone["added_p50_ms"] is None  # no haproxy-rr row in this run
    text = table(rows)
    line = next(ln for ln in text.splitlines() if "nginx-kvroute" in ln)
    assert "+2.0/+20.0" in line and "   5.0   50.0" in line
    rr_line = next(ln for ln in text.splitlines() if "nginx-rr" in ln)
    assert "0.0k" not in rr_line  # no engine known: "-", not zero tokens
    assert all(len(ln) <= 200 for ln in text.splitlines())


def test_balancer_routers_are_arguments() -> None:
    args = parse_args(["--routers", "nginx-kvroute,haproxy-kvroute,nginx-rr,haproxy-rr"])
    assert args.routers == ["nginx-kvroute", "haproxy-kvroute", "nginx-rr", "haproxy-rr"]
    assert args.lb_deadline_ms is None  # the shipped files' deadline
    assert parse_args(["--lb-deadline-ms", "500"]).lb_deadline_ms == 500
    with pytest.raises(SystemExit):
        parse_args(["--lb-deadline-ms", "0"])


def test_replica_routers_are_known_and_measured_against_round_robin() -> None:
    assert set(REPLICAS) <= set(ROUTERS)
    assert all(BASELINES[r] == "round-robin" for r in REPLICAS)
    assert not REPLICAS["kvroute-2r"][1] and REPLICAS["kvroute-2r-roll"] == (True, True)
    assert REPLICAS["kvroute-2r-cold"] == (False, True)  # the control: nothing shared
    assert parse_args(["--routers", "kvroute-2r,kvroute-2r-roll", "--buffer-steps", "32"]
                      ).buffer_steps == 32
    assert parse_args([]).buffer_steps is None
    with pytest.raises(SystemExit):
        parse_args(["--buffer-steps", "0"])


def test_restart_points_cut_the_run_in_equal_parts() -> None:
    assert restart_points(96, 2) == [32, 64]
    assert restart_points(64, 2) == [21, 42]
    assert restart_points(10, 1) == [5]


def test_replica_order_rotates_over_those_in_service_then_the_others() -> None:
    assert [replica_order(i, [True, True]) for i in range(3)] == [[0, 1], [1, 0], [0, 1]]
    assert replica_order(0, [False, True]) == [1, 0]  # replica 0 restarting
    assert replica_order(1, [False, True]) == [1, 0]
    assert replica_order(5, [False, False]) == [0, 1]  # last resort: ask anyway


def test_the_hit_rate_right_after_the_restart_points() -> None:
    assert restart_windows(900, 2) == [(300, 450), (600, 750)]
    outcomes = [Outcome(i, 100, cached_tokens=(0 if i in (300, 600) else 80))
                for i in range(900)]
    outcomes[301].error = "HTTP 500"  # not counted
    rate = window_hit_rate(outcomes, restart_windows(900, 2))
    assert rate == pytest.approx(80 * 297 / (100 * 299))
    assert window_hit_rate(outcomes, [(900, 901)]) is None
    row = summarize(RunRecord(SHARED, "kvroute-2r", 4, ["a"], outcomes,
                              {"a": {"hits": 1.0, "queries": 2.0, "prompt_tokens": 0.0,
                                     "requests_ok": 0.0, "preemptions": 0.0}}, 1.0))
    assert row["hit_rate_after_restarts"] == rate and row["restart_windows"] == [(300, 450),
                                                                                (600, 750)]
    assert "right after the restart points" in table([row])


def test_engines_get_every_core_but_the_first_unless_told_otherwise() -> None:
    assert split_cores(None, {0, 1}) == ({1}, {0})
    assert split_cores(None, {0, 1, 2, 3}) == ({1, 2, 3}, {0})
    assert split_cores(None, {3}) == (None, None)  # one core: nothing to split
    assert split_cores("shared", {0, 1}) == (None, None)
    assert split_cores(parse_args(["--engine-cores", "2-3"]).engine_cores, {0, 1, 2, 3}) == (
        {2, 3}, {0, 1})
    assert parse_args(["--engine-cores", "1,3"]).engine_cores == {1, 3}


def test_an_engine_core_split_that_leaves_nothing_or_names_missing_cores_says_so() -> None:
    with pytest.raises(SystemExit, match="leave no core of"):
        split_cores(frozenset({0, 1}), {0, 1})
    with pytest.raises(SystemExit, match=r"cores \[5\] are not available"):
        split_cores(frozenset({5}), {0, 1})
    with pytest.raises(SystemExit):
        parse_args(["--engine-cores", "one"])


def test_each_run_is_reported_beside_the_pool_and_the_worst_comes_first() -> None:
    partition = summarize(merge([_record("partition", 800.0, repeat=r) for r in range(3)]))
    runs = [_record("kvroute-proxy", hits, repeat=r)
            for r, hits in enumerate((800.0, 400.0, 820.0))]
    runs[1].outcomes[1].latency_s = 4.0  # the dipping run is the slow one too
    proxy = summarize(merge(runs))
    rows = [partition, proxy]
    add_partition_share(rows)
    assert proxy["share_repeats"] == pytest.approx([1.0, 0.5, 1.025])
    assert proxy["share_worst"] == pytest.approx(0.5)
    assert proxy["share_median"] == pytest.approx(1.0)
    assert proxy["share_of_partition"] == pytest.approx(2020 / 2400)  # the pool hides it
    assert proxy["latency_p90_repeats_ms"] == [400.0, 4000.0, 400.0]
    assert proxy["latency_p50_repeats_ms"] == [200.0, 200.0, 200.0]
    text = runs_table(rows)
    line = next(ln for ln in text.splitlines() if "kvroute-proxy" in ln)
    assert " 50.0% 100.0%  84.2%" in line and "4000" in line
    assert "20.0%(50.0%) 200/4000" in line
    assert median([3.0, None, 1.0, 2.0, 10.0]) == 2.5 and median([]) is None


def test_text_prompts_tokenize_back_to_their_ids() -> None:
    from tokenizers import Tokenizer

    from e2e.model import VOCAB_SIZE, text_of, tokenizer_json

    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json()))
    ids = [3, 4, 31999, 1234, 1234, 17]
    assert tokenizer.encode(text_of(ids)).ids == ids
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert parse_args(["--prompts", "text"]).prompts == "text"
    assert parse_args([]).prompts == "tokens"
    assert parse_args([]).front_ends == "engines"
    assert parse_args(["--front-ends", "clients"]).front_ends == "clients"
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "words"])
