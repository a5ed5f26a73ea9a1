"""Prefill/decode disaggregation on real sockets: a prefill pod's answer (one token, finish reason
``remote_decode``, the ``kv_transfer_params`` of its transfer), a decode pod that loads what it does
not hold (its first token after the transfer time, the loaded blocks stored and published), and
their metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ingest.events import BlockStored
from kvindex.keys import block_keys
from simulator.config import LatencyConfig
from simulator.fleet import Fleet, PublishConfig
from simulator.pod import Pod, PodTokenizer
from simulator.protocol import KVTransferParams, SamplingParams
from tests.simulator.conftest import MODEL, ZERO_LATENCY, Collector, pod_config, wait_until
from tests.simulator.test_fleet import complete, fleet_of, run_with

PROMPT = list(range(1000, 1070))  # 70 tokens: 4 full blocks of 16 and 6 tokens
PREFIX = PROMPT[:40]  # its first 2 full blocks and 8 tokens
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
CHAT = [{"role": "user", "content": "Tell me about the KV cache of a prefill pod, at length."}]


def pd_fleet(qwen: PodTokenizer, latency: LatencyConfig = ZERO_LATENCY, **fleet: object) -> Fleet:
    """Two pods, ``sim-0`` and ``sim-1``, on free ports; ``latency`` for both."""
    pod = dataclasses.replace(pod_config(), latency=latency)
    return fleet_of(qwen, pod, **{"pods": 2, "publish": PublishConfig(endpoint=None), **fleet})


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` in a Prometheus exposition."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name}{labels} is not exposed")


# --- the prefill side ----------------------------------------------------------------------------


def test_a_prefill_answers_one_token_and_the_kv_transfer_params_of_its_blocks(qwen: PodTokenizer) -> None:
    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[list[dict], list[int], int]:
        prefill = fleet.pods[0]
        answers = [
            (await complete(client, prefill.url, PROMPT, max_tokens=50, kv_transfer_params=PREFILL)).json()
            for _ in range(2)
        ]
        cache = prefill.pod.engines[0].cache
        return answers, cache.cached_prefix(block_keys(PROMPT, seed="42")), prefill.port

    (first, second), stored, port = run_with(pd_fleet(qwen), body)
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "remote_decode"
    assert choice["text"] == qwen.decode(PROMPT[:1])  # echo: the first token the request would give
    assert first["usage"]["completion_tokens"] == 1  # whatever max_tokens says
    params = first["kv_transfer_params"]
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": params["remote_block_ids"],
        "remote_engine_id": "sim-0",
        "remote_request_id": first["id"],
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
        "remote_prefill_cached_tokens": 0,
    }
    # One list per KV-cache group (vLLM's shape): the prompt's 5 blocks, its 4 full ones cached.
    ((*full, partial),) = params["remote_block_ids"]
    assert full == stored and partial not in stored
    # The same prompt again: the blocks it hit, and what the prefill pod had cached.
    again = second["kv_transfer_params"]
    assert again["remote_block_ids"][0][:4] == stored
    assert again["remote_prefill_cached_tokens"] == 64
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_a_chat_prefill_answers_the_same_way(qwen: PodTokenizer) -> None:
    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[httpx.Response, int]:
        request = {"model": MODEL, "messages": CHAT, "kv_transfer_params": PREFILL}
        return await client.post(f"{fleet.pods[1].url}/v1/chat/completions", json=request), fleet.pods[1].port

    answer, port = run_with(pd_fleet(qwen), body)
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] == "remote_decode"
    assert body["usage"]["completion_tokens"] == 1
    params = body["kv_transfer_params"]
    assert (params["do_remote_prefill"], params["do_remote_decode"]) == (True, False)
    assert (params["remote_engine_id"], params["remote_request_id"]) == ("sim-1", body["id"])
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", port, 1)
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"][0]) == -(-prompt_tokens // 16)


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ],
)
def test_a_streamed_prefill_is_refused(qwen: PodTokenizer, path: str, request_body: dict) -> None:
    async def body(fleet: Fleet, client: httpx.AsyncClient) -> httpx.Response:
        request = {"model": MODEL, **request_body, "stream": True, "kv_transfer_params": PREFILL}
        return await client.post(f"{fleet.pods[0].url}{path}", json=request)

    refused = run_with(pd_fleet(qwen, pods=1), body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["message"], error["param"]) == ("Prefill does not support streaming", "stream")


def test_each_data_parallel_rank_is_an_engine_of_its_own(qwen: PodTokenizer) -> None:
    pod = Pod(dataclasses.replace(pod_config(), data_parallel_size=2), tokenizer=qwen)

    async def main() -> list[str | None]:
        submissions = [
            pod.submit(
                request_id=f"prefill-{i}",
                model=MODEL,
                prompts=[(PROMPT, PROMPT)],
                sampling=SamplingParams(max_tokens=1),
                adapter=None,
                param="prompt",
                kv_transfer=KVTransferParams(do_remote_decode=True),
            )
            for i in range(2)  # both admitted at once: the second on the idle rank
        ]
        answers = [pod.kv_transfer_answer(s, host="10.0.0.7", port=8100) for s in submissions]
        for submission in submissions:
            for choice in submission.choices:
                choice.engine.abort(choice.state)
        return [a["remote_engine_id"] if a else None for a in answers]

    assert asyncio.run(main()) == ["sim-0", "sim-0#dp1"]  # as the index names the ranks


# --- the decode side -----------------------------------------------------------------------------


async def prefill_then_decode(
    client: httpx.AsyncClient, fleet: Fleet, *, prompt: list[int] = PROMPT, **decode: object
) -> tuple[dict, httpx.Response]:
    """``prompt`` prefilled on ``sim-0``, then sent to ``sim-1`` with the prefill's params, as a
    P/D router does; the prefill's answer and the decode's response."""
    prefill = await complete(client, fleet.pods[0].url, prompt, max_tokens=1, kv_transfer_params=PREFILL)
    params = prefill.json()["kv_transfer_params"]
    return prefill.json(), await complete(
        client, fleet.pods[1].url, prompt, kv_transfer_params=params, **decode
    )


def test_a_decode_answers_as_a_whole_request_would(qwen: PodTokenizer) -> None:
    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[dict, dict, list]:
        prefill, decode = await prefill_then_decode(client, fleet, max_tokens=5)
        params = prefill["kv_transfer_params"]
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        async with client.stream(
            "POST",
            f"{fleet.pods[1].url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": params, **stream},
        ) as streamed:
            lines = [line async for line in streamed.aiter_lines() if line]
        return prefill, decode.json(), lines

    prefill, decode, lines = run_with(pd_fleet(qwen), body)
    assert decode["choices"][0]["text"] == qwen.decode(PROMPT[:5])
    assert decode["choices"][0]["finish_reason"] == "length"
    assert "kv_transfer_params" not in decode  # vLLM's decode answers with none (null)
    # vLLM reports the prefill pod's cached tokens, which its answer carried.
    assert decode["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert prefill["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    assert len(lines) == 5 + 3  # a chunk per token, the finish, the usage, [DONE]
    assert lines[-1] == "data: [DONE]"


def test_the_first_token_of_a_decode_comes_after_the_transfer_not_a_prefill(qwen: PodTokenizer) -> None:
    latency = dataclasses.replace(
        ZERO_LATENCY,
        prefill_overhead_ms=3000,
        kv_cache_transfer_latency_ms=200,
        kv_cache_transfer_time_per_token_ms=0,
    )
    fleet = pd_fleet(qwen, latency, pods=1)

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[float, float, str]:
        url, params = fleet.pods[0].url, {"do_remote_prefill": True}
        started = time.perf_counter()
        answer = await complete(client, url, PROMPT, max_tokens=1, kv_transfer_params=params)
        whole = time.perf_counter() - started
        assert answer.status_code == 200
        request = {
            "model": MODEL,
            "prompt": PREFIX,
            "max_tokens": 3,
            "stream": True,
            "kv_transfer_params": params,
        }
        started = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/completions", json=request) as streamed:
            async for line in streamed.aiter_lines():
                if line:
                    break
        first_chunk = time.perf_counter() - started
        return whole, first_chunk, (await client.get(f"{url}/metrics")).text

    whole, first_chunk, metrics = run_with(fleet, body)
    for seconds in (whole, first_chunk):
        assert 0.2 <= seconds < 1.5  # the 200 ms transfer; a prefill would take 3 s
    assert metric(metrics, "vllm:nixl_xfer_time_seconds_count", engine="0") == 2
    assert metric(metrics, "vllm:nixl_xfer_time_seconds_sum", engine="0") == pytest.approx(0.4)
    assert metric(metrics, "vllm:time_to_first_token_seconds_sum", engine="0") >= 0.4


def test_local_hits_are_not_transferred_and_the_transferred_blocks_are_published(
    qwen: PodTokenizer, collector: Collector
) -> None:
    latency = dataclasses.replace(
        ZERO_LATENCY, kv_cache_transfer_latency_ms=1, kv_cache_transfer_time_per_token_ms=0.5
    )
    fleet = pd_fleet(qwen, latency, publish=PublishConfig(endpoint=collector.endpoint))

    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[dict, dict, str]:
        collector.wait_peers(2)
        decode = fleet.pods[1].url
        assert (await complete(client, decode, PREFIX, max_tokens=1)).status_code == 200  # 2 blocks
        _, answer = await prefill_then_decode(client, fleet, max_tokens=1)
        # The same without the prefill's cached tokens: vLLM then reports all it did not compute.
        again = await complete(
            client, decode, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_prefill": True}
        )
        return answer.json(), again.json(), (await client.get(f"{decode}/metrics")).text

    answer, again, metrics = run_with(fleet, body)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prefill pod's hits
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 70
    labels = {"engine": "0", "model_name": MODEL}
    # The first decode held 32 tokens (2 blocks) and loaded 38; the second held 64 and loaded 6.
    assert metric(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute", **labels) == 40
    assert (
        metric(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit", **labels) == 32 + 64
    )
    assert (
        metric(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer", **labels)
        == 38 + 6
    )
    assert metric(metrics, "vllm:prefix_cache_hits_total", **labels) == 32 + 64
    assert metric(metrics, "vllm:external_prefix_cache_queries_total", **labels) == 40 + 38 + 6
    assert metric(metrics, "vllm:external_prefix_cache_hits_total", **labels) == 38 + 6
    assert metric(metrics, "vllm:nixl_xfer_time_seconds_count", **labels) == 2
    assert metric(metrics, "vllm:nixl_xfer_time_seconds_sum", **labels) == pytest.approx(
        (0.001 + 38 * 0.0005) + (0.001 + 6 * 0.0005)
    )
    assert metric(metrics, "vllm:nixl_num_failed_transfers_total", **labels) == 0

    keys = block_keys(PROMPT, seed="42")
    wait_until(lambda: len([m for m in collector.messages if m.pod == "sim-1"]) >= 2, what="decode events")
    stored = [
        e
        for m in collector.messages
        if m.pod == "sim-1"
        for e in m.batch.events
        if isinstance(e, BlockStored)
    ]
    # The plain request's 2 blocks, then the 2 the transfer brought, chained to them.
    assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [
        (tuple(keys[:2]), None),
        (tuple(keys[2:4]), keys[1]),
    ]
    assert stored[1].token_ids == tuple(PROMPT[32:64])


def test_a_decode_without_the_remote_fields_is_served_and_counted(qwen: PodTokenizer) -> None:
    async def body(fleet: Fleet, client: httpx.AsyncClient) -> tuple[httpx.Response, str]:
        url = fleet.pods[0].url
        answer = await complete(
            client, url, PROMPT, max_tokens=2, kv_transfer_params={"do_remote_prefill": True}
        )
        return answer, (await client.get(f"{url}/metrics")).text

    answer, metrics = run_with(pd_fleet(qwen, pods=1), body)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 2
    assert metric(metrics, "vllm:nixl_xfer_time_seconds_count", engine="0") == 1
    assert metric(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 70
