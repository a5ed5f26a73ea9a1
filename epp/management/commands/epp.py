"""``python manage.py epp``: the Endpoint Picker (``epp.service``) with this process's registry
snapshot, index, tokenizers and settings (the gateway's routing settings: the same choice).

The pods it picks from are the registry's, or, on Kubernetes, an InferencePool's: ``--pool-name``
reads the pool's selector and target port, ``--pod-selector`` and ``--target-port`` give them
directly; the ready pods matching it are watched (``epp.kubernetes``, with the pod's service
account or ``KUBECONFIG``) and serve ``--pool-model``, whose settings (block size, hash seed...)
stay the registry's.

``--index in-process``: the picker keeps its own index and subscribes to the engines' KV events
itself (``ingest.in_process``): the registry's pods' event endpoints, and ``--ingest-connect`` /
``--ingest-bind`` for a pool's engines, which the registry does not list."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from lightkube import ApiError, AsyncClient, ConfigError

from epp import metrics
from epp.envoy import EndpointsFile
from epp.kubernetes import (
    InferencePoolError,
    PoolConfigSource,
    PoolEndpoints,
    parse_pod_selector,
    read_inference_pool,
)
from epp.server import PickerSettings
from epp.service import PickerService
from ingest import in_process
from registry import runtime
from routing.policies import POLICIES
from routing.router import Router, RouterHandles, RouterSettings


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
        pool = parser.add_argument_group("an InferencePool's pods instead of the registry's")
        pool.add_argument("--pool-name", help="read this InferencePool's selector and target port")
        pool.add_argument("--pool-namespace", help="its namespace (default: the client's, in a pod its own)")
        pool.add_argument("--pod-selector", help="or the pods' labels directly: 'app=vllm,tier=x'")
        pool.add_argument("--target-port", type=int, help="with --pod-selector: the engines' port")
        pool.add_argument("--pool-model", help="the model the pool's pods serve (required with a pool)")
        pool.add_argument(
            "--pod-ids",
            choices=("address", "name"),
            default="address",
            help="what the pool's pods are called: their ip:port (default, as engines publish KV events "
            "under it: deploy/examples/vllm-engine.yaml) or their Kubernetes pod name",
        )
        parser.add_argument(
            "--endpoints-file",
            type=Path,
            default=None,
            help="write the live pods here for Envoy's pool cluster (deploy/envoy/envoy.yaml's EDS file)",
        )
        in_process.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        if options["pool_name"] and options["pod_selector"]:
            raise CommandError("--pool-name or --pod-selector, not both")
        if options["pod_selector"] and not options["target_port"]:
            raise CommandError("--pod-selector needs --target-port")
        if (options["pool_name"] or options["pod_selector"]) and not options["pool_model"]:
            raise CommandError("a pool needs --pool-model: the model its pods serve")
        try:
            ingest = in_process.options_from(options)
            index = in_process.InProcessIndex(ingest) if ingest is not None else None
            if index is not None:  # before the event loop: it reads the registry
                index.start()
        except in_process.IngestSetupError as error:
            raise CommandError(str(error)) from None
        try:
            if index is not None:
                index.register_metrics(metrics.REGISTRY)
                self.stdout.write(index.describe())
            asyncio.run(self._serve(**options))  # SIGINT and SIGTERM stop it in order
        finally:
            if index is not None:
                index.stop()

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
        pool_name: str | None,
        pool_namespace: str | None,
        pod_selector: str | None,
        target_port: int | None,
        pool_model: str | None,
        pod_ids: str,
        **_: Any,
    ) -> None:
        config, pool = runtime.config_source, None
        if pool_name or pod_selector:
            pool = await _watch_pool(pool_name, pool_namespace, pod_selector, target_port)
            config = PoolConfigSource(runtime.config_source, pool, pool_model, pod_ids=pod_ids)
            self.stdout.write(f"Pool: pods of {pool.namespace} labelled {pool.selector}, port {pool.port}")

        async def ready() -> None:
            await runtime.warm_up()
            if pool is not None:
                await pool.synced.wait()

        router = Router(
            RouterHandles(
                config=config,
                index=runtime.get_index,
                tokenizers=runtime.get_tokenizers,
                sandbox=runtime.get_sandbox,
            ),
            RouterSettings.from_settings(settings, policy=policy),
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
            ready=ready,
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
        if pool is not None:
            await pool.stop()
        runtime.close_sandbox()


async def _watch_pool(
    name: str | None, namespace: str | None, selector: str | None, port: int | None
) -> PoolEndpoints:
    """The pool's pods, watched from now on (the client: in a pod its service account, else
    ``KUBECONFIG``); ``CommandError`` when the pool cannot be read."""
    try:
        client = AsyncClient(namespace=namespace)
        namespace = namespace or client.namespace
        if name:
            spec = await read_inference_pool(client, name, namespace=namespace)
            labels, port = spec.selector, spec.target_port
        else:
            labels = parse_pod_selector(selector or "")
    except (ConfigError, ApiError, InferencePoolError) as error:
        raise CommandError(f"the pool's pods cannot be watched: {error}") from None
    pool = PoolEndpoints(client, namespace=namespace, selector=labels, port=port)
    pool.start()
    return pool
