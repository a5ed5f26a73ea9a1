"""ASGI entry point of ``manage.py gateway``: the gateway core (``gateway.app``) with the Django
shell's handles (registry snapshot, index, tokenizers, template sandbox) and settings. At start-up
the registry's models' tokenizers are loaded, so no first request waits for one. With ``--index
in-process`` the worker keeps its own index and starts the ingest that fills it first
(``ingest.in_process``), its counters on the gateway's ``/metrics``."""

import logging
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
django.setup()

from django.conf import settings  # noqa: E402

from gateway import metrics  # noqa: E402
from gateway.app import GatewayApp, GatewayHandles, GatewaySettings  # noqa: E402
from ingest.in_process import IngestSetupError, InProcessIndex  # noqa: E402
from registry import runtime  # noqa: E402

log = logging.getLogger("gateway")
in_process = InProcessIndex.from_environment()

gateway = GatewayApp(
    GatewayHandles(
        config=runtime.config_source,
        index=runtime.get_index,
        tokenizers=runtime.get_tokenizers,
        sandbox=runtime.get_sandbox,
    ),
    GatewaySettings(
        policy=os.environ.get("KVCACHE_GATEWAY_POLICY_OVERRIDE") or settings.KVCACHE_GATEWAY_POLICY,
        alpha=settings.KVCACHE_GATEWAY_ALPHA,
        speculative_seconds=settings.KVCACHE_SPECULATIVE_SECONDS,
        retries=settings.KVCACHE_GATEWAY_RETRIES,
        max_body_bytes=settings.KVCACHE_MAX_BODY_BYTES,
        threads=settings.KVCACHE_SCORING_THREADS,
        allow_request_templates=settings.KVCACHE_REQUEST_TEMPLATES,
        connect_timeout=settings.KVCACHE_GATEWAY_CONNECT_TIMEOUT,
        first_byte_timeout=settings.KVCACHE_GATEWAY_FIRST_BYTE_TIMEOUT,
        api_keys=tuple(settings.KVCACHE_API_KEYS),
        pod_api_key=settings.KVCACHE_GATEWAY_POD_API_KEY,
        matched_blocks_header=settings.KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER,
        trusted_proxies=tuple(settings.KVCACHE_TRUSTED_PROXIES),
        pd_threshold_tokens=settings.KVCACHE_PD_THRESHOLD_TOKENS,
        prefill_timeout=settings.KVCACHE_PD_PREFILL_TIMEOUT,
    ),
)


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
    else:
        await gateway(scope, receive, send)


async def lifespan(receive, send):
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if in_process is not None:
                try:
                    log.info("%s", await in_process.astart(metrics.REGISTRY))
                except IngestSetupError as error:
                    await send({"type": "lifespan.startup.failed", "message": str(error)})
                    return
            await runtime.warm_up()
            await gateway.startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await gateway.shutdown()
            runtime.close_sandbox()
            if in_process is not None:
                await in_process.astop()
            await send({"type": "lifespan.shutdown.complete"})
            return
