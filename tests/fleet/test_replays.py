"""A fleet's replays: stuck answers end in `degraded` with the reason (and are retried),
replays at once are bounded fleet-wide, and idle checks reuse their socket. Real publishers
over loopback TCP (tests.support.events)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from kvroute.app.ingest.pacing import FleetPacing
from kvroute.app.ingest.subscriber import Subscriber
from kvroute.sim.publisher import EventPublisher
from tests.support.events import (
    TEST_OPTIONS,
    EventSource,
    Ledger,
    OpLog,
    Running,
    caught_up,
    endpoint_of,
    run,
)
from tests.support.waiting import wait_until

SERVING = ("live", "degraded")


def test_a_replay_that_never_ends_leaves_the_worker_degraded_with_the_reason_then_exact():
    options = dataclasses.replace(TEST_OPTIONS, replay_timeout=0.5, replay_retries=2,
                                  retry_backoff=0.05, idle_check=0.5)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(5)
            for _ in range(4):
                ledger.publish(source.batch())
            pub.flush()
            pub.stall_replays()  # every batch, never the end marker
            index = OpLog()
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
            async with Running(sub):
                await wait_until(lambda: sub.status.state == "degraded",
                                 "the stuck rebuild to give up", detail=lambda: sub.status)
                assert "timed out (attempt 2/2)" in (sub.status.last_error or "")
                assert sub.status.replay_failures >= 1
                # The publisher answers again: an idle check retries the rebuild, and the
                # whole history makes the worker exact (live, not degraded) again.
                pub.stall_replays(False)
                await wait_until(lambda: sub.status.state == "live", "the retried rebuild",
                                 detail=lambda: sub.status)
                assert index.log(sub.worker) == ledger.truth(sub.worker)
    run(scenario)


def test_a_replay_that_trickles_past_its_deadline_is_given_up_not_left_replaying():
    # Each frame comes within replay_timeout, so only the deadline over the whole answer
    # can end it.
    options = dataclasses.replace(TEST_OPTIONS, replay_timeout=2.0, replay_retries=2,
                                  retry_backoff=0.05, replay_deadline=0.6, idle_check=60.0)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(6)
            for _ in range(40):
                ledger.publish(source.batch())
            pub.flush()
            pub.stall_replays(frame_delay=0.1)
            sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx, options=options)
            async with Running(sub):
                await wait_until(lambda: sub.status.state == "degraded",
                                 "the trickling replay to be given up", detail=lambda: sub.status)
                assert "did not finish within 0.6 s (attempt 2/2)" in sub.status.last_error
                pub.stall_replays(False)  # stop the trickle so the publisher closes quickly
    run(scenario)


def test_replays_at_once_are_bounded_across_the_fleet():
    pacing = FleetPacing(replay_concurrency=2)
    options = dataclasses.replace(TEST_OPTIONS, replay_timeout=5.0)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(7)
            for _ in range(30):
                ledger.publish(source.batch())
            pub.flush()
            pub.stall_replays(frame_delay=0.01)  # slow enough for answers to overlap
            index = OpLog()
            subs = [Subscriber(dataclasses.replace(endpoint_of(pub), dp_rank=rank), index,
                               ctx=ctx, options=options, pacing=pacing) for rank in range(6)]
            runners = [Running(sub) for sub in subs]
            try:
                for runner in runners:
                    await runner.__aenter__()
                await wait_until(lambda: pub.replays_served >= 4, "several replays asked")
                pub.stall_replays(False)
                await wait_until(lambda: all(caught_up(s, ledger, SERVING) for s in subs),
                                 "every worker rebuilt", detail=lambda: [s.status for s in subs])
            finally:
                await asyncio.gather(*(r.__aexit__(None, None, None) for r in runners))
            assert pacing.most_replays_running == 2  # the bound was reached, never passed
    run(scenario)


def test_idle_checks_reuse_one_socket_and_find_dropped_tail_batches():
    options = dataclasses.replace(TEST_OPTIONS, idle_check=0.2)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(8)
            ledger.publish(source.batch())
            index = OpLog()
            sub = Subscriber(endpoint_of(pub), index, ctx=ctx, options=options)
            async with Running(sub):
                await wait_until(lambda: caught_up(sub, ledger, SERVING), "the first batch")
                await wait_until(lambda: pub.replays_served >= 5, "several idle checks")
                assert sub._replayer.channel is not None
                assert sub._replayer.channel.opened == 1
                pub.drop_live([pub.next_seq])  # a tail batch sent only to the buffer
                ledger.publish(source.batch())
                await wait_until(lambda: caught_up(sub, ledger, ("live",)),
                                 "an idle check to find the dropped batch")
                assert index.log(sub.worker) == ledger.truth(sub.worker)
    run(scenario)


def test_replay_channels_kept_open_are_bounded_fleet_wide_and_checks_still_work():
    """More workers than the fleet may keep replay channels for (the open-file limit's
    share): at most that many DEALERs stay open between requests (one more per request in
    flight), the others are closed after their request, and every worker's idle checks still
    find its dropped tail batches."""
    pacing = FleetPacing(replay_concurrency=1)
    pacing.replay_channels.resize(2)
    options = dataclasses.replace(TEST_OPTIONS, idle_check=0.2)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(9)
            ledger.publish(source.batch())
            index = OpLog()
            subs = [Subscriber(dataclasses.replace(endpoint_of(pub), dp_rank=rank), index,
                               ctx=ctx, options=options, pacing=pacing) for rank in range(5)]
            most_open = 0

            async def watch() -> None:
                nonlocal most_open
                while True:
                    most_open = max(most_open, len(pacing.replay_channels))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            runners = [Running(sub) for sub in subs]
            try:
                for runner in runners:
                    await runner.__aenter__()
                await wait_until(lambda: all(caught_up(s, ledger, SERVING) for s in subs),
                                 "every worker rebuilt")
                served = pub.replays_served
                await wait_until(lambda: pub.replays_served >= served + 10,
                                 "idle checks of every worker")
                pub.drop_live([pub.next_seq])  # a tail batch only replays can bring
                ledger.publish(source.batch())
                await wait_until(lambda: all(caught_up(s, ledger, ("live",)) for s in subs),
                                 "idle checks on reopened channels to find the batch",
                                 detail=lambda: [s.status for s in subs])
                assert all(index.log(s.worker) == ledger.truth(s.worker) for s in subs)
            finally:
                watcher.cancel()
                await asyncio.gather(*(r.__aexit__(None, None, None) for r in runners))
            # Two kept, and one more open for the request in flight at most: reached,
            # never passed.
            assert most_open == 3
            assert pacing.replay_channels.closed_for_room > 0
            assert len(pacing.replay_channels) == 0  # stopped workers closed theirs
    run(scenario)


def test_idle_checks_that_find_nothing_back_off_until_a_live_batch_arrives():
    options = dataclasses.replace(TEST_OPTIONS, idle_check=0.05)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(9)
            ledger.publish(source.batch())
            sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx,
                             options=options, pacing=FleetPacing(jitter=0.0))
            async with Running(sub):
                await wait_until(lambda: caught_up(sub, ledger, ("live",)), "the first batch")
                first = pub.replays_served
                await asyncio.sleep(2.0)
                # At a fixed 0.05 s pace that would be about 40 checks; doubling to at most
                # IDLE_CHECK_BACKOFF (8) times 0.05 s makes it fewer than 10 (fewer still on
                # a slow machine, so this cannot fail for being slow).
                assert pub.replays_served - first < 12
                # A live batch ends the backoff: a dropped tail right after it is found by
                # the check at the set pace.
                ledger.publish(source.batch())
                await wait_until(lambda: caught_up(sub, ledger, ("live",)), "a live batch")
                pub.drop_live([pub.next_seq])
                ledger.publish(source.batch())
                await wait_until(lambda: caught_up(sub, ledger, ("live",)),
                                 "an idle check to find the dropped batch")
    run(scenario)


def _counted_quiet_waits(sub: Subscriber) -> Callable[[], int]:
    """Count `sub`'s quiet waits (each a wake-up of its task) from now; the count so far."""
    waits = 0
    wait_for_live = sub._wait_for_live

    async def counted(seconds: float) -> bool:
        nonlocal waits
        waits += 1
        return await wait_for_live(seconds)

    sub._wait_for_live = counted  # type: ignore[method-assign]
    return lambda: waits


