"""``python manage.py sidecar --decode HOST:PORT``: the decode pod's sidecar for prefill/decode
disaggregation under the Endpoint Picker (``gateway.sidecar``), under uvicorn in one worker."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from stack.asgi_server import ConnectionLimits, add_server_arguments, run_server

APPLICATION = "gateway.sidecar_asgi:application"


class Command(BaseCommand):
    help = "Serve a decode pod's P/D sidecar: the prefill step the picker asked for, then the pod's answer."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser, port=8000)
        parser.set_defaults(workers=1)
        parser.add_argument(
            "--decode", required=True, help="the decode pod's engine, host:port (e.g. 127.0.0.1:8200)"
        )

    def handle(self, *args: Any, decode: str, port: int, workers: int, **options: Any) -> None:
        if workers != 1:
            raise CommandError("the sidecar runs one worker (its counters are its process's): --workers 1")
        host, _, engine_port = decode.rpartition(":")
        if not host or not engine_port.isdigit():
            raise CommandError(f"--decode {decode!r} must be host:port")
        os.environ["KVCACHE_SIDECAR_DECODE"] = decode  # read by every worker's gateway.sidecar_asgi
        run_server(
            APPLICATION,
            port=port,
            workers=workers,
            metrics_dir=Path(settings.VAR_DIR) / f"metrics-{port}",
            say=self.stdout.write,
            limits=ConnectionLimits.from_settings(settings),
            **options,
        )
