"""Dashboard fixtures: users with sessions, a fast push interval, the in-memory channel layer,
a websocket client that goes through the real ASGI stack (origin check, session auth), and a
gateway's ``/metrics`` served over real HTTP."""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from dashboard import sampler
from dashboard.fleet import COUNTERS
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
PUSH_SECONDS = 0.1


@pytest.fixture(autouse=True)
def live_settings(settings) -> Iterator[None]:
    """A fast push interval and the in-memory channel layer (one process: the test)."""
    settings.DASHBOARD_PUSH_SECONDS = PUSH_SECONDS
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    sampler.reset_sampler()
    yield
    sampler.reset_sampler()


def prepare_site(env: dict[str, str]) -> None:
    """Migrate the database ``env`` names and create the staff user ``ops`` (its password from
    ``DJANGO_SUPERUSER_PASSWORD``), as an operator's first start does."""
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    subprocess.run(
        [*manage, "createsuperuser", "--noinput", "--username", "ops", "--email", "ops@example.com"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )


def make_user(username: str, *, staff: bool):
    return get_user_model().objects.create_user(
        username=username, password="not-used-here", is_staff=staff, is_superuser=staff
    )


@pytest.fixture
def staff_user(transactional_db):
    return make_user("staff", staff=True)


@pytest.fixture
def plain_user(transactional_db):
    return make_user("plain", staff=False)


def session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def communicator(path: str, *, cookie: str = "", origin: str = "http://localhost") -> WebsocketCommunicator:
    """A websocket client of ``kvsite.asgi.application``, as a browser on ``origin`` would be."""
    from kvsite.asgi import application

    headers = [(b"origin", origin.encode())]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, path, headers=headers)


async def receive_until(
    comm: WebsocketCommunicator, condition: Callable[[dict], object], *, timeout: float = 5.0
) -> dict:
    """The first message for which ``condition`` holds; fails after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(f"no matching message within {timeout}s")
        message = await comm.receive_json_from(timeout=left)
        if condition(message):
            return message


def stream(pod: str, rank: int = 0, **counts) -> dict:
    """A stream as ``StreamStats.as_dict`` shapes it, counters zero unless given."""
    base = {c: 0 for c in COUNTERS}
    extra = {k: counts.pop(k) for k in ("decode_errors", "last_event_at", "last_seq", "model") if k in counts}
    return {
        "pod": pod,
        "rank": rank,
        "model": extra.get("model", "m"),
        **base,
        **counts,
        "decode_errors": extra.get("decode_errors", {}),
        "last_event_at": extra.get("last_event_at", 0.0),
        "last_seq": extra.get("last_seq"),
    }


class Process:
    """A child process of the test, stopped for sure at the end."""

    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self.args, self.env, self.log = args, env, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fresh_gateway_metrics() -> ModuleType:
    """A fresh copy of ``gateway/metrics.py``: the gateway's counters and buckets, counting from
    zero (the module's own are shared by every test of the session)."""
    spec = importlib.util.find_spec("gateway.metrics")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GatewayMetrics:
    """A gateway's ``/metrics`` over real HTTP, served by ``exposition`` of a fresh copy of
    ``gateway/metrics.py``. Count on ``metrics`` as the gateway would, e.g.
    ``metrics.REQUESTS.labels(policy, pod, outcome).inc()``."""

    def __init__(self) -> None:
        self.metrics = fresh_gateway_metrics()
        exposition = self.metrics.exposition

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body, content_type = exposition() if self.path == "/metrics" else (b"", "text/plain")
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.closed = False
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop answering: from now on the gateway cannot be reached."""
        if not self.closed:
            self.server.shutdown()
            self.server.server_close()
            self.closed = True


@pytest.fixture
def gateway_metrics() -> Iterator[GatewayMetrics]:
    served = GatewayMetrics()
    yield served
    served.close()


def unreachable_url() -> str:
    """A loopback port nothing listens on (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"
