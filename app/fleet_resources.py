"""Sockets and open files sized for the fleet kvroute is configured to follow.

Each worker holds up to `SOCKETS_PER_WORKER` ZMQ sockets (its live SUB and the monitor that
watches it connect, its replay DEALER and that one's monitor; a monitor is two sockets to
ZMQ, the one it sends on inside ZMQ and the PAIR kvroute reads) and about `FILES_PER_WORKER`
file descriptors (a socket's mailbox, its TCP connection, the monitors' pairs). ZMQ's
default limit of 1,023 sockets per context would stop a fleet at about 250 workers, deep
inside a subscriber; the process's open-file limit (often 1,024 soft) sooner.

Invariants: `fleet_context` is a new context whose socket limit covers `max_instances`
workers' worth of sockets (ZMQ fixes the limit when a context opens its first socket, so
it is set before any); `raise_open_files` raises the soft open-file limit to what the
configured workers need, up to the hard limit, or refuses with one sentence naming the
limit and the fleet's size. An instance known only by its URL counts as one worker (its
data-parallel size is discovered later); `max_instances` bounds the API's additions, and
`room_for` refuses (one sentence) workers that the open-file or the context's socket limit
could not hold, before any of their sockets is made.
"""

from __future__ import annotations

import resource

import zmq
import zmq.asyncio

from kvroute.app.config import ConfigError, Settings

__all__ = ["FILES_PER_WORKER", "SOCKETS_PER_WORKER", "configured_workers", "fleet_context",
           "raise_open_files", "room_for"]

SOCKETS_PER_WORKER = 6
FILES_PER_WORKER = 8
# The HTTP server, clients, logs and Python itself.
BASE_FILES = 256
ZMQ_DEFAULT_MAX_SOCKETS = 1023


def configured_workers(settings: Settings) -> int:
    return sum(max(1, len(instance.events or ())) for instance in settings.instances)


def fleet_context(settings: Settings) -> zmq.asyncio.Context:
    """A ZMQ context for the fleet's subscribers, its socket limit sized for it."""
    workers = max(configured_workers(settings), settings.max_instances)
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, max(ZMQ_DEFAULT_MAX_SOCKETS,
                                     SOCKETS_PER_WORKER * workers + 64))
    return context


def raise_open_files(settings: Settings) -> int:
    """Raise the soft open-file limit to what the configured workers need; returns the
    limit now in force. Raises ConfigError when the hard limit is below that."""
    workers = configured_workers(settings)
    needed = BASE_FILES + FILES_PER_WORKER * workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"{workers} configured workers need about {needed} open files; "
                          f"the process may open {hard} (RLIMIT_NOFILE hard limit: raise "
                          "`ulimit -n` or the container's nofile limit, or follow fewer "
                          "workers)", "instances")
    target = needed if hard == resource.RLIM_INFINITY else min(hard, max(needed, soft))
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def room_for(workers: int, adding: int, context: zmq.Context) -> str | None:
    """None when `adding` workers more than the `workers` followed fit the open-file limit
    (the soft limit is raised toward the hard one if that is what it takes) and the
    context's socket limit; else why not, in one sentence."""
    total = workers + adding
    sockets = context.get(zmq.MAX_SOCKETS)
    if SOCKETS_PER_WORKER * total > sockets:
        return (f"following {total} workers needs about {SOCKETS_PER_WORKER * total} ZMQ "
                f"sockets; kvroute's context holds {sockets} (sized from max_instances at "
                "start: raise max_instances)")
    needed = BASE_FILES + FILES_PER_WORKER * total
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    if hard != resource.RLIM_INFINITY and hard < needed:
        return (f"following {total} workers needs about {needed} open files; the process "
                f"may open {hard} (RLIMIT_NOFILE hard limit: raise `ulimit -n` or the "
                "container's nofile limit)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return None
