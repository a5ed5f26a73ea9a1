"""Writes to the registry, with their effects on the index (``scoring.runtime`` has the handles)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction

from scoring.models import HashSeed, ModelConfig, Pod
from scoring.runtime import get_index, invalidate_service_config


def address_in_pod_id(pod_id: str) -> str:
    """The address a ``host:port`` pod id names (llm-d's convention; IPv6 as ``[::1]:8000``),
    else ""."""
    host, colon, port = pod_id.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(pod_id) > 255:
        return ""
    if host.startswith("["):
        return pod_id if host.endswith("]") and len(host) > 2 else ""
    return pod_id if all(c.isalnum() or c in ".-" for c in host) else ""


def record_pods_seen(seen: Iterable[tuple[str, str, float, float]]) -> int:
    """Upsert ``(pod, model, first_seen, last_seen)`` (unix times) into the registry; returns how
    many pods were new. ``first_seen`` never moves later; ``last_seen`` never moves earlier. A new
    pod whose id is ``host:port`` gets that as its address."""
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
                Pod.objects.create(
                    pod_id=pod_id,
                    model=model,
                    address=address_in_pod_id(pod_id),
                    first_seen=first_dt,
                    last_seen=last_dt,
                )
                created += 1
                continue
            pod.model = model
            pod.first_seen = min(pod.first_seen or first_dt, first_dt)
            pod.last_seen = max(pod.last_seen or last_dt, last_dt)
            changed.append(pod)
        if changed:
            Pod.objects.bulk_update(changed, ["model", "first_seen", "last_seen"])
    return created


def save_pod(pod: Pod) -> Pod:
    """Save a pod from the admin or the API. Disabling it removes its blocks from the index now
    (ingest stops indexing it within a config refresh and clears it again in order)."""
    was_enabled = Pod.objects.filter(pk=pod.pk, enabled=True).exists() if pod.pk else True
    pod.full_clean()
    pod.save()
    if was_enabled and not pod.enabled:
        clear_pod_blocks(pod.pod_id)
    invalidate_service_config()
    return pod


def delete_pod(pod: Pod) -> None:
    """Delete a pod and its blocks. A pod that keeps publishing is registered again."""
    pod_id = pod.pod_id
    pod.delete()
    clear_pod_blocks(pod_id)
    invalidate_service_config()


def clear_pod_blocks(pod_id: str) -> int:
    """Remove every block of ``pod_id`` (and of its data-parallel ranks) under every model."""
    index = get_index()
    removed = index.clear_pod(pod=pod_id)
    for other in {b.pod for b in index.pod_blocks() if b.pod.startswith(pod_id + "#dp")}:
        removed += index.clear_pod(pod=other)
    return removed


def save_model_config(config: ModelConfig) -> ModelConfig:
    """Save a model config. A new block size changes every block key of the model, so its index
    is cleared (engines re-report blocks as they cache them; until then it scores nothing)."""
    previous = ModelConfig.objects.filter(pk=config.pk).first() if config.pk else None
    config.full_clean()
    config.save()
    old_block_size = previous.block_size if previous is not None else settings.KVCACHE_BLOCK_SIZE
    if config.block_size != old_block_size:
        get_index().clear_model(model=config.name)
    if previous is not None and previous.name != config.name:
        get_index().clear_model(model=previous.name)
    invalidate_service_config()
    return config


def delete_model_config(config: ModelConfig) -> None:
    name, block_size = config.name, config.block_size
    config.delete()
    if block_size != settings.KVCACHE_BLOCK_SIZE:
        get_index().clear_model(model=name)
    invalidate_service_config()


def current_hash_seed() -> HashSeed:
    """The hash-seed row, created from ``KVCACHE_HASH_SEED`` the first time it is asked for."""
    seed, _ = HashSeed.objects.get_or_create(pk=1, defaults={"value": settings.KVCACHE_HASH_SEED})
    return seed


def set_hash_seed(value: str) -> HashSeed:
    """Change the hash seed. Every block key depends on it, so the whole index is cleared."""
    seed = current_hash_seed()
    if seed.value != value:
        seed.value = value
        seed.full_clean()
        seed.save()
        index = get_index()
        for model in {b.model for b in index.pod_blocks()}:
            index.clear_model(model=model)
    invalidate_service_config()
    return seed
