"""``manage.py serve``: the production web server.

One ASGI application (``kvsite.asgi``: the scoring fast path, Django and Channels websockets)
under uvicorn (uvloop, httptools), in ``--workers`` processes sharing one port. With several
workers, prometheus_client's multiprocess mode (a fresh ``PROMETHEUS_MULTIPROC_DIR``) lets any
worker's ``/metrics`` report all of them. SIGTERM or SIGINT: stop accepting, let in-flight
requests finish for up to ``--graceful-seconds``, close websockets, exit 0. ``runserver`` stays for
development.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

APPLICATION = "kvsite.asgi:application"
HTTP_PROTOCOL = "stack.asgi_server:NoDelayHttpToolsProtocol"


class Command(BaseCommand):
    help = "Serve the web application (scoring fast path, Django, websockets) with uvicorn workers."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser, port=8000)

    def handle(self, *args: Any, **options: Any) -> None:
        run_server(self, APPLICATION, ws="websockets-sansio", **options)


def add_server_arguments(parser: CommandParser, *, port: int) -> None:
    """The options of a uvicorn-served command (``serve``, ``gateway``)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help=f"port to listen on (default {port})")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: the cores)"
    )
    parser.add_argument(
        "--graceful-seconds",
        type=float,
        default=8.0,
        help="how long in-flight requests may finish after SIGTERM (default 8; the whole exit stays "
        "under 10 s)",
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop (default asyncio: under saturation uvloop accepts about one new connection per "
        "turn of the loop, so a burst of new connections waits up to seconds; docs/performance.md)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request (off: it costs)")


def run_server(
    command: BaseCommand,
    application: str,
    *,
    host: str,
    port: int,
    workers: int,
    graceful_seconds: float,
    access_log: bool,
    loop: str = "asyncio",
    ws: str = "none",
    **_options: Any,
) -> None:
    """``application`` under uvicorn in ``workers`` processes, with multiprocess metrics."""
    if workers < 1:
        raise CommandError("--workers must be at least 1")
    if workers > 1:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_fresh_metrics_dir(port))
    command.stdout.write(f"Serving {application} on http://{host}:{port} with {workers} worker(s)")
    # After a graceful stop, uvicorn re-raises the SIGTERM or SIGINT it caught (with one worker), so
    # the process would die by that signal: a stop that was asked for exits 0 instead.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _exit_zero)
    uvicorn.run(
        application,
        host=host,
        port=port,
        workers=workers,
        loop=loop,
        http=HTTP_PROTOCOL,
        ws=ws,
        lifespan="on",
        timeout_graceful_shutdown=graceful_seconds,
        access_log=access_log,
        log_level="info",
        proxy_headers=False,
    )


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _fresh_metrics_dir(port: int) -> Path:
    """An empty directory for this server's worker metrics (the last run's counts are not ours)."""
    directory = Path(settings.VAR_DIR) / f"metrics-{port}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory
