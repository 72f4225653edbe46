"""Subscribers feeding the real PrefixIndex: after each scenario the index answers exactly
like a fresh PrefixIndex given every published batch in order (the publisher side's truth)."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import apply_batch, decode_batch
from kvroute.index import PrefixIndex
from kvroute.sim.publisher import EventPublisher
from tests.support.events import (
    TEST_OPTIONS,
    EventSource,
    Ledger,
    Running,
    endpoint_of,
    run,
)
from tests.support.fixtures import live_payloads
from tests.support.synced import synced
from tests.support.waiting import wait_until


@pytest.mark.parametrize(("encoding", "replay_format"), [("map", "new"), ("array", "old")])
def test_two_ranks_with_drops_and_a_late_start_match_the_truth(encoding, replay_format):
    async def scenario(ctx):
        with EventPublisher(encoding=encoding, replay_format=replay_format, dp_rank=0) as r0, \
                EventPublisher(encoding=encoding, replay_format=replay_format, dp_rank=1) as r1:
            index = PrefixIndex()
            ledgers = {("vllm-a", 0): Ledger(r0), ("vllm-a", 1): Ledger(r1)}
            sources = [EventSource(40), EventSource(41)]
            for ledger, source in zip(ledgers.values(), sources, strict=True):
                for _ in range(20):  # cached before kvroute starts
                    ledger.publish(source.batch())
            subs = [Subscriber(endpoint_of(p, rank=r), index, ctx=ctx, options=TEST_OPTIONS)
                    for r, p in enumerate((r0, r1))]
            async with Running(subs[0]), Running(subs[1]):
                await synced(subs, index, ledgers, "replayed start")
                r0.drop_live(range(r0.next_seq + 2, r0.next_seq + 6))
                r1.drop_live([r1.next_seq])
                for _ in range(30):
                    for ledger, source in zip(ledgers.values(), sources, strict=True):
                        ledger.publish(source.batch())
                await synced(subs, index, ledgers, "after drops")
                assert index.stats().holdings[("vllm-a", 0)]["GPU"] > 0
                assert all(s.status.gaps >= 1 for s in subs)
    run(scenario)


def test_restart_and_disconnect_leave_only_the_new_engines_blocks():
    async def scenario(ctx):
        first = EventPublisher().start()
        second = None
        try:
            index = PrefixIndex()
            worker = ("vllm-a", 0)
            ledger, source = Ledger(first), EventSource(42)
            sub = Subscriber(endpoint_of(first), index, ctx=ctx, options=TEST_OPTIONS)
            async with Running(sub):
                for _ in range(10):
                    ledger.publish(source.batch())
                await synced([sub], index, {worker: ledger}, "start")
                ledger.restart()
                source = EventSource(43)
                for _ in range(5):
                    ledger.publish(source.batch())
                await synced([sub], index, {worker: ledger}, "restart")
                endpoints = (first.endpoint, first.replay_endpoint)
                first.close()
                await wait_until(lambda: sub.status.state == "down", "down")
                assert index.stats().holdings.get(worker, {}).get("GPU", 0) == 0
                second = EventPublisher(*endpoints).start()
                ledger, source = Ledger(second), EventSource(44)
                for _ in range(7):
                    ledger.publish(source.batch())
                await synced([sub], index, {worker: ledger}, "rebuilt")
        finally:
            first.close()
            if second is not None:
                second.close()
    run(scenario)


def test_captured_vllm_traffic_through_publisher_and_subscriber():
    """The real vLLM 0.32.0 payloads, re-published byte for byte, some dropped live."""
    live = live_payloads()
    payloads = [live[seq] for seq in sorted(live)]
    direct = PrefixIndex()
    for payload in payloads:
        apply_batch(direct, "w", decode_batch(payload))

    async def scenario(ctx):
        with EventPublisher(topic="kv-events") as pub:
            index = PrefixIndex()
            # The last batch is dropped too: only the idle check can find it.
            options = dataclasses.replace(TEST_OPTIONS, idle_check=0.3)
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
            async with Running(sub):
                await wait_until(lambda: sub.status.state == "live", "connected")
                pub.drop_live([3, 9, 10, 19])
                for payload in payloads:
                    pub.publish_raw(payload)
                await wait_until(lambda: sub.status.last_seq == len(payloads) - 1, "all seqs",
                                 detail=lambda: sub.status)
                worker = sub.worker
                assert index.stats().holdings[worker] == direct.stats().holdings["w"]
                last_prompt = decode_batch(payloads[-1]).events[-1].token_ids
                assert index.match(last_prompt)[worker].blocks == 3
                assert sub.status.malformed == 0 and sub.status.gaps >= 1
    run(scenario)
