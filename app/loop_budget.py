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

Invariant: one budget per event loop (``shared_budget``); it is only used on its loop.
"""

from __future__ import annotations

import asyncio
import time
import weakref

#: Ingest work per turn of the loop: small beside the 50 ms a request may wait at worst,
#: big beside the ~0.05 ms a turn costs, so yielding costs little throughput.
TURN_SECONDS = 0.008
#: The share while requests are being answered: a route's few turns wait ~1 ms each, not 8.
SERVING_TURN_SECONDS = 0.001

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

    def exhausted(self) -> bool:
        """Whether this turn's ingest work is used up (starts the turn's clock if not)."""
        now = time.perf_counter()
        if self._since is None:
            self._since = now
            return False
        return now - self._since >= (self.serving_seconds if self.serving else self.seconds)

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
