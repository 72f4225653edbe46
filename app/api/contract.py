"""What each HTTP operation takes and answers: the table the OpenAPI document is built from.

One entry per (method, path) kvroute can serve. Bodies are named by the types the code
itself decodes requests with and encodes answers from (`app.api.route_request`, `app.config`,
`app.api.answers`), never by a copy; what a type cannot say is in the status reasons. Every
status an operation can answer is listed with every reason it is answered, so a client
(and the fuzz test) can rely on the list being complete. Invariants, checked by tests:
the app's routes and this table name the same operations, and the document built from it
matches the committed docs/openapi.json.

Two statuses are added by the document builder, not listed here: 401 on an operation whose
`guard` token is configured, and nothing else; and an undeclared method on a path is
answered 405 with an `Allow` header (app.http.app), which OpenAPI has no place to declare.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from kvroute.app.api.answers import (
    Dashboard,
    DecisionLogAnswer,
    Deleted,
    Error,
    Health,
    InstanceDetail,
    InstanceList,
    MatchAnswer,
    ModelList,
    Readiness,
    RouteAnswer,
)
from kvroute.app.api.openai_request import ChatQuestion, CompletionQuestion
from kvroute.app.api.route_request import (
    CONTINUE_RULE,
    inputs_schema,
    match_request_type,
    route_request_type,
)
from kvroute.app.config import INSTANCE_RULES, InstanceConfig, Settings

__all__ = ["CONTRACT", "DECISIONS_PAGE", "JSON", "REGISTRATION_MAX_BYTES", "Answer", "Operation",
           "Relayed"]

JSON = "application/json"

# A registration is a few hundred bytes; this bounds what one can make kvroute hold.
REGISTRATION_MAX_BYTES = 64 * 1024
# The most entries one GET /v1/decisions answers: page on with `since`.
DECISIONS_PAGE = 10_000


@dataclass(frozen=True, slots=True)
class Relayed:
    """An instance's own answer, passed on as it came (the proxy): any JSON, or an event
    stream."""

    description: str


@dataclass(frozen=True, slots=True)
class Answer:
    """One status: why it is answered, and its body (a type kvroute encodes; `str` for
    text; None for none; `Relayed` for the instance's own)."""

    reasons: tuple[str, ...]
    body: Any = Error
    media_type: str = JSON
    headers: Mapping[str, str] = field(default_factory=dict)  # name -> description
    # OpenAPI links: name -> (operationId, {parameter: runtime expression}).
    links: Mapping[str, tuple[str, Mapping[str, str]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Operation:
    summary: str
    description: str
    tag: str
    answers: Mapping[int | str, Answer]
    # The request body's type under the given settings (its limits); None: no body.
    body: Callable[[Settings], Any] | None = None
    body_limit: str | None = None  # the byte limit, as the 413 reason names it
    # The token that guards the operation when it is configured (app.http.auth).
    guard: Literal["api", "admin"] | None = None
    # Path parameter -> description (its schema is the instance id's).
    parameters: Mapping[str, str] = field(default_factory=dict)
    # Query parameter -> (description, JSON schema); none is required.
    query: Mapping[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)


def _merge(*parts: Mapping[int | str, Answer]) -> dict[int | str, Answer]:
    """The parts' statuses together; a status in several parts has all their reasons."""
    merged: dict[int | str, Answer] = {}
    for part in parts:
        for status, answer in part.items():
            if status in merged:
                known = merged[status]
                answer = Answer(known.reasons + answer.reasons, known.body, known.media_type,
                                {**known.headers, **answer.headers})
            merged[status] = answer
    return dict(sorted(merged.items(), key=lambda item: str(item[0])))


def _why(*reasons: str) -> Answer:
    return Answer(reasons)


# Every path but /healthz, /readyz and /metrics passes app.http.guard first.
ADMISSION = {
    400: _why("the Host header does not name this server (`allowed_hosts`)"),
    429: _why("`max_concurrent_requests` requests are in progress already; retry later"),
}


def _json_body(limit: str) -> dict[int | str, Answer]:
    return {
        400: _why("the body is not JSON"),
        408: _why("the whole body did not arrive within `body_timeout`"),
        413: _why(f"the body is over {limit}"),
        415: _why("the body is not sent as `application/json`"),
        422: _why("a value the request schema does not allow; `field` names it"),
    }


def _route_body(settings: Settings) -> Any:
    examples = [{"token_ids": [128000, 9906, 1917, 0], "model": "llama-3-8b"},
                {"prompt": "Summarise the ticket below.", "probe": True}]
    return Annotated[route_request_type(settings), msgspec.Meta(
        extra_json_schema=inputs_schema(settings), examples=examples)]


def _match_body(settings: Settings) -> Any:
    examples = [{"token_ids": [128000, 9906, 1917, 0], "model": "llama-3-8b"},
                {"block_hashes": ["5d1c9f0e2b7a4c3d"], "candidates": ["gpu-a", "gpu-b"]}]
    return Annotated[match_request_type(settings), msgspec.Meta(
        extra_json_schema=inputs_schema(settings), examples=examples)]


# What a match query and a route refuse alike (`Service._lookup`).
PROMPT_REFUSALS = {
    400: _why("the instance's tokenizer (or the local chat template) refused `prompt` "
              "or `messages`; its reason is quoted"),
    404: _why("`model` is served by no registered instance",
              "a `candidates` id is not registered (`unknown` lists them)"),
    409: _why("`prompt` or `messages` with `tokenizer = \"instance\"`, and no eligible "
              "instance has a `url` to tokenize with (registered with `events` only)"),
    413: _why("the prompt is over `max_prompt_tokens` once tokenized",
              "the `messages`' text together is over `max_prompt_chars`"),
    422: _why("`prompt` or `messages` while no `tokenizer` is configured"),
    502: _why("the instances asked to tokenize the prompt failed (up to 3 are tried)"),
    503: _why("no eligible worker: none registered, or none live that serves `model` "
              "among the `candidates`"),
}


ROUTE = Operation(
    summary="Choose the worker for a prompt",
    description=(
        "Give the prompt exactly one way: `token_ids`, vLLM `block_hashes`, `prompt` text or "
        "chat `messages` (text and chat need a `tokenizer`). Every eligible worker is "
        "scored in prefill tokens (uncached prompt tokens plus queued work); the cheapest "
        "wins. Send the request to the answer's `url` with the header "
        "`X-data-parallel-rank: <dp_rank>`. With `probe: true` the answer is only a "
        "question: it leaves no placement guess and counts as no load."),
    tag="routing",
    guard="api",
    body=_route_body,
    body_limit="`max_body_bytes`",
    answers=_merge(
        {200: Answer(("the chosen worker, and the scores of the cheapest few (every eligible "
                      "worker's with `all_scores`)",), RouteAnswer)},
        ADMISSION, _json_body("`max_body_bytes`"),
        PROMPT_REFUSALS),
)

MATCH = Operation(
    summary="How much of a prompt each worker holds",
    description=(
        "The prompt is given as for `/v1/route`, and the same workers are eligible. The "
        "answer lists each eligible worker that holds at least the prompt's first block, "
        "most matched tokens first: matched blocks and tokens, per tier, and how many are "
        "only guessed from recent answers. Nothing is weighed (no load, no cost, no tie "
        "broken) and nothing is left behind: for a caller that applies its own policy."),
    tag="routing",
    guard="api",
    body=_match_body,
    body_limit="`max_body_bytes`",
    answers=_merge(
        {200: Answer(("the workers holding part of the prompt (none: an empty list)",),
                     MatchAnswer)},
        ADMISSION, _json_body("`max_body_bytes`"), PROMPT_REFUSALS),
)

LIST_INSTANCES = Operation(
    summary="The registered instances",
    description="Each instance's state, models and block size; `discovery_error` and "
                "`load_error` (the last failed `/metrics` scrape) when there is one; "
                "`fleet` for an address of a fleet. `fleets`: each configured DNS name, "
                "what it resolved to and its last error.",
    tag="instances",
    guard="api",
    answers=_merge({200: Answer(("every registered instance",), InstanceList)}, ADMISSION),
)

INSTANCE_ID = {"instance_id": "the instance's `id` (its HOST:PORT unless registered with one)"}
UNKNOWN_INSTANCE = {404: _why("no instance is registered under `instance_id`")}

GET_INSTANCE = Operation(
    summary="One instance, worker by worker",
    description="Per data-parallel worker: its state (`connecting`, `replaying`, `live`, "
                "`degraded`, `down`), endpoints, holdings per tier and event counters.",
    tag="instances",
    guard="api",
    parameters=INSTANCE_ID,
    answers=_merge({200: Answer(("the instance",), InstanceDetail)}, UNKNOWN_INSTANCE,
                   ADMISSION),
)

ADD_INSTANCE = Operation(
    summary="Register an instance and follow its KV events",
    description=(
        "`url` alone is enough: discovery asks the instance for its event endpoints, "
        "models and block size. Explicit `events` (and `replay`) endpoints, one per "
        "data-parallel rank (or one `replay` endpoint, rank 0's, with rank r's at its port "
        "+ r), skip discovery. `api_key` is the instance's vLLM `--api-key` "
        "and is never shown back. `endpoint` is the `IP:PORT` the Endpoint Picker gives "
        "gateways for it. Only while `manage_instances` is on."),
    tag="instances",
    guard="admin",
    body=lambda settings: Annotated[InstanceConfig, msgspec.Meta(
        extra_json_schema=INSTANCE_RULES,
        examples=[{"url": "http://10.0.0.5:8000"},
                  {"id": "gpu-b", "url": "http://10.0.0.6:8000", "model": "llama-3-8b",
                   "events": ["tcp://10.0.0.6:5557"], "replay": ["tcp://10.0.0.6:5558"]}])],
    body_limit=f"{REGISTRATION_MAX_BYTES // 1024} KiB",
    answers=_merge(
        {201: Answer(("registered; its workers start connecting",), InstanceDetail,
                     links={"get_instance": ("get_instance",
                                             {"instance_id": "$response.body#/id"}),
                            "delete_instance": ("delete_instance",
                                                {"instance_id": "$response.body#/id"})})},
        ADMISSION, _json_body(f"{REGISTRATION_MAX_BYTES // 1024} KiB"),
        {403: _why("an `events` or `replay` endpoint is on another host than `url`'s, "
                   "which `zmq_endpoint_hosts` does not list"),
         409: _why("an instance is registered under this id already",
                   "`max_instances` are registered already",
                   "the instance does not serve the registration's `model`"),
         422: _why("`replay` is a list of another length than `events`, or one endpoint "
                   "whose port + the last rank passes 65535",
                   "an endpoint names a bind address (`0.0.0.0`, `[::]`) instead of a host"),
         502: _why("discovery failed: the instance at `url` did not answer as vLLM does")}),
)

DELETE_INSTANCE = Operation(
    summary="Stop following an instance",
    description="Its subscribers stop and its entries leave the index. Only while "
                "`manage_instances` is on; an address of a fleet leaves when DNS drops it.",
    tag="instances",
    guard="admin",
    parameters=INSTANCE_ID,
    answers=_merge({200: Answer(("removed",), Deleted)}, UNKNOWN_INSTANCE, ADMISSION,
                   {409: _why("the instance is an address of a fleet, which follows its "
                              "DNS name")}),
)

HEALTHZ = Operation(
    summary="Liveness",
    description="Answers while the process serves HTTP.",
    tag="health",
    answers={200: Answer(("alive",), Health)},
)

READYZ = Operation(
    summary="Readiness",
    description=(
        "Ready once every configured worker is live, or `ready_grace_seconds` after start; "
        "then ready for good. With `state_url`, `replicas` says whether Valkey is reachable "
        "(unreachable stays ready); with saved state, `saved_state` says how the last save "
        "and the load went."),
    tag="health",
    answers={200: Answer(("ready",), Readiness),
             503: Answer(("not ready yet; `reason` says what it waits for",), Readiness)},
)

METRICS = Operation(
    summary="Prometheus metrics",
    description="The Prometheus text exposition format, version 0.0.4.",
    tag="health",
    answers={200: Answer(("the metrics",), str, "text/plain")},
)

# Headers every forwarded answer carries (with `decision_log` on, `x-kvroute-decision` too:
# its entry's id, described with `GET /v1/decisions`, not listed as required here).
_KVROUTE_HEADERS = {
    "x-kvroute-instance": "the instance the request went to",
    "x-kvroute-dp-rank": "its data-parallel rank",
    "x-kvroute-attempts": "connections tried, this one included",
}


def _or_relayed(answers: Mapping[int | str, Answer], relayed: Relayed
                ) -> dict[int | str, Answer]:
    """kvroute's own refusals, each of which the instance may also answer itself."""
    return {status: answer if answer.body is relayed else Answer(
        (*answer.reasons, "the instance answered so itself (relayed, with "
                          "`x-kvroute-instance`)"), (Error, relayed))
            for status, answer in answers.items()}


def _forwarded(kind: str, question: Any, reads: str) -> Operation:
    relayed = Relayed("the instance's own answer (also for its errors), relayed as it came")
    return Operation(
        summary=f"OpenAI {kind}, forwarded to the chosen worker",
        description=(
            "Routed like `POST /v1/route` and forwarded byte for byte to the chosen worker "
            "with `X-data-parallel-rank`; the answer, streamed or not, is the instance's. "
            f"kvroute reads only {reads}; any other field is the instance's to judge. A "
            "status kvroute answers itself has kvroute's error body and no "
            "`x-kvroute-instance` header. Only with `proxy` on."),
        tag="proxy",
        guard="api",
        body=lambda settings: question,
        body_limit="`max_body_bytes`",
        answers=_or_relayed(_merge(
            {200: Answer((relayed.description,), relayed, headers=_KVROUTE_HEADERS),
             "default": Answer((relayed.description,), relayed, headers=_KVROUTE_HEADERS)},
            ADMISSION, _json_body("`max_body_bytes`"),
            {400: _why("the body is not the OpenAI request kvroute reads (`field` names "
                       "what), or the prompt's tokenizer refused it"),
             404: _why("`model` is served by no registered instance"),
             409: _why("a text prompt, and no eligible instance has a `url` to tokenize with"),
             413: _why("the prompt is over `max_prompt_tokens` once tokenized",
                       "the `messages`' text together is over `max_prompt_chars`"),
             502: _why("the instance broke before answering, or tokenizing failed"),
             503: _why("no eligible worker is left (at most 3 refused connections are "
                       "tried)")}), relayed),
    )


MODELS = Operation(
    summary="Every model a registered instance serves",
    description="vLLM's model list shape; a model several instances serve is listed once. "
                "Only with `proxy` on.",
    tag="proxy",
    guard="api",
    answers=_merge({200: Answer(("the models",), ModelList)}, ADMISSION),
)

DASHBOARD_DATA = Operation(
    summary="What the dashboard shows",
    description=(
        "Every instance and worker now: state, holdings by medium, event counters (gaps, "
        "replays), load (proxied requests in flight, the instance's own gauges), routing "
        "decisions per worker and in all with their recent latency, and the proxy's "
        "predicted against actual cached tokens. Values are current or counters since "
        "start: rates are the differences between two answers."),
    tag="dashboard",
    guard="api",
    answers=_merge({200: Answer(("the snapshot",), Dashboard)}, ADMISSION),
)


def _page(what: str, media_type: str) -> Operation:
    return Operation(
        summary=f"The dashboard's {what}",
        description="A static file shipped with kvroute; it holds no data and needs no "
                    "token (the page asks `GET /v1/dashboard` for the data, with the token "
                    "the user gives it).",
        tag="dashboard",
        answers=_merge({200: Answer((f"the {what}",), str, media_type)}, ADMISSION),
    )


DECISIONS = Operation(
    summary="The last routing decisions",
    description=(
        "Only with `decision_log` set (it is the number of decisions kept, oldest dropped "
        "first). Per decision: when, for which caller (`route`, `proxy`, `epp`), the "
        "prompt's prefix key, the cost terms and load readings of the cheapest shown workers "
        "(at most 8), the choice, and for a proxied request the cached tokens the engine "
        "reported (the proxy's "
        "answers carry the decision's id in `x-kvroute-decision`). Probes are not logged. "
        "Page with `since`."),
    tag="routing",
    guard="api",
    answers=_merge({200: Answer(("the kept decisions with an id above `since`, oldest "
                                 "first",), DecisionLogAnswer),
                    422: _why("`since` or `limit` is not a whole number in its range")},
                   ADMISSION),
    query={"since": ("only decisions with a larger id (default 0: every kept one)",
                     {"type": "integer", "minimum": 0, "default": 0}),
           "limit": ("at most this many decisions",
                     {"type": "integer", "minimum": 1, "maximum": DECISIONS_PAGE,
                      "default": DECISIONS_PAGE})},
)

CONTRACT: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/route"): ROUTE,
    ("POST", "/v1/match"): MATCH,
    ("GET", "/v1/decisions"): DECISIONS,
    ("GET", "/v1/instances"): LIST_INSTANCES,
    ("POST", "/v1/instances"): ADD_INSTANCE,
    ("GET", "/v1/instances/{instance_id}"): GET_INSTANCE,
    ("DELETE", "/v1/instances/{instance_id}"): DELETE_INSTANCE,
    ("POST", "/v1/completions"): _forwarded(
        "completions", CompletionQuestion,
        "`model` and `prompt` (text, token ids, or a batch of either, routed by its first)"),
    ("POST", "/v1/chat/completions"): _forwarded(
        "chat completions",
        Annotated[ChatQuestion, msgspec.Meta(extra_json_schema=CONTINUE_RULE)],
        "`model`, `messages` (every field of each) and the fields that change how the chat "
        "template renders them (`tools`, `chat_template_kwargs`, `add_generation_prompt`, "
        "`continue_final_message`, `add_special_tokens`, `chat_template`)"),
    ("GET", "/v1/models"): MODELS,
    ("GET", "/v1/dashboard"): DASHBOARD_DATA,
    ("GET", "/dashboard"): _page("page: a live view of the fleet, updated every second",
                                 "text/html"),
    ("GET", "/dashboard/app.js"): _page("script", "text/javascript"),
    ("GET", "/dashboard/style.css"): _page("style sheet", "text/css"),
    ("GET", "/healthz"): HEALTHZ,
    ("GET", "/readyz"): READYZ,
    ("GET", "/metrics"): METRICS,
}
