"""The decode pod's sidecar: prefill/decode disaggregation where Envoy, not the gateway, carries
the requests (under the Endpoint Picker, as llm-d's routing sidecar does).

The picker (``epp``) names a P/D request's decode pod as its destination and its prefill pod in
``x-prefiller-host-port`` (llm-d's header). Envoy sends the request to the decode pod's sidecar,
which runs the prefill step there (``routing.disaggregation.prefill``: ``do_remote_decode``, one
output token), then sends the request with the returned ``kv_transfer_params`` to its decode pod
and streams the answer back, with ``x-kvcache-pd``: ``disaggregated``, or ``fallback`` (the
prefill step failed and the decode pod served the request whole, counted), which the picker reads
(and names the prefill pod to the client). A prefill pod's refusal of the request itself (a
4xx but 429) is the client's answer. Every other request (no such header, other paths:
``/health``, ``/metrics``, ``/v1/models``) goes to the decode pod unchanged, so the pod's own
``/metrics`` (the routers' load) is there; the sidecar's are at ``/sidecar/metrics``.

Trust: the header says where the sidecar sends a prompt; only the picker sets it (it overwrites
it on a P/D request and removes a client's on every other: ``epp.server``), so the sidecar must be
reachable only through Envoy (deploy/: the pod's port is the sidecar's, the engine listens on
localhost). The header is never passed on to the pods.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from gateway.app import (
    HOP_BY_HOP,
    Receive,
    Refused,
    Scope,
    Send,
    cancel_on_departure,
    departed,
    read_body,
    relay,
    send_bytes,
    send_error,
)
from routing.disaggregation import DISAGGREGATED, FALLBACK, decode_body, prefill
from routing.router import ROUTED_PATHS
from routing.upstream import Upstream, UpstreamError

PREFILLER = b"x-prefiller-host-port"
"""The prefill pod (``host:port``) of a request the picker disaggregated: llm-d's header."""
NOT_PASSED_ON = HOP_BY_HOP | {b"expect", PREFILLER}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    decode: str
    """The decode pod's engine (``host:port``, usually ``127.0.0.1:<port>``)."""
    connect_timeout: float = 2.0
    first_byte_timeout: float = 300.0
    prefill_timeout: float = 60.0
    max_body_bytes: int = 4 * 1024 * 1024


class SidecarMetrics:
    """The sidecar's own counts (``/sidecar/metrics``), in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvcache_sidecar_pd_requests",
            "Requests the picker disaggregated, by decision: disaggregated (two steps), fallback "
            "(served whole by the decode pod: the prefill step failed).",
            ["decision"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kvcache_sidecar_pd_fallbacks",
            "Prefill steps that failed, by reason (connect, timeout, closed, malformed, too_large, "
            "status, no_transfer_params).",
            ["reason"],
            registry=self.registry,
        )
        self.steps = Histogram(
            "kvcache_sidecar_pd_step_seconds",
            "P/D steps: prefill (the prefill pod's whole answer), transfer (the decode pod's first "
            "byte: it pulls the prompt's KV cache, then computes the first token).",
            ["step"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


class Sidecar:
    """The sidecar as an ASGI application."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        self._upstream = Upstream(
            connect_timeout=settings.connect_timeout, first_byte_timeout=settings.first_byte_timeout
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self._upstream.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] == "/sidecar/metrics":
            await send_bytes(send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode())
            return
        try:
            body = await read_body(receive, self.settings.max_body_bytes)
        except Refused as refused:
            await send_error(send, refused.status, str(refused), refused.kind)
            return
        # When the client goes away, at any await below, this task is cancelled and the pods'
        # connections closed with it.
        watcher = asyncio.create_task(cancel_on_departure(receive, asyncio.current_task()))
        try:
            await self._serve(scope, send, body)
        except asyncio.CancelledError:
            if not departed(watcher) or asyncio.current_task().uncancel():  # not (only) the client's
                raise
        finally:
            watcher.cancel()

    async def _serve(self, scope: Scope, send: Send, body: bytes) -> None:
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        headers, prefiller = [], None
        for name, value in scope["headers"]:
            if name == PREFILLER:
                prefiller = value.decode("latin-1").strip()
            elif name not in NOT_PASSED_ON:
                headers.append((name, value))
        extra: list[tuple[bytes, bytes]] = []
        transfer = False
        if prefiller and scope["method"] == "POST" and scope["path"] in ROUTED_PATHS:
            payload = _object(body)
            if payload is not None:
                sent = time.perf_counter()
                step = await prefill(
                    self._upstream, prefiller, target, headers, payload, timeout=self.settings.prefill_timeout
                )
                if step.refusal is not None:
                    status, answer = step.refusal
                    await send_bytes(
                        send, status, answer, b"application/json", [(b"x-kvcache-pd", b"prefill_refused")]
                    )
                    return
                if step.params is not None:
                    self.metrics.steps.labels("prefill").observe(time.perf_counter() - sent)
                    self.metrics.requests.labels(DISAGGREGATED).inc()
                    body, transfer = decode_body(payload, step.params), True
                    extra = [(b"x-kvcache-pd", DISAGGREGATED.encode())]
                else:
                    self.metrics.fallbacks.labels(step.failure).inc()
                    self.metrics.requests.labels(FALLBACK).inc()
                    extra = [(b"x-kvcache-pd", FALLBACK.encode())]
        sent = time.perf_counter()
        decode = self.settings.decode
        try:
            response = await self._upstream.request(decode, scope["method"].encode(), target, headers, body)
        except UpstreamError as error:
            status = 504 if error.reason == "timeout" else 502
            await send_error(send, status, f"the decode pod {decode}: {error}", "upstream_error")
            return

        def first_bytes() -> None:
            if transfer:
                self.metrics.steps.labels("transfer").observe(time.perf_counter() - sent)

        await relay(response, send, decode, extra, first_bytes)


def _object(body: bytes) -> dict | None:
    """The request's JSON object; ``None`` for anything else (the decode pod answers it)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None
