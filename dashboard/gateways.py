"""The gateways' view as pure functions over plain values; no Django, no I/O (``selectors``
scrapes, ``sampler`` keeps each gateway's scrapes of the recent window).

Input: the Prometheus text a gateway serves at ``/metrics`` (``gateway/metrics.py``): requests
routed by policy, pod and outcome, retries by reason, prefix hits, score failures by reason,
histograms of the upstream time to first token and of the gateway's own overhead, and, under
prefill/decode disaggregation, its decisions, fallbacks by reason, prefill steps by pod and
outcome, and histograms of the prefill and transfer steps. Output: one JSON-able row per
configured gateway (``gateway_row``): its traffic, its pods (the requests each answered, which
under P/D is its decode pod, and the prefill steps each was sent), and a ``pd`` part that is None
until the gateway serves a P/D request, so a fleet without P/D shows none of it. As in ``fleet``,
recent numbers are never read but derived: the growth of the counters between the oldest scrape
of the window and the latest, so they do not depend on how often anyone looks. Quantiles are
estimated from the histogram buckets as Prometheus's ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from dashboard.fleet import ScoreCounters

REQUESTS = "kvcache_gateway_requests_total"
RETRIES = "kvcache_gateway_retries_total"
PREFIX_HITS = "kvcache_gateway_prefix_hits_total"
SCORE_FAILURES = "kvcache_gateway_score_failures_total"
TTFT = "kvcache_gateway_upstream_ttft_seconds"
OVERHEAD = "kvcache_gateway_overhead_seconds"
PD_REQUESTS = "kvcache_gateway_pd_requests_total"
PD_FALLBACKS = "kvcache_gateway_pd_fallbacks_total"
PD_PREFILLS = "kvcache_gateway_pd_prefills_total"
PD_STEP = "kvcache_gateway_pd_step_seconds"


def _grown(now: float, before: float) -> float:
    """How much a counter grew; one that went down restarted from zero (a new gateway process)."""
    return now - before if now >= before else now


@dataclass(frozen=True, slots=True)
class Buckets:
    """A histogram: per upper bound (ascending, the last ``inf``), the observations at most that
    large, cumulative as Prometheus exposes them; no bounds when nothing was observed yet."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, before: Buckets) -> Buckets:
        """The observations made after ``before``: all of them when the histogram restarted
        from zero (fewer observations than before) or ``before`` had other bounds."""
        if before.bounds != self.bounds or self.count < before.count:
            return self
        grown = (max(0.0, n - b) for n, b in zip(self.counts, before.counts, strict=True))
        return Buckets(self.bounds, tuple(grown))

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 < q <= 1) estimated as ``histogram_quantile`` does: linearly
        within the bucket holding it, the first bucket starting at 0; in the ``+Inf`` bucket, the
        largest finite bound (all that is known). None without observations."""
        rank = q * self.count
        if rank <= 0:
            return None
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.counts, strict=True):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True, slots=True)
class GatewayCounters:
    """One scrape of a gateway's metrics, summed over the labels the view does not show.
    ``routed``: (pod, outcome) -> requests, pod ``""`` when no pod answered; ``policies``: every
    policy a sample was labelled with (``kvcache_gateway_policy`` names it from the start)."""

    policies: tuple[str, ...] = ()
    routed: Mapping[tuple[str, str], float] = field(default_factory=dict)
    retries: Mapping[str, float] = field(default_factory=dict)
    prefix_hits: float = 0.0
    score_failures: Mapping[str, float] = field(default_factory=dict)
    ttft: Buckets = Buckets()
    overhead: Buckets = Buckets()
    pd_decisions: Mapping[str, float] = field(default_factory=dict)
    pd_fallbacks: Mapping[str, float] = field(default_factory=dict)
    pd_prefills: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(prefill pod, outcome) -> prefill steps."""
    prefill_step: Buckets = Buckets()
    transfer_step: Buckets = Buckets()

    @property
    def requests(self) -> float:
        """Every request routed, whatever became of it."""
        return sum(self.routed.values())

    @property
    def answered(self) -> float:
        """Requests a pod answered (the ones a prefix hit is counted for)."""
        return sum(n for (pod, _), n in self.routed.items() if pod)

    def since(self, before: GatewayCounters) -> GatewayCounters:
        """What happened after ``before`` (counters that went down restarted from zero)."""

        def grown(now: Mapping, then: Mapping) -> dict:
            return {k: _grown(n, then.get(k, 0.0)) for k, n in now.items()}

        return GatewayCounters(
            policies=self.policies,
            routed=grown(self.routed, before.routed),
            retries=grown(self.retries, before.retries),
            prefix_hits=_grown(self.prefix_hits, before.prefix_hits),
            score_failures=grown(self.score_failures, before.score_failures),
            ttft=self.ttft.since(before.ttft),
            overhead=self.overhead.since(before.overhead),
            pd_decisions=grown(self.pd_decisions, before.pd_decisions),
            pd_fallbacks=grown(self.pd_fallbacks, before.pd_fallbacks),
            pd_prefills=grown(self.pd_prefills, before.pd_prefills),
            prefill_step=self.prefill_step.since(before.prefill_step),
            transfer_step=self.transfer_step.since(before.transfer_step),
        )


