"""Service configuration: defaults, then a TOML file, then environment, then flags.

`Settings` and `InstanceConfig` are declared once, as typed msgspec structs whose
annotations carry the constraints; every layer is converted against them, so a bad
value stops start-up with a `ConfigError` that names the setting and the layer it
came from, never a traceback. The rest of the service can trust a `Settings`.

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

    [[fleets]]                      # one instance per address of a DNS name
    url = "http://vllm-headless.default.svc:8000"
    id = "vllm"                     # members are vllm@10.0.0.7, vllm@10.0.0.8, ...
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import msgspec

from kvroute.app.errors import split_validation
from kvroute.app.patterns import (
    API_KEY,
    HTTP_ORIGIN,
    INSTANCE_ID,
    IP_ENDPOINT,
    NOT_BLANK,
    ZMQ_ENDPOINT,
    described,
    documented,
    matches,
    parse_endpoint,
)
from kvroute.app.workers import SubscriberOptions

# The largest decision log a setting may ask for (app.routing.decision_log keeps it).
MAX_DECISION_LOG = 1_000_000


@dataclass(frozen=True, slots=True)
class CostWeights:
    """What each term of a route's cost weighs, in prefill tokens (app.routing.cost)."""

    miss_token: float = 1.0
    cpu_hit_token: float = 0.25
    storage_hit_token: float = 0.5
    # One token of prefill queued ahead, relative to a token of this prompt to compute.
    queued_prefill_token: float = 0.25
    # Decode pressure of one running request, in prefill tokens.
    running_request: float = 32.0
    # A token to compute here that another eligible worker holds: on top of its miss, the
    # cache space the second copy takes from other prefixes (app.routing.cost says why).
    copied_token: float = 1.0
    # A token to compute on a worker that must hold more other prefixes than the least
    # crowded loaded worker, times the share of its demand above that one's.
    crowded_token: float = 2.0
    overload_waiting: int = 64
    overload_kv_usage: float = 0.98


_COSTS = CostWeights()  # the one place the cost defaults are written
_PUBLISHER_BOUNDS = SubscriberOptions()  # and the publisher bounds

__all__ = [
    "MAX_DECISION_LOG", "ConfigError", "CostWeights", "FleetConfig", "InstanceConfig", "Settings",
    "default_instance_id",
    "foreign_endpoints", "is_loopback", "load_settings", "parse_instance",
]

