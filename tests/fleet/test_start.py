"""A fleet past ZMQ's default socket limit (1,023 per context) starts, every worker goes
live, routes answer, and it all stops quickly; too few open files is one clear sentence."""

from __future__ import annotations

import resource
import time

import httpx
import pytest

from kvroute.app.cli import main
from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.fleet.limits import SOCKETS_PER_WORKER, raise_open_files
from kvroute.app.ingest.wire import BlockStored
from kvroute.app.server import BackgroundServer
from kvroute.sim.publisher import EventPublisher
from tests.support.waiting import HTTP_TIMEOUT, wait_for

RANKS = 8
INSTANCES = 66  # 528 workers: over 2,000 sockets, twice ZMQ's default limit
BLOCK = 16


def test_a_fleet_past_zmqs_default_socket_limit_starts_routes_and_stops():
    assert INSTANCES * RANKS * SOCKETS_PER_WORKER > 1023
    publishers = [EventPublisher(dp_rank=None).start() for _ in range(4)]
    try:
        instances = tuple(
            InstanceConfig(id=f"i{n:03d}", model="m", block_size=BLOCK,
                           events=(publishers[n % 4].endpoint,) * RANKS,
                           replay=(publishers[n % 4].replay_endpoint,) * RANKS)
            for n in range(INSTANCES))
        settings = Settings(host="127.0.0.1", port=0, log_level="warning",
                            placement_ttl=0.0, load_interval=0.0, instances=instances)
        raise_open_files(settings)  # what `kvroute serve` does first
        server = BackgroundServer(settings).start()
        try:
            with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
                def all_live() -> bool:
                    listed = http.get("/v1/instances").json()["instances"]
                    return len(listed) == INSTANCES and all(i["state"] == "live"
                                                            for i in listed)

                wait_for(all_live, "every worker of the fleet to go live", timeout=120)
                # One publisher's blocks: every worker following it holds them.
                tokens = list(range(1, 4 * BLOCK + 2))
                publishers[0].publish([BlockStored(
                    block_hashes=[101, 102, 103, 104], parent_block_hash=None,
                    token_ids=tokens[:4 * BLOCK], block_size=BLOCK)])

                def matched() -> dict | None:
                    body = http.post("/v1/route", json={"token_ids": tokens,
                                                         "probe": True}).json()
                    return body if body.get("matched_blocks") == 4 else None

                body = wait_for(matched, "the fleet to learn the blocks", timeout=60)
                assert body["eligible_workers"] == INSTANCES * RANKS
                assert len(body["scores"]) == 4
                assert int(body["instance"][1:]) % 4 == 0  # follows publisher 0
        finally:
            started = time.monotonic()
            server.stop()
            stopped_in = time.monotonic() - started
        # Not a speed goal (benchmarks/fleet_bench.py measures it): stopping one
        # subscriber after another took minutes at this size.
        assert stopped_in < 60
    finally:
        for pub in publishers:
            pub.close()


def test_too_few_open_files_for_the_fleet_is_one_line(tmp_path, capsys):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard open-file limit to exceed here")
    workers = hard // 4 + 1  # not even their live sides fit (4 files each)
    config = tmp_path / "fleet.toml"
    config.write_text(f"max_instances = {workers}\n" + "".join(
        f'[[instances]]\nid = "w{n}"\nevents = ["tcp://127.0.0.1:{5000 + n % 1000}"]\n'
        for n in range(workers)))
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"{workers} configured workers and 1024 client connections" in err
    assert f"may open {hard}" in err
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


def test_workers_past_the_sockets_kvroute_can_hold_are_refused_in_one_sentence():
    """Added through the API after start: refused before any socket is made, not failing
    inside their subscribers; what was followed goes on."""
    publishers = [EventPublisher(dp_rank=None).start() for _ in range(2)]
    try:
        # max_instances 2: the context keeps ZMQ's default of 1,023 sockets, half of them
        # for sockets closing: 85 workers.
        settings = Settings(host="127.0.0.1", port=0, log_level="warning", load_interval=0.0,
                            max_instances=2)
        server = BackgroundServer(settings).start()
        try:
            with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
                def register(name: str, ranks: int) -> httpx.Response:
                    return http.post("/v1/instances", json={
                        "id": name, "block_size": BLOCK,
                        "events": [publishers[r % 2].endpoint for r in range(ranks)],
                        "replay": [publishers[r % 2].replay_endpoint for r in range(ranks)]})

                assert register("a", 60).status_code == 201
                refused = register("b", 30)  # 90 workers' sockets: more than it keeps
                assert refused.status_code == 409, refused.text
                error = refused.json()["error"]
                assert "following 90 workers needs about 540 ZMQ sockets" in error
                assert "\n" not in error
                listed = http.get("/v1/instances").json()["instances"]
                assert [i["id"] for i in listed] == ["a"]
                wait_for(lambda: http.get("/v1/instances/a").json()["state"] == "live",
                         "the instance followed before to stay live", timeout=120)
        finally:
            server.stop()
    finally:
        for pub in publishers:
            pub.close()
