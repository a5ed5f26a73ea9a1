"""What the gateway's security tests stand on: raw-socket pods that record every byte the gateway
sends them and answer as a test needs (at once, never, or with a broken body), the gateway core
under uvicorn with the servers' HTTP protocol in a thread, and raw-socket clients."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from gateway.app import GatewayApp, GatewayHandles, GatewaySettings
from kvindex import open_index
from registry.config import ServiceConfig
from registry.snapshot import ConfigSource
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
OK_BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi"}]}'


class Received:
    """One request as a pod read it: its head (request line and headers) and body, as bytes."""

    def __init__(self, head: bytes, body: bytes) -> None:
        self.head = head
        self.body = body

    def headers(self) -> list[tuple[bytes, bytes]]:
        """(lower-cased name, value as sent) of every header line."""
        lines = self.head.split(b"\r\n")[1:]
        return [
            (n.strip().lower(), v.strip()) for n, _, v in (line.partition(b":") for line in lines if line)
        ]

    def header(self, name: bytes) -> bytes | None:
        values = [v for n, v in self.headers() if n == name]
        return b", ".join(values) if values else None


def answer_ok(conn: socket.socket, request: Received) -> bool:
    """A 200 with a small JSON body; the connection stays open for the next request."""
    conn.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(OK_BODY), OK_BODY)
    )
    return True


def answer_never(conn: socket.socket, request: Received) -> bool:
    """No answer at all: the connection stays open until the gateway closes it."""
    return False


def answer_malformed_chunks(conn: socket.socket, request: Received, *, good: int = 0) -> bool:
    """A 200 whose chunked body turns malformed after ``good`` well-formed chunks, each a moment
    after the last (the head goes out alone); then silence."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(good):
        time.sleep(0.2)
        conn.sendall(b"d\r\ndata: token\n\n\r\n")
    time.sleep(0.2)
    conn.sendall(b"zz\r\nnot a chunk\r\n")
    return False


class RawPod:
    """A pod on a free loopback port, one thread per connection: it reads each request whole
    (``Content-Length`` framing), records it in ``received``, and answers with ``answer``
    (which returns whether to read another request from the connection). ``closed`` gets the
    time of every connection the gateway closed while the pod was still waiting on it;
    ``connections`` every connection accepted. The gateway's scrapes of ``/metrics`` are answered
    (empty) and not recorded."""

    def __init__(self, answer: Callable[[socket.socket, Received], bool] = answer_ok) -> None:
        self.answer = answer
        self.received: list[Received] = []
        self.closed: list[float] = []
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                request = Received(head, b"")
                length = int(request.header(b"content-length") or 0)
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                request.body, buffer = buffer[:length], buffer[length:]
                if head.startswith(b"GET /metrics "):  # the gateway's load scrapes: nothing to report
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                self.received.append(request)
                if not self.answer(conn, request):
                    while conn.recv(65536):  # until the gateway closes the connection
                        pass
                    self.closed.append(time.monotonic())
                    return

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.close()


def gateway_app(pods: dict[str, str], **settings) -> GatewayApp:
    """The gateway core in front of ``pods`` (pod -> address, all serving :data:`MODEL`), an
    in-memory index and the model's tokenizer; ``settings`` are ``GatewaySettings``'."""
    config = ServiceConfig(
        seed="42", default_block_size=16, pods=dict.fromkeys(pods, MODEL), pod_addresses=dict(pods)
    )
    index = open_index("memory://")
    tokenizers = TokenizerRegistry()
    return GatewayApp(
        GatewayHandles(
            config=ConfigSource(lambda: config, max_age=0.0),
            index=lambda: index,
            tokenizers=lambda _config: tokenizers,
            sandbox=lambda: None,
        ),
        GatewaySettings(seed=7, **settings),
    )


def raw_request(port: int, head: bytes, body: bytes = b"", *, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``head`` (request line and header lines, without the blank line) and ``body`` on a
    new connection; return everything the server sent until it closed the connection or
    ``timeout`` passed, and how long that took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(head + b"\r\nconnection: close\r\n\r\n" + body)
        answer = b""
        with contextlib.suppress(TimeoutError):
            while data := conn.recv(65536):
                answer += data
    return answer, time.monotonic() - started


def status_of(answer: bytes) -> int:
    """The status code of a raw HTTP answer (0 when there is none)."""
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
