"""The checks of ``make e2e-lb``: nginx and HAProxy with kvroute's shipped files, in front
of simulated vLLM instances.

Who served a request is the instance's own record (``SimInstance.received``: the path, the
headers as they arrived, the data-parallel rank that ran it, the status), found by the
X-Request-Id each request carries. Two kinds of balancer are checked:

- *real*: asking the real kvroute, in front of both instances (two ranks each). A request
  lands where kvroute says once kvroute has learnt where its prefix is cached; when kvroute
  is stopped, the upstream group serves everything.
- *faked*: asking a scripted stand-in (e2e/lb_fake.py), in front of instance 0 and an
  address that refuses connections. The stand-in shows what the glue asks, and that every
  kind of bad answer (an error, not JSON, no usable url, a stall past the deadline, a
  closed connection, an instance that refuses) sends the request to the upstream group.

Nothing here asserts speed: every wait polls a condition until a generous deadline.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from e2e.lb import Balancer
from e2e.lb_fake import FakeKvroute, Reply
from kvroute.sim.api import ReceivedRequest
from kvroute.sim.cluster import SimCluster

MODEL = "sim-model"
BLOCK = 16
API_TOKEN = "router-token"  # kvroute's api_token, given to the balancers
INSTANCE_KEY = "instance-key"  # the instances' --api-key, sent by the clients
STREAM_INTERVAL_S = 0.08  # the simulated instances' pause between two SSE events

_ids = itertools.count()
_rng = random.Random(20261123)


class CheckFailed(AssertionError):
    """A balancer broke the contract."""


def require(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Setup:
    """Everything the checks use; made and torn down by e2e/lb_run.py."""

    cluster: SimCluster
    kv_url: str
    ids: list[str]  # kvroute's instance id of each cluster instance
    fake: FakeKvroute
    dying: FakeKvroute  # an "instance" that accepts a request and hangs up
    dead_url: str  # an address that refuses connections
    real: dict[str, Balancer]  # kind -> balancer asking kvroute
    faked: dict[str, Balancer]  # kind -> balancer asking the fake
    http: httpx.Client
    timeout: float
    say: Callable[[str], None]
    kvroute_stopped: bool = False
    notes: list[str] = field(default_factory=list)


# --- helpers ------------------------------------------------------------------------------------


def new_id(tag: str) -> str:
    return f"lb-{tag}-{next(_ids)}-{time.monotonic_ns()}"


def tokens(n: int) -> list[int]:
    return [_rng.randrange(1000, 30000) for _ in range(n)]


def text(n: int) -> str:
    words = ["kv", "cache", "prefix", "route", "block", "token", "engine", "gateway"]
    out = f"[{next(_ids)}:{_rng.random():.12f}]"
    while len(out) < n:
        out += " " + _rng.choice(words)
    return out[:n]


def client_headers(rid: str) -> dict[str, str]:
    """What a client of the balancer sends: the instances' own key, an id, a header of
    its own."""
    return {"Authorization": f"Bearer {INSTANCE_KEY}", "X-Request-Id": rid,
            "X-Client-Tag": f"tag-{rid}"}


def served(setup: Setup, rid: str) -> list[tuple[int, ReceivedRequest]]:
    """(instance index, record) of every instance that received the request ``rid``."""
    return [(i, r) for i, inst in enumerate(setup.cluster.instances)
            for r in inst.received_with("x-request-id", rid)]


def served_once(setup: Setup, rid: str, what: str) -> tuple[int, ReceivedRequest]:
    got = served(setup, rid)
    require(len(got) == 1, f"{what}: expected one instance to receive it, got "
                           f"{[(i, r.rank, r.status) for i, r in got]}")
    return got[0]


def check_client_headers(record: ReceivedRequest, rid: str, what: str) -> None:
    require(record.header("authorization") == f"Bearer {INSTANCE_KEY}",
            f"{what}: the instance got Authorization {record.header('authorization')!r}, "
            "not the client's")
    require(record.header("x-client-tag") == f"tag-{rid}",
            f"{what}: the client's own header did not reach the instance")


def post(setup: Setup, base: str, path: str, body: Any, headers: dict[str, str]
         ) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return setup.http.post(base + path, content=content,
                           headers={"Content-Type": "application/json", **headers})


def kvroute_probe(setup: Setup, question: dict[str, Any]) -> dict[str, Any]:
    """kvroute's answer to a question only (a probe: it leaves nothing behind)."""
    answer = setup.http.post(f"{setup.kv_url}/v1/route", json={**question, "probe": True},
                             headers={"Authorization": f"Bearer {API_TOKEN}"})
    require(answer.status_code == 200, f"kvroute: POST /v1/route -> {answer.status_code}: "
                                       f"{answer.text[:300]}")
    return answer.json()


