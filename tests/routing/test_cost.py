"""The cost policy on its own: prefill by tier, queued work, overload, ties."""

from __future__ import annotations

from collections import Counter

import msgspec

from kvroute.app.routing.cost import CostWeights, TieBreaker, WorkerView, best_of, score_workers
from kvroute.app.routing.load import parse_load
from kvroute.index import Match
from tests.support.tokens import unique_tokens

W = CostWeights()


def view(name: str, **load: float) -> WorkerView:
    return WorkerView(key=(name, 0), block_size=16, state="live", **load)


def match(blocks: int, gpu: int | None = None, cpu: int = 0) -> Match:
    gpu = blocks - cpu if gpu is None else gpu
    return Match(blocks=blocks, tokens=blocks * 16, block_size=16,
                 by_medium={"GPU": gpu, "CPU": cpu, "STORAGE": 0})


def pick(views, matches, prompt_tokens=1024, weights=W):
    held = max((m.tokens for m in matches.values()), default=0)  # as the service finds it
    scores = score_workers(views, matches, weights, prompt_tokens=prompt_tokens,
                           held_elsewhere=held)
    return best_of(scores, TieBreaker()), scores


def test_idle_fleet_prefers_the_longest_match():
    best, scores = pick([view("a"), view("b")], {("a", 0): match(10), ("b", 0): match(20)})
    assert best.instance == "b"
    costs = {s.instance: msgspec.to_builtins(s.answer())["cost_terms"] for s in scores}
    # a would copy the 160 tokens b holds beyond its own: priced again.
    assert costs == {"a": {"prefill": 1024 - 160, "copy": 160.0, "queue": 0.0, "crowding": 0.0},
                     "b": {"prefill": 1024 - 320, "copy": 0.0, "queue": 0.0, "crowding": 0.0}}


def test_a_cpu_hit_costs_more_than_a_gpu_hit_and_less_than_a_miss():
    gpu, cpu, miss = view("gpu"), view("cpu"), view("miss")
    best, scores = pick([gpu, cpu, miss], {("gpu", 0): match(10), ("cpu", 0): match(10, cpu=10)})
    cost = {s.instance: s.cost for s in scores}
    assert cost["gpu"] < cost["cpu"] < cost["miss"]
    assert best.instance == "gpu"


def test_queued_work_outweighs_a_small_hit():
    busy, idle = view("busy", running=4, waiting=2), view("idle", running=0, waiting=0)
    best, scores = pick([busy, idle], {("busy", 0): match(4)})
    assert best.instance == "idle"
    busy_score = next(s for s in scores if s.instance == "busy")
    # Nothing says what a waiting request costs: like this prompt's full length (1024).
    assert busy_score.queued_prefill == 2 * 1024 and busy_score.running == 4
    assert busy_score.queue_cost == W.queued_prefill_token * 2 * 1024 + 4 * W.running_request
    # A long enough hit is still worth running requests (decode pressure).
    running = view("busy", running=4, waiting=0)
    best, _ = pick([running, idle], {("busy", 0): match(400)}, prompt_tokens=8192)
    assert best.instance == "busy"


def test_a_cached_prefix_on_a_busy_worker_and_an_idle_worker_compare_in_prefill_tokens():
    """480 cached tokens of a 540-token prompt: the holder keeps it while the prefill queued
    ahead of it, at a quarter per token, costs less than what a copy on the idle worker
    costs (the 480 tokens to compute, and as much again for the cache space the copy takes
    from other prefixes), and the prompt spreads once the holder is saturated."""
    hit = {("holder", 0): Match(blocks=30, tokens=480, block_size=16,
                                by_medium={"GPU": 30, "CPU": 0, "STORAGE": 0})}
    holder = view("holder", inflight=2, queued_prefill=60)
    best, scores = pick([holder, view("idle")], hit, prompt_tokens=540)
    cost = {s.instance: msgspec.to_builtins(s.answer())["cost_terms"] for s in scores}
    assert cost == {"holder": {"prefill": 60.0, "copy": 0.0,
                               "queue": W.queued_prefill_token * 60 + 2 * W.running_request,
                               "crowding": 0.0},
                    "idle": {"prefill": 540.0, "copy": 480.0, "queue": 0.0, "crowding": 0.0}}
    assert best.instance == "holder"
    # Four cold 540-token prompts queued ahead (2,160 tokens, 4.5 times the saving): kept.
    busy = view("holder", inflight=4, queued_prefill=4 * 540)
    best, _ = pick([busy, view("idle")], hit, prompt_tokens=540)
    assert best.instance == "holder"
    # Eight of them: the idle worker computes the prompt much sooner, a copy is worth it.
    saturated = view("holder", inflight=8, queued_prefill=8 * 540)
    best, _ = pick([saturated, view("idle")], hit, prompt_tokens=540)
    assert best.instance == "idle"
    # Without the copy's price the holder gave way at four.
    no_copy = CostWeights(copied_token=0.0)
    best, _ = pick([busy, view("idle")], hit, prompt_tokens=540, weights=no_copy)
    assert best.instance == "idle"


