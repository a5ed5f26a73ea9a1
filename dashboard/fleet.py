"""The fleet view as pure functions over plain values; no Django, no I/O (``sampler`` feeds it).

Inputs are what the other parts already publish: ingest snapshots (``IngestStats.snapshot``, one
per ingest process), the index's ``PodBlocks``, the pod registry and the scoring counters.
Outputs are JSON-able rows and totals. Rates are never read, only derived: the difference of two
successive counter snapshots of the same ingest process over the time between them, so they do
not depend on how often anyone looks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvindex.base import PodBlocks
from kvindex.kv_cache_groups import is_group_holder
from registry.liveness import POD_STATES, pod_state

COUNTERS = (
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "clears",
    "seq_gaps",
    "missed_batches",
    "restarts",
    "replayed_batches",
    "lost_state_clears",
    "aligned_blocks",
    "misaligned_blocks",
    "orphaned_blocks",
    "ignored_batches",
)
"""The monotonic ``StreamStats`` counters the dashboard sums per pod and differentiates."""

_RANK_HOLDER = re.compile(r"(.+)#dp\d+")


def pod_of_holder(holder: str) -> str:
    """The pod an index holder belongs to: ``pod#dp2`` (data-parallel rank 2) is ``pod``."""
    match = _RANK_HOLDER.fullmatch(holder)
    return match.group(1) if match else holder


@dataclass(frozen=True, slots=True)
class PodCounters:
    """One pod's stream counters in one ingest snapshot, summed over its data-parallel ranks."""

    pod: str
    model: str
    counts: dict[str, int]
    decode_errors: dict[str, int]
    last_event_at: float
    last_seq: int | None
    ranks: int
    resyncing: bool = False  # a rank's state was lost and cleared, and it has not stored since

    @property
    def hash_alignment(self) -> float | None:
        """As ``StreamStats.hash_alignment``, over all ranks: share of judged blocks whose
        engine hash equalled our block key (None: no judged block yet)."""
        aligned, misaligned = self.counts["aligned_blocks"], self.counts["misaligned_blocks"]
        return aligned / (aligned + misaligned) if aligned + misaligned else None


def pod_counters(streams: Iterable[Mapping]) -> dict[str, PodCounters]:
    """Per pod, the sum of its streams (``StreamStats.as_dict`` shape) of one snapshot."""
    grouped: dict[str, list[Mapping]] = {}
    for stream in streams:
        grouped.setdefault(stream["pod"], []).append(stream)
    out = {}
    for pod, ranks in grouped.items():
        errors: dict[str, int] = {}
        for s in ranks:
            for reason, n in s.get("decode_errors", {}).items():
                errors[reason] = errors.get(reason, 0) + n
        latest = max(ranks, key=lambda s: s.get("last_event_at", 0.0))
        out[pod] = PodCounters(
            pod=pod,
            model=latest.get("model", ""),
            counts={c: sum(s.get(c, 0) for s in ranks) for c in COUNTERS},
            decode_errors=errors,
            last_event_at=latest.get("last_event_at", 0.0),
            last_seq=latest.get("last_seq"),
            ranks=len(ranks),
            resyncing=any(s.get("resyncing") for s in ranks),
        )
    return out


def _delta(now: float, before: float) -> float:
    """How much a counter grew; a counter that went down restarted from zero (a new process)."""
    return now - before if now >= before else now


@dataclass(frozen=True, slots=True)
class PodRates:
    """Per second, between two successive snapshots."""

    stored: float
    removed: float
    events: float


def rates_between(
    before: Mapping[str, PodCounters], now: Mapping[str, PodCounters], *, seconds: float
) -> dict[str, PodRates]:
    """Rates of every pod in ``now``; a pod new since ``before`` counts from zero."""
    if seconds <= 0:
        return {}
    out = {}
    for pod, cur in now.items():
        prev = before.get(pod)
        grown = {
            c: _delta(cur.counts[c], prev.counts[c]) if prev else cur.counts[c]
            for c in ("blocks_stored", "blocks_removed", "events")
        }
        out[pod] = PodRates(
            stored=grown["blocks_stored"] / seconds,
            removed=grown["blocks_removed"] / seconds,
            events=grown["events"] / seconds,
        )
    return out


_LOGGED = (
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "clears",
    "seq_gaps",
    "missed_batches",
    "restarts",
    "orphaned_blocks",
    "ignored_batches",
)
"""The counters a pod's activity log reports."""


