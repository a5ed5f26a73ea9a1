"""The scoring endpoints and the health probes: thin shells around ``scoring.read_path``.

Each scoring view validates the body with its serializer, calls the core with this process's
index, tokenizer registry and registry snapshot, records metrics, and shapes the answer. The
core's timing breakdown goes out in a ``Server-Timing`` header (milliseconds), so a client can
tell the service's own time from the framework's and the network's.
"""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer
from rest_framework.views import APIView

from scoring import read_path
from scoring.api import metrics
from scoring.api.auth import BEARER_HINT, SCORING_AUTHENTICATION, SCORING_PERMISSIONS
from scoring.api.codecs import BoundedJSONParser, CompactJSONRenderer, FirstRenderer
from scoring.api.errors import error_body
from scoring.api.serializers import (
    ErrorResponse,
    ScoreChatCompletionsRequest,
    ScoreChatCompletionsResponse,
    ScoreCompletionsRequest,
    ScoreRequest,
    ScoreResponse,
)
from scoring.index import IndexUnavailable
from scoring.scorer import PodScore
from scoring.selectors import service_config
from scoring.services import get_index, get_tokenizers

POD_SCORES_SCHEMA = {
    "type": "object",
    "additionalProperties": {"type": "number"},
    "description": "{pod: score}; {} when no pod holds the first block (or the prompt has no full block).",
}


def _errors(*statuses: int) -> dict[int, OpenApiResponse]:
    described = {
        400: "The body is not valid: `fields` says which field and what to send.",
        401: "KVCACHE_API_KEYS is set and no valid `Authorization: Bearer <key>` was sent.",
        404: "The model has no tokenizer (use token_ids on /api/v1/score for such models).",
        413: "The body is larger than KVCACHE_MAX_BODY_BYTES.",
        422: "The model's tokenizer files exist but do not load.",
        503: "The KV-block index cannot be reached.",
    }
    return {s: OpenApiResponse(ErrorResponse, description=described[s]) for s in statuses}


SCORING_ERRORS = _errors(400, 401, 404, 413, 422, 503)


def server_timing(result: read_path.ScoreResult) -> str:
    """``Server-Timing`` header value: each step of the core and their sum (``core``), in ms."""
    t = result.timings
    tokenize = f"tokenize;dur={t.tokenize * 1e3:.3f}"
    tokenization = result.tokenization
    if tokenization is not None and tokenization.from_prefix_store:
        tokenize += ';desc="prefix store hit"'
    parts = [
        f"render;dur={t.render * 1e3:.3f}",
        tokenize,
        f"keys;dur={t.keys * 1e3:.3f}",
        f"lookup;dur={t.lookup * 1e3:.3f}",
        f"score;dur={t.score * 1e3:.3f}",
        f"core;dur={t.total * 1e3:.3f}",
    ]
    return ", ".join(parts)


def pod_detail(score: PodScore) -> dict[str, Any]:
    return {
        "score": score.score,
        "matched_blocks": score.matched_blocks,
        "normalized": score.normalized,
        "tier": score.tier,
    }


class ScoringView(APIView):
    """What every scoring endpoint shares: API-key auth, the bounded JSON parser, compact JSON
    out whatever the Accept header, metrics per endpoint and outcome, Server-Timing."""

    endpoint = ""  # the metrics label
    authentication_classes = SCORING_AUTHENTICATION
    permission_classes = SCORING_PERMISSIONS
    parser_classes = [BoundedJSONParser]
    renderer_classes = [CompactJSONRenderer]
    content_negotiation_class = FirstRenderer
    throttle_classes: list = []
    auth_hint = BEARER_HINT

    def validated(self, serializer_class: type[Serializer]) -> Any:
        serializer = serializer_class(data=self.request.data)
        serializer.is_valid(raise_exception=True)
        return serializer

    def scored(self, body: Any, result: read_path.ScoreResult) -> Response:
        metrics.observe_result(self.endpoint, result)
        return Response(body, headers={"Server-Timing": server_timing(result)})

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)
        outcome = "ok"
        if response.status_code >= 400:
            outcome = (response.data or {}).get("error", {}).get("code", str(response.status_code))
        metrics.count_request(self.endpoint, outcome)
        return response


class ScoreCompletionsView(ScoringView):
    endpoint = "score_completions"

    @extend_schema(
        operation_id="score_completions",
        tags=["scoring (upstream-compatible)"],
        summary="Score a completion prompt (upstream's shape)",
        description="Per-pod prefix-hit scores for a prompt: the sum of the tier weights of the "
        "leading blocks each pod holds. Bare `{pod: score}`; `{}` when nothing matched, also for a "
        "prompt shorter than one block.",
        request=ScoreCompletionsRequest,
        responses={200: OpenApiResponse(POD_SCORES_SCHEMA), **SCORING_ERRORS},
        examples=[
            OpenApiExample(
                "prompt", value={"model": "Qwen/Qwen3-0.6B", "prompt": "Anarchism is..."}, request_only=True
            ),
            OpenApiExample("scores", value={"pod-a": 25.0, "pod-b": 3.0}, response_only=True),
        ],
    )
    def post(self, request: Request) -> Response:
        data = self.validated(ScoreCompletionsRequest).validated_data
        result = read_path.score_prompt(
            index=get_index(),
            tokenizers=get_tokenizers(),
            config=service_config(),
            model=data["model"],
            prompt=data["prompt"],
        )
        return self.scored({pod: s.score for pod, s in result.scores.items()}, result)


