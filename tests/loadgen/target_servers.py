"""Real servers for the ``--target`` tests: a simulated fleet and a tiny OpenAI proxy in front.

:class:`SimulatedFleet` runs :class:`simulator.fleet.Fleet` (real pods: tokenizer, prefix cache,
``/metrics``) in a thread of its own, so a test may drive loadgen with ``asyncio.run`` or
``call_command``. :func:`proxy_app` is the stand-in for a router in front of the fleet: it
forwards every completion to one pod, counts what it forwarded, and answers with the pod's
status, body and content type plus, like our gateway, ``x-kvcache-pod`` (and, when asked,
``x-kvcache-matched-blocks``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from simulator.config import EngineConfig, LatencyConfig, PodConfig
from simulator.fleet import Fleet, FleetConfig, PublishConfig
from simulator.pod import PodTokenizer
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
BLOCK_SIZE = 16
# Fast, but not instant: a streamed answer has a first token measurably before its end.
QUICK = LatencyConfig(prefill_overhead_ms=1, prefill_time_per_token_ms=0, inter_token_latency_ms=1)


class SimulatedFleet:
    """``pods`` simulated pods (``sim-0``...) serving on free loopback ports, publishing no events,
    until ``stop``. ``urls`` maps pod id -> base URL."""

    def __init__(self, tokenizer: PodTokenizer, pods: int = 2) -> None:
        pod = PodConfig(
            pod_id="sim-0",
            model=MODEL,
            engine=EngineConfig(block_size=BLOCK_SIZE, hash_seed="42"),
            latency=QUICK,
        )
        config = FleetConfig(pod=pod, pods=pods, base_port=0, publish=PublishConfig(endpoint=None))
        self.fleet = Fleet(config, tokenizer=tokenizer, graceful_timeout=0.5)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fleet.start(), self._loop).result(timeout=30)
        self.urls = {running.pod_id: running.url for running in self.fleet.pods}

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.fleet.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def qwen_tokenizer() -> PodTokenizer:
    return PodTokenizer(TokenizerRegistry(), MODEL)


@dataclass
class ProxyBehaviour:
    """Forward to ``upstream`` (a pod's base URL) and name ``pod`` in ``x-kvcache-pod`` (no header
    when None). With ``predict`` set, the whole answer is read first and
    ``x-kvcache-matched-blocks`` says ``cached_tokens // block_size + predict_error`` blocks:
    a perfect prediction for ``predict_error`` 0. ``forwarded`` lists (path, stream) per request,
    ``authorization`` the Authorization header of each."""

    upstream: str
    pod: str | None
    predict: bool = False
    predict_error: int = 0
    forwarded: list[tuple[str, bool]] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)


def _cached_tokens(content: bytes) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON answer or an SSE stream."""
    text = content.decode()
    bodies = (
        [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: {")]
        if text.startswith("data:")
        else [text]
    )
    for body in bodies:
        usage = json.loads(body).get("usage")
        if usage:
            return usage["prompt_tokens_details"]["cached_tokens"]
    raise AssertionError("the pod's answer has no usage")


def proxy_app(proxy: ProxyBehaviour) -> Starlette:
    async def forward(request: Request) -> Response:
        body = await request.json()
        proxy.forwarded.append((request.url.path, bool(body.get("stream"))))
        proxy.authorization.append(request.headers.get("authorization"))
        client = httpx.AsyncClient(timeout=30, trust_env=False)
        upstream = await client.send(
            client.build_request("POST", f"{proxy.upstream}{request.url.path}", json=body), stream=True
        )
        headers = {"x-kvcache-pod": proxy.pod} if proxy.pod is not None else {}
        media_type = upstream.headers.get("content-type")

        async def close() -> None:
            await upstream.aclose()
            await client.aclose()

        if proxy.predict:
            content = await upstream.aread()
            await close()
            if upstream.status_code == 200:
                blocks = _cached_tokens(content) // BLOCK_SIZE + proxy.predict_error
                headers["x-kvcache-matched-blocks"] = str(blocks)
            return Response(content, status_code=upstream.status_code, headers=headers, media_type=media_type)
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            headers=headers,
            media_type=media_type,
            background=BackgroundTask(close),
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", forward, methods=["POST"]),
            Route("/v1/completions", forward, methods=["POST"]),
        ]
    )
