"""The Redis index's read connection for an event loop: one pipelined connection, no thread.

The scoring fast path looks blocks up with one ``MGET`` per request. Through redis-py that cost
~0.4 ms of client time per call from a thread pool (the thread hop and its GIL hand-offs) or
from ``redis.asyncio`` (its connection pool and command machinery), against ~0.1 ms for the same
``MGET`` written straight onto one connection and parsed by hiredis (``bench/score.py``,
docs/performance.md). This module is that connection, and nothing more: it sends commands, in
order, on one socket, and matches replies to callers first in, first out (the RESP protocol
answers in order), so any number of requests share it without waiting for each other.

Guarantees:

* every call ends within ``timeout`` seconds: past it the call fails with ``TimeoutError`` and the
  connection is dropped (a server that does not answer in time may be gone), failing the calls
  still waiting on it with ``ConnectionError``; the next call connects again;
* a connection that fails or closes fails every call waiting on it, at once;
* error replies come back as ``ReplyError`` values, raised to the caller.

Only ``redis://`` and ``unix://`` URLs (user, password and database from the URL, as redis-py
reads them); ``rediss://`` has no reader here and its index reads through redis-py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

import hiredis
from redis.connection import parse_url

ReplyError = hiredis.ReplyError


def pack(args: tuple[bytes, ...] | list[bytes]) -> bytes:
    """One command in RESP: ``*N`` then each argument as a bulk string (hiredis packs it in C:
    15 us for an ``MGET`` of 128 keys, against 28 us in Python)."""
    return hiredis.pack_command(tuple(args))


class _Replies(asyncio.Protocol):
    """One connection's replies, handed to the waiting calls in the order they were sent: each
    call waits for one reply, or for a list of ``count`` (pipelined commands)."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        # (waiter, replies it waits for, those read so far: None for a single reply)
        self.waiting: deque[tuple[asyncio.Future[Any], int, list[Any] | None]] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if not self.waiting:  # a reply nobody asked for: this connection cannot be trusted
                self.abort(ConnectionError("the index sent a reply no call was waiting for"))
                return
            waiter, count, got = self.waiting[0]
            if got is not None:
                got.append(reply)
                if len(got) < count:
                    continue
                reply = got
            self.waiting.popleft()
            if not waiter.done():  # a call that timed out still holds its place in the order
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"the connection to the index closed: {exc or 'by the server'}"))

    def fail(self, error: Exception) -> None:
        self.closed = True
        while self.waiting:
            waiter, _, _ = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def abort(self, error: Exception) -> None:
        self.fail(error)
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nothing to abort
                self.transport.abort()


class ReadConnection:
    """A pipelined connection to one Redis or Valkey server, for one event loop (not thread-safe:
    call it from the loop it first ran on)."""

    def __init__(
        self,
        *,
        host: str = "localhost",
        port: int = 6379,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        timeout: float = 1.0,
        connect_timeout: float = 1.0,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._hello: list[tuple[bytes, ...]] = []
        if password is not None:
            auth = (b"AUTH", username.encode(), password.encode()) if username else None
            self._hello.append(auth or (b"AUTH", password.encode()))
        if db:
            self._hello.append((b"SELECT", str(db).encode()))
        self._replies: _Replies | None = None
        self._connecting: asyncio.Future[_Replies] | None = None

    @classmethod
    def from_url(cls, url: str, *, timeout: float, connect_timeout: float) -> ReadConnection | None:
        """A connection for ``url``, or ``None`` for a URL it cannot serve (``rediss://``)."""
        if not url.startswith(("redis://", "unix://")):
            return None
        options = parse_url(url)
        return cls(
            host=options.get("host", "localhost"),
            port=int(options.get("port", 6379)),
            path=options.get("path"),
            username=options.get("username"),
            password=options.get("password"),
            db=int(options.get("db", 0)),
            timeout=timeout,
            connect_timeout=connect_timeout,
        )

    async def execute(self, *args: bytes) -> Any:
        """Send one command and return its reply (raises ``ReplyError`` for an error reply,
        ``ConnectionError``, ``OSError`` or ``TimeoutError`` when the server cannot answer)."""
        replies = self._replies
        if replies is None or replies.closed:
            replies = await self._connect()
        reply = await self._send(replies, pack(args))
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def execute_many(self, commands: bytes, count: int) -> list[Any]:
        """Send ``count`` commands, packed one after another in ``commands``, at once, and return
        their replies in order, an error reply as a ``ReplyError`` in its place (not raised);
        ``ConnectionError``, ``OSError`` or ``TimeoutError`` as ``execute``."""
        if count < 1:
            return []
        replies = self._replies
        if replies is None or replies.closed:
            replies = await self._connect()
        reply = await self._send(replies, commands, count)
        return reply if count > 1 else [reply]

    def close(self) -> None:
        if self._replies is not None:
            self._replies.abort(ConnectionError("the read connection was closed"))
            self._replies = None

    async def _send(self, replies: _Replies, command: bytes, count: int = 1) -> Any:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        replies.waiting.append((waiter, count, [] if count > 1 else None))
        replies.transport.write(command)  # type: ignore[union-attr]
        expiry = loop.call_later(self.timeout, self._expire, replies, waiter)
        try:
            return await waiter
        finally:
            expiry.cancel()

    def _expire(self, replies: _Replies, waiter: asyncio.Future[Any]) -> None:
        if waiter.done():
            return
        waiter.set_exception(TimeoutError(f"the index did not answer within {self.timeout:g} s"))
        replies.abort(ConnectionError("the connection was dropped after a call timed out"))

    async def _connect(self) -> _Replies:
        """One connection attempt at a time: concurrent callers wait for the same one."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Replies:
        loop = asyncio.get_running_loop()
        if self.path is not None:
            opening = loop.create_unix_connection(_Replies, self.path)
        else:
            opening = loop.create_connection(_Replies, self.host, self.port)
        _, replies = await asyncio.wait_for(opening, self.connect_timeout)
        try:
            for command in self._hello:
                reply = await self._send(replies, pack(command))
                if isinstance(reply, ReplyError):
                    raise ConnectionError(f"the index refused {command[0].decode()}: {reply}")
        except BaseException:
            replies.abort(ConnectionError("the connection's handshake failed"))
            raise
        self._replies = replies  # from here on, callers use it without waiting for this task
        return replies
