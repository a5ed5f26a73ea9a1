"""Prometheus metrics of the web process, served at ``/metrics`` with django-prometheus's own.

Upstream's names are kept (upstream-parity.md, "Metrics"):

* ``kvcache_index_lookup_requests_total``, ``kvcache_index_lookup_hits_total`` (block keys found
  held, before disabled pods are taken out), ``kvcache_index_lookup_latency_seconds``;
* ``kvcache_tokenization_tokenization_latency_seconds{tokenizer}``,
  ``kvcache_tokenization_tokenized_tokens_total{tokenizer}``,
  ``kvcache_tokenization_render_chat_template_latency_seconds{tokenizer}`` (``tokenizer`` is the
  model name);
* ``kvcache_index_admissions_total`` / ``kvcache_index_evictions_total`` and the other ingest
  counters, read at scrape time from the ingest processes' snapshots in Redis.

Ours: ``kvcache_scoring_requests_total{endpoint,outcome}`` (outcome ``ok`` or the error code),
``kvcache_scoring_core_latency_seconds{endpoint}``, ``kvcache_tokenization_prefix_store_*``,
``kvcache_pod_blocks{pod,model,tier}`` and ``kvcache_{index,ingest_stats}_up``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ingest.stats import collect_families
from scoring import selectors, services
from scoring.index import IndexUnavailable
from scoring.read_path import ScoreResult

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
        model = result.model
        TOKENIZATION_LATENCY.labels(model).observe(timings.tokenize)
        TOKENIZED_TOKENS.labels(model).inc(len(tokenization.token_ids))
        PREFIX_STORE_REQUESTS.labels(model).inc()
        if tokenization.from_prefix_store:
            PREFIX_STORE_HITS.labels(model).inc()
            PREFIX_STORE_REUSED_TOKENS.labels(model).inc(tokenization.reused_tokens)
    if result.templated is not None:
        RENDER_LATENCY.labels(result.model).observe(timings.render)
    SCORING_CORE_LATENCY.labels(endpoint).observe(timings.total)
    if result.scores:
        SCORING_HITS.labels(endpoint).inc()


def count_request(endpoint: str, outcome: str) -> None:
    SCORING_REQUESTS.labels(endpoint, outcome).inc()


class LiveStateCollector(Collector):
    """At scrape time: per-pod block counts from the index and the ingest processes' counters
    from their snapshots in Redis. A source that cannot be read is reported as down (its ``_up``
    gauge is 0) and its families are left out, never the whole scrape failed."""

    def collect(self) -> Iterator:
        index_up = GaugeMetricFamily("kvcache_index_up", "1 when the KV-block index answered this scrape.")
        blocks = GaugeMetricFamily(
            "kvcache_pod_blocks", "Blocks held per pod, model and tier.", labels=["pod", "model", "tier"]
        )
        try:
            rows = services.get_index().pod_blocks()
        except IndexUnavailable:
            index_up.add_metric([], 0)
        else:
            index_up.add_metric([], 1)
            for row in rows:
                for tier, n in sorted(row.blocks_by_tier.items()):
                    blocks.add_metric([row.pod, row.model, tier], n)
        yield index_up
        yield blocks

        snapshots = selectors.ingest_snapshots()
        stats_up = GaugeMetricFamily(
            "kvcache_ingest_stats_up", "1 when the ingest processes' stats could be read from Redis."
        )
        stats_up.add_metric([], 0 if snapshots is None else 1)
        yield stats_up
        if snapshots is None:
            return
        yield from collect_families(
            selectors.merge_streams(snapshots), selectors.merge_unattributed_errors(snapshots)
        )
        queue_full = CounterMetricFamily(
            "kvcache_ingest_queue_full",
            "Times an ingest worker queue was full, summed over ingest processes.",
            labels=["worker"],
        )
        by_worker: dict[str, int] = {}
        for snapshot in snapshots:
            for worker, n in snapshot.get("queue_full", {}).items():
                by_worker[worker] = by_worker.get(worker, 0) + n
        for worker, n in sorted(by_worker.items()):
            queue_full.add_metric([worker], n)
        yield queue_full

    def describe(self) -> list:
        # Nothing to declare up front: registering must not read the index or Redis.
        return []


LIVE_STATE = LiveStateCollector()
REGISTRY.register(LIVE_STATE)
