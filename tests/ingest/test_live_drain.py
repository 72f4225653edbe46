"""The compiled take of live messages (app/ingest/_live_drain.pyx, ``BatchApplier.drain``): it
applies exactly the queued messages that are the next batch in order, read as plain and
applied whole by one run, leaves the index as the Python path does, and hands back the
first other message as it was sent; it stops at each bound without taking a message it
should not (the count, the turn's deadline, a waiting request, an empty socket), and the
events and blocks allowed bound each message's run, not their sum."""

from __future__ import annotations

import asyncio
import os
import select
import time
import weakref

import pytest
import zmq

from kvroute.app.ingest import apply as batch_apply
from kvroute.app.ingest.apply import BatchApplier, BatchOutcome, Begun
from kvroute.app.ingest.budget import LoopBudget
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import BlockRemoved, BlockStored, apply_event, encode_batch, encode_seq
from kvroute.app.workers import SubscriberOptions
from kvroute.index import PrefixIndex
from kvroute.index.runs import RunLimits
from kvroute.sim.publisher import EventPublisher
from tests.support.events import TEST_OPTIONS, EventSource, Ledger, Running, endpoint_of, run
from tests.support.index_impl import layout
from tests.support.synced import synced

live_drain = pytest.importorskip("kvroute.app.ingest._live_drain",
                                 reason="the compiled drain is built where zmq.h is found")
pytestmark = pytest.mark.skipif(PrefixIndex().implementation != "compiled",
                                reason="the drain applies through the compiled index")

WORKER = ("w", 0)
BLOCK = 4
LIMITS = RunLimits(stored=(BlockStored,), removed=BlockRemoved, max_event_blocks=1000,
                   max_worker_blocks=100_000, max_work=1024)
FAR = 1e18  # a deadline no test reaches


def chain(first: int, blocks: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(range(first, first + blocks)), parent_block_hash=parent,
                       token_ids=[(first * 7 + i) % 50_000 for i in range(blocks * BLOCK)],
                       block_size=BLOCK)


def batch(*events) -> bytes:
    return encode_batch(list(events), ts=1.0, dp_rank=0)


