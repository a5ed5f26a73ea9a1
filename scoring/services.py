"""Writes to the registry and the process's handle on the index."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.db import transaction

from scoring.config import ServiceConfig
from scoring.index import KVIndex, open_index
from scoring.models import HashSeed, ModelConfig, Pod
from scoring.prefix_store import PrefixStore
from scoring.selectors import invalidate_service_config, service_config
from scoring.tokenization import TokenizerRegistry

_index: KVIndex | None = None
_index_lock = threading.Lock()


def index_url() -> str:
    """The index this process opens: ``redis`` -> ``REDIS_URL``; ``memory`` or a
    ``memory://?max_keys=..&max_bytes=2GiB`` URL -> an in-process index with those bounds."""
    backend = settings.KVCACHE_INDEX_BACKEND
    if backend == "memory":
        return "memory://"
    if backend.startswith("memory://"):
        return backend
    if backend == "redis":
        return settings.REDIS_URL
    raise ValueError(f"KVCACHE_INDEX_BACKEND must be 'redis', 'memory' or a memory:// URL, not {backend!r}")


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


_tokenizers: TokenizerRegistry | None = None
_tokenizers_lock = threading.Lock()
_tokenizers_checked: ServiceConfig | None = None  # the registry snapshot last compared against
_tokenizer_sources: dict[str, str] | None = None  # model -> tokenizer source the registry was built for


def get_tokenizers() -> TokenizerRegistry:
    """This process's tokenizer registry (one per process: loaded tokenizers and the prefix store
    are shared by every request), configured from ``KVCACHE_TOKENIZERS_DIR``,
    ``KVCACHE_ALLOW_HUB`` and ``KVCACHE_PREFIX_STORE_CAPACITY``.

    A model's tokenizer source comes from its model config. The registry keeps a model's
    tokenizer once loaded, so when any model's source changes it is rebuilt, within a config
    refresh: every tokenizer loads again on next use; the prefix store is kept (its chunks are
    keyed by tokenizer file, so none can be reused for the wrong tokenizer)."""
    global _tokenizers, _tokenizers_checked, _tokenizer_sources
    config = service_config()
    registry = _tokenizers
    if registry is not None and config is _tokenizers_checked:
        return registry  # the common case: nothing changed since the last request
    with _tokenizers_lock:
        sources = {name: m.tokenizer_source for name, m in config.models.items() if m.tokenizer_source}
        if _tokenizers is None:
            _tokenizers = build_tokenizers()
        elif _tokenizer_sources is not None and sources != _tokenizer_sources:
            _tokenizers = build_tokenizers(prefix_store=_tokenizers.prefix_store)
        _tokenizer_sources, _tokenizers_checked = sources, config
        return _tokenizers


def build_tokenizers(*, prefix_store: PrefixStore | None = None) -> TokenizerRegistry:
    """A new tokenizer registry configured from the settings (``get_tokenizers`` keeps one),
    with ``prefix_store`` or a new one."""
    directory = settings.KVCACHE_TOKENIZERS_DIR
    if prefix_store is None:
        prefix_store = PrefixStore(capacity=settings.KVCACHE_PREFIX_STORE_CAPACITY)
    return TokenizerRegistry(
        tokenizers_dir=Path(directory) if directory else None,
        model_sources=lambda model: service_config().model(model).tokenizer_source or None,
        allow_hub=settings.KVCACHE_ALLOW_HUB,
        prefix_store=prefix_store,
    )


def set_tokenizers(registry: TokenizerRegistry | None) -> None:
    """Replace this process's tokenizer registry (tests; ``None`` builds a new one on next use).
    The registry given is taken as built for the model configs as they are now."""
    global _tokenizers, _tokenizers_checked, _tokenizer_sources
    with _tokenizers_lock:
        _tokenizers, _tokenizers_checked, _tokenizer_sources = registry, None, None
