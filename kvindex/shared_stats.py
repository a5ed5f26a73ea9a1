"""The stream counters of the ingest processes as the other processes see them, the web's scoring
counters beside them, and the fleet's history that ingest records from both for the dashboard.

Each ingest process writes its snapshot (``ingest.stats.IngestStats.snapshot``) as JSON into the
HASH ``kv:ingest:stats`` under its own instance id, once a second; readers merge the snapshots
that are fresh. The web process turns them into ``/metrics`` (``collect_families``), the pods API
and the dashboard. The format lives here, below both ``ingest`` (the writer) and the web (the
readers), so neither reaches into the other.

Redis layout of the rest (every value JSON):

    kv:web:scoring   HASH    source -> {"at", "requests", "hits"}: cumulative scoring counters,
                             "web:<host>:<pid>" per web process, "gateway:<url>" per gateway
                             (``dashboard.traffic`` publishes them once a second)
    kv:history:1s    STREAM  one point a second, the last 600 (10 minutes)
    kv:history:10s   STREAM  one point every 10 s, the last 8640 (24 hours)

A history point is one stream entry whose ID is the start of the step it was recorded in (whole
seconds, a multiple of the level's step: ``<unix ms>-0``), and whose field ``p`` is
``{"blocks", "events_per_s", "score_requests_per_s", "hit_rate", "pods": {pod: [blocks,
stored_per_s, removed_per_s, events_per_s]}}``: block counts then, rates over about the step
before (null when unknown), for the ``HISTORY_PODS`` pods holding the most blocks. Redis refuses
an entry whose ID is not above the last one, so an interval has one point however many ingest
processes record it (``ingest.history``), and ``XADD ... MAXLEN`` keeps each stream at its length
whatever the uptime: 9,240 points of ~130 bytes plus the pod's name and ~30 bytes per pod
(measured with ``MEMORY USAGE``: 8 pods named ``sim-<i>``: 3.5 MB; 64 pods with 11-character
names: 24 MB; 64 with 36-character names: 39 MB; ``HISTORY_PODS`` caps it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

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


def read_snapshots(
    client: redis.Redis, *, now: float | None = None, besides: str | None = None
) -> list[dict]:
    """Every fresh snapshot (published within ``STALE_AFTER_SECONDS``); stale or unreadable
    ones are deleted. ``besides``: an instance whose snapshot the caller has at hand (an ingest
    process's own), not read back: with thousands of streams it is megabytes to fetch and decode
    each second (4,376 streams: 2 MB)."""
    return list(_read_fresh(client, STATS_KEY, now=now, besides=besides).values())


def _read_fresh(
    client: redis.Redis, key: str, *, now: float | None, besides: str | None = None
) -> dict[str, dict]:
    """The JSON values of the HASH ``key`` with an ``at`` within ``STALE_AFTER_SECONDS`` of
    ``now``, by field, but the field ``besides``; the others are deleted."""
    now = time.time() if now is None else now
    fresh: dict[str, dict] = {}
    stale: list[bytes] = []
    if besides is None:
        values = client.hgetall(key).items()
    else:
        fields = [field for field in client.hkeys(key) if field != besides.encode()]
        values = zip(fields, client.hmget(key, fields) if fields else (), strict=True)
    for field, raw in values:
        if raw is None:  # deleted since the fields were listed
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            stale.append(field)
            continue
        if now - value.get("at", 0) <= STALE_AFTER_SECONDS:
            fresh[field.decode()] = value
        else:
            stale.append(field)
    if stale:
        client.hdel(key, *stale)
    return fresh


SCORING_KEY = "kv:web:scoring"


def publish_scoring(
    client: redis.Redis, *, source: str, at: float, requests: float, hits: float | None
) -> None:
    """``source``'s cumulative scoring counters as of ``at``: requests scored or routed, and those
    that found a cached prefix (None: the source does not count them)."""
    value = {"at": at, "requests": requests, "hits": hits}
    client.hset(SCORING_KEY, source, json.dumps(value, separators=(",", ":")))


def read_scoring(client: redis.Redis, *, now: float | None = None) -> dict[str, dict]:
    """Every fresh ``publish_scoring`` value, by source; stale or unreadable ones are deleted."""
    return _read_fresh(client, SCORING_KEY, now=now)


@dataclass(frozen=True, slots=True)
class HistoryLevel:
    """One resolution of the fleet's history: a point every ``step`` seconds, the last
    ``length`` kept (the STREAM ``key``)."""

    step: int
    length: int

    @property
    def key(self) -> str:
        return f"kv:history:{self.step}s"

    @property
    def seconds(self) -> int:
        return self.step * self.length


HISTORY_LEVELS = (HistoryLevel(step=1, length=600), HistoryLevel(step=10, length=8640))
"""Finest first: 10 minutes at 1 s, 24 hours at 10 s."""

HISTORY_PODS = 64
"""Pods a history point carries at most: those holding the most blocks (the bound on its size)."""


def history_level(seconds: float) -> HistoryLevel:
    """The finest level reaching ``seconds`` back (the coarsest when none does)."""
    return next((level for level in HISTORY_LEVELS if level.seconds >= seconds), HISTORY_LEVELS[-1])


def record_point(client: redis.Redis, level: HistoryLevel, *, t: int, point: dict) -> bool:
    """Append ``point`` as ``level``'s point for the interval starting at ``t`` (unix seconds, a
    multiple of its step) and trim the stream to ``level.length`` points. False when another
    writer was first: Redis refuses an entry ID not above the stream's last."""
    fields = {"p": json.dumps(point, separators=(",", ":"))}
    try:
        client.xadd(level.key, fields, id=f"{t * 1000}-0", maxlen=level.length, approximate=False)
    except redis.ResponseError as e:
        if "equal or smaller" not in str(e):
            raise
        return False
    return True


def read_history(client: redis.Redis, level: HistoryLevel, *, after: float) -> list[dict]:
    """``level``'s points of the intervals starting after ``after`` (unix seconds), oldest first,
    each ``{"t": start, **point}``."""
    points = []
    for entry_id, fields in client.xrange(level.key, min=int(after * 1000) + 1, max="+"):
        try:
            point = json.loads(fields[b"p"])
        except (KeyError, ValueError):
            continue
        points.append({"t": int(entry_id.partition(b"-")[0]) / 1000, **point})
    return points


DECODE_ERROR_REASONS = (
    # Decoding (``ingest.events.REASONS``), then what the applier refuses in a decoded event.
    *("frames", "topic", "seq", "msgpack", "batch", "event", "unknown_tag", "field", "too_large"),
    *("too_many_events", "too_many_blocks", "too_many_pods", "unregistered_pod", "too_many_models"),
    *("too_many_ranks", "token_count", "rechunk_extras"),
)
"""Every reason ``kvcache_ingest_decode_errors_total`` counts. Each is exported from 0, for every
stream and for input no pod can be named for: a counter that first appeared at its first error
would hide that error from ``increase()`` (and from the decode-error alert)."""

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


def _from_zero(counts: dict[str, int]) -> Iterator[tuple[str, int]]:
    """Every known reason with its count (0 when none yet), then any other reason counted."""
    for reason in DECODE_ERROR_REASONS:
        yield reason, counts.get(reason, 0)
    for reason, n in counts.items():
        if reason not in DECODE_ERROR_REASONS:
            yield reason, n


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
        stream = [s["pod"], str(s["rank"]), s["model"]]
        for reason, n in _from_zero(s["decode_errors"]):
            errors.add_metric([*stream, reason], n)
    for reason, n in _from_zero(unattributed):
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
