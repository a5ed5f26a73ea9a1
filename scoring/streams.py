"""The stream counters of the ingest processes as the other processes see them.

Each ingest process writes its snapshot (``ingest.stats.IngestStats.snapshot``) as JSON into the
HASH ``kv:ingest:stats`` under its own instance id, once a second; readers merge the snapshots
that are fresh. The web process turns them into ``/metrics`` (``collect_families``), the pods API
and the dashboard. The format lives here, below both ``ingest`` (the writer) and the web (the
readers), so neither reaches into the other.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATS_KEY = "kv:ingest:stats"
STALE_AFTER_SECONDS = 30.0


def instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def publish_snapshot(client: redis.Redis, snapshot: dict, *, instance: str) -> None:
    client.hset(STATS_KEY, instance, json.dumps(snapshot, separators=(",", ":")))


def withdraw_snapshot(client: redis.Redis, *, instance: str) -> None:
    client.hdel(STATS_KEY, instance)


def read_snapshots(client: redis.Redis, *, now: float | None = None) -> list[dict]:
    """Every fresh snapshot (published within ``STALE_AFTER_SECONDS``); stale or unreadable
    ones are deleted."""
    now = time.time() if now is None else now
    fresh: list[dict] = []
    stale: list[bytes] = []
    for instance, raw in client.hgetall(STATS_KEY).items():
        try:
            snap = json.loads(raw)
        except ValueError:
            stale.append(instance)
            continue
        if now - snap.get("at", 0) <= STALE_AFTER_SECONDS:
            fresh.append(snap)
        else:
            stale.append(instance)
    if stale:
        client.hdel(STATS_KEY, *stale)
    return fresh


_STREAM_COUNTERS = (
    ("batches", "kvcache_ingest_batches_total", "Event batches received."),
    ("events", "kvcache_ingest_events_total", "Events decoded."),
    ("blocks_stored", "kvcache_index_admissions_total", "Blocks stored into the index."),
    ("blocks_removed", "kvcache_index_evictions_total", "Blocks removed from the index."),
    ("clears", "kvcache_ingest_all_blocks_cleared_total", "AllBlocksCleared events applied."),
    ("ignored_batches", "kvcache_ingest_ignored_batches_total", "Batches ignored: the pod is disabled."),
    ("orphaned_blocks", "kvcache_ingest_orphaned_blocks_total", "Blocks skipped: parent unknown."),
    ("aligned_blocks", "kvcache_ingest_aligned_blocks_total", "Blocks whose engine hash equalled our key."),
    ("misaligned_blocks", "kvcache_ingest_misaligned_blocks_total", "Blocks whose engine hash differed."),
    ("seq_gaps", "kvcache_ingest_seq_gaps_total", "Times the seq jumped ahead (batches missed live)."),
    ("missed_batches", "kvcache_ingest_missed_batches_total", "Batches missed live, by seq arithmetic."),
    ("restarts", "kvcache_ingest_restarts_total", "Times the seq went backwards (engine restart)."),
    ("replayed_batches", "kvcache_ingest_replayed_batches_total", "Missed batches applied from replay."),
    ("duplicates", "kvcache_ingest_duplicate_batches_total", "Live batches already applied from replay."),
    (
        "lost_state_clears",
        "kvcache_ingest_lost_state_clears_total",
        "Times a pod's blocks were cleared: missed batches could not be replayed.",
    ),
)


def collect_families(snapshots: Iterable[dict], unattributed: dict[str, int]) -> Iterator:
    """Prometheus metric families from stream snapshots (``StreamStats.as_dict`` shape)."""
    snapshots = list(snapshots)
    labels = ["pod", "rank", "model"]
    for attr, name, doc in _STREAM_COUNTERS:
        family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
        for s in snapshots:
            family.add_metric([s["pod"], str(s["rank"]), s["model"]], s.get(attr, 0))  # 0: an older ingest
        yield family
    errors = CounterMetricFamily(
        "kvcache_ingest_decode_errors", "Malformed or skipped input, by reason.", labels=[*labels, "reason"]
    )
    for s in snapshots:
        for reason, n in s["decode_errors"].items():
            errors.add_metric([s["pod"], str(s["rank"]), s["model"], reason], n)
    for reason, n in unattributed.items():
        errors.add_metric(["", "", "", reason], n)
    yield errors
    failed = CounterMetricFamily(
        "kvcache_ingest_replays_failed",
        "Replays that could not cover missed batches, by reason.",
        labels=[*labels, "reason"],
    )
    for s in snapshots:
        for reason, n in s.get("replay_failures", {}).items():
            failed.add_metric([s["pod"], str(s["rank"]), s["model"], reason], n)
    yield failed
    resyncing = GaugeMetricFamily(
        "kvcache_ingest_pod_resyncing",
        "1 while a pod's lost state is cleared and it has not stored blocks since.",
        labels=labels,
    )
    for s in snapshots:
        resyncing.add_metric([s["pod"], str(s["rank"]), s["model"]], 1.0 if s.get("resyncing") else 0.0)
    yield resyncing
    lag = GaugeMetricFamily(
        "kvcache_ingest_lag_seconds", "Receive time minus batch timestamp.", labels=labels
    )
    age = GaugeMetricFamily(
        "kvcache_ingest_last_event_age_seconds", "Seconds since the last batch.", labels=labels
    )
    now = time.time()
    for s in snapshots:
        lag.add_metric([s["pod"], str(s["rank"]), s["model"]], s["lag_seconds"])
        age.add_metric([s["pod"], str(s["rank"]), s["model"]], max(0.0, now - s["last_event_at"]))
    yield lag
    yield age
