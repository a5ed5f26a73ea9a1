"""Reads the dashboard makes of the rest of the system: the registry, the index, the ingest
snapshots and the history shared through Redis, the scoring API's Prometheus counters and the
gateways' ``/metrics``. Each returns plain values (``dashboard.fleet`` and ``dashboard.gateways`` types);
none writes. The dashboard's totals count the scoring requests of every worker of ``manage.py serve``
(``all_workers_metrics``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

import httpx
import redis
from django.conf import settings
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from dashboard.fleet import RegistryPod, ScoreCounters
from dashboard.gateways import GatewayScrape, gateway_traffic, parse_gateway_metrics
from kvindex.base import IndexUnavailable, PodBlocks
from kvindex.shared_stats import HistoryLevel, read_history, read_snapshots
from registry.models import Pod
from registry.runtime import get_index, index_is_shared, resyncing_models

log = logging.getLogger(__name__)

SCORE_METRIC_PREFIXES = ("kvcache_score_", "kvcache_scoring_")
"""Where the scoring API's counters are looked for: ``<prefix>...request..._total`` (requests)
and ``<prefix>...hit..._total`` (requests that found a cached prefix), summed over labels."""


def registry_pods() -> list[RegistryPod]:
    """Every registered pod."""
    return [
        RegistryPod(
            pod=p.pod_id,
            model=p.model,
            enabled=p.enabled,
            last_seen=p.last_seen.timestamp() if p.last_seen else None,
            health=p.health,
        )
        for p in Pod.objects.only("pod_id", "model", "enabled", "last_seen", "health")
    ]


def index_blocks() -> list[PodBlocks] | None:
    """Live block counts per (model, holder) from this process's index; None when the index
    cannot be reached (the dashboard says so instead of showing zeros)."""
    try:
        return get_index().pod_blocks()
    except IndexUnavailable:
        return None


def index_resyncing() -> list[str]:
    """The models whose index data ingest is rebuilding after the index lost it (none when the
    index cannot be reached: that is said apart)."""
    try:
        return resyncing_models()
    except IndexUnavailable:
        return []


GATEWAY_SCRAPE_TIMEOUT_SECONDS = 0.5


def scrape_gateways() -> list[GatewayScrape]:
    """One scrape of the ``/metrics`` of each gateway in ``KVCACHE_GATEWAY_URLS``, in that
    order (with the first of ``KVCACHE_API_KEYS``, which the gateways take too). A gateway that
    cannot be reached, answers other than 200 or not with Prometheus text is a scrape without
    counters that says why."""
    keys = settings.KVCACHE_API_KEYS
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    scrapes = []
    for url in settings.KVCACHE_GATEWAY_URLS:
        at, counters, error = time.time(), None, None
        try:
            response = httpx.get(f"{url}/metrics", headers=headers, timeout=GATEWAY_SCRAPE_TIMEOUT_SECONDS)
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        else:
            if response.status_code != 200:
                error = f"/metrics answered HTTP {response.status_code}"
            else:
                try:
                    counters = parse_gateway_metrics(response.text)
                except ValueError as e:
                    error = f"/metrics is not Prometheus text: {e}"
        scrapes.append(GatewayScrape(url=url, at=at, counters=counters, error=error))
    return scrapes


def all_workers_metrics() -> CollectorRegistry:
    """Where the dashboard's totals read the scoring counters: when ``manage.py serve`` runs
    several workers (it sets ``PROMETHEUS_MULTIPROC_DIR``), every worker's, summed from their
    files by prometheus_client's ``MultiProcessCollector`` as ``/metrics`` sums them (a worker that
    exited still counts, so the totals never go back); else this process's registry."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


def routing_counters(
    registry: CollectorRegistry = REGISTRY, *, gateways: Iterable[GatewayScrape] = ()
) -> ScoreCounters | None:
    """The scoring API's counters in ``registry`` and the gateways (their scrapes) together:
    every request a prefix was looked up for, and those that found one."""
    parts = [c for c in (scoring_counters(registry), gateway_traffic(gateways)) if c is not None]
    if not parts:
        return None
    hits = [c.hits for c in parts if c.hits is not None]
    return ScoreCounters(requests=sum(c.requests for c in parts), hits=sum(hits) if hits else None)


def scoring_counters(registry: CollectorRegistry = REGISTRY) -> ScoreCounters | None:
    """Cumulative scoring requests and hits read from ``registry`` (see ``SCORE_METRIC_PREFIXES``):
    this process's with the default registry, every worker's with ``all_workers_metrics()``; None
    while there is no requests counter (the scoring API has not registered it or counted a request,
    or this process does not serve it), ``hits`` None while there is no hits one."""
    requests = hits = None
    for family in registry.collect():
        if not family.name.startswith(SCORE_METRIC_PREFIXES):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if "hit" in sample.name:
                hits = (hits or 0.0) + sample.value
            elif "request" in sample.name:
                requests = (requests or 0.0) + sample.value
    if requests is None:
        return None
    return ScoreCounters(requests=requests, hits=hits)


_redis_clients: dict[str, redis.Redis] = {}
_redis_lock = threading.Lock()


def _redis() -> redis.Redis | None:
    """The client of ``REDIS_URL``; None when the index is not shared through Redis."""
    if not index_is_shared():
        return None
    url = settings.REDIS_URL
    with _redis_lock:
        client = _redis_clients.get(url)
        if client is None:
            client = _redis_clients[url] = redis.Redis.from_url(url, socket_timeout=2.0)
    return client


def shared_snapshots() -> list[dict]:
    """The fresh ingest snapshots every ingest process stores in Redis (``kvindex.shared_stats``);
    empty when the index is not shared through Redis or Redis cannot be reached."""
    if (client := _redis()) is None:
        return []
    try:
        return read_snapshots(client)
    except redis.RedisError as e:
        log.warning("could not read the ingest snapshots from Redis: %s", e)
        return []


def recorded_history(level: HistoryLevel, *, after: float) -> list[dict]:
    """The points of ``level`` that ingest recorded after ``after`` (unix seconds), oldest first
    (``kvindex.shared_stats.read_history``); none when the index is not shared through Redis or
    Redis cannot be reached."""
    if (client := _redis()) is None:
        return []
    try:
        return read_history(client, level, after=after)
    except redis.RedisError as e:
        log.warning("could not read the dashboard history from Redis: %s", e)
        return []
