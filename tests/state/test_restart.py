"""Restarting kvroute with saved state, end to end: real kvroutes over HTTP, simulated vLLM
instances over HTTP and ZMQ, the state in a real directory.

vLLM announces a block once, and its replay keeps only the last ``buffer_steps`` batches.
Each scenario keeps a few long "system prompts" hot on small engines (the blocks stay
cached, their stores long gone from the replay buffer) among many other prompts that evict
each other, and asks kvroute, as a probe, how much of each hot prompt every instance holds.
What an engine really holds is read from the engine itself (``Engine.lookup``).

- the same engines: a kvroute that resumes answers exactly as the one before it did;
  one that starts without saved state cannot know the hot prompts at all;
- kvroute down longer than the buffer: the saved blocks count as unconfirmed (pending)
  until ``unconfirmed_ttl``; a block evicted meanwhile whose removal is still buffered
  stops matching, and is never counted as held;
- a corrupt, truncated, foreign or empty state file: logged once, ignored, replaced;
- an engine restarted while kvroute was down: its saved holdings are dropped;
- ``kvroute serve`` killed with SIGKILL resumes from its last periodic save, and saves
  once more when stopped with SIGTERM.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.ingest.wire import BlockRemoved, decode_batch
from kvroute.app.server import BackgroundServer
from kvroute.app.state.format import SavedState, decode_state
from kvroute.app.state.store import STATE_FILE
from kvroute.sim.cluster import SimCluster
from kvroute.sim.engine import Engine
from kvroute.sim.instance import SimInstance
from tests.support.metrics import metric
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for

BLOCK = 16
SUFFIX = 24  # tokens after a hot prompt, new on every request: one more full block
PROBE_TAIL = 8  # a probe's own tokens after the hot prompt: a partial block, never matched
DISTINCT = 64  # tokens of each one-off prompt: 4 blocks

# One answer of kvroute for one instance: (matched_tokens, pending_blocks, GPU blocks).
Answer = tuple[int, int, int]


# --- the simulated fleet ---------------------------------------------------------------------

def instance_id(instance: SimInstance) -> str:
    """kvroute's id for an instance configured by URL: HOST:PORT."""
    return instance.url.removeprefix("http://")


def hot_prompts(count: int, tokens: int, seed: int = 7_000) -> list[list[int]]:
    return [unique_tokens(seed + i, tokens) for i in range(count)]


def probe_of(prompt: list[int]) -> list[int]:
    """The hot prompt plus a few tokens that no request ever sent."""
    return prompt + list(range(PROBE_TAIL))


def workload(n_instances: int, hot: Sequence[list[int]], distinct: range, *,
             every: int) -> list[tuple[int, list[int]]]:
    """One-off prompts of `distinct` seeds, round robin over the instances; every `every`
    of them each hot prompt is sent again (hot prompt i to instance i % n_instances) with
    a suffix of its own, so it stays cached while the one-off prompts evict each other."""
    requests: list[tuple[int, list[int]]] = []
    for number, seed in enumerate(distinct):
        if number % every == 0:
            for h, prompt in enumerate(hot):
                suffix = unique_tokens(900_000 + seed * 31 + h, SUFFIX)
                requests.append((h % n_instances, prompt + suffix))
        requests.append((number % n_instances, unique_tokens(seed, DISTINCT)))
    return requests


def drive(sim: SimCluster, requests: list[tuple[int, list[int]]]) -> None:
    sim.drive(requests, max_tokens=1, concurrency=8)
    flush(sim)


def flush(sim: SimCluster) -> None:
    for instance in sim.instances:
        instance.ranks[0].publisher.flush()


def engine_holds(sim: SimCluster, tokens: list[int]) -> dict[str, int]:
    """Per instance, the tokens of the longest cached prefix kvroute could report for this
    prompt (it matches all tokens but the last, as vLLM can reuse no more). Read from the
    engines themselves, while they are idle."""
    held = {}
    for instance in sim.instances:
        rank = instance.ranks[0]
        with rank.lock:
            held[instance_id(instance)] = rank.engine.lookup(tokens[:-1])
    return held


