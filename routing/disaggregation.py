"""Prefill/decode disaggregation: which requests are served in two steps, and the two requests.

A model whose live pods include ``prefill`` pods and pods that decode (``decode`` or ``both``,
``Pod.role``) is served as vLLM's NixlConnector serves it: the prompt goes first to a prefill pod
with ``kv_transfer_params.do_remote_decode`` and one output token (:func:`prefill_body`); its
answer carries the ``kv_transfer_params`` a decode pod needs to pull the prompt's KV cache from it
(:func:`transfer_params`); then the original request, with those parameters, goes to the decode
pod (:func:`decode_body`), whose answer is the client's. The prefill pod is picked by prefix
score and load (it computes the prompt: that is where prefix reuse pays), the decode pod by load
and its own prefix hits (what it holds locally it need not pull), both by the router's policy.

A request whose prompt the chosen decode pod would have to compute less than ``threshold_tokens``
of skips the prefill step (``short_prompt``): the extra hop costs more than a short prefill on
the decode pod (Dynamo's ``max_local_prefill_length``, llm-d's P/D threshold).

:func:`prefill` runs the prefill step on one pod; the fronts (the gateway; under the EPP, the
decode pod's sidecar, ``gateway.sidecar``) carry the rest. No Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from routing.upstream import Upstream, UpstreamError

PREFILL, DECODE = "prefill", "decode"

DISAGGREGATED = "disaggregated"
"""A request served in two steps."""
SHORT_PROMPT = "short_prompt"
"""A request of a P/D model served whole by its decode pod: below the threshold."""
FALLBACK = "fallback"
"""A request of a P/D model served whole by its decode pod: its prefill step failed."""

MAX_PREFILL_ANSWER_BYTES = 1024 * 1024
"""The largest prefill answer read (one output token: a few hundred bytes, more with logprobs)."""


@dataclass(frozen=True, slots=True)
class Sides:
    """The live pods of a P/D model, pod -> address: those that prefill, those that decode."""

    prefill: dict[str, str]
    decode: dict[str, str]


def sides(pods: Mapping[str, str], roles: Mapping[str, str]) -> Sides | None:
    """The two sides of ``pods`` (pod -> address) by their ``roles``; ``None`` when they are not
    both there (every pod then serves whole requests: a vLLM pod with a NixlConnector serves a
    request without ``kv_transfer_params`` as any other)."""
    if not roles:  # the usual fleet: nothing to look at, every request
        return None
    prefill = {pod: address for pod, address in pods.items() if roles.get(pod) == PREFILL}
    if not prefill or len(prefill) == len(pods):
        return None
    return Sides(prefill, {pod: address for pod, address in pods.items() if pod not in prefill})


def uncached_tokens(token_count: int, matched_blocks: int, block_size: int) -> int:
    """The prompt tokens a pod holding ``matched_blocks`` of its leading blocks would compute."""
    return max(0, token_count - matched_blocks * block_size)


def prefill_body(payload: Mapping[str, object]) -> bytes:
    """The prefill step's request: the client's, with ``do_remote_decode``, one output token and
    no streaming (vLLM's P/D proxies send the same)."""
    request = dict(payload)
    request["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request.pop("stream_options", None)
    return orjson.dumps(request)


def transfer_params(answer: bytes) -> dict | None:
    """The ``kv_transfer_params`` of a prefill pod's answer (an object with ``do_remote_prefill``
    true), ``None`` when the answer has none: the pod does not disaggregate."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    return params


def decode_body(payload: Mapping[str, object], params: Mapping[str, object]) -> bytes:
    """The decode step's request: the client's, with the prefill answer's ``kv_transfer_params``."""
    return orjson.dumps({**payload, "kv_transfer_params": dict(params)})


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What a prefill step came to: the ``params`` for the decode pod; or the pod's ``refusal``
    of the request itself (a 4xx but 429: status, body), which is the client's answer; or
    neither, and the ``failure`` (an ``UpstreamError`` reason, ``status``: a 5xx or 429, or
    ``no_transfer_params``): the decode pod then serves the request whole."""

    params: dict | None = None
    refusal: tuple[int, bytes] | None = None
    failure: str = ""


async def prefill(
    upstream: Upstream,
    address: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    payload: Mapping[str, object],
    *,
    timeout: float,
) -> Prefilled:
    """The prefill step of ``payload`` (the client's request to ``target``) on the pod at
    ``address``: its whole answer within ``timeout`` seconds."""
    try:
        status, answer = await upstream.fetch(
            address,
            target,
            headers,
            timeout=timeout,
            max_bytes=MAX_PREFILL_ANSWER_BYTES,
            method=b"POST",
            body=prefill_body(payload),
        )
    except UpstreamError as error:
        return Prefilled(failure=error.reason)
    if status >= 500 or status == 429:
        return Prefilled(failure="status")
    if status != 200:
        return Prefilled(refusal=(status, answer))
    params = transfer_params(answer)
    return Prefilled(params=params) if params is not None else Prefilled(failure="no_transfer_params")
