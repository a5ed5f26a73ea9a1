"""The read path: a prompt (or a conversation, or token ids) -> per-pod prefix-hit scores.

Steps, each timed (``Timings``) so the API can report them (``Server-Timing``) and the benchmark
can say where the time goes:

1. **render** (conversations only): the model's chat template (``tokenization.chat_templates.render_chat``);
2. **tokenize**: the model's tokenizer through the prefix store (``TokenizerRegistry.tokenize``);
   skipped when the caller sends token ids;
3. **keys**: vLLM's ``sha256_cbor`` block keys (``kvindex.keys.block_keys``) from the hash seed,
   the model's block size and lookahead (``hash_lookahead_tokens``), and the request's extra keys
   (LoRA adapter name, ``cache_salt``, multimodal features), through ``BLOCK_KEY_MEMO`` (a
   repeated prefix's blocks are looked up, not hashed again; a step is memoized under its extra
   keys, so salted and plain chains never share one);
4. **lookup**: one index round trip for the longest held run of keys, restricted to the asked
   pods; disabled pods and pods the liveness prober found down (``config.unscored_pods``) are
   taken out, with their data-parallel ranks. For a hybrid model (``kv_cache_groups``), one
   more round trip per other KV-cache group for its holders of the run's keys, and each pod's
   run cut to vLLM's hit over the groups (``kvindex.kv_cache_groups``);
5. **score**: longest-prefix scores with the model's tier weights (``scoring.scorer``).

Pure core: no Django import. The registry snapshot (``ServiceConfig``), the index and the
tokenizer registry come in as arguments; errors go out as exceptions the shell maps to HTTP
statuses: ``InvalidInput`` (the caller must fix the request), ``ChatTemplateError``,
``TokenizerNotFound`` / ``TokenizerLoadError`` and ``IndexUnavailable``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvindex import HolderMap, KVIndex, keys
from kvindex.keys import BlockKey, ChainMemo, MultimodalFeature, block_keys
from kvindex.kv_cache_groups import group_keys, hybrid_run, other_groups
from registry.config import ModelSettings, ServiceConfig, owner_pod
from scoring.scorer import PodScore, longest_prefix_scores
from tokenization.chat_templates import ChatTemplateError, render_chat
from tokenization.template_sandbox import TemplateSandbox
from tokenization.tokenizers import Tokenization, TokenizerError, TokenizerRegistry, TooManyTokens

__all__ = [
    "BLOCK_KEY_MEMO",
    "ChatRequest",
    "ChatTemplateError",
    "InvalidInput",
    "ScoreResult",
    "Timings",
    "score_chat",
    "score_prompt",
    "score_token_ids",
]


BLOCK_KEY_MEMO = ChainMemo()
"""The chain steps of the keys this process computed for requests (scoring endpoints, gateway),
shared by all of them: ``kvindex.keys.DEFAULT_CHAIN_MEMO_STEPS`` steps at most (~22 MiB). Used
only while the key chain is pure Python: the compiled chain hashes a block faster than the memo
looks one up (docs/performance.md)."""


def default_memo() -> ChainMemo | None:
    """The memo requests are keyed through: ``BLOCK_KEY_MEMO`` where it pays, else none."""
    return BLOCK_KEY_MEMO if keys.memo_pays() else None


_DEFAULT_MEMO = object()


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
    cached by vLLM, so never scored; with lookahead hashing, only blocks followed by that many
    tokens are keyed); ``looked_up`` says whether the index was asked (not when
    there is no full block or every asked pod is unscored: disabled or down); ``lookup_hits`` is the
    length of the held run it returned (before unscored pods were taken out). ``tokenization`` is
    ``None`` when the caller sent token ids; ``templated`` is the rendered conversation for chat
    requests.
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


@dataclass(slots=True)
class KeyedRequest:
    """A request made ready for the index: its block keys (steps 1-3), the pods it asks about
    (``None``: every pod; unscored pods already taken out) and what its earlier steps produced."""

    model: str
    token_count: int
    keys: list[BlockKey]
    wanted: frozenset[str] | None
    timings: Timings
    tokenization: Tokenization | None = None
    templated: str | None = None

    @property
    def needs_lookup(self) -> bool:
        """False when nothing can match: no full block, or every asked pod is unscored."""
        return bool(self.keys) and (self.wanted is None or bool(self.wanted))


def key_token_ids(
    *,
    config: ServiceConfig,
    model: str,
    token_ids: Sequence[int],
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultimodalFeature] = (),
    pods: Collection[str] | None = None,
    timings: Timings | None = None,
    max_tokens: int | None = None,
    memo: ChainMemo | object | None = _DEFAULT_MEMO,
) -> KeyedRequest:
    """Steps 3 and the pod filter: keys computed with ``config.seed``, the model's block size and
    lookahead (``hash_lookahead_tokens``), ``lora_name``, ``cache_salt`` and ``mm_features``
    (positions in ``token_ids``) exactly as a ``sha256_cbor`` engine's events key the request's
    blocks (through ``memo``: the same keys; ``None`` hashes every block; by default
    :func:`default_memo`).

    Raises ``InvalidInput`` for a token id outside 0..2**64-1, more token ids than the model's
    context length (``max_tokens``, else the model config's ``max_model_len``), or a multimodal
    feature that ends past the last token."""
    timings = timings if timings is not None else Timings()
    settings = config.model(model)
    limit = settings.max_model_len or max_tokens
    if limit is not None and len(token_ids) > limit:
        raise InvalidInput("token_ids", str(TooManyTokens(len(token_ids), limit)))
    for i, feature in enumerate(mm_features):
        if feature.end > len(token_ids):
            raise InvalidInput(
                "mm_features",
                f"mm_features[{i}] covers tokens {feature.offset} to {feature.end - 1}, but the prompt has "
                f"{len(token_ids)} tokens",
            )
    started = time.perf_counter()
    try:
        keys = block_keys(
            token_ids,
            seed=config.seed,
            block_size=settings.block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_features=mm_features,
            lookahead_tokens=settings.hash_lookahead_tokens,
            memo=default_memo() if memo is _DEFAULT_MEMO else memo,
        )
    except ValueError as error:
        field = _unencodable(lora_name=lora_name, cache_salt=cache_salt, mm_features=mm_features)
        raise InvalidInput(field or "token_ids", str(error)) from error
    timings.keys = time.perf_counter() - started
    unscored = config.unscored_pods
    wanted = None if pods is None else frozenset(p for p in pods if not _is_unscored(p, unscored))
    return KeyedRequest(model=model, token_count=len(token_ids), keys=keys, wanted=wanted, timings=timings)


def finish(keyed: KeyedRequest, holders: list[HolderMap], *, config: ServiceConfig) -> ScoreResult:
    """Step 5: the scores of ``holders`` (the index's answer for ``keyed``), unscored pods out."""
    started = time.perf_counter()
    hits = len(holders)
    if config.unscored_pods and holders:
        holders = _without_unscored(holders, config.unscored_pods)
    settings = config.model(keyed.model)
    scores = longest_prefix_scores(holders, total_blocks=len(keyed.keys), tier_weight=settings.tier_weight)
    keyed.timings.score = time.perf_counter() - started
    return ScoreResult(
        model=keyed.model,
        token_count=keyed.token_count,
        total_blocks=len(keyed.keys),
        scores=scores,
        timings=keyed.timings,
        looked_up=keyed.needs_lookup,
        lookup_hits=hits,
        tokenization=keyed.tokenization,
        templated=keyed.templated,
    )


def _holder_groups(keyed: KeyedRequest, run: list[HolderMap], config: ServiceConfig) -> dict[str, list]:
    """holder -> its KV-cache groups after group 0 (``other_groups``), for the holders of the
    run's first block that have any (only they can hit): the model config's groups, else each
    pod's own (``ServiceConfig.kv_cache_groups_of``)."""
    settings = config.model(keyed.model)
    if not run or not (settings.kv_cache_groups or config.pod_kv_cache_groups):
        return {}
    found = {}
    for holder in run[0]:
        groups = config.kv_cache_groups_of(keyed.model, holder)
        if len(groups) > 1:
            found[holder] = other_groups(groups, settings.block_size)
    return found


def _group_holders(
    index: KVIndex, keyed: KeyedRequest, run: list[HolderMap], config: ServiceConfig
) -> list[HolderMap]:
    """``run`` cut to each pod's hit over a hybrid model's KV-cache groups (one ``holders`` read per
    group any holder has); ``run`` itself when no holder has more than one group."""
    holder_groups = _holder_groups(keyed, run, config)
    if not holder_groups:
        return run
    keys = keyed.keys[: len(run)]
    wanted = sorted({g for groups in holder_groups.values() for g, _ in groups})
    reads = {g: index.holders(model=keyed.model, keys=group_keys(keys, g)) for g in wanted}
    return hybrid_run(run, holder_groups, reads)


async def _agroup_holders(
    index: KVIndex, keyed: KeyedRequest, run: list[HolderMap], config: ServiceConfig
) -> list[HolderMap]:
    """``_group_holders`` on an event loop: ``aholders`` where the index has it, else in a thread."""
    holder_groups = _holder_groups(keyed, run, config)
    if not holder_groups:
        return run
    keys = keyed.keys[: len(run)]
    reads = {}
    for g in sorted({g for groups in holder_groups.values() for g, _ in groups}):
        wanted = group_keys(keys, g)
        aholders = getattr(index, "aholders", None)
        if aholders is not None:
            reads[g] = await aholders(model=keyed.model, keys=wanted)
        else:
            reads[g] = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(index.holders, model=keyed.model, keys=wanted)
            )
    return hybrid_run(run, holder_groups, reads)


def look_up(index: KVIndex, keyed: KeyedRequest, *, config: ServiceConfig) -> ScoreResult:
    """Step 4 then 5 for one request: at most one index round trip (one per KV-cache group of a
    hybrid model)."""
    started = time.perf_counter()
    holders = (
        index.lookup(model=keyed.model, keys=keyed.keys, pods=keyed.wanted) if keyed.needs_lookup else []
    )
    holders = _group_holders(index, keyed, holders, config)
    keyed.timings.lookup = time.perf_counter() - started
    return finish(keyed, holders, config=config)


async def alook_up(index: KVIndex, keyed: KeyedRequest, *, config: ServiceConfig) -> ScoreResult:
    """``look_up`` on an event loop, for an index that reads there (``alookup``: see
    ``RedisIndex.alookup``)."""
    started = time.perf_counter()
    holders = (
        await index.alookup(model=keyed.model, keys=keyed.keys, pods=keyed.wanted)  # type: ignore[attr-defined]
        if keyed.needs_lookup
        else []
    )
    holders = await _agroup_holders(index, keyed, holders, config)
    keyed.timings.lookup = time.perf_counter() - started
    return finish(keyed, holders, config=config)


def look_up_many(
    index: KVIndex, requests: Sequence[KeyedRequest], *, config: ServiceConfig
) -> list[ScoreResult]:
    """Steps 4 and 5 for several requests: one index round trip per distinct model."""
    holders: list[list[HolderMap]] = [[] for _ in requests]
    by_model: dict[str, list[int]] = {}
    for i, keyed in enumerate(requests):
        if keyed.needs_lookup:
            by_model.setdefault(keyed.model, []).append(i)
    for model, positions in by_model.items():
        started = time.perf_counter()
        answers = index.lookup_many(
            model=model, queries=[(requests[i].keys, requests[i].wanted) for i in positions]
        )
        elapsed = time.perf_counter() - started
        for i, answer in zip(positions, answers, strict=True):
            holders[i] = _group_holders(index, requests[i], answer, config)
            requests[i].timings.lookup = elapsed
    return [finish(keyed, found, config=config) for keyed, found in zip(requests, holders, strict=True)]


def score_token_ids(
    *,
    index: KVIndex,
    config: ServiceConfig,
    model: str,
    token_ids: Sequence[int],
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultimodalFeature] = (),
    pods: Collection[str] | None = None,
    max_tokens: int | None = None,
) -> ScoreResult:
    """Scores for a prompt given as token ids (steps 3-5).

    Guarantees: only pods in ``pods`` (all when ``None``) and never a disabled or down pod (or one
    of its data-parallel ranks) appear in the result; one index round trip at most (none when the prompt
    has no full block). Raises what ``key_token_ids`` raises and ``IndexUnavailable``.
    """
    keyed = key_token_ids(
        config=config,
        model=model,
        token_ids=token_ids,
        lora_name=lora_name,
        cache_salt=cache_salt,
        mm_features=mm_features,
        pods=pods,
        max_tokens=max_tokens,
    )
    return look_up(index, keyed, config=config)


