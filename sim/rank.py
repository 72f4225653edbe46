"""One data-parallel rank of a simulated vLLM instance: an engine, its publisher, its stepping
thread.

Rank r of an instance publishes on ``kv_port + r`` and answers replays on ``replay_port + r``,
as vLLM does. Two ways to drive a rank's engine, never mixed on one instance:

- HTTP (demo, end-to-end tests): ``submit`` queues a request and the stepping thread runs the
  rank's steps until every submitted request is done, publishing each step's events. Steps do
  not sleep unless ``time_scale > 0`` (then a step takes ``time_scale`` times its modelled
  duration in real time).
- Directly (benchmarks): ``rank.lock`` held, call ``rank.engine`` and ``rank.publish``; the
  stepping thread only steps while submitted requests are pending, so it stays out of the way.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from kvroute.app.ingest.wire import Event
from kvroute.sim.engine import Engine, RequestOutcome, StepResult
from kvroute.sim.publisher import EventPublisher
from kvroute.sim.spec import SimInstanceSpec

__all__ = ["SimRank"]


class SimRank:
    """One data-parallel rank: an engine, its publisher and its stepping thread."""

    def __init__(self, config: SimInstanceSpec, rank: int, endpoint: str, replay: str) -> None:
        self.rank = rank
        self.engine = Engine(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            seed=config.seed * 1009 + rank,  # a distinct hash seed per process, as in vLLM
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            time_model=config.time_model,
            hash_format=config.hash_format,  # type: ignore[arg-type]
            lookahead=config.lookahead,
        )
        self.publisher = EventPublisher(
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=config.topic,
            encoding=config.encoding,
            replay_format=config.replay_format,
            buffer_steps=config.buffer_steps,
            dp_rank=rank,
        )
        self.lock = threading.Lock()
        self._time_scale = config.time_scale
        self._wake = threading.Condition(self.lock)
        self._pending: dict[str, Future[RequestOutcome]] = {}
        self._closing = False
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"sim-rank-{rank}", daemon=True)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str:
        return self.publisher.replay_endpoint or ""

    def start(self) -> None:
        self.publisher.start()
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for fut in self._pending.values():
            fut.cancel()
        self.publisher.close()

    def publish(self, events: list[Event]) -> int | None:
        """Publish one step's batch (nothing when the step had no events, like vLLM)."""
        if not events:
            return None
        return self.publisher.publish(events, dp_rank=self.rank)

    def load(self) -> int:
        return self.engine.load()

    def submit(self, prompt: list[int], output: list[int], request_id: str, *,
               cache_salt: str | None = None,
               report_reused: bool = False) -> Future[RequestOutcome]:
        """Queue an HTTP request; the future resolves when it finishes. Raises EngineError."""
        fut: Future[RequestOutcome] = Future()
        with self._wake:
            now = time.monotonic() - self._t0
            self.engine.add_request(request_id, prompt, output, arrival_time=now,
                                    cache_salt=cache_salt, report_reused=report_reused)
            self._pending[request_id] = fut
            self._wake.notify_all()
        return fut

    def abort(self, request_id: str) -> bool:
        """The client went away: drop the request if the engine still has it."""
        with self._wake:
            self._pending.pop(request_id, None)
            return self.engine.abort_request(request_id)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                result = self.engine.step(now=time.monotonic() - self._t0)
                self.publish(result.events)
                done = [(self._pending.pop(o.request_id, None), o) for o in result.finished]
            for fut, outcome in done:
                if fut is not None:
                    fut.set_result(outcome)
            self._pace(result)

    def _pace(self, result: StepResult) -> None:
        if self._time_scale > 0:
            time.sleep((result.end - result.start) * self._time_scale)
