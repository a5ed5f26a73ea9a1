"""``python manage.py epp``: the Endpoint Picker (``epp.service``) with this process's registry
snapshot, index, tokenizers and settings (the gateway's routing settings: the same choice)."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from epp import metrics
from epp.envoy import EndpointsFile
from epp.server import PickerSettings
from epp.service import PickerService
from registry import runtime
from routing.policies import POLICIES
from routing.router import Router, RouterHandles, RouterSettings

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Serve the Endpoint Picker: Envoy's ext_proc (gRPC) names the pod for each request."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        parser.add_argument("--grpc-port", type=int, default=9002, help="ext_proc and health (default 9002)")
        parser.add_argument(
            "--metrics-port", type=int, default=9090, help="Prometheus /metrics (default 9090; 0: none)"
        )
        parser.add_argument(
            "--policy",
            choices=sorted(POLICIES),
            default=None,
            help="routing policy (default: KVCACHE_GATEWAY_POLICY, kv-load)",
        )
        parser.add_argument(
            "--fallbacks", type=int, default=2, help="endpoints named after the primary (default 2)"
        )
        parser.add_argument(
            "--shed-queue",
            type=float,
            default=5.0,
            help="a sheddable request (x-kvcache-priority < 0) gets 429 when every pod has this many waiting",
        )
        parser.add_argument(
            "--fail-open",
            action="store_true",
            help="when the picker fails on a request, let it through without a destination (default: 500)",
        )
        parser.add_argument(
            "--endpoints-file",
            type=Path,
            default=None,
            help="write the live pods here for Envoy's pool cluster (deploy/envoy/envoy.yaml's EDS file)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        asyncio.run(self._serve(**options))  # SIGINT and SIGTERM stop it in order

    async def _serve(
        self,
        *,
        host: str,
        grpc_port: int,
        metrics_port: int,
        policy: str | None,
        fallbacks: int,
        shed_queue: float,
        fail_open: bool,
        endpoints_file: Path | None,
        **_: Any,
    ) -> None:
        router = Router(
            RouterHandles(
                config=runtime.config_source,
                index=runtime.get_index,
                tokenizers=runtime.get_tokenizers,
                sandbox=runtime.get_sandbox,
            ),
            RouterSettings(
                policy=policy or settings.KVCACHE_GATEWAY_POLICY,
                alpha=settings.KVCACHE_GATEWAY_ALPHA,
                speculative_seconds=settings.KVCACHE_SPECULATIVE_SECONDS,
                threads=settings.KVCACHE_SCORING_THREADS,
                allow_request_templates=settings.KVCACHE_REQUEST_TEMPLATES,
                pod_api_key=settings.KVCACHE_GATEWAY_POD_API_KEY,
            ),
            metrics.ROUTING,
        )
        service = PickerService(
            router,
            PickerSettings(
                fallbacks=fallbacks,
                max_body_bytes=settings.KVCACHE_MAX_BODY_BYTES,
                shed_queue=shed_queue,
                fail_open=fail_open,
            ),
            host=host,
            grpc_port=grpc_port,
            metrics_port=metrics_port or None,
            ready=runtime.warm_up,
            endpoints_file=EndpointsFile(endpoints_file) if endpoints_file else None,
        )
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        port = await service.start()
        self.stdout.write(f"Endpoint Picker: ext_proc on {host}:{port}, policy {router.policy.name}")
        if metrics_port:
            self.stdout.write(f"Metrics: http://{host}:{metrics_port}/metrics")
        await stopping.wait()
        await service.stop()
        runtime.close_sandbox()
