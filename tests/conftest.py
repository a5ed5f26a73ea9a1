"""Session-wide real servers and the two real vLLM captures."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.servers import FIXTURES, RedisServer, ValkeyCluster


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean Redis-compatible server for one test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ValkeyCluster]:
    """A Valkey Cluster of 3 masters (no replicas), started the first time a test asks for it."""
    cluster = ValkeyCluster(masters=3)
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: ValkeyCluster) -> str:
    """A clean cluster for one test: its ``redis-cluster://`` URL (every master as a seed)."""
    redis_cluster.flush()
    return redis_cluster.url


def load_capture(name: str) -> dict:
    return json.loads((FIXTURES / "vllm" / f"kv_event_{name}.json").read_text())


@pytest.fixture(scope="session")
def base_capture() -> dict:
    """Qwen/Qwen3-0.6B, seed "42", block size 16: prompt, 400 token ids, 25 block hashes."""
    return load_capture("base")


@pytest.fixture(scope="session")
def lora_capture() -> dict:
    """The same prompt through LoRA adapter "Alice": 25 different block hashes."""
    return load_capture("lora")


@pytest.fixture
def python_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pure-Python key chain and index maps for this test, as where the compiled hot path is
    not built (``MemoryIndex`` then makes a ``PyCore``)."""
    import kvindex.keys
    import kvindex.memory

    monkeypatch.setattr(kvindex.keys, "_native", None)
    monkeypatch.setattr(kvindex.memory, "_native", None)


@pytest.fixture(params=["native", "python"])
def both_cores(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: with the compiled hot path (``kvindex.native``: the key chain and the
    in-memory index's maps) and with the pure-Python fallback. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("both_cores")``. The compiled one must be built (``make
    install``): the suite fails rather than skip it, so a machine where it does not build says so."""
    from kvindex import native

    if request.param == "native":
        assert native.module is not None, f"the compiled hot path did not load: {native.reason}"
    else:
        request.getfixturevalue("python_fallback")
    return request.param
