"""The fast path's endpoints in the OpenAPI schema, beside what drf-spectacular finds in Django.

The request bodies come from the same ``msgspec`` types that validate them
(``scoring.fastpath.schema``), so the documentation cannot drift from the validation; the
responses are described here once.
"""

from __future__ import annotations

from typing import Any

import msgspec

from scoring.fastpath.schema import MAX_BATCH, openapi_components
from scoring.kv_indexer import QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest

_ERRORS = {
    "400": "The body is not valid: `fields` says which field and what to send (also: JSON nested "
    "too deep, a prompt longer than the model's context length, `mm_features` past the prompt's last "
    "token, a template that cannot render).",
    "401": "KVCACHE_API_KEYS is set and no valid `Authorization: Bearer <key>` was sent.",
    "404": "The model has no tokenizer (use token_ids on /api/v1/score for such models).",
    "405": "Only POST is allowed.",
    "413": "The body is larger than KVCACHE_MAX_BODY_BYTES.",
    "422": "The model's tokenizer does not load, or the request's chat template went over its CPU, "
    "memory or output budget.",
    "503": "The KV-block index cannot be reached, or every template sandbox is busy.",
}

_POD_SCORES = {
    "type": "object",
    "additionalProperties": {"type": "number"},
    "description": "{pod: score}; {} when no pod holds the first block (or the prompt has no full block).",
    "example": {"pod-a": 25.0, "pod-b": 3.0},
}

_SCHEMAS: dict[str, Any] = {
    "PodScores": _POD_SCORES,
    "ScoreChatCompletionsResponse": {
        "type": "object",
        "properties": {
            "podScores": {"$ref": "#/components/schemas/PodScores"},
            "templated_messages": {"type": "string", "description": "The rendered prompt that was scored."},
        },
        "required": ["podScores", "templated_messages"],
    },
    "PodResult": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "description": "Sum of the tier weights of the matched blocks."},
            "matched_blocks": {
                "type": "integer",
                "description": "Leading blocks of the prompt the pod holds.",
            },
            "normalized": {"type": "number", "description": "matched_blocks / blocks."},
            "tier": {
                "type": "string",
                "description": 'The slowest tier of the matched prefix ("gpu" when all).',
            },
            "address": {
                "type": "string",
                "nullable": True,
                "description": "Where the pod serves HTTP (the registry's address); null when unknown.",
            },
        },
    },
    "ScoreResponse": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "blocks": {
                "type": "integer",
                "description": "Full blocks in the request (a partial last one is not).",
            },
            "scores": {"$ref": "#/components/schemas/PodScores"},
            "pods": {
                "type": "object",
                "additionalProperties": {"$ref": "#/components/schemas/PodResult"},
                "description": "The same pods, with the detail and their address.",
            },
        },
    },
    "ScoreBatchResponse": {
        "type": "object",
        "properties": {
            "results": {
                "type": "array",
                "description": "One per request, in order: `status` 200 and a ScoreResponse, or the "
                "item's error status and `error`.",
                "items": {
                    "allOf": [
                        {"type": "object", "properties": {"status": {"type": "integer"}}},
                        {"$ref": "#/components/schemas/ScoreResponse"},
                    ]
                },
            }
        },
    },
}


def _operation(
    operation_id: str, tag: str, summary: str, description: str, request: str, response: dict
) -> dict[str, Any]:
    return {
        "post": {
            "operationId": operation_id,
            "tags": [tag],
            "summary": summary,
            "description": description,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}},
            },
            "responses": {
                "200": {"description": "Scores.", "content": {"application/json": {"schema": response}}},
                **{
                    status: {
                        "description": text,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                    }
                    for status, text in _ERRORS.items()
                },
            },
            "security": [{"apiKey": []}, {}],
        }
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


