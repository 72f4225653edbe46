"""The replay channels (a DEALER and its monitor, four open files) the fleet keeps open
between requests, bounded so that a fleet larger than the open-file limit allows for one
per worker still fits.

A worker's idle checks reuse its channel while it is kept. When every worker's channel fits
the open files kvroute may use (`app.fleet.limits.replay_channels_room`), every one is
kept, as if there were no bound. Past that, the channels kept stay kept, and a worker
without one opens a channel for its request and closes it after: the checks of quiet
workers come round in a cycle, and evicting the least recently used channel to keep the
newest would make every check open a channel; this way the kept ones are reused.

Invariants: at most `capacity` channels stay open between requests; more are open only
while requests use them (the fleet's replay slots bound those: `replay_concurrency`). A
channel in use is never closed from here. Made and used on one event loop.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["KeptChannels"]


class _Channel(Protocol):
    in_use: bool

    def close(self) -> None: ...


class KeptChannels:
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # None: no bound
        self._open: dict[int, _Channel] = {}  # by id(), first opened first
        self.closed_for_room = 0  # channels closed for want of room, for tests and benchmarks

    def __len__(self) -> int:
        return len(self._open)

    def resize(self, capacity: int | None) -> None:
        """A new bound (None: none), applied at once: channels not in use beyond it are
        closed now, before the workers that made it smaller open their sockets."""
        self.capacity = capacity
        # The usual case: no copy of a fleet's channels.
        if capacity is None or len(self._open) <= capacity:
            return
        for channel in list(self._open.values()):
            if len(self._open) <= capacity:
                return
            if not channel.in_use:
                channel.close()  # tells closed()
                self.closed_for_room += 1

    def opened(self, channel: _Channel) -> None:
        """`channel` has just opened its sockets, for a request."""
        self._open[id(channel)] = channel

    def keep(self, channel: _Channel) -> bool:
        """`channel` served a request and could be reused: whether there is room to keep it
        (if not, its owner closes it)."""
        if self.capacity is None or len(self._open) <= self.capacity:
            return True
        self.closed_for_room += 1
        return False

    def closed(self, channel: _Channel) -> None:
        self._open.pop(id(channel), None)
