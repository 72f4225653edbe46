"""Following a DNS name whose addresses are the instances of a fleet (a Kubernetes
headless Service: one A/AAAA record per ready pod).

A `Fleet` resolves its name now and every `interval` seconds after. Each address is an
instance of the registry, `scheme://ADDRESS:PORT` (the fleet url's scheme and port),
named `<fleet id>@<address>` and discovered by that URL like any configured instance.

Invariants:
- The registry holds exactly one instance per address of the last successful
  resolution (less any the registry refused: a duplicate id, `max_instances`), each
  with `fleet` set to this fleet's id; an address that leaves the answer leaves the
  registry (its subscribers stop, its index entries go) at the same refresh.
- A failed resolution, or one with no address, changes nothing: the last known members
  stay (a DNS outage must not empty the index), `error` says why, it is logged when it
  starts or changes, and `failures` counts it.
- Resolution runs off the event loop (`loop.getaddrinfo` uses the default executor);
  the resolver is injectable, so tests decide what a name resolves to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.app.config import ConfigError, FleetConfig, parse_instance
from kvroute.app.errors import LimitReached
from kvroute.app.fleet.registry import DuplicateInstance, Registry
from kvroute.app.tasks import cancel_and_wait

__all__ = ["Fleet", "FleetCollector", "Resolver", "resolve_with_getaddrinfo"]

log = logging.getLogger("kvroute.fleet")

# (host, port) -> the addresses it resolves to now; raises OSError when it does not resolve.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_with_getaddrinfo(host: str, port: int) -> list[str]:
    """Every address of `host` (IPv4 and IPv6), sorted, as the system resolver answers."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Fleet:
    """One DNS name followed; `start()` runs its refresh loop, `stop()` ends it."""

    def __init__(self, config: FleetConfig, registry: Registry, resolver: Resolver, *,
                 interval: float) -> None:
        parts = urlsplit(config.url)
        assert parts.hostname is not None and config.id is not None  # FleetConfig's checks
        self.config = config
        self.id: str = config.id
        self.host: str = parts.hostname
        self.scheme = parts.scheme
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.interval = interval
        self._registry = registry
        self._resolve = resolver
        self.members: dict[str, str] = {}  # address -> instance id
        self.addresses: list[str] = []  # the last successful resolution
        self.error: str | None = None
        self.failures = 0
        self.resolved_at: float | None = None  # time.time() of the last success
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"fleet {self.id}")

    async def stop(self) -> None:
        """End the refresh loop; the members stay registered (the registry closes them)."""
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a bug must not end the following for good
                log.exception("fleet %s: refresh failed", self.id)
                self._report(f"refresh failed: {exc.__class__.__name__}")
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        """Resolve once and make the members match; never raises but for cancellation."""
        try:
            addresses = sorted(set(await self._resolve(self.host, self.port)))
            if not addresses:
                raise OSError("the name resolved to no address")
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            self._report(f"cannot resolve {self.host}: {exc}")
            return
        self.addresses = addresses
        self.resolved_at = time.time()
        for address in [a for a in self.members if a not in addresses]:
            instance_id = self.members.pop(address)
            if instance_id in self._registry:
                await self._registry.remove(instance_id)
            log.info("fleet %s: %s is gone; stopped following %s", self.id, address,
                     instance_id)
        first_error = None
        for address in addresses:
            if address not in self.members:
                error = await self._add(address)
                first_error = first_error or error
        self._report(first_error)

    async def _add(self, address: str) -> str | None:
        """Register the instance at `address`; why it could not be, or None."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return f"{self.host} resolved to {address!r}, not an IP address"
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        raw = {"url": f"{self.scheme}://{host}:{self.port}", "id": f"{self.id}@{ip}",
               "model": self.config.model, "topic": self.config.topic,
               "block_size": self.config.block_size, "api_key": self.config.api_key}
        try:
            # An IPv6 address with a zone (fe80::1%eth0) is no URL host: refused here.
            config = parse_instance({k: v for k, v in raw.items() if v is not None},
                                    f"fleet {self.id}")
            await self._registry.add(config, wait_for_discovery=False, fleet=self.id)
        except ConfigError as exc:
            return f"no instance can be at {address}: {exc}"
        except DuplicateInstance:
            return f"cannot add {raw['id']}: an instance is registered under that id already"
        except LimitReached as exc:
            return f"cannot add {raw['id']}: {exc}"
        self.members[address] = str(config.id)
        log.info("fleet %s: following %s at %s", self.id, config.id, config.url)
        return None

    def _report(self, error: str | None) -> None:
        """The refresh's outcome: counted when it failed, logged when it changed."""
        if error is not None:
            self.failures += 1
            if error != self.error:
                log.warning("fleet %s: %s; keeping its %d known instance(s)", self.id, error,
                            len(self.members))
        elif self.error is not None:
            log.info("fleet %s: %s resolves again; following %d instance(s)", self.id,
                     self.host, len(self.members))
        self.error = error


class FleetCollector(Collector):
    """Per fleet: its members, whether its last resolution worked, and failures so far."""

    def __init__(self, fleets: Callable[[], Iterator[Fleet]]) -> None:
        self._fleets = fleets

    def collect(self) -> Iterator[object]:
        members = GaugeMetricFamily("kvroute_fleet_members",
                                    "instances followed for each fleet's DNS name",
                                    labels=["fleet"])
        ok = GaugeMetricFamily("kvroute_fleet_ok",
                               "1 when the fleet's last refresh resolved its name and "
                               "follows every address", labels=["fleet"])
        failures = CounterMetricFamily("kvroute_fleet_resolve_failures",
                                       "failed DNS resolutions (and refused members)",
                                       labels=["fleet"])
        for fleet in self._fleets():
            members.add_metric([fleet.id], float(len(fleet.members)))
            ok.add_metric([fleet.id], 1.0 if fleet.resolved_at and not fleet.error else 0.0)
            failures.add_metric([fleet.id], float(fleet.failures))
        yield members
        yield ok
        yield failures
