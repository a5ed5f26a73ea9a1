"""The floor of ``bench/score.py``: a bare ASGI app, no framework, that does nothing but HTTP.

It reads the whole request body and answers 200 with a fixed JSON body shaped like (and padded to
the size of) our ``/api/v1/score`` answer for a 2k-token ``token_ids`` request scored on 16 pods,
for any method and path. Served by the same server with the same options and worker count as our
endpoints, its latency is what the HTTP server, the event loop and the client cost on their own:
the part of our latency that no change to our code can remove.

    .venv/bin/uvicorn bench.floor:app --host 127.0.0.1 --port 8001 --loop asyncio \
        --http stack.asgi_server:NoDelayHttpToolsProtocol

``KVBENCH_FLOOR_BYTES`` (optional): pad the answer with trailing spaces to this many bytes (the
bench sets it to the size of the real answer it measured, when it has one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

PODS = 16
BLOCKS = 128  # 2048 tokens / 16 tokens per block
MODEL = "Qwen/Qwen3-0.6B"


def answer_body(*, size: int | None = None) -> bytes:
    """Our ``/api/v1/score`` answer for a ``BLOCKS``-block request held as a staircase on ``PODS``
    pods (pod k holds the first (k+1)/PODS of the blocks), compact JSON, padded to ``size``."""
    matched = {f"pod-{k:02d}": -(-BLOCKS * (k + 1) // PODS) for k in range(PODS)}
    body = json.dumps(
        {
            "model": MODEL,
            "blocks": BLOCKS,
            "scores": {pod: float(n) for pod, n in matched.items()},
            "pods": {
                pod: {"score": float(n), "matched_blocks": n, "normalized": n / BLOCKS, "tier": "gpu"}
                for pod, n in matched.items()
            },
        },
        separators=(",", ":"),
    ).encode()
    if size is not None and size > len(body):
        body += b" " * (size - len(body))
    return body


BODY = answer_body(
    size=int(os.environ["KVBENCH_FLOOR_BYTES"]) if os.environ.get("KVBENCH_FLOOR_BYTES") else None
)
START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())],
}
RESPONSE = {"type": "http.response.body", "body": BODY}


async def app(
    scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
) -> None:
    """Read the request body to its end, then send ``BODY``; lifespan events are acknowledged."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    b"".join(chunks)  # what any app does before parsing: the whole body in one buffer
    await send(START)
    await send(RESPONSE)