def wait_until(condition: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def cached_tokens(response: httpx.Response) -> int:
    usage = response.json().get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# --- real kvroute -------------------------------------------------------------------------------


def _warm(setup: Setup, instance: int, rank: int, path: str, body: dict[str, Any]) -> None:
    """Send a request straight to one worker, so that its prefix cache holds the prompt."""
    headers = {"Authorization": f"Bearer {INSTANCE_KEY}", "X-data-parallel-rank": str(rank)}
    answer = post(setup, setup.cluster.instances[instance].url, path,
                  {**body, "max_tokens": 1}, headers)
    require(answer.status_code == 200, f"warming instance {instance} rank {rank}: "
                                       f"{answer.status_code} {answer.text[:200]}")


def _learnt(setup: Setup, question: dict[str, Any], instance: int, rank: int,
            at_least: int) -> None:
    """Until kvroute names (instance, rank) for the question with a match of ``at_least``."""

    def named() -> bool:
        answer = kvroute_probe(setup, question)
        return (answer.get("instance") == setup.ids[instance]
                and answer.get("dp_rank") == rank
                and int(answer.get("matched_tokens") or 0) >= at_least)

    wait_until(named, f"kvroute to learn that instance {instance} rank {rank} holds the "
                      "prompt", setup.timeout)


def check_routes_where_kvroute_says(setup: Setup, lb: Balancer) -> str:
    """Token ids, text and chat prompts land on the worker kvroute names, with its rank."""
    cluster = setup.cluster
    workers = [(i, r.rank) for i, inst in enumerate(cluster.instances) for r in inst.ranks]
    plans: list[tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any]]] = []
    for n, _worker in enumerate(workers):
        head = tokens(10 * BLOCK + 3)
        plans.append((f"token ids #{n}", "/v1/completions", {"model": MODEL, "prompt": head},
                      {"model": MODEL, "prompt": head + tokens(5)},
                      {"model": MODEL, "token_ids": head}))
    prose = text(12 * BLOCK)
    plans.append(("text", "/v1/completions", {"model": MODEL, "prompt": prose},
                  {"model": MODEL, "prompt": prose + " and a question"},
                  {"model": MODEL, "prompt": prose}))
    # An agent's chat: tools and template arguments change the prompt the engine renders
    # (the simulator's template, like a model's), so the glue must pass them on.
    chat = {"model": MODEL, "tools": [{"type": "function", "function": {"name": "where"}}],
            "chat_template_kwargs": {"brief": True},
            "messages": [{"role": "system", "content": text(10 * BLOCK)},
                         {"role": "user", "name": "ops", "content": "which instance holds this?"}]}
    plans.append(("chat", "/v1/chat/completions", chat, chat, chat))
    # A tenant's request: the engine caches it under its salt, and only a question with the
    # salt finds it, so the glue must pass `cache_salt` on.
    salted = tokens(10 * BLOCK + 3)
    plans.append(("salted", "/v1/completions",
                  {"model": MODEL, "prompt": salted, "cache_salt": "tenant-lb"},
                  {"model": MODEL, "prompt": salted + tokens(5), "cache_salt": "tenant-lb"},
                  {"model": MODEL, "token_ids": salted, "cache_salt": "tenant-lb"}))
    # every worker at least once, text, chat and the tenant on workers of their own
    targets = workers + [workers[1], workers[2], workers[-1]]
    lines = []
    for (what, path, warm, body, question), (instance, rank) in zip(plans, targets,
                                                                     strict=True):
        _warm(setup, instance, rank, path, warm)
        _learnt(setup, question, instance, rank, 8 * BLOCK)
        rid = new_id(lb.kind)
        answer = post(setup, lb.url, path, {**body, "max_tokens": 2}, client_headers(rid))
        require(answer.status_code == 200, f"{what}: {answer.status_code} {answer.text[:200]}")
        got_instance, record = served_once(setup, rid, what)
        require((got_instance, record.rank) == (instance, rank),
                f"{what}: kvroute named instance {instance} rank {rank}, the request was "
                f"served by instance {got_instance} rank {record.rank} (response headers "
                f"{dict(answer.headers)})")
        require(record.header("x-data-parallel-rank") == str(rank),
                f"{what}: X-data-parallel-rank {record.header('x-data-parallel-rank')!r}")
        require(answer.headers.get("x-kvroute-instance") == setup.ids[instance]
                and answer.headers.get("x-kvroute-dp-rank") == str(rank),
                f"{what}: response headers {dict(answer.headers)}")
        check_client_headers(record, rid, what)
        cached = cached_tokens(answer)
        require(cached >= 8 * BLOCK, f"{what}: only {cached} cached tokens on the worker "
                                     "that holds the prompt")
        lines.append(f"{what} -> instance {instance} rank {rank} ({cached} cached)")
    return f"{len(plans)} requests each on the worker kvroute named: " + "; ".join(lines[-3:])


