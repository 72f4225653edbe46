"""What the subscribers of one kvroute share so that a fleet's cost stays bounded: how many
replays run at once, and how often quiet workers look for dropped tail batches.

Invariants:
- At most `replay_concurrency` replay requests are open at once across the fleet (each
  attempt holds a slot while it waits for and applies its answer; the backoff between
  attempts holds none), so a thousand workers connecting at once rebuild in waves, not one
  by one and not all at once against the publishers and the event loop.
- Idle checks (a replay from `last_seq + 1` after `idle_check` quiet seconds) start at most
  `idle_checks_per_second` times a second across the fleet, and each worker's interval is
  jittered, so checks of workers that went quiet together spread over time.
- At most `turns_per_pass` subscribers open or close their sockets in one pass of the event
  loop (`turn`): a hundred instances added or removed at once start and stop in a few
  milliseconds' pieces, with routes answered between them, not in one stall.
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
from collections.abc import AsyncIterator

from kvroute.app.replay_channels import KeptChannels

__all__ = ["FleetPacing"]


class FleetPacing:
    def __init__(self, replay_concurrency: int = 32, idle_checks_per_second: float = 50.0,
                 *, jitter: float = 0.5, rng: random.Random | None = None,
                 turns_per_pass: int = 16) -> None:
        if replay_concurrency < 1 or idle_checks_per_second <= 0:
            raise ValueError("replay_concurrency and idle_checks_per_second must be positive")
        self._replays = asyncio.Semaphore(replay_concurrency)
        self.replay_concurrency = replay_concurrency
        self.replays_running = 0
        self.most_replays_running = 0  # the high-water mark, for tests and benchmarks
        self._interval = 1.0 / idle_checks_per_second
        self._next_check = 0.0  # time.monotonic() of the next free idle-check slot
        self._jitter = jitter
        self._rng = rng or random.Random()
        self._turns_per_pass = turns_per_pass
        self._turns_taken = 0  # in this pass of the loop
        self._turn_waiters: deque[asyncio.Future[None]] = deque()
        self._next_pass_scheduled = False
        # Replay channels kept open between requests (app.replay_channels); the registry
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

    async def idle_check_slot(self) -> None:
        """Wait for this check's turn under the fleet's rate bound (slots are handed out in
        order of asking, one every 1/idle_checks_per_second seconds)."""
        now = time.monotonic()
        slot = max(now, self._next_check)
        self._next_check = slot + self._interval
        if slot > now:
            await asyncio.sleep(slot - now)

    async def turn(self) -> None:
        """Wait for a turn to do a piece of work that cannot be cut (a subscriber opening or
        closing its sockets): turns are handed out in order of asking, `turns_per_pass` in
        each pass of the event loop."""
        if self._turns_taken < self._turns_per_pass and not self._turn_waiters:
            self._turns_taken += 1
            self._schedule_next_pass()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._turn_waiters.append(waiter)
        self._schedule_next_pass()
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._turn_waiters.remove(waiter)
            raise

    def _schedule_next_pass(self) -> None:
        if not self._next_pass_scheduled:
            self._next_pass_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        """A new pass of the loop: the next waiters get its turns (they run in the pass
        after this one, each as its task resumes)."""
        self._next_pass_scheduled = False
        self._turns_taken = 0
        while self._turn_waiters and self._turns_taken < self._turns_per_pass:
            waiter = self._turn_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._turns_taken += 1
        if self._turn_waiters or self._turns_taken:
            self._schedule_next_pass()
