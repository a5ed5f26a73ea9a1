"""The dashboard's totals under ``manage.py serve --workers 2``: the scoring requests per second and
the hit rate its websocket sends count the requests of both worker processes, whichever worker
serves the page (they read every worker's counters, as ``/metrics`` does), while each worker still
publishes only its own counters for the charts' history (``dashboard.traffic``), so that the
history's sum counts every request once."""

from __future__ import annotations

import http.client
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client import REGISTRY
from prometheus_client.multiprocess import MultiProcessCollector
from websockets.sync.client import ClientConnection, connect

from dashboard import selectors
from kvindex import open_index
from kvindex.base import StoredBlock
from kvindex.keys import block_digest, key_of, root_digest
from kvindex.shared_stats import read_scoring
from tests.dashboard.conftest import Process, prepare_site
from tests.servers import free_port, service_env, wait_until

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"  # service_env's
PASSWORD = "workers-test-password-not-secret"
HELD = list(range(64))  # 4 blocks, held by pod-a: a hit
NOT_HELD = list(range(1000, 1064))  # held by nobody: a miss
BATCH = 8  # concurrent requests, each on a new connection: the kernel spreads them over the workers
MAX_REQUESTS = 200


def test_without_several_workers_the_totals_read_this_process():
    assert selectors.all_workers_metrics() is REGISTRY


def hold_blocks(redis_url: str, *, pod: str, tokens: list[int]) -> None:
    """Record in the index that ``pod`` holds every full block of ``tokens`` (as ingest would)."""
    digest, blocks = root_digest(SEED), []
    for start in range(0, len(tokens), 16):
        digest = block_digest(digest, tokens[start : start + 16])
        blocks.append(StoredBlock(key_of(digest), key_of(digest), digest))
    index = open_index(redis_url)
    try:
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks)
    finally:
        index.close()


@pytest.fixture
def web(tmp_path: Path, redis_url: str) -> Iterator[dict]:
    """``manage.py serve --workers 2`` on the test Redis, with a superuser and a fast push, and a
    ``manage.py ingest`` beside it as in every deployment: the snapshot it sends each second over
    the channel layer keeps the dashboard consumer's blocking read of that layer short (a read
    left waiting 5 s times out under redis-py 8's default socket timeout, closing the page)."""
    env = service_env(
        tmp_path,
        redis_url,
        HF_HUB_OFFLINE="1",
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
        DASHBOARD_PUSH_SECONDS="0.2",
    )
    prepare_site(env)
    manage = [sys.executable, "manage.py"]
    port = free_port()
    ingest = Process(
        [*manage, "ingest", "--bind", f"tcp://127.0.0.1:{free_port()}"], env, tmp_path / "ingest.log"
    )
    server = Process([*manage, "serve", "--port", str(port), "--workers", "2"], env, tmp_path / "web.log")
    ingest.start()
    server.start()
    try:
        wait_until(lambda: score(port, HELD) is not None, timeout=30, what=f"serve; see {server.log}")
        yield {"port": port, "metrics_dir": tmp_path / f"metrics-{port}"}
    finally:
        server.stop()
        ingest.stop()


def score(port: int, tokens: list[int]) -> dict | None:
    """One score request on a new connection; its scores (None: no answer yet)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": MODEL, "token_ids": tokens})
        connection.request("POST", "/api/v1/score", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
    except OSError:
        return None
    finally:
        connection.close()
    assert response.status == 200, answer
    return answer["scores"]


def requests_by_worker(metrics_dir: Path) -> list[float]:
    """Each worker's own ``kvcache_scoring_requests_total``, from its counter file."""
    return [
        sum(
            sample.value
            for family in MultiProcessCollector.merge([str(path)])
            for sample in family.samples
            if sample.name == "kvcache_scoring_requests_total"
        )
        for path in sorted(metrics_dir.glob("counter_*.db"))
    ]


def open_dashboard(port: int) -> ClientConnection:
    """The fleet dashboard's websocket, logged in as the superuser through the admin login form."""
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=10) as browser:
        browser.get("/admin/login/")
        form = {"username": "ops", "password": PASSWORD, "csrfmiddlewaretoken": browser.cookies["csrftoken"]}
        browser.post("/admin/login/?next=/admin/", data=form)
        session = browser.cookies["sessionid"]
    return connect(
        f"ws://127.0.0.1:{port}/ws/dashboard/",
        origin=base,
        additional_headers={"Cookie": f"sessionid={session}"},
        open_timeout=10,
    )


def next_frame(dashboard: ClientConnection) -> dict:
    while True:
        message = json.loads(dashboard.recv(timeout=10))
        if message["type"] == "frame":
            return message


def test_the_totals_count_the_requests_of_every_worker(web, redis_url):
    port, metrics_dir = web["port"], web["metrics_dir"]
    hold_blocks(redis_url, pod="pod-a", tokens=HELD)
    assert score(port, HELD) == {"pod-a": 4.0}  # serve answered it already: the counters exist
    before = 2  # that request and the fixture's

    with open_dashboard(port) as dashboard:
        baseline = wait_until(
            lambda: (frame := next_frame(dashboard))["totals"]["scoring_available"] and frame,
            timeout=10,
            what="a frame with scoring counters",
        )

        # Half hits, half misses, until both workers have served some.
        sent = hits = 0
        with ThreadPoolExecutor(BATCH) as pool:
            while sum(n > 0 for n in requests_by_worker(metrics_dir)) < 2:
                assert sent < MAX_REQUESTS, f"one worker got all {sent}: {requests_by_worker(metrics_dir)}"
                prompts = [HELD if i % 2 == 0 else NOT_HELD for i in range(BATCH)]
                answers = list(pool.map(lambda tokens: score(port, tokens), prompts))
                sent += BATCH
                hits += sum(bool(scores) for scores in answers)
        assert sum(requests_by_worker(metrics_dir)) == before + sent
        assert max(requests_by_worker(metrics_dir)) < before + sent

        # The totals are rates since the last frame: over the frames since the baseline they add
        # up to the requests and hits sent since, whichever worker serves the page.
        counted = {"requests": 0.0, "hits": 0.0}
        at, deadline = baseline["at"], time.monotonic() + 10
        while counted["requests"] < sent - 1e-6 and time.monotonic() < deadline:
            frame = next_frame(dashboard)
            totals, seconds = frame["totals"], frame["at"] - at
            if seconds > 0:  # a frame younger than the push interval is sent again
                requests = totals["score_requests_per_s"] * seconds
                counted["requests"] += requests
                counted["hits"] += (totals["hit_rate"] or 0.0) * requests
                at = frame["at"]
        assert counted == {"requests": pytest.approx(sent), "hits": pytest.approx(hits)}

    # Each worker publishes its own counters for the history: summed, every request once.
    def published(client: redis.Redis) -> float:
        values = read_scoring(client, now=time.time())
        return sum(v["requests"] for source, v in values.items() if source.startswith("web:"))

    with redis.Redis.from_url(redis_url) as client:
        wait_until(lambda: published(client) == before + sent, timeout=5, what="the workers' counters")