def _stream(setup: Setup, base: str, path: str, body: dict[str, Any], rid: str
            ) -> tuple[httpx.Headers, list[tuple[float, str]]]:
    events: list[tuple[float, str]] = []
    headers = {"Content-Type": "application/json", **client_headers(rid)}
    with setup.http.stream("POST", base + path, content=json.dumps(body).encode(),
                           headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise CheckFailed(f"stream: {response.status_code} {response.text[:200]}")
        require(response.headers.get("content-type", "").startswith("text/event-stream"),
                f"stream: content-type {response.headers.get('content-type')!r}")
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append((time.monotonic(), line[5:].strip()))
        return response.headers, events


def check_streams(setup: Setup, lb: Balancer) -> str:
    """Streamed completions and chats come through event by event, as the instance paces
    them (a buffering balancer would deliver them all at once at the end)."""
    max_tokens = 10
    lines = []
    for what, path, body in (
        ("completion", "/v1/completions", {"model": MODEL, "prompt": tokens(3 * BLOCK)}),
        ("chat", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": text(3 * BLOCK)}]}),
    ):
        rid = new_id(lb.kind)
        headers, events = _stream(setup, lb.url, path,
                                  {**body, "max_tokens": max_tokens, "stream": True}, rid)
        require(events and events[-1][1] == "[DONE]", f"{what}: the stream did not end with "
                                                       f"[DONE]: {[e[1][:40] for e in events]}")
        require(len(events) >= max_tokens + 1, f"{what}: {len(events)} events")
        require(headers.get("x-kvroute-instance"), f"{what}: not routed ({dict(headers)})")
        _, record = served_once(setup, rid, what)
        check_client_headers(record, rid, what)
        # The instance sleeps STREAM_INTERVAL_S between two events. Delivered as sent, they
        # arrive about that far apart; held back (buffered, or merged into bigger writes)
        # they arrive in bursts, most of them right after another.
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(events)]
        apart = sum(gap >= 0.4 * STREAM_INTERVAL_S for gap in gaps)
        require(2 * apart >= len(gaps),
                f"{what}: only {apart} of {len(gaps)} events arrived on their own; gaps (ms) "
                f"{[round(1000 * gap) for gap in gaps]}, sent {STREAM_INTERVAL_S}s apart")
        span = events[-1][0] - events[0][0]
        lines.append(f"{what}: {len(events)} events over {span:.2f}s, {apart} of {len(gaps)} "
                     "gaps as sent")
    return "; ".join(lines)


ERROR_CASES: list[tuple[str, str, Any, bool]] = [
    # (what, path, body, with the instance key)
    ("not JSON", "/v1/completions", b"{this is not json", True),
    ("no prompt", "/v1/completions", {"model": MODEL, "max_tokens": 2}, True),
    ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "hello"}, True),
    ("token out of vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": [5, 6, 99_999_999]}, True),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 0},
     True),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, True),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, True),
    ("no credentials", "/v1/completions", {"model": MODEL, "prompt": "hello"}, False),
]


