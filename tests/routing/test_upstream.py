"""The client for the pods (``routing.upstream``) against raw-socket pods: connections kept
alive and reused, one the pod closed while idle retried on a new one, interim answers skipped, a
body that ends at the close. (What it bounds and refuses: tests/security/test_gateway_upstream.py.)"""

from __future__ import annotations

import asyncio
import socket

from routing.upstream import Upstream
from tests.security.gateway_harness import RawPod, Received, answer_ok


def fetch_all(address: str, requests: int) -> list[tuple[int, bytes]]:
    """``requests`` sequential POSTs through one client: each answer's status and body."""

    async def run() -> list[tuple[int, bytes]]:
        upstream = Upstream(connect_timeout=2, first_byte_timeout=5)
        answers = []
        try:
            for n in range(requests):
                response = await upstream.request(address, b"POST", b"/v1/completions", [], b"%d" % n)
                body = b""
                while chunk := await response.next_chunk():
                    body += chunk
                response.release()
                answers.append((response.status, body))
        finally:
            upstream.close()
        return answers

    return asyncio.run(run())


def test_a_connection_is_kept_alive_and_reused() -> None:
    pod = RawPod()
    try:
        answers = fetch_all(pod.address, 5)
        assert [status for status, _ in answers] == [200] * 5
        assert [r.body for r in pod.received] == [b"0", b"1", b"2", b"3", b"4"]
        assert len(pod.connections) == 1
    finally:
        pod.stop()


def test_a_connection_the_pod_closed_unanswered_is_retried_once_on_a_new_one() -> None:
    """The race of a kept-alive connection: the pod closes it as the next request goes out."""
    answered: dict[int, int] = {}

    def once_per_connection(conn: socket.socket, request: Received) -> bool:
        if answered.setdefault(conn.fileno(), 0):
            conn.shutdown(socket.SHUT_RDWR)  # the second request on a connection: closed unanswered
            return False
        answered[conn.fileno()] += 1
        return answer_ok(conn, request)

    pod = RawPod(once_per_connection)
    try:
        assert [status for status, _ in fetch_all(pod.address, 3)] == [200] * 3
        assert len(pod.connections) == 3
    finally:
        pod.stop()


def test_interim_answers_are_skipped_and_a_body_may_end_at_the_close() -> None:
    def continue_then_until_close(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-pod: raw\r\n\r\nhello, ")
        conn.sendall(b"world")
        conn.close()
        return False

    pod = RawPod(continue_then_until_close)
    try:
        assert fetch_all(pod.address, 2) == [(200, b"hello, world")] * 2
        assert len(pod.connections) == 2  # an answer that ends at the close ends its connection
    finally:
        pod.stop()
