"""The fleet's history for the dashboard charts, recorded by ingest whether or not anyone looks.

Once a second the ``ingest`` command's housekeeping hands ``HistoryRecorder.record`` what every
process has shared in Redis (the ingest snapshots, the web's and the gateways' scoring counters,
``kvindex.shared_stats``) and the index's block counts; at the start of each level's interval
(``kvindex.shared_stats.HISTORY_LEVELS``: every second, every 10 s) it appends one point to that
level's stream. Every ingest process records the same fleet-wide point from the same shared
inputs, and Redis keeps the first one of an interval only (``record_point``): with several ingest
processes nothing is counted twice, and the history goes on while one of them is up.

Rates are never sampled, only derived, as in ``dashboard.fleet``: each source (an ingest process,
a web process, a gateway) publishes cumulative counters at its own pace, and its rate is their
growth between two of its publications at least half a step apart over the time between them.
No Django import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis

from kvindex.base import PodBlocks
from kvindex.kv_cache_groups import is_group_holder
from kvindex.shared_stats import HISTORY_LEVELS, HISTORY_PODS, HistoryLevel, record_point
from registry.config import owner_pod

_POD_COUNTERS = ("blocks_stored", "blocks_removed", "events")


class CounterRates:
    """Per-second rates of cumulative counters published by several sources, summed over them.

    A source's rates are its counters' growth between two of its publications at least
    ``min_seconds`` apart (a counter that went down restarted from zero); a source that has not
    published anew keeps its last rates for ``keep_seconds``; a new source has none until its
    second publication."""

    def __init__(self, *, min_seconds: float, keep_seconds: float) -> None:
        self.min_seconds = min_seconds
        self.keep_seconds = keep_seconds
        self._base: dict[str, tuple[float, Mapping]] = {}  # source -> (at, counters) rates start from
        self._rates: dict[str, dict] = {}

    def update(self, sources: Mapping[str, tuple[float, Mapping]], *, now: float) -> dict | None:
        """Take in each source's latest ``(at, counters)``; returns the rates by counter, None
        while no source has any."""
        for gone in self._base.keys() - sources.keys():
            del self._base[gone]
            self._rates.pop(gone, None)
        for source, (at, counters) in sources.items():
            base = self._base.get(source)
            if base is None:
                self._base[source] = (at, counters)
                continue
            seconds = at - base[0]
            if seconds >= self.min_seconds:
                self._rates[source] = {
                    name: (n - base[1].get(name, 0) if n >= base[1].get(name, 0) else n) / seconds
                    for name, n in counters.items()
                }
                self._base[source] = (at, counters)
            elif now - base[0] > self.keep_seconds:
                self._rates.pop(source, None)
        if not self._rates:
            return None
        total: dict = {}
        for rates in self._rates.values():
            for name, rate in rates.items():
                total[name] = total.get(name, 0.0) + rate
        return total


def ingest_counters(snapshot: Mapping) -> dict[tuple[str, str], int]:
    """``(pod, counter) -> n`` of one ingest snapshot: blocks stored and removed and events,
    summed over each pod's data-parallel ranks."""
    out: dict[tuple[str, str], int] = {}
    for stream in snapshot.get("streams", ()):
        for name in _POD_COUNTERS:
            key = (stream["pod"], name)
            out[key] = out.get(key, 0) + stream.get(name, 0)
    return out


def blocks_by_pod(rows: Iterable[PodBlocks]) -> dict[str, int]:
    """Blocks each pod holds (``index.pod_blocks()``), summed over models, tiers and ranks (a
    hybrid model's blocks once: its other KV-cache groups left out)."""
    out: dict[str, int] = {}
    for row in rows:
        if is_group_holder(row.pod):
            continue
        pod = owner_pod(row.pod)
        out[pod] = out.get(pod, 0) + sum(row.blocks_by_tier.values())
    return out


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


@dataclass(slots=True)
class _Level:
    level: HistoryLevel
    ingest: CounterRates
    scoring: CounterRates
    interval: int | None = None  # the last interval recorded (its start, unix seconds)


class HistoryRecorder:
    """One per ingest process: the rate state of every level. ``pods``: the most a point carries."""

    def __init__(self, *, levels: Iterable[HistoryLevel] = HISTORY_LEVELS, pods: int = HISTORY_PODS) -> None:
        self.pods = pods
        self._levels = [
            _Level(
                level,
                CounterRates(min_seconds=level.step / 2, keep_seconds=max(3.0, 3 * level.step)),
                CounterRates(min_seconds=level.step / 2, keep_seconds=max(3.0, 3 * level.step)),
            )
            for level in levels
        ]

    def record(
        self,
        client: redis.Redis,
        *,
        now: float,
        snapshots: Iterable[Mapping],
        blocks: Mapping[str, int] | None,
        scoring: Mapping[str, Mapping],
    ) -> list[int]:
        """Record a point for each level whose interval began since the last call: ``snapshots``
        are the fresh ingest snapshots (``read_snapshots``), ``blocks`` the blocks per pod (None:
        the index did not answer), ``scoring`` the fresh scoring counters (``read_scoring``).
        Returns the steps of the levels this call's points went in (another process may have
        recorded an interval first)."""
        ingest = {
            s.get("instance") or f"started-at:{s.get('started_at')}": (s.get("at", 0.0), ingest_counters(s))
            for s in snapshots
        }
        score = {
            source: (c.get("at", 0.0), {k: c[k] for k in ("requests", "hits") if c.get(k) is not None})
            for source, c in scoring.items()
        }
        written = []
        for state in self._levels:
            step = state.level.step
            interval = int(now // step) * step
            if interval == state.interval:
                continue
            state.interval = interval
            point = self._point(
                blocks=blocks,
                streaming={pod for _, counters in ingest.values() for pod, _ in counters},
                pod_rates=state.ingest.update(ingest, now=now),
                score_rates=state.scoring.update(score, now=now),
            )
            if record_point(client, state.level, t=interval, point=point):
                written.append(step)
        return written

    def _point(
        self,
        *,
        blocks: Mapping[str, int] | None,
        streaming: set[str],
        pod_rates: dict | None,
        score_rates: dict | None,
    ) -> dict:
        """One point (``kvindex.shared_stats``): of every pod the index or an ingest process knows,
        the ``pods`` holding the most blocks."""
        rates = pod_rates or {}
        held = blocks or {}
        pods = sorted(held.keys() | streaming, key=lambda p: (-held.get(p, 0), p))
        requests = score_rates.get("requests") if score_rates else None
        hits = score_rates.get("hits") if score_rates else None
        return {
            "blocks": sum(held.values()) if blocks is not None else None,
            "events_per_s": _round(sum(r for (_, name), r in rates.items() if name == "events"))
            if pod_rates is not None
            else None,
            "score_requests_per_s": _round(requests),
            # A gateway counts a hit when the answer starts, the request when it ends: cap at 1.
            "hit_rate": _round(min(1.0, hits / requests), 4) if hits is not None and requests else None,
            "pods": {
                pod: [
                    held.get(pod, 0) if blocks is not None else None,
                    *(_round(rates.get((pod, name))) for name in _POD_COUNTERS),
                ]
                for pod in pods[: self.pods]
            },
        }
