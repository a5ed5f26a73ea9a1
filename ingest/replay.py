"""Asking an engine for the KV-event batches it still buffers: vLLM's replay protocol.

vLLM's publisher (``distributed/kv_events.py``) keeps its last batches and serves them behind a
ROUTER socket. A DEALER sends ``[b"", start_seq]`` (8 bytes, big-endian); the engine answers
every buffered batch whose seq is at least ``start_seq``, oldest first, as ``[b"", topic, seq,
payload]`` (vLLM >= 0.26) or ``[b"", seq, payload]`` (older, and SGLang), then an end marker
whose seq is -1 and whose payload is empty. Both layouts are accepted.

A replay is bounded: ``timeout`` seconds for the whole answer, at most ``max_batches`` batches
and ``max_bytes`` of payload. An answer that breaks a bound, is malformed, or does not end in
time is a :class:`ReplayFailed` with a reason (a counter label), never a partial list taken for
a whole one.

With ``curve`` (``ingest.curve``), the DEALER is a CURVE client of the engine's ROUTER, whose
public key is ``curve.server_key``; a ROUTER that does not speak CURVE with that key answers
nothing (a ``timeout``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import zmq

from ingest.curve import EventCurve
from registry.config import ServiceConfig

__all__ = ["ReplayClient", "ReplayFailed", "derived_replay_endpoint", "fetch_replay", "offset_endpoint"]

END_SEQ: Final = -1
DEFAULT_TIMEOUT_SECONDS: Final = 2.0
DEFAULT_MAX_BATCHES: Final = 100_000
DEFAULT_MAX_BYTES: Final = 512 * 2**20


class ReplayFailed(Exception):
    """The engine's buffer could not be read; ``reason`` says why (a short label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def offset_endpoint(endpoint: str, offset: int) -> str:
    """The endpoint of the ``offset``-th publisher sharing a base endpoint: a TCP port + offset
    (vLLM's data-parallel rule, also used for the pods of a fleet); ``ipc``/``inproc`` endpoints
    get a ``_dp<offset>`` suffix. Offset 0 is the endpoint itself."""
    if offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, colon, port = endpoint.rpartition(":")
        if not colon or not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} has no port to offset")
        return f"{host}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


def derived_replay_endpoint(address: str, port_offset: int) -> str | None:
    """``tcp://host:(port + port_offset)`` for a pod serving HTTP at ``host:port`` (fleets whose
    replay port follows a convention, ``ingest --replay-port-offset``); None when the address
    has no port."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        return None
    replay_port = int(port) + port_offset
    if not 0 < replay_port < 65536:
        return None
    return f"tcp://{host}:{replay_port}"


def fetch_replay(
    context: zmq.Context,
    endpoint: str,
    start: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    max_batches: int = DEFAULT_MAX_BATCHES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    curve: EventCurve | None = None,
) -> list[tuple[int, bytes]]:
    """The ``(seq, payload)`` batches the engine at ``endpoint`` buffers from seq ``start`` on,
    in the order sent (ascending); over CURVE with ``curve``. Raises :class:`ReplayFailed`."""
    if start < 0:
        raise ValueError("start must be >= 0")
    deadline = time.monotonic() + timeout
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # the answer is bounded by max_batches, not by dropping
    if curve is not None:
        curve.secure(sock, server=False, watch=False)
    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise ReplayFailed("endpoint", f"cannot connect to {endpoint!r}: {e}") from e
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        size = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(remaining * 1000, zmq.POLLIN):
                raise ReplayFailed(
                    "timeout", f"{endpoint} sent {len(batches)} batches and no end within {timeout:g}s"
                )
            frames = sock.recv_multipart(zmq.NOBLOCK)
            seq, payload = _parse_reply(frames, endpoint)
            if seq == END_SEQ:
                return batches
            if seq < start or (batches and seq <= batches[-1][0]):
                raise ReplayFailed("malformed", f"{endpoint} replayed seq {seq} out of order")
            size += len(payload)
            if len(batches) >= max_batches or size > max_bytes:
                raise ReplayFailed(
                    "too_large", f"{endpoint} replays more than {max_batches} batches or {max_bytes} bytes"
                )
            batches.append((seq, payload))
    finally:
        sock.close(0)


def _parse_reply(frames: list[bytes], endpoint: str) -> tuple[int, bytes]:
    """``(seq, payload)`` of one reply ``[b"", (topic,) seq, payload]``."""
    if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
        raise ReplayFailed("malformed", f"{endpoint} sent a {len(frames)}-frame reply, not vLLM's layout")
    return int.from_bytes(frames[-2], "big", signed=True), frames[-1]


class ReplayClient:
    """Replays from the engines of the registry: where each one's replay endpoint is, and the
    bounds every replay keeps.

    An engine's endpoint is its pod's registry ``replay_endpoint``; failing that, with
    ``port_offset``, ``tcp://host:(port + port_offset)`` of the pod's registry address. Never one
    a pod id names: ingest connects only where the registry says a pod is. Data-parallel rank r
    uses that endpoint's port + r, as vLLM does. ``curve``: ask over CURVE, as the client of
    the engines' ROUTERs (their public key is ``curve.server_key``).
    """

    def __init__(
        self,
        *,
        config: Callable[[], ServiceConfig],
        context: zmq.Context | None = None,
        port_offset: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_batches: int = DEFAULT_MAX_BATCHES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        curve: EventCurve | None = None,
    ) -> None:
        if curve is not None and curve.server_key is None:
            raise ValueError("a CURVE replay client needs the engines' public key (server_key)")
        self.config = config
        self.context = context or zmq.Context.instance()
        self.port_offset = port_offset
        self.timeout = timeout
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.curve = curve

    def endpoint(self, pod: str, rank: int = 0) -> str | None:
        """Where engine ``rank`` of ``pod`` serves replays (None: nowhere known)."""
        config = self.config()
        base = config.replay_endpoints.get(pod)
        if base is None and self.port_offset is not None:
            address = config.pod_addresses.get(pod)
            base = derived_replay_endpoint(address, self.port_offset) if address else None
        if base is None:
            return None
        try:
            return offset_endpoint(base, rank)
        except ValueError:
            return None

    def fetch(self, pod: str, rank: int, start: int) -> list[tuple[int, bytes]]:
        """What engine ``rank`` of ``pod`` buffers from seq ``start`` on (see ``fetch_replay``)."""
        endpoint = self.endpoint(pod, rank)
        if endpoint is None:
            raise ReplayFailed("no_endpoint", f"{pod} has no replay endpoint")
        return fetch_replay(
            self.context,
            endpoint,
            start,
            timeout=self.timeout,
            max_batches=self.max_batches,
            max_bytes=self.max_bytes,
            curve=self.curve,
        )
