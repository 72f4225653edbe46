"""Service configuration: defaults, then a TOML file, then environment, then flags.

Each layer overrides the one before it. Every value is validated here, once, so
the rest of the service can trust a `Settings`: a bad value stops start-up with a
`ConfigError` that names the setting and where it came from, never a traceback.

File format (TOML)::

    host = "127.0.0.1"
    port = 8000
    max_prompt_tokens = 131072
    ready_grace_seconds = 60
    tokenizer = "instance"          # or a path to a tokenizer.json / folder

    [[instances]]
    url = "http://10.0.0.5:8000"    # discovery does the rest

    [[instances]]
    id = "gpu-b"
    url = "http://10.0.0.6:8000"
    model = "llama-3-8b"
    events = ["tcp://10.0.0.6:5557"]
    replay = ["tcp://10.0.0.6:5558"]
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvroute.app.routing import CostWeights

_COSTS = CostWeights()  # the one place the cost defaults are written

__all__ = [
    "ConfigError", "InstanceConfig", "Settings", "default_instance_id", "load_settings",
    "parse_instance",
]

ENV_PREFIX = "KVROUTE_"


class ConfigError(ValueError):
    """A setting is missing, mistyped or out of range; the message says which and where."""


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    """One vLLM instance. `url` alone is enough; explicit endpoints skip discovery.

    `events[r]` and `replay[r]` are data-parallel rank r's PUB and ROUTER endpoints.
    """

    url: str | None = None
    id: str | None = None
    model: str | None = None
    events: tuple[str, ...] = ()
    replay: tuple[str, ...] = ()
    topic: str = ""
    block_size: int | None = None
    # The instance's vLLM --api-key, sent when kvroute itself calls its /v1 endpoints.
    api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    instances: tuple[InstanceConfig, ...] = ()
    # Size limits protect the event loop: a query is O(prompt length).
    max_prompt_tokens: int = 131_072
    max_block_hashes: int = 8_192
    max_prompt_chars: int = 1_000_000
    max_body_bytes: int = 4 * 1024 * 1024
    # /readyz turns ready when every configured worker is live, or after this long.
    ready_grace_seconds: float = 60.0
    # None: text and chat prompts are refused; "instance": an instance's /tokenize;
    # anything else: a local Hugging Face tokenizer (tokenizer.json file or folder).
    tokenizer: str | None = None
    log_level: str = "info"
    # Also serve OpenAI-compatible endpoints that forward each request to the chosen worker.
    proxy: bool = False
    # Routing cost weights, in prefill tokens; their defaults are app.routing.CostWeights'.
    cost_miss_token: float = _COSTS.miss_token
    cost_cpu_hit_token: float = _COSTS.cpu_hit_token
    cost_storage_hit_token: float = _COSTS.storage_hit_token
    cost_queued_prefill_token: float = _COSTS.queued_prefill_token
    cost_running_request: float = _COSTS.running_request
    overload_waiting: int = _COSTS.overload_waiting
    overload_kv_usage: float = _COSTS.overload_kv_usage
    # Seconds between scrapes of each instance's /metrics for load; 0 turns scraping off.
    load_interval: float = 1.0
    # Seconds a routing answer counts as "the chosen worker will hold this prompt" before
    # its events confirm it; 0 turns placement guesses off.
    placement_ttl: float = 2.0


_INT_SETTINGS = {"port", "max_prompt_tokens", "max_block_hashes", "max_prompt_chars",
                 "max_body_bytes", "overload_waiting"}
_FLOAT_SETTINGS = {"ready_grace_seconds", "cost_miss_token", "cost_cpu_hit_token",
                   "cost_storage_hit_token", "cost_queued_prefill_token",
                   "cost_running_request", "overload_kv_usage",
                   "load_interval", "placement_ttl"}
_STR_SETTINGS = {"host", "tokenizer", "log_level"}
_BOOL_SETTINGS = {"proxy"}
_LOG_LEVELS = {"critical", "error", "warning", "info", "debug"}


def parse_instance(raw: Mapping[str, Any], where: str) -> InstanceConfig:
    """Validate one instance table (from TOML, env or the HTTP API)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: an instance must be a table/object, got {type(raw).__name__}")
    known = {f.name for f in fields(InstanceConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")

    def text(name: str) -> str | None:
        value = raw.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}.{name}: must be a non-empty string")
        return value.strip()

    def endpoints(name: str) -> tuple[str, ...]:
        value = raw.get(name, ())
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}.{name}: must be a list of tcp://HOST:PORT strings")
        for endpoint in value:
            _check_zmq_endpoint(endpoint, f"{where}.{name}")
        return tuple(value)

    url = text("url")
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where}.url: {url!r} is not an http(s)://HOST[:PORT] URL")
        url = url.rstrip("/")
    events, replay = endpoints("events"), endpoints("replay")
    if url is None and not events:
        raise ConfigError(f"{where}: give `url` (discovery) or explicit `events` endpoints")
    if replay and len(replay) != len(events):
        raise ConfigError(f"{where}.replay: {len(replay)} endpoint(s) for {len(events)} "
                          "event endpoint(s); give one per data-parallel rank")
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise ConfigError(f"{where}.topic: must be a string")
    block_size = raw.get("block_size")
    if block_size is not None and (type(block_size) is not int or block_size <= 0):
        raise ConfigError(f"{where}.block_size: must be a positive integer")
    instance_id = text("id")
    if instance_id is not None and "/" in instance_id:
        raise ConfigError(f"{where}.id: must not contain '/'")
    return InstanceConfig(url=url, id=instance_id, model=text("model"), events=events,
                          replay=replay, topic=topic, block_size=block_size,
                          api_key=text("api_key"))


