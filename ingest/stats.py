"""Counters of the event stream, per pod and data-parallel rank, and their export.

One set of plain counters is the truth: workers bump ints on the hot path (each stream is only
ever written by the one worker its pod hashes to), and readers take snapshots: the Prometheus
collector at scrape time, and the stats publisher that shares them with the web process.

With worker processes (``ingest --processes N``) each process counts in its own ``IngestStats``
and ships what changed (``StatsShipper``) every ``ingest.processes.STATS_SECONDS``; the main
process adds it up (``merge_stats``), so what it reads lags the workers by that much.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Container, Iterator
from dataclasses import asdict, dataclass, field, fields
from itertools import islice

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvindex.shared_stats import collect_families

MAX_VISIBLE_SECONDS = 24 * 3600.0
"""Event-to-visible latencies past this (either way) are clock disagreements, not latencies."""


@dataclass(slots=True)
class StreamStats:
    """What one (pod, data-parallel rank) sent us and what became of it."""

    pod: str
    rank: int
    model: str = ""
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    ignored_batches: int = 0
    orphaned_blocks: int = 0
    aligned_blocks: int = 0
    misaligned_blocks: int = 0
    seq_gaps: int = 0
    missed_batches: int = 0
    restarts: int = 0
    replayed_batches: int = 0
    duplicates: int = 0
    lost_state_clears: int = 0
    resyncing: bool = False  # its state was lost and cleared; False again once it stores
    decode_errors: Counter = field(default_factory=Counter)
    replay_failures: Counter = field(default_factory=Counter)  # by reason
    last_seq: int | None = None
    first_event_at: float = 0.0
    last_event_at: float = 0.0
    lag_seconds: float = 0.0

    @property
    def hash_alignment(self) -> float | None:
        """Share of judged blocks whose engine hash equalled our block key (None: none yet). A
        block is judged unless it, or a block before it in its chain, has extra keys (a LoRA, a
        cache salt, an image: vLLM 0.33 hashes those tagged, so they never equal our keys), or it
        was re-cut from pages of another size, or reported again (``ingest.applier``)."""
        n = self.aligned_blocks + self.misaligned_blocks
        return self.aligned_blocks / n if n else None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["decode_errors"] = dict(self.decode_errors)
        out["replay_failures"] = dict(self.replay_failures)
        out["hash_alignment"] = self.hash_alignment
        return out


VISIBLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets (seconds) of event-to-visible-in-index latency."""


class IngestStats:
    """All streams, plus errors that cannot be pinned on a pod (bad topic, bad frames), plus the
    event-to-visible latency: from the batch's timestamp (set by the engine when it published)
    to the moment its last update was applied to the index."""

    def __init__(self, *, latency_samples: int = 65536) -> None:
        self._streams: dict[tuple[str, int], StreamStats] = {}
        self._lock = threading.Lock()
        self.unattributed_errors: Counter = Counter()
        self.queue_full: Counter = Counter()
        self.index_losses = 0  # times a model's index data was found lost (epoch marker gone)
        self.pods_evicted = 0  # unregistered pods that gave their place to a new one (ingest.pool.Admission)
        self._evicted: list[str] = []  # those pods, until housekeeping takes them (``take_evicted``)
        self.started_at = time.time()
        self.recent_visible_latencies: deque[float] = deque(maxlen=latency_samples)
        self.visible_buckets = [0] * (len(VISIBLE_BUCKETS) + 1)
        self.visible_sum = 0.0
        self.learned_groups: dict[tuple[str, str], dict[int, tuple[str, int | None]]] = {}
        """(pod, model) -> group_idx -> (kv_cache_spec_kind, sliding window): what the pod's events
        described. Per pod: what one pod says of its groups is applied to its own scores only."""

    def learn_group(self, pod: str, model: str, group: int, kind: str, sliding_window: int | None) -> None:
        """Record what an event of ``pod`` said of its KV-cache group ``group`` (the last word wins)."""
        groups = self.learned_groups.get((pod, model))
        if groups is None:
            groups = self.learned_groups.setdefault((pod, model), {})
        if groups.get(group) != (kind, sliding_window):
            groups[group] = (kind, sliding_window)

    def observe_visible(self, seconds: float) -> None:
        """Record one batch's event-to-visible latency (called by the worker that applied it).
        An engine clock slightly ahead of ours reads as 0; a latency beyond
        ``MAX_VISIBLE_SECONDS`` either way says the clocks disagree, and is not recorded."""
        if not -MAX_VISIBLE_SECONDS <= seconds <= MAX_VISIBLE_SECONDS:  # also False for NaN
            return
        seconds = max(0.0, seconds)
        self.recent_visible_latencies.append(seconds)
        self.visible_buckets[bisect_left(VISIBLE_BUCKETS, seconds)] += 1
        self.visible_sum += seconds

    def stream(self, pod: str, rank: int, model: str) -> StreamStats:
        key = (pod, rank)
        found = self._streams.get(key)
        if found is None:
            with self._lock:
                found = self._streams.setdefault(
                    key, StreamStats(pod=pod, rank=rank, model=model, first_event_at=time.time())
                )
        found.model = model
        return found

    def streams(self) -> list[StreamStats]:
        with self._lock:
            return sorted(self._streams.values(), key=lambda s: (s.pod, s.rank))

    def forget_pod(self, pod: str) -> None:
        with self._lock:
            for key in [k for k in self._streams if k[0] == pod]:
                del self._streams[key]
            for key in [k for k in list(self.learned_groups) if k[0] == pod]:
                self.learned_groups.pop(key, None)

    def evicted(self, pod: str) -> None:
        """An unregistered pod gave its place: forget its streams, and keep it for ``take_evicted``."""
        self.forget_pod(pod)
        with self._lock:
            self._evicted.append(pod)

    def take_evicted(self) -> list[str]:
        """The pods evicted since the last call (their registry rows and blocks go next)."""
        with self._lock:
            taken, self._evicted = self._evicted, []
        return taken

    def snapshot(self) -> dict:
        """A JSON-able picture of every stream and the process-wide counters."""
        return {
            "at": time.time(),
            "started_at": self.started_at,
            "streams": [s.as_dict() for s in self.streams()],
            "unattributed_errors": dict(self.unattributed_errors),
            "queue_full": {str(k): v for k, v in self.queue_full.items()},
            "index_losses": self.index_losses,
            "pods_evicted": self.pods_evicted,
            "learned_groups": [
                [pod, model, {str(g): list(spec) for g, spec in list(groups.items())}]
                for (pod, model), groups in list(self.learned_groups.items())
            ],
        }