def parse_gateway_metrics(text: str) -> GatewayCounters:
    """A gateway's ``/metrics`` text as counters; ValueError when it is not Prometheus text.
    Samples of other names are ignored (a gateway that routed nothing yet has none of its own)."""
    policies: set[str] = set()
    routed: dict[tuple[str, str], float] = {}
    retries: dict[str, float] = {}
    failures: dict[str, float] = {}
    hits = 0.0
    decisions: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    prefills: dict[tuple[str, str], float] = {}
    buckets: dict[str, dict[float, float]] = {TTFT: {}, OVERHEAD: {}, "prefill": {}, "transfer": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if not name.startswith("kvcache_gateway_") or name.endswith("_created"):
                continue
            if "policy" in labels:
                policies.add(labels["policy"])
            if name == REQUESTS:
                key = (labels.get("pod", ""), labels.get("outcome", ""))
                routed[key] = routed.get(key, 0.0) + value
            elif name == RETRIES:
                retries[labels.get("reason", "")] = retries.get(labels.get("reason", ""), 0.0) + value
            elif name == PREFIX_HITS:
                hits += value
            elif name == SCORE_FAILURES:
                failures[labels.get("reason", "")] = failures.get(labels.get("reason", ""), 0.0) + value
            elif name == PD_REQUESTS:
                decisions[labels.get("decision", "")] = decisions.get(labels.get("decision", ""), 0.0) + value
            elif name == PD_FALLBACKS:
                fallbacks[labels.get("reason", "")] = fallbacks.get(labels.get("reason", ""), 0.0) + value
            elif name == PD_PREFILLS:
                key = (labels.get("pod", ""), labels.get("outcome", ""))
                prefills[key] = prefills.get(key, 0.0) + value
            elif name.endswith("_bucket") and (
                name.removesuffix("_bucket") in buckets or name == PD_STEP + "_bucket"
            ):
                if "le" not in labels:
                    raise ValueError(f"{name} without an le label")
                histogram_name = name.removesuffix("_bucket")
                by_bound = buckets[labels.get("step", "") if histogram_name == PD_STEP else histogram_name]
                bound = float(labels["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + value

    def histogram(by_bound: dict[float, float]) -> Buckets:
        bounds = tuple(sorted(by_bound))
        return Buckets(bounds, tuple(by_bound[b] for b in bounds))

    return GatewayCounters(
        policies=tuple(sorted(policies)),
        routed=routed,
        retries=retries,
        prefix_hits=hits,
        score_failures=failures,
        ttft=histogram(buckets[TTFT]),
        overhead=histogram(buckets[OVERHEAD]),
        pd_decisions=decisions,
        pd_fallbacks=fallbacks,
        pd_prefills=prefills,
        prefill_step=histogram(buckets["prefill"]),
        transfer_step=histogram(buckets["transfer"]),
    )


@dataclass(frozen=True, slots=True)
class GatewayScrape:
    """One attempt to read a gateway's ``/metrics`` at ``at`` (unix seconds): its counters, or
    None and why not (``error``) when it could not be reached or did not answer with metrics."""

    url: str
    at: float
    counters: GatewayCounters | None
    error: str | None = None


def gateway_traffic(scrapes: Iterable[GatewayScrape]) -> ScoreCounters | None:
    """Requests the gateways routed and those sent to a pod holding their prefix, summed over the
    gateways that answered; None when none did (or none is configured)."""
    answered = [s.counters for s in scrapes if s.counters is not None]
    if not answered:
        return None
    return ScoreCounters(
        requests=sum(c.requests for c in answered), hits=sum(c.prefix_hits for c in answered)
    )


def _hit_rate(counters: GatewayCounters) -> float | None:
    """Prefix hits per answered request. A hit is counted when the pod starts answering and the
    request when the answer ends, so a scrape between the two could see more hits than
    requests: the rate is capped at 1."""
    answered = counters.answered
    return min(1.0, counters.prefix_hits / answered) if answered else None


def _per_s(n: float, seconds: float | None) -> float | None:
    return n / seconds if seconds else None


_UNKNOWN_WHEN_UNREACHABLE = (
    "policy",
    "window_seconds",
    "requests",
    "requests_per_s",
    "outcomes",
    "retries",
    "retries_per_s",
    "retries_by_reason",
    "hit_rate",
    "hit_rate_overall",
    "score_failures",
    "score_failures_by_reason",
    "ttft_p50",
    "ttft_p90",
    "ttft_p50_overall",
    "ttft_p90_overall",
    "overhead_p50",
    "overhead_p50_overall",
    "pd",
)
"""What an unreachable gateway's row has None for."""


def gateway_row(window: Sequence[GatewayScrape]) -> dict:
    """The row of one gateway from its scrapes of the recent window, oldest first, the latest
    last. Totals are since the gateway started; ``*_per_s``, ``hit_rate``, ``ttft_p50``,
    ``ttft_p90``, ``overhead_p50`` and the P/D steps' ``*_p50`` cover ``window_seconds``: from the
    oldest scrape that answered to the latest (None with a single one). ``pods``: ``_pods``;
    ``pd``: ``_pd``. A gateway whose latest scrape failed is ``reachable: False`` with the
    ``error``, and every number None: unknown, not zero."""
    latest = window[-1]
    now = latest.counters
    row: dict = {"url": latest.url, "reachable": now is not None, "error": latest.error}
    if now is None:
        return {**row, **dict.fromkeys(_UNKNOWN_WHEN_UNREACHABLE), "pods": []}
    oldest = next(s for s in window if s.counters is not None)
    seconds = latest.at - oldest.at if latest.at > oldest.at else None
    # Without a window every recent number comes out None: no rate, no hit rate, no quantile.
    recent = now.since(oldest.counters) if seconds else GatewayCounters()
    outcomes: dict[str, float] = {}
    for (_, outcome), n in now.routed.items():
        outcomes[outcome] = outcomes.get(outcome, 0.0) + n
    return {
        **row,
        "policy": ", ".join(now.policies) or None,
        "window_seconds": seconds,
        "requests": now.requests,
        "requests_per_s": _per_s(recent.requests, seconds),
        "outcomes": dict(sorted(outcomes.items())),
        "retries": sum(now.retries.values()),
        "retries_per_s": _per_s(sum(recent.retries.values()), seconds),
        "retries_by_reason": dict(sorted(now.retries.items())),
        "hit_rate": _hit_rate(recent),
        "hit_rate_overall": _hit_rate(now),
        "score_failures": sum(now.score_failures.values()),
        "score_failures_by_reason": dict(sorted(now.score_failures.items())),
        "ttft_p50": recent.ttft.quantile(0.5),
        "ttft_p90": recent.ttft.quantile(0.9),
        "ttft_p50_overall": now.ttft.quantile(0.5),
        "ttft_p90_overall": now.ttft.quantile(0.9),
        "overhead_p50": recent.overhead.quantile(0.5),
        "overhead_p50_overall": now.overhead.quantile(0.5),
        "pd": _pd(now, recent, seconds),
        "pods": _pods(now, recent, seconds),
    }


def _by_pod(counts: Mapping[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    """(pod, outcome) -> n as pod -> outcome -> n, leaving out pod ``""`` (no pod answered)."""
    by_pod: dict[str, dict[str, float]] = {}
    for (pod, outcome), n in counts.items():
        if pod:
            outcomes = by_pod.setdefault(pod, {})
            outcomes[outcome] = outcomes.get(outcome, 0.0) + n
    return by_pod


def _pods(now: GatewayCounters, recent: GatewayCounters, seconds: float | None) -> list[dict]:
    """Per pod, by name: the requests it answered (under P/D, as the decode pod or whole), those
    that did not end ``ok``, its share of the answered ones and its recent rate; and the prefill
    steps the gateway sent it, whatever their outcome, their recent rate and those that did not
    end ``ok`` by outcome (``refused``: the pod refused the request itself; else why the step
    failed). The ``prefills*`` are None for a pod that was sent no prefill step (not a prefill pod,
    or no P/D at all)."""
    answered = now.answered
    routed, routed_recent = _by_pod(now.routed), _by_pod(recent.routed)
    prefills, prefills_recent = _by_pod(now.pd_prefills), _by_pod(recent.pd_prefills)
    rows = []
    for pod in sorted(routed.keys() | prefills.keys()):
        outcomes = routed.get(pod, {})
        requests = sum(outcomes.values())
        row = {
            "pod": pod,
            "requests": requests,
            "not_ok": sum(n for outcome, n in outcomes.items() if outcome != "ok"),
            "share": requests / answered if answered else None,
            "requests_per_s": _per_s(sum(routed_recent.get(pod, {}).values()), seconds),
            "prefills": None,
            "prefills_per_s": None,
            "prefills_not_ok": None,
        }
        if pod in prefills:
            steps = prefills[pod]
            row["prefills"] = sum(steps.values())
            row["prefills_per_s"] = _per_s(sum(prefills_recent.get(pod, {}).values()), seconds)
            row["prefills_not_ok"] = {o: n for o, n in sorted(steps.items()) if o != "ok" and n}
        rows.append(row)
    return rows


def _pd(now: GatewayCounters, recent: GatewayCounters, seconds: float | None) -> dict | None:
    """The gateway's prefill/decode disaggregation: requests per decision (totals, and per second
    over the window), fallbacks by reason (those that happened), and the prefill and transfer
    steps' p50 (over the window and since start). None while the gateway has counted no decision
    and sent no prefill step (it exposes its decisions at 0 from the start: zeros are no P/D)."""
    if not any(now.pd_decisions.values()) and not any(now.pd_prefills.values()):
        return None
    decisions = dict(sorted(now.pd_decisions.items()))
    return {
        "decisions": decisions,
        "decisions_per_s": {d: _per_s(recent.pd_decisions.get(d, 0.0), seconds) for d in decisions},
        "fallbacks_by_reason": {r: n for r, n in sorted(now.pd_fallbacks.items()) if n},
        "prefill_p50": recent.prefill_step.quantile(0.5),
        "prefill_p50_overall": now.prefill_step.quantile(0.5),
        "transfer_p50": recent.transfer_step.quantile(0.5),
        "transfer_p50_overall": now.transfer_step.quantile(0.5),
    }
