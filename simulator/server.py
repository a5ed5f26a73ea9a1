"""The HTTP shell of one simulated pod: a Starlette app that translates requests into ``Pod`` calls.

Endpoints (vLLM's OpenAI server and its operational endpoints):

=========================================  ===========================================================
``POST /v1/completions``                   prompt: str | [str] | [int] | [[int]]; ``stream`` (SSE),
                                           with ``return_token_ids`` each chunk's ``token_ids``
``POST /v1/chat/completions``              messages rendered with the model's chat template
``GET /v1/models``                         the base model and the loaded LoRA adapters
``POST /tokenize``                         ``{"count", "tokens", "max_model_len", "token_strs"}``
``GET /health``, ``GET /health/ready``     200; ready is 503 while sleeping
``GET /metrics``                           Prometheus text, ``vllm:`` names (``simulator.metrics``)
``POST /v1/load_lora_adapter``             ``{"lora_name", "lora_path"}``
``POST /v1/unload_lora_adapter``           ``{"lora_name"}``
``GET|POST /admin/config``                 the configuration (and the pod's ``role``); POST changes
                                           latency and failures
``POST /reset_prefix_cache``               AllBlocksCleared; 409 while requests hold blocks
``POST /sleep``, ``POST /wake_up``         sleep drops the prefix cache; ``GET /is_sleeping``
=========================================  ===========================================================

And SGLang's operational endpoints, which vllm-router and sglang-router ask their workers for (SMG
asks for vLLM's: ``/health``, ``/v1/models``, ``/metrics``):

=========================================  ===========================================================
``GET /[get_]server_info``                 model, tokenizer, ``dp_size``, cache and batch sizes,
                                           ``disaggregation_mode`` (the role: ``"prefill"``,
                                           ``"decode"``, ``"null"`` for both)
``GET /[get_]model_info``                  model and tokenizer path, ``is_generation``
``GET /get_load``                          per rank ``{"dp_rank", "num_reqs", "num_waiting_reqs",
                                           "num_tokens"}``
``GET /health_generate``                   200; 503 while sleeping
``GET|POST /flush_cache``                  as ``/reset_prefix_cache``
=========================================  ===========================================================

Completions and chat completions answer with ``X-Simulated-Pod: <pod id>``, so a client behind a
router can tell which pod served it.

Both take vLLM's ``kv_transfer_params`` (prefill/decode disaggregation, NixlConnector's keys,
``simulator.protocol.KVTransferParams``; any pod serves both sides, its ``role`` only announced in
``/server_info``'s ``disaggregation_mode``):

* ``{"do_remote_decode": true}``: a prefill for another pod. Not streamed (400 "Prefill does not
  support streaming"); one token per choice, ``finish_reason: "remote_decode"``, and a top-level
  ``kv_transfer_params`` for the decode request: ``do_remote_prefill: true``, ``remote_engine_id``
  (the pod, ``<pod>#dp<r>`` for rank r > 0), ``remote_request_id``, ``remote_block_ids`` (``[[the
  block ids of the prompt in that engine]]``), ``remote_host`` and ``remote_port`` (where the
  request reached the pod), ``tp_size`` 1 and ``remote_prefill_cached_tokens``.
* ``{"do_remote_prefill": true, ...}``: the decode of that prefill. The prompt tokens beyond the
  local prefix hit are "transferred" (the first token after ``kv_cache_transfer_latency_ms`` +
  tokens * ``kv_cache_transfer_time_per_token_ms``, then stored and published), then decoding
  goes on as usual, streamed or not. Its ``cached_tokens`` are vLLM 0.32's: the request's
  ``remote_prefill_cached_tokens`` if it has them, else the whole prompt (none computed here).

Streams are ``data: <json>\\n\\n`` events: for chat, a role chunk ``{"role": "assistant"}`` before
each choice's first token, then one chunk per token, then a chunk with ``finish_reason``, then a
usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``. Every error is an OpenAI
error body with its status (``simulator.errors``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from simulator.config import ConfigError
from simulator.errors import OpenAIError, bad_request
from simulator.pod import Pod, Submission
from simulator.protocol import (
    ChatParams,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    parse_chat,
    parse_completion,
    usage_chunk,
)

__all__ = ["POD_HEADER", "create_app"]

_SSE_HEADERS = {"Cache-Control": "no-cache"}
POD_HEADER = "X-Simulated-Pod"
Handler = Callable[[Request], Awaitable[Response]]


def _error_response(error: OpenAIError) -> JSONResponse:
    headers = {"X-Simulated-Failure": error.injected} if error.injected else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _openai_errors(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except OpenAIError as error:
            return _error_response(error)

    return wrapped


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:
        raise bad_request("the request body must be valid JSON") from None


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def create_app(pod: Pod) -> Starlette:
    """The Starlette app of ``pod``; it holds no state of its own."""

    def request_id(request: Request, prefix: str) -> str:
        return request.headers.get("x-request-id") or new_id(prefix)

    def answer_headers(submission: Submission) -> dict[str, str]:
        return {"X-Request-Id": submission.request_id, POD_HEADER: pod.config.pod_id}

    def kv_transfer_answer(request: Request, submission: Submission) -> dict[str, Any] | None:
        host, port = request.scope.get("server") or (None, None)
        return pod.kv_transfer_answer(submission, host=host, port=port)

    async def collect(submission: Submission) -> list[tuple[int, str, str]]:
        pieces: list[list[str]] = [[] for _ in submission.choices]
        async with contextlib.aclosing(pod.run(submission)) as tokens:
            async for choice, index in tokens:
                pieces[choice.index].append(choice.texts[index])
        return [(c.index, "".join(pieces[c.index]), c.finish_reason) for c in submission.choices]

    async def stream(
        submission: Submission, *, chat: bool, include_usage: bool, token_ids: bool = False
    ) -> AsyncIterator[str]:
        rid, model, created = submission.request_id, submission.model, submission.created
        async with contextlib.aclosing(pod.run(submission)) as tokens:
            async for choice, index in tokens:
                if chat:
                    if index == 0:
                        yield _sse(chat_chunk(rid, model, created, choice.index, {"role": "assistant"}, None))
                    yield _sse(
                        chat_chunk(rid, model, created, choice.index, {"content": choice.texts[index]}, None)
                    )
                    if index == choice.last_token:
                        yield _sse(chat_chunk(rid, model, created, choice.index, {}, choice.finish_reason))
                else:
                    ids = [choice.state.request.output_ids[index]] if token_ids else None
                    text = choice.texts[index]
                    yield _sse(completion_chunk(rid, model, created, choice.index, text, None, ids))
                    if index == choice.last_token:
                        end = [] if token_ids else None
                        yield _sse(
                            completion_chunk(rid, model, created, choice.index, "", choice.finish_reason, end)
                        )
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield _sse(usage_chunk(rid, obj, model, created, submission.usage()))
        yield "data: [DONE]\n\n"

    def stream_response(
        submission: Submission, *, chat: bool, include_usage: bool, token_ids: bool = False
    ) -> Response:
        return StreamingResponse(
            stream(submission, chat=chat, include_usage=include_usage, token_ids=token_ids),
            media_type="text/event-stream",
            headers={**_SSE_HEADERS, **answer_headers(submission)},
        )

    @_openai_errors
    async def completions(request: Request) -> Response:
        params = parse_completion(await _json(request))
        adapter = pod.adapter_for(params.model)
        pod.maybe_fail(params.model)
        prompts = []
        for prompt in params.prompts:
            ids = list(prompt) if isinstance(prompt, tuple) else pod.tokenizer.encode(prompt)
            prompts.append((ids, ids))
        submission = pod.submit(
            request_id=request_id(request, "cmpl"),
            model=params.model,
            prompts=prompts,
            sampling=params.sampling,
            adapter=adapter,
            param="prompt",
            kv_transfer=params.kv_transfer,
        )
        if params.sampling.stream:
            sampling = params.sampling
            return stream_response(
                submission,
                chat=False,
                include_usage=sampling.include_usage,
                token_ids=sampling.return_token_ids,
            )
        choices = await collect(submission)
        body = completion_response(
            submission.request_id,
            params.model,
            choices,
            submission.usage(),
            kv_transfer_answer(request, submission),
        )
        return JSONResponse(body, headers=answer_headers(submission))

    @_openai_errors
    async def chat_completions(request: Request) -> Response:
        params = parse_chat(await _json(request))
        adapter = pod.adapter_for(params.model)
        pod.maybe_fail(params.model)
        prompt_ids, last_message_ids = pod.chat_prompt(params)
        submission = pod.submit(
            request_id=request_id(request, "chatcmpl"),
            model=params.model,
            prompts=[(prompt_ids, last_message_ids)],
            sampling=params.sampling,
            adapter=adapter,
            param="messages",
            kv_transfer=params.kv_transfer,
        )
        if params.sampling.stream:
            return stream_response(submission, chat=True, include_usage=params.sampling.include_usage)
        choices = await collect(submission)
        body = chat_response(
            submission.request_id,
            params.model,
            choices,
            submission.usage(),
            kv_transfer_answer(request, submission),
        )
        return JSONResponse(body, headers=answer_headers(submission))

    async def models(request: Request) -> Response:
        limit = pod.config.engine.max_model_len
        data = [
            {
                "id": pod.model,
                "object": "model",
                "owned_by": "vllm",
                "root": pod.model,
                "parent": None,
                "max_model_len": limit,
            }
        ]
        data += [
            {"id": a.name, "object": "model", "owned_by": "vllm", "root": a.path, "parent": pod.model}
            for a in pod.loras.values()
        ]
        return JSONResponse({"object": "list", "data": data})

    @_openai_errors
    async def tokenize(request: Request) -> Response:
        body = await _json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        if body.get("model") is not None:
            pod.adapter_for(body["model"])
        if "messages" in body:
            params: ChatParams = parse_chat({**body, "model": pod.model})
            tokens, _ = pod.chat_prompt(params)
        elif isinstance(body.get("prompt"), str):
            tokens = pod.tokenizer.encode(body["prompt"])
        else:
            raise bad_request("send a prompt (a string) or messages", "prompt")
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": pod.config.engine.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        if pod.sleeping:
            return JSONResponse({"status": "sleeping"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics(request: Request) -> Response:
        return Response(pod.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @_openai_errors
    async def load_lora(request: Request) -> Response:
        body = await _json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(name, str) or not isinstance(path, str):
            raise bad_request("lora_name and lora_path are required strings", "lora_name")
        pod.load_lora(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @_openai_errors
    async def unload_lora(request: Request) -> Response:
        body = await _json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise bad_request("lora_name is required", "lora_name")
        pod.unload_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @_openai_errors
    async def admin_config(request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse(pod.config_dict())
        try:
            return JSONResponse(pod.update_config(await _json(request)))
        except ConfigError as error:
            raise bad_request(str(error)) from None

    def busy(what: str) -> OpenAIError:
        return OpenAIError(
            409, f"cannot {what} while requests hold KV blocks: retry when idle", type="conflict"
        )

    @_openai_errors
    async def reset_prefix_cache(request: Request) -> Response:
        if not pod.reset_prefix_cache():
            raise busy("reset the prefix cache")
        return Response(status_code=200)

    @_openai_errors
    async def sleep(request: Request) -> Response:
        if not pod.sleep():
            raise busy("sleep")
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        pod.wake_up()
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": pod.sleeping})

    # --- SGLang's operational endpoints ----------------------------------------------------------

    def model_info() -> dict[str, Any]:
        # The directory the pod's tokenizer was loaded from, as SGLang reports its own: a router
        # that loads the tokenizer from there needs no model hub.
        return {
            "model_path": str(pod.tokenizer.loaded.path.parent),
            "tokenizer_path": str(pod.tokenizer.loaded.path.parent),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    async def get_model_info(request: Request) -> Response:
        return JSONResponse(model_info())

    async def get_server_info(request: Request) -> Response:
        engine = pod.config.engine
        return JSONResponse(
            {
                **model_info(),
                "served_model_name": pod.model,
                "dp_size": pod.config.data_parallel_size,
                "tp_size": 1,
                "page_size": engine.block_size,
                "max_total_num_tokens": engine.kv_cache_size * engine.block_size,
                "max_running_requests": engine.max_num_seqs,
                "context_length": engine.max_model_len,
                # SGLang's names the role; "null" is its answer for a pod that serves both.
                "disaggregation_mode": pod.config.role if pod.config.role != "both" else "null",
            }
        )

    async def get_load(request: Request) -> Response:
        return JSONResponse(
            [
                {
                    "dp_rank": load.rank,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": load.tokens,
                }
                for load in pod.loads()
            ]
        )

    async def health_generate(request: Request) -> Response:
        if pod.sleeping:
            return JSONResponse({"status": "sleeping"}, status_code=503)
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/health/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
            Route("/admin/config", admin_config, methods=["GET", "POST"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/sleep", sleep, methods=["POST"]),
            Route("/wake_up", wake_up, methods=["POST"]),
            Route("/is_sleeping", is_sleeping, methods=["GET"]),
            Route("/server_info", get_server_info, methods=["GET"]),
            Route("/get_server_info", get_server_info, methods=["GET"]),
            Route("/model_info", get_model_info, methods=["GET"]),
            Route("/get_model_info", get_model_info, methods=["GET"]),
            Route("/get_load", get_load, methods=["GET"]),
            Route("/health_generate", health_generate, methods=["GET"]),
            Route("/flush_cache", reset_prefix_cache, methods=["GET", "POST"]),
        ]
    )
