"""``manage.py ingest`` as a real process probes the registry's pods and keeps the registry tidy:
a pod that answers ``/health`` is up, one on a closed port is down and, after
``KVCACHE_POD_FORGET_SECONDS``, loses its blocks; a pod unheard of for
``KVCACHE_POD_EXPIRE_DAYS`` is deleted, a pod made by hand is not; the prober's counters are
served with the other metrics."""

from __future__ import annotations

import http.server
import signal
import sqlite3
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from kvindex import open_index
from tests.ingest.conftest import MODEL, wait_until
from tests.ingest.test_command import ROOT
from tests.registry.test_liveness import blocks_of, cache_blocks
from tests.servers import free_port, service_env


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def healthy() -> Iterator[str]:
    """The address of a pod that answers its /health."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


REGISTRY = """
from datetime import UTC, datetime, timedelta
from registry.models import Pod
old = datetime.now(UTC) - timedelta(days=8)
Pod.objects.create(pod_id="up-pod", model="{model}", address="{healthy}")
Pod.objects.create(pod_id="gone-pod", model="{model}", address="{closed}")
Pod.objects.create(pod_id="old-pod", model="{model}", first_seen=old, last_seen=old)
Pod.objects.create(pod_id="by-hand", model="{model}")
"""


def test_ingest_probes_pods_forgets_the_gone_and_expires_the_old(tmp_path, redis_url, healthy):
    env = service_env(
        tmp_path,
        redis_url,
        KVCACHE_POD_DOWN_SECONDS="0.5",
        KVCACHE_POD_FORGET_SECONDS="1",
        KVCACHE_POD_EXPIRE_DAYS="7",
    )
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    registry = REGISTRY.format(model=MODEL, healthy=healthy, closed=f"127.0.0.1:{free_port()}")
    subprocess.run([*manage, "shell", "-c", registry], cwd=ROOT, env=env, check=True)
    index = open_index(redis_url)
    cache_blocks(index, pod="gone-pod")
    cache_blocks(index, pod="gone-pod#dp1")
    metrics_port = free_port()
    proc = subprocess.Popen(
        [
            *manage, "ingest",
            "--bind", f"tcp://127.0.0.1:{free_port()}",
            "--metrics-port", str(metrics_port),
            "--housekeeping-interval", "0.2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip

    def health() -> dict[str, str]:
        with sqlite3.connect(tmp_path / "db.sqlite3") as db:
            return dict(db.execute("select pod_id, health from scoring_pod"))

    try:
        expected = {"up-pod": "up", "gone-pod": "down", "by-hand": "unknown"}
        wait_until(lambda: health() == expected, timeout=15, what=f"the registry to say {expected}")
        # The pod and its ranks are cleared one after another: wait for both.
        wait_until(
            lambda: blocks_of(index, "gone-pod") == blocks_of(index, "gone-pod#dp1") == 0,
            timeout=10,
            what="gone-pod and its rank forgotten",
        )

        url = f"http://127.0.0.1:{metrics_port}/metrics"

        def metrics() -> str:
            return urllib.request.urlopen(url, timeout=5).read().decode()

        # Counted just after the last clear.
        forgotten = "kvcache_liveness_pods_forgotten_total 1.0"
        wait_until(lambda: forgotten in metrics(), timeout=5, what="the forgetting counted")
        assert 'kvcache_liveness_pods{health="down"} 1.0' in metrics()
        assert 'kvcache_liveness_probe_failures_total{reason="connect"}' in metrics()

        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        index.close()
