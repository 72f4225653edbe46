"""Stopping a background task kvroute started.

`cancel_and_wait` is the one way a component ends its own task at stop or close: cancel it,
then wait until it has run its `finally` blocks, so nothing it holds (sockets, connections,
files) outlives the call. The task's cancellation is not an error of the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (nothing when None) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