def last_seqs(sim: SimCluster) -> dict[str, int | None]:
    """Per instance, the seq of the last batch its publisher sent (None: none yet)."""
    flush(sim)
    out = {}
    for instance in sim.instances:
        next_seq = instance.ranks[0].publisher.next_seq
        out[instance_id(instance)] = next_seq - 1 if next_seq else None
    return out


def buffer_starts(sim: SimCluster) -> dict[str, int]:
    flush(sim)
    return {instance_id(i): i.ranks[0].publisher.buffered_seqs()[0] for i in sim.instances}


# --- one kvroute ---------------------------------------------------------------------------

class Kvroute:
    """A kvroute's HTTP API, as a test reads it."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def workers(self, iid: str) -> list[dict]:
        answer = self.http.get(f"/v1/instances/{iid}")
        assert answer.status_code == 200, answer.text
        return answer.json()["workers"]

    def worker(self, iid: str) -> dict:
        (worker,) = self.workers(iid)
        return worker

    def wait_caught_up(self, sim: SimCluster, states: Sequence[str] = ("live",)) -> None:
        """Until every instance's worker is in one of `states` and has applied the last
        batch its engine published."""
        expected = last_seqs(sim)

        def seen() -> dict[str, tuple[str, int | None]]:
            out = {}
            for iid in expected:
                answer = self.http.get(f"/v1/instances/{iid}")
                workers = answer.json().get("workers") if answer.status_code == 200 else None
                if not workers:
                    out[iid] = ("discovering", None)
                else:
                    out[iid] = (workers[0]["state"], workers[0]["stats"]["last_seq"])
            return out

        def done() -> bool:
            now = seen()
            return all(state in states and now[iid][1] == expected[iid]
                       for iid, (state, _) in now.items())

        wait_for(done, f"every worker {'/'.join(states)} at {expected}", detail=seen)

    def probe(self, tokens: list[int]) -> dict[str, Answer]:
        answer = self.http.post("/v1/route", json={"token_ids": tokens, "probe": True})
        assert answer.status_code == 200, answer.text
        return {s["instance"]: (s["matched_tokens"], s["pending_blocks"], s["by_medium"]["GPU"])
                for s in answer.json()["scores"]}

    def answers(self, prompts: Sequence[list[int]]) -> list[dict[str, Answer]]:
        return [self.probe(probe_of(prompt)) for prompt in prompts]

    def readyz(self) -> dict:
        return self.http.get("/readyz").json()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (fails when there is none)."""
        return metric(self.http, name, **labels)


@contextmanager
def kvroute(sim: SimCluster, **overrides: object) -> Iterator[Kvroute]:
    """An in-process kvroute following every instance of `sim`, stopped (gracefully: its
    final save included) on leaving the block. Probes leave no placement guesses, and
    nothing here needs the instances' load."""
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", placement_ttl=0.0,
                        load_interval=0.0,
                        instances=tuple(InstanceConfig(url=url) for url in sim.urls),
                        **overrides)
    server = BackgroundServer(settings).start()
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            yield Kvroute(http)
    finally:
        server.stop()


def saved(state_dir: Path) -> SavedState:
    return decode_state((state_dir / STATE_FILE).read_bytes())


