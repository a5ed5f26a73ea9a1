"""The HTTP/1.1 client for the pods: the gateway's hop to them, and the routers' scrapes of their
``/metrics``.

Not aiohttp, the client until issue 27: aiohttp takes header values as text and writes them as
UTF-8, so a value that is not UTF-8 (``café\\xff``) reached the pod re-encoded. Here a request goes
out as bytes, the client's header lines as they came; answers are parsed by httptools (uvicorn's
parser) and handed on as their body arrives.

Every wait on a pod is bounded:

* connecting: ``connect_timeout`` (``UpstreamError`` ``connect``);
* the answer's head (status line and headers), from the request's sending: ``first_byte_timeout``
  (``timeout``). A non-streaming completion's head comes when it is done, so this also bounds the
  longest one;
* an answer that is malformed (status line, headers, chunked framing: ``malformed``) or cut short
  (``closed``) fails at once, and its connection is closed.

Cancelling the task that waits on a request (its client left) closes the connection: the pod sees
its client leave too. Interim answers (``100 Continue``) are skipped.

Connections are kept alive and reused per pod, the most recent first, while idle less than
``KEEP_ALIVE_SECONDS``: below the 5 s after which uvicorn (vLLM's server) closes an idle
connection, so a connection the pod is closing is seldom picked; one that the pod closed without
answering is retried once on a new connection (closed idle, the pod never read the request).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httptools

KEEP_ALIVE_SECONDS = 2.0
"""How long an idle connection to a pod is kept for reuse."""
PAUSE_BYTES = 256 * 1024
"""Body bytes waiting to be handed on past which reading from the pod pauses (the client is slow)."""
RESUME_BYTES = 64 * 1024
MAX_FETCH_BYTES = 8 * 1024 * 1024
"""The largest body ``Upstream.fetch`` reads (a pod's ``/metrics`` is ~100 KB)."""


class UpstreamError(Exception):
    """A pod not reached, not answering in time, or answering malformed or too much. ``reason``:
    ``connect``, ``timeout``, ``malformed``, ``too_large`` or ``closed``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Connection(asyncio.Protocol):
    """One connection to a pod, carrying one request at a time; httptools calls its ``on_*``
    methods as the answer is parsed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.in_use = False
        self.idle_since = 0.0
        self._start()

    def _start(self) -> None:
        """A new request's answer, nothing of it received yet."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] = self.loop.create_future()  # done: the head, or an error
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False  # as the parser said at the answer's end (it forgets once reset)
        self.error: UpstreamError | None = None
        self.received = False  # any byte of the answer
        self.framed = False  # Content-Length or Transfer-Encoding: the body does not end at the close
        self.interim = False
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None

    # --- the request -------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.in_use = True
        self._start()
        self.transport.write(data)

    async def answer_head(self, timeout: float) -> None:
        """Until the answer's head has come; raises UpstreamError if it does not within
        ``timeout`` seconds, or the connection fails first."""
        if not self.head.done():
            timer = self.loop.call_later(timeout, self._head_timed_out, timeout)
            try:
                await self.head
            finally:
                timer.cancel()
        if self.status == 0:
            assert self.error is not None
            raise self.error

    async def next_chunk(self) -> bytes:
        """The body bytes that have come since the last call (waiting for some), ``b""`` at the
        end; raises UpstreamError when the body is malformed or cut short."""
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self._drain())
        self.buffered -= len(chunk)
        if self.paused and self.buffered < RESUME_BYTES:
            self.paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return chunk

    def _drain(self) -> list[bytes]:
        chunks = list(self.chunks)
        self.chunks.clear()
        return chunks

    def at_end(self) -> bool:
        """Whether the whole body has been handed on."""
        return self.complete and not self.chunks

    def reusable(self) -> bool:
        return self.at_end() and self.keep_alive and not self.closed

    def abort(self) -> None:
        """Closes the connection: a request on it ends for the pod."""
        self.in_use = False
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    # --- asyncio -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] (a TCP transport: asyncio's or uvloop's)

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # nothing may come between answers
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("malformed", "the pod switched protocols"))
        except httptools.HttpParserError as error:
            self._fail(UpstreamError("malformed", f"malformed answer: {error.__context__ or error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.in_use or self.complete or self.error is not None:
            return
        if self.status and not self.framed:  # a body that ends at the close
            self.on_message_complete()
        else:
            self._fail(UpstreamError("closed", "the pod closed the connection before the end of its answer"))

    # --- httptools ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: the parser stops (``malformed``)
            raise UpstreamError("malformed", "more than one answer to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the answer follows
            self.interim = True
            self.headers = []
            self.framed = False
            return
        self.status = status
        if status in (204, 304):
            self.framed = True
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > PAUSE_BYTES and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # --- the rest ----------------------------------------------------------------------------

    def _head_timed_out(self, timeout: float) -> None:
        self._fail(UpstreamError("timeout", f"no answer within {timeout:g} s"))

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        if not self.head.done():
            self.head.set_result(None)
        self._wake()
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class UpstreamResponse:
    """A pod's answer once its head has come: ``status`` and ``headers`` as the pod sent them, then
    its body through ``next_chunk``. ``release`` once the body is read to its end (the connection
    is reused), else ``close``."""

    __slots__ = ("_address", "_connection", "_upstream", "headers", "status")

    def __init__(self, upstream: Upstream, address: str, connection: _Connection) -> None:
        self._upstream = upstream
        self._address = address
        self._connection = connection
        self.status = connection.status
        self.headers = connection.headers

    async def next_chunk(self) -> bytes:
        """The body's next bytes, ``b""`` at its end; raises UpstreamError (malformed, cut short)."""
        return await self._connection.next_chunk()

    def at_end(self) -> bool:
        return self._connection.at_end()

    def release(self) -> None:
        self._upstream._release(self._address, self._connection)

    def close(self) -> None:
        self._connection.abort()


class Upstream:
    """The pods' connections, kept alive per pod (``address``: ``host:port``)."""

    def __init__(self, *, connect_timeout: float, first_byte_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self._idle: dict[str, deque[_Connection]] = {}
        self._pruning: asyncio.TimerHandle | None = None

    async def request(
        self, address: str, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Sends the request (``headers`` as they are, then ``Host`` and ``Content-Length``) and
        returns the pod's answer once its head has come; raises UpstreamError."""
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, target, address.encode())]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        data = b"".join(lines) + body
        connection = self._take_idle(address)
        while True:
            fresh = connection is None
            if connection is None:
                connection = await self._connect(address)
            connection.send(data)
            try:
                await connection.answer_head(self.first_byte_timeout)
            except UpstreamError as error:
                connection.abort()
                if not fresh and error.reason == "closed" and not connection.received:
                    connection = None  # the pod had closed it, idle: once more on a new connection
                    continue
                raise
            except BaseException:  # cancelled: the client left
                connection.abort()
                raise
            return UpstreamResponse(self, address, connection)

    async def fetch(
        self,
        address: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        *,
        timeout: float,
        max_bytes: int = MAX_FETCH_BYTES,
        method: bytes = b"GET",
        body: bytes = b"",
    ) -> tuple[int, bytes]:
        """``method target`` (``GET`` by default), its status and whole body within ``timeout``
        seconds (at most ``max_bytes``: else ``too_large``); raises UpstreamError."""
        response: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(timeout):
                response = await self.request(address, method, target, headers, body)
                parts, size = [], 0
                while chunk := await response.next_chunk():
                    size += len(chunk)
                    if size > max_bytes:
                        raise UpstreamError("too_large", f"an answer over {max_bytes} bytes")
                    parts.append(chunk)
        except TimeoutError:
            if response is not None:
                response.close()
            raise UpstreamError("timeout", f"no whole answer within {timeout:g} s") from None
        except BaseException:
            if response is not None:
                response.close()
            raise
        response.release()
        return response.status, b"".join(parts)

    def close(self) -> None:
        """Closes every idle connection (those in use end with their requests)."""
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()
        if self._pruning is not None:
            self._pruning.cancel()
            self._pruning = None

    # --- the pool ----------------------------------------------------------------------------

    async def _connect(self, address: str) -> _Connection:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), host.strip("[]"), int(port)
                )
        except TimeoutError:
            raise UpstreamError("connect", f"no connection within {self.connect_timeout:g} s") from None
        except (OSError, ValueError) as error:
            raise UpstreamError("connect", f"{type(error).__name__}: {error}") from None
        return connection

    def _take_idle(self, address: str) -> _Connection | None:
        """The most recently idle connection to ``address`` still fresh, if any."""
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            if now - connection.idle_since > KEEP_ALIVE_SECONDS:  # and every older one too
                connection.abort()
                while idle:
                    idle.pop().abort()
                return None
            return connection
        return None

    def _release(self, address: str, connection: _Connection) -> None:
        if not connection.reusable():
            connection.abort()
            return
        connection.in_use = False
        connection.idle_since = time.monotonic()
        self._idle.setdefault(address, deque()).append(connection)
        if self._pruning is None:
            self._pruning = asyncio.get_running_loop().call_later(KEEP_ALIVE_SECONDS, self._prune)

    def _prune(self) -> None:
        """Closes the connections idle too long (then again later, while any are idle)."""
        self._pruning = None
        stale = time.monotonic() - KEEP_ALIVE_SECONDS
        for idle in self._idle.values():
            while idle and (idle[0].closed or idle[0].idle_since < stale):
                idle.popleft().abort()
        if any(self._idle.values()):
            self._pruning = asyncio.get_running_loop().call_later(KEEP_ALIVE_SECONDS, self._prune)
