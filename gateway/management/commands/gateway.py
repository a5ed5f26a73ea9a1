"""``python manage.py gateway``: the OpenAI gateway (``gateway.asgi``) under uvicorn workers, as
``serve`` runs the web application (``stack.asgi_server``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from routing.policies import POLICIES
from stack.asgi_server import ConnectionLimits, add_server_arguments, run_server

APPLICATION = "gateway.asgi:application"


class Command(BaseCommand):
    help = "Serve the KV-aware OpenAI gateway (/v1/completions, /v1/chat/completions) with uvicorn."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser, port=8200)
        parser.add_argument(
            "--policy",
            choices=sorted(POLICIES),
            default=None,
            help="routing policy (default: KVCACHE_GATEWAY_POLICY, kv-load)",
        )

    def handle(self, *args: Any, policy: str | None, port: int, **options: Any) -> None:
        if policy:
            os.environ["KVCACHE_GATEWAY_POLICY_OVERRIDE"] = policy  # read by every worker's gateway.asgi
        metrics_dir = Path(settings.VAR_DIR) / f"metrics-{port}"
        run_server(
            APPLICATION,
            port=port,
            metrics_dir=metrics_dir,
            say=self.stdout.write,
            limits=ConnectionLimits.from_settings(settings),
            **options,
        )
