"""Fixtures of the registry's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvindex import KVIndex, open_index
from registry import runtime
from registry.runtime import invalidate_service_config


@pytest.fixture
def process_index() -> Iterator[KVIndex]:
    """An in-memory index installed as this process's (what services and the read path use)."""
    idx = open_index("memory://")
    runtime.set_index(idx)
    invalidate_service_config()
    yield idx
    runtime.set_index(None)
    invalidate_service_config()


@pytest.fixture
def index(process_index: KVIndex) -> KVIndex:
    return process_index
