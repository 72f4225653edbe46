"""The engines of the real-vLLM benchmark (``benchmarks.real_hitrate``) and a fresh kvroute
in front of them.

``Fleet`` holds the engines the benchmark started and makes the synchronous calls between
runs (metrics, waiting for idle, resetting prefix caches). ``start_kvroute`` starts one
kvroute with every engine registered and live; ``inflight_check`` reads its
``load.inflight`` after a run, which must come back to 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.real_parts import parse_engine_metrics
from e2e.engines import Engine
from e2e.processes import ProcessSet
from e2e.service import Kvroute, KvrouteError

PROBE = [7, 8, 9, 10, 11]  # shorter than a block: makes the engine step, caches nothing


# --- engines: metrics, idle, reset ----------------------------------------------------------------


class Fleet:
    """The engines the benchmark started, and the synchronous calls made between runs."""

    def __init__(self, engines: list[Engine], model: str, say: Callable[[str], None]) -> None:
        self.engines = engines
        self.model = model
        self.say = say
        self.http = httpx.Client(timeout=30.0, trust_env=False)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.engines]

    def metrics(self, engine: Engine) -> dict[str, float]:
        response = self.http.get(f"{engine.url}/metrics")
        response.raise_for_status()
        return parse_engine_metrics(response.text)

    def check_alive(self) -> None:
        for engine in self.engines:
            code = engine.proc.exited() if engine.proc else None
            if code is not None:
                raise RuntimeError(f"{engine.name} exited with code {code}; last log lines:\n"
                                   f"{engine.proc.log_tail() if engine.proc else ''}")

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no engine has a running or waiting request (abandoned requests included)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = {}
            for engine in self.engines:
                m = self.metrics(engine)
                if m["running"] or m["waiting"]:
                    busy[engine.name] = (m["running"], m["waiting"])
            if not busy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines still busy after {timeout:.0f}s "
                                   f"(running, waiting): {busy}")
            time.sleep(0.2)

    def settled_metrics(self, timeout: float = 10.0) -> dict[str, dict[str, float]]:
        """Readings of every engine that no longer change (the engine records a step's
        stats a moment after it answered)."""
        previous = {e.name: self.metrics(e) for e in self.engines}
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(0.3)
            current = {e.name: self.metrics(e) for e in self.engines}
            if current == previous or time.monotonic() > deadline:
                return current
            previous = current

    def reset(self, engine: Engine, attempts: int = 30) -> int:
        """POST /reset_prefix_cache until the engine says it succeeded; returns the attempts.

        vLLM refuses a reset while blocks are in use. Depending on the version it says so
        with 409, with ``{"success": false}``, or not at all (then the engine is idle, see
        wait_idle, and nothing holds blocks, so the reset cannot fail)."""
        last = ""
        for attempt in range(1, attempts + 1):
            response = self.http.post(f"{engine.url}/reset_prefix_cache")
            ok = response.status_code == 200
            if ok and response.content:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                if isinstance(body, dict) and body.get("success") is False:
                    ok = False
                elif body is False:
                    ok = False
            if ok:
                return attempt
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            time.sleep(1.0)
        raise RuntimeError(f"{engine.name}: /reset_prefix_cache did not succeed in "
                           f"{attempts} attempts; last answer {last}")

    def probe(self, engine: Engine) -> None:
        """One tiny request: vLLM publishes AllBlocksCleared with its next step."""
        response = self.http.post(f"{engine.url}/v1/completions", json={
            "model": self.model, "prompt": PROBE, "max_tokens": 1, "temperature": 0.0})
        response.raise_for_status()

    def prepare(self) -> list[str]:
        """Idle, empty prefix caches, the clears published; notes for the record."""
        notes = []
        self.check_alive()
        self.wait_idle()
        for engine in self.engines:
            attempts = self.reset(engine)
            if attempts > 1:
                notes.append(f"{engine.name}: reset took {attempts} attempts")
            self.probe(engine)
        self.wait_idle()
        return notes

    def close(self) -> None:
        self.http.close()


#: Decisions each benchmark kvroute keeps: more than one run's requests.
DECISION_LOG = 20_000

# --- kvroute ------------------------------------------------------------------------------------


def start_kvroute(procs: ProcessSet, fleet: Fleet, log_dir: Path, proxy: bool,
                  say: Callable[[str], None], tokenizer: str | None = None
                  ) -> tuple[Kvroute, dict[str, str]]:
    """A fresh kvroute with the engines registered by URL and live; returns it and the
    instance id of each engine name. `tokenizer` is its setting for text prompts: "instance"
    (the engines' /tokenize, the proxy's default anyway) or a tokenizer.json folder."""
    kv = Kvroute(procs, log_dir)
    # The decision log (app.routing.decision_log) lets a dipping run be replayed decision by
    # decision.
    kv.start({"KVROUTE_PROXY": "true" if proxy else "false",
              "KVROUTE_DECISION_LOG": str(DECISION_LOG),
              **({"KVROUTE_TOKENIZER": tokenizer} if tokenizer else {})})
    ids = {e.name: kv.register(e.url) for e in fleet.engines}
    for iid in ids.values():
        kv.wait_state(iid, {"live"}, 60.0, say, "after registering")
    # The engines were reset before kvroute started: whatever it replays ends empty.
    deadline = time.monotonic() + 15.0
    while any(kv.holdings(iid) for iid in ids.values()):
        if time.monotonic() > deadline:
            held = {name: kv.holdings(iid) for name, iid in ids.items()}
            raise KvrouteError(f"kvroute still holds blocks of reset engines: {held}")
        time.sleep(0.1)
    return kv, ids


def read_inflight(kv: Kvroute, probe: list[int], order: list[tuple[str, str]]
                  ) -> tuple[list[int], dict[str, Any]]:
    """load.inflight of each engine's rank-0 worker in a POST /v1/route answer (in ``order``
    of (engine name, instance id)), and the raw load readings. Asked as a probe (a question
    only: no placement guess, not counted as an answer)."""
    response = kv.http.post("/v1/route", json={"token_ids": probe, "probe": True})
    if response.status_code != 200:
        raise KvrouteError(f"POST /v1/route -> {response.status_code}: {response.text[:300]}")
    answer = response.json()
    by_id: dict[str, dict[str, Any]] = {}
    for score in answer.get("scores", []):
        if int(score.get("dp_rank", 0)) == 0:
            by_id[str(score["instance"])] = score
    values, loads = [], {}
    for name, iid in order:
        score = by_id.get(iid, {})
        load = score.get("load") or {}
        values.append(int(load.get("inflight") or 0))
        loads[name] = {"load": load, "cost_terms": score.get("cost_terms"),
                       "queued_prefill_tokens": score.get("queued_prefill_tokens"),
                       "running_requests": score.get("running_requests")}
    return values, loads


def inflight_check(kv: Kvroute, ids: dict[str, str], probe: list[int], wait_s: float
                   ) -> dict[str, Any]:
    """Right after the run and again until every value is 0 or ``wait_s`` has passed."""
    order = list(ids.items())
    started = time.monotonic()
    try:
        after_run, loads_after = read_inflight(kv, probe, order)
        settled, loads = after_run, loads_after
        while any(settled) and time.monotonic() - started < wait_s:
            time.sleep(0.25)
            settled, loads = read_inflight(kv, probe, order)
    except (KvrouteError, httpx.HTTPError, KeyError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "leak": None}
    check = {"engines": [n for n, _ in order], "after_run": after_run, "settled": settled,
             "waited_s": round(time.monotonic() - started, 2), "leak": any(settled),
             "loads_after_run": loads_after, "loads_settled": loads}
    if check["leak"]:  # what kvroute says about the workers, for the hunt
        try:
            check["instances"] = {name: kv.instance(iid) for name, iid in order}
        except (KvrouteError, httpx.HTTPError) as exc:
            check["instances"] = f"{type(exc).__name__}: {exc}"
    return check
