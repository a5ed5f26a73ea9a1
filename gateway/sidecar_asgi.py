"""ASGI entry point of ``manage.py sidecar``: the decode pod's sidecar (``gateway.sidecar``) with
the settings' timeouts, in front of the engine the command named (``KVCACHE_SIDECAR_DECODE``)."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
django.setup()

from django.conf import settings  # noqa: E402

from gateway.sidecar import Sidecar, SidecarSettings  # noqa: E402

application = Sidecar(
    SidecarSettings(
        decode=os.environ["KVCACHE_SIDECAR_DECODE"],
        connect_timeout=settings.KVCACHE_GATEWAY_CONNECT_TIMEOUT,
        first_byte_timeout=settings.KVCACHE_GATEWAY_FIRST_BYTE_TIMEOUT,
        prefill_timeout=settings.KVCACHE_PD_PREFILL_TIMEOUT,
        max_body_bytes=settings.KVCACHE_MAX_BODY_BYTES,
    )
)
