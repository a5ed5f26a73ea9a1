"""NVIDIA Dynamo's KV router (``bench.dynamo``) in front of simulated pods: its frontend and one
worker shim per pod start with no etcd and no NATS, route completions and chat completions, plain
and streamed, to the pods, and learn the pods' caches from their own ZeroMQ KV events, so a
repeated prompt goes back to the pod that holds it. Needs ``make bench-dynamo``; without it the
tests that run Dynamo skip, saying so.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.dynamo import (
    DynamoNotInstalled,
    DynamoPod,
    dynamo_installed,
    eos_token_id,
    fleet_pods,
    start_dynamo,
)
from bench.faults import free_port_range
from simulator.fleet import FleetConfig, PublishConfig
from simulator.pod import PodTokenizer
from tests.simulator.conftest import MODEL, pod_config
from tests.simulator.threaded_fleet import ThreadedFleet
from tokenization.tokenizers import qwen_package_tokenizer_dir

needs_dynamo = pytest.mark.skipif(
    not dynamo_installed(), reason="Dynamo is not installed: run `make bench-dynamo`"
)
BLOCK_SIZE = 16


class RunningFleet(ThreadedFleet):
    """Two zero-latency pods on free loopback ports, each binding its KV-event PUB socket (as
    vLLM does by default), served from a thread's event loop."""

    def __init__(self, tokenizer: PodTokenizer) -> None:
        self.events = f"tcp://*:{free_port_range(2)}"
        config = FleetConfig(
            pod=pod_config(block_size=BLOCK_SIZE),
            pods=2,
            base_port=0,
            publish=PublishConfig(endpoint=self.events),
        )
        super().__init__(config, tokenizer)


@pytest.fixture(scope="module")
def fleet(qwen: PodTokenizer) -> Iterator[RunningFleet]:
    running = RunningFleet(qwen)
    yield running
    running.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


# --- bench.dynamo without Dynamo -----------------------------------------------------------------


def test_the_pods_of_a_binding_fleet_are_reached_on_loopback_one_port_each() -> None:
    pods = fleet_pods(["http://127.0.0.1:8100/", "http://127.0.0.1:8101"], "tcp://*:5600")
    assert pods == [
        DynamoPod(url="http://127.0.0.1:8100", events="tcp://127.0.0.1:5600"),
        DynamoPod(url="http://127.0.0.1:8101", events="tcp://127.0.0.1:5601"),
    ]


def test_pods_that_connect_to_ingest_cannot_be_subscribed_to() -> None:
    with pytest.raises(ValueError, match="must bind"):
        fleet_pods(["http://127.0.0.1:8100"], "tcp://127.0.0.1:5557")


def test_without_the_dynamo_venv_starting_it_says_to_run_make_bench_dynamo(tmp_path: Path) -> None:
    assert not dynamo_installed(tmp_path)
    with pytest.raises(DynamoNotInstalled, match="make bench-dynamo"):
        start_dynamo([DynamoPod("http://127.0.0.1:1", "")], model=MODEL, block_size=16, venv=tmp_path)


def test_the_model_card_ends_sequences_with_the_tokenizers_eos_token() -> None:
    tokenizer_dir = qwen_package_tokenizer_dir()
    assert tokenizer_dir is not None
    assert eos_token_id(tokenizer_dir) == 151645  # Qwen3's <|im_end|>


# --- Dynamo in front of the fleet ----------------------------------------------------------------


@needs_dynamo
def test_dynamo_routes_to_the_pods_and_sends_a_repeated_prompt_to_the_pod_that_cached_it(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    pods = fleet_pods(fleet.urls, fleet.events)
    with (
        start_dynamo(pods, model=MODEL, block_size=BLOCK_SIZE, kv_blocks=1024, log_dir=tmp_path) as dynamo,
        httpx.Client(timeout=30, trust_env=False) as client,
    ):
        # The pods echo their prompt: Dynamo's answers are the prompt's text, detokenized by it.
        plain = {"model": MODEL, "prompt": "Plain via dynamo", "max_tokens": 8}
        r = client.post(f"{dynamo.url}/v1/completions", json=plain)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Plain via dynamo"

        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Streamed chat via dynamo"}],
            "max_tokens": 64,
            "stream": True,
        }
        with client.stream("POST", f"{dynamo.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])
        assert "Streamed chat via dynamo" in text  # the chat template's tokens around it, echoed

        # Four long prompts, three times each: every repeat finds its prompt cached, so it went to
        # the pod that served the first (both pods start empty), and Dynamo's router predicted it
        # from the KV events it took from the pods.
        repeats = []
        for group in range(4):
            prompt = " ".join(f"group{group} word{i}" for i in range(100))
            for attempt in range(3):
                r = client.post(
                    f"{dynamo.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                if attempt:
                    repeats.append(usage["prompt_tokens_details"]["cached_tokens"])
                    assert repeats[-1] >= usage["prompt_tokens"] - BLOCK_SIZE, usage
                time.sleep(0.2)  # the pod's KV events reach the router
        metrics = client.get(dynamo.metrics_url).text
    assert metric(metrics, "dynamo_component_kv_cache_events_applied", event_type="stored", status="ok") > 0
    # The router's predicted hit rate: ~1 for each repeat, ~0 for each first request.
    assert metric(metrics, "dynamo_component_router_kv_hit_rate_sum") >= 0.9 * len(repeats)
    assert all(code == 0 for code in dynamo.stop())
    assert not dynamo.workdir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frontend.log", "worker-0.log", "worker-1.log"]