ENV_PREFIX = "KVROUTE_"
# Endpoint hosts that say "every interface" (where an engine binds), not where to connect.
BIND_HOSTS = frozenset({"*", "0.0.0.0", "::"})

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: the OS picks a free port
Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]  # and finite: see __post_init__
Seconds = Annotated[float, msgspec.Meta(gt=0)]  # and finite
Text = Annotated[str, msgspec.Meta(pattern=NOT_BLANK)]  # not empty, not only spaces
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class ConfigError(ValueError):
    """A setting is missing, mistyped or out of range; the message says which and where,
    `field` is its path (`port`, `instances[0].url`) when there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


Endpoint = described(str, ZMQ_ENDPOINT)
Endpoints = Endpoint | tuple[Endpoint, ...]
# InstanceConfig's rules across fields as JSON Schema (the checks are its __post_init__):
# `url` or `events`, and `replay` only beside `events`.
_SOME_EVENTS: dict[str, Any] = {"required": ["events"], "properties": {"events": {
    "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}}}
INSTANCE_RULES: dict[str, Any] = {
    "anyOf": [{"required": ["url"], "properties": {"url": {"type": "string"}}}, _SOME_EVENTS],
    "if": {"required": ["replay"], "properties": {"replay": {
        "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}}},
    "then": _SOME_EVENTS,
}


class InstanceConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One vLLM instance. `url` alone is enough; explicit endpoints skip discovery.
    `events[r]` and `replay[r]` are data-parallel rank r's PUB and ROUTER endpoints."""

    # (This docstring describes the registration body in the OpenAPI document.) After
    # construction `url` has no trailing slash and `events`/`replay` are tuples; the string
    # fields' patterns (app.patterns) are checked in __post_init__, not by msgspec.

    url: documented(described(str, HTTP_ORIGIN) | None,
                    "its HTTP origin, http(s)://HOST[:PORT]: no path, query or credentials"
                    ) = None
    id: documented(described(str, INSTANCE_ID) | None,
                   "its name in kvroute (default: the url's HOST:PORT): printable ASCII "
                   "without '/'") = None
    model: documented(Text | None, "the model it serves (checked against its /v1/models "
                                   "when that answers)") = None
    # None (not an empty list) by default: client generators mistake a list default in a
    # union for a string (openapi-python-client sent events "[]").
    events: documented(Endpoints | None, "each data-parallel rank's KV-event endpoint, "
                                         "tcp://HOST:PORT (skips discovery)") = None
    replay: documented(Endpoints | None, "each rank's replay endpoint: a list, one per "
                                         "`events` entry, or one endpoint, rank 0's, with "
                                         "rank r's at its port + r (as vLLM numbers them)"
                       ) = None
    topic: documented(str, "the ZeroMQ topic of its events (default: all)") = ""
    block_size: documented(Positive | None, "tokens per KV block (default: discovered)"
                           ) = None
    # The instance's vLLM --api-key, sent when kvroute itself calls its /v1 endpoints.
    api_key: documented(described(str, API_KEY) | None,
                        "its vLLM --api-key, for kvroute's own calls to it; never shown back"
                        ) = None
    endpoint: documented(described(str, IP_ENDPOINT) | None,
                         "IP:PORT a gateway reaches it at when kvroute is its Endpoint Picker "
                         "(default: the url's host, resolved when a name, and port)") = None

    def __post_init__(self) -> None:
        # Errors start with the field's name; _explain prefixes the instance's path.
        if not isinstance(self.events, tuple):
            self.events = () if self.events is None else (self.events,)
        if isinstance(self.replay, str) and len(self.events) > 1:
            self.replay = _numbered(self.replay, len(self.events))
        elif not isinstance(self.replay, tuple):
            self.replay = () if self.replay is None else (self.replay,)
        if self.url is not None:
            self.url = _origin(self.url)
        for name in ("events", "replay"):
            for endpoint in getattr(self, name):
                _check_zmq_endpoint(endpoint, name)
        if self.url is None and not self.events:
            raise ValueError("give `url` (discovery) or explicit `events` endpoints")
        if self.endpoint is not None:
            normalized = (parse_endpoint(self.endpoint)
                          if matches(IP_ENDPOINT, self.endpoint) else None)
            if normalized is None:
                raise ValueError(f"endpoint: {self.endpoint!r} is not IP:PORT (an IP address, "
                                 "IPv6 in brackets, and a port from 1 to 65535)")
            self.endpoint = normalized
        if self.replay and len(self.replay) != len(self.events):
            raise ValueError(f"replay: {len(self.replay)} endpoint(s) for {len(self.events)} "
                             "event endpoint(s); give one per data-parallel rank")
        _check_id_and_key(self.id, self.api_key)

    def __repr__(self) -> str:
        return _repr_without_secrets(self)


def _check_id_and_key(instance_id: str | None, api_key: str | None) -> None:
    """The string rules (app.patterns) of an instance's id and vLLM --api-key."""
    if instance_id is not None and not matches(INSTANCE_ID, instance_id):
        raise ValueError("id: must be printable ASCII without '/', and not begin or end "
                         "with a space")
    if api_key is not None and not matches(API_KEY, api_key):
        raise ValueError("api_key: must be printable ASCII (it is sent in a header), and "
                         "not begin or end with a space")


class FleetConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A DNS name with one address per vLLM instance (a Kubernetes headless Service).

    Each address the name resolves to is an instance, `http(s)://ADDRESS:PORT` with the
    url's scheme and port, discovered by that URL and named `<id>@<address>`; the name is
    resolved again every `dns_refresh_seconds` (app.fleet.dns). After construction `url` has
    no trailing slash and `id` is set (default: the url's host)."""

    url: described(str, HTTP_ORIGIN)
    id: described(str, INSTANCE_ID) | None = None
    model: Text | None = None
    topic: str = ""
    block_size: Positive | None = None
    api_key: described(str, API_KEY) | None = None

    def __post_init__(self) -> None:
        self.url = _origin(self.url)
        _check_id_and_key(self.id, self.api_key)
        if self.id is None:
            self.id = urlsplit(self.url).hostname

    def __repr__(self) -> str:
        return _repr_without_secrets(self)


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    host: Text = "127.0.0.1"
    port: Port = 8000
    instances: tuple[InstanceConfig, ...] = ()
    # DNS names followed as fleets (app.fleet.dns), and how often each is resolved again.
    fleets: tuple[FleetConfig, ...] = ()
    dns_refresh_seconds: Seconds = 10.0
    # Size limits protect the event loop: a query is O(prompt length).
    max_prompt_tokens: Positive = 131_072
    max_block_hashes: Positive = 8_192
    max_prompt_chars: Positive = 1_000_000
    max_body_bytes: Positive = 4 * 1024 * 1024
    # /readyz turns ready when every configured worker is live, or after this long.
    ready_grace_seconds: NonNegative = 60.0
    # None: text and chat prompts are refused; "instance": an instance's /tokenize;
    # anything else: a local Hugging Face tokenizer (tokenizer.json file or folder).
    # With the proxy on and none given: "instance" (an OpenAI client sends text).
    tokenizer: Text | None = None
    log_level: LogLevel = "info"
    # Also serve OpenAI-compatible endpoints that forward each request to the chosen worker.
    proxy: bool = False
    # The proxy sends the instance's own `api_key` instead of the client's Authorization
    # (always so when api_token is set: the client's header then holds kvroute's token).
    proxy_instance_key: bool = False
    # Routing cost weights, in prefill tokens; their defaults are app.routing.cost.CostWeights'.
    cost_miss_token: NonNegative = _COSTS.miss_token
    cost_cpu_hit_token: NonNegative = _COSTS.cpu_hit_token
    cost_storage_hit_token: NonNegative = _COSTS.storage_hit_token
    cost_queued_prefill_token: NonNegative = _COSTS.queued_prefill_token
    cost_running_request: NonNegative = _COSTS.running_request
    cost_copied_token: NonNegative = _COSTS.copied_token
    cost_crowded_token: NonNegative = _COSTS.crowded_token
    overload_waiting: Positive = _COSTS.overload_waiting
    overload_kv_usage: NonNegative = _COSTS.overload_kv_usage
    # Seconds between scrapes of each instance's /metrics for load; 0 turns scraping off.
    load_interval: NonNegative = 1.0
    # Seconds a routing answer counts as "the chosen worker will hold this prompt" before
    # its events confirm it; 0 turns placement guesses off.
    placement_ttl: NonNegative = 2.0
    # Keep the last N routing decisions for GET /v1/decisions (app.routing.decision_log); 0: off.
    decision_log: Annotated[int, msgspec.Meta(ge=0, le=MAX_DECISION_LOG)] = 0
    # Bearer tokens (app.http.auth): api_token for routing, the proxy and the instance list;
    # admin_token for registering and removing instances (api_token when not set).
    api_token: Text | None = None
    admin_token: Text | None = None
    # Serve without tokens on an address other than loopback (a trusted network only).
    allow_unauthenticated: bool = False
    # POST/DELETE /v1/instances; false: the instances are the configured ones, fixed.
    manage_instances: bool = True
    # Serve /docs and /openapi.json.
    docs: bool = False
    # Host header names accepted (a leading "*." matches subdomains). Empty: loopback names
    # only when bound to a loopback address (no DNS rebinding), any otherwise.
    allowed_hosts: tuple[Text, ...] = ()
    # HTTPS: both, or neither (plain HTTP).
    tls_certfile: Text | None = None
    tls_keyfile: Text | None = None
    # Slow clients: seconds to send a request's headers, then its body; an idle keep-alive
    # connection is closed after keep_alive_timeout.
    header_timeout: Seconds = 10.0
    body_timeout: Seconds = 30.0
    keep_alive_timeout: Seconds = 5.0
    # Requests served at once; more are refused with 429.
    max_concurrent_requests: Positive = 512
    # Client connections open at once (HTTP API and proxy); one more is answered 503 and
    # closed as it is accepted. Counted in the open files kvroute asks for at start.
    max_connections: Positive = 1024
    # Registered instances (configured ones included); one more is refused with 409.
    max_instances: Positive = 4096
    # Replays (a worker's rebuild on connect, a gap's fill) in progress at once, fleet-wide.
    replay_concurrency: Positive = 32
    # Idle checks (a quiet worker asking for dropped tail batches) started per second,
    # fleet-wide; each worker's 5 s interval is jittered by half.
    idle_checks_per_second: Seconds = 50.0  # a positive finite number, like Seconds
    # `kvroute serve` freezes the fleet's objects out of the garbage collector's passes
    # (app.fleet.gc_freeze); at most this often, once the fleet has been quiet for 5 s after a
    # change, it unfreezes, collects and freezes again, freeing the garbage the freezes
    # kept. 0: never.
    gc_refreeze_interval: NonNegative = 3600.0
    # Hosts explicit `events`/`replay` endpoints may name besides the instance's own.
    zmq_endpoint_hosts: tuple[Text, ...] = ()
    # A hostile or broken publisher: bigger ZMQ messages close the connection; bigger
    # BlockStored events and stores past a worker's cap are counted and skipped (the
    # worker turns degraded).
    max_event_message_bytes: Positive = _PUBLISHER_BOUNDS.max_message_bytes
    max_blocks_per_event: Positive = _PUBLISHER_BOUNDS.max_blocks_per_event
    max_blocks_per_worker: Positive = _PUBLISHER_BOUNDS.max_blocks_per_worker
    # Saved state (app.state.format): the index is saved every state_save_interval seconds
    # and on shutdown, to a directory or to Valkey/Redis (redis://, rediss://, unix://),
    # and loaded on start. With state_url, replicas also share placement guesses and load.
    state_dir: Text | None = None
    state_url: Text | None = None
    # A CA bundle to check a rediss:// server's certificate against (default: the system's).
    state_ca_file: Text | None = None
    state_save_interval: Seconds = 30.0
    # Saved holdings that no replay could confirm count like placement guesses for this
    # long, unless real events replace them first.
    unconfirmed_ttl: Seconds = _PUBLISHER_BOUNDS.unconfirmed_ttl
    # The Endpoint Picker (app.epp.stream): Envoy's ext_proc gRPC service on this port, on `host`;
    # None: off. Gateways of the Gateway API Inference Extension ask it where each request
    # goes (docs/endpoint-picker.md).
    epp_port: Port | None = None
    # TLS on the EPP port, as gateways expect; they usually do not verify the certificate.
    epp_tls: bool = True
    # The EPP's certificate chain and key (PEM files), both or neither; neither: a
    # self-signed certificate made at every start.
    epp_tls_certfile: Text | None = None
    epp_tls_keyfile: Text | None = None
    # A CA bundle (PEM): the EPP then requires clients to present a certificate it signed.
    epp_client_ca: Text | None = None
    # Serve the EPP on an address other than loopback without client certificates. Its
    # protocol has no authentication, and whoever reaches it sways routing: allow only the
    # gateway on the network (the Helm chart's NetworkPolicy).
    epp_allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        for name in _FLOAT_SETTINGS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number")
        for name in ("api_token", "admin_token"):
            token = getattr(self, name)
            # A client's header could never carry anything else, so the token would never match.
            if token is not None and not matches(API_KEY, token):
                raise ValueError(f"{name}: must be printable ASCII (clients send it in a "
                                 "header), and not begin or end with a space")
        if self.proxy and self.tokenizer is None:
            self.tokenizer = "instance"

    def __repr__(self) -> str:
        return _repr_without_secrets(self)


# Secrets never appear in a repr, so never in logs or error messages.
_SECRETS = frozenset({"api_key", "api_token", "admin_token", "state_url"})
_FLOAT_SETTINGS = tuple(f.name for f in msgspec.structs.fields(Settings)
                        if f.type in (NonNegative, Seconds))
_LIST_SETTINGS = frozenset(f.name for f in msgspec.structs.fields(Settings)
                           if f.type == tuple[Text, ...])
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}