class Pair:
    """A PAIR socket to send from and one to drain, over inproc: a message sent is queued
    on the other at once."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PAIR)
        self.inbox.bind("inproc://drain")
        self.outbox = self.ctx.socket(zmq.PAIR)
        self.outbox.connect("inproc://drain")

    def send(self, seq: int, payload: bytes, topic: bytes = b"kv") -> list[bytes]:
        frames = [topic, encode_seq(seq), payload]
        self.outbox.send_multipart(frames)
        return frames

    def drain(self, index: PrefixIndex, last_seq: int | None, *, last_live: int | None = None,
              limit: int = 100, deadline: float = FAR, arrivals: int = -1,
              unyielded: int = 0, unyielded_work: int = 0, chunk_events: int = 256,
              slice_blocks: int = 1024, big: int = 1 << 20):
        take = live_drain.LiveTake(index, WORKER, LIMITS, chunk_events, slice_blocks,
                                   256 * 1024, big)
        return take.drain(self.inbox, last_seq, last_live, 0, limit, deadline, arrivals, 0.0,
                          unyielded, unyielded_work)

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close(0)
        self.ctx.term()


@pytest.fixture
def pair():
    made = Pair()
    yield made
    made.close()


def fresh() -> PrefixIndex:
    index = PrefixIndex(compiled=True)
    index.clear_worker(WORKER)  # known to the index, as a subscribed worker is
    return index


def test_in_order_plain_batches_are_applied_and_the_first_other_message_comes_back(pair):
    index, reference = fresh(), fresh()
    events = [[chain(100 * s, 3), chain(100 * s + 50, 2)] for s in range(1, 5)]
    events[2].append(BlockRemoved(block_hashes=[100, 101]))  # removals of held hashes
    payloads = [batch(*e) for e in events]
    for seq, payload in enumerate(payloads, start=11):
        pair.send(seq, payload)
    gap = pair.send(16, batch(chain(900, 1)))  # 15 is missing
    done = pair.drain(index, 10)
    for e in events:
        for event in e:
            apply_event(reference, WORKER, event)
    assert (done.taken, done.seq, done.payload) == (4, 14, payloads[-1])
    assert done.events == sum(map(len, events)) and done.blocks == 4 * 5 + 2
    assert done.frames == gap and done.plain is None and done.run is None
    assert layout(index) == layout(reference)
    # The work since its last look at the clock: the last message taken.
    assert not done.empty and (done.unyielded, done.unyielded_work) == (1 + 2, 3 + 2)


def test_each_kind_of_other_message_is_handed_back_whole(pair):
    index = fresh()
    others = [
        pair.send(5, batch(chain(10, 1))),  # a duplicate of the last batch applied
        pair.send(7, batch(BlockStored(block_hashes=[1], parent_block_hash=None,
                                       token_ids=[1] * BLOCK, block_size=BLOCK,
                                       medium="CPU"))),  # not plain in form
        pair.send(7, b"\x93garbage"),
    ]
    pair.outbox.send_multipart([b"kv", encode_seq(7)])  # two frames
    for expected in others:
        done = pair.drain(index, 6)
        assert (done.taken, done.frames, done.run) == (0, expected, None)
    done = pair.drain(index, 6)
    assert done.frames == [b"kv", encode_seq(7)]
    done = pair.drain(index, 6, last_live=9)  # a later live batch was seen: 7 is not news
    assert done.empty and done.frames is None
    assert layout(index) == layout(fresh())


def test_a_big_frame_comes_back_in_place_and_read_only(pair):
    index = fresh()
    payload = batch(chain(10, 2))
    pair.send(1, payload)
    done = pair.drain(index, 0, big=16)  # the payload is a "big" frame here
    frame = done.frames[2]
    assert type(frame) is memoryview and frame.readonly and bytes(frame) == payload
    assert done.taken == 0 and layout(index) == layout(fresh())
    with pytest.raises(TypeError):
        frame[0] = 0
    del done, frame  # the message is freed with its last view


def test_a_batch_a_run_does_not_finish_comes_back_begun(pair):
    index = fresh()
    pair.send(1, batch(chain(10, 2), chain(20, 2, parent=999), chain(30, 1)))  # an orphan
    done = pair.drain(index, 0)
    assert done.taken == 0 and done.plain is not None and len(done.plain) == 3
    assert done.run.next == 1 and done.run.blocks == 2
    assert index.blocks_held(WORKER) == 2
    assert done.unyielded == 1 + 1


def test_it_takes_nothing_past_its_bounds(pair):
    index = fresh()
    for seq in range(1, 6):
        pair.send(seq, batch(chain(10 * seq, 1)))
    late = pair.drain(index, 0, deadline=time.perf_counter() - 1)
    assert late.taken == 0 and late.bounded
    full = pair.drain(index, 0, unyielded=255)  # the caller's work left no room for an event
    assert full.taken == 0 and full.bounded
    read, write = os.pipe()
    arrivals = select.epoll()
    try:
        arrivals.register(read, select.EPOLLIN)
        os.write(write, b"x")  # "a request waits"
        waiting = pair.drain(index, 0, arrivals=arrivals.fileno())
        assert waiting.taken == 0 and waiting.requests_waiting and waiting.bounded
    finally:
        arrivals.close()
        os.close(read)
        os.close(write)
    counted = pair.drain(index, 0, limit=2)
    assert counted.taken == 2 and not counted.bounded  # nothing was taken before
    done = pair.drain(index, 2)
    assert (done.taken, done.seq, done.empty, done.bounded) == (3, 5, True, False)
    assert index.blocks_held(WORKER) == 5


@pytest.mark.parametrize("bound", ["events", "blocks"])
def test_the_events_and_blocks_allowed_bound_each_message_not_their_sum(pair, bound):
    """It looks at the clock before each message, so the work allowed between two looks
    is one message's: batches that each fit it are all taken. The caller's work since its
    last yield counts for the first one only; a batch that does not fit beside it is begun
    and handed back, for the Python path to finish in pieces."""
    index, reference = fresh(), fresh()
    events = [[chain(100, 2)]] + [[chain(100 * s + 10 * k, 2) for k in range(3)]
                                  for s in range(2, 4)]
    for seq, e in enumerate(events, start=1):
        pair.send(seq, batch(*e))
    # The first batch: 1 event (and the batch's own count of one), 2 blocks; the next two:
    # 3 events, 6 blocks. The caller's work leaves room for the first, and each of the
    # others has the whole room: it is not counted again.
    if bound == "events":
        room, before = {"chunk_events": 4}, {"unyielded": 2}
    else:
        room, before = {"slice_blocks": 6}, {"unyielded_work": 4}
    done = pair.drain(index, 0, **room, **before)
    assert (done.taken, done.seq, done.empty, done.bounded) == (3, 3, True, False)
    for e in events:
        for event in e:
            apply_event(reference, WORKER, event)
    assert layout(index) == layout(reference)
    pair.send(4, batch(*[chain(500 + 10 * k, 2) for k in range(3)]))
    before = {"unyielded": 1} if bound == "events" else {"unyielded_work": 1}
    begun = pair.drain(index, 3, **room, **before)
    assert begun.taken == 0 and begun.run is not None and begun.run.next < 3
    assert begun.frames[1] == encode_seq(4)


def test_no_last_seq_takes_nothing(pair):
    pair.send(1, batch(chain(10, 1)))
    done = pair.drain(fresh(), None)
    assert done.taken == 0 and done.frames is None and not done.empty
    assert pair.drain(fresh(), 0).taken == 1  # still queued


def test_the_applier_drains_within_the_turn_and_counts_toward_its_yields(pair):
    async def main() -> None:
        index = fresh()
        options = SubscriberOptions()
        applier = BatchApplier(index, WORKER, options, check=lambda: None,
                               refused=lambda counter, reason: None)
        assert applier.drains
        applier._budget = LoopBudget(seconds=60)
        pair.send(1, batch(chain(10, 2)))
        pair.send(2, batch(chain(20, 1), chain(30, 1, parent=999)))  # stops at its orphan
        done = applier.drain(pair.inbox, 0, None, 0, 10)
        assert done.taken == 1 and done.run is not None
        begun = applier.begun(done)
        assert isinstance(begun, Begun) and begun.outcome.blocks == 1
        outcome = await applier.apply(2, done.frames[2], begun)
        assert isinstance(outcome, BatchOutcome) and outcome.failed is None
        assert index.blocks_held(WORKER) == 3  # the orphan is not held
        applier._budget = LoopBudget(seconds=0.0)
        applier._budget.exhausted()  # the turn began
        assert applier.drain(pair.inbox, 2, None, 0, 10) is None

    asyncio.run(main())


_short_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBudget] = (
    weakref.WeakKeyDictionary())


def short_turns() -> LoopBudget:
    """``shared_budget`` with turns of 0.1 ms."""
    loop = asyncio.get_running_loop()
    return _short_budgets.setdefault(loop, LoopBudget(seconds=0.0001))


def test_a_subscriber_drains_live_batches_as_its_python_path_takes_them(monkeypatch):
    """The same live stream, with drops, into a subscriber with the drain and one without:
    both indexes answer as the truth does, and the counts of the in-order stretch agree."""
    compiled = batch_apply.LiveTake
    taken: list[int] = []
    begun: list[bool] = []
    bounded: list[bool] = []
    # Short turns of the loop, so the drain stops at a turn's end often.
    monkeypatch.setattr(batch_apply, "shared_budget", short_turns)
    options = TEST_OPTIONS

    class Counting:
        """The compiled take, with what each of its calls did recorded."""

        def __init__(self, index, worker, limits, chunk_events, *rest) -> None:
            self.take = compiled(index, worker, limits, chunk_events, *rest)
            self.chunk_events = chunk_events

        def drain(self, *args):
            # Every other call begins with the events allowed between two yields nearly
            # used up, so it stops after its first message (a bounded stop) however fast
            # the machine: the way out that turns of 0.1 ms reach only when messages pile up.
            args = list(args)
            if len(taken) % 2:
                args[8] = max(args[8], self.chunk_events - 2)  # unyielded
            done = self.take.drain(*args)
            taken.append(done.taken)
            begun.append(done.run is not None)
            bounded.append(done.bounded)
            return done

    def stream(take) -> tuple[int, int, int]:
        monkeypatch.setattr(batch_apply, "LiveTake", take)
        counts = []

        async def scenario(ctx):
            with EventPublisher(dp_rank=0) as publisher:
                index = PrefixIndex()
                ledgers = {("vllm-a", 0): Ledger(publisher)}
                source = EventSource(7)
                sub = Subscriber(endpoint_of(publisher), index, ctx=ctx, options=options)
                async with Running(sub):
                    ledgers[("vllm-a", 0)].publish(source.batch(4))
                    await synced([sub], index, ledgers, "started")
                    for _ in range(60):
                        ledgers[("vllm-a", 0)].publish(source.batch(4))
                    await synced([sub], index, ledgers, "in order")
                    status = sub.status
                    counts.append((status.batches, status.events, status.blocks))
                    publisher.drop_live(range(publisher.next_seq + 3, publisher.next_seq + 7))
                    for _ in range(30):
                        ledgers[("vllm-a", 0)].publish(source.batch(4))
                    await synced([sub], index, ledgers, "after drops")
                    assert sub.status.gaps >= 1

        run(scenario)
        return counts[0]

    without = stream(None)
    # Every way out of the drain is taken: batches applied whole, batches it began (an
    # event no run takes: this stream's stores hang off removed blocks now and then), and
    # stops at a turn's end, after which the subscriber drains on. Which call stops where
    # is the machine's timing, so the stream runs again (three times at most) until each
    # was seen; every run must agree with the Python path's.
    for _ in range(3):
        assert stream(Counting) == without
        if sum(taken) > 0 and any(begun) and any(bounded):
            break
    assert sum(taken) > 0 and any(begun) and any(bounded)
