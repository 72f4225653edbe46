"""One budget of ingest work per turn of the event loop, shared by every subscriber.

Each subscriber already works in bounded pieces and yields between them (``ingest.apply``),
but a yield only moves it to the back of the loop's ready queue: when 32 or 64 workers all
have batches queued, one turn of the loop runs a piece of each of them before any HTTP
request or timer gets its turn, and the stall grows with the fleet.

``LoopBudget`` bounds the ingest work of a turn as a whole: the clock starts at the first
piece of work asked for in a turn (``exhausted``), and once ``seconds`` have gone by, every
subscriber that asks parks (``next_turn``) instead of going on.

Parked subscribers are woken ONE per turn, in the order they parked, and the clock restarts
just before the woken one runs. Waking all of them every turn (an ``asyncio.sleep(0)``
each) put every parked subscriber in front of the HTTP callbacks of each turn: each took a
piece of work (decoding a batch) before it found the budget used up, so a turn of a burst
from 64 workers ran one batch per parked subscriber, far past the budget. Now a turn holds
the budget plus one piece of work of each subscriber that a live message woke meanwhile
(which then parks too), and the one woken has a budget's worth of its backlog to do.

A request is read only between two turns, so one whose bytes arrive while ingest runs
would wait for the rest of the turn: the budget also counts as used up as soon as bytes
wait on a watched HTTP connection (``watch``: ``app.server`` watches each one; an epoll
asked without waiting, at a piece of ingest at most every ``LOOK_SECONDS``: asked at every
piece, that system call was a sixth of the loop thread's time while it ingested). The turn
then ends after the piece under way, the loop reads the request, and from its first byte
to its answer's last (``serving``, counted by ``app.server``) a turn's share is
``serving_seconds``: the request's task waits behind the turn in front of it. The first
piece of each turn is always allowed, so a steady flow of requests slows ingest, never
stops it. (A new connection's first bytes
are seen once the loop has accepted it: the listening socket is not watched.)

Invariants: one budget per event loop (``shared_budget``), used only on its loop; every
parked caller is woken (or was cancelled) within as many turns as callers parked before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
import weakref
from collections import deque

#: Ingest work per turn of the loop: timers (and new connections) wait for the rest of it,
#: and a turn's own cost (waking one subscriber) stays small beside it.
TURN_SECONDS = 0.002
#: The share while requests are being answered: the turn in front of a request's task.
SERVING_TURN_SECONDS = 0.00005
#: How often, at most, a turn looks for bytes waiting on a watched connection: what it adds
#: to a request's wait at most, beside the piece of work under way.
LOOK_SECONDS = 0.0001

_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBudget] = (
    weakref.WeakKeyDictionary())


class LoopBudget:
    def __init__(self, seconds: float = TURN_SECONDS,
                 serving_seconds: float = SERVING_TURN_SECONDS,
                 look_seconds: float = LOOK_SECONDS) -> None:
        self.seconds = seconds
        self.serving_seconds = min(serving_seconds, seconds)
        self.look_seconds = look_seconds
        self._next_look = 0.0  # perf_counter() from which exhausted() looks again
        self.serving = 0  # requests being answered now (app.server counts them)
        self.turns = 0  # turns started for parked callers (for tests and benchmarks)
        self._since: float | None = None  # when this turn's ingest work began
        self._parked: deque[asyncio.Future[None]] = deque()
        self._turn_queued = False
        # HTTP connections (fd -> owner) whose waiting bytes end a turn; no epoll: none.
        self._watched: dict[int, object] = {}
        self._arrivals = select.epoll() if hasattr(select, "epoll") else None

    def exhausted(self) -> bool:
        """Whether this turn's ingest work is used up (starts the turn's clock if not):
        its share of time has gone by, or a request waits to be read."""
        now = time.perf_counter()
        if self._since is None:
            self._since = now
            return False
        if now - self._since >= (self.serving_seconds if self.serving else self.seconds):
            return True
        if now < self._next_look:  # looked moments ago
            return False
        self._next_look = now + self.look_seconds
        return self.requests_waiting()

    def stretch(self) -> tuple[float, int] | None:
        """For ingest done in one compiled call (``BatchApplier.drain``): None when this turn's
        work is used up (``exhausted``), else when the turn's share ends (on
        ``time.perf_counter``'s clock) and the epoll descriptor that is ready when a request
        waits (-1: no connection watched). The call looks at it every ``look_seconds``, as
        ``exhausted`` does, and stops when it is ready or the share is over."""
        if self.exhausted():
            return None
        assert self._since is not None  # started by exhausted()
        share = self.serving_seconds if self.serving else self.seconds
        arrivals = self._arrivals.fileno() if self._arrivals is not None and self._watched else -1
        return self._since + share, arrivals

    def look_now(self) -> None:
        """The next ``exhausted`` looks for waiting requests whatever the interval (a
        compiled call saw one)."""
        self._next_look = 0.0

    @property
    def watching(self) -> int:
        """HTTP connections watched now."""
        return len(self._watched)

    def requests_waiting(self) -> bool:
        """Whether bytes wait unread on a watched HTTP connection."""
        return bool(self._watched) and bool(self._arrivals.poll(0, 1))  # type: ignore[union-attr]

    def watch(self, fd: int, owner: object) -> None:
        """Count bytes waiting on ``fd`` (an HTTP connection of ``owner``'s) as a request
        waiting, until ``unwatch``."""
        if self._arrivals is None:
            return
        try:
            self._arrivals.register(fd, select.EPOLLIN)
        except FileExistsError:  # a closed connection's number, reused before its unwatch
            self._arrivals.modify(fd, select.EPOLLIN)
        self._watched[fd] = owner

    def unwatch(self, fd: int, owner: object) -> None:
        """Stop watching ``fd`` for ``owner`` (a later owner of the same number stays)."""
        if self._arrivals is None or self._watched.get(fd) is not owner:
            return
        del self._watched[fd]
        with contextlib.suppress(OSError):  # closed already: epoll dropped it by itself
            self._arrivals.unregister(fd)

    async def next_turn(self) -> None:
        """Park until a later turn of the loop gives this caller a whole budget (one caller
        per turn, in the order they parked)."""
        loop = asyncio.get_running_loop()
        if not self._turn_queued:
            # Nobody parked since the last turn: the next one is this caller's, right after
            # the callback that starts it (no future, no extra turn to be woken in).
            self._turn_queued = True
            loop.call_soon(self._next_turn)
            await asyncio.sleep(0)
        else:
            waiter: asyncio.Future[None] = loop.create_future()
            self._parked.append(waiter)
            await waiter
        self.exhausted()  # the turn's clock starts with this caller's work

    def _next_turn(self) -> None:
        """Start a turn: restart the clock, and wake the first caller still parked, whose
        task runs in the next turn, right after this callback's next run."""
        self._since = None
        self.turns += 1
        while self._parked:
            waiter = self._parked.popleft()
            if not waiter.done():  # a cancelled caller gave its place up
                # Queued before the waiter's wake-up, so it runs just before it.
                asyncio.get_running_loop().call_soon(self._next_turn)
                waiter.set_result(None)
                return
        self._turn_queued = False


def shared_budget() -> LoopBudget:
    """The running loop's budget (created on first use)."""
    loop = asyncio.get_running_loop()
    budget = _budgets.get(loop)
    if budget is None:
        budget = _budgets[loop] = LoopBudget()
    return budget
