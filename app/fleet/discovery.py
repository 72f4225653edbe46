"""Find a vLLM instance's KV-event endpoints, models and block size from its HTTP URL alone.

What vLLM answers (facts; docs/wire-protocol.md):

- ``GET /kv_event_sources``, vLLM 0.32.0: a JSON object keyed by data-parallel rank as a
  STRING, each value the rank's resolved KVEventsConfig::

      {"0": {"enable_kv_cache_events": true, "publisher": "zmq",
             "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
             "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
             "topic": "kv-events"}}

  The per-rank port offset is already applied, and a wildcard bind host ("*") is returned
  verbatim: the caller substitutes the instance's host. Other vLLM revisions answer a list
  of ``{"data_parallel_rank", "endpoint", "replay_endpoint", "topic"}``, bare or wrapped as
  ``{"sources": [...]}``; both are accepted, as is a single config object without ranks.
- Without a resolved per-rank answer, rank r publishes on base port + r (replay likewise);
  a port of 0 is never offset.
- ``GET /v1/models``: ``{"data": [{"id": ..., "max_model_len": ..., "parent": ...}, ...]}``;
  a LoRA adapter is listed as a model whose ``parent`` is the base model, and a request
  naming it is cached under the adapter's name (vLLM's ``lora_name``).
- ``GET /metrics``: ``vllm:cache_config_info{...,block_size="32",...} 1.0``.

Every request is bounded (``app.fleet.upstream``): each answer within ``DISCOVERY_DEADLINE`` and
``DISCOVERY_MAX_BYTES`` (the /metrics page within ``METRICS_MAX_BYTES``), so discovering a
slow, huge or hostile instance fails with a ``DiscoveryError`` instead of hanging
registration or filling memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from kvroute.app.fleet.upstream import (
    DISCOVERY_DEADLINE,
    DISCOVERY_MAX_BYTES,
    METRICS_MAX_BYTES,
    UpstreamError,
    fetch,
    url_at,
)
from kvroute.app.workers import WorkerEndpoint

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}
_CACHE_CONFIG = "vllm:cache_config_info{"
# At most 9 digits: int() of a hostile 10,000-digit value would raise.
_BLOCK_SIZE = re.compile(r'[^}]*\bblock_size="(\d{1,9})"', re.ASCII)
# Longer lines are not read: vLLM's cache_config_info line is a few hundred bytes.
_MAX_CACHE_CONFIG_LINE = 16 * 1024


class DiscoveryError(Exception):
    """An instance that cannot be discovered; the message names the URL and the reason."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    url: str
    models: list[str]
    block_size: int | None
    workers: list[WorkerEndpoint]
    max_model_len: int | None = None
    notes: list[str] = field(default_factory=list)  # what was assumed, for the operator
    lora_adapters: list[str] = field(default_factory=list)  # models that are LoRA adapters


def instance_id_for(url: str) -> str:
    """The default instance id: the URL's host:port."""
    parts = urlsplit(url)
    return parts.netloc or url


def rewrite_host(endpoint: str, host: str) -> str:
    """Replace a wildcard bind host (``tcp://*:5557``) with the host kvroute should dial."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    address = endpoint[len("tcp://"):]
    bind_host, sep, port = address.rpartition(":")
    if not sep:
        return endpoint
    if bind_host in _WILDCARD_HOSTS:
        dial = f"[{host}]" if ":" in host else host
        return f"tcp://{dial}:{port}"
    return endpoint


def offset_port(endpoint: str, rank: int) -> str:
    """vLLM's rule: rank r uses base port + r; port 0 (ephemeral) and non-tcp stay."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


def workers_from_sources(url: str, payload: Any, *, dp_size: int = 1) -> list[WorkerEndpoint]:
    """Turn a ``/kv_event_sources`` answer (any accepted shape) into worker endpoints; a
    single config for the whole instance stands for ``dp_size`` ranks."""
    host = urlsplit(url).hostname or ""
    instance = instance_id_for(url)
    entries = _entries(url, payload, dp_size)
    workers = []
    for rank, entry in entries:
        if entry.get("enable_kv_cache_events") is False or entry.get("publisher") in ("null",):
            continue
        endpoint = entry.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise DiscoveryError(url, f"rank {rank} of /kv_event_sources has no endpoint")
        replay = entry.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise DiscoveryError(url, f"rank {rank}: replay_endpoint must be a string")
        topic = entry.get("topic") or ""
        if not isinstance(topic, str):
            raise DiscoveryError(url, f"rank {rank}: topic must be a string")
        workers.append(WorkerEndpoint(
            instance, rank, rewrite_host(endpoint, host),
            rewrite_host(replay, host) if replay else None, topic))
    if not workers:
        raise DiscoveryError(url, "the instance publishes no KV events; start vLLM with "
                                  "--enable-prefix-caching and a zmq --kv-events-config")
    ranks = [w.dp_rank for w in workers]
    if len(set(ranks)) != len(ranks):
        raise DiscoveryError(url, f"/kv_event_sources names a rank twice: {sorted(ranks)}")
    return sorted(workers, key=lambda w: w.dp_rank)


