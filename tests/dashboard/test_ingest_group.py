"""A real ``manage.py ingest`` process sends its stats snapshot to the channel-layer group through
Redis (channels-redis), where any web process's dashboard consumers can hear it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import zmq
from asgiref.sync import async_to_sync
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from ingest.events import encode_batch, encode_message
from tests.dashboard.conftest import ROOT, Process
from tests.ingest.conftest import MODEL
from tests.servers import free_port


def test_ingest_sends_its_snapshots_to_the_dashboard_group(tmp_path, redis_url):
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "KVCACHE_INDEX_BACKEND": "redis",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "KVCACHE_VAR_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
    }
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port = free_port()
    ingest = Process(
        [
            sys.executable,
            "manage.py",
            "ingest",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            *("--housekeeping-interval", "0.2"),
        ],
        env,
        tmp_path / "ingest.log",
    )
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")

    async def listen() -> dict:
        layer = RedisChannelLayer(hosts=[redis_url])
        channel = await layer.new_channel()
        await layer.group_add(settings.KVCACHE_STATS_GROUP, channel)
        try:
            deadline = time.monotonic() + 30
            seq = 0
            while time.monotonic() < deadline:
                # Keep publishing: ZeroMQ drops what is sent before the subscription arrives.
                pub.send_multipart(encode_message("pod-g", MODEL, seq, encode_batch([], ts=time.time())))
                seq += 1
                try:
                    message = await asyncio.wait_for(layer.receive(channel), timeout=0.5)
                except TimeoutError:
                    continue
                if any(s["pod"] == "pod-g" for s in message["snapshot"]["streams"]):
                    return message
            raise AssertionError(f"no snapshot with pod-g reached the group; see {ingest.log}")
        finally:
            await layer.group_discard(settings.KVCACHE_STATS_GROUP, channel)
            await layer.flush()

    ingest.start()
    try:
        message = async_to_sync(listen)()
    finally:
        ingest.stop()
        pub.close(0)
        context.term()
    assert message["type"] == "ingest.snapshot"
    snapshot = message["snapshot"]
    assert snapshot["instance"]  # which ingest process: the dashboard keeps one state per process
    assert {"at", "started_at", "streams", "unattributed_errors"} <= set(snapshot)
