"""One budget of ingest work per turn of the event loop, shared by every subscriber.

Each subscriber already works in bounded pieces and yields between them (``batch_apply``),
but a yield only moves it to the back of the loop's ready queue: when 32 or 64 workers all
have batches queued, one turn of the loop runs a piece of each of them before any HTTP
request or timer gets its turn, and the stall grows with the fleet.

``LoopBudget`` bounds the ingest work of a turn as a whole: the first piece of work started
in a turn starts its clock, and once ``seconds`` have gone by, every subscriber that asks
(``exhausted``) yields (``next_turn``) until the loop has started a new turn. The clock
restarts from a callback queued before the subscribers' wake-ups, so requests and timers
that became ready meanwhile run after at most about ``seconds`` plus one piece of work.

While HTTP requests are being answered (``serving``, counted by ``app.server`` from a
request's first byte to its answer's last), a turn's share shrinks to ``serving_seconds``:
answering one request takes several turns of the loop (its bytes arrive, its task starts,
its body is read, its answer is sent), and each of them waited behind a whole share, so a
route answered during a burst took 3-4 shares longer than an idle one. Ingest still runs
in every turn, so a steady flow of requests slows it, never stops it.

A request's bytes only count as "being answered" once the loop has read them, which it does
between turns: a request arriving while ingest works waited out the rest of a whole idle
share (8 ms) before it was even read. So the budget also watches the HTTP sockets itself
(``watch``: every open connection, in an epoll set of its own, Linux): past
``PROBE_SECONDS`` of a turn's work, a connection with bytes waiting ends the turn's share
at once, and the next turn reads them. The check is one
non-blocking ``epoll_wait`` per piece of work; without epoll the shares alone apply.

Invariant: one budget per event loop (``shared_budget``); it is only used on its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
import weakref

#: Ingest work per turn of the loop: small beside the 50 ms a request may wait at worst,
#: big beside the ~0.05 ms a turn costs, so yielding costs little throughput.
TURN_SECONDS = 0.008
#: The share while requests are being answered: a route's few turns wait ~1 ms each, not 8.
SERVING_TURN_SECONDS = 0.001
#: Work in a turn before waiting HTTP bytes are looked for: a piece of ingest always runs,
#: and the look (a system call) is not paid on every tiny piece.
PROBE_SECONDS = 0.0002

_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBudget] = (
    weakref.WeakKeyDictionary())


class LoopBudget:
    def __init__(self, seconds: float = TURN_SECONDS,
                 serving_seconds: float = SERVING_TURN_SECONDS) -> None:
        self.seconds = seconds
        self.serving_seconds = min(serving_seconds, seconds)
        self.serving = 0  # requests being answered now (app.server counts them)
        self._since: float | None = None  # when this turn's ingest work began
        self._restart_queued = False
        # The HTTP sockets, watched for bytes waiting to be read (None: no epoll here).
        self._sockets = select.epoll() if hasattr(select, "epoll") else None
        self._watched: set[int] = set()

    def watch(self, fd: int) -> None:
        """Let bytes waiting on `fd` (an HTTP socket) end the turn's share early."""
        if self._sockets is None or fd < 0:
            return
        try:
            if fd in self._watched:  # a number reused before its old socket was unwatched
                self._sockets.modify(fd, select.EPOLLIN)
            else:
                self._sockets.register(fd, select.EPOLLIN)
        except OSError:  # closed meanwhile: nothing to watch
            return
        self._watched.add(fd)

    def unwatch(self, fd: int) -> None:
        """Stop watching `fd` (before it is closed: its number may be reused)."""
        if fd in self._watched:
            self._watched.discard(fd)
            with contextlib.suppress(OSError, ValueError):
                self._sockets.unregister(fd)  # type: ignore[union-attr]

    def exhausted(self) -> bool:
        """Whether this turn's ingest work is used up (starts the turn's clock if not): its
        share is spent, or bytes of HTTP work are waiting to be read."""
        now = time.perf_counter()
        if self._since is None:
            self._since = now
            return False
        spent = now - self._since
        if spent >= (self.serving_seconds if self.serving else self.seconds):
            return True
        return (spent >= PROBE_SECONDS and bool(self._watched)
                and bool(self._sockets.poll(0)))  # type: ignore[union-attr]

    async def next_turn(self) -> None:
        """Yield until the loop's next turn, restarting the clock there."""
        if not self._restart_queued:
            self._restart_queued = True
            asyncio.get_running_loop().call_soon(self._restart)
        await asyncio.sleep(0)

    def _restart(self) -> None:
        self._restart_queued = False
        self._since = None


def shared_budget() -> LoopBudget:
    """The running loop's budget (created on first use)."""
    loop = asyncio.get_running_loop()
    budget = _budgets.get(loop)
    if budget is None:
        budget = _budgets[loop] = LoopBudget()
    return budget
