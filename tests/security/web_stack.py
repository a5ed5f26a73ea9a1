"""The processes whose request bodies the security tests send: ``manage.py serve`` (the scoring fast
path and the registry API) and ``manage.py gateway`` in front of a fake pod, as operators run them,
on a database of their own with a staff user, a model config and the pod registered (and a pod and
a model config of their own for tests that write)."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.dashboard.conftest import ROOT, Process
from tests.loadgen.fake_fleet import Served
from tests.servers import free_port, service_env, wait_until

MODEL = "Qwen/Qwen3-0.6B"
STAFF = ("ops", "ops-password-1")
SCRATCH_POD = "scratch-pod"
SCRATCH_MODEL = "scratch/model"
"""Registry entries a test may write anything to (the gateway routes nothing to them)."""

SETUP = """
from django.contrib.auth.models import User
from registry.models import ModelConfig, Pod
User.objects.create_superuser({user!r}, "ops@example.com", {password!r})
ModelConfig.objects.create(name={model!r}, block_size=16)
Pod.objects.create(pod_id="pod-a", model={model!r}, address={address!r})
ModelConfig.objects.create(name={scratch_model!r}, block_size=16)
Pod.objects.create(pod_id={scratch_pod!r}, model={scratch_model!r})
"""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class FakePod:
    """A vLLM-like pod for the gateway to forward to: a JSON object with a string ``model`` is
    answered 200, anything else 400 in OpenAI's shape (as vLLM refuses what it cannot read)."""

    received: list[bytes] = field(default_factory=list)

    def app(self) -> Starlette:
        async def complete(request: Request) -> Response:
            body = await request.body()
            self.received.append(body)
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
            if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
                error = {"message": "not a request", "type": "BadRequestError", "code": 400}
                return JSONResponse({"error": error}, status_code=400)
            return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})

        async def metrics(request: Request) -> Response:
            return PlainTextResponse("vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n")

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        return Starlette(
            routes=[
                Route("/v1/completions", complete, methods=["POST"]),
                Route("/v1/chat/completions", complete, methods=["POST"]),
                Route("/metrics", metrics),
                Route("/health", health),
            ]
        )


@dataclass
class Stack:
    web_port: int
    gateway_port: int
    pod: FakePod
    web: Process
    gateway: Process
    _staff: dict[str, str] | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str | None = "application/json",
        staff: bool = False,
        gateway: bool = False,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> Answer:
        """One request on a new connection, its answer read whole; ``staff``: as the staff user."""
        headers = {**(headers or {})}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if staff:
            headers.update(self.staff_headers())
        port = self.gateway_port if gateway else self.web_port
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            answer_headers = {k.lower(): v for k, v in response.getheaders()}
            return Answer(response.status, answer_headers, response.read())
        finally:
            connection.close()

    def staff_headers(self) -> dict[str, str]:
        """A staff session's cookie and CSRF header, logged in once (an HTTP basic login hashes
        the password, ~0.3 s, on every request)."""
        if self._staff is None:
            page = self.request("GET", "/admin/login/", content_type=None)
            token = re.search(r"csrftoken=([^;]+)", page.headers["set-cookie"]).group(1)
            form = {"username": STAFF[0], "password": STAFF[1], "csrfmiddlewaretoken": token}
            login = self.request(
                "POST",
                "/admin/login/",
                urllib.parse.urlencode({**form, "next": "/admin/"}).encode(),
                content_type="application/x-www-form-urlencoded",
                headers={"Cookie": f"csrftoken={token}"},
            )
            session = re.search(r"sessionid=([^;]+)", login.headers.get("set-cookie", ""))
            assert login.status == 302 and session, login
            cookie = f"csrftoken={token}; sessionid={session.group(1)}"
            self._staff = {"Cookie": cookie, "X-CSRFToken": token}
        return self._staff


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
    pod = FakePod()
    served = Served(pod.app())
    env = service_env(tmp_path, redis_url, HF_HUB_OFFLINE="1", KVCACHE_POD_DOWN_SECONDS="0")
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    setup = SETUP.format(
        user=STAFF[0],
        password=STAFF[1],
        model=MODEL,
        address=f"127.0.0.1:{served.port}",
        scratch_model=SCRATCH_MODEL,
        scratch_pod=SCRATCH_POD,
    )
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
