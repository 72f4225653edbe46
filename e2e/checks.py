"""The end-to-end checks: kvroute's answers against what real vLLM engines report.

Ground truth is vLLM's own ``usage.prompt_tokens_details.cached_tokens``.
One comparison ("a step") is: ask kvroute how many tokens of the prompt the
chosen instance holds, send the prompt to that instance, and require
kvroute's ``matched_tokens`` to equal vLLM's ``cached_tokens`` exactly.
kvroute answers with what vLLM will reuse, so prompts ending on a block
boundary (vLLM always recomputes the last token: a 64-token prompt with both
blocks cached reports 32) must agree too; the workloads include such prompts.

Events are published after the engine step, so the index trails the engine.
After every request the harness waits (bounded) until kvroute has applied the
last batch the engine published, as seen on the harness's own subscription
(:mod:`e2e.tap`), before it asks the next question.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from e2e.engines import Engine, wait_ready
from e2e.service import Kvroute, KvrouteError
from e2e.tap import EventTap, replay_seqs
from e2e.workloads import Prompt, grouped_workload, random_tokens, shared_prefix_workload

SYNC_TIMEOUT = 10.0  # seconds kvroute may take to apply a batch the engine published


class CheckFailed(AssertionError):
    """kvroute disagreed with vLLM, or broke its contract."""


@dataclass
class Step:
    """One prompt sent to one engine, with kvroute's prediction just before."""

    engine: str
    tokens: int
    predicted: int  # kvroute's matched_tokens for that engine
    cached: int  # vLLM's cached_tokens

    @property
    def ok(self) -> bool:
        return self.predicted == self.cached

    def describe(self) -> str:
        return (f"{self.engine}: {self.tokens}-token prompt, kvroute matched_tokens="
                f"{self.predicted}, vLLM cached_tokens={self.cached}")


@dataclass
class CheckResult:
    name: str
    ok: bool
    summary: str
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)


