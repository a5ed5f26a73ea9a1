"""Serving an ASGI application under uvicorn worker processes: what ``manage.py serve`` (the web
application, ``kvsite.asgi``) and ``manage.py gateway`` (``gateway.asgi``) share, limits on every
connection included (``ConnectionLimits``).

No Django here: ``bench/floor.py`` and ``bench/score.py`` run their servers with the same HTTP
protocol, so the floor and our application share the server.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from stack.trust import TrustedProxies

HTTP_PROTOCOL = "stack.asgi_server:NoDelayHttpToolsProtocol"
"""The ``--http`` every server of ours runs uvicorn with (``http_protocol`` for other limits)."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long each phase of a connection may take, and how many connections one client may hold.
    uvicorn bounds only the wait between requests (``timeout_keep_alive``): a client that sent its
    headers or its body a byte at a time, or connected and sent nothing, held its connection (and a
    file descriptor) for as long as it liked."""

    header_timeout: float = 10.0
    """From a request's first byte to the end of its headers; then 408 and the connection closes."""
    body_timeout: float = 30.0
    """From the end of a request's headers to the end of its body; then 408 (the application is
    told the client left), or only the close when its answer has begun."""
    idle_timeout: float = 5.0
    """A connection with no request under way, new or kept alive after an answer, is closed after
    this long (uvicorn's keep-alive timeout, which a new connection did not have)."""
    max_connections_per_client: int = 256
    """Connections one client address may hold open in a worker process (0: no limit); the next is
    answered 429 and closed at once. Websockets, once upgraded, are not counted."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or networks free of the per-client limit: every client of a reverse proxy comes
    from the proxy's address."""

    @classmethod
    def from_settings(cls, settings: Any) -> ConnectionLimits:
        """The limits that ``settings`` (Django's, or any object with these attributes) give:
        ``KVCACHE_HTTP_HEADER_TIMEOUT``, ``_BODY_TIMEOUT``, ``_IDLE_TIMEOUT``,
        ``_MAX_CONNECTIONS_PER_CLIENT`` and ``KVCACHE_TRUSTED_PROXIES``."""
        return cls(
            header_timeout=settings.KVCACHE_HTTP_HEADER_TIMEOUT,
            body_timeout=settings.KVCACHE_HTTP_BODY_TIMEOUT,
            idle_timeout=settings.KVCACHE_HTTP_IDLE_TIMEOUT,
            max_connections_per_client=settings.KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT,
            trusted_proxies=tuple(settings.KVCACHE_TRUSTED_PROXIES),
        )


_HEADERS, _BODY = "headers", "body"
"""The phases of a request the protocol times (between requests, uvicorn's keep-alive timer does)."""

_open_by_client: weakref.WeakKeyDictionary[ServerState, dict[str, int]] = weakref.WeakKeyDictionary()
"""Per server (there may be several in one process: tests), its open connections per client."""


