"""One bad pod harms no other (issue 27, defect 9): whatever a pod's ``/metrics`` answers (a count
that is not a number, NaN, infinities, a body without end, a drip, nothing at all, bytes that are
not text), the gateway keeps scraping the other pods once a second and the liveness prober of a
real ``manage.py ingest`` keeps marking pods down and up; each failure is counted by reason."""

from __future__ import annotations

import asyncio
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.app import GatewayApp, GatewayHandles, GatewaySettings
from kvindex import open_index
from registry.config import ServiceConfig
from registry.snapshot import ConfigSource
from tests.ingest.test_command import ROOT
from tests.loadgen.fake_fleet import Served
from tests.servers import Served as ServedGateway
from tests.servers import free_port, service_env, wait_until
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
FILLER = b"# " + b"x" * 1022 + b"\n"  # a 1 KiB line of an endless body

BAD_METRICS: dict[str, bytes | str | int] = {
    "not-a-number": b"vllm:num_requests_running 1.2.3\n",  # the pod
    "nan": b"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n",
    "overflow": b"vllm:num_requests_running 1e999\n",
    "negative": b"vllm:num_requests_waiting -3\n",
    "not-text": b"vllm:num_requests_running \xff\xfe\n",
    "endless": "endless",  # comment lines without end, as fast as they go
    "drip": "drip",  # a line every 0.1 s, without end
    "silent": "silent",  # answers nothing until the client leaves
    "error": 500,
}
"""Pod name -> what its /metrics answers (its /health answers 200)."""


@dataclass
class FakePod:
    """A pod whose ``/health`` answers 200 and whose ``/metrics`` answers ``metrics``: bytes as
    they are, a status, or one of the behaviours of ``BAD_METRICS``; ``scrapes`` counts them."""

    metrics: bytes | str | int
    scrapes: int = 0

    def app(self) -> Starlette:
        async def metrics(request: Request) -> Response:
            self.scrapes += 1
            if isinstance(self.metrics, bytes):
                return Response(self.metrics, media_type="text/plain; version=0.0.4")
            if isinstance(self.metrics, int):
                return PlainTextResponse("failing", status_code=self.metrics)
            if self.metrics == "silent":
                while not await request.is_disconnected():
                    await asyncio.sleep(0.05)
                return Response(b"")

            async def body() -> Iterator[bytes]:
                while True:
                    if self.metrics == "drip":
                        await asyncio.sleep(0.1)
                        yield b"vllm:num_requests_running 1\n"
                    else:
                        yield FILLER * 64
                        await asyncio.sleep(0)

            return StreamingResponse(body(), media_type="text/plain")

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        async def complete(request: Request) -> Response:
            return JSONResponse({"choices": [{"text": "ok"}]})

        return Starlette(
            routes=[
                Route("/metrics", metrics),
                Route("/health", health),
                Route("/v1/completions", complete, methods=["POST"]),
            ]
        )


@dataclass
class Fleet:
    pods: dict[str, FakePod]
    served: dict[str, Served]

    def address(self, pod: str) -> str:
        return f"127.0.0.1:{self.served[pod].port}"

    def stop(self, pod: str) -> None:
        self.served.pop(pod).stop()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    """Two good pods (``busy`` runs 7 requests, ``free`` none) and every bad pod."""
    pods = {
        "busy": FakePod(b"vllm:num_requests_running 7\nvllm:num_requests_waiting 0\n"),
        "free": FakePod(b'vllm:num_requests_running{engine="0"} 0.0\n'),
        **{name: FakePod(metrics) for name, metrics in BAD_METRICS.items()},
    }
    fleet = Fleet(pods, {name: Served(pod.app()) for name, pod in pods.items()})
    yield fleet
    for served in fleet.served.values():
        served.stop()