def test_a_cold_prompt_under_load_is_stored_where_fewer_other_prefixes_are_held():
    """Two loaded workers and a 600-token prompt neither holds (a new system prompt, or one
    its holder evicted): the queues differ by a coincidence of the burst (20 tokens), the
    prefixes each must hold by a whole prompt. The crowded one pays for the space its
    uncached tokens take, by the share of its other demand above the least: twice (the
    default weight) 600 x 600/1800.
    (On two real engines the queues alone put four cold system prompts on one engine and
    two on the other; evicting each other there, they moved back and forth all run.)"""
    crowded = view("crowded", inflight=4, queued_prefill=400, recent_demand=1800.0,
                   other_demand=1800.0)
    # Its own prefix, sent here last, does not count against it: the space is its own.
    home = view("home", inflight=4, queued_prefill=480, recent_demand=1800.0,
                other_demand=1200.0)
    best, scores = pick([crowded, home], {}, prompt_tokens=600)
    cost = {s.instance: msgspec.to_builtins(s.answer())["cost_terms"] for s in scores}
    assert cost["crowded"]["crowding"] == 2 * 200.0 and cost["home"]["crowding"] == 0.0
    assert best.instance == "home"
    # A worker without load scored beside them (a block-hash query scores every one) pays
    # none and is not what the loaded ones compare with.
    _, scores = pick([crowded, home, view("idle")], {}, prompt_tokens=600)
    assert [s.crowding_cost for s in scores] == [400.0, 0.0, 0.0]
    # Without the price the shorter queue won.
    best, _ = pick([crowded, home], {}, prompt_tokens=600, weights=CostWeights(crowded_token=0))
    assert best.instance == "crowded"
    # Only what is to be computed pays: a held prefix's question (60 tokens) pays 2 x 20.
    held = {("crowded", 0): Match(blocks=15, tokens=540, block_size=36,
                                  by_medium={"GPU": 15, "CPU": 0, "STORAGE": 0})}
    _, scores = pick([crowded, home], held, prompt_tokens=600)
    assert next(s for s in scores if s.instance == "crowded").crowding_cost == 2 * 20.0
    # No demand anywhere (a fresh kvroute): nothing to price.
    best, scores = pick([view("a", inflight=1), view("b", inflight=2)], {}, prompt_tokens=600)
    assert all(s.crowding_cost == 0.0 for s in scores) and best.instance == "a"


def test_waiting_requests_are_priced_like_the_answers_kvroute_sent_there():
    """A holder of a 480-token prefix with 7 requests waiting, all of which kvroute sent
    there for ~90 uncached tokens each: 630 tokens queued, not 7 x 570. Priced like this
    prompt's length, the queue outweighed the 480 tokens the holder saves and the prefix
    was copied to the other worker, evicting another one there."""
    hit = {("holder", 0): Match(blocks=15, tokens=480, block_size=32,
                                by_medium={"GPU": 15, "CPU": 0, "STORAGE": 0})}
    other = view("other", running=1, waiting=0, waiting_prefill=90.0)
    unknown = view("holder", running=1, waiting=7)
    best, scores = pick([unknown, other], hit, prompt_tokens=570)
    assert next(s for s in scores if s.instance == "holder").queued_prefill == 7 * 570
    assert best.instance == "other"
    typical = view("holder", running=1, waiting=7, waiting_prefill=90.0)
    best, scores = pick([typical, other], hit, prompt_tokens=570)
    assert next(s for s in scores if s.instance == "holder").queued_prefill == 7 * 90
    assert best.instance == "holder"
    # The holder's queue still counts: saturated, the prompt spreads.
    saturated = view("holder", running=1, waiting=60, waiting_prefill=90.0)
    best, _ = pick([saturated, other], hit, prompt_tokens=570)
    assert best.instance == "other"