def truth(sim: SimCluster, tokens: list[int]) -> dict[str, Answer]:
    """What an exact kvroute answers for `tokens`: all the engines hold, on GPU, nothing
    pending."""
    return {iid: (held, 0, held // BLOCK) for iid, held in engine_holds(sim, tokens).items()}


def exact(sim: SimCluster, prompts: Sequence[list[int]]) -> list[dict[str, Answer]]:
    """``truth`` for the probes of `prompts`."""
    return [truth(sim, probe_of(prompt)) for prompt in prompts]


# --- 1. the scenario -------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_a_restarted_kvroute_answers_the_hot_prompts_exactly_as_before(tmp_path: Path) -> None:
    hot = hot_prompts(6, 800)  # six ~800-token system prompts: 50 blocks each
    with SimCluster(n=2, block_size=BLOCK, num_blocks=400, buffer_steps=300) as sim:
        ids = [instance_id(i) for i in sim.instances]
        with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3) as first:
            first.wait_caught_up(sim)
            drive(sim, workload(2, hot, range(0, 1), every=1))  # the hot prompts are stored
            stored_by = last_seqs(sim)
            drive(sim, workload(2, hot, range(1, 1201), every=20))
            first.wait_caught_up(sim)
            before = first.answers(hot)

        # The hot prompts' stores are long gone from the replay buffers, while the engines
        # still hold every hot prompt, each on its own instance, and evicted plenty.
        starts = buffer_starts(sim)
        assert all(starts[iid] > stored_by[iid] for iid in ids), (starts, stored_by)
        engines = exact(sim, hot)
        for h, held in enumerate(engines):
            assert held[ids[h % 2]] == (800, 0, 50) and held[ids[1 - h % 2]] == (0, 0, 0)
        assert before == engines

        state = saved(tmp_path)
        assert set(state.workers) == {(iid, 0) for iid in ids}
        assert all(state.workers[(iid, 0)].head.seq == last_seqs(sim)[iid] for iid in ids)

        with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3) as second:
            second.wait_caught_up(sim, states=("live",))
            assert second.answers(hot) == before
            for iid in ids:
                worker = second.worker(iid)
                assert worker["state"] == "live"
                assert worker["stats"]["restored_blocks"] == state.workers[(iid, 0)].head.blocks
                assert worker["stats"]["restored_blocks"] >= 150  # three hot prompts at least
                assert worker["stats"]["restored_unconfirmed"] == 0
                assert worker["unconfirmed_blocks"] == 0
                assert second.metric("kvroute_restored_blocks_total", instance=iid) == (
                    worker["stats"]["restored_blocks"])
            loaded = second.readyz()["saved_state"]["loaded"]
            assert loaded == {"workers": 2, "blocks": state.blocks, "unclaimed": 0}

        # Without saved state the same engines' replays say nothing of the hot prompts (and
        # the workers know that history was lost).
        with kvroute(sim) as stateless:
            stateless.wait_caught_up(sim, states=("degraded",))
            cold = stateless.answers(hot)
            assert all(answer == {iid: (0, 0, 0) for iid in ids} for answer in cold), cold
            assert all(w["stats"]["restored_blocks"] == 0
                       for iid in ids for w in stateless.workers(iid))
        assert before == exact(sim, hot)  # nothing moved meanwhile


# --- 2. down longer than the buffer -----------------------------------------------------------

def removal_buffered(sim: SimCluster, instance: int, prompt: list[int]) -> bool:
    """Whether instance's replay buffer holds the removal of the first block of `prompt`."""
    rank = sim.instances[instance].ranks[0]
    first = rank.engine.block_hashes(prompt)[0]
    return any(isinstance(event, BlockRemoved) and first in event.block_hashes
               for _, payload in rank.publisher.buffered()
               for event in decode_batch(payload).events)


