"""Which index a process opens, from KVCACHE_INDEX_BACKEND."""

from __future__ import annotations

import pytest

from scoring.runtime import index_url


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("redis", "redis://example:6379/3"),
        ("memory", "memory://"),
        ("memory://?max_bytes=2GiB", "memory://?max_bytes=2GiB"),
    ],
)
def test_the_backend_setting_names_the_index(settings, backend, expected):
    settings.REDIS_URL = "redis://example:6379/3"
    settings.KVCACHE_INDEX_BACKEND = backend
    assert index_url() == expected


def test_an_unknown_backend_is_refused_with_the_choices(settings):
    settings.KVCACHE_INDEX_BACKEND = "postgres"
    with pytest.raises(ValueError, match="'redis', 'memory' or a memory:// URL"):
        index_url()
