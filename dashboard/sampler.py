"""This web process's running picture of the fleet: the deliberate, named cache behind every
open dashboard.

Ingest snapshots arrive as channel-layer messages (each ingest process sends one a second to
``settings.KVCACHE_STATS_GROUP``) through whichever dashboard consumer got them first; when the
group has been silent for a while (this process just started, or the channel layer is down) the
same snapshots are read from Redis instead. Frames (rows, totals) are built at most once per
``min_interval`` however many dashboards are open, and each build scrapes the gateways
(``KVCACHE_GATEWAY_URLS``), keeping each one's scrapes of the last ``gateway_window`` seconds for
their recent numbers. Activity logs and gateway scrapes live in memory: they cover the time since
this process first served a dashboard. The charts' history is not here: ingest records it in
Redis (``ingest.history``), where every web process reads the same.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from django.conf import settings
from prometheus_client import REGISTRY, CollectorRegistry

from dashboard import selectors
from dashboard.fleet import (
    PodCounters,
    PodRates,
    RegistryPod,
    ScoreCounters,
    activity_between,
    fleet_totals,
    pod_counters,
    pod_rows,
    rates_between,
)
from dashboard.gateways import GatewayScrape, gateway_row
from kvindex.base import PodBlocks
from kvindex.shared_stats import STALE_AFTER_SECONDS

LOG_SIZE = 50
"""Activity entries kept per pod (one per snapshot in which the pod's counters moved)."""

GATEWAY_WINDOW_SECONDS = 60.0
"""How far back a gateway's recent numbers (rates, P/D decisions per second, hit rate, TTFT,
overhead and P/D step quantiles) reach."""


@dataclass(frozen=True, slots=True)
class _Instance:
    """The latest snapshot of one ingest process, digested."""

    at: float
    counters: dict[str, PodCounters]
    rates: dict[str, PodRates]
    unattributed_errors: int


def instance_of(snapshot: dict) -> str:
    """Which ingest process a snapshot is from (older processes did not say: their start time)."""
    return snapshot.get("instance") or f"started-at:{snapshot.get('started_at')}"


class FleetSampler:
    """``min_interval``: a frame younger than this is reused. ``stale_after``: seconds without an
    event before a pod is no longer active.
    ``group_silence``: seconds without a channel-layer delivery before Redis is read instead.
    ``metrics``: where the scoring counters are read (``selectors.scoring_counters``): every
    web worker's in production (``selectors.all_workers_metrics``).
    ``gateway_window``: seconds of gateway scrapes kept for their recent numbers."""

    def __init__(
        self,
        *,
        min_interval: float,
        stale_after: float,
        group_silence: float = 3.0,
        metrics: CollectorRegistry = REGISTRY,
        gateway_window: float = GATEWAY_WINDOW_SECONDS,
    ) -> None:
        self.min_interval = min_interval
        self.stale_after = stale_after
        self.group_silence = group_silence
        self.metrics = metrics
        self.gateway_window = gateway_window
        # Rates of a process that stopped publishing are no longer current.
        self.rates_fresh_for = max(3.0, 3 * min_interval)
        self._lock = threading.Lock()  # guards the state below (observe runs on the event loop)
        self._build_lock = threading.Lock()  # one frame build at a time
        self._instances: dict[str, _Instance] = {}
        self._logs: dict[str, deque[dict]] = {}
        self._heard_at = float("-inf")  # monotonic time of the last channel-layer delivery
        self._frame: dict | None = None
        self._frame_built_at = float("-inf")
        self._score: tuple[float, ScoreCounters] | None = None
        self._gateway_scrapes: dict[str, deque[GatewayScrape]] = {}  # url -> the window's, oldest first

    # --- input ---------------------------------------------------------------------------------

    def observe(self, snapshot: dict, *, via_group: bool = True) -> bool:
        """Take in one ingest snapshot (``IngestStats.snapshot`` shape). Every consumer hands
        over the same group message, so only a snapshot newer than the process's last counts;
        returns whether this one did. The second snapshot of a process on gives its rates and
        its pods' activity log entries."""
        instance, at = instance_of(snapshot), snapshot.get("at", 0.0)
        with self._lock:
            if via_group:
                self._heard_at = time.monotonic()
            previous = self._instances.get(instance)
            if previous is not None and at <= previous.at:
                return False
            counters = pod_counters(snapshot.get("streams", ()))
            rates: dict[str, PodRates] = {}
            if previous is not None:
                rates = rates_between(previous.counters, counters, seconds=at - previous.at)
                for entry in activity_between(previous.counters, counters, at=at):
                    self._logs.setdefault(entry["pod"], deque(maxlen=LOG_SIZE)).append(entry)
            self._instances[instance] = _Instance(
                at=at,
                counters=counters,
                rates=rates,
                unattributed_errors=sum(snapshot.get("unattributed_errors", {}).values()),
            )
        return True

    # --- output --------------------------------------------------------------------------------

    def frame(self) -> dict:
        """The current fleet: ``{"at", "totals", "pods": [row, ...], "gateways": [row, ...]}``
        (``fleet.pod_rows``, ``fleet.fleet_totals``, ``gateways.gateway_row`` in the order of
        ``KVCACHE_GATEWAY_URLS``), rebuilt when older than ``min_interval``. Blocking I/O (the
        registry, the index, maybe Redis, the gateways): call it from a thread."""
        with self._build_lock:
            if self._frame is not None and time.monotonic() - self._frame_built_at < self.min_interval:
                return self._frame
            if time.monotonic() - self._heard_at > self.group_silence:
                for snapshot in selectors.shared_snapshots():
                    self.observe(snapshot, via_group=False)
            registry = selectors.registry_pods()
            blocks = selectors.index_blocks()
            resyncing = selectors.index_resyncing() if blocks is not None else []
            gateway_scrapes = selectors.scrape_gateways()
            score_counters = selectors.routing_counters(self.metrics, gateways=gateway_scrapes)
            now = time.time()
            with self._lock:
                frame = self._build(
                    now=now,
                    registry=registry,
                    blocks=blocks,
                    score_counters=score_counters,
                    resyncing=resyncing,
                    gateway_scrapes=gateway_scrapes,
                )
            self._frame, self._frame_built_at = frame, time.monotonic()
            return frame

    def _build(
        self,
        *,
        now: float,
        registry: list[RegistryPod],
        blocks: list[PodBlocks] | None,
        score_counters: ScoreCounters | None,
        resyncing: list[str] = (),
        gateway_scrapes: list[GatewayScrape] = (),
    ) -> dict:
        for instance, seen in list(self._instances.items()):
            if now - seen.at > STALE_AFTER_SECONDS:
                del self._instances[instance]
        counters: dict[str, PodCounters] = {}
        rates: dict[str, PodRates] = {}
        for seen in self._instances.values():
            rates_current = now - seen.at <= self.rates_fresh_for
            # A pod streams into one ingest process; if two know it, the one that heard it last wins.
            for pod, c in seen.counters.items():
                if pod not in counters or c.last_event_at > counters[pod].last_event_at:
                    counters[pod] = c
                    rates.pop(pod, None)
                    if rates_current and pod in seen.rates:
                        rates[pod] = seen.rates[pod]
        rows = pod_rows(
            now=now,
            registry=registry,
            blocks=blocks or [],
            counters=counters,
            rates=rates,
            stale_after=self.stale_after,
        )
        score = None
        if score_counters is not None:
            if self._score is not None:
                score = score_counters.rates_since(self._score[1], seconds=now - self._score[0])
            self._score = (now, score_counters)
        totals = fleet_totals(
            rows,
            unattributed_errors=sum(i.unattributed_errors for i in self._instances.values()),
            ingest_processes=len(self._instances),
            scoring=score_counters,
            score=score,
            index_available=blocks is not None,
            index_resyncing=resyncing,
        )
        return {"at": now, "totals": totals, "pods": rows, "gateways": self._gateway_rows(gateway_scrapes)}

    def _gateway_rows(self, scrapes: list[GatewayScrape]) -> list[dict]:
        """Each gateway's row from its scrapes of the last ``gateway_window`` seconds, this
        one's included (gateways no longer configured are forgotten)."""
        windows = {}
        for scrape in scrapes:
            window = windows[scrape.url] = self._gateway_scrapes.get(scrape.url, deque())
            window.append(scrape)
            while window[0].at < scrape.at - self.gateway_window:
                window.popleft()
        self._gateway_scrapes = windows
        return [gateway_row(windows[s.url]) for s in scrapes]

    def pod_log(self, pod: str) -> list[dict]:
        """The pod's recent activity, newest first (at most ``LOG_SIZE`` entries)."""
        with self._lock:
            return list(reversed(self._logs.get(pod, ())))


_sampler: FleetSampler | None = None
_sampler_lock = threading.Lock()


def get_sampler() -> FleetSampler:
    """This process's sampler, made from the settings on first use."""
    global _sampler
    with _sampler_lock:
        if _sampler is None:
            _sampler = FleetSampler(
                # A little under the push interval, so that every push of every open dashboard
                # gets a fresh frame while N dashboards still cost one build per interval.
                min_interval=settings.DASHBOARD_PUSH_SECONDS * 0.9,
                stale_after=settings.DASHBOARD_STALE_SECONDS,
                metrics=selectors.all_workers_metrics(),
            )
        return _sampler


def reset_sampler() -> None:
    """Forget everything sampled (tests; settings changed)."""
    global _sampler
    with _sampler_lock:
        _sampler = None