def test_own_and_scraped_views_of_a_queue_are_not_added_up():
    both = view("both", running=3, waiting=1, inflight=2, answered=1, queued_prefill=100)
    _, (score,) = pick([both], {}, prompt_tokens=64)
    assert score.running == 3  # max(2 forwarded + 1 answered, 3 scraped)
    assert score.queued_prefill == 100  # max(100 own, 1 waiting x 64)
    own_only = view("own", inflight=3)  # no reading of the instance's metrics
    _, (score,) = pick([own_only], {}, prompt_tokens=64)
    assert score.running == 3 and score.queue_cost == 3 * W.running_request


def test_overloaded_workers_are_skipped_unless_all_are():
    hot = view("hot", running=1, waiting=W.overload_waiting)
    cold = view("cold", running=10, waiting=0)
    best, _ = pick([hot, cold], {("hot", 0): match(60)}, prompt_tokens=8192)
    assert best.instance == "cold"
    cold = view("cold", running=1, waiting=W.overload_waiting)
    best, scores = pick([hot, cold], {("hot", 0): match(60)}, prompt_tokens=8192)
    assert all(s.overloaded for s in scores)
    assert best.instance == "hot"  # every worker overloaded: cost decides among all


def test_a_full_kv_cache_saturates_a_worker_but_never_steers_the_choice():
    """vLLM runs what its cache holds and queues the rest: a holder whose cache filled
    under a burst is busy, priced by its queue, not skipped. Skipped, it sent its own hot
    prefixes to a worker that computed and cached them again (two real engines, 16
    clients: 3-5 points of hit rate lost against a static partition)."""
    holder = view("holder", running=5, waiting=3, kv_usage=1.0)
    other = view("other", running=1, waiting=0, kv_usage=0.2)
    best, scores = pick([holder, other], {("holder", 0): match(30)}, prompt_tokens=570)
    by_name = {s.instance: s for s in scores}
    assert best.instance == "holder"
    assert by_name["holder"].saturated and not by_name["holder"].overloaded
    assert not by_name["other"].saturated
    # A queue long enough still sends the prompt elsewhere: the cost decides.
    holder = view("holder", running=5, waiting=40, kv_usage=1.0)
    best, _ = pick([holder, other], {("holder", 0): match(30)}, prompt_tokens=570)
    assert best.instance == "other"


def test_a_tie_goes_to_the_same_worker_for_the_same_first_block_in_any_process():
    """Rendezvous hashing: no state, so two replicas (two TieBreakers) agree, whatever the
    order of the scores; only the first block of the prompt (16 tokens here) counts."""
    views = [view("a"), view("b"), view("c")]
    scores = score_workers(views, {}, W, prompt_tokens=100)
    prompt = unique_tokens(1, 40)
    first = best_of(scores, TieBreaker(tokens=prompt))
    assert best_of(scores[::-1], TieBreaker(tokens=prompt)) == first
    assert best_of(scores, TieBreaker(tokens=prompt[:16] + unique_tokens(2, 30))) == first
    # Removing a worker the prompt did not pick leaves the pick alone.
    others = [s for s in scores if s is not first]
    assert best_of([first, others[0]], TieBreaker(tokens=prompt)) == first
    # A block-hash query: signed and unsigned spellings of one hash are one key.
    assert (best_of(scores, TieBreaker(first_hash=-1))
            == best_of(scores, TieBreaker(first_hash=2**64 - 1)))


def test_ties_spread_cold_prefixes_evenly():
    scores = score_workers([view("a"), view("b"), view("c")], {}, W, prompt_tokens=100)
    picks = Counter(best_of(scores, TieBreaker(tokens=unique_tokens(seed, 20))).instance
                    for seed in range(600))
    assert set(picks) == {"a", "b", "c"}
    assert min(picks.values()) >= 150  # 200 each expected; the seeds are fixed
    hashes = Counter(best_of(scores, TieBreaker(first_hash=h * 7919)).instance
                     for h in range(600))
    assert min(hashes.values()) >= 150