def check_instance_errors(setup: Setup, lb: Balancer) -> str:
    """A bad request comes back as the instance's own answer, status and body."""
    direct_base = setup.cluster.instances[0].url
    for what, path, body, keyed in ERROR_CASES:
        headers = {"Authorization": f"Bearer {INSTANCE_KEY}"} if keyed else {}
        direct = post(setup, direct_base, path, body, headers)
        via = post(setup, lb.url, path, body, headers)
        require(direct.status_code >= 400, f"{what}: the instance accepted it")
        require((via.status_code, via.content) == (direct.status_code, direct.content),
                f"{what}: through {lb.kind} {via.status_code} {via.text[:200]}; the "
                f"instance itself answers {direct.status_code} {direct.text[:200]}")
    return f"{len(ERROR_CASES)} bad requests answered exactly as the instance answers them"


def check_kvroute_stopped(setup: Setup, lb: Balancer) -> str:
    """With kvroute stopped, the upstream group serves every request (both instances)."""
    require(setup.kvroute_stopped, "kvroute is still running")
    by_instance: dict[int, int] = {}
    reasons = set()
    bodies = [("/v1/completions", {"model": MODEL, "prompt": tokens(2 * BLOCK)}),
              ("/v1/completions", {"model": MODEL, "prompt": text(40)}),
              ("/v1/chat/completions",
               {"model": MODEL, "messages": [{"role": "user", "content": text(30)}]})] * 2
    for path, body in bodies:
        rid = new_id(lb.kind)
        answer = post(setup, lb.url, path, {**body, "max_tokens": 2}, client_headers(rid))
        require(answer.status_code == 200, f"{path}: {answer.status_code} {answer.text[:200]}")
        require("x-kvroute-instance" not in answer.headers,
                f"routed with kvroute stopped? {dict(answer.headers)}")
        reasons.add(answer.headers.get("x-kvroute-fallback", "?"))
        instance, record = served_once(setup, rid, path)
        require(record.header("x-data-parallel-rank") is None,
                "a fallback request carried X-data-parallel-rank")
        check_client_headers(record, rid, path)
        by_instance[instance] = by_instance.get(instance, 0) + 1
    rid = new_id(lb.kind)
    _, events = _stream(setup, lb.url, "/v1/completions",
                        {"model": MODEL, "prompt": tokens(BLOCK), "max_tokens": 4,
                         "stream": True}, rid)
    require(events and events[-1][1] == "[DONE]", "a stream through the fallback did not end")
    require(len(by_instance) == len(setup.cluster.instances),
            f"the upstream group did not spread the requests: {by_instance}")
    return (f"{len(bodies) + 1} requests served, per instance {dict(sorted(by_instance.items()))}"
            f", fallback reason {sorted(reasons)}")


# --- the stand-in -------------------------------------------------------------------------------


def _via_fake(setup: Setup, lb: Balancer, reply: Reply, path: str, body: dict[str, Any]
              ) -> tuple[httpx.Response, str]:
    setup.fake.answer(reply)
    setup.fake.forget()
    rid = new_id(lb.kind)
    return post(setup, lb.url, path, {**body, "max_tokens": 2}, client_headers(rid)), rid