class ScoreChatCompletionsView(ScoringView):
    endpoint = "score_chat_completions"

    @extend_schema(
        operation_id="score_chat_completions",
        tags=["scoring (upstream-compatible)"],
        summary="Score a conversation (upstream's shape)",
        description="Renders the messages with the request's chat template, else the model "
        "config's, else the tokenizer's own, then scores the rendered prompt. "
        "`chat_template_kwargs` are merged over the model's template variables (the caller wins). "
        "`add_generation_prompt` defaults to false, as upstream.",
        request=ScoreChatCompletionsRequest,
        responses={200: ScoreChatCompletionsResponse, **SCORING_ERRORS},
    )
    def post(self, request: Request) -> Response:
        serializer = self.validated(ScoreChatCompletionsRequest)
        data = serializer.validated_data
        generation_prompt = data.get("add_generation_prompt", False)  # upstream's default
        chat = serializer.chat_request(data["messages"], add_generation_prompt=generation_prompt)
        result = read_path.score_chat(
            index=get_index(),
            tokenizers=get_tokenizers(),
            config=service_config(),
            model=data["model"],
            chat=chat,
        )
        body = {
            "podScores": {pod: s.score for pod, s in result.scores.items()},
            "templated_messages": result.templated,
        }
        return self.scored(body, result)


class ScoreView(ScoringView):
    endpoint = "score"

    @extend_schema(
        operation_id="score",
        tags=["scoring"],
        summary="Score a prompt, a conversation or token ids, with detail",
        description="Send exactly one of `prompt`, `messages` or `token_ids`. `token_ids` skips "
        "tokenization (any model name works). `messages` accepts the chat options of "
        "/score_chat_completions; `add_generation_prompt` defaults to true there (vLLM's chat "
        "completions default), false with `continue_final_message`. `pods` restricts the answer to "
        "those pods; `lora_name` keys the blocks as vLLM does for that adapter. Disabled pods never "
        "appear.",
        request=ScoreRequest,
        responses={200: ScoreResponse, **SCORING_ERRORS},
        examples=[
            OpenApiExample(
                "token ids",
                value={"model": "Qwen/Qwen3-0.6B", "token_ids": [1, 2, 3], "pods": ["pod-a"]},
                request_only=True,
            ),
            OpenApiExample(
                "detail",
                value={
                    "model": "Qwen/Qwen3-0.6B",
                    "blocks": 25,
                    "scores": {"pod-a": 25.0},
                    "pods": {
                        "pod-a": {"score": 25.0, "matched_blocks": 25, "normalized": 1.0, "tier": "gpu"}
                    },
                },
                response_only=True,
            ),
        ],
    )
    def post(self, request: Request) -> Response:
        serializer = self.validated(ScoreRequest)
        data = serializer.validated_data
        common = {
            "index": get_index(),
            "config": service_config(),
            "model": data["model"],
            "lora_name": data.get("lora_name") or None,
            "pods": data.get("pods"),
        }
        if "token_ids" in data:
            result = read_path.score_token_ids(token_ids=data["token_ids"], **common)
        elif "prompt" in data:
            result = read_path.score_prompt(tokenizers=get_tokenizers(), prompt=data["prompt"], **common)
        else:
            chat = serializer.chat_request(
                data["messages"], add_generation_prompt=serializer.generation_prompt()
            )
            result = read_path.score_chat(tokenizers=get_tokenizers(), chat=chat, **common)
        body = {
            "model": result.model,
            "blocks": result.total_blocks,
            "scores": {pod: s.score for pod, s in result.scores.items()},
            "pods": {
                pod: {
                    "score": s.score,
                    "matched_blocks": s.matched_blocks,
                    "normalized": s.normalized,
                    "tier": s.tier,
                }
                for pod, s in result.scores.items()
            },
        }
        return self.scored(body, result)


# --- probes: plain Django views, no authentication, no DRF -----------------------------------


def healthz(request: HttpRequest) -> JsonResponse:
    """The process is alive and serving requests (it checks nothing else)."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """Ready when the index and the database both answer; 503 (error shape, plus ``checks``)
    naming what does not."""
    checks: dict[str, str] = {}
    try:
        get_index().ping()
        checks["index"] = "ok"
    except IndexUnavailable as error:
        checks["index"] = str(error)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except DatabaseError as error:
        checks["database"] = f"the database cannot be reached: {error}"
    failing = {name: problem for name, problem in checks.items() if problem != "ok"}
    if not failing:
        return JsonResponse({"status": "ready", "checks": checks})
    message = "; ".join(f"{name}: {problem}" for name, problem in failing.items())
    return JsonResponse({**error_body("not_ready", message), "checks": checks}, status=503)