PATHS = {
    "/score_completions": _operation(
        "score_completions",
        "scoring (upstream-compatible)",
        "Score a completion prompt (upstream's shape)",
        "Per-pod prefix-hit scores for a prompt: the sum of the tier weights of the leading blocks "
        "each pod holds. Bare `{pod: score}`; `{}` when nothing matched, also for a prompt shorter "
        "than one block. `cache_salt` and `mm_features` key the blocks as vLLM does for a request with "
        "them (as on /api/v1/score).",
        "ScoreCompletionsRequest",
        _ref("PodScores"),
    ),
    "/score_chat_completions": _operation(
        "score_chat_completions",
        "scoring (upstream-compatible)",
        "Score a conversation (upstream's shape)",
        "Renders the messages with the request's chat template (in a sandbox with a CPU budget), else the "
        "model config's, else the tokenizer's own, then scores the rendered prompt. `chat_template_kwargs` "
        "are merged over the model's template variables (the caller wins). `add_generation_prompt` "
        "defaults to false, as upstream. `cache_salt` and `mm_features` (in positions of the rendered "
        "prompt's tokens) as on /api/v1/score.",
        "ScoreChatCompletionsRequest",
        _ref("ScoreChatCompletionsResponse"),
    ),
    "/api/v1/score": _operation(
        "score",
        "scoring",
        "Score a prompt, a conversation or token ids, with detail and pod addresses",
        "Send exactly one of `prompt`, `messages` or `token_ids`. `token_ids` skips tokenization (any model "
        "name works). `pods` restricts the answer to those pods; `lora_name`, `cache_salt` and `mm_features` "
        "key the blocks as vLLM does for a request served with that adapter, salt and media: a pod's "
        "salted blocks score only for the same salt, and a prompt with an image hits the blocks the image "
        "overlaps only with the same identifier and offset. The model config's `hash_lookahead_tokens` "
        "keys each block with the tokens after it too (a block then counts only when they follow it). "
        "Disabled pods never appear. Each pod comes with its registry `address`.",
        "ScoreRequest",
        _ref("ScoreResponse"),
    ),
    "/api/v1/score/batch": _operation(
        "score_batch",
        "scoring",
        f"Score up to {MAX_BATCH} requests in one call",
        "Each item is an /api/v1/score body; the answers come in the same order, each with its own status "
        "and result or error. One index round trip per distinct model.",
        "ScoreBatchRequest",
        _ref("ScoreBatchResponse"),
    ),
}

_INDEXER_TAG = "KV-indexer API (Dynamo-compatible)"
_DYNAMO_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}}


def _indexer_operation(
    method: str,
    summary: str,
    description: str,
    request: str | None,
    ok: str,
    errors: dict[str, str],
    staff: bool,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": "kv_indexer_" + summary.split()[0].lower(),
        "tags": [_INDEXER_TAG],
        "summary": summary,
        "description": description,
        "responses": {
            ok.split(" ", 1)[0]: {"description": ok.split(" ", 1)[1]},
            **{
                status: {"description": text, "content": {"application/json": {"schema": _DYNAMO_ERROR}}}
                for status, text in errors.items()
            },
        },
        "security": [{"basicAuth": []}, {"cookieAuth": []}] if staff else [{"apiKey": []}, {}],
    }
    if request is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}},
        }
    return {method: operation}


_BODY_ERRORS = {
    "400": "The body is not JSON (or a field's value is refused: the message names it).",
    "415": "No `Content-Type: application/json`.",
    "422": "A field is missing or of the wrong type.",
}
_STAFF_ERRORS = {"401": "Not logged in: HTTP basic credentials of a staff user.", "403": "Not staff."}