def test_a_worker_that_never_had_a_batch_wakes_ever_less_often():
    """Most workers of a large idle fleet never hear a batch; each used to wake at the
    set pace for nothing (no tail to check): some 180 wake-ups a second at 1,024 workers."""
    options = dataclasses.replace(TEST_OPTIONS, idle_check=0.05)

    async def scenario(ctx):
        with EventPublisher() as pub:
            sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx,
                             options=options, pacing=FleetPacing(jitter=0.0))
            waits = _counted_quiet_waits(sub)
            async with Running(sub):
                await wait_until(lambda: sub.status.state == "live", "the worker live")
                first = waits()
                await asyncio.sleep(2.0)
                # At the fixed 0.05 s pace about 40 wake-ups; doubling to at most
                # IDLE_CHECK_BACKOFF (8) times 0.05 s, fewer than 12 (fewer still on a slow
                # machine, so this cannot fail for being slow).
                assert waits() - first < 12
                assert sub.status.last_seq is None  # still nothing heard
                # The rebuild's, and the one check after it for batches the subscription
                # may have missed on its way; then no tail to check.
                assert pub.replays_served == 2
    run(scenario)


def test_stopping_a_quiet_worker_ends_its_wait_at_once():
    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(10)
            ledger.publish(source.batch())
            sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx, options=TEST_OPTIONS)
            task = asyncio.create_task(sub.run())
            try:
                await wait_until(lambda: caught_up(sub, ledger, ("live",)), "the first batch")
                await asyncio.sleep(0.2)  # waiting for a live batch, the idle check 60 s away
                await sub.stop()
                # It returned by itself: stop() cancels a subscriber only after its timeout.
                assert task.done() and not task.cancelled()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    run(scenario)


