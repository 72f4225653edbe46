"""Valkey (or Redis) for a fleet of kvroute replicas: the saved state, and what the
replicas tell each other while they route.

One server (``state_url``), two uses:

- ``ValkeyStore``: the saved-state blob (``app.state.format``) under one key. ``SET``
  replaces it atomically, so a reader sees the previous blob or the new one; replicas
  share it and the last one to save wins.
- ``Peers``: every replica publishes on one pub/sub channel the placement guesses it makes
  and its own load per worker (proxy requests in flight, route answers not yet in the
  instance's metrics, and the prefill tokens queued among them); it applies the other
  replicas' guesses to its index and adds their load to its own in the cost model. So
  replicas behind one Service price the fleet's traffic, not their share of it.

Invariants:

- Nothing on the request path waits on Valkey. ``publish_guess`` puts into a bounded queue
  (what does not fit is dropped and counted) that a background task drains; ``load`` reads
  this process's memory.
- Losing Valkey never stops routing: the replica routes on its own view, the other
  replicas' loads run out ``expiry`` seconds after they were last refreshed, and the
  connection is retried with bounded, jittered backoff. The loss and the return are logged
  once each; meanwhile ``kvroute_valkey_connected`` is 0 and ``/readyz`` says why.
- A load message is a full snapshot of its sender's load (never a delta), sent when it
  changed and at least every ``heartbeat``: a lost message is repaired by the next one, and
  a replica that comes back needs nothing else to catch up.
- A received message is trusted no further than its shape: one that does not decode to the
  schema is counted and dropped, the loop carries on; a guess is applied only to a worker
  this replica follows. A replica ignores its own messages (it learns of its guesses and
  load directly).
- The server is only ever named by ``redacted(url)``: no user name or password reaches a
  log line, an error message, ``/readyz`` or a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import secrets
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit

import msgspec
import redis.asyncio as aredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvroute.app.api.answers import ReplicasStatus
from kvroute.app.api.route_request import CacheSalt
from kvroute.app.state.store import StateStoreError
from kvroute.app.tasks import cancel_and_wait, cancel_requested
from kvroute.app.workers import WorkerKey
from kvroute.index import PrefixIndex

__all__ = ["NO_LOAD", "PeerLoad", "Peers", "PeersCollector", "ValkeyStore", "redacted"]

log = logging.getLogger("kvroute.valkey")

STATE_KEY = "kvroute:state"
# Every network error redis-py and the socket layer raise; anything else is a bug.
NETWORK_ERRORS = (RedisError, OSError, TimeoutError)
CONNECT_TIMEOUT = 5.0
# A saved state is tens of MB: its SET or GET may take a while on a slow link.
STORE_TIMEOUT = 60.0
# Peers' commands are small; a reply this late means the connection is gone.
PEER_TIMEOUT = 5.0


# -- the server --------------------------------------------------------------

def redacted(url: str) -> str:
    """`url` without user name, password, or any query parameter but ``db``."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k == "db"])
    # Not urlunsplit: it spells unix:///path (empty host) as unix:/path.
    return f"{parts.scheme}://{host}{parts.path}" + (f"?{query}" if query else "")


def _secrets_of(url: str) -> list[str]:
    parts = urlsplit(url)
    found = [parts.password or "", parts.username or ""]
    found += [v for k, v in parse_qsl(parts.query) if k in ("password", "username")]
    return [s for s in found if s]


