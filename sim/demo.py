"""`kvroute demo`: the whole loop on one machine, with no GPU.

Starts a simulated vLLM cluster on loopback, a kvroute service beside it,
registers the instances by URL exactly as an operator would, then plays a small
workload of chat-like prompts that share system prompts, a third of them from each of two
tenants with a `cache_salt` of their own (the engines cache a tenant's copy apart): each
prompt is sent to kvroute's proxy (`POST /v1/completions`), which routes it and forwards it
to the chosen instance, whose `cached_tokens` shows the hit (and feeds kvroute's
predicted-vs-actual figures on the dashboard at `/dashboard`). A summary line per
instance is printed every few seconds until Ctrl-C or `--duration`.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster

__all__ = ["run_demo"]

SUMMARY_EVERY = 3.0
TENANTS = (None, "tenant-a", "tenant-b")  # who sends each prompt (None: no salt)
LIVE_WITHIN = 60.0  # seconds: generous, a loaded machine connects subscribers slowly
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu").split()


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    routed: dict[str, int] = field(default_factory=dict)


def _system_prompts(rng: random.Random, groups: int, words: int) -> list[str]:
    return [f"system prompt {g}: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for g in range(groups)]


def _print_summary(client: httpx.Client, base: str, tally: Tally, started: float) -> None:
    instances = client.get(f"{base}/v1/instances").json()["instances"]
    rate = tally.cached_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
    print(f"[{time.monotonic() - started:6.1f}s] {tally.requests} requests, "
          f"prefix-cache hit rate {rate:.1%} ({tally.cached_tokens}/{tally.prompt_tokens} "
          "prompt tokens)")
    for summary in instances:
        detail = client.get(f"{base}/v1/instances/{summary['id']}").json()
        held = sum(sum(w["holdings"].values()) for w in detail.get("workers", []))
        print(f"    {summary['id']:<22} {summary['state']:<9} blocks held {held:>5}   "
              f"routed here {tally.routed.get(summary['id'], 0):>4}")
    sys.stdout.flush()


def run_demo(*, port: int = 8000, instances: int = 4, duration: float | None = None,
             requests: int | None = None, seed: int = 0) -> int:
    """Route simulated traffic until `duration` seconds have passed or `requests` requests
    were served (whichever comes first; neither: until Ctrl-C)."""
    rng = random.Random(seed)
    print(f"starting {instances} simulated vLLM instances on loopback ...", flush=True)
    with SimCluster(n=instances, block_size=16, num_blocks=256, seed=seed) as cluster:
        settings = Settings(host="127.0.0.1", port=port, tokenizer="instance", proxy=True,
                            log_level="warning", ready_grace_seconds=10)
        try:
            server = BackgroundServer(settings).start()
        except (OSError, RuntimeError) as exc:
            print(f"kvroute demo: {exc} (is port {settings.port} in use? try --port)",
                  file=sys.stderr)
            return 1
        try:
            return _play(server.url, cluster.urls, rng, duration, requests)
        except KeyboardInterrupt:
            print("\nstopping ...")
            return 0
        finally:
            server.stop()


def _wait_live(client: httpx.Client, base: str, within: float) -> bool:
    """Wait until every registered instance is live: kvroute routes only to workers whose
    subscriber applies the live stream, so routing sooner would be refused (503)."""
    deadline = time.monotonic() + within
    while True:
        states = {i["id"]: i["state"]
                  for i in client.get(f"{base}/v1/instances").json()["instances"]}
        if all(state == "live" for state in states.values()):
            print(f"all {len(states)} instances live")
            return True
        if time.monotonic() > deadline:
            print(f"kvroute demo: instances not live after {within:.0f}s: {states}",
                  file=sys.stderr)
            return False
        time.sleep(0.1)


def _play(base: str, urls: list[str], rng: random.Random, duration: float | None,
          requests: int | None) -> int:
    with httpx.Client(timeout=30.0) as client:
        for url in urls:
            answer = client.post(f"{base}/v1/instances", json={"url": url})
            answer.raise_for_status()
            print(f"registered {url} as {answer.json()['id']} "
                  f"(discovered through {url}/kv_event_sources)")
        if not _wait_live(client, base, LIVE_WITHIN):
            return 1
        prompts = _system_prompts(rng, groups=2 * len(urls), words=60)
        example = prompts[0]
        print("\nkvroute is answering on", base)
        print(f"live dashboard: {base}/dashboard")
        print("try, while it runs:\n")
        print(f"  curl -s {base}/v1/route -H 'content-type: application/json' "
              f"-d '{{\"prompt\": \"{example}\"}}'\n")
        tally = Tally()
        started = last = time.monotonic()
        while ((duration is None or time.monotonic() - started < duration)
               and (requests is None or tally.requests < requests)):
            system = rng.choice(prompts)
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
            prompt = f"{system}\nuser: {question}"
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 8}
            tenant = rng.choice(TENANTS)
            if tenant is not None:
                body["cache_salt"] = tenant
            done = client.post(f"{base}/v1/completions", json=body)
            done.raise_for_status()
            usage = done.json()["usage"]
            instance = done.headers["x-kvroute-instance"]
            tally.requests += 1
            tally.prompt_tokens += usage["prompt_tokens"]
            tally.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)
            tally.routed[instance] = tally.routed.get(instance, 0) + 1
            if time.monotonic() - last >= SUMMARY_EVERY:
                _print_summary(client, base, tally, started)
                last = time.monotonic()
            time.sleep(0.05)
        _print_summary(client, base, tally, started)
    return 0
