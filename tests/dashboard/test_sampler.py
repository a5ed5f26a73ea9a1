"""The web process's fleet sampler against real sources: the registry database, an index, the
ingest snapshots in Redis, a Prometheus registry."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from dashboard import selectors
from dashboard.sampler import LOG_SIZE, FleetSampler
from kvindex import open_index
from kvindex.base import Store, StoredBlock
from kvindex.epochs import READY, RESYNCING, marker
from kvindex.shared_stats import publish_snapshot
from registry.models import Pod
from registry.runtime import invalidate_service_config, set_index
from tests.dashboard.conftest import stream, unreachable_url

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def index(settings, redis_url) -> Iterator:
    """The web side's index: the same Redis the ingest snapshots are shared through."""
    settings.REDIS_URL = redis_url
    settings.KVCACHE_INDEX_BACKEND = "redis"
    idx = open_index(redis_url)
    set_index(idx)
    yield idx
    set_index(None)
    idx.close()


def make_sampler(**overrides) -> FleetSampler:
    options = {
        "min_interval": 0.0,
        "stale_after": 30.0,
        "group_silence": float("inf"),
        "metrics": CollectorRegistry(),
    }
    return FleetSampler(**{**options, **overrides})


def snapshot(at: float, *streams: dict, instance: str = "ingest-1", unattributed: dict | None = None) -> dict:
    return {
        "at": at,
        "started_at": at - 100,
        "instance": instance,
        "streams": list(streams),
        "unattributed_errors": unattributed or {},
        "queue_full": {},
    }


def store(index, pod: str, n: int, *, tier: str = "gpu") -> None:
    blocks = [StoredBlock(key, key, key.to_bytes(8, "big")) for key in range(1, n + 1)]
    index.apply_updates([Store(MODEL, pod, tier, blocks)])


def test_a_snapshot_counts_once_however_many_consumers_hand_it_over():
    sampler = make_sampler()
    first = snapshot(100.0, stream("a", blocks_stored=1))
    assert sampler.observe(first)
    assert not sampler.observe(first)
    assert not sampler.observe(snapshot(99.0, stream("a", blocks_stored=9)))


@pytest.mark.django_db
def test_rates_and_activity_come_from_the_second_snapshot_on(index):
    sampler = make_sampler()
    now = time.time()
    sampler.observe(snapshot(now - 2, stream("a", blocks_stored=10, last_event_at=now - 2)))
    [row] = sampler.frame()["pods"]
    assert row["stored_per_s"] is None
    assert sampler.pod_log("a") == []

    sampler.observe(snapshot(now, stream("a", blocks_stored=30, batches=2, last_event_at=now)))
    [row] = sampler.frame()["pods"]
    assert row["stored_per_s"] == pytest.approx(10.0)
    [entry] = sampler.pod_log("a")
    assert (entry["blocks_stored"], entry["batches"]) == (20, 2)


def test_the_activity_log_is_bounded():
    sampler = make_sampler()
    for i in range(LOG_SIZE + 10):
        sampler.observe(snapshot(float(i + 1), stream("a", batches=i)))
    log = sampler.pod_log("a")
    assert len(log) == LOG_SIZE
    assert log[0]["at"] > log[-1]["at"]  # newest first


@pytest.mark.django_db
def test_a_frame_joins_registry_index_and_streams(index):
    Pod.objects.create(pod_id="registered", model=MODEL, enabled=False)
    store(index, "indexed", 3)
    store(index, "indexed#dp1", 2, tier="cpu")
    sampler = make_sampler()
    now = time.time()
    sampler.observe(snapshot(now, stream("streaming", last_event_at=now), unattributed={"bad_topic": 4}))
    frame = sampler.frame()
    rows = {r["pod"]: r for r in frame["pods"]}
    assert set(rows) == {"registered", "indexed", "streaming"}
    assert rows["indexed"]["blocks_by_tier"] == {"cpu": 2, "gpu": 3}
    assert rows["registered"]["status"] == "disabled"
    assert rows["streaming"]["status"] == "active"
    totals = frame["totals"]
    assert (totals["pods"], totals["blocks"], totals["decode_errors"]) == (3, 5, 4)
    assert totals["ingest_processes"] == 1
    assert totals["index_available"] is True
    assert totals["scoring_available"] is False  # no kvcache_score counter: the page says n/a


