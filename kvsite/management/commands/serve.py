"""``manage.py serve``: the production web server.

One ASGI application (``kvsite.asgi``: the scoring fast path, Django and Channels websockets)
under uvicorn (uvloop, httptools), in ``--workers`` processes sharing one port
(``stack.asgi_server``). With several workers, prometheus_client's multiprocess mode (a fresh
``var/metrics-<port>``) lets any worker's ``/metrics`` report all of them. SIGTERM or SIGINT: stop
accepting, let in-flight requests finish for up to ``--graceful-seconds``, close websockets, exit
0. ``runserver`` stays for development.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from stack.asgi_server import ConnectionLimits, add_server_arguments, run_server

APPLICATION = "kvsite.asgi:application"


class Command(BaseCommand):
    help = "Serve the web application (scoring fast path, Django, websockets) with uvicorn workers."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser, port=8000)

    def handle(self, *args: Any, port: int, **options: Any) -> None:
        metrics_dir = Path(settings.VAR_DIR) / f"metrics-{port}"
        run_server(
            APPLICATION,
            port=port,
            ws="websockets-sansio",
            limits=ConnectionLimits.from_settings(settings),
            metrics_dir=metrics_dir,
            say=self.stdout.write,
            **options,
        )
