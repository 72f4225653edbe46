"""A fleet of simulated vLLM instances on loopback, for the demo, tests and benchmarks.

``SimCluster`` owns every instance it starts and stops all of them in ``stop()`` (also on a
failed start and on leaving the ``with`` block). Instance i gets hash seed ``seed * 7919 + i``,
so no two instances (or ranks) share block-hash values for the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvroute.sim.engine import Engine, TimeModel
from kvroute.sim.instance import SimInstance
from kvroute.sim.rank import SimRank
from kvroute.sim.spec import SimInstanceSpec


class SimCluster:
    """``n`` simulated vLLM instances, each with ``dp_size`` data-parallel ranks.

    Extra keyword arguments are ``SimInstanceSpec`` fields (max_num_seqs, encoding, topic ...).
    """

    def __init__(
        self,
        n: int = 8,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        model: str = "sim-model",
        dp_size: int = 1,
        seed: int = 0,
        time_model: TimeModel | None = None,
        **config: Any,
    ) -> None:
        if n < 1 or dp_size < 1:
            raise ValueError("a cluster needs n >= 1 instances of dp_size >= 1 ranks")
        base = SimInstanceSpec(
            model=model,
            block_size=block_size,
            num_blocks=num_blocks,
            dp_size=dp_size,
            time_model=time_model or TimeModel(),
            **config,
        )
        self.configs = [dataclasses.replace(base, seed=seed * 7919 + i) for i in range(n)]
        self.instances: list[SimInstance] = []

    def __enter__(self) -> SimCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SimCluster:
        try:
            for cfg in self.configs:
                inst = SimInstance(cfg)
                self.instances.append(inst)
                inst.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        instances, self.instances = self.instances, []
        for inst in instances:
            inst.stop()

    @property
    def urls(self) -> list[str]:
        return [inst.url for inst in self.instances]

    @property
    def ranks(self) -> list[tuple[int, SimRank]]:
        """Every (instance index, rank): the routing units ("workers") of the fleet."""
        return [(i, r) for i, inst in enumerate(self.instances) for r in inst.ranks]

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for _, r in self.ranks]

    def complete(
        self,
        instance: int,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 8,
        dp_rank: int | None = None,
        client: httpx.Client | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/completions`` on one instance (a tenant's with ``cache_salt``); the
        JSON body (raises on HTTP errors)."""
        headers = {} if dp_rank is None else {"X-data-parallel-rank": str(dp_rank)}
        body: dict[str, Any] = {
            "model": self.configs[instance].model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        own = client is None
        http = client or httpx.Client(timeout=60)
        try:
            resp = http.post(
                f"{self.instances[instance].url}/v1/completions", json=body, headers=headers
            )
            resp.raise_for_status()
            return resp.json()
        finally:
            if own:
                http.close()

    def drive(
        self,
        requests: Iterable[tuple[int, str | Sequence[int]]],
        *,
        max_tokens: int = 8,
        concurrency: int = 8,
    ) -> list[dict[str, Any]]:
        """Send ``(instance index, prompt)`` pairs over HTTP, ``concurrency`` at a time;
        returns the response bodies in request order."""
        items = list(requests)
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(concurrency) as pool:
            futures = [
                pool.submit(self.complete, i, p, max_tokens=max_tokens, client=client)
                for i, p in items
            ]
            return [f.result() for f in futures]
