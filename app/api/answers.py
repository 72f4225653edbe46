"""What the HTTP API answers: every JSON body kvroute writes is one of these structs.

They are encoded with msgspec exactly as they are, and the OpenAPI document
(`app.http.openapi`) describes these same structs, so the description cannot drift from what
is sent. Invariants: every field is always present unless its default is UNSET (then it
is left out, never sent as null); fields that can be null say so in their type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from kvroute.app.workers import WorkerState, WorkerStatus

__all__ = [
    "CostTerms", "Dashboard", "DecisionLogAnswer", "LoggedChoice", "LoggedDecision",
    "LoggedScore", "DashboardHits", "DashboardInstance", "DashboardRoutes",
    "DashboardWorker", "Deleted", "Error", "FleetStatus", "Health", "InstanceDetail",
    "InstanceList",
    "InstanceSummary", "LoadReadings", "MatchAnswer", "MediumCounts", "ModelCard", "ModelList",
    "Readiness", "ReplicasStatus", "RouteAnswer", "SavedStateLoaded", "SavedStateStatus",
    "WorkerDetail", "WorkerMatch", "WorkerScore", "encode",
]

encode = msgspec.json.Encoder().encode

# An instance is "discovering" until its workers are known, then in its workers' state.
INSTANCE_STATES = ("discovering", *(state.value for state in WorkerState))
InstanceState = Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(INSTANCE_STATES)})]


class Error(msgspec.Struct, forbid_unknown_fields=True):
    """Every refusal: a sentence for people and the request field at fault (null when the
    request as a whole is)."""

    error: str
    field: str | None
    # The candidate instance ids kvroute does not know (POST /v1/route only).
    unknown: list[str] | UnsetType = UNSET


class MediumCounts(msgspec.Struct, forbid_unknown_fields=True):
    """Blocks per storage tier."""

    GPU: int
    CPU: int
    STORAGE: int

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> MediumCounts:
        """The counts per tier name (the index's holdings), 0 for a tier not in them."""
        return cls(GPU=counts.get("GPU", 0), CPU=counts.get("CPU", 0),
                   STORAGE=counts.get("STORAGE", 0))


class CostTerms(msgspec.Struct, forbid_unknown_fields=True):
    """A worker's cost in prefill tokens, by term: the prompt's tokens it would compute
    (`prefill`), those of them another eligible worker holds, priced again for the cache
    space a second copy takes (`copy`), the price of storing the tokens it would compute
    where more other prefixes must be held than on the least crowded loaded worker
    (`crowding`), and the work queued there (`queue`)."""

    prefill: float
    copy: float
    queue: float
    crowding: float


class LoadReadings(msgspec.Struct, forbid_unknown_fields=True):
    """What the cost used: the instance's /metrics (null without a fresh scrape, and in
    proxy mode for running and waiting) and kvroute's own counts; and what breaks a tie
    between idle workers of equal cost, `recent_demand`: the prompt tokens this kvroute
    sent there lately (per prefix, its latest prompt), each halving every 10 s."""

    running: float | None
    waiting: float | None
    kv_usage: float | None
    inflight: int
    answered: int
    queued_prefill: int
    recent_demand: int


class WorkerMatch(msgspec.Struct, forbid_unknown_fields=True):
    """How much of the prompt one eligible worker holds (a match answer's entry, and the
    first fields of its score in a route answer)."""

    instance: str
    dp_rank: int
    matched_blocks: int
    matched_tokens: int
    block_size: int | None
    by_medium: MediumCounts
    pending_blocks: int  # of matched_blocks: only guessed, from answers lately


class WorkerScore(WorkerMatch, forbid_unknown_fields=True):
    """One eligible worker's score; `cost` is the sum of `cost_terms`, in prefill tokens."""

    state: WorkerState
    cost: float
    cost_terms: CostTerms
    queued_prefill_tokens: float
    running_requests: float
    overloaded: bool
    load: LoadReadings


class RouteAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """The chosen worker: send the request to `url` with `X-data-parallel-rank: dp_rank`.
    `scores` has the chosen worker and the cheapest others, at most 4, cheapest first,
    overloaded ones last; every one of the `eligible_workers` with `all_scores`."""

    instance: str
    url: str | None
    dp_rank: int
    matched_blocks: int
    matched_tokens: int
    prompt_tokens: int | None  # null for block_hashes
    prompt_blocks: int | None  # null unless block_hashes (and not empty)
    scores: list[WorkerScore]
    eligible_workers: int  # workers weighed, shown in `scores` or not


class MatchAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """Every eligible worker that holds at least the prompt's first block, most matched
    tokens first (then by instance id and rank): what the index knows, weighed by nothing."""

    prompt_tokens: int | None  # null for block_hashes
    prompt_blocks: int | None  # null unless block_hashes (and not empty)
    matches: list[WorkerMatch]
    eligible_workers: int  # workers asked, listed in `matches` or not


class InstanceSummary(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A registered instance; its state is its workers' (`discovering` until they are known)."""

    id: str
    url: str | None
    models: list[str]
    block_size: int | None
    state: InstanceState
    dp_size: int
    endpoint: str | UnsetType = UNSET  # IP:PORT given to gateways (the Endpoint Picker)
    discovery_error: str | UnsetType = UNSET
    load_error: str | UnsetType = UNSET  # the last failed /metrics scrape
    fleet: str | UnsetType = UNSET  # the fleet whose DNS name gave its address


class WorkerDetail(msgspec.Struct, forbid_unknown_fields=True):
    """One data-parallel rank of an instance: where its events come from, what it holds."""

    dp_rank: int
    events_endpoint: str
    replay_endpoint: str | None
    state: WorkerState
    holdings: MediumCounts
    unconfirmed_blocks: int
    stats: WorkerStatus


class InstanceDetail(InstanceSummary, forbid_unknown_fields=True, kw_only=True):
    """A registered instance, worker by worker."""

    workers: list[WorkerDetail]


class FleetStatus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A DNS name followed as a fleet: the addresses it last resolved to, the instances
    made of them (`<id>@<address>`), and the last refresh's error, if it failed."""

    id: str
    url: str
    addresses: list[str]
    instances: list[str]
    resolve_failures: int
    error: str | UnsetType = UNSET


class InstanceList(msgspec.Struct, forbid_unknown_fields=True):
    instances: list[InstanceSummary]
    fleets: list[FleetStatus] | UnsetType = UNSET  # with `fleets` configured


class Deleted(msgspec.Struct, forbid_unknown_fields=True):
    deleted: str


class Health(msgspec.Struct, forbid_unknown_fields=True):
    status: Literal["ok"]


class ReplicasStatus(msgspec.Struct, forbid_unknown_fields=True):
    """Sharing with other replicas through Valkey/Redis (`state_url`)."""

    connected: bool
    peers: int
    detail: str


class SavedStateLoaded(msgspec.Struct, forbid_unknown_fields=True):
    workers: int
    blocks: int
    unclaimed: int


class SavedStateStatus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the index is saved, and how the last save and the load went."""

    store: str
    saves: int
    last_save_age_seconds: float | UnsetType = UNSET
    save_error: str | UnsetType = UNSET
    loaded: SavedStateLoaded | UnsetType = UNSET
    load_error: str | UnsetType = UNSET


class Readiness(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Whether this replica is ready, and why (what it still waits for)."""

    ready: bool
    reason: str
    replicas: ReplicasStatus | UnsetType = UNSET  # with state_url
    saved_state: SavedStateStatus | UnsetType = UNSET  # with state_dir or state_url


class ModelCard(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's model list shape."""

    object: Literal["list"]
    data: list[ModelCard]


class DashboardHits(msgspec.Struct, forbid_unknown_fields=True):
    """Predicted against actual cached tokens of the requests the proxy forwarded to a
    worker: `requests` compared, `exact` of them with no difference, the two token totals,
    and `unavailable` requests that could not be compared."""

    requests: int
    exact: int
    predicted: int
    actual: int
    unavailable: int


class DashboardWorker(msgspec.Struct, forbid_unknown_fields=True):
    """One worker now: state, holdings, its subscriber's counters, its load and what was
    routed to it. Counters only grow while the worker is followed; rates are differences
    between two answers."""

    dp_rank: int
    state: WorkerState
    holdings: MediumCounts
    unconfirmed_blocks: int
    stats: WorkerStatus
    inflight: int  # proxied requests open on it
    queued_prefill: int  # their prompt tokens not yet computed
    running: float | None  # the instance's /metrics (null without a fresh scrape)
    waiting: float | None
    kv_usage: float | None
    routed: int  # decisions that chose it (probes excluded)
    hits: DashboardHits


class DashboardInstance(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    url: str | None
    state: InstanceState
    models: list[str]
    block_size: int | None
    workers: list[DashboardWorker]


class DashboardRoutes(msgspec.Struct, forbid_unknown_fields=True):
    """Routing decisions since start (`/v1/route`, the proxy, the Endpoint Picker):
    `decisions` all of them, `routed` those that were not probes, `seconds` their time
    together; the median and 99th percentile of the last few hundred, in milliseconds
    (null before the first)."""

    decisions: int
    routed: int
    seconds: float
    recent_p50_ms: float | None
    recent_p99_ms: float | None


class Dashboard(msgspec.Struct, forbid_unknown_fields=True):
    """What `/dashboard` shows, as of `time` (Unix seconds on kvroute's clock)."""

    time: float
    uptime_seconds: float
    ready: bool
    ready_reason: str
    proxy: bool
    index_nodes: int
    index_bytes: int
    routes: DashboardRoutes
    instances: list[DashboardInstance]


class LoggedScore(msgspec.Struct, forbid_unknown_fields=True):
    """One weighed worker of a logged decision: its match, its cost terms in prefill tokens
    (the queue term as weighed, no higher than the worker's recent average), and the load
    readings behind them."""

    instance: str
    dp_rank: int
    matched_tokens: int
    pending_blocks: int
    cost: float
    prefill: float
    copy: float
    crowding: float
    queue: float
    queued_prefill: int
    running: float
    inflight: int
    answered: int
    metrics_running: float | None
    metrics_waiting: float | None
    recent_demand: int
    overloaded: bool


class LoggedChoice(msgspec.Struct, forbid_unknown_fields=True):
    """The worker a logged decision chose."""

    instance: str
    dp_rank: int
    matched_tokens: int


class LoggedDecision(msgspec.Struct, forbid_unknown_fields=True):
    """One decision of the log: when (seconds since kvroute started), for which caller
    (`route`, `proxy` or `epp`), the prompt's prefix key (its first block's digest), what
    was weighed and chosen, and the cached tokens the engine reported (proxied requests
    only; null until the answer's usage is read, and for a route answered to a caller)."""

    id: int
    at: float
    mode: str
    prefix: str
    prompt_tokens: int | None
    chosen: LoggedChoice
    eligible_workers: int
    scores: list[LoggedScore]
    cached_tokens: int | None = None


class DecisionLogAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """The kept decisions with an id above `since`, oldest first; the log keeps `capacity`."""

    capacity: int
    decisions: list[LoggedDecision]
