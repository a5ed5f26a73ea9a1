"""A fleet on real sockets: uvicorn servers spoken to with httpx, events read from a real SUB."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
import zmq

from ingest.events import BlockStored, decode_batch
from simulator.config import ConfigError, LatencyConfig, PodConfig
from simulator.fleet import Fleet, FleetConfig, PublishConfig
from simulator.pod import PodTokenizer
from tests.simulator.conftest import MODEL, Collector, pod_config, wait_until
from tests.simulator.test_publisher import replay


def consecutive_free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def fleet_of(qwen: PodTokenizer, pod: PodConfig, **fleet: object) -> Fleet:
    config = FleetConfig(pod=pod, **{"base_port": 0, **fleet})
    return Fleet(config, tokenizer=qwen, graceful_timeout=0.5)


def run_with(fleet: Fleet, body: Callable[[Fleet, httpx.AsyncClient], Awaitable[object]]) -> object:
    async def main() -> object:
        async with fleet, httpx.AsyncClient(timeout=10) as client:
            return await body(fleet, client)

    return asyncio.run(main())


async def complete(
    client: httpx.AsyncClient, url: str, prompt: str | list[int], **extra: object
) -> httpx.Response:
    """POST a completion to the pod at ``url``."""
    return await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, **extra})


def test_each_pod_serves_http_and_publishes_under_its_own_topic(
    qwen: PodTokenizer, collector: Collector
) -> None:
    base = consecutive_free_ports(2)
    fleet = fleet_of(
        qwen, pod_config(), pods=2, base_port=base, publish=PublishConfig(endpoint=collector.endpoint)
    )

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> list[int]:
        assert [p.url for p in fleet.pods] == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        collector.wait_peers(2)
        statuses = []
        for i, pod in enumerate(fleet.pods):
            for n in range(2):
                r = await complete(client, pod.url, f"pod {i} request {n} " * 10, max_tokens=1)
                statuses.append(r.status_code)
        return statuses

    assert run_with(fleet, body) == [200] * 4
    wait_until(lambda: len(collector.messages) == 4, what="4 batches")
    by_pod: dict[str, list[int]] = {}
    for message in collector.messages:
        assert message.model == MODEL
        by_pod.setdefault(message.pod, []).append(message.seq)
    assert by_pod == {"sim-0": [0, 1], "sim-1": [0, 1]}
    assert {t for t in collector.topics} == {f"kv@sim-0@{MODEL}".encode(), f"kv@sim-1@{MODEL}".encode()}


def test_the_qwen_capture_prompt_yields_the_captured_block_hashes(
    qwen: PodTokenizer, collector: Collector, base_capture: dict, lora_capture: dict
) -> None:
    pod = pod_config(block_size=16)  # hash seed "42", as the capture
    fleet = fleet_of(qwen, pod, publish=PublishConfig(endpoint=collector.endpoint, layout="map"))

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> None:
        collector.wait_peers(1)
        url = fleet.pods[0].url
        await client.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "Alice", "lora_path": "x"})
        for model in (MODEL, "Alice"):
            r = await client.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": base_capture["prompt"], "max_tokens": 1},
            )
            assert r.status_code == 200

    run_with(fleet, body)
    wait_until(lambda: len(collector.messages) == 2, what="two batches")
    base, lora = (m.batch.events[0] for m in collector.messages)
    assert isinstance(base, BlockStored)
    assert list(base.block_hashes) == base_capture["block_hashes"]
    assert list(base.token_ids) == base_capture["token_ids"]
    assert base.parent_block_hash is None and base.block_size == 16 and base.tier == "gpu"
    assert list(lora.block_hashes) == lora_capture["block_hashes"]
    assert lora.lora_name == "Alice"


def test_kv_exhaustion_queues_requests_over_http_instead_of_failing(qwen: PodTokenizer) -> None:
    # 4 blocks of 16; each request needs 3: they must run one after the other.
    pod = dataclasses.replace(
        pod_config(kv_cache_size=4),
        latency=LatencyConfig(prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=5),
    )
    fleet = fleet_of(qwen, pod, publish=PublishConfig(endpoint=None))

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[list[int], int]:
        url = fleet.pods[0].url
        engine = fleet.pods[0].pod.engines[0]
        waited = 0

        async def watch() -> None:
            nonlocal waited
            while True:
                waited = max(waited, engine.num_waiting)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        responses = await asyncio.gather(
            *(complete(client, url, list(range(100 * i, 100 * i + 30)), max_tokens=10) for i in range(3))
        )
        watcher.cancel()
        return [r.status_code for r in responses], waited

    statuses, waited = run_with(fleet, body)
    assert statuses == [200, 200, 200]
    assert waited >= 1


def test_a_full_waiting_queue_is_429_over_http(qwen: PodTokenizer) -> None:
    pod = dataclasses.replace(
        pod_config(max_num_seqs=1, max_waiting=0),
        latency=LatencyConfig(prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=20),
    )
    fleet = fleet_of(qwen, pod, publish=PublishConfig(endpoint=None))

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        url, prompt = fleet.pods[0].url, "a slow request of several tokens"
        slow = asyncio.create_task(complete(client, url, prompt, max_tokens=5))
        while fleet.pods[0].pod.engines[0].num_running == 0:
            await asyncio.sleep(0.002)
        refused = await complete(client, url, prompt, max_tokens=5)
        return await slow, refused

    slow, refused = run_with(fleet, body)
    assert slow.status_code == 200
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "waiting queue is full" in error["message"]


def test_data_parallel_ranks_publish_on_consecutive_endpoints(
    qwen: PodTokenizer, zmq_context: zmq.Context
) -> None:
    base = consecutive_free_ports(2)
    pod = dataclasses.replace(
        pod_config(),
        data_parallel_size=2,
        latency=LatencyConfig(prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=10),
    )
    fleet = fleet_of(
        qwen, pod, pod_id_style="hostport", publish=PublishConfig(endpoint=f"tcp://*:{base}", layout="array")
    )
    sub = zmq_context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"kv@")
    received: list[tuple[str, int | None]] = []

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> str:
        for rank in range(2):
            sub.connect(f"tcp://127.0.0.1:{base + rank}")
        deadline = time.monotonic() + 5
        url = fleet.pods[0].url
        n = 0
        while len({rank for _, rank in received}) < 2 and time.monotonic() < deadline:
            # Two at once: the second goes to the idle rank.
            await asyncio.gather(
                *(complete(client, url, f"request {n} {k} " * 8, max_tokens=2) for k in range(2))
            )
            n += 1
            while sub.poll(50):
                topic, _, payload = sub.recv_multipart()
                received.append((topic.decode(), decode_batch(payload).data_parallel_rank))
        return fleet.pods[0].pod_id

    try:
        pod_id = run_with(fleet, body)
    finally:
        sub.close()
    assert pod_id.startswith("127.0.0.1:")
    assert {rank for _, rank in received} == {0, 1}
    assert {topic for topic, _ in received} == {f"kv@{pod_id}@{MODEL}"}


def test_replay_endpoint_of_a_pod_answers_a_dealer(qwen: PodTokenizer, collector: Collector) -> None:
    base = consecutive_free_ports(1)
    publish = PublishConfig(endpoint=collector.endpoint, replay_endpoint=f"tcp://127.0.0.1:{base}")
    fleet = fleet_of(qwen, pod_config(), publish=publish)

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> list[list[bytes]]:
        for n in range(3):
            await complete(client, fleet.pods[0].url, f"replayed {n} " * 10, max_tokens=1)
        return await replay(f"tcp://127.0.0.1:{base}", start=1)

    replies = run_with(fleet, body)
    assert [int.from_bytes(r[2], "big") for r in replies] == [1, 2, 2**64 - 1]
    assert all(r[1] == f"kv@sim-0@{MODEL}".encode() for r in replies)


def test_a_client_that_goes_away_mid_stream_aborts_its_request(qwen: PodTokenizer) -> None:
    pod = dataclasses.replace(
        pod_config(),
        latency=LatencyConfig(prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=20),
    )
    fleet = fleet_of(qwen, pod, publish=PublishConfig(endpoint=None))

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[int, int, str]:
        running = fleet.pods[0]
        engine = running.pod.engines[0]
        request = {"model": MODEL, "prompt": list(range(100)), "max_tokens": 50, "stream": True}
        async with client.stream("POST", f"{running.url}/v1/completions", json=request) as r:
            async for line in r.aiter_lines():
                if line:
                    break  # one token, then hang up
        assert engine.num_running == 1
        deadline = time.monotonic() + 5
        while engine.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        metrics = (await client.get(f"{running.url}/metrics")).text
        return engine.num_running, engine.cache.num_used, metrics

    running, used, metrics = run_with(fleet, body)
    assert (running, used) == (0, 0)
    assert (
        f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}} 1.0'
        in metrics
    )


def test_a_kept_alive_connection_answers_without_waiting_for_a_delayed_ack(qwen: PodTokenizer) -> None:
    # With Nagle on the pod's side, every request after the first on a connection waited ~40 ms
    # (the client's delayed ACK): a floor under every latency a benchmark measured.
    fleet = fleet_of(qwen, pod_config(), publish=PublishConfig(endpoint=None))

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> list[float]:
        took = []
        for n in range(6):
            start = time.perf_counter()
            r = await complete(client, fleet.pods[0].url, f"kept alive {n} " * 20, max_tokens=2)
            took.append(time.perf_counter() - start)
            assert r.status_code == 200
        return took

    took = sorted(run_with(fleet, body)[1:])  # the first also opens the connection
    assert took[len(took) // 2] < 0.02, took


def test_a_pd_fleet_gives_its_first_pods_the_prefill_role_and_the_others_decode() -> None:
    pod = pod_config()
    assert [FleetConfig(pod=pod, pods=3, prefill_pods=2).role_of(i) for i in range(3)] == [
        "prefill",
        "prefill",
        "decode",
    ]
    decode = dataclasses.replace(pod, role="decode")
    assert [FleetConfig(pod=decode, pods=2).role_of(i) for i in range(2)] == ["decode", "decode"]
    with pytest.raises(ValueError, match="prefill_pods must be 0 to pods"):
        FleetConfig(pod=pod, pods=2, prefill_pods=3)
    with pytest.raises(ValueError, match="the template's must be 'both'"):
        FleetConfig(pod=decode, pods=2, prefill_pods=1)
    with pytest.raises(ConfigError, match="role must be one of"):
        dataclasses.replace(pod, role="encode")