def _reason(exc: BaseException, url: str) -> str:
    """One line saying why, with the URL's credentials masked should a library echo them."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    for secret in _secrets_of(url):
        text = text.replace(secret, "***")
    return text


def connect(url: str, ca_file: str | None, *, timeout: float) -> aredis.Redis:
    """A client for `url` (no I/O yet). Retries are left to the caller: a failed command
    raises at once. Raises StateStoreError for a URL redis-py cannot use."""
    options: dict[str, Any] = {
        "socket_timeout": timeout, "socket_connect_timeout": CONNECT_TIMEOUT,
        "retry": Retry(NoBackoff(), 0), "client_name": "kvroute"}
    if ca_file and urlsplit(url).scheme.lower() == "rediss":
        options["ssl_ca_certs"] = ca_file
    try:
        return aredis.Redis.from_url(url, **options)
    except (ValueError, TypeError) as exc:
        raise StateStoreError(f"{redacted(url)} is not a usable Valkey/Redis URL: "
                              f"{_reason(exc, url)}") from None


class ValkeyStore:
    """The saved-state blob under one key (see the module invariants); a `StateStore`."""

    def __init__(self, url: str, *, ca_file: str | None = None, key: str = STATE_KEY) -> None:
        self.key = key
        self.where = f"{redacted(url)} key {key}"
        self._url = url
        self._client = connect(url, ca_file, timeout=STORE_TIMEOUT)

    async def read(self) -> bytes | None:
        try:
            value = await self._client.get(self.key)
        except NETWORK_ERRORS as exc:
            raise StateStoreError(f"cannot read {self.where}: {_reason(exc, self._url)}") from None
        return bytes(value) if value is not None else None

    async def write(self, chunks: list[bytes]) -> None:
        blob = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            await self._client.set(self.key, blob)
        except NETWORK_ERRORS as exc:
            raise StateStoreError(f"cannot write {self.where}: "
                                  f"{_reason(exc, self._url)}") from None

    async def close(self) -> None:
        with contextlib.suppress(*NETWORK_ERRORS):
            await self._client.aclose()


# -- what replicas tell each other ------------------------------------------

SCHEMA_VERSION = 1
MAX_GUESS_TOKENS = 1 << 20
MAX_TTL = 600.0
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
# Bounds of sanity, far above any real value: a sender never hits them.
Name = Annotated[str, msgspec.Meta(max_length=1 << 16)]
MAX_GUESSES_PER_MESSAGE = 4096
MAX_LOADS_PER_MESSAGE = 1 << 16


class _Guess(msgspec.Struct, array_like=True, frozen=True):
    """A placement guess: `tokens` are the prompt's full blocks as little-endian uint32."""

    instance: Name
    dp_rank: Rank
    tokens: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_GUESS_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 16)] | None
    lora_name: Name | None
    ttl: Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL)]
    # Last, with a default: a replica of an older kvroute sends guesses without it.
    cache_salt: CacheSalt | None = None


class _Load(msgspec.Struct, array_like=True, frozen=True):
    instance: Name
    dp_rank: Rank
    inflight: Count
    answered: Count
    queued_prefill: Count


class _Message(msgspec.Struct, frozen=True):
    """One publication. Encoded as a map, so later versions can add fields."""

    v: int
    sender: Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
    guesses: Annotated[list[_Guess], msgspec.Meta(max_length=MAX_GUESSES_PER_MESSAGE)] = (
        msgspec.field(default_factory=list))
    # The sender's whole load, or None: this message carries no snapshot.
    loads: Annotated[list[_Load], msgspec.Meta(max_length=MAX_LOADS_PER_MESSAGE)] | None = None


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """Work one replica (or all the others, summed) has put on one worker."""

    inflight: int = 0  # proxy requests forwarded and not yet ended
    answered: int = 0  # route answers the instance's metrics do not show yet
    queued_prefill: int = 0  # uncached prompt tokens of both, not yet computed

    def __add__(self, other: PeerLoad) -> PeerLoad:
        return PeerLoad(self.inflight + other.inflight, self.answered + other.answered,
                        self.queued_prefill + other.queued_prefill)


NO_LOAD = PeerLoad()


class _Pending(NamedTuple):
    queued_at: float
    worker: WorkerKey
    tokens: Sequence[int]
    block_size: int | None
    lora_name: str | None
    cache_salt: str | None
    ttl: float


@dataclass(slots=True)
class _Peer:
    seen: float
    loads: dict[WorkerKey, PeerLoad]


DROP_REASONS = (
    "queue_full",  # a guess made while the queue to Valkey was full: not shared
    "offline",  # a guess made while Valkey was unreachable: not shared
    "malformed",  # a received message that does not decode to the schema
    "unknown_worker",  # a received guess for a worker this replica does not follow
    "too_many_peers",  # a message from one replica more than MAX_PEERS
)
MAX_PEERS = 256


