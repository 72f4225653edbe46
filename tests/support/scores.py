"""Reading kvroute's routing scores the way an operator probes them."""

from __future__ import annotations

import httpx


def inflight_counts(client: httpx.Client) -> dict[tuple[str, int], int]:
    """Every worker's in-flight count, as a probe of POST /v1/route reports it (a probe leaves
    no guess and no load behind)."""
    answer = client.post("/v1/route", json={"token_ids": [1, 2, 3], "probe": True}).json()
    return {(s["instance"], s["dp_rank"]): s["load"]["inflight"] for s in answer["scores"]}