def key_prompt(
    *,
    tokenizers: TokenizerRegistry,
    config: ServiceConfig,
    model: str,
    prompt: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultimodalFeature] = (),
    pods: Collection[str] | None = None,
) -> KeyedRequest:
    """Steps 2-3 for a completion prompt: tokenized with the model's tokenizer (no special tokens
    added, as vLLM's completions endpoint does for the prompt text), then keyed as
    ``key_token_ids`` keys (``mm_features`` in positions of the prompt's tokens).

    Raises ``TokenizerNotFound`` (no tokenizer for ``model``; answered at once, never retried),
    ``TokenizerLoadError``, ``InvalidInput`` (text that is not valid Unicode, or longer than the
    model's context length, and what ``key_token_ids`` refuses)."""
    return _key_text(
        tokenizers,
        config,
        model,
        prompt,
        field="prompt",
        lora_name=lora_name,
        cache_salt=cache_salt,
        mm_features=mm_features,
        pods=pods,
        timings=Timings(),
    )


def score_prompt(*, index: KVIndex, **request: Any) -> ScoreResult:
    """``key_prompt`` then the index: scores for a completion prompt."""
    keyed = key_prompt(**request)
    return look_up(index, keyed, config=request["config"])


def key_chat(
    *,
    tokenizers: TokenizerRegistry,
    config: ServiceConfig,
    model: str,
    chat: ChatRequest,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultimodalFeature] = (),
    pods: Collection[str] | None = None,
    sandbox: TemplateSandbox | None = None,
    allow_request_templates: bool = True,
) -> KeyedRequest:
    """Steps 1-3 for a conversation: rendered with the request's template (in ``sandbox`` when
    given), else the model config's, else the tokenizer's own (``render_chat``), then tokenized
    and keyed as ``key_prompt`` does (``mm_features`` in positions of the rendered prompt's
    tokens); ``templated`` is the rendered prompt.

    Raises what ``key_prompt`` raises, and ``ChatTemplateError`` for a conversation or options
    the template cannot render (the message says what to fix)."""
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
        sandbox=sandbox,
        allow_request_templates=allow_request_templates or chat.chat_template is None,
    )
    timings.render = time.perf_counter() - started  # a first use's tokenizer load included
    keyed = _key_text(
        tokenizers,
        config,
        model,
        rendered.text,
        field="messages",
        lora_name=lora_name,
        cache_salt=cache_salt,
        mm_features=mm_features,
        pods=pods,
        timings=timings,
    )
    keyed.templated = rendered.text
    return keyed