@pytest.mark.timeout(180)
def test_down_longer_than_the_buffer_saved_blocks_are_unconfirmed_until_they_expire(
        tmp_path: Path) -> None:
    hot = hot_prompts(4, 320)  # two per instance, 20 blocks each
    doomed = hot_prompts(2, 160, seed=8_000)  # one per instance, evicted while kvroute is down
    ttl = scaled(5.0)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=160, buffer_steps=80) as sim:
        ids = [instance_id(i) for i in sim.instances]
        with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3) as first:
            first.wait_caught_up(sim)
            drive(sim, workload(2, [*hot, *doomed], range(0, 20), every=5))
            first.wait_caught_up(sim)
            before = first.answers(hot)
            assert before == exact(sim, hot)
            assert first.answers(doomed) == exact(sim, doomed)
            for h in range(2):
                assert engine_holds(sim, probe_of(doomed[h]))[ids[h]] == 160
        state = saved(tmp_path)
        saved_seq = {iid: state.workers[(iid, 0)].head.seq for iid in ids}

        # While kvroute is down: more batches than the buffers keep, the hot and the doomed
        # prompts kept cached; then the doomed ones evicted, recently enough that their
        # removals are still in the buffers.
        drive(sim, workload(2, [*hot, *doomed], range(1000, 1200), every=5))
        rounds = 0
        while any(engine_holds(sim, probe_of(doomed[h]))[ids[h]] for h in range(2)):
            rounds += 1
            assert rounds <= 20, "the doomed prompts were never evicted"
            drive(sim, workload(2, hot, range(2000 + 10 * rounds, 2010 + 10 * rounds),
                                every=5))
        recent = unique_tokens(3000, DISTINCT)  # sent last: the buffers surely hold it
        drive(sim, [(1, recent)])
        starts = buffer_starts(sim)
        assert all(starts[iid] > saved_seq[iid] + 1 for iid in ids), (starts, saved_seq)
        assert all(removal_buffered(sim, h, doomed[h]) for h in range(2))
        assert exact(sim, hot) == before  # the hot prompts are still cached

        with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3,
                     unconfirmed_ttl=ttl) as second:
            second.wait_caught_up(sim, states=("degraded",))
            for iid in ids:
                worker = second.worker(iid)
                assert worker["stats"]["restored_unconfirmed"] > 0, worker
                assert worker["stats"]["restored_blocks"] == 0
                assert worker["unconfirmed_blocks"] > 0
                assert second.metric("kvroute_restored_unconfirmed_blocks_total",
                                     instance=iid) == worker["stats"]["restored_unconfirmed"]
            # The hot prompts match as before, through pending blocks only.
            pending = second.answers(hot)
            for h, answer in enumerate(pending):
                holder, other = ids[h % 2], ids[1 - h % 2]
                assert answer[holder] == (320, 20, 0), answer
                assert answer[other] == (0, 0, 0), answer
            # The evicted ones: their buffered removals ended them.
            assert second.answers(doomed) == [{iid: (0, 0, 0) for iid in ids}] * 2

            # Past the ttl only real events count: the hot prompts' stores are not among them.
            wait_for(lambda: all(a == {iid: (0, 0, 0) for iid in ids}
                                 for a in second.answers(hot)),
                     "the unconfirmed blocks to expire", timeout=ttl + 30,
                     detail=lambda: second.answers(hot))
            assert second.answers(doomed) == [{iid: (0, 0, 0) for iid in ids}] * 2
            for iid in ids:
                worker = second.worker(iid)
                assert worker["unconfirmed_blocks"] == 0 and worker["state"] == "degraded"
            # What the buffers do hold is known exactly.
            assert second.probe(recent) == truth(sim, recent)
            assert second.probe(recent)[ids[1]][0] == 3 * BLOCK


# --- 3. a bad state file ---------------------------------------------------------------------

def flipped(blob: bytes) -> bytes:
    middle = len(blob) // 2
    return blob[:middle] + bytes([blob[middle] ^ 0xFF]) + blob[middle + 1:]


BAD_FILES = {
    "flipped byte": flipped,
    "cut in half": lambda blob: blob[:len(blob) // 2],
    "garbage": lambda blob: random.Random(3).randbytes(len(blob)),
    "empty": lambda blob: b"",
}


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimCluster, bytes]]:
    """One instance whose whole history fits its buffer (so kvroute without saved state
    is exact too), and a sound state file saved by a kvroute that followed it."""
    directory = tmp_path_factory.mktemp("good-state")
    with SimCluster(n=1, block_size=BLOCK, num_blocks=64) as sim:
        with kvroute(sim, state_dir=str(directory), state_save_interval=60.0) as kv:
            kv.wait_caught_up(sim)
            drive(sim, [(0, unique_tokens(seed, 3 * BLOCK + 5)) for seed in range(20)])
            kv.wait_caught_up(sim)
        blob = (directory / STATE_FILE).read_bytes()
        assert decode_state(blob).blocks > 0
        yield sim, blob


