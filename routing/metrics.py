"""What the routing core counts, under the name of the front that runs it (``kvcache_gateway_*``
for the gateway, ``kvcache_epp_*`` for the Endpoint Picker), in that front's registry."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from registry.pod_metrics import READ_FAILURES

PD_DECISIONS = ("disaggregated", "short_prompt", "fallback")
PD_FALLBACK_REASONS = (
    "connect",
    "timeout",
    "closed",
    "malformed",
    "too_large",
    "status",
    "no_transfer_params",
    "no_pod",
    "no_sidecar",
)
"""Why a prefill step failed (``routing.disaggregation.Prefilled.failure``; ``no_pod``: no prefill
pod left to try; ``no_sidecar``: under the Endpoint Picker, the decode pod had no sidecar)."""


@dataclass(frozen=True, slots=True)
class RoutingMetrics:
    policy: Gauge
    hits: Counter
    matched: Counter
    blocks: Counter
    score_failures: Counter
    scrapes: Counter
    scrape_failures: Counter
    pd_requests: Counter
    pd_fallbacks: Counter

    @classmethod
    def create(cls, prefix: str, registry: CollectorRegistry) -> RoutingMetrics:
        """The collectors, named ``<prefix>_<name>``, registered in ``registry``."""
        made = cls(
            policy=Gauge(
                f"{prefix}_policy",
                "1 for the routing policy this process runs (set at start: known before any request).",
                ["policy"],
                registry=registry,
                multiprocess_mode="max",
            ),
            hits=Counter(
                f"{prefix}_prefix_hits",
                "Requests routed to a pod known to hold at least their first block.",
                ["policy"],
                registry=registry,
            ),
            matched=Counter(
                f"{prefix}_matched_blocks",
                "Blocks of routed requests the chosen pod was known to hold (index or speculative).",
                ["policy"],
                registry=registry,
            ),
            blocks=Counter(
                f"{prefix}_request_blocks", "Full blocks of routed requests.", ["policy"], registry=registry
            ),
            score_failures=Counter(
                f"{prefix}_score_failures",
                "Requests routed without prefix knowledge: tokenizing or the index failed, by reason.",
                ["reason"],
                registry=registry,
            ),
            scrapes=Counter(
                f"{prefix}_scrapes",
                "Scrapes of pods' /metrics for their load (each pod once a second).",
                registry=registry,
            ),
            scrape_failures=Counter(
                f"{prefix}_scrape_failures",
                "Scrapes of pods' /metrics that gave no load, by reason (connect, timeout, status, "
                "too_large, malformed, error): the pod's load is then this process's own requests alone.",
                ["reason"],
                registry=registry,
            ),
            pd_requests=Counter(
                f"{prefix}_pd_requests",
                "Requests of models served with prefill/decode disaggregation, by decision: "
                "disaggregated (two steps), short_prompt (whole on the decode pod: below the "
                "threshold), fallback (whole on the decode pod: the prefill step failed).",
                ["decision"],
                registry=registry,
            ),
            pd_fallbacks=Counter(
                f"{prefix}_pd_fallbacks",
                "Prefill steps that failed, the request then served whole by its decode pod, by "
                "reason (the last prefill pod's: connect, timeout, closed, malformed, too_large, "
                "status: a 5xx or 429, no_transfer_params: it answered without kv_transfer_params; "
                "no_pod: none to try; no_sidecar: the picker's decode pod ran no sidecar).",
                ["reason"],
                registry=registry,
            ),
        )
        for reason in READ_FAILURES:
            made.scrape_failures.labels(reason)  # every reason shows, at 0 until it happens
        for decision in PD_DECISIONS:
            made.pd_requests.labels(decision)
        for reason in PD_FALLBACK_REASONS:
            made.pd_fallbacks.labels(reason)
        return made

    @classmethod
    def unregistered(cls) -> RoutingMetrics:
        """Collectors of their own (a tracker or router built alone, in a test or a benchmark)."""
        return cls.create("kvcache_routing", CollectorRegistry())
