"""The scoring endpoints as a plain ASGI application: no framework between the server and the core.

Schedulers call these on every LLM request, so they skip Django's request cycle (which cost 5-20x
the core's own work) but keep its contract: the same validation and error shape
(``scoring.fastpath.schema``, ``scoring.fastpath.errors``), the same API-key auth, metrics and
``Server-Timing`` header. ``kvsite.asgi`` sends these paths here and everything else to Django.

Bounded work per request:

* the body is read whatever its framing (``Content-Length`` or chunked) up to
  ``max_body_bytes`` (413 past it), and validated before anything is looked up (a body over
  ``bulk_body_bytes`` in the bulk pool: a 1 MB prompt takes ~7 ms to decode and check);
* keying (tokenizing, rendering) runs off the event loop, in a thread pool: requests with a
  large body or their own chat template in a separate small "bulk" pool, so they cannot take
  every thread from small ones (tokenizers release the GIL while they work; request templates
  render in a process sandbox with a CPU budget); short token ids are keyed on the loop;
* the index is read on the loop when it can be (the in-process index for up to
  ``INLINE_MAX_KEYS`` keys; Redis through ``alookup``'s pipelined connection), else in the pool;
* prompts longer than the model's context length are refused as soon as their token count is
  known.

Nothing here imports Django: the settings, the index, the tokenizer registry, the registry
snapshot and the template sandbox come in as arguments.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from kvindex import KVIndex
from kvindex.dynamo import DynamoBlockStore
from registry.config import ServiceConfig
from registry.snapshot import ConfigSource
from scoring import read_path
from scoring.fastpath import metrics
from scoring.fastpath.errors import error_body, from_core
from scoring.fastpath.schema import (
    MAX_JSON_DEPTH,
    RequestError,
    ScoreBatchRequest,
    ScoreChatCompletionsRequest,
    ScoreCompletionsRequest,
    ScoreRequest,
    decode,
)
from scoring.read_path import ChatRequest, KeyedRequest, ScoreResult
from stack.trust import bearer_problem
from tokenization.priority import lower_priority
from tokenization.template_sandbox import TemplateSandbox
from tokenization.tokenizers import TokenizerRegistry

logger = logging.getLogger(__name__)

JSON_HEADERS = [(b"content-type", b"application/json")]
INLINE_MAX_TOKENS = 4096
"""``/api/v1/score`` token ids up to this many are keyed on the event loop (``_inline``)."""
INLINE_MAX_KEYS = 256
"""The in-process index is read on the event loop for up to this many keys (~0.1 ms)."""


@dataclass(frozen=True, slots=True)
class FastPathSettings:
    """The settings the fast path reads (the shell builds them from its own settings)."""

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    allow_request_templates: bool = True
    threads: int = 8
    bulk_threads: int = 2
    bulk_body_bytes: int = 64 * 1024
    max_json_depth: int = MAX_JSON_DEPTH


@dataclass(frozen=True, slots=True)
class Handles:
    """How the fast path reaches the shared state (each a callable: tests swap them)."""

    settings: Callable[[], FastPathSettings]
    config: ConfigSource
    index: Callable[[], KVIndex]
    tokenizers: Callable[[ServiceConfig], TokenizerRegistry]
    sandbox: Callable[[], TemplateSandbox | None]
    dynamo_blocks: Callable[[], DynamoBlockStore | None] = lambda: None
    """Where ingest records blocks as Dynamo's indexer knows them (``/kv-indexer/dump``)."""


class _Answer:
    """A response body, its status and the core's timings for ``Server-Timing``."""

    __slots__ = ("body", "result", "status")

    def __init__(self, body: Any, result: ScoreResult | None = None, status: int = 200) -> None:
        self.body = body
        self.result = result
        self.status = status