def _repr_without_secrets(struct: msgspec.Struct) -> str:
    shown = ", ".join(f"{name}={'<hidden>' if name in _SECRETS and value else repr(value)}"
                      for name, value in msgspec.structs.asdict(struct).items())
    return f"{type(struct).__name__}({shown})"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 bracketed or not) is this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _origin(url: str) -> str:
    """`url` as scheme://host[:port]: kvroute builds every request URL from it, so a path,
    query, fragment or credentials would end up where nobody looks (and in answers).
    HTTP_ORIGIN admits only what urlsplit reads as such an origin."""
    if not matches(HTTP_ORIGIN, url):
        raise ValueError(f"url: {url!r} is not an http(s)://HOST[:PORT] URL (no path, query, "
                         "fragment or credentials)")
    parts = urlsplit(url)
    assert parts.hostname is not None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port is not None else "")


def _numbered(endpoint: str, ranks: int) -> tuple[str, ...]:
    """Rank r's endpoint for each of `ranks` ranks: `endpoint`'s port + r, as vLLM numbers
    a data-parallel engine's publisher and replay ports."""
    _check_zmq_endpoint(endpoint, "replay")
    base, _, port = endpoint.rpartition(":")
    first = int(port)
    if first + ranks - 1 > 65535:
        raise ValueError(f"replay: {endpoint!r} numbers {ranks} ranks past port 65535; "
                         "give one endpoint per `events` entry")
    return tuple(f"{base}:{first + rank}" for rank in range(ranks))


