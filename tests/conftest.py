"""Session-wide real servers and the two real vLLM captures."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.servers import FIXTURES, RedisServer


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