def _entries(url: str, payload: Any, dp_size: int) -> list[tuple[int, dict[str, Any]]]:
    if isinstance(payload, dict) and isinstance(payload.get("sources"), list):
        payload = payload["sources"]
    if isinstance(payload, list):
        entries = []
        for i, item in enumerate(payload):
            if not isinstance(item, dict):
                raise DiscoveryError(url, f"/kv_event_sources entry {i} is not an object")
            rank = item.get("data_parallel_rank", i)
            if type(rank) is not int or rank < 0:
                raise DiscoveryError(url, f"/kv_event_sources entry {i}: bad rank {rank!r}")
            entries.append((rank, item))
        return entries
    if isinstance(payload, dict) and "endpoint" in payload:
        # One config for the whole instance: expand to the ranks by vLLM's port rule.
        return [(rank, {**payload,
                        "endpoint": offset_port(str(payload["endpoint"]), rank),
                        "replay_endpoint": payload.get("replay_endpoint") and offset_port(
                            str(payload["replay_endpoint"]), rank)})
                for rank in range(dp_size)]
    if isinstance(payload, dict):
        entries = []
        for key, value in payload.items():
            if not (isinstance(key, str) and key.isdigit()) or not isinstance(value, dict):
                raise DiscoveryError(
                    url, f"/kv_event_sources: expected rank -> config, got key {key!r}")
            entries.append((int(key), value))
        return entries
    raise DiscoveryError(url, f"/kv_event_sources answered {type(payload).__name__}, "
                              "expected an object or a list")


async def discover(url: str, client: httpx.AsyncClient, *,
                   api_key: str | None = None) -> InstanceInfo:
    """Ask the instance for its event endpoints, models and block size. (Endpoints an
    operator configures are used as given, without asking: see ``app.fleet.registry``.)"""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DiscoveryError(url, "the instance URL must start with http:// or https://")
    notes: list[str] = []
    sources = await _get_json(client, url, "/kv_event_sources")
    workers = workers_from_sources(url, sources)
    if any(w.replay_endpoint is None for w in workers):
        notes.append("no replay endpoint: prefixes cached before kvroute connected stay "
                     "unknown and dropped events cannot be recovered")
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    models_body = await _get_json(client, url, "/v1/models", headers=auth)
    models, max_len, adapters = _models(url, models_body)
    block_size = await _block_size(client, url, notes)
    return InstanceInfo(url, models, block_size, workers, max_len, notes, adapters)


async def discover_models(url: str, client: httpx.AsyncClient, *,
                          api_key: str | None = None) -> tuple[list[str], list[str]]:
    """The models an instance serves and which of them are LoRA adapters, from its
    /v1/models alone (for instances registered with explicit endpoints)."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    models, _, adapters = _models(url, await _get_json(client, url, "/v1/models",
                                                       headers=auth))
    return models, adapters


def _models(url: str, body: Any) -> tuple[list[str], int | None, list[str]]:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise DiscoveryError(url, "/v1/models has no 'data' list")
    models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not models:
        raise DiscoveryError(url, "/v1/models lists no model")
    lengths = [m.get("max_model_len") for m in data if isinstance(m, dict)]
    known = [n for n in lengths if type(n) is int and n > 0]
    adapters = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
                and isinstance(m.get("parent"), str)]
    return models, (min(known) if known else None), adapters


async def _block_size(client: httpx.AsyncClient, url: str, notes: list[str]) -> int | None:
    """From vllm:cache_config_info; None (with a note) when metrics say nothing."""
    try:
        answer = await fetch(client, "GET", url_at(url, "/metrics"), max_bytes=METRICS_MAX_BYTES,
                             deadline=DISCOVERY_DEADLINE)
    except UpstreamError as exc:
        notes.append(f"{exc}: block size unknown until the first BlockStored")
        return None
    if answer.status != 200:
        notes.append(f"/metrics answered {answer.status}: block size unknown")
        return None
    # latin-1 decodes any bytes one to one; the line searched for is ASCII.
    found = block_size_in(answer.body.decode("latin-1"))
    if found is None:
        notes.append("/metrics has no vllm:cache_config_info block_size: block size unknown")
        return None
    return found


def block_size_in(page: str) -> int | None:
    """The block size on a /metrics page's first ``vllm:cache_config_info`` line.

    It runs on the event loop, so every step is one C-speed scan of at most the page
    (``str.find``, under a millisecond for the largest page fetched) or of one line of
    bounded length; a regex over the whole page would take tens of milliseconds for a
    hostile one, or quadratic time for many unclosed ``{`` lines."""
    if page.startswith(_CACHE_CONFIG):
        start = 0
    else:
        start = page.find("\n" + _CACHE_CONFIG)
        if start < 0:
            return None
        start += 1
    end = page.find("\n", start)
    line = page[start:end if end >= 0 else len(page)]
    if len(line) > _MAX_CACHE_CONFIG_LINE:
        return None
    found = _BLOCK_SIZE.match(line, len(_CACHE_CONFIG))
    return int(found.group(1)) if found else None


async def _get_json(client: httpx.AsyncClient, url: str, path: str,
                    headers: dict[str, str] | None = None) -> Any:
    try:
        answer = await fetch(client, "GET", url_at(url, path), headers=headers,
                             max_bytes=DISCOVERY_MAX_BYTES, deadline=DISCOVERY_DEADLINE)
    except UpstreamError as exc:
        raise DiscoveryError(url, str(exc)) from None
    if answer.status == 404 and path == "/kv_event_sources":
        raise DiscoveryError(url, "GET /kv_event_sources: 404; this vLLM is too old to report "
                                  "its KV-event endpoints, give them explicitly")
    if answer.status != 200:
        raise DiscoveryError(url, f"GET {path} answered HTTP {answer.status}")
    try:
        # msgspec, not json: an answer of up to 1 MiB is decoded on the event loop, and
        # msgspec holds the loop for the shorter time.
        return msgspec.json.decode(answer.body)
    except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
        # RecursionError: nesting deeper than the decoder's stack (a hostile "[[[[...").
        raise DiscoveryError(url, f"GET {path} did not answer JSON") from None
