"""The processes whose request bodies the security tests send: ``manage.py serve`` (the scoring fast
path and the registry API) and ``manage.py gateway`` in front of a fake pod, as operators run them,
on a database of their own with a staff user, a model config and the pod registered."""

from __future__ import annotations

import base64
import http.client
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.dashboard.conftest import ROOT, Process
from tests.loadgen.fake_fleet import PodBehaviour, Served, pod_app
from tests.servers import free_port, service_env, wait_until

MODEL = "Qwen/Qwen3-0.6B"
STAFF = ("ops", "ops-password-1")

SETUP = """
from django.contrib.auth.models import User
from registry.models import ModelConfig, Pod
User.objects.create_superuser({user!r}, "ops@example.com", {password!r})
ModelConfig.objects.create(name={model!r}, block_size=16)
Pod.objects.create(pod_id="pod-a", model={model!r}, address={address!r})
"""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Stack:
    web_port: int
    gateway_port: int
    pod: PodBehaviour
    web: Process
    gateway: Process

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str | None = "application/json",
        staff: bool = False,
        gateway: bool = False,
        timeout: float = 30.0,
    ) -> Response:
        """One request on a new connection, its answer read whole."""
        headers = {} if content_type is None else {"Content-Type": content_type}
        if staff:
            headers["Authorization"] = "Basic " + base64.b64encode(":".join(STAFF).encode()).decode()
        port = self.gateway_port if gateway else self.web_port
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return Response(
                response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
            )
        finally:
            connection.close()


def _answers(port: int, path: str) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", path)
        ok = connection.getresponse().status == 200
        connection.close()
        return ok
    except OSError:
        return False


@contextmanager
def running_stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    """serve (1 worker) and gateway (1 worker) on ``redis_url``, the fake pod behind the gateway."""
    pod = PodBehaviour(name="pod-a", first_token_delay=0.0, token_delay=0.0)
    served = Served(pod_app(pod))
    env = service_env(tmp_path, redis_url, HF_HUB_OFFLINE="1", KVCACHE_POD_DOWN_SECONDS="0")
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    setup = SETUP.format(user=STAFF[0], password=STAFF[1], model=MODEL, address=f"127.0.0.1:{served.port}")
    subprocess.run([*manage, "shell", "-c", setup], cwd=ROOT, env=env, check=True, capture_output=True)
    web_port, gateway_port = free_port(), free_port()
    web = Process([*manage, "serve", "--port", str(web_port), "--workers", "1"], env, tmp_path / "web.log")
    gateway = Process(
        [*manage, "gateway", "--port", str(gateway_port), "--workers", "1", "--policy", "kv-load"],
        env,
        tmp_path / "gateway.log",
    )
    web.start()
    gateway.start()
    try:
        wait_until(lambda: _answers(web_port, "/healthz"), timeout=60, what="serve to answer")
        wait_until(lambda: _answers(gateway_port, "/health"), timeout=60, what="the gateway to answer")
        yield Stack(web_port, gateway_port, pod, web, gateway)
    finally:
        web.stop()
        gateway.stop()
        served.stop()