def test_a_tie_leaves_out_workers_sent_clearly_more_lately():
    """Chat sessions that all hash to one worker: the hash alone would send it every one;
    with the demand each was sent, a tie between idle workers leaves out a worker more than
    a quarter and more than one prompt above the least, and the rest break it by the hash
    as before. A tie between loaded workers goes by the hash alone."""
    scores = score_workers([view("a"), view("b"), view("c")], {}, W, prompt_tokens=100)
    prompts = [unique_tokens(seed, 20) for seed in range(200)]
    favourite = {p[0]: best_of(scores, TieBreaker(tokens=p)).instance for p in prompts}
    to_a = [p for p in prompts if favourite[p[0]] == "a"][:12]
    assert len(to_a) == 12
    sent = Counter({"a": 0, "b": 0, "c": 0})

    def tie(prompt):
        return TieBreaker(tokens=prompt, demand=lambda key: sent[key[0]], slack=len(prompt))

    for prompt in to_a:
        sent[best_of(scores, tie(prompt)).instance] += len(prompt)
    # The hash alone: a 240, b and c none. Now no one is more than two prompts behind.
    assert sum(sent.values()) == 240 and max(sent.values()) - min(sent.values()) <= 40
    # Demand within a prompt of the least, or within a quarter of it: the hash decides.
    for demand in ({"a": 20, "b": 0, "c": 0}, {"a": 1000, "b": 900, "c": 850}):
        sent = Counter(demand)
        assert all(best_of(scores, tie(p)).instance == "a" for p in to_a)
    sent = Counter({"a": 1100, "b": 800, "c": 2000})
    assert {best_of(scores, tie(p)).instance for p in to_a} == {"b"}
    # Between workers that carry load, a tie is their queues' coincidence: the hash alone.
    busy = score_workers([view(n, inflight=1) for n in "abc"], {}, W, prompt_tokens=100)
    assert all(s.queue_cost for s in busy)
    assert {best_of(busy, tie(p)).instance for p in to_a} == {"a"}
    # Block-hash queries and workers known by key alone weigh it the same way.
    hashed = TieBreaker(first_hash=1, demand=lambda key: sent[key[0]], slack=64)
    assert hashed.pick_key([("a", 0), ("b", 0), ("c", 0)], 16) == ("b", 0)


def test_the_first_block_is_at_the_smallest_block_size_of_the_scored_workers():
    """Prompts that share the first 16 tokens but not 32 share a block of a 16-token
    worker, so they tie-break alike; with only 32-token workers they may spread."""
    small = [WorkerView(key=(n, 0), block_size=16, state="live") for n in "abcd"]
    large = [WorkerView(key=(n, 0), block_size=32, state="live") for n in "abcd"]
    prompts = [unique_tokens(7, 16) + unique_tokens(100 + i, 16) for i in range(40)]
    scores = score_workers(small, {}, W, prompt_tokens=32)
    assert len({best_of(scores, TieBreaker(tokens=p)).instance for p in prompts}) == 1
    scores = score_workers(large, {}, W, prompt_tokens=32)
    assert len({best_of(scores, TieBreaker(tokens=p)).instance for p in prompts}) == 4


def test_block_hash_queries_count_prefill_per_block_size():
    small = WorkerView(key=("s", 0), block_size=16, state="live")
    large = WorkerView(key=("l", 0), block_size=32, state="live")
    scores = score_workers([small, large], {}, W, prompt_blocks=4)
    assert {s.instance: s.prefill_cost for s in scores} == {"s": 64.0, "l": 128.0}


def test_parse_load_reads_vllm_metrics_per_engine():
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""
    loads = parse_load(text, read_at=1.0)
    assert loads[0].running == 3 and loads[0].waiting == 7 and loads[0].kv_usage == 0.5
    assert loads[1].running == 1 and loads[1].waiting == 0


def test_queued_prefill_that_builds_this_prompts_prefix_is_not_held_against_it():
    """An answer just sent a cold 512-token prompt to `first` (guessed, not yet stored): a
    second request for it reuses that work there instead of computing it elsewhere."""
    guessed = {("first", 0): Match(blocks=32, tokens=512, block_size=16,
                                   by_medium={"GPU": 0, "CPU": 0, "STORAGE": 0}, pending=32)}
    first = view("first", answered=1, queued_prefill=512)
    best, scores = pick([first, view("other")], guessed, prompt_tokens=520)
    assert best.instance == "first"
    assert {s.instance: s.queued_prefill for s in scores} == {"first": 0.0, "other": 0.0}