KV_INDEXER_PATHS = {
    "/kv-indexer/register": _indexer_operation(
        "post",
        "Register an engine's KV-event endpoint (staff)",
        "Dynamo's `/register`: creates the pod `instance_id` (a number is the pod id in decimal) or "
        "gives a pod registered otherwise its `endpoint` (the registry's `event_endpoint`, where "
        "`ingest --replica` connects), `model_name` and `replay_endpoint`; a model without a config "
        "gets one with `block_size`. "
        "`routing_group`: only `default`; `tenant_id` is ignored, as by Dynamo.",
        "RegisterRequest",
        '201 {"status": "ok"}',
        {
            **_BODY_ERRORS,
            **_STAFF_ERRORS,
            "409": "Already registered, another block size or model, or a "
            "dp_rank above 0 on another endpoint than its pod's.",
        },
        True,
    ),
    "/kv-indexer/unregister": _indexer_operation(
        "post",
        "Unregister an engine (staff)",
        "Dynamo's `/unregister`: the pod and its blocks go; with `routing_group` and a `dp_rank` above 0, "
        "only that rank's blocks.",
        "UnregisterRequest",
        '200 {"status": "ok"}',
        {**_BODY_ERRORS, **_STAFF_ERRORS, "404": "No such registered pod for that model."},
        True,
    ),
    "/kv-indexer/workers": _indexer_operation(
        "get",
        "List the registered engines",
        "Dynamo's `/workers`: every registered pod, in Dynamo's shape; `?model_name=` and `?routing_group=` "
        "filter.",
        None,
        "200 A list of workers.",
        {"401": "KVCACHE_API_KEYS is set and no valid bearer key was sent."},
        False,
    ),
    "/kv-indexer/query": _indexer_operation(
        "post",
        "Matched tokens of token ids per instance and rank",
        'Dynamo\'s `/query`: `{"scores": {instance: {dp_rank: tokens}}, "frequencies", '
        '"instances"}`, the matched blocks of our score times the model\'s block size. `cache_salt` '
        "and `lora_name` key the blocks as vLLM does; `tenant_id` is ignored, as by Dynamo.",
        "QueryRequest",
        "200 Matched tokens.",
        {
            **_BODY_ERRORS,
            "401": "No valid bearer key.",
            "404": "No indexer for the model (no registered pod, no model config) or routing group.",
            "413": "Larger than KVCACHE_MAX_BODY_BYTES.",
        },
        False,
    ),
    "/kv-indexer/query_by_hash": _indexer_operation(
        "post",
        "Dynamo's block hashes: refused",
        "Dynamo's block hashes (XXH3-64 of each block's tokens) are not this index's keys (vLLM's "
        "sha256_cbor chain): answered 400 once the body, `cache_salt` and the model are checked as Dynamo "
        "checks them. Send token_ids to /kv-indexer/query.",
        "QueryByHashRequest",
        "200 Never.",
        {**_BODY_ERRORS, "401": "No valid bearer key.", "404": "No indexer for the model."},
        False,
    ),
    "/kv-indexer/dump": _indexer_operation(
        "get",
        "The index as Dynamo's dump: stored events per worker, rank and tier",
        "Dynamo's `/dump`, per `\"<model>:default\"`: `block_size` and `events`, the blocks held as Dynamo's "
        "radix tree lists them (stored events, parents first: what `python -m dynamo.indexer --peers "
        "http://<here>/kv-indexer` replays), of pods with a numeric id, when ingest records them "
        "(KVCACHE_DYNAMO_BLOCKS; else empty); ours, `blocks` counts the blocks of each instance, rank "
        "and tier.",
        None,
        "200 Per model.",
        {"401": "No valid bearer key.", "503": "The index cannot be reached."},
        False,
    ),
}


HEALTHZ = {
    "get": {
        "operationId": "healthz",
        "tags": ["probes"],
        "summary": "The process is alive (checks nothing else; no Host check, for probes by pod IP)",
        "responses": {"200": {"description": '{"status": "ok"}'}},
    }
}


def add_fast_path(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the fast path's paths and schemas."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(openapi_components())
    schemas.update(_SCHEMAS)
    schemas.setdefault(
        "Error",
        {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string", "description": "What went wrong and what to fix."},
                        "fields": {
                            "type": "object",
                            "description": "Field -> problems, for invalid requests.",
                        },
                    },
                }
            },
        },
    )
    result["components"].setdefault("securitySchemes", {})["apiKey"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "Required only when KVCACHE_API_KEYS is set: one of its keys.",
    }
    _, indexer_schemas = msgspec.json.schema_components(
        [RegisterRequest, UnregisterRequest, QueryRequest, QueryByHashRequest],
        ref_template="#/components/schemas/{name}",
    )
    schemas.update(indexer_schemas)
    result.setdefault("paths", {}).update(PATHS)
    result["paths"].update(KV_INDEXER_PATHS)
    result["paths"]["/healthz"] = HEALTHZ
    return result
