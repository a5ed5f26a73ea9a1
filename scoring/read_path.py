"""The read path: a prompt (or a conversation, or token ids) -> per-pod prefix-hit scores.

Steps, each timed (``Timings``) so the API can report them (``Server-Timing``) and the benchmark
can say where the time goes:

1. **render** (conversations only): the model's chat template (``scoring.chat.render_chat``);
2. **tokenize**: the model's tokenizer through the prefix store (``TokenizerRegistry.tokenize``);
   skipped when the caller sends token ids;
3. **keys**: vLLM's ``sha256_cbor`` block keys (``scoring.keys.block_keys``) from the hash seed,
   the model's block size and the LoRA adapter name;
4. **lookup**: one index round trip for the longest held run of keys, restricted to the asked
   pods; disabled pods are taken out;
5. **score**: longest-prefix scores with the model's tier weights (``scoring.scorer``).

Pure core: no Django import. The registry snapshot (``ServiceConfig``), the index and the
tokenizer registry come in as arguments; errors go out as exceptions the shell maps to HTTP
statuses: ``InvalidInput`` (the caller must fix the request), ``ChatTemplateError``,
``TokenizerNotFound`` / ``TokenizerLoadError`` and ``IndexUnavailable``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from scoring.chat import ChatTemplateError, render_chat
from scoring.config import ModelSettings, ServiceConfig
from scoring.index import HolderMap, KVIndex
from scoring.keys import block_keys
from scoring.scorer import PodScore, longest_prefix_scores
from scoring.tokenization import Tokenization, TokenizerRegistry

__all__ = [
    "ChatRequest",
    "ChatTemplateError",
    "InvalidInput",
    "ScoreResult",
    "Timings",
    "score_chat",
    "score_prompt",
    "score_token_ids",
]

DP_RANK_SEPARATOR = "#dp"
"""Data-parallel rank r > 0 of pod P is indexed as ``P#dp<r>`` (``ingest.applier.holder_id``)."""


class InvalidInput(ValueError):
    """Input the core cannot score; ``field`` names the request field to fix."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(slots=True)
class Timings:
    """Seconds spent in each step of one request (0.0 for a step that did not run)."""

    render: float = 0.0
    tokenize: float = 0.0
    keys: float = 0.0
    lookup: float = 0.0
    score: float = 0.0

    @property
    def total(self) -> float:
        return self.render + self.tokenize + self.keys + self.lookup + self.score

    def as_dict(self) -> dict[str, float]:
        return {
            "render": self.render,
            "tokenize": self.tokenize,
            "keys": self.keys,
            "lookup": self.lookup,
            "score": self.score,
        }


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A conversation to score, with the rendering options of ``render_chat``.

    ``chat_template`` is the request's template (or the name of one of the model's); when it is
    ``None`` the model config's template is used, else the tokenizer's own.
    """

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """What one scoring request found.

    ``scores`` holds every pod whose cache holds at least the first block, sorted by pod name;
    ``total_blocks`` counts the full blocks of the request (a trailing partial block is never
    cached by vLLM, so never scored); ``looked_up`` says whether the index was asked (not when
    there is no full block or every asked pod is disabled); ``lookup_hits`` is the length of the
    held run it returned (before disabled pods were taken out). ``tokenization`` is ``None`` when the caller
    sent token ids; ``templated`` is the rendered conversation for chat requests.
    """

    model: str
    token_count: int
    total_blocks: int
    scores: dict[str, PodScore]
    timings: Timings
    looked_up: bool = False
    lookup_hits: int = 0
    tokenization: Tokenization | None = None
    templated: str | None = None


def score_token_ids(
    *,
    index: KVIndex,
    config: ServiceConfig,
    model: str,
    token_ids: Sequence[int],
    lora_name: str | None = None,
    pods: Collection[str] | None = None,
    timings: Timings | None = None,
) -> ScoreResult:
    """Scores for a prompt given as token ids (steps 3-5).

    Guarantees: keys are computed with ``config.seed``, the model's block size and ``lora_name``
    exactly as a ``sha256_cbor`` engine computes them; only pods in ``pods`` (all when ``None``)
    and never a disabled pod (or one of its data-parallel ranks) appear in the result; one index
    round trip at most (none when the prompt has no full block).

    Raises ``InvalidInput`` for a token id outside 0..2**64-1 and ``IndexUnavailable`` when the
    index cannot be reached.
    """
    timings = timings if timings is not None else Timings()
    settings = config.model(model)
    started = time.perf_counter()
    try:
        keys = block_keys(token_ids, seed=config.seed, block_size=settings.block_size, lora_name=lora_name)
    except ValueError as error:
        raise InvalidInput("token_ids", str(error)) from error
    keyed = time.perf_counter()
    timings.keys = keyed - started

    disabled = config.disabled_pods
    wanted = None if pods is None else frozenset(p for p in pods if not _is_disabled(p, disabled))
    holders: list[HolderMap] = []
    looked_up = bool(keys) and (wanted is None or bool(wanted))
    if looked_up:
        holders = index.lookup(model=model, keys=keys, pods=wanted)
    hits = len(holders)
    if disabled and holders:
        holders = _without_disabled(holders, disabled)
    scoring = time.perf_counter()
    timings.lookup = scoring - keyed

    scores = longest_prefix_scores(holders, total_blocks=len(keys), tier_weight=settings.tier_weight)
    timings.score = time.perf_counter() - scoring
    return ScoreResult(
        model=model,
        token_count=len(token_ids),
        total_blocks=len(keys),
        scores=scores,
        timings=timings,
        looked_up=looked_up,
        lookup_hits=hits,
    )