@dataclass
class Cluster:
    """What the checks act on: engines by name, their kvroute ids and event taps."""

    engines: dict[str, Engine]
    taps: dict[str, EventTap]
    kvroute: Kvroute
    ids: dict[str, str] = field(default_factory=dict)  # engine name -> kvroute instance id
    say: Callable[[str], None] = print

    def name_of(self, instance_id: str) -> str:
        for name, iid in self.ids.items():
            if iid == instance_id:
                return name
        raise CheckFailed(f"kvroute routed to {instance_id!r}, which the harness never registered")

    def register_all(self) -> None:
        for name, engine in self.engines.items():
            self.ids[name] = self.kvroute.register(engine.url)
            self.say(f"  registered {name} ({engine.url}) as {self.ids[name]!r}")
        for name in self.engines:
            self.kvroute.wait_state(self.ids[name], {"live"}, 30.0, self.say, "after registering")
            self.sync(name)

    def sync(self, name: str) -> None:
        """Wait until kvroute applied the last batch this engine published."""
        deadline = time.monotonic() + SYNC_TIMEOUT
        seen: int | None = None
        target = self.taps[name].last_seq
        while time.monotonic() < deadline:
            # Read again each time: a batch published after the call (one request can make
            # more than one) reaches the tap and kvroute in either order.
            target = self.taps[name].last_seq
            if target is None:
                return
            seen = self.kvroute.last_seq(self.ids[name])
            if seen == target:
                return
            time.sleep(0.01)
        raise CheckFailed(
            f"{name}: kvroute's last_seq is {seen}, the engine published up to seq {target}; "
            f"not applied within {SYNC_TIMEOUT:.0f}s")

    def settle(self, name: str, batches_before: int, expect_batch: bool) -> None:
        """After a request: wait for the engine's batch (if one is due), then for kvroute."""
        tap = self.taps[name]
        if expect_batch and not tap.wait_for_count(batches_before + 1, 10.0):
            raise RuntimeError(f"{name}: vLLM published no KV-event batch for a request "
                               "that stored new blocks (is the harness's subscription up?)")
        tap.wait_quiet(0.05, 2.0)
        self.sync(name)

    def step(self, prompt: Prompt, engine_name: str | None = None) -> Step:
        """Ask kvroute, send to ``engine_name`` (default: kvroute's choice), compare."""
        answer = self.kvroute.route(prompt)
        name = engine_name or self.name_of(str(answer["instance"]))
        engine = self.engines[name]
        predicted = self.predicted_for(answer, name)
        bs = engine.spec.block_size
        before = self.taps[name].count
        cached = engine.cached_tokens(prompt)
        self.settle(name, before, expect_batch=len(prompt) // bs > cached // bs)
        return Step(name, len(prompt), predicted, cached)

    def predicted_for(self, answer: dict, name: str) -> int:
        return int(_score_of(self, answer, name)["matched_tokens"])

    def holdings_disagree(self) -> list[str]:
        """kvroute's block count per engine against the engine's own event stream."""
        wrong = []
        for name, iid in self.ids.items():
            held, streamed = self.kvroute.holdings(iid), self.taps[name].held_blocks
            if held != streamed:
                wrong.append(f"{name}: kvroute holds {held} blocks, the engine's events leave "
                             f"{streamed}")
        return wrong

    def holdings(self) -> dict[str, int]:
        return {name: self.kvroute.holdings(iid) for name, iid in self.ids.items()}

    def matched(self, prompt: Prompt) -> dict[str, int]:
        """kvroute's matched_tokens per engine name (0 for an engine it left out)."""
        by_id = self.kvroute.matched(prompt)
        return {name: by_id.get(iid, 0) for name, iid in self.ids.items()}

    def reset_engine(self, name: str) -> None:
        """Empty an engine's prefix cache and make kvroute learn it.

        vLLM publishes AllBlocksCleared with its next engine step, not at reset
        time; a prompt shorter than one block makes that step without storing
        anything.
        """
        engine = self.engines[name]
        engine.reset_prefix_cache()
        before = self.taps[name].count
        engine.complete([7, 8, 9, 10, 11])
        self.settle(name, before, expect_batch=True)
        types = [t for b in self.taps[name].batches_since(before) for t in b.event_types]
        if "AllBlocksCleared" not in types:
            raise RuntimeError(f"{name}: vLLM sent no AllBlocksCleared after the reset: {types}")


def _mismatches(steps: list[Step]) -> list[str]:
    return [f"request {i}: {s.describe()}" for i, s in enumerate(steps) if not s.ok]


def check_agreement(cl: Cluster, prompts: list[Prompt]) -> CheckResult:
    """1. kvroute's prediction equals vLLM's hit for every request it routes."""
    steps = [cl.step(p) for p in prompts]
    bad = _mismatches(steps)
    hits = sum(1 for s in steps if s.cached > 0)
    per_engine = {n: sum(1 for s in steps if s.engine == n) for n in cl.engines}
    summary = (f"{len(steps) - len(bad)}/{len(steps)} requests agree; {hits} had cache hits "
               f"({sum(s.cached for s in steps)} tokens); routed {per_engine}")
    if hits < len(prompts) // 4:
        bad.append(f"only {hits} requests hit the cache: the workload proves too little")
    bad += cl.holdings_disagree()
    summary += f"; holdings {cl.holdings()} match the event streams"
    return CheckResult("1 agreement", not bad, summary, details=bad)


def check_kvroute_restart(cl: Cluster, prompts: list[Prompt]) -> CheckResult:
    """5. A new kvroute rebuilds the same answers from replay, without new traffic."""
    before = [cl.matched(p) for p in prompts]
    engine_batches = {n: t.count for n, t in cl.taps.items()}
    cl.kvroute.stop()
    cl.say("  kvroute stopped; starting a new one and registering the engines by URL")
    cl.kvroute.start(cl.kvroute.settings)
    cl.ids.clear()
    cl.register_all()
    after = [cl.matched(p) for p in prompts]
    details = [f"prompt {i}: before {b}, after {a}"
               for i, (b, a) in enumerate(zip(before, after, strict=True)) if a != b]
    details += cl.holdings_disagree()
    new_batches = {n: t.count - engine_batches[n] for n, t in cl.taps.items()}
    if any(new_batches.values()):
        details.append(f"the engines published during the restart: {new_batches}")
    held = sum(sum(m.values()) for m in before)
    if held == 0:
        details.append("kvroute held nothing before the restart: nothing was proven")
    # The rebuilt answers must also still be vLLM's truth.
    best = max(range(len(prompts)), key=lambda i: max(after[i].values()))
    step = cl.step(prompts[best], max(after[best], key=after[best].get))
    if not step.ok:
        details.append(f"after the restart: {step.describe()}")
    summary = (f"{len(prompts) - sum(1 for d in details if d.startswith('prompt'))}/"
               f"{len(prompts)} answers identical after replay ({held} matched tokens); "
               f"probe: {step.describe()}")
    return CheckResult("5 kvroute restart", not details, summary, details=details)


def check_eviction(cl: Cluster, name: str, rng: random.Random) -> CheckResult:
    """2. What vLLM evicted stops matching; what it kept still matches."""
    bs = cl.engines[name].spec.block_size
    details: list[str] = []
    early = [random_tokens(rng, 170) for _ in range(3)]
    steps = [cl.step(p, name) for p in early]
    learned = [cl.matched(p)[name] for p in early]
    if learned != [len(p) // bs * bs for p in early]:
        details.append(f"kvroute did not learn the early prompts: matched {learned}")
    removed_before = cl.taps[name].event_counts()["BlockRemoved"]
    flood = [random_tokens(rng, 300) for _ in range(12)]
    steps += [cl.step(p, name) for p in flood]
    evicted = cl.taps[name].event_counts()["BlockRemoved"] - removed_before
    if evicted == 0:
        raise RuntimeError(f"{name}: vLLM evicted nothing; its KV cache is too large for this")
    now_early = [cl.matched(p)[name] for p in early]
    kept_full = len(flood[-1]) // bs * bs
    kept_now = cl.matched(flood[-1])[name]
    if not any(n < b for n, b in zip(now_early, learned, strict=True)):
        details.append(f"vLLM evicted {evicted} blocks but kvroute still matches every early "
                       f"prompt in full: {now_early}")
    if kept_now != kept_full:
        details.append(f"the newest prompt matches {kept_now}, expected {kept_full}")
    # Probing changes the cache, so each probe is its own step: kvroute is asked
    # again just before it. The kept prompt first: its probe stores nothing new.
    kept_probe = cl.step(flood[-1], name)
    victim = min(range(len(early)), key=lambda i: now_early[i])
    evicted_probe = cl.step(early[victim], name)
    steps += [kept_probe, evicted_probe]
    if kept_probe.cached == 0:
        details.append(f"kept prompt was not a hit in vLLM: {kept_probe.describe()}")
    if evicted_probe.predicted >= learned[victim]:
        details.append(f"evicted prompt still fully predicted: {evicted_probe.describe()}")
    details += _mismatches(steps)
    details += cl.holdings_disagree()
    summary = (f"vLLM evicted {evicted} blocks; early prompts matched {learned} -> "
               f"{now_early}; newest kept {kept_now}/{kept_full}; probes: kept "
               f"{kept_probe.predicted}=={kept_probe.cached}, evicted "
               f"{evicted_probe.predicted}=={evicted_probe.cached}")
    return CheckResult("2 eviction", not details, summary, details=details)


def check_reset(cl: Cluster, name: str, probes: list[Prompt]) -> CheckResult:
    """3. POST /reset_prefix_cache empties that instance in kvroute, and only that one."""
    details: list[str] = []
    held_before = {n: cl.kvroute.holdings(cl.ids[n]) for n in cl.engines}
    if held_before[name] == 0:
        details.append(f"{name} held nothing before the reset: nothing to prove")
    cl.reset_engine(name)
    held_after = {n: cl.kvroute.holdings(cl.ids[n]) for n in cl.engines}
    if held_after[name] != 0:
        details.append(f"{name} still holds {held_after[name]} blocks after AllBlocksCleared")
    for other in cl.engines:
        if other != name and held_after[other] != held_before[other]:
            details.append(f"{other} changed from {held_before[other]} to {held_after[other]}")
    still = [i for i, p in enumerate(probes) if cl.matched(p)[name] != 0]
    if still:
        details.append(f"{len(still)} earlier prompts still match {name}")
    probe = cl.step(probes[-1], name)
    if not probe.ok or probe.cached != 0:
        details.append(f"probe after reset: {probe.describe()}")
    details += cl.holdings_disagree()
    summary = (f"holdings {held_before} -> {held_after}; {len(probes)} earlier prompts match 0; "
               f"probe {probe.predicted}=={probe.cached}")
    return CheckResult("3 reset_prefix_cache", not details, summary, details=details)


def _wait_hits(cl: Cluster, start: dict[str, float], expected: int) -> int:
    """Sum of vllm:prefix_cache_hits_total deltas, once it reaches ``expected`` (bounded)."""
    deadline = time.monotonic() + 5.0
    total = 0
    while time.monotonic() < deadline:
        total = int(sum(e.prefix_cache_hits() - start[n] for n, e in cl.engines.items()))
        if total >= expected:
            break
        time.sleep(0.1)
    return total


def check_routing_pays(cl: Cluster, rng: random.Random) -> CheckResult:
    """6. The same workload: kvroute's routing versus round-robin, in vLLM's own hit counter."""
    prompts = grouped_workload(rng, groups=8, per_group=6, prefix_tokens=192)
    names = list(cl.engines)
    results: dict[str, int] = {}
    details: list[str] = []
    for policy in ("kvroute", "round-robin"):
        for name in names:
            cl.reset_engine(name)
        start = {n: e.prefix_cache_hits() for n, e in cl.engines.items()}
        reported = 0
        for i, prompt in enumerate(prompts):
            if policy == "kvroute":
                step = cl.step(prompt)
                if not step.ok:
                    details.append(f"kvroute run, request {i}: {step.describe()}")
                reported += step.cached
            else:
                reported += cl.engines[names[i % len(names)]].cached_tokens(prompt)
        results[policy] = _wait_hits(cl, start, reported)
        if results[policy] != reported:
            details.append(f"{policy}: /metrics counted {results[policy]} hit tokens, the "
                           f"responses reported {reported}")
    for name in names:  # leave kvroute in step with the engines for the next check
        cl.settle(name, cl.taps[name].count, expect_batch=False)
    details += cl.holdings_disagree()
    if results["kvroute"] <= results["round-robin"]:
        details.append("routing by kvroute did not beat round-robin")
    total = sum(len(p) for p in prompts)
    summary = (f"{len(prompts)} requests, {total} prompt tokens; prefix-cache hit tokens "
               f"(vllm:prefix_cache_hits_total): kvroute {results['kvroute']} "
               f"({results['kvroute'] / total:.0%}) vs round-robin {results['round-robin']} "
               f"({results['round-robin'] / total:.0%})")
    return CheckResult("6 routing pays", not details, summary, details=details)


def check_engine_restart(cl: Cluster, name: str, rng: random.Random,
                         boot_timeout: float) -> CheckResult:
    """4. An engine killed and started again: kvroute drops what it had, then relearns."""
    details: list[str] = []
    engine = cl.engines[name]
    iid = cl.ids[name]
    prompt = random_tokens(rng, 230)
    cl.step(prompt, name)
    held_before = cl.kvroute.holdings(iid)
    if cl.matched(prompt)[name] == 0:
        details.append(f"kvroute did not learn the prompt on {name} before the restart")
    cl.say(f"  killing {name} (SIGKILL to its process group) and starting it on the same ports")
    engine.kill()
    cl.taps[name].forget_epoch()
    try:
        cl.kvroute.wait_state(iid, {"down", "connecting", "replaying"}, 20.0, cl.say,
                              "after the engine was killed")
        answer = cl.kvroute.route(prompt)
        eligible = [s["instance"] for s in answer.get("scores", [])]
        if answer.get("instance") == iid:
            details.append(f"kvroute routed to {name} while it was down: {answer}")
        cl.say(f"  while {name} is down kvroute answers {answer.get('instance')} "
               f"(eligible: {eligible})")
    except KvrouteError as exc:
        details.append(f"kvroute never noticed that {name} died: {exc}")
    engine.start()
    wait_ready([engine], boot_timeout, cl.say)
    cl.kvroute.wait_state(iid, {"live"}, 60.0, cl.say, "after the engine came back")
    deadline = time.monotonic() + SYNC_TIMEOUT
    while time.monotonic() < deadline and cl.kvroute.holdings(iid) != 0:
        time.sleep(0.05)
    held_after = cl.kvroute.holdings(iid)
    if held_after != 0:
        details.append(f"{name} restarted with an empty cache, kvroute still holds "
                       f"{held_after} blocks for it")
    first = cl.step(prompt, name)  # the new engine has nothing: both must say 0
    if first.predicted != 0 or not first.ok:
        details.append(f"first request after the restart: {first.describe()}")
    relearn = [cl.step(prompt, name)]
    relearn += [cl.step(p, name) for p in shared_prefix_workload(rng, 12)]
    if relearn[0].cached == 0:
        details.append(f"vLLM did not cache the prompt again: {relearn[0].describe()}")
    details += _mismatches(relearn)
    details += cl.holdings_disagree()
    summary = (f"holdings {held_before} -> {held_after} after restart (tap saw "
               f"{cl.taps[name].restarts} seq restart); relearned: "
               f"{sum(s.ok for s in relearn)}/{len(relearn)} requests agree, repeat hit "
               f"{relearn[0].predicted}=={relearn[0].cached}")
    return CheckResult("4 engine restart", not details, summary, details=details)


def check_placement(cl: Cluster, rng: random.Random) -> CheckResult:
    """8. Placement guesses (kvroute's defaults): a burst sharing a new prefix stays on one
    worker, real events confirm the guess block for block, and routed traffic still agrees."""
    details: list[str] = []
    cl.kvroute.stop()
    cl.say("  restarting kvroute with its default settings (placement guesses on)")
    cl.kvroute.start({})
    cl.ids.clear()
    cl.register_all()
    prefix = random_tokens(rng, 200)
    first = cl.kvroute.route(prefix)
    chosen = cl.name_of(str(first["instance"]))
    full = (len(prefix) - 1) // cl.engines[chosen].spec.block_size
    burst = cl.kvroute.route(prefix + random_tokens(rng, 40))
    guessed = _score_of(cl, burst, chosen)
    if burst["instance"] != first["instance"]:
        details.append(f"the burst's second request went to {burst['instance']}, the first to "
                       f"{first['instance']}")
    if guessed.get("pending_blocks", 0) < full:
        details.append(f"no guess recorded for {chosen}: {guessed}")
    sent = cl.step(prefix, chosen)  # the guess is not cache: vLLM must say 0
    if sent.cached != 0:
        details.append(f"a new prefix was a hit in vLLM: {sent.describe()}")
    confirmed = _score_of(cl, cl.kvroute.route(prefix), chosen)
    if confirmed.get("pending_blocks", 0) != 0 or confirmed["matched_blocks"] != full:
        details.append(f"real events did not replace the guess ({full} blocks): {confirmed}")
    steps = [cl.step(prefix, chosen)]
    steps += [cl.step(p) for p in shared_prefix_workload(rng, 20)]
    details += _mismatches(steps)
    details += cl.holdings_disagree()
    second = cl.name_of(str(burst["instance"]))
    summary = (f"burst: first request -> {chosen}, second -> {second} with "
               f"{guessed.get('pending_blocks')} guessed blocks on {chosen}; "
               f"confirmed by events {confirmed['matched_blocks']}/{full} blocks, pending "
               f"{confirmed.get('pending_blocks')}; {sum(s.ok for s in steps)}/{len(steps)} "
               f"routed requests agree with guesses on")
    return CheckResult("8 placement guesses", not details, summary, details=details)


def _score_of(cl: Cluster, answer: dict, name: str) -> dict:
    for score in answer.get("scores", []):
        if score.get("instance") == cl.ids[name] and score.get("dp_rank", 0) == 0:
            return score
    raise CheckFailed(f"kvroute's answer has no score for {name}: {answer}")


def check_proxy(cl: Cluster, rng: random.Random) -> CheckResult:
    """7. Proxy mode: completions sent through kvroute reach the worker it picks, and the
    hit vLLM reports equals kvroute's answer for that worker, streamed or not."""
    details: list[str] = []
    model = str(next(iter(cl.engines.values())).spec.model_dir)
    served = cl.kvroute.models()
    if model not in served:
        details.append(f"kvroute's /v1/models lacks {model}: {served}")
    steps: list[Step] = []
    for prompt in shared_prefix_workload(rng, 16):
        predicted = cl.matched(prompt)
        before = {n: t.count for n, t in cl.taps.items()}
        iid, body = cl.kvroute.proxied_completion(
            {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
        steps.append(_proxied_step(cl, iid, prompt, predicted, body["usage"], before))
    prompt = shared_prefix_workload(rng, 1)[0]
    cl.step(prompt)  # cached somewhere now; the streamed request should find it
    predicted = cl.matched(prompt)
    before = {n: t.count for n, t in cl.taps.items()}
    iid, chunks = cl.kvroute.proxied_stream(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
         "stream_options": {"include_usage": True}})
    if not chunks or chunks[-1] != "[DONE]":
        details.append(f"the streamed answer did not end with [DONE]: {chunks[-3:]}")
    usage = [json.loads(c)["usage"] for c in chunks if c != "[DONE]" and json.loads(c).get("usage")]
    if not usage:
        details.append("the streamed answer carried no usage chunk")
    else:
        steps.append(_proxied_step(cl, iid, prompt, predicted, usage[-1], before))
    details += _mismatches(steps)
    per_engine = {n: sum(1 for s in steps if s.engine == n) for n in cl.engines}
    summary = (f"{sum(s.ok for s in steps)}/{len(steps)} proxied requests (1 streamed, "
               f"{len(chunks)} SSE events) agree; {sum(s.cached > 0 for s in steps)} hits; "
               f"forwarded {per_engine}")
    return CheckResult("7 proxy", not details, summary, details=details)


def check_concurrent_proxy(cl: Cluster, rng: random.Random, clients: int = 4) -> CheckResult:
    """9. Overlapping requests through the proxy (kvroute's defaults, proxy on): several
    clients at once, streamed and not. Every answer is vLLM's own, every in-flight count
    is back at zero afterwards, kvroute's holdings still equal each engine's event stream,
    and the shared prefixes are hits."""
    details: list[str] = []
    cl.kvroute.stop()
    cl.say(f"  restarting kvroute in proxy mode with its defaults; {clients} clients at once")
    cl.kvroute.start({"KVROUTE_PROXY": "true"})
    cl.ids.clear()
    cl.register_all()
    model = str(next(iter(cl.engines.values())).spec.model_dir)
    prompts = shared_prefix_workload(rng, 32)

    def send(job: tuple[int, Prompt]) -> tuple[str, int, int, str | None]:
        i, prompt = job
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        url = f"{cl.kvroute.url}/v1/completions"
        with httpx.Client(timeout=120.0) as http:
            if i % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                with http.stream("POST", url, json=body) as response:
                    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
                    status, iid = response.status_code, response.headers.get("x-kvroute-instance")
                usage = [json.loads(line[6:]).get("usage") for line in lines
                         if line != "data: [DONE]"]
                cached = _cached_of(next((u for u in reversed(usage) if u), {}))
                ended = bool(lines) and lines[-1] == "data: [DONE]"
                error = None if status == 200 and ended else f"stream {status}, {lines[-1:]}"
            else:
                response = http.post(url, json=body)
                status, iid = response.status_code, response.headers.get("x-kvroute-instance")
                cached = _cached_of(response.json().get("usage", {})) if status == 200 else 0
                error = None if status == 200 else f"{status}: {response.text[:200]}"
        return str(iid), len(prompt), cached, error

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(send, enumerate(prompts)))
    details += [f"request {i}: {error}" for i, (_, _, _, error) in enumerate(results) if error]
    deadline = time.monotonic() + 30.0
    open_ = cl.kvroute.inflight()
    while any(open_.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        open_ = cl.kvroute.inflight()
    if any(open_.values()):
        details.append(f"in-flight counts not back at zero 30 s after the last answer: {open_}")
    for name in cl.engines:
        cl.taps[name].wait_quiet(0.2, 5.0)
        cl.sync(name)
    details += cl.holdings_disagree()
    prompt_tokens = sum(n for _, n, _, _ in results)
    cached = sum(c for _, _, c, _ in results)
    if not cached:
        details.append("no proxied request was a prefix-cache hit")
    per_engine = {name: sum(n for iid, n, _, _ in results if iid == cl.ids[name])
                  for name in cl.engines}
    summary = (f"{len(results)} requests, {clients} at a time: "
               f"{sum(e is None for *_, e in results)} answered, hit rate "
               f"{cached / max(prompt_tokens, 1):.1%} ({cached}/{prompt_tokens} prompt tokens), "
               f"prompt tokens per engine {per_engine}, in-flight afterwards {open_}")
    return CheckResult("9 concurrent proxy", not details, summary, details=details)


def _proxied_step(cl: Cluster, iid: str, prompt: Prompt, predicted: dict[str, int],
                  usage: dict, before: dict[str, int]) -> Step:
    name = cl.name_of(iid)
    cached = _cached_of(usage)
    bs = cl.engines[name].spec.block_size
    cl.settle(name, before[name], expect_batch=len(prompt) // bs > cached // bs)
    return Step(name, len(prompt), predicted[name], cached)


def _cached_of(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def check_saved_state(cl: Cluster, rng: random.Random, *, buffer_steps: int, state_dir: Path,
                      settings: dict[str, str], boot_timeout: float,
                      drop_saved_state: bool = False) -> CheckResult:
    """10. Saved state: engines whose replay keeps only ``buffer_steps`` batches, hot
    prompts stored long enough ago that the replay no longer holds them, kvroute stopped
    with SIGTERM and started again on the same state dir: its workers resume ``live`` with
    restored blocks, its answers for the hot prompts are what they were before the stop,
    and they equal vLLM's cached_tokens. A kvroute without the saved state could only
    replay the last ``buffer_steps`` batches: ``drop_saved_state`` deletes the state dir
    between the stop and the start (a negative control: the check must then fail)."""
    details: list[str] = []
    names = list(cl.engines)
    bs = cl.engines[names[0]].spec.block_size
    cl.kvroute.stop()
    restart = [e for e in cl.engines.values() if e.spec.buffer_steps != buffer_steps]
    if restart:
        cl.say(f"  restarting {', '.join(e.name for e in restart)} with buffer_steps="
               f"{buffer_steps} (SIGTERM, same ports)")
        for engine in restart:
            engine.terminate()
        for engine in restart:
            engine.stop()
            cl.taps[engine.name].forget_epoch()
            engine.spec.buffer_steps = buffer_steps
            engine.start()
        wait_ready(restart, boot_timeout, cl.say)
    shutil.rmtree(state_dir, ignore_errors=True)
    cl.kvroute.start(settings)
    cl.say(f"  kvroute with state dir {state_dir}; registering the engines by URL")
    cl.ids.clear()
    cl.register_all()

    # Hot prompts: one system prompt per engine (six full blocks), two questions after it
    # that traffic keeps touching (so vLLM keeps them: LRU), and one cut on a block
    # boundary that nothing touches again (vLLM may evict its own blocks later).
    hot: list[tuple[str, Prompt, bool]] = []  # (engine, prompt, touched again)
    for name in names:
        system = random_tokens(rng, 6 * bs)
        hot += [(name, system + random_tokens(rng, 50), True),
                (name, system + random_tokens(rng, 75), True),
                (name, system + random_tokens(rng, 2 * bs), False)]
    steps = [cl.step(p, name) for name, p, _ in hot]
    hot_seq = {name: cl.taps[name].last_seq for name in names}
    # Traffic until every engine has published more than buffer_steps batches since.
    fillers = 0
    for _ in range(4 * buffer_steps):
        behind = [n for n in names
                  if (cl.taps[n].last_seq or 0) - (hot_seq[n] or 0) <= buffer_steps + 1]
        if not behind:
            break
        for name in behind:
            for _ in range(6):
                steps.append(cl.step(random_tokens(rng, rng.randint(40, 90)), name))
                fillers += 1
            steps += [cl.step(p, n) for n, p, touched in hot if touched and n == name]
    first: dict[str, int | None] = {}
    for name in names:
        held = replay_seqs(cl.engines[name].spec.replay_endpoint, 0)
        first[name] = held[0] if held else None
        if not held or held[0] <= (hot_seq[name] or 0):
            details.append(f"{name}: the replay still holds the hot prompts' batches (up to "
                           f"seq {hot_seq[name]}): from 0 it sends {held[:3]}...")
    before = [cl.matched(p) for _, p, _ in hot]
    for (name, p, _), matched in zip(hot, before, strict=True):
        if matched[name] == 0:
            details.append(f"before the stop kvroute matched nothing of a hot "
                           f"{len(p)}-token prompt on {name}: {matched}")
    saved_seq = {name: cl.taps[name].last_seq for name in names}

    cl.kvroute.stop()
    assert cl.kvroute.proc is not None
    code = cl.kvroute.proc.returncode
    saved = sorted(p.name for p in state_dir.glob("*")) if state_dir.is_dir() else []
    if code != 0:
        details.append(f"kvroute exited with {code} on SIGTERM (0 expected)")
    if not saved:
        details.append(f"kvroute saved nothing to {state_dir} on SIGTERM")
    size = sum(p.stat().st_size for p in state_dir.glob("*")) if state_dir.is_dir() else 0
    if drop_saved_state:
        cl.say(f"  negative control: deleting {state_dir} ({size} bytes) before the restart")
        shutil.rmtree(state_dir)
    # Traffic while kvroute is down: the resumed workers must catch up from the replay.
    down = 2
    for name in names:
        for _ in range(down):
            before_count = cl.taps[name].count
            cl.engines[name].complete(random_tokens(rng, rng.randint(40, 90)))
            if not cl.taps[name].wait_for_count(before_count + 1, 10.0):
                raise RuntimeError(f"{name}: no KV-event batch for a prompt while kvroute "
                                   "was down")
        cl.taps[name].wait_quiet(0.05, 2.0)

    cl.kvroute.start(settings)
    cl.say(f"  kvroute started again on {state_dir}; registering the engines by URL")
    cl.ids.clear()
    workers: dict[str, dict] = {}
    for name, engine in cl.engines.items():
        cl.ids[name] = cl.kvroute.register(engine.url)
    for name in names:
        cl.kvroute.wait_state(cl.ids[name], {"live", "degraded"}, 60.0, cl.say,
                              "after the restart")
        cl.sync(name)
        workers[name] = cl.kvroute.worker(cl.ids[name])
    for name, worker in workers.items():
        stats = worker.get("stats", {})
        if worker.get("state") != "live":
            details.append(f"{name}: worker {worker.get('state')!r} after the restart "
                           f"(live expected); stats {stats}")
        if not stats.get("restored_blocks"):
            details.append(f"{name}: restored_blocks {stats.get('restored_blocks')!r} "
                           "(the saved holdings were not restored)")
        if stats.get("restored_unconfirmed"):
            details.append(f"{name}: {stats['restored_unconfirmed']} blocks restored "
                           "unconfirmed (the replay reached the saved seq)")
    after = [cl.matched(p) for _, p, _ in hot]
    for i, ((name, p, touched), b, a) in enumerate(zip(hot, before, after, strict=True)):
        if touched and a != b:
            details.append(f"hot prompt {i} ({len(p)} tokens, on {name}): kvroute matched "
                           f"{b} before the stop, {a} after the restart")
    details += cl.holdings_disagree()
    # The hot prompts again, each sent where kvroute routes it: vLLM's truth.
    checked = [cl.step(p) for _, p, _ in hot]
    for i, ((name, _, touched), step) in enumerate(zip(hot, checked, strict=True)):
        if not step.ok:
            details.append(f"hot prompt {i} after the restart: {step.describe()}")
        elif touched and (step.engine != name or step.cached == 0):
            details.append(f"hot prompt {i} (held by {name}) after the restart: routed to "
                           f"{step.engine}, vLLM cached {step.cached}")
    details += _mismatches(steps)
    details += cl.holdings_disagree()
    restored = {n: w.get("stats", {}).get("restored_blocks") for n, w in workers.items()}
    states = {n: w.get("state") for n, w in workers.items()}
    summary = (f"buffer_steps={buffer_steps}; hot prompts stored by seq {hot_seq}, then "
               f"{fillers} more requests: replay from 0 starts at {first}; kvroute stopped "
               f"(exit {code}, saved {size} bytes) at seq {saved_seq}, {down} batches per "
               f"engine while down; after the restart workers {states}, restored_blocks "
               f"{restored}; hot prompts {sum(s.ok for s in checked)}/{len(checked)} agree "
               f"({sum(s.cached for s in checked)} tokens cached); "
               f"{sum(s.ok for s in steps)}/{len(steps)} requests before the stop agree")
    return CheckResult("10 saved state", not details, summary, details=details)
