"""The Endpoint Picker's Prometheus metrics (its ``--metrics-port``'s ``/metrics``): the routing
core's counts as ``kvcache_epp_*`` (``routing.metrics``) and its own: decisions by outcome, picks
per pod, stream errors and the time per pick."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from routing.metrics import RoutingMetrics

PICK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

REGISTRY = CollectorRegistry()

ROUTING = RoutingMetrics.create("kvcache_epp", REGISTRY)
DECISIONS = Counter(
    "kvcache_epp_decisions",
    "Requests Envoy asked about, by outcome: routed (a destination named), unavailable (503: no live "
    "pod, or none in the subset), shed (429), refused (400, 404, 413: the request cannot be routed), "
    "error (the picker failed: 500, or passed on without a destination when failing open).",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("routed", "unavailable", "shed", "refused", "error"):
    DECISIONS.labels(_outcome)
PICKS = Counter(
    "kvcache_epp_picks",
    "Requests per pod: picked first (role primary), as Envoy reported, served (role served), and a "
    "P/D request's prefill pod, named to its decode pod's sidecar (role prefill).",
    ["pod", "role"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "kvcache_epp_stream_errors",
    "ext_proc streams that ended in an error, by reason (protocol: a message out of order; "
    "cancelled: Envoy went away mid-request; internal).",
    ["reason"],
    registry=REGISTRY,
)
PICK_SECONDS = Histogram(
    "kvcache_epp_pick_seconds",
    "The picker's own time per request: from the body's last byte to the destination sent to Envoy.",
    buckets=PICK_BUCKETS,
    registry=REGISTRY,
)
