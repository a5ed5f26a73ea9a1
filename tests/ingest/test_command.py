"""``manage.py ingest`` as a real process: events in over ZeroMQ, index and registry out,
metrics served, SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import zmq

from ingest.events import encode_batch, encode_message
from kvindex import open_index
from kvindex.keys import block_keys
from kvindex.shared_stats import STATS_KEY
from tests.events import stored_event
from tests.ingest.conftest import MODEL, wait_until
from tests.servers import free_port, service_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ingest_process(tmp_path, redis_url):
    env = service_env(tmp_path, redis_url)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "manage.py", "ingest",
            "--bind", f"tcp://127.0.0.1:{port}",
            "--workers", "2",
            "--metrics-port", str(metrics_port),
            "--housekeeping-interval", "0.2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    proc.endpoint = f"tcp://127.0.0.1:{port}"
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    proc.db = tmp_path / "db.sqlite3"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_ingest_process_indexes_registers_reports_and_drains(ingest_process, redis_url, base_capture):
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.connect(ingest_process.endpoint)
    index = open_index(redis_url)
    client = redis.Redis.from_url(redis_url)
    event = stored_event(base_capture)
    payload = encode_batch([event], ts=time.time(), layout="map")
    seq = 0

    def landed() -> bool:
        # Re-sending is harmless (stores are idempotent) and beats ZeroMQ's slow-joiner drop.
        nonlocal seq
        pub.send_multipart(encode_message("pod-a", MODEL, seq, payload))
        seq += 1
        time.sleep(0.05)
        return len(index.lookup(model=MODEL, keys=base_capture["block_hashes"])) == 25

    try:
        wait_until(landed, timeout=30, what="the capture in the index")

        def registered():
            with sqlite3.connect(ingest_process.db) as db:
                return db.execute("select pod_id, model from scoring_pod").fetchall()

        assert wait_until(registered, timeout=10, what="the pod registry") == [("pod-a", MODEL)]

        metrics = urllib.request.urlopen(ingest_process.metrics_url, timeout=5).read().decode()
        assert 'kvcache_index_admissions_total{model="Qwen/Qwen3-0.6B",pod="pod-a",rank="0"}' in metrics

        def shared():
            snaps = [json.loads(v) for v in client.hgetall(STATS_KEY).values()]
            return [
                s for snap in snaps for s in snap["streams"] if s["pod"] == "pod-a" and s["blocks_stored"]
            ]

        assert wait_until(shared, timeout=10, what="stats shared through Redis")[0]["aligned_blocks"] >= 25

        # A seed changed in the registry reaches the running process within 5 s: a new pod's
        # first blocks are then keyed from the new seed's root.
        changed_at = time.monotonic()
        with sqlite3.connect(ingest_process.db) as db:
            db.execute(
                "insert or replace into scoring_hashseed (id, value, updated_at)"
                " values (1, '7', datetime('now'))"
            )
        new_keys = block_keys(base_capture["token_ids"], seed="7")

        def rekeyed() -> bool:
            nonlocal seq
            pub.send_multipart(encode_message("pod-b", MODEL, seq, payload))
            seq += 1
            time.sleep(0.05)
            return len(index.lookup(model=MODEL, keys=new_keys, pods=["pod-b"])) == 25

        wait_until(rekeyed, timeout=10, what="blocks keyed with the new seed")
        assert time.monotonic() - changed_at < 5

        ingest_process.send_signal(signal.SIGTERM)
        output, _ = ingest_process.communicate(timeout=20)
        assert ingest_process.returncode == 0, output
        assert "ingest: stopped" in output
    finally:
        pub.close(0)
        context.term()
        index.close()