def score_chat(*, index: KVIndex, **request: Any) -> ScoreResult:
    """``key_chat`` then the index: scores for a conversation."""
    keyed = key_chat(**request)
    return look_up(index, keyed, config=request["config"])


def context_length(tokenizers: TokenizerRegistry, config: ServiceConfig, model: str) -> int | None:
    """The model's context length in tokens: its config's ``max_model_len``, else its tokenizer
    config's ``model_max_length`` (``None`` when neither says, or the model has no tokenizer)."""
    configured = config.model(model).max_model_len
    if configured is not None:
        return configured
    try:
        return tokenizers.get(model).model_max_length
    except TokenizerError:
        return None


def _key_text(
    tokenizers: TokenizerRegistry,
    config: ServiceConfig,
    model: str,
    text: str,
    *,
    field: str,
    lora_name: str | None,
    cache_salt: str | None,
    mm_features: Sequence[MultimodalFeature],
    pods: Collection[str] | None,
    timings: Timings,
) -> KeyedRequest:
    """Steps 2-3 for text: tokenized (``timings.tokenize``, a first use's tokenizer load
    included), then keyed; ``field`` names the request field an error is about."""
    started = time.perf_counter()
    tokenization = _tokenize(tokenizers, config, model, text, field=field)
    timings.tokenize = time.perf_counter() - started
    keyed = key_token_ids(
        config=config,
        model=model,
        token_ids=tokenization.token_ids,
        lora_name=lora_name,
        cache_salt=cache_salt,
        mm_features=mm_features,
        pods=pods,
        timings=timings,
    )
    keyed.tokenization = tokenization
    return keyed