@functools.lru_cache(maxsize=8)
def _trusted(entries: tuple[str, ...]) -> TrustedProxies:
    return TrustedProxies(entries)


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with Nagle's algorithm off on every connection, and the
    ``ConnectionLimits`` of its server.

    Nagle: asyncio sets TCP_NODELAY only on sockets accepted from a listener it made itself; with
    ``--workers`` > 1 uvicorn makes the listener (``proto`` 0), so answers written in two parts
    (head, then body) waited for the client's delayed ACK: ~40 ms per request (uvloop sets it on
    every socket).

    Deadlines: a new connection has ``idle_timeout`` to begin a request; after each read, the
    request in progress, if any, gets a timer for the phase it is in (headers, then body), armed
    once per phase: a request that arrives whole in one read, the usual case, arms none. Between
    requests uvicorn's keep-alive timer, set to ``idle_timeout``, closes the connection. A phase
    that runs out while the server itself has stopped reading (it does so while an application
    is slow to take a large body, or behind a pipelined request) is given its time again."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits = ConnectionLimits(),
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.timeout_keep_alive = limits.idle_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._timed: tuple[Any, str] | None = None  # (the request's scope, its phase) the timer is for
        self._counted_as: str | None = None  # the client address this connection counts against
        self._upgraded = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        if self._admit():
            self._timer = self.loop.call_later(self.limits.idle_timeout, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._upgraded or self.transport.is_closing():
            return
        scope, cycle = self.scope, self.cycle
        if scope is None:  # nothing but blank lines yet: the new connection's timer runs on
            return
        if cycle is None or cycle.scope is not scope:
            self._time(scope, _HEADERS, self.limits.header_timeout)
        elif cycle.more_body:
            self._time(scope, _BODY, self.limits.body_timeout)
        else:
            self._disarm()

    def handle_websocket_upgrade(self) -> None:
        # The websocket protocol owns the transport from here on: no deadline of ours may close it.
        self._upgraded = True
        self._disarm()
        self._release()
        super().handle_websocket_upgrade()

    # --- deadlines ---------------------------------------------------------------------------

    def _time(self, scope: Any, phase: str, seconds: float) -> None:
        """A timer for ``phase`` of the request of ``scope``, unless it has one already."""
        timed = self._timed
        if timed is not None and timed[0] is scope and timed[1] is phase:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timed = (scope, phase)
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timed = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        timed, self._timed = self._timed, None
        if timed is None:  # the new connection never began a request
            self.transport.close()
            return
        scope, phase = timed
        if self.flow.read_paused:  # the server stopped reading, not the client: its time again
            self._time(
                scope, phase, self.limits.header_timeout if phase is _HEADERS else self.limits.body_timeout
            )
            return
        cycle = self.cycle
        if phase is _HEADERS:
            if cycle is None or cycle.response_complete:  # nothing else is being answered
                seconds = self.limits.header_timeout
                self._answer(
                    408,
                    "request_timeout",
                    f"the request's headers did not arrive within {seconds:g} s "
                    "(KVCACHE_HTTP_HEADER_TIMEOUT)",
                )
        elif not cycle.response_complete:
            answer = not cycle.response_started
            # The application reads that the client left, and whatever it sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            if answer:
                seconds = self.limits.body_timeout
                self._answer(
                    408,
                    "request_timeout",
                    f"the request's body did not arrive within {seconds:g} s (KVCACHE_HTTP_BODY_TIMEOUT)",
                )
        self.transport.close()

    # --- connections per client --------------------------------------------------------------

    def _admit(self) -> bool:
        """Whether the new connection may stay: its client is under the limit (then it is
        counted) or a trusted proxy; else it is answered 429 and closed."""
        limit = self.limits.max_connections_per_client
        if not limit or self.client is None:
            return True
        address = self.client[0]
        if _trusted(self.limits.trusted_proxies).trusts(address):
            return True
        counts = _open_by_client.setdefault(self.server_state, {})
        held = counts.get(address, 0)
        if held >= limit:
            self._answer(
                429,
                "too_many_connections",
                f"too many connections from this address (at most {limit} "
                "at once: KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT)",
            )
            self.transport.close()
            return False
        counts[address] = held + 1
        self._counted_as = address
        return True

    def _release(self) -> None:
        address, self._counted_as = self._counted_as, None
        if address is None:
            return
        counts = _open_by_client.get(self.server_state, {})
        held = counts.get(address, 0) - 1
        if held > 0:
            counts[address] = held
        else:
            counts.pop(address, None)

    def _answer(self, status: int, code: str, message: str) -> None:
        """An error answer written straight to the connection (no application is answering), in
        the shape both servers' errors share: ``{"error": {"code", "type", "message"}}``."""
        body = json.dumps({"error": {"code": code, "type": code, "message": message}}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(b"".join(head) + body)


def http_protocol(limits: ConnectionLimits) -> Callable[..., NoDelayHttpToolsProtocol]:
    """uvicorn's ``http`` for a server with ``limits``: the protocol class with them bound (it is
    pickled to every worker process with uvicorn's config)."""
    return functools.partial(NoDelayHttpToolsProtocol, limits=limits)


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
    limits: ConnectionLimits = ConnectionLimits(),
    **_options: Any,
) -> None:
    """``application`` under uvicorn in ``workers`` processes, each connection within ``limits``,
    with multiprocess metrics: with several workers, prometheus_client's multiprocess mode in
    ``metrics_dir``, emptied first (the last run's counts are not ours), lets any worker's
    ``/metrics`` report all of them. ``say`` gets the line that tells where it serves."""
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
        http=http_protocol(limits),  # type: ignore[arg-type] (a class with its limits bound)
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
