"""The OpenAI wire format of a simulated pod: request bodies in, response and chunk bodies out.

Parsing validates only what the simulator uses and raises :func:`~simulator.errors.bad_request`
naming the field to fix; unknown fields are ignored, as vLLM ignores most sampling options it is
not asked about here (temperature, top_p...). Responses follow vLLM's OpenAI server: ``usage``
always carries ``prompt_tokens_details.cached_tokens``.

``kv_transfer_params`` is vLLM's field for prefill/decode disaggregation (NixlConnector's keys,
:class:`KVTransferParams`): a request sets ``do_remote_decode`` to be prefilled here for another
pod, or ``do_remote_prefill`` with the prefill pod's answer to decode here what it prefilled. The
answer of a prefill carries the top-level ``kv_transfer_params`` the decode request needs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.errors import bad_request

__all__ = [
    "ChatParams",
    "CompletionParams",
    "KVTransferParams",
    "SamplingParams",
    "Usage",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "new_id",
    "parse_chat",
    "parse_completion",
    "usage_chunk",
]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The generation options the simulator honours."""

    max_tokens: int | None = None
    n: int = 1
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    # vLLM's ``return_token_ids``: each streamed completion chunk carries its tokens' ids.
    return_token_ids: bool = False


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A request's ``kv_transfer_params``, vLLM NixlConnector's keys (unknown ones are ignored).

    ``do_remote_decode``: prefill here, for another pod to decode (one token, answered with
    ``finish_reason: "remote_decode"`` and the params of the transfer). ``do_remote_prefill``: the
    prompt was prefilled by the pod the ``remote_*`` fields name; its KV is loaded from there
    instead of computed. ``remote_block_ids`` is kept as given (vLLM >= 0.11 sends a list per KV
    cache group, older ones and llm-d-inference-sim a flat list); ``remote_prefill_cached_tokens``
    (vLLM's, in a prefill's answer) is what a decode reports as its cached tokens."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: tuple[Any, ...] | None = None
    tp_size: int | None = None
    remote_prefill_cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """``POST /v1/completions``: one or more prompts, each text or token ids."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingParams
    kv_transfer: KVTransferParams | None = None


@dataclass(frozen=True, slots=True)
class ChatParams:
    """``POST /v1/chat/completions``: a conversation and how to render it (vLLM's defaults)."""

    model: str
    messages: tuple[Mapping[str, Any], ...]
    sampling: SamplingParams
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    kv_transfer: KVTransferParams | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# --- parsing -------------------------------------------------------------------------------------


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    return body


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: the name of a served model or LoRA adapter", "model")
    return model


def _int(body: Mapping[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise bad_request(f"{name} must be an integer >= {minimum}, not {value!r}", name)
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, not {value!r}", name)
    return value


def _sampling(body: Mapping[str, Any], *, max_tokens_names: Sequence[str]) -> SamplingParams:
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _int(body, name, minimum=1)
        if max_tokens is not None:
            break
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise bad_request("stream_options must be an object", "stream_options")
    stream = _bool(body, "stream", False)
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise bad_request(f"seed must be an integer, not {seed!r}", "seed")
    return SamplingParams(
        max_tokens=max_tokens,
        n=_int(body, "n", minimum=1) or 1,
        ignore_eos=_bool(body, "ignore_eos", False),
        seed=seed,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids", False),
    )


def _kv_transfer(body: Mapping[str, Any], sampling: SamplingParams) -> KVTransferParams | None:
    """``kv_transfer_params``: an object or null; each known key of its type or null."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise bad_request("kv_transfer_params must be an object or null", "kv_transfer_params")

    def typed(name: str, kind: type, what: str) -> Any:
        value = params.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise bad_request(
                f"kv_transfer_params.{name} must be {what} or null, not {value!r}",
                f"kv_transfer_params.{name}",
            )
        return value

    block_ids = typed("remote_block_ids", list, "a list")
    cached = typed("remote_prefill_cached_tokens", int, "an integer >= 0")
    if cached is not None and cached < 0:
        raise bad_request(
            f"kv_transfer_params.remote_prefill_cached_tokens must be an integer >= 0, not {cached}",
            "kv_transfer_params.remote_prefill_cached_tokens",
        )
    kv = KVTransferParams(
        do_remote_decode=bool(typed("do_remote_decode", bool, "true or false")),
        do_remote_prefill=bool(typed("do_remote_prefill", bool, "true or false")),
        remote_engine_id=typed("remote_engine_id", str, "a string"),
        remote_request_id=typed("remote_request_id", str, "a string"),
        remote_host=typed("remote_host", str, "a string"),
        remote_port=typed("remote_port", int, "an integer"),
        remote_block_ids=tuple(block_ids) if block_ids is not None else None,
        tp_size=typed("tp_size", int, "an integer"),
        remote_prefill_cached_tokens=cached,
    )
    if kv.do_remote_decode and sampling.stream:
        # llm-d-inference-sim's refusal, word for word: a prefill answers once, with the params.
        raise bad_request("Prefill does not support streaming", "stream")
    return kv


def _token_ids(value: list, param: str) -> tuple[int, ...]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad_request(f"{param} must be a non-empty list of token ids (integers >= 0)", param)
    return tuple(value)


def parse_completion(body: object) -> CompletionParams:
    """A completions request. ``prompt`` may be a string, a list of strings, a list of token ids
    or a list of lists of token ids; every prompt must be non-empty."""
    body = _object(body)
    prompt = body.get("prompt")
    prompts: list[str | tuple[int, ...]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, "prompt") for p in prompt]
    elif isinstance(prompt, list):
        prompts = [_token_ids(prompt, "prompt")]
    else:
        raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")
    if any(p == "" for p in prompts):
        raise bad_request("prompt cannot be empty", "prompt")
    sampling = _sampling(body, max_tokens_names=("max_tokens",))
    return CompletionParams(
        model=_model(body),
        prompts=tuple(prompts),
        sampling=sampling,
        kv_transfer=_kv_transfer(body, sampling),
    )


def parse_chat(body: object) -> ChatParams:
    """A chat completions request (the template checks the messages themselves)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("chat_template must be a string", "chat_template")
    sampling = _sampling(body, max_tokens_names=("max_completion_tokens", "max_tokens"))
    return ChatParams(
        model=_model(body),
        messages=tuple(messages),
        sampling=sampling,
        chat_template=template,
        chat_template_kwargs=body.get("chat_template_kwargs"),
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        continue_final_message=_bool(body, "continue_final_message", False),
        tools=body.get("tools"),
        documents=body.get("documents"),
        kv_transfer=_kv_transfer(body, sampling),
    )


# --- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _envelope(request_id: str, obj: str, model: str, created: int | None) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model}


def _with_kv_transfer(body: dict[str, Any], kv_transfer: Mapping[str, Any] | None) -> dict[str, Any]:
    if kv_transfer is not None:
        body["kv_transfer_params"] = dict(kv_transfer)
    return body


def completion_response(
    request_id: str,
    model: str,
    choices: Sequence[tuple[int, str, str]],
    usage: Usage,
    kv_transfer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``choices``: (index, text, finish_reason); ``kv_transfer``: a prefill's params for its
    decode, the answer's top-level ``kv_transfer_params`` (absent otherwise)."""
    body = {
        **_envelope(request_id, "text_completion", model, None),
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
            for i, text, reason in choices
        ],
        "usage": usage.as_dict(),
    }
    return _with_kv_transfer(body, kv_transfer)


def chat_response(
    request_id: str,
    model: str,
    choices: Sequence[tuple[int, str, str]],
    usage: Usage,
    kv_transfer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``choices``: (index, content, finish_reason); ``kv_transfer`` as for completions."""
    body = {
        **_envelope(request_id, "chat.completion", model, None),
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
            for i, text, reason in choices
        ],
        "usage": usage.as_dict(),
    }
    return _with_kv_transfer(body, kv_transfer)


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None,
    token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``token_ids``: the chunk's token ids, sent (vLLM's field) when the request asked for them."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return {**_envelope(request_id, "text_completion", model, created), "choices": [choice]}


def chat_chunk(
    request_id: str, model: str, created: int, index: int, delta: Mapping[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    return {
        **_envelope(request_id, "chat.completion.chunk", model, created),
        "choices": [{"index": index, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, obj: str, model: str, created: int, usage: Usage) -> dict[str, Any]:
    """The last chunk before ``[DONE]`` when ``stream_options.include_usage``: no choices."""
    return {**_envelope(request_id, obj, model, created), "choices": [], "usage": usage.as_dict()}
