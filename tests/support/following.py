"""A kvroute server following a simulated fleet: every instance registered by its URL and
live before the test asks anything."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.conftest import HTTP_TIMEOUT, wait_for


@contextmanager
def following(fleet: SimCluster, settings: Settings) -> Iterator[httpx.Client]:
    """A client of a kvroute server run with `settings` (host 127.0.0.1, port 0) that has
    registered each of `fleet`'s instances and sees every one live; stopped on exit."""
    with BackgroundServer(settings) as server, httpx.Client(base_url=server.url,
                                                          timeout=HTTP_TIMEOUT) as http:
        for url in fleet.urls:
            added = http.post("/v1/instances", json={"url": url})
            assert added.status_code == 201, added.text
        wait_for(lambda: all(i["state"] == "live" for i in
                             http.get("/v1/instances").json()["instances"]),
                 "every instance to go live")
        yield http
