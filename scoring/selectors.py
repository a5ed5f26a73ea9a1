"""Reads: the registry as a ``ServiceConfig`` snapshot, refreshed so admin edits reach every
running process within seconds."""

from __future__ import annotations

import threading
import time

from django.conf import settings

from scoring.config import DEFAULT_OTHER_TIER_WEIGHT, ModelSettings, ServiceConfig
from scoring.models import HashSeed, ModelConfig, Pod

CONFIG_REFRESH_SECONDS = 2.0
"""How stale a process's view of the registry may be (the promise is: live within 5 s)."""


def load_service_config() -> ServiceConfig:
    """A fresh snapshot from the database."""
    seed_row = HashSeed.objects.filter(pk=1).first()
    seed = seed_row.value if seed_row is not None else settings.KVCACHE_HASH_SEED
    models = {
        m.name: ModelSettings(
            name=m.name,
            block_size=m.block_size,
            tokenizer_source=m.tokenizer_source,
            chat_template=m.chat_template,
            tier_weights=dict(m.tier_weights or {}),
            other_tier_weight=m.other_tier_weight
            if m.other_tier_weight is not None
            else DEFAULT_OTHER_TIER_WEIGHT,
            lora_adapters=tuple(m.lora_adapters or ()),
        )
        for m in ModelConfig.objects.all()
    }
    disabled = frozenset(Pod.objects.filter(enabled=False).values_list("pod_id", flat=True))
    return ServiceConfig(
        seed=seed, default_block_size=settings.KVCACHE_BLOCK_SIZE, models=models, disabled_pods=disabled
    )


class _ConfigCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: ServiceConfig | None = None
        self._loaded_at = 0.0

    def get(self) -> ServiceConfig:
        value = self._value
        if value is not None and time.monotonic() - self._loaded_at < CONFIG_REFRESH_SECONDS:
            return value
        with self._lock:
            if self._value is None or time.monotonic() - self._loaded_at >= CONFIG_REFRESH_SECONDS:
                self._value = load_service_config()
                self._loaded_at = time.monotonic()
            return self._value

    def invalidate(self) -> None:
        self._loaded_at = 0.0


_config_cache = _ConfigCache()


def service_config() -> ServiceConfig:
    """The registry snapshot of this process, at most ``CONFIG_REFRESH_SECONDS`` old."""
    return _config_cache.get()


def invalidate_service_config() -> None:
    _config_cache.invalidate()
