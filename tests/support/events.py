"""The publisher side's truth for subscriber tests: what was sent, by seq, and what a worker
must therefore hold.

`Ledger` records every batch the test published through the wire-exact `EventPublisher`;
its truth is those batches applied in order to a fresh recording index (`OpLog`) or a fresh
`PrefixIndex`. The truth is built once per question, after a cheap wait (`caught_up`), never
inside a polling loop on the event loop being measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import zmq.asyncio

from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import BlockRemoved, BlockStored, Event, EventBatch, apply_batch
from kvroute.app.workers import SubscriberOptions, WorkerEndpoint
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.waiting import run_async, scaled, wait_until

# Subscriber options for tests: quick reconnects, and a replay timeout a loaded event loop
# meets with room to spare. A test that needs a replay to fail quickly sets its own.
TEST_OPTIONS = SubscriberOptions(
    replay_timeout=scaled(5.0), replay_retries=3, retry_backoff=0.05, reconnect_ivl_ms=50,
    reconnect_ivl_max_ms=200, idle_check=60.0,
)


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


class OpLog:
    """A recording stand-in for PrefixIndex: per worker, the operations since its last clear.

    For the subscriber's caps it also answers ``blocks_held`` and ``holds_hash`` from a
    reference count per hash (stores with tokens add, removals take away; mediums, orphans
    and group kinds are not modelled): tests of the caps themselves use a real PrefixIndex.
    """

    def __init__(self) -> None:
        self.ops: dict[Any, list[tuple[Any, ...]]] = defaultdict(list)
        self.refs: dict[Any, Counter[Any]] = defaultdict(Counter)

    def apply_stored(self, worker, block_hashes, parent_block_hash, token_ids, block_size,
                     **kwargs) -> None:
        self.ops[worker].append(("stored", _freeze(block_hashes), parent_block_hash,
                                 _freeze(token_ids), block_size,
                                 tuple(sorted((k, _freeze(v)) for k, v in kwargs.items()))))
        if token_ids:
            self.refs[worker].update(block_hashes)

    def apply_removed(self, worker, block_hashes, **kwargs) -> None:
        self.ops[worker].append(("removed", _freeze(block_hashes),
                                 tuple(sorted(kwargs.items()))))
        refs = self.refs[worker]
        for block_hash in block_hashes:
            if refs[block_hash] > 1:
                refs[block_hash] -= 1
            else:
                del refs[block_hash]  # a Counter forgives a missing key

    def clear_worker(self, worker) -> None:
        self.ops[worker] = []
        self.refs[worker] = Counter()

    def blocks_held(self, worker) -> int:
        return len(self.refs.get(worker, ()))

    def holds_hash(self, worker, block_hash) -> bool:
        return self.refs.get(worker, Counter())[block_hash] > 0

    def log(self, worker) -> list[tuple[Any, ...]]:
        return list(self.ops.get(worker, []))


class EventSource:
    """Deterministic random KV events: chains (some hanging off earlier blocks), removals of
    held blocks, duplicate stores; hashes span the whole uint64 range."""

    def __init__(self, seed: int, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.held: list[int] = []

    def batch(self, n_events: int = 3) -> list[Event]:
        events: list[Event] = []
        for _ in range(n_events):
            roll = self.rng.random()
            if roll < 0.25 and self.held:
                gone = self.rng.sample(self.held, min(len(self.held), self.rng.randint(1, 3)))
                events.append(BlockRemoved(block_hashes=gone, medium="GPU", group_idx=0))
            else:
                n = self.rng.randint(1, 4)
                hashes = [self.rng.getrandbits(64) for _ in range(n)]
                parent = self.rng.choice(self.held) if self.held and roll < 0.7 else None
                tokens = [self.rng.randrange(50_000) for _ in range(n * self.block_size)]
                events.append(BlockStored(
                    block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                    block_size=self.block_size, medium="GPU", group_idx=0,
                    kv_cache_spec_kind="full_attention", extra_keys=[None] * n))
                self.held.extend(hashes)
        return events


class Ledger:
    """What one publisher sent, by seq, since its last restart (None = garbage payload)."""

    def __init__(self, pub: EventPublisher) -> None:
        self.pub = pub
        self.sent: dict[int, list[Event] | None] = {}

    @property
    def last(self) -> int | None:
        return max(self.sent) if self.sent else None

    def publish(self, events: list[Event]) -> int:
        seq = self.pub.publish(events)
        self.sent[seq] = events
        return seq

    def publish_raw(self, payload: bytes) -> int:
        seq = self.pub.publish_raw(payload)
        self.sent[seq] = None
        return seq

    def restart(self) -> None:
        self.pub.restart()
        self.sent = {}

    def apply_to(self, index: Any, worker: Any, seqs: list[int] | None = None) -> None:
        """Apply the sent batches (all, or only `seqs`) in seq order to `index` as `worker`."""
        for seq in sorted(self.sent) if seqs is None else seqs:
            events = self.sent[seq]
            if events is not None:
                apply_batch(index, worker, EventBatch(0.0, list(events)))

    def truth(self, worker: Any, seqs: list[int] | None = None) -> list[tuple[Any, ...]]:
        """The operation log `worker` must hold: built afresh, so call it once per check."""
        model = OpLog()
        self.apply_to(model, worker, seqs)
        return model.log(worker)


def truth_index(ledgers: dict[Any, Ledger]) -> PrefixIndex:
    """A fresh PrefixIndex given every ledger's batches in order, each as its worker."""
    truth = PrefixIndex()
    for worker, ledger in ledgers.items():
        ledger.apply_to(truth, worker)
    return truth


