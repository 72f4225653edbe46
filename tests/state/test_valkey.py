"""app.state.valkey against a real redis-server (never mocked): the saved-state store, and the
messages replicas share (`Peers`) on their own. tests/state/test_replicas.py runs whole replicas.

The server listens on a unix socket (TCP off: no port to race for) and, at least once for
the store and once for Peers, on a loopback TCP port; once over TLS. Nothing here asserts
speed: every wait polls a condition under a scaled deadline.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import redis.asyncio as aredis

from kvroute.app.state.store import StateStoreError
from kvroute.app.state.valkey import PeerLoad, Peers, ValkeyStore, redacted
from kvroute.index import PrefixIndex
from tests.support.paths import REPO
from tests.support.redis_server import RedisServer, running, start_on_a_free_port
from tests.support.tokens import unique_tokens
from tests.support.waiting import refusing_ports, run_async, wait_until

BLOCK = 16


@pytest.fixture
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """redis-server on a unix socket (in a short directory: the path must fit ~100 bytes)."""
    yield from running(RedisServer(tmp_path_factory.mktemp("valkey")))


@pytest.fixture
def valkey_tcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_on_a_free_port(tmp_path_factory.mktemp("valkey-tcp"))
    try:
        yield server
    finally:
        server.stop()


# -- the saved-state store -------------------------------------------------

def test_the_store_reads_what_it_wrote_and_nothing_before(valkey: RedisServer):
    async def scenario() -> None:
        store = ValkeyStore(valkey.url(db=1))
        try:
            assert await store.read() is None
            blob = bytes(range(256)) * (30 * 4096)  # ~30 MB, as a big index saves
            await store.write([blob[:1000], blob[1000:]])
            assert await store.read() == blob
            await store.write([b"newer"])  # replaced whole
            assert await store.read() == b"newer"
        finally:
            await store.close()
        # Another client (another replica) sees the last blob written.
        other = ValkeyStore(valkey.url(db=1))
        try:
            assert await other.read() == b"newer"
        finally:
            await other.close()

    run_async(scenario)


def test_the_store_over_tcp(valkey_tcp: RedisServer):
    async def scenario() -> None:
        store = ValkeyStore(valkey_tcp.url(db=2), key="kvroute:test")
        try:
            assert await store.read() is None
            await store.write([b"a", b"b", b"c"])
            assert await store.read() == b"abc"
        finally:
            await store.close()

    run_async(scenario)


def test_store_errors_are_one_line_and_never_show_a_password(
        tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("valkey-auth")
    guarded = RedisServer(directory, password="right-one").start()
    try:
        with refusing_ports(1) as (port,):
            urls = [f"redis://kvroute:s3cret-pw@127.0.0.1:{port}/0",
                    f"unix://:s3cret-pw@{directory}/absent.sock?db=0",
                    f"unix://{directory}/absent.sock?db=0&password=s3cret-pw",
                    # A server that is there, with the wrong password.
                    f"unix://:s3cret-pw@{guarded.socket_path}?db=0"]

            async def scenario() -> None:
                for url in urls:
                    store = ValkeyStore(url)
                    assert "s3cret" not in store.where
                    for attempt in (store.read(), store.write([b"x"])):
                        with pytest.raises(StateStoreError) as failed:
                            await attempt
                        message = str(failed.value)
                        assert "s3cret" not in message and "\n" not in message, message
                        assert store.where in message
                    await store.close()

            run_async(scenario)
    finally:
        guarded.stop()
    assert redacted("rediss://u:pw@host:6380/3?password=pw&db=3") == "rediss://host:6380/3?db=3"
    assert redacted("unix://:pw@/run/valkey.sock?db=1") == "unix:///run/valkey.sock?db=1"


def test_the_store_over_tls_checks_the_server_against_state_ca_file(
        tmp_path_factory: pytest.TempPathFactory):
    import trustme

    directory = tmp_path_factory.mktemp("valkey-tls")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    files = (directory / "cert.pem", directory / "key.pem", directory / "ca.pem")
    issued.cert_chain_pems[0].write_to_path(str(files[0]))
    issued.private_key_pem.write_to_path(str(files[1]))
    ca.cert_pem.write_to_path(str(files[2]))
    server = start_on_a_free_port(directory, tls=files)
    try:
        async def scenario() -> None:
            store = ValkeyStore(server.url(), ca_file=str(files[2]))
            try:
                await store.write([b"over tls"])
                assert await store.read() == b"over tls"
            finally:
                await store.close()
            unchecked = ValkeyStore(server.url())  # the system's CAs do not know this one
            try:
                with pytest.raises(StateStoreError, match="certificate"):
                    await unchecked.read()
            finally:
                await unchecked.close()

        run_async(scenario)
    finally:
        server.stop()


# -- Peers on their own ------------------------------------------------------

def make_peers(url: str, index: PrefixIndex, **options: object) -> Peers:
    defaults: dict[str, object] = {"is_worker": lambda key: True, "own_load": dict}
    return Peers(url, index=index, **{**defaults, **options})  # type: ignore[arg-type]


def test_peers_share_guesses_and_load_and_drop_what_does_not_decode(valkey_tcp: RedisServer):
    """Over TCP: a guess published by one replica becomes a pending match in the other's
    index, a load snapshot is summed per worker, junk on the channel is counted and
    dropped (the loop carries on), and a replica ignores its own messages."""
    url = valkey_tcp.url()
    tokens = unique_tokens(1, 4 * BLOCK + 3)
    worker = ("vllm-a", 0)
    own: dict[tuple[str, int], PeerLoad] = {}

    async def scenario() -> None:
        a_index, b_index = PrefixIndex(), PrefixIndex()
        a = make_peers(url, a_index, own_load=lambda: dict(own))
        b = make_peers(url, b_index, is_worker=lambda key: key != ("unknown", 0))
        a.start()
        b.start()
        junk = aredis.Redis.from_url(url)
        try:
            await wait_until(lambda: a.connected and b.connected, "both to connect")
            await wait_until(lambda: a.live_peers() == 1 and b.live_peers() == 1,
                             "each to hear the other's heartbeat")

            a.publish_guess(worker, tokens, block_size=BLOCK, lora_name=None, ttl=30.0)
            a.publish_guess(("unknown", 0), tokens, block_size=BLOCK, lora_name=None, ttl=30.0)

            def pending() -> int:
                match = b_index.match(tokens[:-1], workers=[worker], now=None).get(worker)
                return match.pending if match else 0

            await wait_until(lambda: pending() == 4, "A's guess in B's index")
            assert b.guesses_received == 1 and b.dropped["unknown_worker"] == 1
            assert a.guesses_received == 0 and not a_index.placements  # its own: ignored

            own[worker] = PeerLoad(inflight=2, answered=1, queued_prefill=300)
            await wait_until(lambda: b.load(worker) == PeerLoad(2, 1, 300), "A's load at B")
            assert a.load(worker) == PeerLoad()  # its own load is not a peer's

            channel = "kvroute:0:peers"
            bad = [b"not msgpack at all \xc1",
                   msgspec.msgpack.encode({"v": 1}),  # no sender
                   msgspec.msgpack.encode({"v": 2, "sender": b"x"}),  # unknown version
                   msgspec.msgpack.encode({"v": 1, "sender": b"x",
                                           "guesses": [["w", -1, b"", 16, None, 1.0]]}),
                   msgspec.msgpack.encode({"v": 1, "sender": b"x",
                                           "guesses": [["w", 0, b"12345", 16, None, 1.0]]}),
                   msgspec.msgpack.encode({"v": 1, "sender": b"x",
                                           "guesses": [["w", 0, b"1234", 16, None, 1e9]]}),
                   msgspec.msgpack.encode({"v": 1, "sender": b"x",
                                           "loads": [["w", 0, -5, 0, 0]]})]
            for data in bad:
                await junk.publish(channel, data)
            await wait_until(lambda: b.dropped["malformed"] == len(bad) == a.dropped["malformed"],
                             "every malformed message counted", detail=lambda: b.dropped)
            assert b.connected and a.connected  # nothing crashed
            own[worker] = PeerLoad(inflight=3)
            await wait_until(lambda: b.load(worker) == PeerLoad(3), "sharing goes on")

            # A replica that goes away: its load runs out after `expiry`.
            await a.close()
            await wait_until(lambda: b.load(worker) == PeerLoad() and b.live_peers() == 0,
                             "A's load to expire at B")
        finally:
            await a.close()
            await b.close()
            await junk.aclose()

    run_async(scenario)


def test_publishing_never_waits_and_drops_what_cannot_be_sent(valkey: RedisServer):
    """Without a connection a guess is dropped as offline; with the queue full, as
    queue_full. Neither raises nor waits."""

    async def scenario() -> None:
        peers = make_peers(valkey.url(), PrefixIndex(), max_queue=2)
        guess = {"block_size": BLOCK, "lora_name": None, "ttl": 2.0}
        peers.publish_guess(("w", 0), unique_tokens(1, 32), **guess)  # never started
        assert peers.dropped["offline"] == 1
        peers.connected = True  # as if connected, with the sending task not running
        for seed in range(3):
            peers.publish_guess(("w", 0), unique_tokens(seed, 32), **guess)
        assert peers.dropped["queue_full"] == 1
        await peers.close()

    run_async(scenario)


def test_every_peers_metric_is_listed_on_the_metrics_page() -> None:

    from kvroute.app.state.valkey import DROP_REASONS, PeersCollector

    peers = make_peers("unix:///nowhere.sock", PrefixIndex())  # never started: no I/O
    readme = (REPO / "docs" / "metrics.md").read_text()
    metrics = readme.split("## Metrics")[1].split("\n## ")[0]
    names = [f"{family.name}_total" if family.type == "counter" else family.name
             for family in PeersCollector(peers).collect()]
    assert [name for name in names if f"`{name}" not in metrics] == []
    assert [reason for reason in DROP_REASONS if f"`{reason}`" not in metrics] == []
