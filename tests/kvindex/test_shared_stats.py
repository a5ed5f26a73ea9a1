"""The ingest snapshots processes share in Redis (``kvindex.shared_stats``), on a real server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvindex.shared_stats import STALE_AFTER_SECONDS, STATS_KEY, publish_snapshot, read_snapshots


@pytest.fixture
def client(redis_url) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    c.delete(STATS_KEY)
    yield c
    c.close()


def test_a_process_reads_the_others_snapshots_besides_its_own(client):
    """Ingest has its own snapshot at hand: it reads only the other processes' (its own is
    megabytes each second with thousands of streams). Stale ones still go, whoever reads."""
    now = 1000.0
    for instance, at in (("a", now), ("b", now - 1), ("c", now - STALE_AFTER_SECONDS - 1)):
        publish_snapshot(client, {"at": at, "instance": instance, "streams": []}, instance=instance)
    assert [s["instance"] for s in read_snapshots(client, now=now, besides="a")] == ["b"]
    assert client.hexists(STATS_KEY, "a") and not client.hexists(STATS_KEY, "c")
    assert sorted(s["instance"] for s in read_snapshots(client, now=now)) == ["a", "b"]
    assert read_snapshots(client, now=now, besides="z") != []  # an instance not there: everyone
    client.delete(STATS_KEY)
    assert read_snapshots(client, now=now, besides="a") == []
