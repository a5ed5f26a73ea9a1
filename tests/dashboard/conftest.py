"""Dashboard fixtures: users with sessions, a fast push interval, the in-memory channel layer,
and a websocket client that goes through the real ASGI stack (origin check, session auth)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from dashboard import sampler
from dashboard.fleet import COUNTERS

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
