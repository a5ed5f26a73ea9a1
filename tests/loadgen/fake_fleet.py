"""Tiny real HTTP servers for the loadgen tests: a vLLM-like pod and a scoring API.

Each is a Starlette app served by uvicorn on a free loopback port in a background thread. The
pod streams SSE exactly as vLLM does (role chunk, one chunk per token, finish chunk, usage
chunk, ``[DONE]``) after a fixed first-token delay, and its /metrics counters grow by a fixed
amount per request, so a test knows the TTFT and the hit rate to expect.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.servers import free_port


@dataclass
class PodBehaviour:
    """What a fake pod does per request; counters start at ``hits`` / ``queries``."""

    name: str
    first_token_delay: float = 0.1
    token_delay: float = 0.01
    tokens: tuple[str, ...] = ("Hello", " wor", "ld", " ✓")
    prompt_tokens: int = 40
    cached_tokens: int = 30
    hits: float = 1000.0
    queries: float = 5000.0
    fail_status: int | None = None
    received: list[dict] = field(default_factory=list)
    resets: int = 0


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def pod_app(pod: PodBehaviour) -> Starlette:
    async def complete(request: Request) -> Response:
        body = await request.json()
        pod.received.append(body)
        if pod.fail_status is not None:
            error = {"message": "Too many requests, slow down.", "type": "RateLimitError", "param": None}
            return JSONResponse({"error": {**error, "code": pod.fail_status}}, status_code=pod.fail_status)
        pod.queries += pod.prompt_tokens
        pod.hits += pod.cached_tokens
        chat = request.url.path.endswith("/chat/completions")
        base = {"id": "cmpl-1", "created": 1, "model": body["model"]}

        def chunk(text: str | None, finish: str | None = None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {**base, "object": "chat.completion.chunk", "choices": [choice]}
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "object": "text_completion", "choices": [choice]}

        async def events():
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield _sse({**base, "object": "chat.completion.chunk", "choices": [role]})
            await asyncio.sleep(pod.first_token_delay)
            for i, token in enumerate(pod.tokens):
                if i:
                    await asyncio.sleep(pod.token_delay)
                yield _sse(chunk(token))
            yield _sse(chunk(None, "length"))
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": pod.prompt_tokens,
                    "completion_tokens": len(pod.tokens),
                    "total_tokens": pod.prompt_tokens + len(pod.tokens),
                    "prompt_tokens_details": {"cached_tokens": pod.cached_tokens},
                }
                yield _sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request: Request) -> Response:
        label = '{model_name="m",engine="0"}'
        text = (
            "# HELP vllm:prefix_cache_queries Prefix cache queries, in tokens.\n"
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total{label} {pod.queries}\n"
            "# HELP vllm:prefix_cache_hits Prefix cache hits, in tokens.\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total{label} {pod.hits}\n"
            "# HELP vllm:num_requests_running Requests running.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} 0.0\n"
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def reset(request: Request) -> Response:
        pod.resets += 1
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", complete, methods=["POST"]),
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/metrics", metrics),
            Route("/reset_prefix_cache", reset, methods=["POST"]),
        ]
    )


@dataclass
class ScoringBehaviour:
    """Fixed scores for every prompt; a request without ``Bearer <api_key>`` gets 401."""

    scores: dict[str, float]
    blocks: int = 10
    api_key: str | None = None
    fail_status: int | None = None
    received: list[dict] = field(default_factory=list)


def scoring_app(scoring: ScoringBehaviour) -> Starlette:
    async def score(request: Request) -> Response:
        if scoring.api_key and request.headers.get("authorization") != f"Bearer {scoring.api_key}":
            return JSONResponse({"detail": "this endpoint needs an API key"}, status_code=401)
        if scoring.fail_status is not None:
            return JSONResponse({"detail": "index unavailable"}, status_code=scoring.fail_status)
        body = await request.json()
        scoring.received.append(body)
        pods = body.get("pods")
        scores = {p: s for p, s in scoring.scores.items() if pods is None or p in pods}
        detail = {
            p: {"score": s, "matched_blocks": int(s), "normalized": s / scoring.blocks, "tier": "gpu"}
            for p, s in scores.items()
        }
        return JSONResponse(
            {"model": body["model"], "blocks": scoring.blocks, "scores": scores, "pods": detail}
        )

    return Starlette(routes=[Route("/api/v1/score", score, methods=["POST"])])


class Served:
    """An ASGI app served by uvicorn on a free loopback port until ``stop``."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the test server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