@pytest.mark.django_db
def test_a_frame_says_which_models_the_index_is_rebuilding(index):
    Pod.objects.create(pod_id="p", model=MODEL)
    invalidate_service_config()
    assert make_sampler().frame()["totals"]["index_resyncing"] == []
    index.set_epoch(model=MODEL, value=marker("t1", RESYNCING))
    assert make_sampler().frame()["totals"]["index_resyncing"] == [MODEL]
    index.set_epoch(model=MODEL, value=marker("t1", READY))
    assert make_sampler().frame()["totals"]["index_resyncing"] == []


@pytest.mark.django_db
def test_a_process_that_stopped_publishing_is_forgotten(index):
    sampler = make_sampler()
    sampler.observe(snapshot(time.time() - 60, stream("gone", last_event_at=time.time() - 60)))
    assert sampler.frame()["totals"]["ingest_processes"] == 0


@pytest.mark.django_db
def test_frames_are_shared_within_the_interval(index):
    sampler = make_sampler(min_interval=60.0)
    first = sampler.frame()
    store(index, "late", 1)
    assert sampler.frame() is first


@pytest.mark.django_db
def test_the_gateways_routed_requests_count_as_scoring_traffic(index, settings):
    from gateway import metrics as gateway_metrics

    class Exposition(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # a gateway's /metrics, as its registry renders it
            body = generate_latest(gateway_metrics.REGISTRY)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.KVCACHE_GATEWAY_URLS = [f"http://127.0.0.1:{server.server_address[1]}", "http://127.0.0.1:9"]
    try:
        sampler = make_sampler()
        sampler.frame()
        gateway_metrics.REQUESTS.labels("kv-load", "sim-0", "ok").inc(10)
        gateway_metrics.HITS.labels("kv-load").inc(4)
        totals = sampler.frame()["totals"]
        assert totals["scoring_available"] is True
        assert totals["score_requests_per_s"] > 0
        assert totals["hit_rate"] == pytest.approx(0.4)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.django_db
def test_a_frame_shows_each_gateway_and_one_that_cannot_be_reached_as_such(index, settings, gateway_metrics):
    refused = unreachable_url()
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url, refused]
    counted = gateway_metrics.metrics
    counted.REQUESTS.labels("round-robin", "sim-0", "ok").inc(4)
    sampler = make_sampler()
    up, down = sampler.frame()["gateways"]
    assert (up["url"], up["reachable"]) == (gateway_metrics.url, True)
    assert (up["policy"], up["requests"]) == ("round-robin", 4)
    assert up["requests_per_s"] is None  # one scrape: nothing to differentiate yet
    assert (down["url"], down["reachable"], down["requests"], down["pods"]) == (refused, False, None, [])
    assert down["error"].startswith("ConnectError")

    counted.REQUESTS.labels("round-robin", "sim-1", "ok").inc(4)
    counted.RETRIES.labels("round-robin", "connect").inc(2)
    counted.HITS.labels("round-robin").inc(2)
    for _ in range(4):
        counted.TTFT.labels("round-robin").observe(0.3)
    frame = sampler.frame()
    up = frame["gateways"][0]
    seconds = up["window_seconds"]
    assert seconds > 0
    assert up["requests_per_s"] == pytest.approx(4 / seconds)
    assert up["retries_per_s"] == pytest.approx(2 / seconds)
    assert (up["retries"], up["retries_by_reason"]) == (2, {"connect": 2})
    assert (up["hit_rate"], up["hit_rate_overall"]) == (0.5, 0.25)
    assert (up["ttft_p50"], up["ttft_p90"]) == (pytest.approx(0.375), pytest.approx(0.475))
    decisions = [(p["pod"], p["requests"], p["share"]) for p in up["pods"]]
    assert decisions == [("sim-0", 4, 0.5), ("sim-1", 4, 0.5)]
    assert frame["totals"]["scoring_available"] is True

    gateway_metrics.close()
    frame = sampler.frame()
    assert [g["reachable"] for g in frame["gateways"]] == [False, False]
    assert frame["gateways"][0]["requests"] is None
    assert frame["totals"]["scoring_available"] is False  # no traffic known: n/a, not zero


@pytest.mark.django_db
def test_a_gateway_s_recent_numbers_cover_only_the_window(index, settings, gateway_metrics):
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url]
    counted = gateway_metrics.metrics.REQUESTS.labels("kv", "sim-0", "ok")
    sampler = make_sampler(gateway_window=0.2)
    counted.inc(100)
    sampler.frame()
    time.sleep(0.3)
    [row] = sampler.frame()["gateways"]
    assert row["window_seconds"] is None  # the first scrape left the window
    counted.inc(1)
    [row] = sampler.frame()["gateways"]
    assert row["requests_per_s"] == pytest.approx(1 / row["window_seconds"])


@pytest.mark.django_db
def test_scoring_rates_come_from_the_registry_counters(index):
    metrics = CollectorRegistry()
    requests = Counter("kvcache_score_requests", "scored", registry=metrics)
    hits = Counter("kvcache_score_hits", "scored with a hit", registry=metrics)
    sampler = make_sampler(metrics=metrics)
    sampler.frame()
    requests.inc(8)
    hits.inc(2)
    totals = sampler.frame()["totals"]
    assert totals["scoring_available"] is True
    assert totals["hit_rate_available"] is True
    assert totals["score_requests_per_s"] > 0
    assert totals["hit_rate"] == pytest.approx(0.25)


@pytest.mark.django_db
def test_redis_is_read_only_while_the_group_is_silent(index, redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    now = time.time()
    publish_snapshot(client, snapshot(now, stream("via-redis", last_event_at=now)), instance="ingest-1")

    silent = make_sampler(group_silence=0.0)
    assert [r["pod"] for r in silent.frame()["pods"]] == ["via-redis"]

    listening = make_sampler(group_silence=60.0)
    listening.observe(snapshot(now, stream("via-group", last_event_at=now), instance="ingest-2"))
    assert [r["pod"] for r in listening.frame()["pods"]] == ["via-group"]


@pytest.mark.django_db
def test_two_hundred_pods_make_a_quick_frame_of_modest_size(index):
    now = time.time()
    pods = [f"pod-{i:03d}" for i in range(200)]
    Pod.objects.bulk_create(Pod(pod_id=p, model=MODEL) for p in pods)
    for p in pods:
        store(index, p, 16)
    sampler = make_sampler()
    streams = [stream(p, blocks_stored=16, events=1, last_event_at=now) for p in pods]
    sampler.observe(snapshot(now - 1, *streams))
    sampler.observe(snapshot(now, *[{**s, "blocks_stored": 32} for s in streams]))
    started = time.perf_counter()
    frame = sampler.frame()
    elapsed = time.perf_counter() - started
    assert len(frame["pods"]) == 200
    assert all(r["stored_per_s"] == pytest.approx(16.0) for r in frame["pods"])
    assert elapsed < 0.5, f"a 200-pod frame took {elapsed:.3f}s"
    assert len(json.dumps(frame)) < 150_000


def test_the_scoring_counters_are_absent_until_registered():
    metrics = CollectorRegistry()
    assert selectors.scoring_counters(metrics) is None
    Counter("kvcache_scoring_requests", "scored", ["outcome"], registry=metrics).labels("ok").inc(3)
    Counter("kvcache_other_requests", "not scoring", registry=metrics).inc(100)
    counters = selectors.scoring_counters(metrics)
    assert (counters.requests, counters.hits) == (3.0, None)  # no hits counter: no hit rate