def _check_zmq_endpoint(endpoint: str, name: str) -> None:
    if _endpoint_host(endpoint) in BIND_HOSTS:
        raise ValueError(f"{name}: {endpoint!r} is a bind address; give the host to connect to")
    if not matches(ZMQ_ENDPOINT, endpoint):
        raise ValueError(f"{name}: {endpoint!r} is not a tcp://HOST:PORT endpoint")


def _endpoint_host(endpoint: str) -> str:
    return endpoint.partition("://")[2].rpartition(":")[0].strip("[]").lower()


def foreign_endpoints(url: str | None, endpoints: Iterable[str],
                      allowed_hosts: Iterable[str]) -> list[str]:
    """The `endpoints` on neither the host of `url` nor one of `allowed_hosts`.

    An instance's KV events say which prefixes it holds; events from another machine
    would make kvroute send that machine's prefixes to this instance (or hijack its
    traffic). Without a `url` the endpoints are the instance, so none is foreign.
    Hosts are compared as written: a name and its address differ."""
    if url is None:
        return []
    own = (urlsplit(url).hostname or "").lower()
    allowed = {own, *(host.strip("[]").lower() for host in allowed_hosts)}
    return [e for e in endpoints if _endpoint_host(e) not in allowed]


def _explain(exc: msgspec.ValidationError, where: str, given: Any) -> ConfigError:
    """msgspec's `Expected ... - at `$.instances[0].url`` as `where: instances[0].url: ...`,
    with the value found there in `given` (what the layer said)."""
    message, path = split_validation(str(exc))
    named = re.match(r"(\w+): (.*)", message, re.S)  # a __post_init__ check names its field
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
        message = named.group(2)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", message)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        message = "unknown setting; known: " + ", ".join(_known(path))
    message = message.replace(f"`str` matching regex {NOT_BLANK!r}", "a non-blank string")
    if message.startswith("Invalid enum value"):  # log_level, the one Literal setting
        message += "; one of " + ", ".join(get_args(LogLevel))
    message = message[:1].lower() + message[1:]
    value = _lookup(given, path)
    if message.startswith("expected") and value is not _MISSING:
        message = re.sub(r", got `\w+`$", "", message) + f", got {value!r}"
    return ConfigError(f"{where}: {path}: {message}" if path else f"{where}: {message}",
                       path or None)


