"""A kvroute server following a simulated fleet: every instance registered by its URL and
live before the test asks anything."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.waiting import HTTP_TIMEOUT, wait_for


@contextmanager
def following(fleet: SimCluster, settings: Settings,
              headers: dict[str, str] | None = None) -> Iterator[httpx.Client]:
    """A client of a kvroute server run with `settings` (host 127.0.0.1, port 0) that has
    registered each of `fleet`'s instances and sees every one live; stopped on exit.
    `headers` (a token) go with the registrations and the wait only, not with the client's
    other requests."""
    with BackgroundServer(settings) as server, registered(server, fleet, headers) as http:
        yield http


@contextmanager
def registered(server: BackgroundServer, fleet: SimCluster,
               headers: dict[str, str] | None = None) -> Iterator[httpx.Client]:
    """`following` for a server the caller runs (and needs: its Endpoint Picker, say): a
    client of it once each of `fleet`'s instances is registered and live."""
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        for url in fleet.urls:
            added = http.post("/v1/instances", json={"url": url}, headers=headers)
            assert added.status_code == 201, added.text
        wait_for(lambda: all(i["state"] == "live" for i in
                             http.get("/v1/instances", headers=headers).json()["instances"]),
                 "every instance to go live")
        yield http


def instance_ids(fleet: SimCluster, http: httpx.Client,
                 headers: dict[str, str] | None = None) -> list[str]:
    """The registered ids of the fleet's instances, in the fleet's order."""
    listed = http.get("/v1/instances", headers=headers).json()["instances"]
    by_url = {i["url"]: i["id"] for i in listed}
    return [by_url[url] for url in fleet.urls]