def _check_zmq_endpoint(endpoint: str, where: str) -> None:
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: {endpoint!r} is not a tcp://HOST:PORT endpoint")
    if host in ("*", "0.0.0.0"):
        raise ConfigError(f"{where}: {endpoint!r} is a bind address; give the host to connect to")


def _coerce(name: str, value: Any, where: str) -> Any:
    if name in _BOOL_SETTINGS:
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on",
                                                                 "0", "false", "no", "off"):
            return value.strip().lower() in ("1", "true", "yes", "on")
        if type(value) is not bool:
            raise ConfigError(f"{where}: {name} must be true or false, got {value!r}")
        return value
    if name in _INT_SETTINGS:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if name == "port":
            # 0 lets the OS pick a free port; the server logs the one it got.
            if type(value) is not int or not 0 <= value <= 65535:
                raise ConfigError(f"{where}: port must be an integer from 0 to 65535, "
                                  f"got {value!r}")
            return value
        if type(value) is not int or value <= 0:
            raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
        return value
    if name in _FLOAT_SETTINGS:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {name} must be a number, got {value!r}") from None
        if type(value) is bool or not math.isfinite(number) or number < 0:
            raise ConfigError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
        return number
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {name} must be a non-empty string, got {value!r}")
    if name == "log_level" and value.lower() not in _LOG_LEVELS:
        raise ConfigError(f"{where}: log_level must be one of {', '.join(sorted(_LOG_LEVELS))}")
    return value.lower() if name == "log_level" else value


def _apply(settings: Settings, values: Mapping[str, Any], where: str) -> Settings:
    changes: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name == "instances":
            if not isinstance(value, list):
                raise ConfigError(f"{where}: instances must be an array of tables")
            changes[name] = settings.instances + tuple(
                parse_instance(raw, f"{where}: instances[{i}]") for i, raw in enumerate(value))
        elif name in _INT_SETTINGS | _FLOAT_SETTINGS | _STR_SETTINGS | _BOOL_SETTINGS:
            changes[name] = _coerce(name, value, where)
        else:
            raise ConfigError(f"{where}: unknown setting {name!r}")
    return replace(settings, **changes)


def _from_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in _INT_SETTINGS | _FLOAT_SETTINGS | _STR_SETTINGS | _BOOL_SETTINGS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            values[name] = raw
    urls = environ.get(ENV_PREFIX + "INSTANCES", "")
    if urls.strip():
        values["instances"] = [{"url": url.strip()} for url in urls.split(",") if url.strip()]
    return values


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Layer defaults < file < environment (KVROUTE_*) < flags; instances accumulate.

    `KVROUTE_INSTANCES` is a comma-separated list of instance URLs; every other
    setting `x` is read from `KVROUTE_X`. Flags with value None are "not given".
    """
    settings = Settings()
    if config_file is not None:
        settings = _apply(settings, _from_file(Path(config_file)), f"config file {config_file}")
    settings = _apply(settings, _from_env(os.environ if environ is None else environ),
                      "environment")
    if flags:
        settings = _apply(settings, dict(flags), "command line")
    ids = [default_instance_id(instance) for instance in settings.instances]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"instance id(s) {', '.join(repeated)} configured more than once; "
                          "give each instance a distinct `id`")
    return settings


def default_instance_id(config: InstanceConfig) -> str:
    """`id` if given, else HOST:PORT of the URL, else of the first event endpoint."""
    if config.id:
        return config.id
    if config.url:
        parts = urlsplit(config.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"
    return config.events[0].partition("://")[2]

