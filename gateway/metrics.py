"""The gateway's Prometheus metrics (``/metrics``; summed over worker processes in
prometheus_client's multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set)."""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from registry.pod_metrics import READ_FAILURES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

REGISTRY = CollectorRegistry()
"""The gateway's own (the default registry of a Django process holds the web's collectors)."""

POLICY = Gauge(
    "kvcache_gateway_policy",
    "1 for the routing policy this gateway runs (set at start, so it is known before any request).",
    ["policy"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
REQUESTS = Counter(
    "kvcache_gateway_requests",
    "Requests routed, by policy, pod and outcome (ok, upstream_error, no_pod, client_gone).",
    ["policy", "pod", "outcome"],
    registry=REGISTRY,
)
RETRIES = Counter(
    "kvcache_gateway_retries",
    "Requests sent to a next pod after a failure before its answer began, by reason (connect: not "
    "reached; closed, malformed: the connection closed or the answer's head malformed; status: a 5xx).",
    ["policy", "reason"],
    registry=REGISTRY,
)
HITS = Counter(
    "kvcache_gateway_prefix_hits",
    "Requests routed to a pod known to hold at least their first block.",
    ["policy"],
    registry=REGISTRY,
)
MATCHED = Counter(
    "kvcache_gateway_matched_blocks",
    "Blocks of routed requests the chosen pod was known to hold (index or speculative).",
    ["policy"],
    registry=REGISTRY,
)
BLOCKS = Counter(
    "kvcache_gateway_request_blocks", "Full blocks of routed requests.", ["policy"], registry=REGISTRY
)
SCORE_FAILURES = Counter(
    "kvcache_gateway_score_failures",
    "Requests routed without prefix knowledge: tokenizing or the index failed, by reason.",
    ["reason"],
    registry=REGISTRY,
)
SCRAPES = Counter(
    "kvcache_gateway_scrapes",
    "Scrapes of pods' /metrics for their load (each pod once a second).",
    registry=REGISTRY,
)
SCRAPE_FAILURES = Counter(
    "kvcache_gateway_scrape_failures",
    "Scrapes of pods' /metrics that gave no load, by reason (connect, timeout, status, too_large, "
    "malformed, error): the pod's load is then the gateway's own requests alone.",
    ["reason"],
    registry=REGISTRY,
)
for _reason in READ_FAILURES:
    SCRAPE_FAILURES.labels(_reason)  # every reason shows, at 0 until it happens
TTFT = Histogram(
    "kvcache_gateway_upstream_ttft_seconds",
    "From sending a request to the pod until its first response byte.",
    ["policy"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
OVERHEAD = Histogram(
    "kvcache_gateway_overhead_seconds",
    "The gateway's own time per request: from receiving it whole to sending it to a pod.",
    ["policy"],
    buckets=OVERHEAD_BUCKETS,
    registry=REGISTRY,
)


def exposition() -> tuple[bytes, str]:
    """The metrics text and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