def _tokenize(
    tokenizers: TokenizerRegistry, config: ServiceConfig, model: str, text: str, *, field: str
) -> Tokenization:
    limit = context_length(tokenizers, config, model)
    try:
        return tokenizers.tokenize(model, text, max_tokens=limit)
    except ValueError as error:  # not valid Unicode (a lone surrogate), or over the context length
        raise InvalidInput(field, str(error)) from error


def _unencodable(
    *, lora_name: str | None, cache_salt: str | None, mm_features: Sequence[MultimodalFeature]
) -> str | None:
    """The field whose text cannot be hashed (not valid Unicode: a lone surrogate), if any."""
    named = [("lora_name", lora_name), ("cache_salt", cache_salt)]
    named += [("mm_features", feature.identifier) for feature in mm_features]
    for field, text in named:
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError:
            return field
    return None


def _is_unscored(holder: str, unscored: frozenset[str]) -> bool:
    return holder in unscored or owner_pod(holder) in unscored


def _without_unscored(holders: list[HolderMap], unscored: frozenset[str]) -> list[HolderMap]:
    """``holders`` without unscored pods, cut at the first block no scored pod holds (so the
    result is still a held run, as the scorer expects)."""
    out: list[HolderMap] = []
    for block in holders:
        kept = {pod: tiers for pod, tiers in block.items() if not _is_unscored(pod, unscored)}
        if not kept:
            break
        out.append(kept)
    return out
