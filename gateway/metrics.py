"""The gateway's Prometheus metrics (``/metrics``; summed over worker processes in
prometheus_client's multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set)."""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

from routing.metrics import RoutingMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

REGISTRY = CollectorRegistry()
"""The gateway's own (the default registry of a Django process holds the web's collectors)."""

ROUTING = RoutingMetrics.create("kvcache_gateway", REGISTRY)
"""The routing core's counts (``routing.metrics``): policy, hits, matched and request blocks, score
and scrape failures, as ``kvcache_gateway_*``."""
POLICY, HITS, MATCHED, BLOCKS = ROUTING.policy, ROUTING.hits, ROUTING.matched, ROUTING.blocks
SCORE_FAILURES, SCRAPES, SCRAPE_FAILURES = ROUTING.score_failures, ROUTING.scrapes, ROUTING.scrape_failures
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
TTFT = Histogram(
    "kvcache_gateway_upstream_ttft_seconds",
    "From sending a request to the pod until its first response byte.",
    ["policy"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
PD_PREFILLS = Counter(
    "kvcache_gateway_pd_prefills",
    "Prefill steps of requests served with prefill/decode disaggregation, by prefill pod and outcome "
    "(ok; refused: the pod refused the request itself, its answer the client's; else why it failed: "
    "connect, timeout, closed, malformed, too_large, status, no_transfer_params).",
    ["pod", "outcome"],
    registry=REGISTRY,
)
PD_STEP = Histogram(
    "kvcache_gateway_pd_step_seconds",
    "Steps of requests served with prefill/decode disaggregation: prefill (from sending the prompt "
    "to a prefill pod to its whole answer), transfer (from sending the request to the decode pod to "
    "its first byte: it pulls the prompt's KV cache, then computes the first token).",
    ["step"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
for _step in ("prefill", "transfer"):
    PD_STEP.labels(_step)  # shown from the start, at 0 until a P/D request is served
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
