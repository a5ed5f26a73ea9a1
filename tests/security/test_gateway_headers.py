"""Issue 27, defect 11: a non-ASCII header value (``café\\xff``) reached the pod re-encoded
(``cafÃ©Ã¿``), and a client's ``X-Forwarded-*`` headers reached the pods as the client wrote
them, the gateway adding none. Header bytes now go through as they came, and ``X-Forwarded-For``
names the connection's peer, extending what it says only when that peer is a trusted proxy
(``KVCACHE_TRUSTED_PROXIES``)."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from tests.security.gateway_harness import MODEL, RawPod, gateway_app, raw_request, status_of
from tests.servers import Served

BODY = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1})
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nx-note: caf\xc3\xa9\xff\r\nx-forwarded-for: 203.0.113.9\r\n"
    b"x-forwarded-host: evil.example\r\nx-forwarded-proto: https\r\nforwarded: for=203.0.113.9" % len(BODY)
)


@pytest.fixture
def pod() -> Iterator[RawPod]:
    pod = RawPod()
    yield pod
    pod.stop()


def forward(pod: RawPod, **settings) -> dict[bytes, bytes | None]:
    gateway = Served(gateway_app({"pod": pod.address}, **settings))
    try:
        answer, _ = raw_request(gateway.port, HEAD, BODY)
    finally:
        gateway.stop()
    assert status_of(answer) == 200, answer
    received = pod.received[-1]
    names = (b"x-note", b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto", b"forwarded")
    return {name: received.header(name) for name in names}


def test_header_bytes_go_through_as_they_came_and_the_peer_is_forwarded_for(pod: RawPod) -> None:
    assert forward(pod) == {
        b"x-note": b"caf\xc3\xa9\xff",
        b"x-forwarded-for": b"127.0.0.1",  # the connection's peer, not what the client wrote
        b"x-forwarded-host": None,
        b"x-forwarded-proto": None,
        b"forwarded": None,
    }


def test_a_trusted_proxys_forwarding_headers_are_kept_and_extended(pod: RawPod) -> None:
    assert forward(pod, trusted_proxies=("127.0.0.0/8",)) == {
        b"x-note": b"caf\xc3\xa9\xff",
        b"x-forwarded-for": b"203.0.113.9, 127.0.0.1",
        b"x-forwarded-host": b"evil.example",
        b"x-forwarded-proto": b"https",
        b"forwarded": b"for=203.0.113.9",
    }
