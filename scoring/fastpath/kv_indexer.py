"""The reads of Dynamo's KV-indexer API as plain ASGI, beside the scoring endpoints: ``POST
/kv-indexer/query`` and ``/kv-indexer/query_by_hash``, ``GET /kv-indexer/workers`` and
``/kv-indexer/dump`` (``scoring.kv_indexer`` says what each answers). They share the scoring
endpoints' API keys, body bound, thread pools and index reads (``ScoringApp``); the registry
writes, ``/kv-indexer/register`` and ``/unregister``, are Django's (``kvsite.kv_indexer``).
No Django here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from kvindex import KVIndex, PodBlocks
from kvindex.dynamo import DynamoBlockStore, HeldBlocks, held_blocks
from registry.config import ServiceConfig
from scoring import kv_indexer, read_path
from scoring.fastpath import metrics
from scoring.fastpath.app import ScoringApp, _authenticate, _read_body, _respond
from scoring.fastpath.errors import from_core
from scoring.fastpath.schema import RequestError
from scoring.kv_indexer import IndexerError, QueryByHashRequest, QueryRequest

logger = logging.getLogger(__name__)


class KVIndexerApp:
    """ASGI application for ``PATHS`` (HTTP only)."""

    PATHS = {
        "/kv-indexer/query": ("POST", "kv_indexer_query"),
        "/kv-indexer/query_by_hash": ("POST", "kv_indexer_query_by_hash"),
        "/kv-indexer/workers": ("GET", "kv_indexer_workers"),
        "/kv-indexer/dump": ("GET", "kv_indexer_dump"),
    }

    def __init__(self, scoring: ScoringApp) -> None:
        self.scoring = scoring
        self.handles = scoring.handles

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        method, endpoint = self.PATHS[scope["path"]]
        settings = self.handles.settings()
        headers = dict(scope["headers"])
        try:
            if scope["method"] != method:
                # Dynamo (axum) answers 405 with an empty body; ours says what to use.
                raise IndexerError(405, f'method "{scope["method"]}" is not allowed: use {method}')
            _authenticate(headers.get(b"authorization"), settings.api_keys)
            if method == "GET":
                answer = await self._get(endpoint, parse_qs(scope.get("query_string", b"").decode("latin-1")))
            else:
                body = await _read_body(receive, headers.get(b"content-length"), settings.max_body_bytes)
                content_type = headers.get(b"content-type", b"").decode("latin-1")
                answer = await self._post(endpoint, body, content_type, settings.max_json_depth)
        except Exception as exc:
            error = _as_indexer_error(exc, endpoint)
            metrics.count_request(endpoint, str(error.status))
            extra = []
            if error.status == 401:
                extra.append((b"www-authenticate", b'Bearer realm="kvcache"'))
            if error.status == 405:
                extra.append((b"allow", method.encode()))
            await _respond(send, error.status, error.body(), extra)
            return
        metrics.count_request(endpoint, "ok")
        await _respond(send, 200, answer)

    async def _get(self, endpoint: str, query: dict[str, list[str]]) -> Any:
        config = await self.handles.config.aget()
        if endpoint == "kv_indexer_workers":
            return kv_indexer.workers_answer(
                config,
                model_name=query.get("model_name", [None])[-1],
                routing_group=query.get("routing_group", [None])[-1],
            )
        index = self.handles.index()
        store = self.handles.dynamo_blocks()
        blocks, held = await self.scoring.run(True, _dump_reads, index, store, config)
        return kv_indexer.dump_answer(config, blocks, held)

    async def _post(self, endpoint: str, body: bytes, content_type: str, max_depth: int) -> Any:
        if endpoint == "kv_indexer_query_by_hash":
            by_hash = kv_indexer.decode_request(body, content_type, QueryByHashRequest, max_depth=max_depth)
            if by_hash.cache_salt is not None:
                raise IndexerError(
                    400,
                    "cache_salt is not accepted by /query_by_hash; block_hashes must already include the "
                    "intended cache salt",
                )
            config = await self.handles.config.aget()
            kv_indexer.check_indexed(config, by_hash.model_name, by_hash.routing_group)
            raise kv_indexer.by_hash_refusal(by_hash.model_name)
        request = kv_indexer.decode_request(body, content_type, QueryRequest, max_depth=max_depth)
        config = await self.handles.config.aget()
        kv_indexer.check_indexed(config, request.model_name, request.routing_group)
        keyed = await self.scoring.run(len(request.token_ids) > 4096, self._key, request, config)
        result = await self.scoring.look_up(False, keyed, config)
        metrics.observe_result("kv_indexer_query", result)
        return kv_indexer.query_answer(result, config)

    def _key(self, request: QueryRequest, config: Any) -> read_path.KeyedRequest:
        tokenizers = self.handles.tokenizers(config)
        return read_path.key_token_ids(
            config=config,
            model=request.model_name,
            token_ids=request.token_ids,
            lora_name=request.lora_name or None,
            cache_salt=request.cache_salt or None,
            max_tokens=read_path.context_length(tokenizers, config, request.model_name),
        )


def _dump_reads(
    index: KVIndex, store: DynamoBlockStore | None, config: ServiceConfig
) -> tuple[list[PodBlocks], dict[str, HeldBlocks]]:
    """What ``/dump`` reads: the block counts, and per model the recorded blocks each holder
    holds (none without a store)."""
    blocks = index.pod_blocks()
    if store is None:
        return blocks, {}
    models = {row.model for row in blocks} & set(store.models())
    return blocks, {model: held_blocks(index, store, model=model) for model in sorted(models)}


def _as_indexer_error(exc: Exception, endpoint: str) -> IndexerError:
    """Our core's refusals in Dynamo's body: ``{"error": message}``, the status ours."""
    if isinstance(exc, IndexerError):
        return exc
    error = from_core(exc)
    if error is None:
        logger.error("unhandled error in %s", endpoint, exc_info=exc)
        error = RequestError(500, "internal_error", "internal error (logged on the server)")
    return IndexerError(error.status, error.message)
