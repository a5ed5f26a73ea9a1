"""Issue 27, defect 8, the gateway's side: a pod that hangs before its headers was never timed out,
a client that left before the pod's headers kept the pod's request open, a pod's malformed
chunked body gave the client a 200 and a hang, and ``Expect: 100-continue`` went on to a pod
that never sends 100. Every wait on a pod is bounded now, and every departure of the client
closes the pod's request."""

from __future__ import annotations

import functools
import socket
import time

import orjson

from tests.security.gateway_harness import (
    MODEL,
    RawPod,
    answer_malformed_chunks,
    answer_never,
    gateway_app,
    raw_request,
    status_of,
)
from tests.servers import Served, wait_until

BODY = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1})
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\ncontent-length: %d"
    % len(BODY)
)


def test_a_pod_silent_before_its_headers_is_given_up_on() -> None:
    pod = RawPod(answer_never)
    gateway = Served(gateway_app({"pod": pod.address}, first_byte_timeout=0.5))
    try:
        answer, took = raw_request(gateway.port, HEAD, BODY, timeout=30)
        assert status_of(answer) == 504, answer
        assert b'"upstream_timeout"' in answer
        assert took < 15  # 0.5 s of waiting, after loading the tokenizer on a loaded machine
        wait_until(lambda: pod.closed, timeout=5, what="the gateway to close the pod's request")
    finally:
        gateway.stop()
        pod.stop()


def test_a_client_leaving_before_the_pods_headers_closes_the_pods_request() -> None:
    pod = RawPod(answer_never)
    gateway = Served(gateway_app({"pod": pod.address}))  # the default first-byte wait: minutes
    try:
        with socket.create_connection(("127.0.0.1", gateway.port)) as client:
            client.sendall(HEAD + b"\r\n\r\n" + BODY)
            wait_until(lambda: pod.received, timeout=5, what="the request to reach the pod")
        left = time.monotonic()
        wait_until(lambda: pod.closed, timeout=5, what="the gateway to close the pod's request")
        assert pod.closed[0] - left < 5
    finally:
        gateway.stop()
        pod.stop()


def test_a_malformed_chunked_body_is_a_502_at_once_or_a_closed_connection() -> None:
    """Malformed from its start, the pod's body is a 502 (the client's head waits for the body's
    first bytes); malformed later, the client's answer, begun, is cut off at once (no final
    chunk): never a hang."""
    for good, status in ((0, 502), (2, 200)):
        pod = RawPod(functools.partial(answer_malformed_chunks, good=good))
        gateway = Served(gateway_app({"pod": pod.address}))
        try:
            answer, took = raw_request(gateway.port, HEAD, BODY)
            assert status_of(answer) == status, answer
            assert took < 5
            if status == 200:
                assert answer.count(b"data: token") == good
                assert not answer.endswith(b"0\r\n\r\n")  # the chunked answer never ended
            wait_until(
                lambda pod=pod: pod.closed, timeout=5, what="the gateway to close the pod's connection"
            )
        finally:
            gateway.stop()
            pod.stop()


def test_expect_100_continue_stays_between_the_client_and_the_gateway() -> None:
    """The gateway has the whole body before it picks a pod: it asks the pod for nothing."""
    pod = RawPod()  # reads the body it is told of; never sends 100 Continue
    gateway = Served(gateway_app({"pod": pod.address}))
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
            client.sendall(HEAD + b"\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n")
            assert client.recv(1024).startswith(b"HTTP/1.1 100 Continue")  # uvicorn's, on reading
            started = time.monotonic()
            client.sendall(BODY)
            answer = b""
            while data := client.recv(65536):
                answer += data
        assert status_of(answer) == 200, answer
        assert time.monotonic() - started < 5
        assert pod.received[0].header(b"expect") is None
        assert pod.received[0].body == BODY
    finally:
        gateway.stop()
        pod.stop()