class IngestStatsCollector(Collector):
    """Exposes a live ``IngestStats`` to prometheus_client at scrape time."""

    def __init__(self, stats: IngestStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator:
        snap = self.stats.snapshot()
        yield from collect_families(snap["streams"], snap["unattributed_errors"])
        full = CounterMetricFamily(
            "kvcache_ingest_queue_full",
            "Times a worker queue was full (the worker fell behind).",
            labels=["worker"],
        )
        for worker, n in snap["queue_full"].items():
            full.add_metric([worker], n)
        yield full
        losses = CounterMetricFamily(
            "kvcache_ingest_index_losses",
            "Times a model's index data was found lost (its epoch marker vanished) and rebuilt.",
        )
        losses.add_metric([], snap["index_losses"])
        yield losses
        evicted = CounterMetricFamily(
            "kvcache_ingest_pods_evicted",
            "Unregistered pods that gave their place to a new one, quiet for "
            "KVCACHE_INGEST_POD_IDLE_SECONDS while KVCACHE_INGEST_MAX_PODS were admitted.",
        )
        evicted.add_metric([], snap["pods_evicted"])
        yield evicted
        visible = HistogramMetricFamily(
            "kvcache_ingest_event_to_index_seconds", "From the batch timestamp to applied in the index."
        )
        counts = list(self.stats.visible_buckets)
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, VISIBLE_BUCKETS), "+Inf"], counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        visible.add_metric([], buckets, self.stats.visible_sum)
        yield visible


# --- The stats of worker processes (``ingest --processes N``) ---------------------------------

STREAM_COUNTERS = tuple(f.name for f in fields(StreamStats) if f.type == "int" and f.name != "rank")
"""A stream's int fields, which only grow: shipped from a worker process as differences, added up."""
STREAM_TALLIES = tuple(f.name for f in fields(StreamStats) if f.type == "Counter")
"""Its counters by reason, shipped and added up the same way."""
STREAM_GAUGES = tuple(
    f.name for f in fields(StreamStats) if f.name not in ("pod", "rank", *STREAM_COUNTERS, *STREAM_TALLIES)
)
"""The rest (model, last seq, times, lag, resyncing): the latest value wins (``first_event_at``:
the earliest)."""


