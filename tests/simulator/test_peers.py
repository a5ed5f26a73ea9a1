"""The peer routers (``bench.peers``) in front of simulated pods: each peer, with each policy we
compare against, starts on our fleet and routes completions and chat completions, plain and
streamed, to the pods; cache_aware keeps a prompt on the pod that has it cached, round_robin
alternates; SMG reads the pods' load from their vLLM metrics. In front of a P/D fleet, each in its
P/D mode prefills every request on a prefill pod and decodes it on a decode pod, which loads the
prompt's KV cache from the prefill pod. Needs ``make bench-peers``; without it these tests skip,
saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.peers import PEERS, PeersNotInstalled, pd_worker_specs, peers_installed, start_pd_peer, start_peer
from simulator.config import EngineConfig, LatencyConfig, PodConfig
from simulator.fleet import FleetConfig, PublishConfig
from simulator.pod import PodTokenizer
from simulator.server import POD_HEADER
from tests.simulator.conftest import MODEL
from tests.simulator.threaded_fleet import ThreadedFleet

needs_peers = pytest.mark.skipif(
    not peers_installed(), reason="the peer routers are not installed: run `make bench-peers`"
)
# Longer than the cache_aware trees' match threshold, and four blocks of 16 tokens at least.
SYSTEM = "You answer questions about KV caches for a routing test, in one short sentence each. " * 4


# Zero-latency pods.
POD = PodConfig(
    pod_id="sim-0",
    model=MODEL,
    engine=EngineConfig(hash_seed="42"),
    latency=LatencyConfig(prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=0),
)


class RunningFleet(ThreadedFleet):
    """Two zero-latency pods on free loopback ports, served from a thread's event loop."""

    def __init__(self, tokenizer: PodTokenizer) -> None:
        config = FleetConfig(pod=POD, pods=2, base_port=0, publish=PublishConfig(endpoint=None))
        super().__init__(config, tokenizer)


class RunningPDFleet(ThreadedFleet):
    """Three zero-latency pods: ``sim-0`` prefills, ``sim-1`` and ``sim-2`` decode."""

    def __init__(self, tokenizer: PodTokenizer) -> None:
        config = FleetConfig(
            pod=POD, pods=3, prefill_pods=1, base_port=0, publish=PublishConfig(endpoint=None)
        )
        super().__init__(config, tokenizer)
        self.prefill, self.decode = self.urls[:1], self.urls[1:]


@pytest.fixture(scope="module")
def fleet(qwen: PodTokenizer) -> Iterator[RunningFleet]:
    running = RunningFleet(qwen)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def pd_fleet(qwen: PodTokenizer) -> Iterator[RunningPDFleet]:
    running = RunningPDFleet(qwen)
    yield running
    running.stop()


def completion(prompt: str, **extra: object) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 64, **extra}


def chat(content: str, **extra: object) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        "max_tokens": 64,
        **extra,
    }


def events(response: httpx.Response) -> list:
    """The data of each server-sent event of a streamed answer; ``[DONE]`` stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(chunks: list) -> str:
    return "".join(
        choice.get("text") or choice.get("delta", {}).get("content") or ""
        for chunk in chunks[:-1]
        for choice in chunk.get("choices", [])
    )


def metric(url: str, name: str) -> float:
    """The sum of a pod's samples ``name`` (all labels) in its ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


# --- bench.peers without the peers ---------------------------------------------------------------


def test_without_the_peers_venv_starting_a_peer_says_to_run_make_bench_peers(tmp_path: Path) -> None:
    assert not peers_installed(tmp_path)
    with pytest.raises(PeersNotInstalled, match="make bench-peers"):
        start_peer("vllm-router", workers=["http://127.0.0.1:1"], policy="round_robin", venv=tmp_path)


