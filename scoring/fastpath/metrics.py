"""The scoring metrics every web worker records (Django-free: the fast path records them).

Upstream's names are kept (upstream-parity.md, "Metrics"): ``kvcache_index_lookup_requests_total``,
``kvcache_index_lookup_hits_total`` (block keys found held, before disabled and down pods are taken out),
``kvcache_index_lookup_latency_seconds``, ``kvcache_tokenization_tokenization_latency_seconds``,
``kvcache_tokenization_tokenized_tokens_total``,
``kvcache_tokenization_render_chat_template_latency_seconds`` (``tokenizer`` is the model name).
Ours: ``kvcache_scoring_requests_total{endpoint,outcome}`` (outcome ``ok`` or the error code),
``kvcache_scoring_core_latency_seconds{endpoint}``, ``kvcache_tokenization_prefix_store_*``.

A model name comes from the request, so it becomes a label only for the first
``MAX_MODEL_LABELS`` models a process scores (``other`` after that): label sets stay bounded.
With several web workers, prometheus_client's multiprocess mode sums them (``manage.py serve``).
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Histogram

from scoring.read_path import ScoreResult

MAX_MODEL_LABELS = 64
OTHER_MODELS = "other"

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Seconds; the read path's steps take tens of microseconds to milliseconds."""

LOOKUP_REQUESTS = Counter("kvcache_index_lookup_requests", "Index lookups (one per scored request).")
LOOKUP_HITS = Counter("kvcache_index_lookup_hits", "Block keys found held by some pod in index lookups.")
LOOKUP_LATENCY = Histogram(
    "kvcache_index_lookup_latency_seconds", "Index lookup latency.", buckets=LATENCY_BUCKETS
)
TOKENIZATION_LATENCY = Histogram(
    "kvcache_tokenization_tokenization_latency_seconds",
    "Prompt tokenization latency (prefix store included).",
    ["tokenizer"],
    buckets=LATENCY_BUCKETS,
)
TOKENIZED_TOKENS = Counter(
    "kvcache_tokenization_tokenized_tokens", "Tokens produced by tokenization.", ["tokenizer"]
)
RENDER_LATENCY = Histogram(
    "kvcache_tokenization_render_chat_template_latency_seconds",
    "Chat template rendering latency.",
    ["tokenizer"],
    buckets=LATENCY_BUCKETS,
)
PREFIX_STORE_REQUESTS = Counter(
    "kvcache_tokenization_prefix_store_requests",
    "Tokenizations that consulted the prefix store.",
    ["tokenizer"],
)
PREFIX_STORE_HITS = Counter(
    "kvcache_tokenization_prefix_store_hits", "Tokenizations that reused prefix-store tokens.", ["tokenizer"]
)
PREFIX_STORE_REUSED_TOKENS = Counter(
    "kvcache_tokenization_prefix_store_reused_tokens", "Tokens taken from the prefix store.", ["tokenizer"]
)
SCORING_REQUESTS = Counter(
    "kvcache_scoring_requests", "Scoring requests by endpoint and outcome.", ["endpoint", "outcome"]
)
SCORING_HITS = Counter(
    "kvcache_scoring_hits", "Scored requests where some pod holds at least the first block.", ["endpoint"]
)
SCORING_CORE_LATENCY = Histogram(
    "kvcache_scoring_core_latency_seconds",
    "Time in the read path core (render + tokenize + keys + lookup + score) per request.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)


def observe_result(endpoint: str, result: ScoreResult) -> None:
    """Record what one scored request did."""
    timings = result.timings
    if result.looked_up:
        LOOKUP_REQUESTS.inc()
        LOOKUP_HITS.inc(result.lookup_hits)
        LOOKUP_LATENCY.observe(timings.lookup)
    tokenization = result.tokenization
    if tokenization is not None:
        model = model_label(result.model)
        TOKENIZATION_LATENCY.labels(model).observe(timings.tokenize)
        TOKENIZED_TOKENS.labels(model).inc(len(tokenization.token_ids))
        PREFIX_STORE_REQUESTS.labels(model).inc()
        if tokenization.from_prefix_store:
            PREFIX_STORE_HITS.labels(model).inc()
            PREFIX_STORE_REUSED_TOKENS.labels(model).inc(tokenization.reused_tokens)
    if result.templated is not None:
        RENDER_LATENCY.labels(model_label(result.model)).observe(timings.render)
    SCORING_CORE_LATENCY.labels(endpoint).observe(timings.total)
    if result.scores:
        SCORING_HITS.labels(endpoint).inc()


def count_request(endpoint: str, outcome: str) -> None:
    SCORING_REQUESTS.labels(endpoint, outcome).inc()


_model_labels: set[str] = set()
_model_labels_lock = threading.Lock()


def model_label(model: str) -> str:
    """``model`` while fewer than ``MAX_MODEL_LABELS`` models have been labelled, else ``other``."""
    if model in _model_labels:
        return model
    with _model_labels_lock:
        if len(_model_labels) < MAX_MODEL_LABELS:
            _model_labels.add(model)
            return model
    return OTHER_MODELS
