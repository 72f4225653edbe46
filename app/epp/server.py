"""The Endpoint Picker's gRPC server: ext_proc and gRPC health on `epp_port`.

It runs on the service's own event loop (grpc.aio), started by the app's lifespan after
the service and stopped before it, so a pick reads the index exactly as `POST /v1/route`
does. Health (grpc.health.v1) answers for:

- `liveness` and "" (the server): SERVING while the process runs;
- `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`: SERVING once kvroute is
  ready, as `/readyz` says (every configured worker live, or the start-up grace period
  over), NOT_SERVING before;
- everything NOT_SERVING from the start of a shutdown.

TLS (app.epp.tls) is on unless `epp_tls` is off; the port is never shared with another
process (SO_REUSEPORT off, which gRPC would otherwise set).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvroute.app.epp.messages import EXT_PROC_SERVICE
from kvroute.app.epp.stream import EndpointPicker, EppMetrics
from kvroute.app.epp.tls import ServerIdentity, load_identity
from kvroute.app.errors import RequestError
from kvroute.app.fleet.endpoints import EndpointMap
from kvroute.app.service import Service
from kvroute.app.tasks import cancel_and_wait

__all__ = ["EppServer", "HEALTH_SERVICES"]

log = logging.getLogger("kvroute.epp")

LIVENESS = ("", "liveness")
READINESS = ("readiness", EXT_PROC_SERVICE)
HEALTH_SERVICES = (*LIVENESS, *READINESS)
# How often readiness is looked at until kvroute is ready (it stays ready afterwards).
READINESS_POLL = 0.2
# Streams still open at shutdown get this long to end before they are cancelled.
SHUTDOWN_GRACE = 5.0


class EppServer:
    def __init__(self, service: Service, status_of: dict[type[RequestError], int]) -> None:
        settings = service.settings
        assert settings.epp_port is not None
        self.service = service
        self.settings = settings
        self.endpoints = EndpointMap()
        self.picker = EndpointPicker(service, self.endpoints, EppMetrics(service), status_of)
        self.health = health.aio.HealthServicer()
        self.identity: ServerIdentity | None = None
        self.port: int = 0
        self._server: grpc.aio.Server | None = None
        self._readiness: asyncio.Task[None] | None = None

    async def start(self) -> None:
        settings = self.settings
        host = settings.host
        address = f"[{host.strip('[]')}]:{settings.epp_port}" if ":" in host \
            else f"{host}:{settings.epp_port}"
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        credentials = None
        if settings.epp_tls:
            self.identity = load_identity(host, settings.epp_tls_certfile,
                                          settings.epp_tls_keyfile, settings.epp_client_ca)
            credentials = grpc.ssl_server_credentials(
                [(self.identity.key, self.identity.certificate)],
                root_certificates=self.identity.client_ca,
                require_client_auth=self.identity.client_ca is not None)
        try:
            if credentials is not None:
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # gRPC says only "Failed to bind" (and logs the reason)
            raise OSError(f"the Endpoint Picker cannot listen on {address} (in use, or not "
                          "an address of this machine)") from None
        await server.start()
        self._server = server
        for name in LIVENESS:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        for name in READINESS:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._readiness = asyncio.create_task(self._until_ready(), name="epp readiness")
        log.info("Endpoint Picker (Envoy ext_proc) on %s:%d, %s", host, self.port,
                 self._tls_description())

    def _tls_description(self) -> str:
        identity = self.identity
        if identity is None:
            return "plaintext (epp_tls off)"
        made = "a self-signed certificate made at start" if identity.self_signed \
            else "the configured certificate"
        clients = ", client certificates required" if identity.client_ca else ""
        return f"TLS with {made} (SHA-256 {identity.fingerprint}){clients}"

    async def _until_ready(self) -> None:
        while not self.service.readiness()[0]:
            await asyncio.sleep(READINESS_POLL)
        for name in READINESS:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await cancel_and_wait(self._readiness)
        if self._server is not None:
            await self._server.stop(SHUTDOWN_GRACE)
        await self.endpoints.close()