@pytest.mark.parametrize(
    ("name", "policy", "message"),
    [("nginx", "round_robin", "unknown peer"), ("smg", "kv_aware", "no policy 'kv_aware'")],
)
def test_an_unknown_peer_or_policy_is_refused(name: str, policy: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        start_peer(name, workers=["http://127.0.0.1:1"], policy=policy)


def test_each_peer_gets_its_own_metrics_port_and_the_workers() -> None:
    argv = PEERS["smg"].argv(
        Path("/v"),
        workers=["http://a:1", "http://b:2"],
        policy="cache_aware",
        host="h",
        port=5,
        metrics_port=6,
    )
    assert argv[:2] == ["/v/bin/smg", "launch"]
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--policy")] == ["http://a:1", "http://b:2"]
    assert argv[argv.index("--prometheus-port") + 1] == "6"


def test_vllm_router_names_the_p_d_pods_and_nixl_on_its_command_line() -> None:
    argv = PEERS["vllm-router"].pd_argv(
        Path("/v"),
        prefill=["http://p:1"],
        decode=["http://d:1", "http://d:2"],
        policy="cache_aware",
        decode_policy="round_robin",
        host="h",
        port=5,
        metrics_port=6,
    )
    assert argv[:4] == ["/v/bin/vllm-router", "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    assert argv[4:10] == ["--prefill", "http://p:1", "--decode", "http://d:1", "--decode", "http://d:2"]
    assert argv[10:14] == ["--policy", "cache_aware", "--decode-policy", "round_robin"]
    assert "--prefill-policy" not in argv and "--worker-urls" not in argv


def test_smg_gets_the_p_d_pods_from_its_worker_api_with_the_nixl_connector() -> None:
    argv = PEERS["smg"].pd_argv(
        Path("/v"),
        prefill=["http://p:1"],
        decode=["http://d:1"],
        policy="prefix_hash",
        host="h",
        port=5,
        metrics_port=6,
    )
    assert argv[:3] == ["/v/bin/smg", "launch", "--pd-disaggregation"]
    assert "--prefill" not in argv and "--decode" not in argv
    assert pd_worker_specs(["http://p:1"], ["http://d:1"]) == [
        {
            "url": "http://p:1",
            "worker_type": "prefill",
            "runtime_type": "vllm",
            "kv_connector": "NixlConnector",
        },
        {
            "url": "http://d:1",
            "worker_type": "decode",
            "runtime_type": "vllm",
            "kv_connector": "NixlConnector",
        },
    ]


def test_a_p_d_peer_needs_a_pod_on_each_side() -> None:
    with pytest.raises(ValueError, match="one prefill pod and one decode pod"):
        start_pd_peer("smg", prefill=["http://127.0.0.1:1"], decode=[], policy="round_robin")


# --- each peer in front of the fleet -------------------------------------------------------------


# Each peer with cache_aware and round_robin, and SMG with the other policy the benchmark runs.
ROUTED = [(name, policy) for name in sorted(PEERS) for policy in ("cache_aware", "round_robin")]
ROUTED.append(("smg", "prefix_hash"))


@needs_peers
@pytest.mark.parametrize(("name", "policy"), ROUTED)
def test_a_peer_routes_plain_and_streamed_requests_to_the_pods(
    fleet: RunningFleet, name: str, policy: str
) -> None:
    pods = {"sim-0", "sim-1"}
    tag = f"{name} {policy}"
    with start_peer(name, workers=fleet.urls, policy=policy) as peer, httpx.Client(timeout=30) as client:
        # The pods echo: each answer is the prompt (or the last message) from a pod, as sent.
        r = client.post(f"{peer.url}/v1/completions", json=completion(f"Plain completion via {tag}"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == f"Plain completion via {tag}"
        assert r.headers[POD_HEADER] in pods

        r = client.post(f"{peer.url}/v1/chat/completions", json=chat(f"Plain chat via {tag}"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"Plain chat via {tag}"
        assert r.headers[POD_HEADER] in pods

        body = completion(f"Streamed completion via {tag}", stream=True)
        with client.stream("POST", f"{peer.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers[POD_HEADER] in pods
            chunks = events(r)
        assert chunks[-1] == "[DONE]"
        assert streamed_text(chunks) == f"Streamed completion via {tag}"

        body = chat(f"Streamed chat via {tag}", stream=True, stream_options={"include_usage": True})
        with client.stream("POST", f"{peer.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = events(r)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert chunks[-2]["usage"]["prompt_tokens"] > 0
        assert streamed_text(chunks) == f"Streamed chat via {tag}"

        # The same long prompt four times: cache_aware keeps it on one pod, which then has it
        # cached, as does prefix_hash (its hash is the same); round_robin spreads it over both.
        served, cached = [], []
        for _ in range(4):
            r = client.post(f"{peer.url}/v1/completions", json=completion(f"{SYSTEM} Asked via {tag}"))
            assert r.status_code == 200, r.text
            served.append(r.headers[POD_HEADER])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        if policy == "round_robin":
            assert set(served) == pods, served
        else:
            assert len(set(served)) == 1, served
            assert all(tokens >= 48 for tokens in cached[1:]), cached
    assert peer.process.returncode is not None


@needs_peers
def test_smg_reads_each_pods_load_from_its_vllm_metrics(fleet: RunningFleet) -> None:
    """SMG takes the pods for vLLM (``owned_by`` in ``/v1/models``) and reads their load from
    ``/metrics`` (it needs ``vllm:kv_cache_usage_perc``), at registration and every 10 s, whatever
    the policy."""
    with (
        start_peer("smg", workers=fleet.urls, policy="prefix_hash") as peer,
        httpx.Client(timeout=5) as client,
    ):
        deadline = time.monotonic() + 15
        while True:
            workers = client.get(f"{peer.url}/workers").json()["workers"]
            loads = {w["url"]: w.get("engine_load", {}).get("loads") for w in workers}
            if all(loads.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert {w["runtime_type"] for w in workers} == {"vllm"}
    assert set(loads) == set(fleet.urls) and all(loads.values()), loads
    for (load,) in loads.values():  # one rank each, idle
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)
        assert 0.0 <= load["token_usage"] < 1.0


# --- each peer in its P/D mode --------------------------------------------------------------------


@needs_peers
@pytest.mark.parametrize("name", sorted(PEERS))
def test_a_peer_in_p_d_mode_prefills_on_the_prefill_pod_and_decodes_with_its_kv_cache(
    pd_fleet: RunningPDFleet, name: str
) -> None:
    """Each request, plain or streamed, completion or chat: one prefill on ``sim-0`` (a request
    that finishes ``remote_decode``), then a decode pod's answer after a KV transfer from it."""
    decoders = {"sim-1", "sim-2"}
    prefills_before = metric(pd_fleet.prefill[0], "vllm:request_success_total")
    transfers_before = sum(metric(url, "vllm:nixl_xfer_time_seconds_count") for url in pd_fleet.decode)
    with (
        start_pd_peer(name, prefill=pd_fleet.prefill, decode=pd_fleet.decode, policy="round_robin") as peer,
        httpx.Client(timeout=30) as client,
    ):
        r = client.post(f"{peer.url}/v1/completions", json=completion(f"P/D completion via {name}"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == f"P/D completion via {name}"
        assert r.headers[POD_HEADER] in decoders

        r = client.post(f"{peer.url}/v1/chat/completions", json=chat(f"P/D chat via {name}"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"P/D chat via {name}"
        assert r.headers[POD_HEADER] in decoders

        body = completion(f"Streamed P/D completion via {name}", stream=True)
        with client.stream("POST", f"{peer.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = events(r)
        assert streamed_text(chunks) == f"Streamed P/D completion via {name}"

        body = chat(f"Streamed P/D chat via {name}", stream=True, stream_options={"include_usage": True})
        with client.stream("POST", f"{peer.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = events(r)
        assert streamed_text(chunks) == f"Streamed P/D chat via {name}"
    assert metric(pd_fleet.prefill[0], "vllm:request_success_total") - prefills_before == 4
    transfers = sum(metric(url, "vllm:nixl_xfer_time_seconds_count") for url in pd_fleet.decode)
    assert transfers - transfers_before == 4