def test_turns_hand_out_a_bounded_number_per_pass_of_the_loop_in_order():
    async def scenario(ctx):
        pacing = FleetPacing(turns_per_pass=4)
        passes = 0
        running = True

        def tick() -> None:  # counts passes of the loop
            nonlocal passes
            passes += 1
            if running:
                asyncio.get_running_loop().call_soon(tick)

        asyncio.get_running_loop().call_soon(tick)
        taken: list[tuple[int, int]] = []

        async def worker(number: int) -> None:
            await pacing.turn()
            taken.append((number, passes))

        await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(30))), 10)
        running = False
        assert [number for number, _ in taken] == list(range(30))  # in order of asking
        per_pass: dict[int, int] = {}
        for _, seen in taken:
            per_pass[seen] = per_pass.get(seen, 0) + 1
        assert max(per_pass.values()) <= 4 and len(per_pass) >= 30 // 4
    run(scenario)


def test_idle_checks_come_in_order_at_the_fleets_rate_and_a_place_given_up_takes_no_slot():
    async def scenario(ctx):
        pacing = FleetPacing(idle_checks_per_second=1 / 1.5)  # a place every 1.5 s
        loop = asyncio.get_running_loop()
        given: dict[str, float] = {}
        checks = {}
        for name in "abcd":
            checks[name] = pacing.ask_check()
            checks[name].add_done_callback(
                lambda check, name=name: check.cancelled() or given.setdefault(name, loop.time()))
        checks["b"].cancel()  # its worker heard a batch, or stopped
        assert pacing.checks_waiting == 2  # c and d ("a" had its place at once)
        await asyncio.wait_for(asyncio.gather(checks["c"], checks["d"]), 30)
        assert list(given) == ["a", "c", "d"]  # in order of asking
        # One every 1.5 s, never faster; c took b's slot (had b kept it, c would come 3 s
        # after a: 2.7 s leaves a stalled machine 1.2 s).
        # (Times seen by callbacks a pass after each place was given: 0.05 s for that.)
        assert 1.45 <= given["c"] - given["a"] < 2.7
        assert given["d"] - given["c"] >= 1.45
        assert pacing.checks_waiting == 0
    run(scenario)


def test_a_worker_waiting_for_its_check_place_still_takes_batches_and_stops_at_once():
    """After a hundred instances were added at once, their checks queued for some 16 s
    under the fleet's rate bound; a worker waiting for its place took no live batch, and
    removing one waited for its place (removing the hundred took 14 s)."""
    options = dataclasses.replace(TEST_OPTIONS, idle_check=0.05)

    async def scenario(ctx):
        with EventPublisher() as pub:
            ledger, source = Ledger(pub), EventSource(11)
            pacing = FleetPacing(idle_checks_per_second=1 / 3600)
            pacing.ask_check()  # takes the place given at once: the next is an hour away
            sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx, options=options,
                             pacing=pacing)
            waits = _counted_quiet_waits(sub)
            task = asyncio.create_task(sub.run())
            try:
                await wait_until(lambda: sub.status.state == "live", "the rebuild")
                await wait_until(lambda: pacing.checks_waiting == 1,
                                 "the check after the rebuild to wait for its place")
                first = waits()
                await asyncio.sleep(1.0)
                # It sleeps until its place comes, not a quiet spell (0.05 s here) at a time:
                # a thousand workers queued at start-up would wake a thousand times a second.
                assert waits() - first <= 1
                ledger.publish(source.batch())
                await wait_until(lambda: caught_up(sub, ledger, ("live",)),
                                 "the batch, taken while the check waits")
                assert pacing.checks_waiting == 0  # heard a batch: the place given up
                # Quiet again with a tail to check: the next check waits, and a stop ends
                # that wait at once (stop() cancels only after its timeout).
                await wait_until(lambda: pacing.checks_waiting == 1,
                                 "the next check to wait for its place")
                await asyncio.wait_for(sub.stop(timeout=3600), 30)
                assert task.done() and not task.cancelled()
                assert pacing.checks_waiting == 0
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    run(scenario)
