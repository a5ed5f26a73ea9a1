"""Shares an ingest process's stream counters with the other processes through Redis.

Each ingest process writes its snapshot (``IngestStats.snapshot``) as JSON into the HASH
``kv:ingest:stats`` under its own instance id, once a second; readers merge the snapshots that
are fresh. The web process turns them into ``/metrics``, the pods API and the dashboard.
"""

from __future__ import annotations

import json
import os
import socket
import time

import redis

STATS_KEY = "kv:ingest:stats"
STALE_AFTER_SECONDS = 30.0


def instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def publish_snapshot(client: redis.Redis, snapshot: dict, *, instance: str) -> None:
    client.hset(STATS_KEY, instance, json.dumps(snapshot, separators=(",", ":")))


def withdraw_snapshot(client: redis.Redis, *, instance: str) -> None:
    client.hdel(STATS_KEY, instance)


def read_snapshots(client: redis.Redis, *, now: float | None = None) -> list[dict]:
    """Every fresh snapshot (published within ``STALE_AFTER_SECONDS``); stale or unreadable
    ones are deleted."""
    now = time.time() if now is None else now
    fresh: list[dict] = []
    stale: list[bytes] = []
    for instance, raw in client.hgetall(STATS_KEY).items():
        try:
            snap = json.loads(raw)
        except ValueError:
            stale.append(instance)
            continue
        if now - snap.get("at", 0) <= STALE_AFTER_SECONDS:
            fresh.append(snap)
        else:
            stale.append(instance)
    if stale:
        client.hdel(STATS_KEY, *stale)
    return fresh
