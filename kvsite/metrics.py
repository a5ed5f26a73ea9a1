"""Prometheus metrics of the web process beside the scoring ones (``scoring.fastpath.metrics``):
the live state read at scrape time, and the ``/metrics`` view that serves them all.

Live state: ``kvcache_pod_blocks{pod,model,tier}``, ``kvcache_pods{state}`` (registered pods by
state: active, idle, stale, down, disabled), ``kvcache_{index,ingest_stats,registry}_up``, and the
ingest processes' counters (``kvcache_index_admissions_total``, ``kvcache_ingest_*``...) read from
their snapshots in Redis. With several web workers (``manage.py serve`` sets
``PROMETHEUS_MULTIPROC_DIR``) every worker's counters are summed, whichever worker is scraped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvindex import IndexUnavailable
from kvindex.kv_cache_groups import is_group_holder
from kvindex.shared_stats import collect_families
from registry import runtime, selectors


class LiveStateCollector(Collector):
    """At scrape time: per-pod block counts from the index, registered pods by state from the
    registry, and the ingest processes' counters from their snapshots in Redis. A source that
    cannot be read is reported as down (its ``_up`` gauge is 0) and its families are left out,
    never the whole scrape failed."""

    def collect(self) -> Iterator:
        index_up = GaugeMetricFamily("kvcache_index_up", "1 when the KV-block index answered this scrape.")
        blocks = GaugeMetricFamily(
            "kvcache_pod_blocks",
            "Blocks held per pod (or data-parallel rank), model and tier; a hybrid model's blocks once.",
            labels=["pod", "model", "tier"],
        )
        try:
            rows = runtime.get_index().pod_blocks()
        except IndexUnavailable:
            index_up.add_metric([], 0)
        else:
            index_up.add_metric([], 1)
            for row in rows:
                if is_group_holder(row.pod):
                    continue  # a hybrid model's other KV-cache groups repeat group 0's blocks
                for tier, n in sorted(row.blocks_by_tier.items()):
                    blocks.add_metric([row.pod, row.model, tier], n)
        yield index_up
        yield blocks
        resyncing = GaugeMetricFamily(
            "kvcache_index_resyncing",
            "1 while ingest rebuilds a model's index data after the index lost it.",
            labels=["model"],
        )
        try:
            lost = set(runtime.resyncing_models())
        except IndexUnavailable:
            pass
        else:
            for model in sorted(runtime.service_config().pod_models):
                resyncing.add_metric([model], 1 if model in lost else 0)
        yield resyncing
        variants = GaugeMetricFamily(
            "kvcache_kv_cache_group_variants",
            "How many different lists of KV-cache groups a model's pods described in their events: "
            "more than 1, they disagree (each pod is scored over its own, unless the model config "
            "sets them).",
            labels=["model"],
        )
        try:
            described = runtime.service_config().kv_cache_group_variants()
        except DatabaseError:
            described = {}
        for model, n in sorted(described.items()):
            variants.add_metric([model], n)
        yield variants

        snapshots = selectors.ingest_snapshots()
        stats_up = GaugeMetricFamily(
            "kvcache_ingest_stats_up", "1 when the ingest processes' stats could be read from Redis."
        )
        stats_up.add_metric([], 0 if snapshots is None else 1)
        yield stats_up
        yield from self._pods_by_state(snapshots)
        if snapshots is None:
            return
        yield from collect_families(
            selectors.merge_streams(snapshots), selectors.merge_unattributed_errors(snapshots)
        )
        queue_full = CounterMetricFamily(
            "kvcache_ingest_queue_full",
            "Times an ingest worker queue was full, summed over ingest processes.",
            labels=["worker"],
        )
        by_worker: dict[str, int] = {}
        for snapshot in snapshots:
            for worker, n in snapshot.get("queue_full", {}).items():
                by_worker[worker] = by_worker.get(worker, 0) + n
        for worker, n in sorted(by_worker.items()):
            queue_full.add_metric([worker], n)
        yield queue_full

    def _pods_by_state(self, snapshots: list[dict] | None) -> Iterator:
        """``kvcache_pods{state}`` (``registry.liveness.pod_state``) from the registry, and
        ``kvcache_registry_up``."""
        registry_up = GaugeMetricFamily("kvcache_registry_up", "1 when the pod registry could be read.")
        pods = GaugeMetricFamily(
            "kvcache_pods",
            "Registered pods by state: active, idle, stale, down (the liveness prober finds /health "
            "failing) or disabled.",
            labels=["state"],
        )
        try:
            counts = selectors.pod_state_counts(snapshots)
        except DatabaseError:
            registry_up.add_metric([], 0)
        else:
            registry_up.add_metric([], 1)
            for state, n in counts.items():
                pods.add_metric([state], n)
        yield registry_up
        yield pods

    def describe(self) -> list:
        # Nothing to declare up front: registering must not read the index or Redis.
        return []


LIVE_STATE = LiveStateCollector()
REGISTRY.register(LIVE_STATE)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``/metrics``: this process's registry, or every worker's when several serve."""
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(LIVE_STATE)
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
