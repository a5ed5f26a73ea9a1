"""Writes to the registry and the process's handle on the index."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction

from scoring.index import KVIndex, open_index
from scoring.models import Pod

_index: KVIndex | None = None
_index_lock = threading.Lock()


def index_url() -> str:
    backend = settings.KVCACHE_INDEX_BACKEND
    if backend == "memory":
        return "memory://"
    if backend == "redis":
        return settings.REDIS_URL
    raise ValueError(f"KVCACHE_INDEX_BACKEND must be 'redis' or 'memory', not {backend!r}")


def get_index() -> KVIndex:
    """This process's index (one per process; backends are thread-safe)."""
    global _index
    if _index is None:
        with _index_lock:
            if _index is None:
                _index = open_index(index_url())
    return _index


def set_index(index: KVIndex | None) -> None:
    """Replace this process's index (tests, and ``ingest`` sharing its in-memory index)."""
    global _index
    with _index_lock:
        _index = index


def record_pods_seen(seen: Iterable[tuple[str, str, float, float]]) -> int:
    """Upsert ``(pod, model, first_seen, last_seen)`` (unix times) into the registry; returns how
    many pods were new. ``first_seen`` never moves later; ``last_seen`` never moves earlier."""
    rows = {pod: (model, first, last) for pod, model, first, last in seen}
    if not rows:
        return 0
    created = 0
    with transaction.atomic():
        existing = {p.pod_id: p for p in Pod.objects.select_for_update().filter(pod_id__in=rows)}
        changed = []
        for pod_id, (model, first, last) in rows.items():
            first_dt = datetime.fromtimestamp(first, UTC)
            last_dt = datetime.fromtimestamp(last, UTC)
            pod = existing.get(pod_id)
            if pod is None:
                Pod.objects.create(pod_id=pod_id, model=model, first_seen=first_dt, last_seen=last_dt)
                created += 1
                continue
            pod.model = model
            pod.first_seen = min(pod.first_seen or first_dt, first_dt)
            pod.last_seen = max(pod.last_seen or last_dt, last_dt)
            changed.append(pod)
        if changed:
            Pod.objects.bulk_update(changed, ["model", "first_seen", "last_seen"])
    return created
