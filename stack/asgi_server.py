"""The HTTP protocol ``manage.py serve`` and ``manage.py gateway`` run uvicorn with (``--http``).

No Django here: ``bench/floor.py`` runs under it too, so the floor and our app share the server.
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


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
