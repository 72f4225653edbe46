"""How one simulated vLLM instance is set up: ``SimInstanceSpec``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.sim.engine import TimeModel

__all__ = ["SimInstanceSpec"]


@dataclass(frozen=True)
class SimInstanceSpec:
    """How one simulated vLLM is set up. ``num_blocks`` counts vLLM's reserved null block."""

    model: str = "sim-model"
    block_size: int = 16
    num_blocks: int = 1024
    dp_size: int = 1
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    vocab_size: int = 32000
    time_model: TimeModel = field(default_factory=TimeModel)
    hash_format: str = "int"
    # vLLM 0.33's lookahead block hashes (speculative decoding with block drop): each block
    # hashed with this many tokens after it; 0: none.
    lookahead: int = 0
    encoding: str = "map"  # "map" (vLLM >= ~0.26) or "array" (older)
    replay_format: str = "new"  # replay reply frames of 0.32.0 ("new") or older ("old")
    topic: str = "kv-events"
    # Batches each rank's publisher keeps for replay (vLLM's --kv-events-config buffer_steps).
    buffer_steps: int = 10_000
    time_scale: float = 0.0
    # /kv_event_sources answer shape: "v0.32" (vLLM 0.32.0: {rank: resolved config}, wildcard
    # bind host), "list" (a bare list of per-rank entries) or "sources" ({"sources": list}).
    sources_shape: str = "v0.32"
    # Seconds between two SSE events of a streamed response (0: as fast as the socket takes).
    stream_interval_s: float = 0.0
    # vLLM's --api-key: every /v1 path (models, completions, chat) needs
    # "Authorization: Bearer <key>".
    api_key: str | None = None
    # Where its HTTP server and event publishers listen: any loopback address (Linux routes
    # all of 127.0.0.0/8 to lo), so several instances can share one port as pods of a
    # headless Service do; http_port 0 lets the OS choose.
    host: str = "127.0.0.1"
    http_port: int = 0
