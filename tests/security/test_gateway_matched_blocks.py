"""Issue 27, defect 7: ``x-kvcache-matched-blocks`` told any client whether a guessed prompt prefix
(another tenant's secret) was cached: ten guesses found the secret. The header is now sent only
when ``KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER`` turns it on, and a ``cache_salt`` keeps tenants'
prefixes apart in routing, as vLLM keeps them apart in its cache."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.security.gateway_harness import MODEL, RawPod, gateway_app
from tests.servers import Served

SECRET = "The launch code of tenant A is " + " ".join(f"w{i}" for i in range(120))


@pytest.fixture
def pods() -> Iterator[dict[str, str]]:
    running = [RawPod(), RawPod()]
    yield {f"pod-{i}": pod.address for i, pod in enumerate(running)}
    for pod in running:
        pod.stop()


def send(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def test_matched_blocks_are_not_told_by_default(pods: dict[str, str]) -> None:
    # kv-load with speculative entries: right after tenant A's request, its pod is taken to hold
    # the prompt's blocks, so a guess of the same prompt would match them all.
    gateway = Served(gateway_app(pods, policy="kv-load", speculative_seconds=30))
    try:
        send(gateway.url, SECRET)
        guess = send(gateway.url, SECRET)
        assert "x-kvcache-matched-blocks" not in guess.headers
        assert guess.headers["x-kvcache-pod"] in pods
    finally:
        gateway.stop()


def test_when_enabled_a_salt_keeps_tenants_apart(pods: dict[str, str]) -> None:
    gateway = Served(gateway_app(pods, policy="kv-load", speculative_seconds=30, matched_blocks_header=True))
    try:
        send(gateway.url, SECRET, cache_salt="tenant-a")
        assert int(send(gateway.url, SECRET, cache_salt="tenant-a").headers["x-kvcache-matched-blocks"]) > 0
        for other in ({"cache_salt": "tenant-b"}, {}):  # another tenant, or no tenant at all
            assert send(gateway.url, SECRET, **other).headers["x-kvcache-matched-blocks"] == "0"
    finally:
        gateway.stop()
