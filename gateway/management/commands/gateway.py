"""``python manage.py gateway``: the OpenAI gateway (``gateway.asgi``) under uvicorn workers, as
``serve`` runs the web application (``stack.asgi_server``).

``--index in-process``: the gateway keeps its own index and subscribes to the engines' KV events
itself (``ingest.in_process``), in one worker process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ingest import in_process
from routing.policies import POLICIES
from stack.asgi_server import ConnectionLimits, add_server_arguments, run_server

APPLICATION = "gateway.asgi:application"


class Command(BaseCommand):
    help = "Serve the KV-aware OpenAI gateway (/v1/completions, /v1/chat/completions) with uvicorn."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser, port=8200)
        parser.set_defaults(workers=None)  # the cores, or 1 with --index in-process
        parser.add_argument(
            "--policy",
            choices=sorted(POLICIES),
            default=None,
            help="routing policy (default: KVCACHE_GATEWAY_POLICY, kv-load)",
        )
        in_process.add_arguments(parser)

    def handle(self, *args: Any, policy: str | None, port: int, workers: int | None, **options: Any) -> None:
        try:
            ingest = in_process.options_from(options)
        except in_process.IngestSetupError as error:
            raise CommandError(str(error)) from None
        if ingest is not None and workers not in (None, 1):
            raise CommandError(
                "--index in-process serves from one worker process (the index lives in it): "
                "run more gateways, each with its own index, instead of more workers"
            )
        if policy:
            os.environ["KVCACHE_GATEWAY_POLICY_OVERRIDE"] = policy  # read by every worker's gateway.asgi
        in_process.hand_to_workers(ingest)
        metrics_dir = Path(settings.VAR_DIR) / f"metrics-{port}"
        run_server(
            APPLICATION,
            port=port,
            workers=workers or (1 if ingest is not None else os.cpu_count() or 1),
            metrics_dir=metrics_dir,
            say=self.stdout.write,
            limits=ConnectionLimits.from_settings(settings),
            **options,
        )
