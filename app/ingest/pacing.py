"""What the subscribers of one kvroute share so that a fleet's cost stays bounded: how many
replays run at once, and how often quiet workers look for dropped tail batches.

Invariants:
- At most `replay_concurrency` replay requests are open at once across the fleet (each
  attempt holds a slot while it waits for and applies its answer; the backoff between
  attempts holds none), so a thousand workers connecting at once rebuild in waves, not one
  by one and not all at once against the publishers and the event loop.
- Idle checks (a replay from `last_seq + 1` after `idle_check` quiet seconds) start at most
  `idle_checks_per_second` times a second across the fleet, in order of asking
  (`ask_check`), and each worker's interval is jittered, so checks of workers that went
  quiet together spread over time. A check given up while it waits (its worker heard a
  batch, or stops) takes no slot.
- Opening and closing sockets (a subscriber's live connection, a replay channel) and the
  start of a rebuild once a live connection is up are done in turns (`turn`), handed out in
  order of asking: in one pass of the event loop at most `turns_per_pass` of them, and none
  once `pass_budget` seconds have passed since the pass's first turn was taken (what runs
  after a turn until its task next waits counts too). So a pass holds at most `pass_budget`
  plus one piece of such work, whatever the pieces cost: a hundred instances added or
  removed at once start and stop in pieces of about half a millisecond, with routes answered
  between them, not in one stall. After a pass that took turns, while others wait, no turn
  is taken for `rest` times as long as that pass's turns took, so a burst of this work keeps
  to about 1 / (1 + rest) of the process's time; `routing_rest` instead while routes are
  being asked (`routing`: the service says whether one was decided lately), so a change
  made while routes are asked takes longer and leaves their answers their usual time.
  (`app.http.paced_changes` makes API registrations and removals wait for a turn as well.) A
  pass wakes about as many waiters as the last one let through, so a waiter is seldom
  woken only to wait again.
- The replay channels kept open between requests are bounded fleet-wide
  (`replay_channels`).
Made on the event loop that runs the subscribers; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvroute.app.ingest.replay_channels import KeptChannels

__all__ = ["FleetPacing"]


def _never() -> bool:
    return False


class FleetPacing:
    def __init__(self, replay_concurrency: int = 32, idle_checks_per_second: float = 50.0,
                 *, jitter: float = 0.5, rng: random.Random | None = None,
                 turns_per_pass: int = 16, pass_budget: float = 0.0005, rest: float = 3.0,
                 routing_rest: float = 16.0, routing: Callable[[], bool] = _never,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if replay_concurrency < 1 or idle_checks_per_second <= 0:
            raise ValueError("replay_concurrency and idle_checks_per_second must be positive")
        self._replays = asyncio.Semaphore(replay_concurrency)
        self.replay_concurrency = replay_concurrency
        self.replays_running = 0
        self.most_replays_running = 0  # the high-water mark, for tests and benchmarks
        self._interval = 1.0 / idle_checks_per_second
        self._next_check = 0.0  # loop.time() of the next free idle-check slot
        self._check_waiters: deque[asyncio.Future[None]] = deque()  # in order of asking
        self._check_timer: asyncio.TimerHandle | None = None  # the next slot's, if any wait
        self._jitter = jitter
        self._rng = rng or random.Random()
        self._turns_per_pass = turns_per_pass
        self._pass_budget = pass_budget
        self._rest = rest
        self._routing_rest = routing_rest
        self._routing = routing
        self._clock = clock
        self._turns_taken = 0  # in this pass of the loop
        self._pass_began: float | None = None  # clock() at this pass's first turn
        self._turn_waiters: deque[asyncio.Future[None]] = deque()
        self._woken = 0  # waiters told to go on and not yet resumed: they come first
        self._requeued = 0  # woken waiters sent back this pass (to the front, in order)
        # Waiters told to go on per pass: one more than took a turn in the last pass whose
        # budget sent some back, doubling (up to turns_per_pass) while none is sent back.
        self._wake_per_pass = turns_per_pass
        self.sent_back = 0  # woken waiters the budget sent back, in all (tests, benchmarks)
        self._next_pass_scheduled = False
        # Replay channels kept open between requests (app.ingest.replay_channels); the registry
        # sets its capacity from the open files the fleet leaves.
        self.replay_channels = KeptChannels()

    @contextlib.asynccontextmanager
    async def replay_slot(self) -> AsyncIterator[None]:
        """Hold one of the fleet's replay slots (waiting for one first)."""
        async with self._replays:
            self.replays_running += 1
            self.most_replays_running = max(self.most_replays_running, self.replays_running)
            try:
                yield
            finally:
                self.replays_running -= 1

    def idle_after(self, idle_check: float) -> float:
        """A quiet spell to wait before the next idle check: `idle_check` give or take
        `jitter` of it."""
        return idle_check * (1 + self._jitter * (2 * self._rng.random() - 1))

    def ask_check(self) -> asyncio.Future[None]:
        """A place in the fleet's queue of idle checks: the future is done when this check
        may start (places are given in order of asking, one every 1 / idle_checks_per_second
        seconds). Cancelled before then, it gives its place up and takes no slot: a worker
        that hears a batch or stops while it waits does not delay the checks behind it."""
        waiter = asyncio.get_running_loop().create_future()
        self._check_waiters.append(waiter)
        if self._check_timer is None:
            self._give_checks()
        return waiter

    @property
    def checks_waiting(self) -> int:
        """Idle checks waiting for their place (for tests and benchmarks)."""
        return sum(not waiter.done() for waiter in self._check_waiters)

    def _give_checks(self, slot_came: bool = False) -> None:
        """Give the first waiting check its place if its slot has come (`slot_came`: this
        is the timer set for it, which the loop may run a little early); come back at the
        next slot while any wait."""
        self._check_timer = None
        loop = asyncio.get_running_loop()
        waiters = self._check_waiters
        while waiters:
            if waiters[0].done():  # cancelled: its place is given up
                waiters.popleft()
                continue
            now = loop.time()
            if not (slot_came or now >= self._next_check):
                self._check_timer = loop.call_at(self._next_check, self._give_checks, True)
                return
            waiters.popleft().set_result(None)
            self._next_check = max(now, self._next_check) + self._interval
            slot_came = False

    async def turn(self) -> None:
        """Wait for a turn to do a piece of work that cannot be cut (a subscriber opening or
        closing its sockets): turns are handed out in order of asking, at most
        `turns_per_pass` in each pass of the event loop and none past its `pass_budget`."""
        if not self._turn_waiters and not self._woken and self._may_take():
            self._take()
            return
        loop = asyncio.get_running_loop()
        place: int | None = None  # None: at the back; else where a sent-back waiter goes
        while True:
            waiter = loop.create_future()
            if place is None:
                self._turn_waiters.append(waiter)
            else:
                self._turn_waiters.insert(place, waiter)
            self._schedule_next_pass()
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._woken -= 1  # woken, then cancelled before it resumed
                else:
                    with contextlib.suppress(ValueError):
                        self._turn_waiters.remove(waiter)
                raise
            self._woken -= 1
            if self._may_take():
                self._take()
                return
            # The pass's budget went to the turns before this one: first in the next pass.
            place = self._requeued
            self._requeued += 1
            self.sent_back += 1

    def _may_take(self) -> bool:
        if self._turns_taken >= self._turns_per_pass:
            return False
        began = self._pass_began
        return began is None or self._clock() - began < self._pass_budget

    def _take(self) -> None:
        self._turns_taken += 1
        if self._pass_began is None:
            self._pass_began = self._clock()
        self._schedule_next_pass()

    def _schedule_next_pass(self) -> None:
        if not self._next_pass_scheduled:
            self._next_pass_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        """A new pass of the loop: its budget is whole again, and the next waiters are told
        to go on (they run in the pass after this one, each as its task resumes, and take
        their turn then if the budget still allows; if not, they wait again, first)."""
        self._next_pass_scheduled = False
        began, self._pass_began = self._pass_began, None
        if began is not None:
            # Each waiter woken and sent back cost its task a step for nothing (thirty
            # steps per worker when a hundred instances were added at once): wake about as
            # many as the budget let through.
            if self._requeued:
                self._wake_per_pass = self._turns_taken + 1
            else:
                self._wake_per_pass = min(self._turns_per_pass, 2 * self._wake_per_pass)
        self._requeued = 0
        if began is not None and self._turn_waiters:
            rest = self._routing_rest if self._routing() else self._rest
            if rest > 0:
                # A rest as long as the pass's turns took times `rest`, with no turn taken
                # meanwhile (so a burst of such work never holds more than its share of
                # the process's time: the machine stays free for the routes' answers).
                self._turns_taken = self._turns_per_pass
                self._next_pass_scheduled = True
                asyncio.get_running_loop().call_later(
                    (self._clock() - began) * rest, self._next_pass)
                return
        self._turns_taken = 0
        woken = 0
        while self._turn_waiters and woken < self._wake_per_pass:
            waiter = self._turn_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
        self._woken += woken
        if self._turn_waiters or woken:
            self._schedule_next_pass()