def score_prompt(
    *,
    index: KVIndex,
    tokenizers: TokenizerRegistry,
    config: ServiceConfig,
    model: str,
    prompt: str,
    lora_name: str | None = None,
    pods: Collection[str] | None = None,
) -> ScoreResult:
    """Scores for a completion prompt: tokenized with the model's tokenizer (no special tokens
    added, as vLLM's completions endpoint does for the prompt text), then ``score_token_ids``.

    Raises ``TokenizerNotFound`` (no tokenizer for ``model``; answered at once, never retried),
    ``TokenizerLoadError``, ``InvalidInput`` (text that is not valid Unicode) and
    ``IndexUnavailable``.
    """
    timings = Timings()
    started = time.perf_counter()
    tokenization = _tokenize(tokenizers, model, prompt, field="prompt")
    timings.tokenize = time.perf_counter() - started  # a first use's tokenizer load included
    result = score_token_ids(
        index=index,
        config=config,
        model=model,
        token_ids=tokenization.token_ids,
        lora_name=lora_name,
        pods=pods,
        timings=timings,
    )
    return replace(result, tokenization=tokenization)


def score_chat(
    *,
    index: KVIndex,
    tokenizers: TokenizerRegistry,
    config: ServiceConfig,
    model: str,
    chat: ChatRequest,
    lora_name: str | None = None,
    pods: Collection[str] | None = None,
) -> ScoreResult:
    """Scores for a conversation: rendered with the request's template, else the model config's,
    else the tokenizer's own (``render_chat``), then scored as ``score_prompt`` scores text.
    ``templated`` in the result is the rendered prompt.

    Raises what ``score_prompt`` raises, and ``ChatTemplateError`` for a conversation or options
    the template cannot render (the message says what to fix).
    """
    timings = Timings()
    settings: ModelSettings = config.model(model)
    template = chat.chat_template if chat.chat_template is not None else settings.chat_template or None
    started = time.perf_counter()
    loaded = tokenizers.get(model)
    rendered = render_chat(
        chat.messages,
        templates=loaded.chat_templates,
        chat_template=template,
        tools=chat.tools,
        documents=chat.documents,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        chat_template_kwargs=chat.chat_template_kwargs,
    )
    rendered_at = time.perf_counter()
    timings.render = rendered_at - started  # a first use's tokenizer load included
    tokenization = _tokenize(tokenizers, model, rendered.text, field="messages")
    timings.tokenize = time.perf_counter() - rendered_at
    result = score_token_ids(
        index=index,
        config=config,
        model=model,
        token_ids=tokenization.token_ids,
        lora_name=lora_name,
        pods=pods,
        timings=timings,
    )
    return replace(result, tokenization=tokenization, templated=rendered.text)


def _tokenize(tokenizers: TokenizerRegistry, model: str, text: str, *, field: str) -> Tokenization:
    try:
        return tokenizers.tokenize(model, text)
    except ValueError as error:  # the prefix store's "not valid Unicode" (a lone surrogate)
        raise InvalidInput(field, str(error)) from error


def _is_disabled(holder: str, disabled: frozenset[str]) -> bool:
    if holder in disabled:
        return True
    pod, separator, _ = holder.partition(DP_RANK_SEPARATOR)
    return bool(separator) and pod in disabled


def _without_disabled(holders: list[HolderMap], disabled: frozenset[str]) -> list[HolderMap]:
    """``holders`` without disabled pods, cut at the first block no enabled pod holds (so the
    result is still a held run, as the scorer expects)."""
    out: list[HolderMap] = []
    for block in holders:
        kept = {pod: tiers for pod, tiers in block.items() if not _is_disabled(pod, disabled)}
        if not kept:
            break
        out.append(kept)
    return out
