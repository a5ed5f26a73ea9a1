"""The monitoring assets in ``deploy/``: the Grafana dashboard and the Prometheus alert rules load
as their tools load them, their PromQL uses each metric as its type allows, and every metric they
name is one the processes really expose.

The exposition comes from the real code paths, in this process: the ingest pipeline receives KV
events (and one malformed message) over ZeroMQ and its registry is built as ``manage.py ingest``
builds it; the web's ``/metrics`` is read through its ASGI application after one score; the
gateway routes requests to stub pods (one answering, one failing with 503, one unreachable) and
its ``/metrics`` is read; the Endpoint Picker, a real gRPC server, is asked about requests over
ext_proc streams as Envoy opens them (no Envoy: a gRPC client plays its part) and its
``--metrics-port`` is read. vLLM's own ``vllm:`` names cannot be rendered here, so the assets use
none (one that appeared would be reported as not exposed).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import queue
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp import metrics as epp_metrics
from epp.server import DESTINATION, SERVED
from gateway.app import GatewayApp, GatewayHandles, GatewaySettings
from ingest.events import BlockStored, encode_message
from ingest.stats import IngestStats, IngestStatsCollector
from kvindex import KVIndex, open_index
from kvindex.shared_stats import publish_snapshot
from registry import runtime
from registry.config import ServiceConfig
from registry.liveness import LivenessCollector, LivenessProber
from registry.models import Pod
from registry.snapshot import ConfigSource
from routing.router import RouterHandles
from tests.asgi import AsgiClient
from tests.epp.harness import Picker
from tests.ingest.conftest import Harness
from tests.servers import free_port, wait_until
from tokenization.tokenizers import TokenizerRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcache-router.json"
RULES = ROOT / "deploy" / "prometheus" / "kvcache-alerts.yaml"

METRIC_NAME = re.compile(r"\b(?:kvcache_|vllm:)[A-Za-z0-9_:]*")
RANGE_FUNCTION = re.compile(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][\w:]*)")
QUANTILE = re.compile(r"histogram_quantile\(\s*[\d.]+\s*,\s*sum by \(([^)]*)\)\s*\(\s*rate\(\s*([\w:]+)")
COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")

MODEL = "Qwen/Qwen3-0.6B"
OTHER_MODEL = "acme/no-tokenizer"  # no tokenizer anywhere: the gateway routes it blind
DOWN_MODEL = "acme/down"  # served by one pod, found down: no live pod
SEED = "42"
BLOCK = 16
WARM = list(range(1000, 1000 + 4 * BLOCK))  # 4 blocks, held by pod-ok
COLD = list(range(5000, 5000 + 4 * BLOCK))  # held by pod-5xx (all 4) and pod-gone (2)


# --- the assets ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its query variables."""
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def metric_names(queries: list[str]) -> set[str]:
    return {name for query in queries for name in METRIC_NAME.findall(query)}


# --- shape ---------------------------------------------------------------------------------------


def test_the_dashboard_is_importable_with_a_datasource_and_a_pod_variable(dashboard):
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert variables["pod"]["type"] == "query"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["expr"].strip() and t["refId"] for t in panel["targets"]), panel["title"]


