"""Check 12: kvroute's own predicted-vs-actual metrics, through `kvroute serve --proxy`.

kvroute compares, for every request it forwards, the cached tokens it predicted for the
chosen worker with vLLM's `usage.prompt_tokens_details.cached_tokens` (the engines run
with `--enable-prompt-tokens-details`) and exports the difference per worker. Here the
harness reads those metrics back from `/metrics` after each request: every request must be
compared, with a difference of exactly 0 and an actual figure equal to what the client
itself read in the answer, streamed or not. Then one engine's cache is emptied behind
kvroute's back (`POST /reset_prefix_cache`: vLLM announces it only with its next step, which
is the next request's own), and the same prompt sent again must show up as a negative
difference, of exactly the tokens kvroute predicted.
"""

from __future__ import annotations

import json
import random
import re
import time

from e2e.checks import CheckFailed, CheckResult, Cluster, _cached_of
from e2e.workloads import shared_prefix_workload

METRIC_TIMEOUT = 10.0
_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def metrics(cl: Cluster) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every labelled sample of kvroute's /metrics."""
    samples = {}
    for line in cl.kvroute.http.get("/metrics").text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


class Accuracy:
    """kvroute's predicted-vs-actual figures for one worker (rank 0 of an instance)."""

    def __init__(self, cl: Cluster, instance_id: str) -> None:
        labels = {("instance", instance_id), ("dp_rank", "0")}
        read = metrics(cl)

        def value(name: str, *extra: tuple[str, str]) -> float:
            return read.get((name, frozenset(labels | set(extra))), 0.0)

        self.compared = value("kvroute_cached_tokens_difference_count")
        self.exact = (value("kvroute_cached_tokens_difference_bucket", ("le", "0.5"))
                      - value("kvroute_cached_tokens_difference_bucket", ("le", "-0.5")))
        self.below = value("kvroute_cached_tokens_difference_bucket", ("le", "-0.5"))
        self.predicted = value("kvroute_predicted_cached_tokens_total")
        self.actual = value("kvroute_actual_cached_tokens_total")
        self.unavailable = sum(v for (name, got), v in read.items()
                               if name == "kvroute_cached_tokens_unavailable_total"
                               and labels <= got)


def _after(cl: Cluster, instance_id: str, before: Accuracy) -> Accuracy:
    """kvroute's figures once the request it just relayed is recorded."""
    deadline = time.monotonic() + METRIC_TIMEOUT
    while True:
        now = Accuracy(cl, instance_id)
        if now.compared + now.unavailable > before.compared + before.unavailable:
            return now
        if time.monotonic() > deadline:
            raise CheckFailed(f"{instance_id}: the proxied request was not recorded in "
                              f"kvroute's predicted-vs-actual metrics within "
                              f"{METRIC_TIMEOUT:.0f}s")
        time.sleep(0.05)


def check_hit_accuracy(cl: Cluster, rng: random.Random, requests: int = 16) -> CheckResult:
    """12. Every proxied request's predicted cached tokens equal vLLM's (difference 0 in
    kvroute's own metrics); a cache emptied behind kvroute's back shows as a difference."""
    cl.kvroute.stop()
    cl.say("  restarting kvroute in proxy mode with its defaults")
    cl.kvroute.start({"KVROUTE_PROXY": "true"})
    cl.ids.clear()
    for name, engine in cl.engines.items():
        cl.ids[name] = cl.kvroute.register(engine.url)
    for name in cl.engines:  # after check 10 the replay is short: live or degraded
        cl.kvroute.wait_state(cl.ids[name], {"live", "degraded"}, 30.0, cl.say,
                              "after registering")
        cl.sync(name)
    for name in cl.engines:  # both sides empty and exact
        cl.reset_engine(name)
        cl.kvroute.wait_state(cl.ids[name], {"live"}, 30.0, cl.say, "after the reset")
    model = str(next(iter(cl.engines.values())).spec.model_dir)
    details: list[str] = []
    hits = streamed = 0
    last: tuple[str, list[int]] | None = None
    for number, prompt in enumerate(shared_prefix_workload(rng, requests)):
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        before_taps = {n: t.count for n, t in cl.taps.items()}
        stream = number % 2 == 1
        befores = {iid: Accuracy(cl, iid) for iid in cl.ids.values()}
        if stream:
            iid, chunks = cl.kvroute.proxied_stream(
                {**body, "stream": True, "stream_options": {"include_usage": True}})
            usages = [json.loads(c)["usage"] for c in chunks
                      if c != "[DONE]" and json.loads(c).get("usage")]
            if not usages:
                raise CheckFailed(f"request {number}: the stream carried no usage")
            cached = _cached_of(usages[-1])
            streamed += 1
        else:
            iid, answer = cl.kvroute.proxied_completion(body)
            cached = _cached_of(answer["usage"])
        name = cl.name_of(iid)
        hits += cached > 0
        before, after = befores[iid], _after(cl, iid, befores[iid])
        got = (after.compared - before.compared, after.exact - before.exact,
               after.actual - before.actual, after.predicted - before.predicted)
        if got != (1, 1, cached, cached):
            details.append(f"request {number} ({'streamed' if stream else 'whole'}, "
                           f"{len(prompt)} tokens, {name}): vLLM cached {cached}; kvroute "
                           f"recorded compared/exact/actual/predicted {got}, "
                           f"unavailable +{after.unavailable - before.unavailable}")
        bs = cl.engines[name].spec.block_size
        cl.settle(name, before_taps[name], expect_batch=len(prompt) // bs > cached // bs)
        last = (name, prompt)
    if hits < requests // 4:
        details.append(f"only {hits} of {requests} requests hit the cache: the agreement "
                       "proves too little")
    # Behind kvroute's back: the engine that served the last prompt forgets it.
    assert last is not None
    name, prompt = last
    iid = cl.ids[name]
    predicted = cl.matched(prompt)[name]
    if predicted == 0:
        raise CheckFailed(f"kvroute predicts no hit for the last prompt on {name}: the "
                          "reset would prove nothing")
    cl.engines[name].reset_prefix_cache()
    before_taps = {n: t.count for n, t in cl.taps.items()}
    before = Accuracy(cl, iid)
    sent_to, answer = cl.kvroute.proxied_completion(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
    cached = _cached_of(answer["usage"])
    after = _after(cl, sent_to, before) if sent_to == iid else before
    cl.settle(cl.name_of(sent_to), before_taps[cl.name_of(sent_to)], expect_batch=True)
    shown = (after.below - before.below, after.predicted - before.predicted,
             after.actual - before.actual)
    if sent_to != iid or cached != 0 or shown != (1, predicted, 0):
        details.append(f"after {name}'s cache was reset behind kvroute's back: sent to "
                       f"{cl.name_of(sent_to)}, vLLM cached {cached}; kvroute recorded "
                       f"differences below 0 / predicted / actual {shown}, expected "
                       f"(1, {predicted}, 0)")
    totals = {n: Accuracy(cl, i) for n, i in cl.ids.items()}
    summary = (f"{requests} proxied requests ({streamed} streamed, {hits} hits): "
               f"{sum(int(a.exact) for a in totals.values())} exact of "
               f"{sum(int(a.compared) for a in totals.values())} compared; after a reset "
               f"behind kvroute's back: predicted {predicted}, vLLM {cached}, counted "
               f"below 0: {int(shown[0])}")
    return CheckResult("12 hit accuracy", not details, summary, details=details)
