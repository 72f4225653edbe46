"""A worker that finds the process out of sockets or open files when it starts (sockets of
workers removed a moment ago still closing, a hundred instances added at once) is down
with the reason and opens once there is room again, instead of staying down for good.
Real publishers over loopback TCP, a real ZMQ context whose socket limit is reached."""

from __future__ import annotations

import resource

import pytest
import zmq
import zmq.asyncio

from kvroute.app.config import Settings
from kvroute.app.fleet.limits import SOCKETS_PER_WORKER, fleet_context, room_for
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

# A worker's live side (SUB and its monitor: 3 ZMQ sockets) and replay channel (3 more).
ROOM = 6


def test_a_worker_out_of_sockets_is_down_with_the_reason_and_opens_when_room_returns():
    async def scenario(_ctx: zmq.asyncio.Context) -> None:
        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, ROOM)  # before its first socket, as kvroute's own
        fillers = [ctx.socket(zmq.PAIR) for _ in range(ROOM)]
        try:
            with EventPublisher() as pub:
                ledger, source = Ledger(pub), EventSource(3)
                for _ in range(3):
                    ledger.publish(source.batch())
                pub.flush()
                sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx, options=TEST_OPTIONS,
                                 pacing=FleetPacing())
                async with Running(sub):
                    await wait_until(lambda: "retrying" in (sub.status.last_error or ""),
                                     "the worker to say it has no room",
                                     detail=lambda: sub.status)
                    assert sub.status.state == "down"
                    assert "Too many open files" in sub.status.last_error
                    for socket in fillers:
                        socket.close(0)
                    await wait_until(lambda: caught_up(sub, ledger),
                                     "the worker to open once there is room",
                                     detail=lambda: sub.status)
        finally:
            for socket in fillers:
                socket.close(0)
            ctx.destroy(linger=0)

    run(scenario)


def test_a_worker_with_no_room_for_its_replay_socket_rebuilds_once_there_is_room():
    """Its live side opens, its rebuild's replay channel cannot: it is not left `replaying`
    with nothing to end it; the rebuild is redone and the worker goes live."""
    async def scenario(_ctx: zmq.asyncio.Context) -> None:
        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, ROOM)
        fillers = [ctx.socket(zmq.PAIR) for _ in range(ROOM // 2)]  # the live side fits
        try:
            with EventPublisher() as pub:
                ledger, source = Ledger(pub), EventSource(4)
                for _ in range(3):
                    ledger.publish(source.batch())
                pub.flush()
                sub = Subscriber(endpoint_of(pub), OpLog(), ctx=ctx, options=TEST_OPTIONS,
                                 pacing=FleetPacing())
                async with Running(sub):
                    await wait_until(lambda: "Too many open files" in (sub.status.last_error
                                                                       or ""),
                                     "the replay to find no room", detail=lambda: sub.status)
                    assert sub.status.last_seq is None
                    for socket in fillers:
                        socket.close(0)
                    await wait_until(lambda: caught_up(sub, ledger),
                                     "the rebuild to be redone once there is room",
                                     detail=lambda: sub.status)
        finally:
            for socket in fillers:
                socket.close(0)
            ctx.destroy(linger=0)

    run(scenario)


def test_the_fleets_context_holds_its_sockets_while_as_many_are_still_closing():
    """A fleet at `max_instances` workers whose instances are all removed and added again at
    once: the removed workers' sockets keep their places until ZMQ's thread takes them
    down, and the new ones must still open (admission counts the workers followed)."""
    workers = 100
    needed = 2 * SOCKETS_PER_WORKER * workers  # eventfds: one open file per socket
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed + 256:
        pytest.skip(f"the hard open-file limit ({hard}) is below {needed + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed + 256), hard))
    ctx = fleet_context(Settings(max_instances=workers))
    opened: list[zmq.Socket] = []
    try:
        assert room_for(0, workers, ctx, replay_concurrency=32, connections=1024) is None
        closing = [ctx.socket(zmq.PAIR) for _ in range(SOCKETS_PER_WORKER * workers)]
        opened += closing  # stand-ins for sockets closed and not yet taken down
        opened += [ctx.socket(zmq.PAIR) for _ in range(SOCKETS_PER_WORKER * workers)]
    finally:
        for socket in opened:
            socket.close(0)
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
