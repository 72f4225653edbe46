"""The service end to end: real HTTP to kvroute, real ZMQ from simulated vLLM instances."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.routing.cost import CostWeights, TieBreaker, WorkerView, best_of, score_workers
from kvroute.app.server import BackgroundServer
from kvroute.app.workers import COUNTERS
from kvroute.sim.cluster import SimCluster
from kvroute.sim.instance import SimInstance
from kvroute.sim.spec import SimInstanceSpec
from tests.support.tokens import unique_tokens
from tests.support.waiting import HTTP_TIMEOUT, wait_for

BLOCK = 16




@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    with SimCluster(n=2, block_size=BLOCK, num_blocks=64, model="sim-model") as sim:
        yield sim


def start_service(**overrides: object) -> BackgroundServer:
    """kvroute on a free port. These tests ask /v1/route without sending the prompt
    anywhere, and placement guesses assume every answer is followed: they are off unless
    a test turns them on (the burst test does)."""
    settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                        **{"placement_ttl": 0.0, **overrides})
    return BackgroundServer(settings).start()


@pytest.fixture
def service() -> Iterator[BackgroundServer]:
    server = start_service(max_prompt_tokens=4096, max_body_bytes=256 * 1024)
    yield server
    server.stop()


@pytest.fixture
def client(service: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=HTTP_TIMEOUT) as http:
        yield http


def register(client: httpx.Client, url: str, **extra: object) -> dict:
    answer = client.post("/v1/instances", json={"url": url, **extra})
    assert answer.status_code == 201, answer.text
    instance = answer.json()
    wait_for(lambda: client.get(f"/v1/instances/{instance['id']}").json()["state"] == "live",
             f"{instance['id']} to go live")
    return instance


def complete(url: str, tokens: list[int]) -> dict:
    answer = httpx.post(f"{url}/v1/completions",
                        json={"model": "sim-model", "prompt": tokens, "max_tokens": 1},
                        timeout=HTTP_TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def route(client: httpx.Client, **body: object) -> httpx.Response:
    """Ask what kvroute would do, as a probe: these tests do not send the prompts."""
    return client.post("/v1/route", json={"probe": True, **body})


def route_until(client: httpx.Client, matched_tokens: int, what: str, **body: object) -> dict:
    """Route `body` until the best answer matches `matched_tokens` (events are asynchronous)."""

    def check() -> dict | None:
        answer = route(client, **body).json()
        return answer if answer.get("matched_tokens") == matched_tokens else None

    return wait_for(check, what)


def test_register_route_and_delete(cluster: SimCluster, client: httpx.Client):
    a = register(client, cluster.urls[0])
    b = register(client, cluster.urls[1])
    assert {i["id"] for i in client.get("/v1/instances").json()["instances"]} == {a["id"],
                                                                                 b["id"]}
    assert a["models"] == ["sim-model"] and a["block_size"] == BLOCK

    prompt = unique_tokens(1, 3 * BLOCK + 5)
    complete(cluster.urls[1], prompt)
    answer = route_until(client, 3 * BLOCK, "kvroute to learn the prompt from B's events",
                         token_ids=prompt)
    assert answer["instance"] == b["id"] and answer["url"] == cluster.urls[1]
    assert answer["matched_blocks"] == 3 and answer["prompt_tokens"] == len(prompt)
    scores = {s["instance"]: s for s in answer["scores"]}
    assert scores[b["id"]]["by_medium"]["GPU"] == 3 and scores[b["id"]]["block_size"] == BLOCK
    assert scores[a["id"]]["matched_tokens"] == 0

    detail = client.get(f"/v1/instances/{b['id']}").json()
    assert detail["workers"][0]["holdings"]["GPU"] >= 3
    assert detail["workers"][0]["state"] == "live"

    # The same blocks asked for by vLLM block hashes (B's own hash values).
    hashes = cluster.engines[1].block_hashes(prompt)
    by_hash = route(client, block_hashes=[h if isinstance(h, int) else h.hex() for h in hashes])
    assert by_hash.status_code == 200, by_hash.text
    assert by_hash.json()["instance"] == b["id"] and by_hash.json()["matched_blocks"] == 3

    assert client.delete(f"/v1/instances/{b['id']}").json() == {"deleted": b["id"]}
    after = route(client, token_ids=prompt).json()
    assert after["instance"] == a["id"] and after["matched_tokens"] == 0
    assert [s["instance"] for s in after["scores"]] == [a["id"]]
    assert client.get(f"/v1/instances/{b['id']}").status_code == 404


def test_cold_prefixes_spread_and_candidates_limit(cluster: SimCluster, client: httpx.Client):
    a, b = (register(client, url) for url in cluster.urls)
    # Prompts nobody holds tie; each first block picks its worker by rendezvous hashing, so
    # different prompts spread over the tied workers (40 prompts on one of two workers:
    # odds 2**-39) and a repeated one is answered alike.
    answers = [route(client, token_ids=unique_tokens(99 + i, 2 * BLOCK)).json()["instance"]
               for i in range(40)]
    assert set(answers) == {a["id"], b["id"]}
    again = route(client, token_ids=unique_tokens(99, 2 * BLOCK)).json()["instance"]
    assert again == answers[0]
    cold = unique_tokens(99, 2 * BLOCK)

    only_a = route(client, token_ids=cold, candidates=[a["id"]]).json()
    assert only_a["instance"] == a["id"] and len(only_a["scores"]) == 1
    # Naming an instance kvroute does not know is a 404, as for a model nobody serves.
    unknown = route(client, token_ids=cold, candidates=[a["id"], "nope", "zz"])
    assert unknown.status_code == 404
    assert unknown.json()["field"] == "candidates" and unknown.json()["unknown"] == ["nope", "zz"]


def test_model_filter(cluster: SimCluster, client: httpx.Client):
    a = register(client, cluster.urls[0])
    other = SimInstance(SimInstanceSpec(model="other-model", block_size=BLOCK, num_blocks=64))
    with other:
        register(client, other.url, id="other")
        tokens = unique_tokens(5, BLOCK)
        assert route(client, token_ids=tokens, model="sim-model").json()["instance"] == a["id"]
        assert route(client, token_ids=tokens, model="other-model").json()["instance"] == (
            "other")
        missing = route(client, token_ids=tokens, model="absent")
        assert missing.status_code == 404 and "absent" in missing.json()["error"]
        assert missing.json()["field"] == "model"


def test_no_workers_is_503(client: httpx.Client):
    answer = route(client, token_ids=[1, 2, 3])
    assert answer.status_code == 503
    assert answer.json()["error"].startswith("no eligible worker")


def test_integral_numbers_are_integers_as_json_schema_says(cluster, client):
    """3.0 is an integer to JSON Schema, so the document allows it as a token id or hash;
    msgspec refused it (found by schemathesis: a schema-valid request answered 422)."""
    register(client, cluster.urls[0])
    by_float = route(client, token_ids=[1.0, 2e0, 3])
    assert by_float.status_code == 200, by_float.text
    assert by_float.json()["prompt_tokens"] == 3
    assert route(client, block_hashes=["8", 57235.0, 18446744073709551615]).status_code == 200
    fraction = route(client, token_ids=[1, 2.5])
    assert fraction.status_code == 422 and fraction.json()["field"] == "token_ids[1]"
    registered = client.post("/v1/instances", json={"url": cluster.urls[0], "id": "f",
                                                    "block_size": 16.0})
    assert registered.status_code == 201 and registered.json()["block_size"] == 16


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"{not json", 400, None),
        (b'{"token_ids": [1, 2.5]}', 422, "token_ids[1]"),
        (b'{"token_ids": [1, true]}', 422, "token_ids[1]"),
        (b'{"token_ids": [-1]}', 422, "token_ids[0]"),
        (b'{"token_ids": [4294967296]}', 422, "token_ids[0]"),
        (b'{"token_ids": "1 2 3"}', 422, "token_ids"),
        (b'{"tokens": [1]}', 422, "tokens"),
        (b"{}", 422, "token_ids"),
        (b'{"token_ids": [1], "prompt": "x"}', 422, "prompt"),
        (b'{"block_hashes": ["xyz"]}', 422, "block_hashes[0]"),
        (b'{"block_hashes": [1.5]}', 422, "block_hashes[0]"),
        (b'{"prompt": "hello"}', 422, "prompt"),
        (b'{"messages": [{"content": "hi"}]}', 422, "messages[0].role"),
        (b'{"messages": [{"role": 1}]}', 422, "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 422, "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": [5]}]}', 422, "messages[0].content[0]"),
        (b'{"messages": ["hi"]}', 422, "messages[0]"),
        (b'{"token_ids": [1], "candidates": "a"}', 422, "candidates"),
        (b'{"token_ids": [1], "lora_name": 3}', 422, "lora_name"),
        (b'[1, 2]', 422, None),
        # What the OpenAPI document's patterns forbid, the service refuses too: a hex hash
        # with padding or a final newline (Python's `$` would let that one through).
        (b'{"block_hashes": [" 0xab"]}', 422, "block_hashes[0]"),
        (b'{"block_hashes": ["ab\\n"]}', 422, "block_hashes[0]"),
        (b'{"block_hashes": ["0x"]}', 422, "block_hashes[0]"),
        (b'{"block_hashes": [18446744073709551616]}', 422, "block_hashes[0]"),
        (b'{"messages": []}', 422, "messages"),
        (b'{"token_ids": [1], "candidates": ["a/b"]}', 404, "candidates"),
    ],
)
def test_bad_route_requests_name_the_field(cluster, client, body, status, field):
    register(client, cluster.urls[0])
    answer = client.post("/v1/route", content=body,
                         headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field
    assert answer.json()["error"]


def test_size_limits(cluster: SimCluster, client: httpx.Client):
    register(client, cluster.urls[0])
    # A list longer than the schema's maxItems is refused like any value it forbids (422);
    # 413 is for sizes a schema cannot state, such as the body's bytes.
    too_many = route(client, token_ids=list(range(4097)))
    assert too_many.status_code == 422 and too_many.json()["field"] == "token_ids"
    assert "4096" in too_many.json()["error"]
    huge = client.post("/v1/route", content=b"[" + b"1," * 200_000 + b"1]",
                       headers={"content-type": "application/json"})
    assert huge.status_code == 413


def test_instance_api_errors(cluster: SimCluster, client: httpx.Client, dead_url: str):
    assert client.post("/v1/instances", json={"url": "ftp://x"}).json()["field"] == "url"
    assert client.post("/v1/instances", json={}).status_code == 422
    assert client.post("/v1/instances", content=b"nope",
                       headers={"content-type": "application/json"}).status_code == 400
    # A form or text/plain body is what a browser may send cross-site without asking.
    for media_type in ("text/plain", "application/x-www-form-urlencoded", None):
        plain = client.post("/v1/instances", content=b'{"url": "http://127.0.0.1:1"}',
                            headers={"content-type": media_type} if media_type else {})
        assert plain.status_code == 415 and plain.json()["field"] == "content-type"
    dead = client.post("/v1/instances", json={"url": dead_url})
    assert dead.status_code == 502 and dead.json()["field"] == "url"
    register(client, cluster.urls[0])
    duplicate = client.post("/v1/instances", json={"url": cluster.urls[0]})
    assert duplicate.status_code == 409
    assert client.get("/v1/instances/missing").status_code == 404
    assert client.delete("/v1/instances/missing").status_code == 404


def test_text_prompts_through_the_instance_tokenizer(cluster: SimCluster):
    server = start_service(tokenizer="instance")
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            a = register(client, cluster.urls[0])
            text = "the quick brown fox " * 40
            tokens = httpx.post(f"{cluster.urls[0]}/tokenize", json={"prompt": text}).json()
            complete(cluster.urls[0], tokens["tokens"])
            full = (len(tokens["tokens"]) - 1) // BLOCK * BLOCK
            answer = route_until(client, full, "text prompt to match", prompt=text)
            assert answer["instance"] == a["id"]
            assert answer["prompt_tokens"] == len(tokens["tokens"])
    finally:
        server.stop()


def test_text_without_an_instance_url_to_tokenize_with_is_a_conflict(cluster: SimCluster):
    """Candidates registered with event endpoints only cannot tokenize a prompt: a 409 that
    says what would work, not a 503 inviting a retry that cannot help (found by
    schemathesis)."""
    server = start_service(tokenizer="instance")
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            (source,) = cluster.instances[0].kv_event_sources()
            bare = client.post("/v1/instances", json={
                "id": "bare", "events": [source["endpoint"]],
                "replay": [source["replay_endpoint"]], "model": "sim-model"})
            assert bare.status_code == 201, bare.text
            wait_for(lambda: client.get("/v1/instances/bare").json()["state"] == "live",
                     "the instance to go live")
            answer = route(client, prompt="hello", candidates=["bare"])
            assert answer.status_code == 409, answer.text
            assert "url" in answer.json()["error"] and "token_ids" in answer.json()["error"]
            assert route(client, token_ids=[1, 2, 3], candidates=["bare"]).status_code == 200
    finally:
        server.stop()


def test_chat_messages_are_checked_before_tokenizing(cluster: SimCluster):
    """A content part's text must be text, and the messages' text together is within
    max_prompt_chars (the one size rule a schema cannot state: a sum)."""
    server = start_service(tokenizer="instance", max_prompt_chars=100)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            register(client, cluster.urls[0])
            parts = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                   {"type": "text", "text": 5}]}]
            bad = route(client, messages=parts)
            assert bad.status_code == 422 and bad.json()["field"] == "messages[0].content[1].text"
            parts[0]["content"][1]["text"] = "x" * 60
            assert route(client, messages=parts).status_code == 200
            long_chat = route(client, messages=[{"role": "user", "content": "x" * 60},
                                                *parts])
            assert long_chat.status_code == 413 and long_chat.json()["field"] == "messages"
            assert "122 characters" in long_chat.json()["error"]
            too_long = route(client, prompt="x" * 101)
            assert too_long.status_code == 422 and too_long.json()["field"] == "prompt"
    finally:
        server.stop()


def test_text_prompts_through_a_local_tokenizer(tmp_path, cluster: SimCluster):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(100)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    server = start_service(tokenizer=str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            a = register(client, cluster.urls[0])
            words = [f"w{(i * 37) % 100}" for i in range(3 * BLOCK + 1)]
            ids = [vocab[w] for w in words]
            complete(cluster.urls[0], ids)
            answer = route_until(client, 3 * BLOCK, "local tokens", prompt=" ".join(words))
            assert answer["instance"] == a["id"] and answer["prompt_tokens"] == 3 * BLOCK + 1
            chat = route(client, messages=[{"role": "user", "content": "w1"}])
            assert chat.status_code in (400, 422) and chat.json()["field"] == "messages"
    finally:
        server.stop()


def test_metrics_expose_counters(cluster: SimCluster, client: httpx.Client):
    a = register(client, cluster.urls[0])
    complete(cluster.urls[0], unique_tokens(7, 2 * BLOCK + 1))
    route_until(client, 2 * BLOCK, "events to arrive", token_ids=unique_tokens(7, 2 * BLOCK + 1))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
    }
    worker = (("dp_rank", "0"), ("instance", a["id"]))
    # Every counter a subscriber keeps, including the names dashboards already use.
    names = [f"{name}_total" for name, _ in COUNTERS.values()]
    assert {"kvroute_events_total", "kvroute_sequence_gaps_total", "kvroute_replays_total",
            "kvroute_malformed_frames_total", "kvroute_degraded_total",
            "kvroute_engine_restarts_total", "kvroute_duplicate_batches_total",
            "kvroute_disconnects_total", "kvroute_rank_mismatches_total"} <= set(names)
    for name in names:
        assert (name, worker) in samples, name
    assert samples[("kvroute_events_total", worker)] >= 1
    assert samples[("kvroute_blocks_total", worker)] >= 2
    assert samples[("kvroute_worker_state", (*worker, ("state", "live")))] == 1.0
    assert samples[("kvroute_worker_holdings", (("dp_rank", "0"), ("instance", a["id"]),
                                                 ("medium", "GPU")))] >= 2
    assert samples[("kvroute_route_latency_seconds_count", (("input", "token_ids"),))] >= 1
    assert samples[("kvroute_route_body_seconds_count", ())] == samples[
        ("kvroute_route_latency_seconds_count", (("input", "token_ids"),))]
    assert samples[("kvroute_route_match_ratio_count", ())] >= 1
    assert samples[("kvroute_instances", ())] == 1


def test_readiness_waits_for_configured_workers(cluster: SimCluster):
    server = start_service(instances=(InstanceConfig(url=cluster.urls[0]),),
                           ready_grace_seconds=600)
    try:
        ready = wait_for(lambda: (r := httpx.get(f"{server.url}/readyz")).status_code == 200
                         and r.json(), "readiness")
        assert ready["reason"] == "all configured workers are live"
        assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    finally:
        server.stop()


def test_readiness_grace_for_unreachable_instance(dead_url: str):
    server = start_service(instances=(InstanceConfig(url=dead_url),), ready_grace_seconds=1.0)
    try:
        first = httpx.get(f"{server.url}/readyz")
        assert first.status_code == 503 and "discovering" in first.json()["reason"]
        later = wait_for(lambda: (r := httpx.get(f"{server.url}/readyz")).status_code == 200
                         and r.json(), "grace period")
        assert "grace period over" in later["reason"]
        listed = httpx.get(f"{server.url}/v1/instances").json()["instances"]
        assert listed[0]["state"] == "discovering" and "discovery_error" in listed[0]
    finally:
        server.stop()


def test_prompt_ending_on_a_block_boundary_matches_what_vllm_reuses(cluster, client):
    """vLLM recomputes a prompt's last token, so a prompt of exactly k full blocks reuses
    k - 1 of them; kvroute's matched_tokens must say the same as vLLM's cached_tokens."""
    register(client, cluster.urls[0])
    prompt = unique_tokens(11, 3 * BLOCK)
    complete(cluster.urls[0], prompt)
    answer = route_until(client, 2 * BLOCK, "the boundary prompt", token_ids=prompt)
    again = complete(cluster.urls[0], prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["matched_tokens"]


def test_data_parallel_ranks_are_separate_workers():
    with SimCluster(n=1, block_size=BLOCK, num_blocks=64, dp_size=2) as sim:
        server = start_service()
        try:
            with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
                instance = register(client, sim.urls[0])
                assert instance["dp_size"] == 2
                prompt = unique_tokens(21, 2 * BLOCK + 3)
                sim.complete(0, prompt, dp_rank=1)
                answer = route_until(client, 2 * BLOCK, "rank 1 to hold the prompt",
                                     token_ids=prompt)
                assert (answer["instance"], answer["dp_rank"]) == (instance["id"], 1)
                ranks = {s["dp_rank"]: s["matched_tokens"] for s in answer["scores"]}
                assert ranks == {1: 2 * BLOCK, 0: 0}
        finally:
            server.stop()


def test_new_sessions_go_where_less_was_sent_lately(cluster: SimCluster):
    """Six chat sessions whose openings the rendezvous hash alone would all send to the
    same worker (each a tie on an idle fleet): the recent demand each worker was sent breaks
    the ties first, so both get sessions, each answer shows it, and a session's next turn
    stays where its first one is cached."""
    server = start_service(load_interval=0.0)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            ids = [register(client, url)["id"] for url in cluster.urls]
            idle = score_workers([WorkerView(key=(i, 0), block_size=BLOCK, state="live")
                                  for i in ids], {}, CostWeights(), prompt_tokens=100)
            openings = [unique_tokens(7000 + seed, 3 * BLOCK + 5) for seed in range(80)]
            sessions = [p for p in openings
                        if best_of(idle, TieBreaker(tokens=p)).instance == ids[0]][:6]
            assert len(sessions) == 6
            chosen = []
            for opening in sessions:
                answer = client.post("/v1/route", json={"token_ids": opening}).json()
                demand = {s["instance"]: s["load"]["recent_demand"] for s in answer["scores"]}
                assert demand[answer["instance"]] <= min(demand.values()) + len(opening)
                chosen.append(answer["instance"])
                cluster.complete(ids.index(answer["instance"]), opening)
                route_until(client, 3 * BLOCK, "the opening to be cached", token_ids=opening)
            counts = Counter(chosen)
            assert set(counts) == set(ids) and abs(counts[ids[0]] - counts[ids[1]]) <= 2
            for opening, holder in zip(sessions, chosen, strict=True):
                turn = opening + unique_tokens(8000 + len(opening), 40)
                answer = client.post("/v1/route", json={"token_ids": turn}).json()
                assert answer["instance"] == holder and answer["matched_tokens"] == 3 * BLOCK
    finally:
        server.stop()


@pytest.mark.parametrize("ttl", [2.0, 0.0])
def test_a_burst_with_a_new_prefix_follows_the_first_answer(cluster: SimCluster, ttl: float):
    """With placement on, 50 concurrent requests sharing a prefix nobody holds yet go to
    one worker, and every answer after the first counts the prefix as held there ("that
    worker will hold it"). With it off they see a tie each time, which the rendezvous
    hash of their common first block breaks alike: one worker too, but none matched."""
    import asyncio

    server = start_service(placement_ttl=ttl, load_interval=0.0)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            ids = {register(client, url)["id"] for url in cluster.urls}
        prefix = unique_tokens(500 + int(ttl), 8 * BLOCK)

        async def burst() -> list[dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
                answers = await asyncio.gather(*(
                    http.post("/v1/route", json={"token_ids": prefix + [7, 8, 9, i]})
                    for i in range(50)))
            return [answer.json() for answer in answers]

        answers = asyncio.run(burst())
        chosen = {answer["instance"] for answer in answers}
        assert len(chosen) == 1 and chosen <= ids
        if ttl:
            later = [a for a in answers if a["matched_tokens"]]
            assert len(later) == 49  # all but the first saw the guess
            assert all(a["scores"][0]["pending_blocks"] == 8 for a in later)
        else:
            assert all(a["matched_tokens"] == 0 for a in answers)
    finally:
        server.stop()


def test_text_prompts_survive_an_instance_whose_http_server_is_gone(cluster: SimCluster,
                                                                   dead_url: str):
    """Its events still flow (it stays eligible), but its /tokenize is unreachable: the next
    instance tokenizes instead of the request failing."""
    from kvroute.sim.publisher import EventPublisher

    server = start_service(tokenizer="instance")
    try:
        with EventPublisher() as ghost_events, httpx.Client(base_url=server.url,
                                                           timeout=HTTP_TIMEOUT) as client:
            ghost = client.post("/v1/instances", json={
                "id": "ghost", "url": dead_url, "model": "sim-model",
                "events": [ghost_events.endpoint], "replay": [ghost_events.replay_endpoint]})
            assert ghost.status_code == 201, ghost.text
            wait_for(lambda: client.get("/v1/instances/ghost").json()["state"] == "live",
                     "the ghost's events to go live")
            register(client, cluster.urls[0])
            answer = route(client, prompt="hello there")
            assert answer.status_code == 200, answer.text
            assert answer.json()["prompt_tokens"] == len(httpx.post(
                f"{cluster.urls[0]}/tokenize", json={"prompt": "hello there"}).json()["tokens"])
    finally:
        server.stop()


def test_a_model_naming_a_lora_adapter_matches_that_adapters_blocks():
    """vLLM lists an adapter as a model with a parent and caches its blocks under the
    adapter's name; a request for that model must match those blocks, not the base's."""
    import json

    from kvroute.app.ingest.wire import BlockStored
    from kvroute.sim.publisher import EventPublisher
    from tests.support.canned_http import canned_http

    with EventPublisher() as events:
        host, port = events.endpoint.removeprefix("tcp://").rsplit(":", 1)
        replay_port = events.replay_endpoint.rsplit(":", 1)[1]
        routes = {
            "/kv_event_sources": (200, json.dumps({"0": {
                "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
                "topic": "kv-events"}})),
            "/v1/models": (200, json.dumps({"object": "list", "data": [
                {"id": "base", "parent": None}, {"id": "sql-lora", "parent": "base"}]})),
            "/metrics": (200, 'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n'),
        }
        tokens = unique_tokens(77, 2 * BLOCK)
        events.publish([BlockStored(block_hashes=[1, 2], token_ids=tokens, block_size=16,
                                    lora_name="sql-lora")])
        with canned_http(routes) as url:
            server = start_service()
            try:
                with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
                    register(client, url)
                    prompt = tokens + [5]
                    adapter = route_until(client, 2 * BLOCK, "the adapter's blocks",
                                          token_ids=prompt, model="sql-lora")
                    assert adapter["matched_blocks"] == 2
                    assert route(client, token_ids=prompt, model="base").json()[
                        "matched_tokens"] == 0
                    assert route(client, token_ids=prompt, model="base",
                                 lora_name="sql-lora").json()["matched_tokens"] == 2 * BLOCK
            finally:
                server.stop()


def test_a_followed_answer_counts_as_load_until_the_instances_metrics_do_and_a_probe_never(
        cluster: SimCluster):
    """Route mode: the caller sends the request where the answer said, before the instance's
    /metrics can show it, so kvroute counts its own answer meanwhile. A probe is not sent:
    it leaves neither a placement guess nor load."""
    server = start_service(placement_ttl=30.0, load_interval=0.2)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            for url in cluster.urls:
                register(client, url)
            prompt = unique_tokens(900, 4 * BLOCK + 1)
            route(client, token_ids=prompt)  # a probe
            probed = route(client, token_ids=prompt).json()
            assert probed["matched_tokens"] == 0
            assert all(s["load"]["answered"] == 0 for s in probed["scores"])

            followed = client.post("/v1/route", json={"token_ids": prompt}).json()
            after = route(client, token_ids=prompt).json()
            chosen = next(s for s in after["scores"] if s["instance"] == followed["instance"])
            assert chosen["load"]["answered"] == 1 and chosen["pending_blocks"] == 4
            # Its prefill is being computed for this very prefix: not held against it.
            assert chosen["load"]["queued_prefill"] == len(prompt)
            assert chosen["queued_prefill_tokens"] == 1
            assert after["instance"] == followed["instance"]
            # Nothing was sent, so the instance's next reading shows nothing: the answer
            # stops counting once a reading taken after it arrives.
            wait_for(lambda: all(s["load"]["answered"] == 0 for s in
                                 route(client, token_ids=prompt).json()["scores"]),
                     "the answer to stop counting once the instance's metrics are read")
    finally:
        server.stop()


def test_a_guess_gives_way_to_the_store_it_foretold_and_its_eviction_shows(
        cluster: SimCluster):
    """A route for real leaves a guess on the chosen instance: its blocks pending. Once the
    instance computes the prompt, its live batches (applied in runs, guess or not) hold
    those blocks and confirm the guess; so when the instance later evicts them, the route
    shows them gone at once, not still pending until the guess's 600 s run out."""
    server = start_service(placement_ttl=600.0)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            for url in cluster.urls:
                register(client, url)
            prompt = unique_tokens(902, 4 * BLOCK + 1)
            followed = client.post("/v1/route", json={"token_ids": prompt}).json()

            def chosen() -> dict:
                scores = route(client, token_ids=prompt, all_scores=True).json()["scores"]
                return next(s for s in scores if s["instance"] == followed["instance"])

            assert chosen()["pending_blocks"] == 4 and chosen()["by_medium"]["GPU"] == 0
            complete(followed["url"], prompt)
            wait_for(lambda: chosen()["by_medium"]["GPU"] == 4, "the instance's store")
            assert chosen()["pending_blocks"] == 0
            # Other prompts fill the instance's 64 blocks: it evicts the prompt's.
            for n in range(5):
                complete(followed["url"], unique_tokens(903 + n, 16 * BLOCK + 1))
            gone = wait_for(lambda: (lambda s: s if s["matched_blocks"] == 0 else None)(
                chosen()), "the prompt's blocks to be evicted")
            assert gone["pending_blocks"] == 0 and gone["by_medium"]["GPU"] == 0
    finally:
        server.stop()


def test_an_idle_instances_leftover_gauges_do_not_count_as_load(cluster: SimCluster):
    """vLLM's running/waiting gauges keep the last step's counts while the engine idles
    (the simulator reports them the same way); its token counters stop moving. Once they
    have not moved for two scrape intervals, kvroute reads the instance as idle."""
    server = start_service(load_interval=0.1)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            instance = register(client, cluster.urls[1])
            complete(cluster.urls[1], unique_tokens(950, 2 * BLOCK))
            metrics = httpx.get(f"{cluster.urls[1]}/metrics", timeout=HTTP_TIMEOUT).text
            assert 'vllm:num_requests_running{engine="0",model_name="sim-model"} 1.0' in metrics

            def running() -> float | None:
                scores = route(client, token_ids=[1, 2, 3]).json()["scores"]
                return next(s["load"]["running"] for s in scores
                            if s["instance"] == instance["id"])

            wait_for(lambda: running() == 0.0, "the idle instance to read as idle",
                     detail=running)
            assert httpx.get(f"{cluster.urls[1]}/metrics", timeout=HTTP_TIMEOUT).text.count(
                'vllm:num_requests_running{engine="0",model_name="sim-model"} 1.0') == 1
    finally:
        server.stop()


def test_an_idle_instances_leftover_kv_usage_does_not_overload_it(cluster: SimCluster):
    """The KV-usage gauge is a leftover too: it counts the blocks of the requests of the
    last step. At the overload limit it made the idle worker skipped for good (nothing
    was sent to it, so no step ever renewed the gauge)."""
    server = start_service(load_interval=0.1, overload_kv_usage=0.01)
    try:
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as client:
            instance = register(client, cluster.urls[1])
            complete(cluster.urls[1], unique_tokens(951, 2 * BLOCK))
            metrics = httpx.get(f"{cluster.urls[1]}/metrics", timeout=HTTP_TIMEOUT).text
            usage = next(line for line in metrics.splitlines()
                         if line.startswith("vllm:kv_cache_usage_perc{"))
            assert float(usage.split()[-1]) >= 0.01, usage

            def reading() -> dict[str, object]:
                scores = route(client, token_ids=[1, 2, 3]).json()["scores"]
                return next(s for s in scores if s["instance"] == instance["id"])

            wait_for(lambda: reading()["load"]["kv_usage"] == 0.0 and not reading()["overloaded"],
                     "the idle instance's leftover KV usage to stop overloading it",
                     detail=reading)
            assert httpx.get(f"{cluster.urls[1]}/metrics", timeout=HTTP_TIMEOUT).text.count(
                usage) == 1
    finally:
        server.stop()


def test_a_worker_that_is_not_live_is_never_chosen(cluster: SimCluster, client: httpx.Client):
    """A registration whose event stream never connects (a fake one, or an engine that is
    not up yet) holds nothing kvroute knows of and must not take traffic."""
    from tests.support.waiting import refusing_ports

    with refusing_ports(1) as (port,):
        ghost = client.post("/v1/instances", json={
            "id": "ghost", "events": [f"tcp://127.0.0.1:{port}"], "model": "sim-model",
            "block_size": BLOCK})
        assert ghost.status_code == 201, ghost.text
        assert client.get("/v1/instances/ghost").json()["state"] != "live"
        alone = route(client, token_ids=list(range(64)), candidates=["ghost"])
        assert alone.status_code == 503 and "no live worker" in alone.json()["error"]
        live = register(client, cluster.urls[0])["id"]
        for seed in range(20):
            answer = route(client, token_ids=unique_tokens(seed, 64))
            assert answer.status_code == 200 and answer.json()["instance"] == live
            assert "ghost" not in {s["instance"] for s in answer.json()["scores"]}
        assert client.get("/v1/instances/ghost").json()["state"] != "live"


def test_an_empty_candidate_list_is_refused_not_a_503(cluster: SimCluster, client: httpx.Client):
    register(client, cluster.urls[0])
    answer = route(client, token_ids=[1, 2, 3], candidates=[])
    assert answer.status_code == 422 and answer.json()["field"] == "candidates"