class Peers:
    """This replica's side of the sharing; see the module invariants.

    The request path calls ``publish_guess`` (after a placement guess) and ``load`` (per
    scored worker); ``start`` and ``close`` bracket the background task that keeps the
    connection and moves the messages.
    """

    def __init__(self, url: str, *, index: PrefixIndex,
                 is_worker: Callable[[WorkerKey], bool],
                 own_load: Callable[[], Mapping[WorkerKey, PeerLoad]],
                 ca_file: str | None = None, apply_guesses: bool = True,
                 interval: float = 0.2, heartbeat: float = 0.5, expiry: float = 2.0,
                 max_queue: int = 1024, max_queued_tokens: int = 4 * MAX_GUESS_TOKENS,
                 backoff: tuple[float, float] = (0.1, 5.0), silence: float = 10.0) -> None:
        self.id = secrets.token_bytes(8)
        self.where = redacted(url)
        self._url, self._ca_file = url, ca_file
        connect(url, ca_file, timeout=PEER_TIMEOUT)  # a URL redis-py refuses fails now
        self._index = index
        self._is_worker = is_worker
        self._own_load = own_load
        self._apply_guesses = apply_guesses
        self._interval, self._heartbeat, self._expiry = interval, heartbeat, expiry
        self._max_queue, self._max_queued_tokens = max_queue, max_queued_tokens
        self._backoff = backoff
        # No message at all for this long, not even our own heartbeat: the subscription is
        # dead although the socket looks open (a half-open TCP connection).
        self._silence = silence
        self._queue: deque[_Pending] = deque()
        self._queued_tokens = 0
        self._wake = asyncio.Event()
        self._peers: dict[bytes, _Peer] = {}
        self._totals: dict[WorkerKey, PeerLoad] = {}
        self._next_expiry = float("inf")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_Message)
        self._task: asyncio.Task[None] | None = None
        self.connected = False
        self._ever_connected = False
        self._lost_at: float | None = None
        self._error: str | None = None
        # Counters, exported by PeersCollector.
        self.guesses_received = 0
        self.load_updates = 0
        self.sent = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    # -- the request path: never waits ----------------------------------
    def publish_guess(self, worker: WorkerKey, tokens: Sequence[int], *,
                      block_size: int | None, lora_name: str | None,
                      cache_salt: str | None = None, ttl: float) -> None:
        """Tell the other replicas that `worker` will hold `tokens`' full blocks for `ttl`
        seconds (as ``PrefixIndex.place``). The caller must not change `tokens` afterwards:
        it is read when the message is sent."""
        if not self.connected:
            self.dropped["offline"] += 1
            return
        size = min(len(tokens), MAX_GUESS_TOKENS)
        if (len(self._queue) >= self._max_queue
                or self._queued_tokens + size > self._max_queued_tokens):
            self.dropped["queue_full"] += 1
            return
        self._queue.append(_Pending(time.monotonic(), worker, tokens, block_size, lora_name,
                                    cache_salt, ttl))
        self._queued_tokens += size
        self._wake.set()

    def loaded(self) -> list[WorkerKey]:
        """The workers the other live replicas say carry some of their load."""
        if self._peers and time.monotonic() >= self._next_expiry:
            self._expire(time.monotonic())
        return list(self._totals)

    def load(self, worker: WorkerKey) -> PeerLoad:
        """The other live replicas' load on `worker`, summed."""
        if self._peers and time.monotonic() >= self._next_expiry:
            self._expire(time.monotonic())
        return self._totals.get(worker, NO_LOAD)

    # -- what it knows ----------------------------------------------------
    def live_peers(self) -> int:
        self._expire(time.monotonic())
        return len(self._peers)

    def status(self) -> ReplicasStatus:
        """For /readyz: whether this replica shares, and a sentence saying so."""
        peers = self.live_peers()
        if self.connected:
            detail = f"sharing guesses and load through {self.where} with {peers} other replica(s)"
        elif self._lost_at is None:
            detail = f"connecting to {self.where}"
        else:
            detail = (f"{self.where} unreachable for {time.monotonic() - self._lost_at:.0f} s "
                      f"({self._error}); routing on this replica's own view, retrying")
        return ReplicasStatus(connected=self.connected, peers=peers, detail=detail)

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name="kvroute-peers")

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.connected = False

    # -- the background task ---------------------------------------------
    async def _supervise(self) -> None:
        delay = self._backoff[0]
        while True:
            client = connect(self._url, self._ca_file, timeout=PEER_TIMEOUT)
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self._channel(client))
                self._up()
                delay = self._backoff[0]
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._receive(pubsub))
                    group.create_task(self._send(client))
            except* NETWORK_ERRORS as failed:
                self._down(_reason(failed.exceptions[0], self._url))
            except* Exception as failed:  # a bug: say so, and keep the replica routing
                log.error("sharing with other replicas failed", exc_info=failed.exceptions[0])
                self._down(f"internal error: {type(failed.exceptions[0]).__name__}")
            finally:
                for closing in (pubsub.aclose, client.aclose):
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(closing(), CONNECT_TIMEOUT)
            # Jittered, so replicas that lost the server together do not return in step.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._backoff[1])

    def _channel(self, client: aredis.Redis) -> str:
        # Pub/sub ignores the database number; fleets kept apart by it stay apart here too.
        return f"kvroute:{client.connection_pool.connection_kwargs.get('db', 0)}:peers"

    def _up(self) -> None:
        if self._lost_at is not None and self._ever_connected:
            # At the loss's level: whoever saw it go sees it come back.
            log.warning("Valkey at %s is back after %.1f s: sharing with other replicas again",
                        self.where, time.monotonic() - self._lost_at)
        elif not self._ever_connected:
            log.info("sharing placement guesses and load with other replicas through %s",
                     self.where)
        self.connected = self._ever_connected = True
        self._lost_at = self._error = None

    def _down(self, reason: str) -> None:
        self.connected = False
        self._error = reason
        # Guesses queued for an outage are stale by the time it ends.
        self._queue.clear()
        self._queued_tokens = 0
        if self._lost_at is None:
            self._lost_at = time.monotonic()
            log.warning("Valkey at %s unreachable (%s): routing on this replica's own view "
                        "until it returns", self.where, reason)

    async def _send(self, client: aredis.Redis) -> None:
        channel = self._channel(client)
        last_loads: Mapping[WorkerKey, PeerLoad] | None = None
        last_snapshot = next_tick = time.monotonic()  # a snapshot at once: peers learn of us
        # Ends when the group cancels it, even if the client swallowed that (app.tasks).
        while not cancel_requested():
            if not self._queue:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(),
                                           max(0.0, next_tick - time.monotonic()))
            now = time.monotonic()
            loads = None
            if now >= next_tick:
                next_tick = now + self._interval
                current = self._own_load()
                if current != last_loads or now - last_snapshot >= self._heartbeat:
                    loads = current
            guesses = self._take_guesses(now)
            if loads is None and not guesses:
                continue
            snapshot = None if loads is None else [
                _Load(i, r, x.inflight, x.answered, x.queued_prefill)
                for (i, r), x in itertools.islice(loads.items(), MAX_LOADS_PER_MESSAGE)]
            message = _Message(v=SCHEMA_VERSION, sender=self.id, guesses=guesses,
                               loads=snapshot)
            await client.publish(channel, self._encoder.encode(message))
            self.sent += 1
            if loads is not None:
                last_loads, last_snapshot = loads, now

    def _take_guesses(self, now: float) -> list[_Guess]:
        """Queued guesses for one message (at most about MAX_GUESS_TOKENS tokens), each
        with the time to live it has left."""
        taken: list[_Guess] = []
        tokens_taken = 0
        while (self._queue and tokens_taken < MAX_GUESS_TOKENS
               and len(taken) < MAX_GUESSES_PER_MESSAGE):
            pending = self._queue.popleft()
            count = min(len(pending.tokens), MAX_GUESS_TOKENS)
            self._queued_tokens -= count
            if pending.block_size:
                count -= count % pending.block_size  # only full blocks are guessed
            ttl = pending.ttl - (now - pending.queued_at)
            if count <= 0 or ttl <= 0:
                continue
            try:
                tokens = array("I", pending.tokens[:count])
            except (OverflowError, TypeError):  # not uint32 token ids: nothing to guess
                continue
            if sys.byteorder != "little":
                tokens.byteswap()
            taken.append(_Guess(pending.worker[0], pending.worker[1], tokens.tobytes(),
                                pending.block_size, pending.lora_name, min(ttl, MAX_TTL),
                                pending.cache_salt))
            tokens_taken += count
        return taken

    async def _receive(self, pubsub: aredis.client.PubSub) -> None:
        heard = time.monotonic()
        while not cancel_requested():
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            now = time.monotonic()
            if message is None:
                if now - heard > self._silence:
                    raise ConnectionError(f"nothing heard on the channel for {self._silence:g} s")
                continue
            heard = now
            if message.get("type") == "message":
                self._take(message["data"], now)
                # Applying a big guess hashes every block of it: let requests run between.
                await asyncio.sleep(0)

    def _take(self, data: bytes, now: float) -> None:
        try:
            message = self._decoder.decode(data)
        except msgspec.DecodeError:  # ValidationError included
            self.dropped["malformed"] += 1
            return
        if message.v != SCHEMA_VERSION or any(len(g.tokens) % 4 for g in message.guesses):
            self.dropped["malformed"] += 1
            return
        if message.sender == self.id:
            return
        peer = self._peers.get(message.sender)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self.dropped["too_many_peers"] += 1
                return
            peer = self._peers[message.sender] = _Peer(now, {})
            log.debug("replica %s joined", message.sender.hex())
        peer.seen = now
        self._next_expiry = min(self._next_expiry, now + self._expiry)
        for guess in message.guesses:
            self._apply(guess, now)
        if message.loads is not None:
            loads: dict[WorkerKey, PeerLoad] = {}
            for item in message.loads:
                key = (item.instance, item.dp_rank)
                loads[key] = loads.get(key, NO_LOAD) + PeerLoad(
                    item.inflight, item.answered, item.queued_prefill)
            if loads != peer.loads:
                peer.loads = loads
                self._retotal()
            self.load_updates += 1

    def _apply(self, guess: _Guess, now: float) -> None:
        key = (guess.instance, guess.dp_rank)
        if not self._apply_guesses:
            return
        if not self._is_worker(key):
            self.dropped["unknown_worker"] += 1
            return
        tokens = array("I")
        tokens.frombytes(guess.tokens)
        if sys.byteorder != "little":
            tokens.byteswap()
        try:
            self._index.place(key, tokens.tolist(), block_size=guess.block_size,
                              lora_name=guess.lora_name, cache_salt=guess.cache_salt,
                              expires=now + guess.ttl)
        except ValueError:  # the index refused it; a peer's message is never fatal
            self.dropped["malformed"] += 1
            return
        self.guesses_received += 1

    def _expire(self, now: float) -> None:
        gone = [sender for sender, peer in self._peers.items()
                if now - peer.seen > self._expiry]
        for sender in gone:
            log.debug("replica %s silent for %g s: its load no longer counts", sender.hex(),
                      self._expiry)
            del self._peers[sender]
        self._next_expiry = min((p.seen for p in self._peers.values()),
                                default=float("inf")) + self._expiry
        if gone:
            self._retotal()

    def _retotal(self) -> None:
        totals: dict[WorkerKey, PeerLoad] = {}
        for peer in self._peers.values():
            for key, load in peer.loads.items():
                totals[key] = totals.get(key, NO_LOAD) + load
        self._totals = totals


class PeersCollector(Collector):
    """The sharing's metrics, read from `Peers` at scrape time."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers

    def collect(self) -> Iterator[Any]:
        peers = self._peers
        yield GaugeMetricFamily("kvroute_valkey_connected",
                                "1 while this replica shares guesses and load through Valkey",
                                value=1.0 if peers.connected else 0.0)
        yield GaugeMetricFamily("kvroute_peers", "other kvroute replicas heard from lately",
                                value=float(peers.live_peers()))
        yield CounterMetricFamily("kvroute_peer_guesses",
                                  "placement guesses received from other replicas and applied",
                                  value=float(peers.guesses_received))
        yield CounterMetricFamily("kvroute_peer_load_updates",
                                  "load snapshots received from other replicas",
                                  value=float(peers.load_updates))
        yield CounterMetricFamily("kvroute_peer_messages_sent",
                                  "messages this replica published to the others",
                                  value=float(peers.sent))
        dropped = CounterMetricFamily("kvroute_peer_messages_dropped",
                                      "guesses not shared and received messages not used",
                                      labels=["reason"])
        for reason, count in peers.dropped.items():
            dropped.add_metric([reason], float(count))
        yield dropped
