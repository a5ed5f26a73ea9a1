"""Which index a process opens, from KVCACHE_INDEX_BACKEND."""

from __future__ import annotations

import pytest

from registry.runtime import index_options, index_url


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


@pytest.mark.parametrize("backend", ["redis", "redis-cluster://10.0.0.1:6379"])
@pytest.mark.parametrize("layout", ["fast", "compact"])
def test_a_redis_index_takes_its_layout_from_the_setting(settings, backend, layout):
    settings.KVCACHE_INDEX_BACKEND, settings.KVCACHE_INDEX_LAYOUT = backend, layout
    assert index_options() == {"layout": layout}


def test_the_in_process_index_has_one_layout(settings):
    settings.KVCACHE_INDEX_BACKEND, settings.KVCACHE_INDEX_LAYOUT = "memory", "fast"
    assert index_options() == {}
    settings.KVCACHE_INDEX_LAYOUT = "compact"
    with pytest.raises(ValueError, match="is for a Redis index"):
        index_options()


def test_an_unknown_backend_is_refused_with_the_choices(settings):
    settings.KVCACHE_INDEX_BACKEND = "postgres"
    with pytest.raises(ValueError, match="'redis', 'memory' or a memory:// URL"):
        index_url()