def caught_up(sub: Subscriber, ledger: Ledger, states: tuple[str, ...] = ("live",)) -> bool:
    """Cheap: the subscriber is in one of `states` and has applied the ledger's last batch."""
    return sub.status.state in states and sub.status.last_seq == ledger.last


def run(scenario: Callable[[zmq.asyncio.Context], Awaitable[None]],
        timeout: float = 90.0) -> None:
    """Run `scenario` with a fresh ZMQ context on a fresh event loop, bounded in time; the
    context is destroyed however the scenario ends."""

    async def with_context() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await scenario(ctx)
        finally:
            ctx.destroy(linger=0)

    run_async(with_context, timeout)


class Running:
    """A started subscriber whose task is always stopped, even when the test fails."""

    def __init__(self, sub: Subscriber) -> None:
        self.sub = sub
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Subscriber:
        self.task = asyncio.create_task(self.sub.run())
        return self.sub

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.stop()
        assert self.task is not None
        await asyncio.gather(self.task, return_exceptions=True)
        assert self.task.done()


def endpoint_of(pub: EventPublisher, rank: int = 0, instance: str = "vllm-a") -> WorkerEndpoint:
    return WorkerEndpoint(instance, rank, pub.endpoint, pub.replay_endpoint)


class Rig(NamedTuple):
    pub: EventPublisher
    ledger: Ledger
    source: EventSource
    index: Any  # an OpLog unless the test gave its own
    sub: Subscriber


@contextlib.asynccontextmanager
async def subscribed(ctx, seed: int, *, index: Any = None, options=TEST_OPTIONS,
                     backlog: int = 0, wait_live: bool = True,
                     **publisher: Any) -> AsyncIterator[Rig]:
    """A publisher (built with `publisher`), its ledger, `EventSource(seed)` and a running
    subscriber into `index` (a fresh OpLog by default). `backlog` batches are published and
    flushed before the subscriber starts, so it can only learn them by replay; with
    `wait_live` the body starts once the first connection is live."""
    with EventPublisher(**publisher) as pub:
        ledger, source = Ledger(pub), EventSource(seed)
        index = OpLog() if index is None else index
        for _ in range(backlog):
            ledger.publish(source.batch())
        if backlog:
            pub.flush()
        sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
        async with Running(sub):
            if wait_live:
                await wait_until(lambda: sub.status.state == "live", "first connection")
            yield Rig(pub, ledger, source, index, sub)