def test_the_dashboard_panels_fit_the_grid_without_overlapping(dashboard):
    """Grafana's grid is 24 columns wide; a panel placed over another one is moved on import."""
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for y in range(grid["y"], grid["y"] + grid["h"]):
            for x in range(grid["x"], grid["x"] + grid["w"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


def test_every_rule_says_what_it_watches_and_what_to_check(rules):
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert rule["expr"].strip(), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]


def test_the_promql_rates_counters_and_takes_quantiles_of_buckets(dashboard, rules):
    for query in [*dashboard_queries(dashboard), *(rule["expr"] for rule in rules)]:
        for opening, closing in ("()", "[]", "{}"):
            assert query.count(opening) == query.count(closing), query
        for name in RANGE_FUNCTION.findall(query):
            assert name.endswith(COUNTER_SUFFIXES), f"rate/increase over {name}, not a counter: {query}"
        quantiles = QUANTILE.findall(query)
        assert len(quantiles) == query.count("histogram_quantile("), f"write it as sum by (.., le): {query}"
        for labels, name in quantiles:
            assert "le" in re.split(r"\s*,\s*", labels.strip()), query
            assert name.endswith("_bucket"), query


# --- the metrics exist ---------------------------------------------------------------------------


def stored(tokens: list[int], *, first_hash: int) -> BlockStored:
    """The BlockStored event an engine sends for every full block of ``tokens``."""
    n = len(tokens) // BLOCK
    return BlockStored(
        block_hashes=tuple(range(first_hash, first_hash + n)),
        parent_block_hash=None,
        token_ids=tuple(tokens),
        block_size=BLOCK,
        lora_id=None,
        tier="gpu",
        lora_name=None,
        extra_keys=None,
        group_idx=None,
    )


def send_events(harness: Harness) -> None:
    """Blocks for three pods, and one message that is not msgpack (a decode error of pod-ok)."""
    held = (("pod-ok", WARM, 100), ("pod-5xx", COLD, 200), ("pod-gone", COLD[:32], 300))
    for pod, tokens, first_hash in held:
        harness.publisher(pod).send([stored(tokens, first_hash=first_hash)])
        harness.sync(pod)
    ok = harness.publishers[0]
    ok.send_frames(encode_message("pod-ok", MODEL, ok.next_seq, b"\xc1"))
    wait_until(lambda: harness.stream("pod-ok").decode_errors, what="the decode error counted")


def ingest_exposition(stats: IngestStats) -> str:
    """What ``manage.py ingest --metrics-port`` serves: its registry, built as the command does."""
    registry = CollectorRegistry()
    registry.register(IngestStatsCollector(stats))
    registry.register(LivenessCollector(LivenessProber(targets=dict)))
    return generate_latest(registry).decode()


def web_exposition(stats: IngestStats, redis_url: str) -> str:
    """The web's ``/metrics`` after one score, with the ingest stats shared through Redis as the
    ingest command shares them."""
    with redis.Redis.from_url(redis_url) as shared:
        publish_snapshot(shared, stats.snapshot(), instance="ingest-under-test")
    client = AsgiClient()
    scored = client.post("/api/v1/score", data={"model": MODEL, "token_ids": WARM})
    assert scored.json()["scores"] == {"pod-ok": 4.0}
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.content.decode()


@contextlib.contextmanager
def stub_pod(status: int) -> Iterator[str]:
    """A pod's OpenAI API reduced to one answer (``status``, a small JSON body); its address."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"choices": [{"text": "!"}]}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # the gateway's load scraper asks for /metrics
            self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def gateway_exposition(index: KVIndex) -> str:
    """The gateway's ``/metrics`` after three requests: a prefix hit on pod-ok; one whose best
    pods fail (503, then unreachable) before pod-ok answers; one it cannot tokenize."""
    with stub_pod(200) as ok, stub_pod(503) as failing:
        unreachable = f"127.0.0.1:{free_port()}"  # nothing listens there
        addresses = {"pod-ok": ok, "pod-5xx": failing, "pod-gone": unreachable, "pod-other": ok}
        pods = {"pod-ok": MODEL, "pod-5xx": MODEL, "pod-gone": MODEL, "pod-other": OTHER_MODEL}
        config = ServiceConfig(seed=SEED, default_block_size=BLOCK, pods=pods, pod_addresses=addresses)
        tokenizers = TokenizerRegistry()
        app = GatewayApp(
            GatewayHandles(
                config=ConfigSource(lambda: config, max_age=0.0),
                index=lambda: index,
                tokenizers=lambda _config: tokenizers,
                sandbox=lambda: None,
            ),
            GatewaySettings(seed=7),
        )
        requests = [
            {"model": MODEL, "prompt": WARM, "max_tokens": 1},
            {"model": MODEL, "prompt": COLD, "max_tokens": 1},
            {"model": OTHER_MODEL, "prompt": "hello", "max_tokens": 1},
        ]

        async def route() -> tuple[list[httpx.Response], str]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                try:
                    answers = [await client.post("/v1/completions", json=body) for body in requests]
                    return answers, (await client.get("/metrics")).text
                finally:
                    await app.shutdown()

        answers, text = asyncio.run(route())
    assert [a.headers["x-kvcache-pod"] for a in answers] == ["pod-ok", "pod-ok", "pod-other"]
    return text


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=name, raw_value=value.encode()) for name, value in headers.items()]
    )


def header_set(mutation: ext_proc.HeaderMutation, name: str) -> str:
    """The value a picker's mutation sets ``name`` to (``""``: it sets none)."""
    values = [
        option.header.raw_value.decode() for option in mutation.set_headers if option.header.key == name
    ]
    return values[0] if values else ""


def ask_picker(stub: ExternalProcessorStub, body: dict) -> tuple[int, str]:
    """One ``POST /v1/completions`` as Envoy puts it to the picker: the request's headers, its
    body, then, when the picker named endpoints, the response's headers saying the first one
    served (status 200). The status the client gets (the immediate response's when refused) and
    the pod it is told served it (``x-kvcache-pod``; ``""`` when refused)."""
    served: queue.Queue[str | None] = queue.Queue()

    def messages() -> Iterator[ext_proc.ProcessingRequest]:
        request = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
        yield ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=header_map(request)))
        yield ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
        )
        endpoint = served.get(timeout=10)
        if endpoint is not None:
            response = header_map({":status": "200", SERVED: endpoint})
            yield ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(headers=response))

    answers = stub.Process(messages(), timeout=10)
    endpoint = None
    try:
        first = next(answers)
        if not first.HasField("immediate_response"):
            endpoint = header_set(first.request_headers.response.header_mutation, DESTINATION).split(",")[0]
    finally:
        served.put(endpoint)  # the messages go on (or end) whatever the answer
    rest = list(answers)
    if endpoint is None:
        return first.immediate_response.status.code, ""
    return 200, header_set(rest[-1].response_headers.response.header_mutation, "x-kvcache-pod")


