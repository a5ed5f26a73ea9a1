"""The Endpoint Picker's process, no Django: the ext_proc service (``epp.server``), the access-log
service that tells it when answers end and the gRPC health service on one gRPC port, Prometheus
metrics on another, and the routing core's load scraper, started and stopped together.

Health (``grpc.health.v1``, as the endpoint-picker protocol asks): ``liveness`` is ``SERVING`` while
the process answers; ``readiness``, the overall status ``""`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` once the picker has its first registry snapshot
(and, when its pods come from a pool's selector, the first list of them), ``NOT_SERVING`` while
it stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import start_http_server

from epp import metrics
from epp.envoy import EndpointsFile
from epp.server import AccessLog, Endings, EndpointPicker, PickerSettings
from routing.router import Router, endpoint_of

log = logging.getLogger(__name__)

ENDPOINTS_SECONDS = 1.0
"""How often the live pods are written to the endpoints file (when they changed)."""
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""The largest gRPC message either way (a body chunk is 62 KiB; Envoy's own limit is 4 MiB)."""


class PickerService:
    def __init__(
        self,
        router: Router,
        settings: PickerSettings,
        *,
        host: str = "127.0.0.1",
        grpc_port: int = 9002,
        metrics_port: int | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
        endpoints_file: EndpointsFile | None = None,
    ) -> None:
        """``ready``: awaited before the picker says it is ready (a first registry snapshot, the
        pool's first list of pods); ``endpoints_file``: where the live pods are written for
        Envoy's pool cluster (deploy/envoy/), every ``ENDPOINTS_SECONDS`` they changed."""
        self.router = router
        self.settings = settings
        self.host = host
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self._ready = ready
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_server = None
        self._readiness: asyncio.Task | None = None
        self.endpoints_file = endpoints_file
        self._endpoints: asyncio.Task | None = None

    async def start(self) -> int:
        """Serves; returns the gRPC port (bound now when ``grpc_port`` is 0)."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        self.endings = Endings(self.router.load)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            EndpointPicker(self.router, self.settings, self.endings), server
        )
        als_grpc.add_AccessLogServiceServicer_to_server(AccessLog(self.endings), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        for service in READY_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_port = server.add_insecure_port(f"{self.host}:{self.grpc_port}")
        if self.metrics_port is not None:
            self._metrics_server, _ = start_http_server(
                self.metrics_port, self.host, registry=metrics.REGISTRY
            )
        await self.router.startup()
        await server.start()
        self._server = server
        self._readiness = asyncio.create_task(self._become_ready())
        return self.grpc_port

    async def _become_ready(self) -> None:
        if self._ready is not None:
            await self._ready()
        if self.endpoints_file is not None:
            await self._write_endpoints()
            self._endpoints = asyncio.create_task(self._endpoints_forever())
        for service in READY_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("the endpoint picker is ready on port %d", self.grpc_port)

    async def _write_endpoints(self) -> None:
        try:
            live = await self.router.live()
        except Exception as error:  # the registry unreachable: the file keeps the last pods
            log.warning("the live pods are unknown (%s): the endpoints file is left as it is", error)
            return
        if self.endpoints_file.write(endpoint_of(address) for address in live.values()):
            log.info("endpoints for Envoy: %s", ", ".join(sorted(live)) or "none")

    async def _endpoints_forever(self) -> None:
        while True:
            await asyncio.sleep(ENDPOINTS_SECONDS)
            await self._write_endpoints()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace: float = 5.0) -> None:
        """Not ready at once (Envoy stops sending new requests), then the streams in flight get
        ``grace`` seconds to end."""
        for task in (self._readiness, self._endpoints):
            if task is not None:
                task.cancel()
        for service in READY_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._server is not None:
            await self._server.stop(grace)
        await self.router.shutdown()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