class ScoringApp:
    """ASGI application for ``PATHS`` (HTTP only; ``kvsite.asgi`` routes the rest elsewhere)."""

    PATHS = {
        "/score_completions": "score_completions",
        "/score_chat_completions": "score_chat_completions",
        "/api/v1/score": "score",
        "/api/v1/score/batch": "score_batch",
        "/healthz": "healthz",
    }

    def __init__(self, handles: Handles) -> None:
        self.handles = handles
        self._pool: ThreadPoolExecutor | None = None
        self._bulk: ThreadPoolExecutor | None = None
        self._handlers: dict[str, Callable[[bytes, FastPathSettings], Awaitable[_Answer]]] = {
            "score_completions": self._score_completions,
            "score_chat_completions": self._score_chat_completions,
            "score": self._score,
            "score_batch": self._score_batch,
        }

    def close(self) -> None:
        for pool in (self._pool, self._bulk):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._bulk = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        endpoint = self.PATHS[scope["path"]]
        if endpoint == "healthz":
            await _respond(send, 200, {"status": "ok"})
            return
        settings = self.handles.settings()
        answer: _Answer | None = None
        try:
            if scope["method"] != "POST":
                raise RequestError(
                    405, "method_not_allowed", f'method "{scope["method"]}" is not allowed: use POST'
                )
            headers = dict(scope["headers"])
            _authenticate(headers.get(b"authorization"), settings.api_keys)
            body = await _read_body(receive, headers.get(b"content-length"), settings.max_body_bytes)
            answer = await self._handlers[endpoint](body, settings)
        except Exception as exc:
            error = from_core(exc)
            if error is None:
                logger.error("unhandled error in %s", endpoint, exc_info=exc)
                error = RequestError(500, "internal_error", "internal error (logged on the server)")
            metrics.count_request(endpoint, error.code)
            extra = []
            if error.status == 401:
                extra.append((b"www-authenticate", b'Bearer realm="kvcache"'))
            if error.status == 405:
                extra.append((b"allow", b"POST"))
            await _respond(send, error.status, error_body(error), extra)
            return
        metrics.count_request(endpoint, "ok")
        extra = []
        if answer.result is not None:
            metrics.observe_result(endpoint, answer.result)
            extra.append((b"server-timing", server_timing(answer.result).encode()))
        await _respond(send, answer.status, answer.body, extra)

    # --- the endpoints ---------------------------------------------------------------------------

    async def _score_completions(self, body: bytes, settings: FastPathSettings) -> _Answer:
        request = await self._decode(body, ScoreCompletionsRequest, settings)
        config = await self.handles.config.aget()
        bulk = len(body) > settings.bulk_body_bytes
        keyed = await self.run(
            bulk,
            read_path.key_prompt,
            tokenizers=self.handles.tokenizers(config),
            config=config,
            model=request.model,
            prompt=request.prompt,
            cache_salt=request.cache_salt or None,
            mm_features=request.multimodal_features(),
        )
        result = await self.look_up(bulk, keyed, config)
        return _Answer({pod: s.score for pod, s in result.scores.items()}, result)

    async def _score_chat_completions(self, body: bytes, settings: FastPathSettings) -> _Answer:
        request = await self._decode(body, ScoreChatCompletionsRequest, settings)
        config = await self.handles.config.aget()
        bulk = _is_bulk(body, request, settings)
        keyed = await self.run(
            bulk,
            read_path.key_chat,
            tokenizers=self.handles.tokenizers(config),
            config=config,
            model=request.model,
            chat=_chat(request, add_generation_prompt=request.add_generation_prompt),
            cache_salt=request.cache_salt or None,
            mm_features=request.multimodal_features(),
            sandbox=self.handles.sandbox(),
            allow_request_templates=settings.allow_request_templates,
        )
        result = await self.look_up(bulk, keyed, config)
        body_out = {
            "podScores": {pod: s.score for pod, s in result.scores.items()},
            "templated_messages": result.templated,
        }
        return _Answer(body_out, result)

    async def _score(self, body: bytes, settings: FastPathSettings) -> _Answer:
        request = await self._decode(body, ScoreRequest, settings)
        config = await self.handles.config.aget()
        bulk = _is_bulk(body, request, settings)
        if self._inline(request, config):
            keyed = self._key(request, config, settings)
        else:
            keyed = await self.run(bulk, self._key, request, config, settings)
        result = await self.look_up(bulk, keyed, config)
        return _Answer(score_body(result, config), result)

    async def look_up(self, bulk: bool, keyed: KeyedRequest, config: ServiceConfig) -> ScoreResult:
        """The index's answer for ``keyed``, read on the event loop when that costs no wait: the
        in-process index for a few keys, or an index with its own async reads (a frozen server
        then costs this request its time-out, never the loop); else in the pool."""
        index = self.handles.index()
        if getattr(index, "in_process", False):
            if len(keyed.keys) <= INLINE_MAX_KEYS:
                return read_path.look_up(index, keyed, config=config)
        elif getattr(index, "reads_async", False):
            return await read_path.alook_up(index, keyed, config=config)
        return await self.run(bulk, read_path.look_up, index, keyed, config=config)

    def _inline(self, request: ScoreRequest, config: ServiceConfig) -> bool:
        """Token ids short enough to key in well under a millisecond, for a model whose context
        length is known without loading anything, are keyed on the event loop (and looked up there
        too when the index is in this process): a thread hop and the GIL hand-offs around it would
        cost more than the work, and its tail more still."""
        token_ids = request.token_ids
        if not token_ids or len(token_ids) > INLINE_MAX_TOKENS:
            return False
        if config.model(request.model).max_model_len is not None:
            return True
        tokenizers = self.handles.tokenizers(config)
        return tokenizers.loaded(request.model) is not None or tokenizers.known_absent(request.model)

    async def _score_batch(self, body: bytes, settings: FastPathSettings) -> _Answer:
        batch = await self._decode(body, ScoreBatchRequest, settings)
        config = await self.handles.config.aget()
        requests: list[ScoreRequest | RequestError] = []
        for raw in batch.requests:
            try:
                requests.append(decode(bytes(raw), ScoreRequest, max_depth=settings.max_json_depth))
            except RequestError as error:
                requests.append(error)
        bulk = len(body) > settings.bulk_body_bytes or any(
            isinstance(r, ScoreRequest) and r.chat_template for r in requests
        )
        outcomes = await self.run(bulk, self._score_many, requests, config, settings)
        results = []
        for outcome in outcomes:
            if isinstance(outcome, RequestError):
                results.append({"status": outcome.status, **error_body(outcome)})
            else:
                metrics.observe_result("score_batch", outcome)
                results.append({"status": 200, **score_body(outcome, config)})
        return _Answer({"results": results})

    async def _decode(self, body: bytes, kind: type, settings: FastPathSettings) -> Any:
        """The validated request: on the event loop for a small body; a large one (a 1 MB prompt
        takes ~7 ms to decode and check) in the bulk pool, so it delays no other request."""
        if len(body) <= settings.bulk_body_bytes:
            return decode(body, kind, max_depth=settings.max_json_depth)
        return await self.run(True, decode, body, kind, max_depth=settings.max_json_depth)

    # --- the core, off the event loop ----------------------------------------------------------------

    def _key(self, request: ScoreRequest, config: ServiceConfig, settings: FastPathSettings) -> KeyedRequest:
        tokenizers = self.handles.tokenizers(config)
        common: dict[str, Any] = {
            "config": config,
            "model": request.model,
            "lora_name": request.lora_name or None,
            "cache_salt": request.cache_salt or None,
            "mm_features": request.multimodal_features(),
            "pods": request.pods,
        }
        if request.token_ids:
            limit = read_path.context_length(tokenizers, config, request.model)
            return read_path.key_token_ids(token_ids=request.token_ids, max_tokens=limit, **common)
        if request.prompt:
            return read_path.key_prompt(tokenizers=tokenizers, prompt=request.prompt, **common)
        return read_path.key_chat(
            tokenizers=tokenizers,
            chat=_chat(request, add_generation_prompt=request.generation_prompt()),
            sandbox=self.handles.sandbox(),
            allow_request_templates=settings.allow_request_templates,
            **common,
        )

    def _score_many(
        self, requests: list[ScoreRequest | RequestError], config: ServiceConfig, settings: FastPathSettings
    ) -> list[ScoreResult | RequestError]:
        """Each request keyed on its own (its error kept in its place), then one index round trip
        per distinct model for all of them."""
        outcomes: list[ScoreResult | RequestError | KeyedRequest] = []
        for request in requests:
            if isinstance(request, RequestError):
                outcomes.append(request)
                continue
            try:
                outcomes.append(self._key(request, config, settings))
            except Exception as exc:
                outcomes.append(_as_error(exc))
        keyed = [o for o in outcomes if isinstance(o, KeyedRequest)]
        try:
            scored = iter(read_path.look_up_many(self.handles.index(), keyed, config=config))
        except Exception as exc:
            error = _as_error(exc)
            return [error if isinstance(o, KeyedRequest) else o for o in outcomes]
        return [next(scored) if isinstance(o, KeyedRequest) else o for o in outcomes]

    async def run(self, bulk: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        settings = self.handles.settings()
        if bulk:
            if self._bulk is None:
                self._bulk = ThreadPoolExecutor(
                    settings.bulk_threads,
                    thread_name_prefix="score-bulk",
                    initializer=_lower_thread_priority,
                )
            pool = self._bulk
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(settings.threads, thread_name_prefix="score")
            pool = self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args, **kwargs))