def counter(text: str, name: str, reason: str) -> float:
    found = re.search(rf'^{name}{{reason="{reason}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_gateway_scrapes_good_pods_every_second_whatever_bad_pods_answer(fleet: Fleet) -> None:
    good = ("busy", "free")
    addresses = {pod: fleet.address(pod) for pod in fleet.served}
    addresses["closed"] = f"127.0.0.1:{free_port()}"
    config = ServiceConfig(
        pods={pod: MODEL if pod in good else "bad/model" for pod in addresses}, pod_addresses=addresses
    )
    index = open_index("memory://")
    app = GatewayApp(
        GatewayHandles(
            config=ConfigSource(lambda: config, max_age=0.0),
            index=lambda: index,
            tokenizers=lambda _config: TokenizerRegistry(),
            sandbox=lambda: None,
        ),
        GatewaySettings(policy="least-loaded", seed=7),
    )
    gateway = ServedGateway(app)  # with its lifespan: the scraper stops with it
    metrics_url = f"{gateway.url}/metrics"
    try:
        before = httpx.get(metrics_url, timeout=10).text
        # The first request starts the scraper (and hands it the registry).
        httpx.post(f"{gateway.url}/v1/completions", json={"model": "no/such-model"}, timeout=10)
        wait_until(
            lambda: all(fleet.pods[p].scrapes for p in BAD_METRICS), timeout=10, what="a scrape of each"
        )
        counted = {pod: fleet.pods[pod].scrapes for pod in good}
        time.sleep(4.0)
        for pod in good:  # once a second: 4 expected; the scraper used to die at the first bad answer
            assert fleet.pods[pod].scrapes - counted[pod] >= 2, f"{pod} scraped {fleet.pods[pod].scrapes}x"
        # Their load is known: least-loaded sends every request to the pod that runs none.
        for _ in range(3):
            routed = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL}, timeout=10)
            assert routed.headers["x-kvcache-pod"] == "free"
        after = httpx.get(metrics_url, timeout=10).text
    finally:
        gateway.stop()
        index.close()
    name = "kvcache_gateway_scrape_failures_total"
    grew = {reason: counter(after, name, reason) - counter(before, name, reason) for reason in
            ("malformed", "too_large", "timeout", "connect", "status")}  # fmt: skip
    assert grew["malformed"] >= 5 * 2  # not-a-number, nan, overflow, negative, not-text: each round
    assert grew["too_large"] >= 2  # endless
    assert grew["timeout"] >= 2 * 2  # drip, silent
    assert grew["connect"] >= 2 and grew["status"] >= 2
    assert re.search(r"^kvcache_gateway_scrapes_total \S+$", after, re.MULTILINE)


REGISTRY = """
from registry.models import Pod
for pod, address in {pods!r}.items():
    Pod.objects.create(pod_id=pod, model="{model}", address=address)
"""


def test_ingest_marks_pods_down_and_up_while_bad_pods_answer_their_metrics(
    tmp_path, redis_url, fleet: Fleet
) -> None:
    """The issue's run: with a pod whose ``/metrics`` says ``1.2.3`` every round failed
    (``liveness probe round failed``), so a stopped pod was never marked down and a new pod never
    came up. Each bad pod now fails alone (counted), keeping its own verdict: up."""
    env = service_env(tmp_path, redis_url, KVCACHE_POD_DOWN_SECONDS="0.5", KVCACHE_POD_FORGET_SECONDS="0")
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    first = {pod: fleet.address(pod) for pod in fleet.served if pod != "free"}  # "free" comes later
    subprocess.run(
        [*manage, "shell", "-c", REGISTRY.format(pods=first, model=MODEL)], cwd=ROOT, env=env, check=True
    )
    metrics_port = free_port()
    proc = subprocess.Popen(
        [*manage, "ingest", "--bind", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(metrics_port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def health() -> dict[str, str]:
        with sqlite3.connect(tmp_path / "db.sqlite3") as db:
            return dict(db.execute("select pod_id, health from scoring_pod"))

    def says(expected: dict[str, str]) -> bool:
        now = health()
        return all(now.get(pod) == h for pod, h in expected.items())

    try:
        every_up = {**{pod: "up" for pod in first}, "busy": "busy"}  # quiet and serving: busy
        wait_until(lambda: says(every_up), timeout=20, what=f"the registry to say {every_up}")
        fleet.stop("busy")  # a pod that stops: down
        wait_until(lambda: says({"busy": "down"}), timeout=15, what="the stopped pod down")
        new = {"free": fleet.address("free")}  # a pod that is added: up
        subprocess.run(
            [*manage, "shell", "-c", REGISTRY.format(pods=new, model=MODEL)], cwd=ROOT, env=env, check=True
        )
        wait_until(lambda: says({"free": "up"}), timeout=15, what="the new pod up")
        assert says({pod: "up" for pod in BAD_METRICS}), health()  # each kept its verdict

        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        name = "kvcache_liveness_metrics_failures_total"
        assert counter(text, name, "malformed") >= 5
        assert counter(text, name, "too_large") >= 1
        assert counter(text, name, "timeout") >= 2
        assert counter(text, name, "status") >= 1
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, output
        assert "liveness probe round failed" not in output
        assert "pod not-a-number: no request counts from its /metrics (malformed" in output
        # Logged when its reason changes, not once a round (a slow answer may time out once or twice).
        assert output.count("pod not-a-number: no request counts") <= 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
