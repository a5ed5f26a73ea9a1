"""Issue 27, defect 8, the servers' side (``stack.asgi_server``, under ``manage.py serve`` and
``manage.py gateway`` alike): slow headers, slow bodies and idle connections stayed open 60 s and
more (file descriptors 38 -> 259 with 220 slow clients). Each phase of a connection has its
deadline now (``KVCACHE_HTTP_HEADER_TIMEOUT``, ``_BODY_TIMEOUT``, ``_IDLE_TIMEOUT``: a 408 where
an answer can still be written, else the connection is closed), and one client address may hold
``KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT`` connections at once (trusted proxies excepted)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stack.asgi_server import ConnectionLimits, http_protocol
from tests.dashboard.conftest import ROOT, Process
from tests.security.gateway_harness import status_of
from tests.servers import Served, free_port, service_env, wait_until

DISCONNECTS: list[float] = []
"""When ``count_body`` read that a request's client had left before the end of its body."""


async def count_body(scope, receive, send) -> None:
    """Answers how many body bytes it read."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            DISCONNECTS.append(time.monotonic())
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def server(**limits) -> Iterator[Served]:
    served = Served(count_body, http=http_protocol(ConnectionLimits(**limits)), lifespan="off")
    try:
        yield served
    finally:
        served.stop()


def until_closed(conn: socket.socket, *, timeout: float) -> tuple[bytes, float]:
    """What the server sends until it closes ``conn`` (or ``timeout`` passes), and how long it took."""
    started = time.monotonic()
    conn.settimeout(timeout)
    received = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while data := conn.recv(65536):
            received += data
    return received, time.monotonic() - started


def test_slow_headers_are_answered_408_and_closed() -> None:
    with server(header_timeout=0.5) as served, socket.create_connection(("127.0.0.1", served.port)) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nhost: x\r\nx-slow: ")
        started = time.monotonic()
        # One byte every 100 ms, until the server answers: never the end of the headers.
        while time.monotonic() - started < 5 and not select.select([conn], [], [], 0.1)[0]:
            conn.sendall(b"x")
        answer, _ = until_closed(conn, timeout=5)
        assert status_of(answer) == 408, answer
        assert time.monotonic() - started < 3


def test_a_slow_body_is_answered_408_and_closed() -> None:
    DISCONNECTS.clear()
    with server(body_timeout=0.5) as served, socket.create_connection(("127.0.0.1", served.port)) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        answer, took = until_closed(conn, timeout=5)
        assert status_of(answer) == 408, answer
        assert took < 3
        wait_until(lambda: DISCONNECTS, what="the application to read that the client left")


def test_idle_connections_are_closed() -> None:
    with server(idle_timeout=0.5) as served:
        with socket.create_connection(("127.0.0.1", served.port)) as silent:
            answer, took = until_closed(silent, timeout=5)  # never sends a request
            assert (answer, took < 3) == (b"", True)
        with socket.create_connection(("127.0.0.1", served.port)) as kept_alive:
            kept_alive.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
            answer, took = until_closed(kept_alive, timeout=5)  # one answer, then nothing more
            assert (status_of(answer), answer.endswith(b"\r\n\r\n2"), took < 3) == (200, True, True)


def test_connections_per_client_address_are_limited_except_for_trusted_proxies() -> None:
    with server(max_connections_per_client=3) as served:
        held = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(3)]
        try:
            wait_until(lambda: len(served.server.server_state.connections) == 3, what="3 connections")
            with socket.create_connection(("127.0.0.1", served.port)) as fourth:
                answer, took = until_closed(fourth, timeout=5)
            assert (status_of(answer), took < 3) == (429, True)
            held.pop().close()
            wait_until(lambda: len(served.server.server_state.connections) == 2, what="a connection closed")
            assert httpx.post(f"{served.url}/", content=b"abc", timeout=5).text == "3"
        finally:
            for conn in held:
                conn.close()
    with server(max_connections_per_client=3, trusted_proxies=("127.0.0.1",)) as served:
        held = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(5)]
        try:
            assert httpx.post(f"{served.url}/", content=b"abcd", timeout=5).text == "4"
        finally:
            for conn in held:
                conn.close()


# --- the two servers as operators run them ------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
@pytest.mark.parametrize(("command", "health"), [("serve", "/healthz"), ("gateway", "/health")])
def test_both_servers_drop_slow_and_idle_clients(
    tmp_path: Path, redis_url: str, command: str, health: str
) -> None:
    env = service_env(
        tmp_path,
        redis_url,
        HF_HUB_OFFLINE="1",
        KVCACHE_HTTP_HEADER_TIMEOUT="0.5",
        KVCACHE_HTTP_BODY_TIMEOUT="0.5",
        KVCACHE_HTTP_IDLE_TIMEOUT="1.0",
        KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT="20",
    )
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port = free_port()
    process = Process(
        [sys.executable, "manage.py", command, "--port", str(port), "--workers", "1"], env, tmp_path / "log"
    )
    process.start()
    try:
        wait_until(lambda: _answers(port, health), timeout=30, what=f"{command} to answer")
        time.sleep(1.5)  # the readiness probes' connections are gone by now
        baseline = open_fds(process.proc.pid)
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")  # headers never end
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        try:
            answers = [until_closed(conn, timeout=5) for conn in [slow, *silent]]
        finally:
            for conn in [slow, *silent]:
                conn.close()
        assert status_of(answers[0][0]) == 408
        refused = [answer for answer, _ in answers[1:] if status_of(answer) == 429]
        assert len(refused) >= 10  # the 21st connection on; the 20 before are closed when idle
        assert all(took < 4 for _, took in answers)
        wait_until(lambda: open_fds(process.proc.pid) <= baseline + 2, timeout=5, what="the descriptors back")
    finally:
        process.stop()


def _answers(port: int, path: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