def epp_exposition(index: KVIndex) -> str:
    """The Endpoint Picker's ``/metrics`` (its registry and the routing core's ``kvcache_epp_*``
    counts, as ``manage.py epp --metrics-port`` serves them) after five ext_proc streams: a prefix
    hit on pod-ok, which serves it; one it cannot tokenize, served by pod-other; one for a model
    no pod serves (404); one whose only pod is down (503); one out of order (a body first)."""
    pods = {
        "pod-ok": MODEL,
        "pod-5xx": MODEL,
        "pod-gone": MODEL,
        "pod-other": OTHER_MODEL,
        "pod-down": DOWN_MODEL,
    }
    # Nothing listens there: the picker only names the addresses (its load scrapes fail, counted).
    addresses = {pod: f"127.0.0.1:{free_port()}" for pod in pods}
    config = ServiceConfig(
        seed=SEED,
        default_block_size=BLOCK,
        pods=pods,
        pod_addresses=addresses,
        down_pods=frozenset({"pod-down"}),
    )
    tokenizers = TokenizerRegistry()
    handles = RouterHandles(
        config=ConfigSource(lambda: config, max_age=0.0),
        index=lambda: index,
        tokenizers=lambda _config: tokenizers,
        sandbox=lambda: None,
    )
    metrics_port = free_port()
    picker = Picker(handles, endpoints_file=None, metrics_port=metrics_port, metrics=epp_metrics.ROUTING)
    try:
        with grpc.insecure_channel(picker.address) as channel:
            stub = ExternalProcessorStub(channel)
            answers = [
                ask_picker(stub, {"model": model, "prompt": prompt, "max_tokens": 1})
                for model, prompt in (
                    (MODEL, WARM),
                    (OTHER_MODEL, "hello"),
                    ("acme/unknown", "hi"),
                    (DOWN_MODEL, "hi"),
                )
            ]
            body_first = ext_proc.ProcessingRequest(
                request_body=ext_proc.HttpBody(body=b"{}", end_of_stream=True)
            )
            with pytest.raises(grpc.RpcError) as out_of_order:
                list(stub.Process(iter([body_first]), timeout=10))
        assert out_of_order.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    finally:
        picker.stop()
    assert answers == [(200, "pod-ok"), (200, "pod-other"), (404, ""), (503, "")]
    return text


def sample_names(text: str) -> set[str]:
    """Every sample name of an exposition (``_total``, ``_bucket``... included)."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture
def exposed(db, settings, redis_url, monkeypatch) -> set[str]:
    """Every sample name the ingest process, the web, the gateway and the Endpoint Picker expose
    after a little work."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings.KVCACHE_HASH_SEED = SEED
    settings.KVCACHE_API_KEYS = []
    settings.REDIS_URL = redis_url  # where the web reads the ingest stats
    Pod.objects.create(pod_id="pod-ok", model=MODEL)
    index = open_index("memory://")
    harness = Harness(index, ServiceConfig(seed=SEED, default_block_size=BLOCK))
    runtime.set_index(index)
    runtime.invalidate_service_config()
    try:
        send_events(harness)
        texts = [
            ingest_exposition(harness.stats),
            web_exposition(harness.stats, redis_url),
            gateway_exposition(index),
            epp_exposition(index),
        ]
    finally:
        runtime.set_index(None)
        runtime.invalidate_service_config()
        harness.close()
        index.close()
    return set().union(*map(sample_names, texts))


def test_every_metric_the_dashboard_and_the_rules_name_is_exposed(dashboard, rules, exposed):
    for asset, queries in (
        (DASHBOARD.name, dashboard_queries(dashboard)),
        (RULES.name, [rule["expr"] for rule in rules]),
    ):
        missing = metric_names(queries) - exposed
        assert not missing, f"{asset} names metrics no process exposes: {sorted(missing)}"
    # The check bites: a misspelt name, or a histogram's base name, is not a series.
    misspelt = "rate(kvcache_ingest_event_total[5m]) + kvcache_scoring_core_latency_seconds"
    assert metric_names([misspelt]) - exposed == {
        "kvcache_ingest_event_total",
        "kvcache_scoring_core_latency_seconds",
    }
