"""The dashboard's history as ingest records it into a real Valkey: a point per interval and level
however many ingest processes record it, rates from each source's own publications, summed, and
a size that stays bounded; and the ``ingest`` command's housekeeping records it from a real
pipeline while no dashboard is open."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from ingest.history import HistoryRecorder
from ingest.service import Housekeeping
from kvindex.shared_stats import HISTORY_LEVELS, HistoryLevel, read_history, record_point
from tests.events import stored_event
from tests.ingest.conftest import Harness, ingest_housekeeping

SECOND = HistoryLevel(step=1, length=600)


@pytest.fixture
def client(redis_url) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def snapshot(instance: str, at: float, **pods: tuple[int, int, int]) -> dict:
    """An ingest process's snapshot (``IngestStats.snapshot`` shape): per pod, blocks stored,
    blocks removed and events so far."""
    streams = [
        {"pod": pod, "rank": 0, "blocks_stored": s, "blocks_removed": r, "events": e}
        for pod, (s, r, e) in pods.items()
    ]
    return {"instance": instance, "at": at, "started_at": 0.0, "streams": streams}


def record(recorder: HistoryRecorder, client, now: float, *snapshots, blocks=None, scoring=None) -> list[int]:
    return recorder.record(client, now=now, snapshots=snapshots, blocks=blocks or {}, scoring=scoring or {})


def test_each_level_keeps_a_point_per_interval_and_no_more_than_its_length(client):
    levels = (HistoryLevel(step=1, length=5), HistoryLevel(step=10, length=3))
    recorder = HistoryRecorder(levels=levels)
    for i in range(80):  # two housekeeping runs a second, for 40 seconds
        record(recorder, client, 1000 + i * 0.5, blocks={"pod-a": i})
    seconds, tens = (read_history(client, level, after=0) for level in levels)
    assert [p["t"] for p in seconds] == [1035, 1036, 1037, 1038, 1039]
    assert seconds[-1]["blocks"] == 78  # the first run of second 1039 recorded it
    assert seconds[-1]["pods"] == {"pod-a": [78, None, None, None]}  # no rate known: no snapshot
    assert [p["t"] for p in tens] == [1010, 1020, 1030]
    assert client.xlen(levels[0].key) == 5 and client.xlen(levels[1].key) == 3


def test_rates_come_from_each_ingest_process_s_own_publications_and_add_up(client):
    recorder = HistoryRecorder(levels=(SECOND,))

    def point(now, *snapshots):
        record(recorder, client, now, *snapshots)
        return read_history(client, SECOND, after=now - 1)[-1]

    first = point(1000.0, snapshot("A", 999.9, a=(0, 0, 0)), snapshot("B", 999.5, b=(0, 0, 0)))
    assert first["events_per_s"] is None  # one publication each: no rate yet
    assert first["pods"] == {"a": [0, None, None, None], "b": [0, None, None, None]}

    p = point(1001.0, snapshot("A", 1000.9, a=(10, 0, 2)), snapshot("B", 1000.5, b=(5, 1, 1)))
    assert (p["pods"]["a"][1:], p["pods"]["b"][1:], p["events_per_s"]) == ([10, 0, 2], [5, 1, 1], 3)

    # B has not published since: it keeps its rates (no dip to zero between its publications).
    p = point(1002.0, snapshot("A", 1001.9, a=(20, 0, 4)), snapshot("B", 1000.5, b=(5, 1, 1)))
    assert (p["pods"]["a"][1:], p["pods"]["b"][1:], p["events_per_s"]) == ([10, 0, 2], [5, 1, 1], 3)

    # A restarted (its counters went down: they count from zero); B's rate spans its 2 seconds.
    p = point(1003.0, snapshot("A", 1002.9, a=(3, 0, 1)), snapshot("B", 1002.5, b=(15, 1, 3)))
    assert (p["pods"]["a"][1:], p["pods"]["b"][1:], p["events_per_s"]) == ([3, 0, 1], [5, 0, 1], 2)

    # B is gone; A stopped publishing long enough ago that its rates are no longer current.
    p = point(1010.0, snapshot("A", 1002.9, a=(3, 0, 1)))
    assert (p["pods"], p["events_per_s"]) == ({"a": [0, None, None, None]}, None)


def test_several_ingest_processes_record_each_interval_once(client):
    """Each computes the fleet's point from the same shared inputs; the first one's stays."""
    one, two = HistoryRecorder(levels=(SECOND,)), HistoryRecorder(levels=(SECOND,))
    blocks = {"pod-a": 25}
    assert record(one, client, 1000.1, blocks=blocks) == [1]
    assert record(two, client, 1000.6, blocks=blocks) == []
    assert record(two, client, 1001.2, blocks=blocks) == [1]
    assert record(one, client, 1001.4, blocks=blocks) == []
    points = read_history(client, SECOND, after=0)
    assert [(p["t"], p["blocks"]) for p in points] == [(1000, 25), (1001, 25)]


def test_scoring_rates_add_up_web_processes_and_gateways(client):
    recorder = HistoryRecorder(levels=(SECOND,))

    def scoring(at, web1, web2, gateway):
        return {
            "web:host:1": {"at": at, "requests": web1[0], "hits": web1[1]},
            "web:host:2": {"at": at, "requests": web2, "hits": None},  # counts no hits
            "gateway:http://gw": {"at": at - 0.3, "requests": gateway[0], "hits": gateway[1]},
        }

    record(recorder, client, 1000.0)
    assert read_history(client, SECOND, after=0)[-1]["score_requests_per_s"] is None  # no source
    record(recorder, client, 1001.0, scoring=scoring(1000.8, (100, 50), 40, (60, 60)))
    record(recorder, client, 1002.0, scoring=scoring(1001.8, (110, 55), 44, (66, 66)))
    p = read_history(client, SECOND, after=1001.5)[-1]
    assert p["score_requests_per_s"] == 20  # 10 + 4 + 6 in one second
    assert p["hit_rate"] == pytest.approx(11 / 20)


def test_a_point_carries_the_pods_holding_most_blocks_and_counts_them_all(client):
    recorder = HistoryRecorder(levels=(SECOND,), pods=2)
    before = snapshot("A", 999.0, small=(0, 0, 0), big=(0, 0, 0), mid=(0, 0, 0))
    after = snapshot("A", 1000.0, small=(1, 0, 1), big=(1, 0, 1), mid=(1, 0, 1))
    record(recorder, client, 999.5, before, blocks={"small": 1, "big": 9, "mid": 4})
    record(recorder, client, 1000.5, after, blocks={"small": 1, "big": 9, "mid": 4})
    p = read_history(client, SECOND, after=999.5)[-1]
    assert list(p["pods"]) == ["big", "mid"]
    assert (p["blocks"], p["events_per_s"]) == (14, 3)


def test_the_index_not_answering_leaves_block_counts_unknown_not_zero(client):
    recorder = HistoryRecorder(levels=(SECOND,))
    recorder.record(
        client, now=1000.0, snapshots=[snapshot("A", 999.9, a=(1, 0, 1))], blocks=None, scoring={}
    )
    p = read_history(client, SECOND, after=0)[-1]
    assert (p["blocks"], p["pods"]) == (None, {"a": [None, None, None, None]})


@pytest.mark.parametrize(
    ("pods", "name", "megabytes"),
    [(8, "sim-{}", 3.6), (64, "vllm-pod-{:02d}", 25)],
)
def test_the_history_memory_is_bounded(client, pods, name, megabytes):
    """Every level full (and more offered) of points for ``pods`` pods: what the docs state."""
    point = {
        "blocks": 123456,
        "events_per_s": 123.45,
        "score_requests_per_s": 12.34,
        "hit_rate": 0.5432,
        "pods": {name.format(i): [12345, 12.34, 1.23, 2.34] for i in range(pods)},
    }
    for level in HISTORY_LEVELS:
        pipe = client.pipeline(transaction=False)
        for i in range(level.length + 100):
            record_point(pipe, level, t=1_700_000_000 + i * level.step, point=point)
        pipe.execute()
        assert client.xlen(level.key) == level.length
    used = sum(client.memory_usage(level.key, samples=0) for level in HISTORY_LEVELS)
    assert used < megabytes * 1e6


@pytest.fixture
def pipeline(settings, redis_url) -> Iterator[tuple[Harness, Housekeeping]]:
    settings.REDIS_URL = redis_url
    settings.KVCACHE_INDEX_BACKEND = "redis"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    with ingest_housekeeping(redis_url) as running:
        yield running


@pytest.mark.django_db(transaction=True)
def test_housekeeping_records_what_a_real_pipeline_applies(pipeline, client, base_capture):
    harness, housekeeping = pipeline
    pub = harness.publisher("pod-a")
    housekeeping.run_once()
    pub.send([stored_event(base_capture)])
    harness.sync("pod-a")
    before = read_history(client, SECOND, after=0)[-1]["t"]
    deadline = time.monotonic() + 5
    while not any(p["pods"]["pod-a"][1] for p in read_history(client, SECOND, after=before)):
        assert time.monotonic() < deadline, "no point with pod-a's stored blocks"
        time.sleep(0.05)
        housekeeping.run_once()
    point = read_history(client, SECOND, after=before)[-1]
    assert point["pods"]["pod-a"][0] == 25
    assert point["pods"]["pod-a"][1] > 0  # blocks stored per second
    assert point["blocks"] == 25
    assert client.xlen("kv:history:10s") >= 1
