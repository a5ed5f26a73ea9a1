"""Issue 27, defect 6: with API keys set, the gateway served anonymous completions, /v1/models and
/metrics. It takes the scoring API's keys (``KVCACHE_API_KEYS``, ``Authorization: Bearer``),
leaves ``/health`` open, and sends the pods a key of their own when one is set."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.dashboard.conftest import ROOT, Process
from tests.security.gateway_harness import MODEL, RawPod, gateway_app
from tests.servers import Served, free_port, service_env, wait_until


@pytest.fixture
def pod() -> Iterator[RawPod]:
    pod = RawPod()
    yield pod
    pod.stop()


def test_with_api_keys_only_health_is_open_and_the_pods_get_their_own_key(pod: RawPod) -> None:
    gateway = Served(gateway_app({"pod": pod.address}, api_keys=("key-1", "key-2"), pod_api_key="pod-key"))
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
        with httpx.Client(base_url=gateway.url, timeout=10) as client:
            assert client.get("/health").status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic a2V5LTE6"}):
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
                    refused = client.request(method, path, json=body, headers=headers)
                    assert refused.status_code == 401, (method, path, headers)
                    assert refused.json()["error"]["type"] == "authentication_error"
                    assert refused.headers["www-authenticate"].startswith("Bearer")
            assert pod.received == []  # nothing anonymous reached the pod

            key = {"Authorization": "Bearer key-2"}
            assert client.post("/v1/completions", json=body, headers=key).status_code == 200
            assert client.get("/v1/models", headers=key).json()["data"][0]["id"] == MODEL
            assert client.get("/metrics", headers=key).status_code == 200
        # The pod gets the gateway's key for the pods, never the client's.
        assert [r.header(b"authorization") for r in pod.received] == [b"Bearer pod-key"]
    finally:
        gateway.stop()


def test_without_a_pod_key_the_clients_authorization_goes_to_the_pod(pod: RawPod) -> None:
    """A fleet whose pods check the same keys as the gateway (vLLM's ``--api-key``)."""
    gateway = Served(gateway_app({"pod": pod.address}, api_keys=("key-1",)))
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
        answer = httpx.post(
            f"{gateway.url}/v1/completions", json=body, headers={"Authorization": "Bearer key-1"}, timeout=10
        )
        assert answer.status_code == 200
        assert [r.header(b"authorization") for r in pod.received] == [b"Bearer key-1"]
    finally:
        gateway.stop()


@pytest.mark.slow
def test_the_gateway_command_takes_the_api_keys(tmp_path: Path, redis_url: str) -> None:
    """``manage.py gateway`` as operators run it reads ``KVCACHE_API_KEYS`` (``gateway/asgi.py``)."""
    env = service_env(tmp_path, redis_url, HF_HUB_OFFLINE="1", KVCACHE_API_KEYS="key-1,key-2")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port = free_port()
    gateway = Process(
        [sys.executable, "manage.py", "gateway", "--port", str(port), "--workers", "1"], env, tmp_path / "log"
    )
    gateway.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _status(f"{url}/health") == 200, timeout=30, what="the gateway to answer")
        assert _status(f"{url}/v1/models") == 401
        assert _status(f"{url}/metrics", key="key-1") == 200
        assert _status(f"{url}/v1/models", key="key-2") == 200
    finally:
        gateway.stop()


def _status(url: str, *, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        return httpx.get(url, headers=headers, timeout=5).status_code
    except httpx.HTTPError:
        return 0
