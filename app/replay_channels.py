"""The replay channels (a DEALER and its monitor, four open files) the fleet keeps open
between requests, bounded so that a fleet larger than the open-file limit allows for one
per worker still fits.

A worker's idle checks reuse its channel while it is kept. When every worker's channel fits
the open files kvroute may use (`app.fleet_resources.replay_channels_room`), every one is
kept, as if there were no bound. Past that, opening one more closes the channel used least
recently that no request is using; its worker opens a new one when it next asks.

Invariants: at most `capacity` channels are open, except while more than `capacity` are in
use by requests at once (the fleet's replay slots bound those, and the capacity is never set
below them); a channel in use is never closed from here. Made and used on one event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

__all__ = ["KeptChannels"]


class _Channel(Protocol):
    in_use: bool

    def close(self) -> None: ...


class KeptChannels:
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # None: no bound
        self._open: OrderedDict[int, _Channel] = OrderedDict()  # least recently used first
        self.closed_for_room = 0  # channels closed to make room, for tests and benchmarks

    def __len__(self) -> int:
        return len(self._open)

    def resize(self, capacity: int) -> None:
        """A new bound, applied at once: channels not in use beyond it are closed now, before
        the workers that made it smaller open their sockets."""
        self.capacity = capacity
        self._make_room()

    def opened(self, channel: _Channel) -> None:
        """`channel` has just opened its sockets (and is about to be used)."""
        self._open[id(channel)] = channel
        self._make_room()

    def used(self, channel: _Channel) -> None:
        """`channel` served a request and stays open: the most recently used."""
        if id(channel) in self._open:
            self._open.move_to_end(id(channel))

    def closed(self, channel: _Channel) -> None:
        self._open.pop(id(channel), None)

    def _make_room(self) -> None:
        if self.capacity is None or len(self._open) <= self.capacity:
            return
        for channel in list(self._open.values()):
            if len(self._open) <= self.capacity:
                return
            if not channel.in_use:
                channel.close()  # tells closed()
                self.closed_for_room += 1