_MISSING = object()


def _lookup(given: Any, path: str) -> Any:
    """The value at `instances[0].url` in decoded TOML/JSON/env values, or _MISSING."""
    for name, index in re.findall(r"(\w+)|\[(\d+)\]", path):
        try:
            given = given[name] if name else given[int(index)]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return given


def _known(path: str) -> list[str]:
    struct = (InstanceConfig if path.startswith("instances[") else
              FleetConfig if path.startswith("fleets[") else Settings)
    return [f.name for f in msgspec.structs.fields(struct)]


def parse_instance(raw: Any, where: str) -> InstanceConfig:
    """One instance from decoded JSON (the HTTP API); a ConfigError names the bad field."""
    try:
        return msgspec.convert(raw, InstanceConfig)
    except msgspec.ValidationError as exc:
        raise _explain(exc, where, raw) from None


def _checked(values: Mapping[str, Any], where: str, *, strict: bool) -> Settings:
    try:
        return msgspec.convert(values, Settings, strict=strict)
    except msgspec.ValidationError as exc:
        raise _explain(exc, where, values) from None


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
    for field in msgspec.structs.fields(Settings):
        raw = environ.get(ENV_PREFIX + field.name.upper())
        if raw is None or raw == "" or field.name in ("instances", "fleets"):
            continue
        if field.type is bool:
            raw = _BOOL_WORDS.get(raw.strip().lower(), raw)
        elif field.name in _LIST_SETTINGS:  # comma-separated
            raw = [item.strip() for item in raw.split(",") if item.strip()]
        elif field.name == "log_level":
            raw = raw.strip().lower()
        values[field.name] = raw
    urls = environ.get(ENV_PREFIX + "INSTANCES", "")
    if urls.strip():
        values["instances"] = [{"url": url.strip()} for url in urls.split(",") if url.strip()]
    fleets = environ.get(ENV_PREFIX + "FLEETS", "")
    if fleets.strip():
        values["fleets"] = [{"url": url.strip()} for url in fleets.split(",") if url.strip()]
    return values


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Layer defaults < file < environment (KVROUTE_*) < flags; instances accumulate.

    `KVROUTE_INSTANCES` is a comma-separated list of instance URLs, `KVROUTE_FLEETS` one
    of fleet URLs (DNS names, app.fleet.dns); fleets accumulate like instances. Every other
    setting `x` is read from `KVROUTE_X`. Flags with value None are "not given".
    Each layer is checked on its own first, so an error names the layer it is in.
    """
    layers: list[tuple[str, dict[str, Any], bool]] = []
    if config_file is not None:
        layers.append((f"config file {config_file}", _from_file(Path(config_file)), True))
    layers.append(("environment", _from_env(os.environ if environ is None else environ), False))
    layers.append(("command line", {k: v for k, v in (flags or {}).items() if v is not None},
                   False))
    merged: dict[str, Any] = {}
    instances: list[InstanceConfig] = []
    fleets: list[FleetConfig] = []
    for where, values, strict in layers:
        # Environment strings become numbers and booleans; a TOML file is already typed.
        checked = _checked(values, where, strict=strict)
        merged.update((name, getattr(checked, name)) for name in values
                      if name not in ("instances", "fleets"))
        instances.extend(checked.instances)
        fleets.extend(checked.fleets)
    settings = Settings(**merged, instances=tuple(instances), fleets=tuple(fleets))
    if not (is_loopback(settings.host) or settings.api_token or settings.admin_token
            or settings.allow_unauthenticated):
        raise ConfigError(f"host {settings.host} is reachable from other machines and no "
                          "api_token/admin_token is set: set KVROUTE_API_TOKEN and "
                          "KVROUTE_ADMIN_TOKEN, or pass --allow-unauthenticated on a trusted "
                          "network", "host")
    if (settings.tls_certfile is None) != (settings.tls_keyfile is None):
        raise ConfigError("give both tls_certfile and tls_keyfile (HTTPS), or neither",
                          "tls_certfile")
    if len(settings.instances) > settings.max_instances:
        raise ConfigError(f"{len(settings.instances)} instances configured, more than "
                          f"max_instances ({settings.max_instances})", "instances")
    for number, instance in enumerate(settings.instances):
        foreign = foreign_endpoints(instance.url, (*instance.events, *instance.replay),
                                    settings.zmq_endpoint_hosts)
        if foreign:
            raise ConfigError(f"instances[{number}]: endpoint {foreign[0]} is not on the "
                              f"instance's host ({instance.url}); list its host in "
                              "zmq_endpoint_hosts to allow it", f"instances[{number}].events")
    if settings.state_dir is not None and settings.state_url is not None:
        raise ConfigError("give state_dir (one process) or state_url (replicas sharing "
                          "Valkey/Redis), not both (the container image sets "
                          "KVROUTE_STATE_DIR: set it empty to use state_url)", "state_url")
    _check_epp(settings)
    if settings.state_url is not None:
        scheme = settings.state_url.partition("://")[0].lower()
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("state_url must be a redis://, rediss:// or unix:// URL",
                              "state_url")
    ids = [default_instance_id(instance) for instance in settings.instances]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"instance id(s) {', '.join(repeated)} configured more than once; "
                          "give each instance a distinct `id`", "instances")
    fleet_ids = [str(fleet.id) for fleet in settings.fleets]
    repeated = sorted({i for i in fleet_ids if fleet_ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"fleet id(s) {', '.join(repeated)} configured more than once; give "
                          "each fleet a distinct `id`", "fleets")
    return settings


def _check_epp(settings: Settings) -> None:
    if settings.epp_port is None:
        return
    if settings.epp_port == settings.port and settings.port != 0:
        raise ConfigError(f"epp_port {settings.epp_port} is also the HTTP port; give the EPP "
                          "its own (9002 by convention)", "epp_port")
    if (settings.epp_tls_certfile is None) != (settings.epp_tls_keyfile is None):
        raise ConfigError("give both epp_tls_certfile and epp_tls_keyfile, or neither (a "
                          "self-signed certificate)", "epp_tls_certfile")
    if not settings.epp_tls and (settings.epp_tls_certfile or settings.epp_client_ca):
        raise ConfigError("epp_tls is off: epp_tls_certfile, epp_tls_keyfile and "
                          "epp_client_ca need it on", "epp_tls")
    from kvroute.app.pem import check_pem_files  # cryptography: only with the EPP on

    try:
        check_pem_files(settings.epp_tls_certfile, settings.epp_tls_keyfile,
                        settings.epp_client_ca)
    except ValueError as exc:
        raise ConfigError(str(exc), str(exc).partition(":")[0]) from None
    if not (is_loopback(settings.host) or settings.epp_client_ca
            or settings.epp_allow_unauthenticated):
        raise ConfigError(f"the EPP on {settings.host}:{settings.epp_port} is reachable from "
                          "other machines and its protocol has no authentication: set "
                          "epp_client_ca (gateways then present a client certificate), or "
                          "epp_allow_unauthenticated = true when only the gateway can reach "
                          "the port (a NetworkPolicy)", "epp_port")


def default_instance_id(config: InstanceConfig) -> str:
    """`id` if given, else HOST:PORT of the URL, else of the first event endpoint."""
    if config.id:
        return config.id
    if config.url:
        parts = urlsplit(config.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"
    return config.events[0].partition("://")[2]
