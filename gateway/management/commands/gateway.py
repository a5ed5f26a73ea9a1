"""``python manage.py gateway``: the OpenAI gateway (``gateway.asgi``) under uvicorn workers, as
``serve`` runs the web application."""

from __future__ import annotations

import os
from typing import Any

import uvicorn
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.policies import POLICIES
from scoring.management.commands.serve import _fresh_metrics_dir

APPLICATION = "gateway.asgi:application"


class Command(BaseCommand):
    help = "Serve the KV-aware OpenAI gateway (/v1/completions, /v1/chat/completions) with uvicorn."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8200, help="port to listen on (default 8200)")
        parser.add_argument(
            "--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: the cores)"
        )
        parser.add_argument(
            "--policy",
            choices=sorted(POLICIES),
            default=None,
            help="routing policy (default: KVCACHE_GATEWAY_POLICY, kv-load)",
        )
        parser.add_argument("--graceful-seconds", type=float, default=8.0)
        parser.add_argument("--access-log", action="store_true", help="log every request (off: it costs)")

    def handle(self, *args: Any, host: str, port: int, workers: int, **options: Any) -> None:
        if workers < 1:
            raise CommandError("--workers must be at least 1")
        if options["policy"]:
            os.environ["KVCACHE_GATEWAY_POLICY_OVERRIDE"] = options["policy"]
        if workers > 1:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_fresh_metrics_dir(port))
        self.stdout.write(f"Gateway on http://{host}:{port} with {workers} worker(s)")
        uvicorn.run(
            APPLICATION,
            host=host,
            port=port,
            workers=workers,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            timeout_graceful_shutdown=options["graceful_seconds"],
            access_log=options["access_log"],
            log_level="info",
            proxy_headers=False,
        )
