"""Checks 13 and 14: what vLLM's reuse reports and tenants' cache salts mean to kvroute,
on real engines.

13. A request sent with ``vllm_xargs: {"kv_cache_report_mode": "full"}`` makes vLLM publish
    ``BlockStored`` again for the cached blocks it reused, and no ``BlockRemoved`` ever
    pairs with such a report. A prompt computed, reused by two such requests, then evicted
    by a flood: afterwards kvroute must predict exactly what the engine still serves from
    cache (before kvroute's rule, it went on predicting the whole prompt).
14. One prompt under two salts and unsalted: vLLM caches each apart. Each tenant's
    prediction, asked through ``/v1/route`` with its ``cache_salt`` just before the request
    is sent, equals the engine's ``cached_tokens``; then salted requests through kvroute's
    proxy keep its predicted-vs-actual metrics exact.
"""

from __future__ import annotations

import random

from e2e.checks import CheckResult, Cluster, Step, _cached_of, _mismatches
from e2e.hit_check import Accuracy, _after
from e2e.workloads import random_tokens

REPORT_FULL = {"vllm_xargs": {"kv_cache_report_mode": "full"}}


def _sent(cl: Cluster, name: str, prompt: list[int], *, cache_salt: str | None = None,
          **extra: object) -> Step:
    """kvroute's prediction for ``name`` (with the tenant's salt), then the request, then
    kvroute caught up with what the engine published for it: a batch when the request
    stored new blocks, or reported the ones it reused."""
    predicted = cl.kvroute.matched(prompt, cache_salt=cache_salt).get(cl.ids[name], 0)
    engine = cl.engines[name]
    before = cl.taps[name].count
    body = dict(extra)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    cached = _cached_of(engine.complete(prompt, **body)["usage"])
    bs = engine.spec.block_size
    reported = extra.get("vllm_xargs") == REPORT_FULL["vllm_xargs"] and cached > 0
    cl.settle(name, before, expect_batch=len(prompt) // bs > cached // bs or reported)
    return Step(name, len(prompt), predicted, cached)


def check_reuse_reports(cl: Cluster, name: str, rng: random.Random) -> CheckResult:
    """13. Reuse reports never keep an evicted block in kvroute."""
    bs = cl.engines[name].spec.block_size
    details: list[str] = []
    prompt = random_tokens(rng, 10 * bs)
    full = (len(prompt) - 1) // bs * bs  # vLLM always computes the last token
    steps = [_sent(cl, name, prompt)]
    stored_before = cl.taps[name].event_counts()["BlockStored"]
    steps += [_sent(cl, name, prompt, **REPORT_FULL) for _ in range(2)]
    reports = cl.taps[name].event_counts()["BlockStored"] - stored_before
    if reports < 2:
        details.append(f"vLLM published {reports} BlockStored for two reused requests with "
                       "kv_cache_report_mode full: no reuse report to test")
    if steps[-1].cached != full:
        details.append(f"the reused prompt was not a full hit: {steps[-1].describe()}")
    removed_before = cl.taps[name].event_counts()["BlockRemoved"]
    for _ in range(12):
        flood = random_tokens(rng, 300)
        steps.append(_sent(cl, name, flood))
    evicted = cl.taps[name].event_counts()["BlockRemoved"] - removed_before
    predicted_after = cl.kvroute.matched(prompt).get(cl.ids[name], 0)
    probe = _sent(cl, name, prompt)
    steps.append(probe)
    if evicted == 0:
        details.append("the flood evicted nothing: the cache is too large for this check")
    if probe.cached >= full:
        details.append(f"the flood did not evict the reported prompt: {probe.describe()}")
    details += _mismatches(steps)
    details += cl.holdings_disagree()
    summary = (f"{reports} reuse reports; the flood evicted {evicted} blocks; afterwards "
               f"kvroute predicted {predicted_after}, vLLM served {probe.cached} of "
               f"{len(prompt)} from cache; {len(steps)} steps exact: "
               f"{sum(s.ok for s in steps)}")
    return CheckResult("13 reuse reports", not details, summary, details=details)


def check_tenants(cl: Cluster, rng: random.Random) -> CheckResult:
    """14. Each tenant is predicted on its own blocks only, by route and by the proxy."""
    names = list(cl.engines)
    name = names[0]
    bs = cl.engines[name].spec.block_size
    details: list[str] = []
    prompt = random_tokens(rng, 8 * bs + 5)
    steps = [_sent(cl, name, prompt, cache_salt="tenant-a")]
    # Asked before each is sent: tenant-a holds it; tenant-b and the unsalted do not (yet).
    for salt in ("tenant-a", "tenant-b", None, "tenant-b", None):
        steps.append(_sent(cl, name, prompt, cache_salt=salt))
    expected = [0, 8 * bs, 0, 0, 8 * bs, 8 * bs]
    if [s.cached for s in steps] != expected:
        details.append(f"vLLM's cached tokens per request {[s.cached for s in steps]}, "
                       f"expected {expected}: the engine did not keep the tenants apart")
    # Through the proxy: kvroute chooses, forwards with the salt, and compares what it
    # predicted with what vLLM reported (check 12's metrics), request by request.
    tokens = random_tokens(rng, 6 * bs + 3)
    plan = [("tenant-c", 0), ("tenant-c", 6 * bs), ("tenant-d", 0), (None, 0),
            ("tenant-c", 6 * bs)]
    model = cl.kvroute.models()[0]
    seen = []
    for salt, wanted in plan:
        before = {iid: Accuracy(cl, iid) for iid in cl.ids.values()}
        batches = {n: cl.taps[n].count for n in cl.engines}
        body: dict[str, object] = {"model": model, "prompt": tokens, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        answer = cl.kvroute.http.post("/v1/completions", json=body)
        if answer.status_code != 200:
            details.append(f"proxied ({salt}): {answer.status_code} {answer.text[:200]}")
            continue
        iid = answer.headers["x-kvroute-instance"]
        cached = _cached_of(answer.json()["usage"])
        after = _after(cl, iid, before[iid])
        exact = after.exact - before[iid].exact
        predicted = after.predicted - before[iid].predicted
        seen.append((salt, predicted, cached))
        if cached != wanted or exact != 1 or predicted != cached:
            details.append(f"proxied ({salt}) to {iid}: kvroute predicted {predicted}, vLLM "
                           f"served {cached} from cache (expected {wanted})")
        served = cl.name_of(iid)
        cl.settle(served, batches[served], expect_batch=len(tokens) // bs > cached // bs)
    details += _mismatches(steps)
    summary = (f"route: predicted {[s.predicted for s in steps]} == vLLM "
               f"{[s.cached for s in steps]} (tenant-a, then a, b, none, b, none); proxy "
               f"(salt, predicted, actual): {seen}")
    return CheckResult("14 tenants", not details, summary, details=details)
