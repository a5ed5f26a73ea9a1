"""``manage.py serve``: the production web server.

One ASGI application (``kvsite.asgi``: the scoring fast path, Django and Channels websockets)
under uvicorn (uvloop, httptools), in ``--workers`` processes sharing one port
(``stack.asgi_server``). With several workers, prometheus_client's multiprocess mode (a fresh
``var/metrics-<port>``) lets any worker's ``/metrics`` report all of them. SIGTERM or SIGINT: stop
accepting, let in-flight requests finish for up to ``--graceful-seconds``, close websockets, exit
0. ``runserver`` stays for development.

``--index in-process``: the web server keeps its own index and subscribes to the engines' KV
events itself (``ingest.in_process``), in one worker process: the scoring and KV-indexer APIs
answer from it, as Dynamo's standalone indexer does, with no Valkey and no ``manage.py ingest``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ingest import in_process
from stack.asgi_server import ConnectionLimits, add_server_arguments, run_server

APPLICATION = "kvsite.asgi:application"


class Command(BaseCommand):
    help = "Serve the web application (scoring fast path, Django, websockets) with uvicorn workers."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser, port=8000)
        in_process.add_arguments(parser)

    def handle(self, *args: Any, port: int, workers: int, **options: Any) -> None:
        try:
            ingest = in_process.options_from(options)
        except in_process.IngestSetupError as error:
            raise CommandError(str(error)) from None
        if ingest is not None:
            if workers != 1:
                self.stderr.write("--index in-process serves from one worker process (the index lives in it)")
            workers = 1
        in_process.hand_to_workers(ingest)
        metrics_dir = Path(settings.VAR_DIR) / f"metrics-{port}"
        run_server(
            APPLICATION,
            port=port,
            workers=workers,
            ws="websockets-sansio",
            limits=ConnectionLimits.from_settings(settings),
            metrics_dir=metrics_dir,
            say=self.stdout.write,
            **options,
        )
