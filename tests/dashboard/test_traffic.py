"""A web process shares the scoring traffic the charts show: its own counters (a real Prometheus
registry) and each gateway's (its real ``/metrics`` over HTTP) reach Redis, and the history ingest
records from them counts a gateway once however many web processes publish it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter

from dashboard import selectors
from dashboard.traffic import publish_once
from ingest.history import HistoryRecorder
from kvindex.shared_stats import HistoryLevel, instance_id, read_history, read_scoring
from tests.dashboard.conftest import unreachable_url


@pytest.fixture
def client(redis_url) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def scoring_registry() -> tuple[CollectorRegistry, Counter, Counter]:
    """What the fast path registers (``scoring.fastpath.metrics``), in a registry of the test's."""
    registry = CollectorRegistry()
    requests = Counter("kvcache_scoring_requests", "scored", ["endpoint", "outcome"], registry=registry)
    hits = Counter("kvcache_scoring_hits", "scored with a hit", ["endpoint"], registry=registry)
    requests.labels("score", "ok")  # the first request made them: they count from zero
    hits.labels("score")
    return registry, requests, hits


def test_a_web_process_publishes_its_counters_and_each_reachable_gateway_s(
    client, settings, gateway_metrics, scoring_registry
):
    registry, requests, hits = scoring_registry
    requests.labels("score", "ok").inc(8)
    hits.labels("score").inc(2)
    gateway_metrics.metrics.REQUESTS.labels("kv-load", "sim-0", "ok").inc(5)
    gateway_metrics.metrics.HITS.labels("kv-load").inc(3)
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url, unreachable_url()]
    published = publish_once(client, registry=registry, gateways=selectors.scrape_gateways())
    web, gateway = f"web:{instance_id()}", f"gateway:{gateway_metrics.url}"
    assert published == [web, gateway]  # the unreachable gateway: nothing known, nothing published
    shared = read_scoring(client)
    assert (shared[web]["requests"], shared[web]["hits"]) == (8, 2)
    assert (shared[gateway]["requests"], shared[gateway]["hits"]) == (5, 3)


def test_a_process_without_a_score_api_publishes_only_the_gateways(client, gateway_metrics, settings):
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url]
    assert publish_once(client, registry=CollectorRegistry(), gateways=selectors.scrape_gateways()) == [
        f"gateway:{gateway_metrics.url}"
    ]


def test_the_recorded_history_counts_a_gateway_once_whoever_publishes_it(
    client, settings, gateway_metrics, scoring_registry
):
    registry, requests, _ = scoring_registry
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url]
    routed = gateway_metrics.metrics.REQUESTS.labels("kv-load", "sim-0", "ok")
    level = HistoryLevel(step=1, length=600)
    recorder = HistoryRecorder(levels=(level,))

    def second(now: float) -> dict:
        for _ in range(3):  # three web processes scrape the same gateway
            publish_once(client, registry=CollectorRegistry(), gateways=selectors.scrape_gateways())
        publish_once(client, registry=registry, gateways=[])
        shared = read_scoring(client)
        recorder.record(client, now=now, snapshots=[], blocks={}, scoring=shared)
        return {source: value["at"] for source, value in shared.items()}

    before = second(1000.0)
    requests.labels("score", "ok").inc(4)
    routed.inc(6)
    time.sleep(1.0)  # the sources' own clocks move on: their rates span their publications
    after = second(1001.0)
    assert len(after) == 2  # this web process and the gateway
    web, gateway = (after[s] - before[s] for s in (f"web:{instance_id()}", f"gateway:{gateway_metrics.url}"))
    [_, point] = read_history(client, level, after=0)
    assert point["score_requests_per_s"] == pytest.approx(4 / web + 6 / gateway, abs=0.01)