class StatsShipper:
    """A worker process's side of ``ingest --processes N``: what changed in its ``IngestStats``
    since the last ``take``, as a picklable delta that ``merge_stats`` adds into the main
    process's stats. Counters travel as differences, so the merged figures keep growing when a
    worker process is replaced (its successor counts from 0); what a process counted after its
    last delta dies with it. Only ``take`` reads the stats it was given; workers write them."""

    def __init__(self, stats: IngestStats) -> None:
        self.stats = stats
        self._shipped: dict[tuple[str, int], tuple] = {}  # (pod, rank) -> (stream, counts, tallies, gauges)
        self._observed = 0  # latencies observed when last taken
        self._buckets = [0] * len(stats.visible_buckets)
        self._visible_sum = 0.0
        self._queue_full: dict = {}
        self._groups: dict = {}

    def take(self) -> dict:
        streams = []
        seen = set()
        for s in self.stats.streams():
            key = (s.pod, s.rank)
            seen.add(key)
            counts = tuple(getattr(s, f) for f in STREAM_COUNTERS)
            tallies = tuple(dict(getattr(s, f)) for f in STREAM_TALLIES)
            gauges = tuple(getattr(s, f) for f in STREAM_GAUGES)
            before = self._shipped.get(key)
            if before is not None and before[0] is s and before[1:] == (counts, tallies, gauges):
                continue
            self._shipped[key] = (s, counts, tallies, gauges)
            if before is None or before[0] is not s:  # new, or forgotten and opened again
                before = (s, (0,) * len(counts), tuple({} for _ in tallies), ())
            streams.append(
                (
                    s.pod,
                    s.rank,
                    tuple(new - old for new, old in zip(counts, before[1], strict=True)),
                    tuple(
                        {k: n - old.get(k, 0) for k, n in new.items() if n != old.get(k, 0)}
                        for new, old in zip(tallies, before[2], strict=True)
                    ),
                    gauges,
                )
            )
        if len(self._shipped) > len(seen):
            self._shipped = {k: v for k, v in self._shipped.items() if k in seen}
        buckets = list(self.stats.visible_buckets)
        observed = sum(buckets)
        recent = self.stats.recent_visible_latencies
        # The newest samples, taken from the right: workers may append meanwhile.
        samples = list(islice(reversed(recent), min(observed - self._observed, recent.maxlen or 0)))[::-1]
        visible = (
            [new - old for new, old in zip(buckets, self._buckets, strict=True)],
            self.stats.visible_sum - self._visible_sum,
            samples,
        )
        self._observed, self._buckets, self._visible_sum = observed, buckets, self.stats.visible_sum
        queue_full = dict(self.stats.queue_full)
        full = {k: n - self._queue_full.get(k, 0) for k, n in queue_full.items()}
        self._queue_full = queue_full
        groups = {key: dict(g) for key, g in list(self.stats.learned_groups.items())}
        changed_groups = (
            [(pod, model, g) for (pod, model), g in groups.items()] if groups != self._groups else None
        )
        self._groups = groups
        return {
            "streams": streams,
            "visible": visible,
            "queue_full": {k: n for k, n in full.items() if n},
            "learned_groups": changed_groups,
        }


def merge_stats(
    stats: IngestStats, delta: dict, *, queue_prefix: str, skip_pods: Container[str] = ()
) -> None:
    """Add a worker process's ``StatsShipper.take`` into ``stats`` (the main process's; one
    thread merges). Its queue_full keys are prefixed with ``queue_prefix`` (the process), and
    the streams of ``skip_pods`` (forgotten after the worker took the delta) are left out."""
    for pod, rank, counts, tallies, gauges in delta["streams"]:
        if pod in skip_pods:
            continue
        values = dict(zip(STREAM_GAUGES, gauges, strict=True))
        stream = stats.stream(pod, rank, values["model"])
        for name, n in zip(STREAM_COUNTERS, counts, strict=True):
            if n:
                setattr(stream, name, getattr(stream, name) + n)
        for name, added in zip(STREAM_TALLIES, tallies, strict=True):
            if added:
                getattr(stream, name).update(added)
        first = values.pop("first_event_at", None)
        if first:
            stream.first_event_at = min(stream.first_event_at, first) if stream.first_event_at else first
        for name, value in values.items():
            setattr(stream, name, value)
    buckets, visible_sum, samples = delta["visible"]
    for i, n in enumerate(buckets):
        stats.visible_buckets[i] += n
    stats.visible_sum += visible_sum
    stats.recent_visible_latencies.extend(samples)
    for key, n in delta["queue_full"].items():
        stats.queue_full[f"{queue_prefix}{key}"] += n
    for pod, model, groups in delta["learned_groups"] or ():
        if pod in skip_pods:
            continue
        for group, (kind, sliding_window) in groups.items():
            stats.learn_group(pod, model, group, kind, sliding_window)
