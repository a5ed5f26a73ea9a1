"""Serving an ASGI application under uvicorn worker processes: what ``manage.py serve`` (the web
application, ``kvsite.asgi``) and ``manage.py gateway`` (``gateway.asgi``) share.

No Django here: ``bench/floor.py`` and ``bench/score.py`` run their servers with the same HTTP
protocol, so the floor and our application share the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HTTP_PROTOCOL = "stack.asgi_server:NoDelayHttpToolsProtocol"
"""The ``--http`` every server of ours runs uvicorn with."""


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with Nagle's algorithm off on every connection. asyncio sets
    TCP_NODELAY only on sockets accepted from a listener it made itself; with ``--workers`` > 1
    uvicorn makes the listener (``proto`` 0), so answers written in two parts (head, then body)
    waited for the client's delayed ACK: ~40 ms per request (uvloop sets it on every socket)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


def add_server_arguments(parser: argparse.ArgumentParser, *, port: int) -> None:
    """The options of a uvicorn-served command (``serve``, ``gateway``)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help=f"port to listen on (default {port})")
    parser.add_argument(
        "--workers",
        type=_at_least_one,
        default=os.cpu_count() or 1,
        help="worker processes (default: the cores)",
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
    application: str,
    *,
    host: str,
    port: int,
    workers: int,
    graceful_seconds: float,
    access_log: bool,
    metrics_dir: Path,
    say: Callable[[str], Any],
    loop: str = "asyncio",
    ws: str = "none",
    **_options: Any,
) -> None:
    """``application`` under uvicorn in ``workers`` processes, with multiprocess metrics: with
    several workers, prometheus_client's multiprocess mode in ``metrics_dir``, emptied first (the
    last run's counts are not ours), lets any worker's ``/metrics`` report all of them. ``say`` gets
    the line that tells where it serves."""
    if workers > 1:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    say(f"Serving {application} on http://{host}:{port} with {workers} worker(s)")
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


def _at_least_one(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return count


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)