def activity_between(
    before: Mapping[str, PodCounters], now: Mapping[str, PodCounters], *, at: float
) -> list[dict]:
    """One log entry per pod whose counters moved between two snapshots: what arrived (batches,
    events, blocks stored and removed, clears) and what went wrong (seq gaps, restarts, decode
    errors by reason), with the last seq seen. Pods that did nothing get no entry."""
    entries = []
    for pod, cur in now.items():
        prev = before.get(pod)
        moved = {c: _delta(cur.counts[c], prev.counts[c]) if prev else cur.counts[c] for c in _LOGGED}
        errors = {
            reason: grown
            for reason, n in cur.decode_errors.items()
            if (grown := _delta(n, prev.decode_errors.get(reason, 0)) if prev else n)
        }
        if any(moved.values()) or errors:
            entries.append({"at": at, "pod": pod, **moved, "decode_errors": errors, "last_seq": cur.last_seq})
    return entries


@dataclass(frozen=True, slots=True)
class RegistryPod:
    """What the registry says about a pod (``registry.models.Pod``), as plain values."""

    pod: str
    model: str
    enabled: bool
    last_seen: float | None
    health: str = "unknown"


def pod_rows(
    *,
    now: float,
    registry: Iterable[RegistryPod],
    blocks: Iterable[PodBlocks],
    counters: Mapping[str, PodCounters],
    rates: Mapping[str, PodRates],
    stale_after: float,
) -> list[dict]:
    """One row per pod known to any source, sorted by pod id.

    Its ``status`` is ``registry.liveness.pod_state``: ``disabled``, ``down``, ``active`` (an event
    at most ``stale_after`` seconds old, in the registry's ``last_seen`` or an ingest snapshot),
    else ``idle`` (the liveness prober finds it up) or ``stale`` (a pod only the index knows is
    stale: nothing says it is alive). ``health`` is the registry's (``unknown`` for a pod it
    does not know).
    """
    registered = {p.pod: p for p in registry}
    tiers: dict[str, dict[str, int]] = {}
    models: dict[str, set[str]] = {}
    for b in blocks:
        if is_group_holder(b.pod):
            continue  # a hybrid model's other KV-cache groups repeat group 0's blocks
        pod = pod_of_holder(b.pod)
        by_tier = tiers.setdefault(pod, {})
        for tier, n in b.blocks_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
        models.setdefault(pod, set()).add(b.model)
    rows = []
    for pod in sorted(registered.keys() | tiers.keys() | counters.keys()):
        reg, cnt, rate = registered.get(pod), counters.get(pod), rates.get(pod)
        last = max(cnt.last_event_at if cnt else 0.0, (reg.last_seen if reg else None) or 0.0)
        age = max(0.0, now - last) if last else None
        health = reg.health if reg is not None else "unknown"
        status = pod_state(
            enabled=reg is None or reg.enabled, health=health, last_event_age=age, stale_after=stale_after
        )
        model_names = set(models.get(pod, ()))
        if cnt is not None and cnt.model:
            model_names.add(cnt.model)
        elif reg is not None and reg.model:
            model_names.add(reg.model)
        by_tier = dict(sorted(tiers.get(pod, {}).items()))
        rows.append(
            {
                "pod": pod,
                "model": ", ".join(sorted(model_names)),
                "blocks_by_tier": by_tier,
                "blocks": sum(by_tier.values()),
                "stored_per_s": rate.stored if rate else None,
                "removed_per_s": rate.removed if rate else None,
                "events_per_s": rate.events if rate else None,
                "last_event_age": age,
                "seq_gaps": cnt.counts["seq_gaps"] if cnt else 0,
                "missed_batches": cnt.counts["missed_batches"] if cnt else 0,
                "restarts": cnt.counts["restarts"] if cnt else 0,
                "replayed_batches": cnt.counts["replayed_batches"] if cnt else 0,
                "lost_state_clears": cnt.counts["lost_state_clears"] if cnt else 0,
                "resyncing": cnt.resyncing if cnt else False,
                "decode_errors": sum(cnt.decode_errors.values()) if cnt else 0,
                "hash_alignment": cnt.hash_alignment if cnt else None,
                "ranks": cnt.ranks if cnt else 0,
                "health": health,
                "status": status,
            }
        )
    return rows