# --- helpers -------------------------------------------------------------------------------------------


def score_body(result: ScoreResult, config: ServiceConfig) -> dict[str, Any]:
    """``/api/v1/score``'s answer: the scores, and per pod the detail and where it serves."""
    return {
        "model": result.model,
        "blocks": result.total_blocks,
        "scores": {pod: s.score for pod, s in result.scores.items()},
        "pods": {
            pod: {
                "score": s.score,
                "matched_blocks": s.matched_blocks,
                "normalized": s.normalized,
                "tier": s.tier,
                "address": config.address_of(pod),
            }
            for pod, s in result.scores.items()
        },
    }


def server_timing(result: ScoreResult) -> str:
    """``Server-Timing`` header value: each step of the core and their sum (``core``), in ms."""
    t = result.timings
    tokenize = f"tokenize;dur={t.tokenize * 1e3:.3f}"
    if result.tokenization is not None and result.tokenization.from_prefix_store:
        tokenize += ';desc="prefix store hit"'
    return ", ".join(
        (
            f"render;dur={t.render * 1e3:.3f}",
            tokenize,
            f"keys;dur={t.keys * 1e3:.3f}",
            f"lookup;dur={t.lookup * 1e3:.3f}",
            f"score;dur={t.score * 1e3:.3f}",
            f"core;dur={t.total * 1e3:.3f}",
        )
    )