def check_question(setup: Setup, lb: Balancer) -> str:
    """What the glue asks: the prompt as token ids, text or messages (a batch by its first
    prompt), the model as given, never a probe, kvroute's token; and the request then goes
    to the URL and rank of the answer, with the client's headers."""
    toks, toks2 = tokens(40), tokens(20)
    messages = [{"role": "user", "content": "héllo \"quoted\" \\ and \u2028 more"}]
    cases: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
        ("token ids", "/v1/completions", {"model": MODEL, "prompt": toks},
         {"model": MODEL, "token_ids": toks}),
        ("text, model null", "/v1/completions", {"model": None, "prompt": "some \"text\"\n"},
         {"prompt": "some \"text\"\n"}),
        ("no model", "/v1/completions", {"prompt": toks2}, {"token_ids": toks2}),
        ("a tenant's salt", "/v1/completions",
         {"model": MODEL, "prompt": toks2, "cache_salt": "tenant \"q\""},
         {"model": MODEL, "token_ids": toks2, "cache_salt": "tenant \"q\""}),
        ("a batch of token lists", "/v1/completions", {"model": MODEL, "prompt": [toks, toks2]},
         {"model": MODEL, "token_ids": toks}),
        ("a batch of texts", "/v1/completions", {"model": MODEL, "prompt": ["first", "second"]},
         {"model": MODEL, "prompt": "first"}),
        ("chat", "/v1/chat/completions", {"model": MODEL, "messages": messages},
         {"model": MODEL, "messages": messages}),
        ("chat, template arguments", "/v1/chat/completions",
         {"model": MODEL, "messages": messages, "temperature": 0, "tools": [],
          "chat_template_kwargs": {"x": [1, {"y": None}]}, "add_generation_prompt": False,
          "continue_final_message": True, "add_special_tokens": False, "chat_template": None},
         {"model": MODEL, "messages": messages, "tools": [],
          "chat_template_kwargs": {"x": [1, {"y": None}]}, "add_generation_prompt": False,
          "continue_final_message": True, "add_special_tokens": False, "chat_template": None}),
    ]
    instance0 = setup.cluster.instances[0].url
    for what, path, body, expected in cases:
        answer, rid = _via_fake(setup, lb, Reply.choice(instance0, 1, "fake-0"), path, body)
        asked = setup.fake.asked()
        require(len(asked) == 1, f"{what}: kvroute was asked {len(asked)} times")
        question = asked[0].json()
        require(asked[0].path == "/v1/route", f"{what}: asked {asked[0].path}")
        require(question == expected, f"{what}: asked {question}, expected {expected}")
        require("probe" not in question, f"{what}: the question is a probe")
        require(asked[0].headers.get("authorization") == f"Bearer {API_TOKEN}",
                f"{what}: kvroute got Authorization {asked[0].headers.get('authorization')!r}")
        require(asked[0].headers.get("content-type", "").startswith("application/json"),
                f"{what}: content-type {asked[0].headers.get('content-type')!r}")
        instance, record = served_once(setup, rid, what)
        require((instance, record.header("x-data-parallel-rank")) == (0, "1"),
                f"{what}: answered instance 0 rank 1, got instance {instance} with rank header "
                f"{record.header('x-data-parallel-rank')!r}")
        if record.status == 200:  # the simulator has no batches: it refuses them itself
            require(record.rank == 1, f"{what}: ran on rank {record.rank}")
        require(answer.status_code == record.status,
                f"{what}: the client got {answer.status_code}, the instance answered "
                f"{record.status}")
        require(answer.headers.get("x-kvroute-instance") == "fake-0",
                f"{what}: response headers {dict(answer.headers)}")
        check_client_headers(record, rid, what)
    return f"{len(cases)} bodies asked as expected and sent to the answer's URL and rank"


def check_fallbacks(setup: Setup, lb: Balancer) -> str:
    """Every kind of unusable answer sends the request to the upstream group."""
    instance0 = setup.cluster.instances[0].url
    cases = [
        ("kvroute 503", Reply("json", 503, {"error": "no eligible worker", "field": None})),
        ("kvroute 404", Reply("json", 404, {"error": "unknown model", "field": "model"})),
        ("kvroute 401", Reply("json", 401, {"error": "missing token", "field": None})),
        ("not JSON", Reply("raw", 200, b"<html>surprise</html>")),
        ("no url", Reply("json", 200, {"instance": "x", "dp_rank": 0})),
        ("a url with a path", Reply.choice(instance0 + "/elsewhere", 0)),
        ("a negative rank", Reply.choice(instance0, -1)),
        ("a stall past the deadline", Reply("stall")),
        ("a closed connection", Reply("close")),
        ("an instance refusing connections", Reply.choice(setup.dead_url, 1, "dead")),
    ]
    body = {"model": MODEL, "prompt": tokens(2 * BLOCK)}
    reasons = []
    for what, reply in cases:
        answer, rid = _via_fake(setup, lb, reply, "/v1/completions", body)
        require(answer.status_code == 200, f"{what}: {answer.status_code} {answer.text[:200]}")
        instance, record = served_once(setup, rid, what)
        require(instance == 0, f"{what}: served by instance {instance}")
        reason = answer.headers.get("x-kvroute-fallback")
        require(reason and "x-kvroute-instance" not in answer.headers,
                f"{what}: not marked as a fallback: {dict(answer.headers)}")
        # HAProxy sets the rank header before its redispatch picks another server; with
        # instances of equal data-parallel size the rank exists there too (docs/load-balancers.md).
        redispatched = isinstance(reply.body, dict) and reply.body.get("instance") == "dead"
        if not (lb.kind == "haproxy" and redispatched):
            require(record.header("x-data-parallel-rank") is None,
                    f"{what}: the fallback request carried X-data-parallel-rank "
                    f"{record.header('x-data-parallel-rank')!r}")
        check_client_headers(record, rid, what)
        reasons.append(f"{what}: {reason}")
    setup.fake.answer(Reply.choice(instance0, 0))  # lets the stalled handler go
    return f"{len(cases)} kinds of answer, each served by the upstream group ({reasons[7]})"