@dataclass(frozen=True, slots=True)
class ScoreRates:
    """The scoring API's traffic over one sampling interval (hit rate None: no request in it,
    or no hits counter to tell)."""

    requests_per_s: float
    hit_rate: float | None


@dataclass(frozen=True, slots=True)
class ScoreCounters:
    """Cumulative counts of requests scored or routed, and of those that found a cached prefix
    (``hits`` None: no such counter)."""

    requests: float
    hits: float | None

    def rates_since(self, before: ScoreCounters, *, seconds: float) -> ScoreRates:
        """Requests per second and the share that hit since ``before``. A gateway counts a hit
        when the pod starts answering and the request when the answer ends, so an interval can
        see more hits than requests: the hit rate is capped at 1, as in the history and the
        gateway rows."""
        requests = _delta(self.requests, before.requests)
        hit_rate = None
        if self.hits is not None and before.hits is not None and requests > 0:
            hit_rate = min(1.0, _delta(self.hits, before.hits) / requests)
        return ScoreRates(requests_per_s=requests / seconds if seconds > 0 else 0.0, hit_rate=hit_rate)


def fleet_totals(
    rows: Iterable[Mapping],
    *,
    unattributed_errors: int,
    ingest_processes: int,
    scoring: ScoreCounters | None,
    score: ScoreRates | None,
    index_available: bool = True,
    index_resyncing: Iterable[str] = (),
) -> dict:
    """Sums over the pod rows, plus what belongs to no pod: decode errors that could not be
    pinned on one, the number of ingest processes heard from, and the scoring traffic (``scoring``:
    the counters now, None when there are none; ``score``: the rates since the last sample), and
    whether the index answered (when not, the rows' block counts are unknown, not zero), and the
    models whose index data ingest is rebuilding after the index lost it."""
    rows = list(rows)
    by_tier: dict[str, int] = {}
    for r in rows:
        for tier, n in r["blocks_by_tier"].items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    statuses = {s: sum(r["status"] == s for r in rows) for s in POD_STATES}
    return {
        "pods": len(rows),
        **statuses,
        "blocks": sum(by_tier.values()),
        "blocks_by_tier": dict(sorted(by_tier.items())),
        "stored_per_s": sum(r["stored_per_s"] or 0.0 for r in rows),
        "removed_per_s": sum(r["removed_per_s"] or 0.0 for r in rows),
        "events_per_s": sum(r["events_per_s"] or 0.0 for r in rows),
        "seq_gaps": sum(r["seq_gaps"] for r in rows),
        "decode_errors": sum(r["decode_errors"] for r in rows) + unattributed_errors,
        "ingest_processes": ingest_processes,
        "index_available": index_available,
        "index_resyncing": sorted(index_resyncing),
        "scoring_available": scoring is not None,
        "hit_rate_available": scoring is not None and scoring.hits is not None,
        "score_requests_per_s": score.requests_per_s if score else None,
        "hit_rate": score.hit_rate if score else None,
    }


CHART_PODS = 8
"""Pods with the most blocks whose block counts the fleet's block chart shows."""

POD_SERIES = ("blocks", "stored_per_s", "removed_per_s", "events_per_s")
"""The values of a pod in a history point (``kvindex.shared_stats``), in their order."""


def fleet_chart(points: Sequence[Mapping], *, pods: int = CHART_PODS) -> dict:
    """Columns for the fleet charts from history points (``kvindex.shared_stats.read_history``):
    times, fleet series, and the block counts of the ``pods`` pods holding the most blocks in
    the latest point (None where a point does not have the pod)."""
    latest = points[-1]["pods"] if points else {}
    top = sorted(latest, key=lambda pod: (-(latest[pod][0] or 0), pod))[:pods]
    columns: dict = {"t": [p["t"] for p in points]}
    for name in ("blocks", "events_per_s", "score_requests_per_s", "hit_rate"):
        columns[name] = [p.get(name) for p in points]
    columns["pods"] = {pod: [p["pods"][pod][0] if pod in p["pods"] else None for p in points] for pod in top}
    return columns


def pod_chart(points: Sequence[Mapping], pod: str) -> dict:
    """Columns for one pod's chart from history points: times, and ``POD_SERIES`` (None where a
    point does not have the pod)."""
    columns: dict = {"t": [p["t"] for p in points]}
    for i, name in enumerate(POD_SERIES):
        columns[name] = [p["pods"][pod][i] if pod in p["pods"] else None for p in points]
    return columns