def _chat(request: ScoreRequest | ScoreChatCompletionsRequest, *, add_generation_prompt: bool) -> ChatRequest:
    return ChatRequest(
        messages=request.messages,
        tools=request.tools,
        documents=request.documents,
        chat_template=request.chat_template or None,
        chat_template_kwargs=request.chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=request.continue_final_message,
    )


def _is_bulk(
    body: bytes, request: ScoreRequest | ScoreChatCompletionsRequest, settings: FastPathSettings
) -> bool:
    return len(body) > settings.bulk_body_bytes or bool(request.chat_template)


def _as_error(exc: Exception) -> RequestError:
    error = from_core(exc)
    if error is None:
        logger.error("unhandled error in a batch item", exc_info=exc)
        error = RequestError(500, "internal_error", "internal error (logged on the server)")
    return error


def _lower_thread_priority() -> None:
    lower_priority(threading.get_native_id())


def _authenticate(header: bytes | None, keys: tuple[str, ...]) -> None:
    """Nothing when no keys are configured; else ``Authorization: Bearer <one of the keys>``."""
    problem = bearer_problem(header, keys)
    if problem is not None:
        raise RequestError(401, "unauthenticated", problem)


def _too_large(limit: int) -> RequestError:
    return RequestError(
        413,
        "body_too_large",
        f"the request body is larger than {limit} bytes (KVCACHE_MAX_BODY_BYTES): send a shorter prompt, or "
        "token_ids for very long ones",
    )


async def _read_body(receive: Callable, declared: bytes | None, limit: int) -> bytes:
    """The whole body, however it is framed, refusing more than ``limit`` bytes as soon as that is
    known (from ``Content-Length``, else while reading)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError(400, "client_disconnected", "the client went away before sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _respond(
    send: Callable, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = orjson.dumps(body)
    headers = [*JSON_HEADERS, (b"content-length", str(len(payload)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
