"""Sockets and open files sized for the fleet kvroute is configured to follow.

A worker's live side holds 3 ZMQ sockets and 4 open files (its SUB socket's mailbox and TCP
connection, and the monitor watching it connect: two sockets to ZMQ, the one it sends on
inside ZMQ and the PAIR kvroute reads, a mailbox each). Its replay channel (a DEALER and its
monitor) holds as many again while it is kept open between requests (`app.ingest.replay_channels`):
8 files for a worker that keeps both (measured: 6 eventfds and 2 TCP sockets per worker).
ZMQ's default limit of 1,023 sockets per context would stop a fleet at about 250 workers,
deep inside a subscriber; the process's open-file limit (often 1,024 soft) sooner.

Invariants: `fleet_context` is a new context whose socket limit covers `max_instances`
workers' worth of sockets, live and replay, twice: half of it stays free for sockets closed
and not yet taken down by ZMQ's own thread (ZMQ fixes the limit when a context opens its
first socket, so it is set before any); `raise_open_files` raises the soft open-file limit
toward what the configured workers need with every replay channel kept (and
`CLOSING_FILES` for sockets closing), up to the hard limit, and refuses with one sentence
naming the limit and the fleet's size only when not even their live sides,
`replay_concurrency` channels, `max_connections` client connections and `CLOSING_FILES`
fit. `replay_channels_room` is how many replay channels the open files left keep between
requests (every worker's when they fit; it never shrinks because workers leave), beside
`replay_concurrency` more that requests may open. An instance known only by its URL
counts as one worker (its data-parallel size is discovered later); `max_instances` bounds
the API's additions, and `room_for` refuses (one sentence) workers that the open-file or
the context's socket limit could not hold, before any socket is made.
"""

from __future__ import annotations

import resource

import zmq

from kvroute.app.config import ConfigError, Settings

__all__ = ["FILES_PER_WORKER", "LIVE_FILES", "REPLAY_CHANNEL_FILES", "SOCKETS_PER_WORKER",
           "configured_workers", "fleet_context", "raise_open_files", "replay_channels_room",
           "room_for"]

LIVE_FILES = 4  # a worker's SUB (mailbox, TCP) and its monitor's two mailboxes
REPLAY_CHANNEL_FILES = 4  # a kept DEALER (mailbox, TCP) and its monitor's two mailboxes
FILES_PER_WORKER = LIVE_FILES + REPLAY_CHANNEL_FILES  # with its replay channel kept
SOCKETS_PER_WORKER = 6
# The listening sockets, clients to the instances, logs and Python itself; the HTTP
# connections clients hold are counted apart (`max_connections`).
BASE_FILES = 256
ZMQ_DEFAULT_MAX_SOCKETS = 1023
# Kept free for sockets closed and not yet released while others open (a fleet change).
CLOSING_FILES = 512


def configured_workers(settings: Settings) -> int:
    return sum(max(1, len(instance.events or ())) for instance in settings.instances)


def fleet_context(settings: Settings) -> zmq.Context:
    """A ZMQ context for the fleet's subscribers, its socket limit sized for it: room for
    the sockets of `max_instances` workers, and as many again closing. ZMQ frees a closed
    socket's place only once its own thread has taken the socket down: a hundred instances
    removed and at once added again found the places of the removed ones still taken, and
    workers failed to open ("Too many open files"). A place costs ZMQ a few bytes."""
    workers = max(configured_workers(settings), settings.max_instances)
    context: zmq.Context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, max(ZMQ_DEFAULT_MAX_SOCKETS,
                                     2 * SOCKETS_PER_WORKER * workers + 64))
    return context


def _files(workers: int, channels: int, connections: int) -> int:
    return BASE_FILES + connections + LIVE_FILES * workers + REPLAY_CHANNEL_FILES * channels


def _fitting(workers: int, replay_concurrency: int, connections: int) -> tuple[int, int]:
    """(the files `workers` need at least: live sides, the replay channels that run at
    once, `connections` clients' and the files of sockets closing; the files with every
    worker's channel kept)."""
    return (_files(workers, min(workers, replay_concurrency), connections) + CLOSING_FILES,
            _files(workers, workers, connections) + CLOSING_FILES)


def _raise_soft(needed: int, wanted: int) -> int | None:
    """Raise the soft limit toward `wanted` (up to the hard one); the limit now, or None
    when the hard limit is below `needed`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        return None
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def raise_open_files(settings: Settings) -> int:
    """Raise the soft open-file limit to what the configured workers need (all their replay
    channels kept, when the hard limit allows); returns the limit now in force. Raises
    ConfigError when the hard limit is below their live sides and `replay_concurrency`
    replay channels."""
    workers = configured_workers(settings)
    needed, wanted = _fitting(workers, settings.replay_concurrency, settings.max_connections)
    limit = _raise_soft(needed, wanted)
    if limit is None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        raise ConfigError(f"{workers} configured workers and {settings.max_connections} "
                          f"client connections (`max_connections`) need at least {needed} open "
                          f"files; the process may open {hard} (RLIMIT_NOFILE hard limit: "
                          "raise `ulimit -n` or the container's nofile limit, follow fewer "
                          "workers or lower max_connections)", "instances")
    return limit


def replay_channels_room(workers: int, replay_concurrency: int,
                         connections: int) -> int | None:
    """How many replay channels may stay open between requests beside `workers` followed,
    within the soft open-file limit (None: no bound). Not capped at one per worker: a
    worker keeps at most one anyway, and a cap would shrink with every removal and close
    the channels of workers still stopping (a hundred instances removed at once: all their
    channels at once, in one long step, instead of each in its own subscriber's turn)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    # Channels opened beyond it for requests (at most replay_concurrency at once), and the
    # files of sockets closed but not yet released (ZMQ closes a socket in its own thread).
    spare = ((soft - _files(workers, replay_concurrency, connections) - CLOSING_FILES)
             // REPLAY_CHANNEL_FILES)
    return max(0, spare)


def room_for(workers: int, adding: int, context: zmq.Context,
             replay_concurrency: int, connections: int) -> str | None:
    """None when `adding` workers more than the `workers` followed fit the open-file limit
    (the soft limit is raised toward the hard one if that is what it takes; fewer replay
    channels kept if that is all there is room for) and the context's socket limit; else
    why not, in one sentence."""
    total = workers + adding
    sockets = context.get(zmq.MAX_SOCKETS) // 2  # half kept for sockets closing
    if SOCKETS_PER_WORKER * total > sockets:
        return (f"following {total} workers needs about {SOCKETS_PER_WORKER * total} ZMQ "
                f"sockets; kvroute's context keeps {sockets} for them, and as many for sockets "
                "closing (sized from max_instances at start: raise max_instances)")
    needed, wanted = _fitting(total, replay_concurrency, connections)
    if _raise_soft(needed, wanted) is None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return (f"following {total} workers needs at least {needed} open files; the process "
                f"may open {hard} (RLIMIT_NOFILE hard limit: raise `ulimit -n` or the "
                "container's nofile limit)")
    return None