def check_large_body(setup: Setup, lb: Balancer) -> str:
    """A body larger than the balancer keeps in memory for the glue (nginx: 1 MiB, HAProxy:
    its 128 KiB buffer) is forwarded whole to the upstream group without asking kvroute."""
    setup.fake.answer(Reply.choice(setup.cluster.instances[0].url, 1, "fake-0"))
    setup.fake.forget()
    # OpenAI's `user` field, which the instance ignores, makes the body large
    body = {"model": MODEL, "prompt": tokens(BLOCK), "max_tokens": 2, "user": "u" * 1_500_000}
    rid = new_id(lb.kind)
    answer = post(setup, lb.url, "/v1/completions", body, client_headers(rid))
    require(answer.status_code == 200, f"{answer.status_code} {answer.text[:200]}")
    require(not setup.fake.asked(), "kvroute was asked about a body the glue cannot hold")
    _, record = served_once(setup, rid, "a large body")
    require(record.header("x-data-parallel-rank") is None, "a rank header on a fallback")
    require(record.header("content-length") == str(len(json.dumps(body))),
            f"the instance got {record.header('content-length')} bytes")
    return f"1.5 MB body forwarded unrouted ({answer.headers.get('x-kvroute-fallback')})"


def check_accepted_then_lost(setup: Setup, lb: Balancer) -> str:
    """nginx: an instance that accepted the request and then hung up is not sent it again
    (generation is not idempotent): the client gets the 502."""
    setup.dying.answer(Reply("close"))
    setup.dying.forget()
    answer, rid = _via_fake(setup, lb, Reply.choice(setup.dying.url, 0, "dying"),
                            "/v1/completions", {"model": MODEL, "prompt": tokens(BLOCK)})
    require(answer.status_code == 502, f"expected a 502, got {answer.status_code}")
    require(len(setup.dying.asked()) == 1, f"the dying instance got "
                                           f"{len(setup.dying.asked())} requests")
    require(not served(setup, rid), "the request was sent again to the upstream group")
    return "502, sent once"


def plan(setup: Setup) -> Iterator[tuple[str, Callable[[], str]]]:
    """(name, check) in the order they run; kvroute is stopped before the last ones."""
    for kind, lb in setup.real.items():
        yield f"{kind}: routes where kvroute says", lambda lb=lb: \
            check_routes_where_kvroute_says(setup, lb)
        yield f"{kind}: streams event by event", lambda lb=lb: check_streams(setup, lb)
        yield f"{kind}: the instance's own errors", lambda lb=lb: \
            check_instance_errors(setup, lb)
    for kind, lb in setup.faked.items():
        yield f"{kind}: the question", lambda lb=lb: check_question(setup, lb)
        yield f"{kind}: fallbacks", lambda lb=lb: check_fallbacks(setup, lb)
        yield f"{kind}: a large body", lambda lb=lb: check_large_body(setup, lb)
        if kind == "nginx":
            yield f"{kind}: accepted, then lost", lambda lb=lb: \
                check_accepted_then_lost(setup, lb)