@pytest.mark.parametrize("damage", BAD_FILES)
def test_a_bad_state_file_is_logged_once_ignored_and_replaced(
        damage: str, small_fleet: tuple[SimCluster, bytes], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    sim, blob = small_fleet
    (iid,) = (instance_id(i) for i in sim.instances)
    path = tmp_path / STATE_FILE
    path.write_bytes(BAD_FILES[damage](blob))
    prompts = [unique_tokens(seed, 3 * BLOCK + 5) for seed in range(20)]
    caplog.set_level(logging.INFO, logger="kvroute.state")
    with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3) as kv:
        kv.wait_caught_up(sim)
        status = kv.readyz()["saved_state"]
        assert status["load_error"] and "loaded" not in status, status
        ignored = [r for r in caplog.records if r.name == "kvroute.state"
                   and r.levelno >= logging.WARNING]
        assert len(ignored) == 1, [r.getMessage() for r in ignored]
        assert "ignored" in ignored[0].getMessage() and "\n" not in ignored[0].getMessage()
        assert ignored[0].exc_info is None
        # It routes as a kvroute without saved state: exactly, from the replay.
        worker = kv.worker(iid)
        assert worker["state"] == "live"
        assert worker["stats"]["restored_blocks"] == worker["stats"]["restored_unconfirmed"] == 0
        assert [kv.probe(p) for p in prompts] == [truth(sim, p) for p in prompts]
        assert any(kv.probe(p)[iid][0] for p in prompts)
        # The next save replaces the bad file with a sound one. (One made before the
        # worker was live, while its replay ran on a loaded machine, holds no worker yet.)
        saves = kv.readyz()["saved_state"]["saves"]
        wait_for(lambda: kv.readyz()["saved_state"]["saves"] > saves, "a save")
        state = saved(tmp_path)
        rank = sim.instances[0].ranks[0]
        assert state.workers[(iid, 0)].head.seq == last_seqs(sim)[iid]
        with rank.lock:
            assert state.workers[(iid, 0)].head.blocks == len(rank.engine.cached_hashes())


# --- 4. an engine restarted while kvroute was down ----------------------------------------------

def restart_engine(instance: SimInstance) -> None:
    """What a vLLM restart on the same ports looks like: an empty cache, and a publisher
    whose seq starts again from 0 with an empty replay buffer."""
    rank = instance.ranks[0]
    config = instance.config
    with rank.lock:
        assert not rank.engine.has_work()
        rank.engine = Engine(num_blocks=config.num_blocks, block_size=config.block_size,
                             seed=config.seed * 1009, max_num_seqs=config.max_num_seqs,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             time_model=config.time_model)
        rank.publisher.restart()


@pytest.mark.parametrize("batches_after", ["fewer than saved", "more than saved"])
def test_an_engine_restarted_while_kvroute_was_down_is_not_resumed(
        batches_after: str, tmp_path: Path) -> None:
    old = [unique_tokens(seed, 3 * BLOCK + 5) for seed in range(30)]
    with SimCluster(n=1, block_size=BLOCK, num_blocks=256) as sim:
        (iid,) = (instance_id(i) for i in sim.instances)
        with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3) as first:
            first.wait_caught_up(sim)
            drive(sim, [(0, prompt) for prompt in old])
            first.wait_caught_up(sim)
            assert all(first.probe(p)[iid][0] == 3 * BLOCK for p in old)
        head = saved(tmp_path).workers[(iid, 0)].head
        assert head.blocks > 0

        restart_engine(sim.instances[0])
        count = 3 if batches_after == "fewer than saved" else head.seq + 10
        new = [unique_tokens(500 + seed, 2 * BLOCK + 3) for seed in range(count)]
        for prompt in new:  # one at a time: one batch each
            sim.complete(0, prompt, max_tokens=1)
        flush(sim)
        assert (last_seqs(sim)[iid] < head.seq) == (batches_after == "fewer than saved")

        with kvroute(sim, state_dir=str(tmp_path), state_save_interval=0.3) as second:
            second.wait_caught_up(sim)
            worker = second.worker(iid)
            assert worker["state"] == "live"
            stats = worker["stats"]
            assert stats["restarts"] == 1, stats
            assert stats["restored_blocks"] == stats["restored_unconfirmed"] == 0
            assert worker["unconfirmed_blocks"] == 0
            rank = sim.instances[0].ranks[0]
            with rank.lock:
                held = len(rank.engine.cached_hashes())
            assert worker["holdings"] == {"GPU": held, "CPU": 0, "STORAGE": 0}
            assert all(second.probe(p)[iid] == (0, 0, 0) for p in old)
            assert all(second.probe(p)[iid] == (2 * BLOCK, 0, 2) for p in new)


# --- 5. SIGKILL, then SIGTERM -------------------------------------------------------------------

KVROUTE = [sys.executable, "-m", "kvroute.app.cli"]


class Child:
    """`kvroute serve` as a separate process; its stderr collected line by line."""

    def __init__(self, sim: SimCluster, state_dir: Path, save_interval: float) -> None:
        args = [*KVROUTE, "serve", "--port", "0", "--log-level", "info",
                "--state-dir", str(state_dir)]
        for url in sim.urls:
            args += ["--instance", url]
        env = {**os.environ, "KVROUTE_STATE_SAVE_INTERVAL": str(save_interval),
               "KVROUTE_PLACEMENT_TTL": "0", "KVROUTE_LOAD_INTERVAL": "0"}
        self.process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.http: httpx.Client | None = None

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def connect(self) -> Kvroute:
        def port() -> str | None:
            if self.process.poll() is not None:
                pytest.fail(f"kvroute serve exited with {self.process.returncode}:\n{self.log()}")
            found = re.search(r"running on http://127\.0\.0\.1:(\d+)", self.log())
            return found.group(1) if found else None

        number = wait_for(port, "kvroute serve to name its port", detail=self.log)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{number}", timeout=HTTP_TIMEOUT)
        return Kvroute(self.http)

    def finish(self) -> None:
        """Make sure the process is gone (SIGKILL if it still runs) and its pipe read."""
        if self.http is not None:
            self.http.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=scaled(30))
        self._reader.join(timeout=scaled(10))


def saves(kv: Kvroute) -> float:
    return kv.metric("kvroute_state_saves_total")


@pytest.mark.timeout(180)
def test_after_sigkill_the_last_periodic_save_is_resumed_and_sigterm_saves_again(
        tmp_path: Path) -> None:
    hot = hot_prompts(4, 320)
    with SimCluster(n=2, block_size=BLOCK, num_blocks=160, buffer_steps=40) as sim:
        ids = [instance_id(i) for i in sim.instances]
        first = Child(sim, tmp_path, save_interval=0.5)
        try:
            kv = first.connect()
            kv.wait_caught_up(sim)
            drive(sim, workload(2, hot, range(0, 1), every=1))
            stored_by = last_seqs(sim)
            drive(sim, workload(2, hot, range(1, 161), every=8))
            kv.wait_caught_up(sim)
            before = kv.answers(hot)
            assert before == exact(sim, hot)
            assert all(before[h][ids[h % 2]][0] == 320 for h in range(4))
            # A periodic save that began after the last batch was applied.
            after = saves(kv)
            wait_for(lambda: saves(kv) >= after + 2, "two more periodic saves",
                     detail=lambda: saves(kv))
            first.process.send_signal(signal.SIGKILL)
            assert first.process.wait(timeout=scaled(30)) == -signal.SIGKILL
        finally:
            first.finish()
        starts = buffer_starts(sim)
        assert all(starts[iid] > stored_by[iid] for iid in ids), (starts, stored_by)
        killed = saved(tmp_path)  # the last periodic save
        assert {k: w.head.seq for k, w in killed.workers.items()} == {
            (iid, 0): seq for iid, seq in last_seqs(sim).items()}

        # Only the final save may write the file this time.
        second = Child(sim, tmp_path, save_interval=3600.0)
        try:
            kv = second.connect()
            kv.wait_caught_up(sim)
            assert kv.answers(hot) == before
            for iid in ids:
                worker = kv.worker(iid)
                assert worker["state"] == "live"
                assert worker["stats"]["restored_blocks"] == killed.workers[(iid, 0)].head.blocks
                assert worker["stats"]["restored_blocks"] >= 40  # two hot prompts at least
            assert saved(tmp_path).saved_at == killed.saved_at
            stopping = time.time()
            second.process.send_signal(signal.SIGTERM)
            assert second.process.wait(timeout=scaled(30)) == 0, second.log()
        finally:
            second.finish()
        assert "Traceback" not in second.log()
        state = saved(tmp_path)
        assert state.saved_at >= stopping
        assert {k: w.head.seq for k, w in state.workers.items()} == {
            (iid, 0): seq for iid, seq in last_seqs(sim).items()}
