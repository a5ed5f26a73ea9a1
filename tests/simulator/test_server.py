"""One pod over HTTP (Starlette's TestClient): OpenAI shapes, SSE, usage, errors, admin endpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from ingest.events import AllBlocksCleared, BlockStored
from kvindex.keys import block_keys
from simulator.config import FAILURE_TYPES, FailureConfig
from simulator.errors import INJECTED
from simulator.pod import Pod, PodTokenizer
from simulator.protocol import SamplingParams
from simulator.server import POD_HEADER, create_app
from tests.simulator.conftest import MODEL, pod_config

SYSTEM = (
    "You are a meticulous assistant for a routing benchmark. Answer briefly, cite nothing, and keep "
    "every answer under twenty words. " * 4
)


@dataclasses.dataclass
class Served:
    pod: Pod
    client: TestClient
    batches: list

    def events(self) -> list:
        return [event for batch in self.batches for event in batch]


@contextlib.contextmanager
def serve(qwen: PodTokenizer, **config: object) -> Iterator[Served]:
    """A pod with ``config`` (engine fields, ``failures``, ``output_mode``, ``role``) behind a
    TestClient."""
    batches: list = []
    pod_fields = ("failures", "output_mode", "role")
    engine = {k: v for k, v in config.items() if k not in pod_fields}
    pod_cfg = dataclasses.replace(
        pod_config(**engine), **{k: v for k, v in config.items() if k in pod_fields}
    )
    pod = Pod(pod_cfg, tokenizer=qwen, on_events=[batches.append])
    with TestClient(create_app(pod)) as client:
        yield Served(pod, client, batches)


@pytest.fixture
def served(qwen: PodTokenizer) -> Iterator[Served]:
    with serve(qwen) as s:
        yield s


def sse(lines: Iterator[str]) -> list:
    """The data of each server-sent event; ``[DONE]`` stays a string."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat(content: str, **extra: object) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        **extra,
    }


# --- completions and chat ------------------------------------------------------------------------


def test_completion_echoes_the_prompt_with_usage(served: Served, qwen: PodTokenizer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    r = served.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == prompt
    assert body["choices"][0]["finish_reason"] == "stop"
    n = len(qwen.encode(prompt))
    assert body["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": n,
        "total_tokens": 2 * n,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_repeated_prompt_reports_cached_tokens(served: Served, qwen: PodTokenizer) -> None:
    prompt = SYSTEM + "What is a KV cache?"
    n = len(qwen.encode(prompt))
    usage = [
        served.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        ).json()["usage"]
        for _ in range(2)
    ]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0


def test_completion_prompts_may_be_token_ids_and_batches(served: Served) -> None:
    body = served.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1, "n": 2}
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_stream_sends_role_then_one_chunk_per_token_then_finish_usage_done(
    served: Served, qwen: PodTokenizer
) -> None:
    question = "Name three colours of the rainbow."
    request = chat(question, stream=True, stream_options={"include_usage": True})
    with served.client.stream("POST", "/v1/chat/completions", json=request) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    n_tokens = len(qwen.encode(question))
    role, *tokens, finish, usage, done = events
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant"}
    assert len(tokens) == n_tokens
    assert all(t["choices"][0]["finish_reason"] is None for t in tokens)
    assert "".join(t["choices"][0]["delta"]["content"] for t in tokens) == question
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == n_tokens
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert done == "[DONE]"
    assert len({e["id"] for e in events[:-1]}) == 1


def test_completion_stream_without_usage(served: Served) -> None:
    request = {"model": MODEL, "prompt": "one two three", "max_tokens": 2, "stream": True}
    with served.client.stream("POST", "/v1/completions", json=request) as r:
        events = sse(r.iter_lines())
    *tokens, finish, done = events
    assert len(tokens) == 2
    assert [t["choices"][0]["text"] for t in tokens] == ["one", " two"]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert done == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


def test_a_completion_stream_with_return_token_ids_gives_each_chunks_token_ids(
    served: Served, qwen: PodTokenizer
) -> None:
    request = {"model": MODEL, "prompt": "one two three", "max_tokens": 3, "stream": True}
    with served.client.stream("POST", "/v1/completions", json={**request, "return_token_ids": True}) as r:
        *tokens, finish, _ = sse(r.iter_lines())
    assert [t["choices"][0]["token_ids"] for t in tokens] == [[i] for i in qwen.encode("one two three")]
    assert finish["choices"][0]["token_ids"] == []
    with served.client.stream("POST", "/v1/completions", json=request) as r:
        assert all("token_ids" not in e["choices"][0] for e in sse(r.iter_lines())[:-1])


def test_a_second_turn_reuses_the_first_turn_and_its_answer(served: Served, qwen: PodTokenizer) -> None:
    question = "Where is Paris? Answer at length, with the geography of France and of Europe."
    first = chat(question)
    answer = served.client.post("/v1/chat/completions", json=first).json()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": question}
    turn1_prompt, turn1_output = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    second = {
        **first,
        "messages": [
            *first["messages"],
            answer["choices"][0]["message"],
            {"role": "user", "content": "And Rome?"},
        ],
    }
    usage = served.client.post("/v1/chat/completions", json=second).json()["usage"]
    assert usage["prompt_tokens"] > turn1_prompt
    # The template renders the answer as the tokens generated, so every full block of the first
    # turn's prompt and answer is reused (the last answer token never had KV).
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == (turn1_prompt + turn1_output - 1) // 16 * 16
    assert cached > turn1_prompt // 16 * 16


def test_generated_tokens_are_cached_for_the_next_prompt(served: Served) -> None:
    prompt = list(range(1000, 1020))
    body = served.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20}
    ).json()
    assert body["usage"]["completion_tokens"] == 20
    echoed = prompt  # echo mode: the output tokens are the prompt's
    follow_up = prompt + echoed + [7, 8, 9]
    body = served.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": follow_up, "max_tokens": 1}
    ).json()
    # 20 prompt + 19 computed output tokens = 39 tokens of KV: 2 full blocks.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_random_output_is_seeded(qwen: PodTokenizer) -> None:
    def text(seed: int | None) -> str:
        with serve(qwen, output_mode="random") as s:
            request = {"model": MODEL, "prompt": "Tell me something.", "max_tokens": 12, "ignore_eos": True}
            if seed is not None:
                request["seed"] = seed
            body = s.client.post("/v1/completions", json=request).json()
            assert body["usage"]["completion_tokens"] == 12
            return body["choices"][0]["text"]

    assert text(None) == text(None)
    assert text(1) == text(1) != text(2)
    assert text(1) != "Tell me something."


# --- events ----------------------------------------------------------------------------------------


def test_events_carry_our_block_keys_with_the_pod_seed(served: Served, qwen: PodTokenizer) -> None:
    prompt = SYSTEM
    ids = qwen.encode(prompt)
    served.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    (stored,) = served.events()
    assert stored.block_hashes == tuple(block_keys(ids, seed="42"))
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(ids[: len(ids) // 16 * 16])


def test_reset_prefix_cache_clears_and_reports(served: Served) -> None:
    served.client.post("/v1/completions", json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 1})
    assert served.client.post("/reset_prefix_cache").status_code == 200
    assert served.events()[-1] == AllBlocksCleared()
    usage = served.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 1}
    ).json()
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_sleep_drops_the_cache_and_refuses_requests_until_woken(served: Served) -> None:
    assert served.client.post("/sleep").status_code == 200
    assert served.events() == [AllBlocksCleared()]
    assert served.client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert served.client.get("/health/ready").status_code == 503
    r = served.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 503
    served.client.post("/wake_up")
    assert served.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code == 200


# --- LoRA ----------------------------------------------------------------------------------------


def test_lora_adapters_load_serve_and_unload(served: Served, qwen: PodTokenizer) -> None:
    r = served.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "Alice", "lora_path": "/adapters/alice"}
    )
    assert r.status_code == 200
    ids = [m["id"] for m in served.client.get("/v1/models").json()["data"]]
    assert ids == [MODEL, "Alice"]
    again = served.client.post("/v1/load_lora_adapter", json={"lora_name": "Alice", "lora_path": "/x"})
    assert again.status_code == 400

    served.client.post("/v1/completions", json={"model": "Alice", "prompt": SYSTEM, "max_tokens": 1})
    (stored,) = served.events()
    assert stored.lora_name == "Alice" and stored.lora_id == 1
    assert stored.block_hashes == tuple(block_keys(qwen.encode(SYSTEM), seed="42", lora_name="Alice"))

    assert served.client.post("/v1/unload_lora_adapter", json={"lora_name": "Alice"}).status_code == 200
    assert served.client.post("/v1/unload_lora_adapter", json={"lora_name": "Alice"}).status_code == 404
    assert served.client.post("/v1/completions", json={"model": "Alice", "prompt": "hi"}).status_code == 404


# --- errors --------------------------------------------------------------------------------------


def assert_openai_error(body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


STATUS = {
    "rate_limit": 429,
    "invalid_api_key": 401,
    "context_length": 400,
    "server_error": 503,
    "invalid_request": 400,
    "model_not_found": 404,
}


@pytest.mark.parametrize("kind", FAILURE_TYPES)
def test_injected_failures_have_their_status_and_an_openai_body(qwen: PodTokenizer, kind: str) -> None:
    with serve(qwen, failures=FailureConfig(rate=100, types=(kind,))) as s:
        r = s.client.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == STATUS[kind] == INJECTED[kind](MODEL).status
        assert r.headers["x-simulated-failure"] == kind
        assert_openai_error(r.json())
        assert s.pod.engines[0].num_running == 0


def test_the_failure_rate_is_a_percentage_and_seeded(qwen: PodTokenizer) -> None:
    def statuses() -> list[int]:
        with serve(qwen, failures=FailureConfig(rate=30)) as s:
            return [
                s.client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
                ).status_code
                for _ in range(200)
            ]

    first = statuses()
    failed = sum(code != 200 for code in first)
    assert 30 <= failed <= 90
    assert statuses() == first


def test_unknown_model_is_404(served: Served) -> None:
    r = served.client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    assert assert_openai_error(r.json())["code"] == "model_not_found"


def test_context_window_exceeded_is_400_with_vllms_message(qwen: PodTokenizer) -> None:
    with serve(qwen, max_model_len=32) as s:
        r = s.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": list(range(30)), "max_tokens": 5}
        )
        assert r.status_code == 400
        error = assert_openai_error(r.json())
        assert error["message"] == (
            "This model's maximum context length is 32 tokens. However, you requested 35 tokens "
            "(30 in the messages, 5 in the completion). Please reduce the length of the messages or "
            "completion."
        )


def test_a_request_that_can_never_fit_the_kv_cache_is_400(qwen: PodTokenizer) -> None:
    with serve(qwen, kv_cache_size=2) as s:
        r = s.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": list(range(40)), "max_tokens": 1}
        )
        assert r.status_code == 400
        assert "KV-cache blocks" in assert_openai_error(r.json())["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_requests_name_the_field(served: Served, body: dict, param: str) -> None:
    r = served.client.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert assert_openai_error(r.json())["param"] == param


@pytest.mark.parametrize(
    ("kv_transfer_params", "param"),
    [
        ("prefill", "kv_transfer_params"),
        ([True], "kv_transfer_params"),
        ({"do_remote_decode": "true"}, "kv_transfer_params.do_remote_decode"),
        ({"do_remote_prefill": 1}, "kv_transfer_params.do_remote_prefill"),
        ({"remote_engine_id": 7}, "kv_transfer_params.remote_engine_id"),
        ({"remote_request_id": ["r"]}, "kv_transfer_params.remote_request_id"),
        ({"remote_host": 10}, "kv_transfer_params.remote_host"),
        ({"remote_port": "8100"}, "kv_transfer_params.remote_port"),
        ({"remote_port": True}, "kv_transfer_params.remote_port"),
        ({"remote_block_ids": "1,2,3"}, "kv_transfer_params.remote_block_ids"),
        ({"tp_size": 1.5}, "kv_transfer_params.tp_size"),
        ({"remote_prefill_cached_tokens": -16}, "kv_transfer_params.remote_prefill_cached_tokens"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_of_the_wrong_type_are_400_naming_the_field(
    served: Served, path: str, kv_transfer_params: object, param: str
) -> None:
    request = chat("hi") if "chat" in path else {"model": MODEL, "prompt": "hi"}
    r = served.client.post(path, json={**request, "kv_transfer_params": kv_transfer_params})
    assert r.status_code == 400
    assert assert_openai_error(r.json())["param"] == param
    assert served.pod.engines[0].num_running == 0


def test_kv_transfer_params_may_be_null_and_unknown_keys_are_ignored(served: Served) -> None:
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert (
        served.client.post("/v1/completions", json={**request, "kv_transfer_params": None}).status_code == 200
    )
    # What vLLM 0.32's prefill answers beyond the keys the simulator reads, and its nulls.
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4, 5]],
        "remote_engine_id": None,
        "remote_host": None,
        "remote_port": None,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "transfer_mode": "pull",
    }
    r = served.client.post("/v1/completions", json={**request, "kv_transfer_params": params})
    assert r.status_code == 200
    assert "kv_transfer_params" not in r.json()


def test_a_chat_template_error_is_400(served: Served) -> None:
    r = served.client.post("/v1/chat/completions", json={**chat("hi"), "chat_template": "{% for %}"})
    assert r.status_code == 400
    assert assert_openai_error(r.json())["param"] == "messages"


# --- operational endpoints -----------------------------------------------------------------------


def test_tokenize_matches_the_manager_tokenizer(served: Served, qwen: PodTokenizer) -> None:
    body = served.client.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert body["tokens"] == qwen.encode("Hello there")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 32768
    chat_body = served.client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_body["count"] > 2


def test_health_and_readiness(served: Served) -> None:
    assert served.client.get("/health").status_code == 200
    assert served.client.get("/health/ready").json() == {"status": "ready"}


def test_admin_config_changes_latency_and_failures_live(served: Served) -> None:
    config = served.client.get("/admin/config").json()
    assert config["engine"]["hash_seed"] == "42"
    assert config["latency"]["inter_token_latency_ms"] == 0
    r = served.client.post(
        "/admin/config",
        json={"latency": {"inter_token_latency_ms": 0.5, "jitter": 0.1}, "failures": {"rate": 5}},
    )
    assert r.status_code == 200
    assert r.json()["latency"]["inter_token_latency_ms"] == 0.5
    assert served.pod.engines[0].latency.jitter == 0.1
    assert served.pod.failures.rate == 5


def test_admin_config_changes_the_kv_transfer_latency_live(served: Served) -> None:
    latency = served.client.get("/admin/config").json()["latency"]
    assert (latency["kv_cache_transfer_latency_ms"], latency["kv_cache_transfer_time_per_token_ms"]) == (
        1.0,
        0.02,
    )
    change = {"latency": {"kv_cache_transfer_latency_ms": 25, "kv_cache_transfer_time_per_token_ms": 0.1}}
    assert served.client.post("/admin/config", json=change).status_code == 200
    assert served.pod.engines[0].latency.kv_cache_transfer_latency_ms == 25
    assert served.pod.engines[0].latency.kv_cache_transfer_time_per_token_ms == 0.1


@pytest.mark.parametrize(
    "change",
    [
        {"latency": {"jitter": 2}},
        {"latency": {"nope": 1}},
        {"engine": {"block_size": 32}},
        {"failures": {"types": ["x"]}},
        {"latency": {"kv_cache_transfer_time_per_token_ms": -0.02}},
        {"role": "decode"},
    ],
)
def test_admin_config_refuses_invalid_changes_and_keeps_the_old_ones(served: Served, change: dict) -> None:
    before = served.client.get("/admin/config").json()
    r = served.client.post("/admin/config", json=change)
    assert r.status_code == 400
    assert_openai_error(r.json())
    assert served.client.get("/admin/config").json() == before


def test_metrics_have_vllm_names_per_pod(served: Served) -> None:
    prompt = SYSTEM + "Metrics?"
    for _ in range(2):
        served.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
    text = served.client.get("/metrics").text
    labels = f'engine="0",model_name="{MODEL}"'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f"{name}{{{labels}}}" in text, name
    assert (
        f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 2.0' in text
    )
    assert f"vllm:generation_tokens_total{{{labels}}} 6.0" in text
    hits = next(line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
    assert float(hits.split()[-1]) > 0
    assert isinstance(served.events()[0], BlockStored)


def test_metrics_of_prefill_decode_disaggregation_have_vllms_names(served: Served) -> None:
    labels = f'engine="0",model_name="{MODEL}"'
    text = served.client.get("/metrics").text
    # Exposed before any transfer, as vLLM exposes them: a router need not wait for one.
    for name in (
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_xfer_time_seconds_count",
    ):
        assert f"{name}{{{labels}}} 0.0" in text, name
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} 0.0' in text, source
    request = {"model": MODEL, "prompt": SYSTEM, "kv_transfer_params": {"do_remote_decode": True}}
    assert served.client.post("/v1/completions", json=request).status_code == 200
    text = served.client.get("/metrics").text
    success = f'vllm:request_success_total{{engine="0",finished_reason="remote_decode",model_name="{MODEL}"}}'
    assert f"{success} 1.0" in text


# --- SGLang's operational endpoints, for the peer routers ----------------------------------------


def test_answers_name_the_pod_that_served_them(served: Served) -> None:
    body = {"model": MODEL, "prompt": "Which pod?", "max_tokens": 2}
    assert served.client.post("/v1/completions", json=body).headers[POD_HEADER] == "sim-0"
    with served.client.stream("POST", "/v1/chat/completions", json=chat("Which pod?", stream=True)) as r:
        assert r.headers[POD_HEADER] == "sim-0"


def test_model_and_server_info_point_at_the_pods_tokenizer(served: Served, qwen: PodTokenizer) -> None:
    info = served.client.get("/get_model_info").json()
    assert served.client.get("/model_info").json() == info
    # A simulated pod's tokenizer is its whole model: a router loads it from there, offline.
    assert info["model_path"] == info["tokenizer_path"] == str(qwen.loaded.path.parent)
    assert (Path(info["tokenizer_path"]) / "tokenizer.json").is_file()
    assert info["is_generation"] is True
    server = served.client.get("/get_server_info").json()
    assert served.client.get("/server_info").json() == server
    assert server["served_model_name"] == MODEL
    assert server["model_path"] == info["model_path"]
    assert (server["dp_size"], server["tp_size"], server["page_size"]) == (1, 1, 16)
    assert server["max_total_num_tokens"] == 1024 * 16


@pytest.mark.parametrize(("role", "mode"), [("both", "null"), ("prefill", "prefill"), ("decode", "decode")])
def test_server_info_and_the_config_announce_the_pods_role(qwen: PodTokenizer, role: str, mode: str) -> None:
    with serve(qwen, role=role) as s:
        assert s.client.get("/server_info").json()["disaggregation_mode"] == mode  # SGLang's names
        assert s.client.get("/admin/config").json()["role"] == role
        # The role restricts nothing: every pod serves whole requests and both sides of a transfer.
        request = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 2}
        for params in (None, {"do_remote_decode": True}, {"do_remote_prefill": True}):
            assert (
                s.client.post("/v1/completions", json={**request, "kv_transfer_params": params}).status_code
                == 200
            )


def test_get_load_counts_each_ranks_requests_and_tokens(qwen: PodTokenizer) -> None:
    with serve(qwen, max_num_seqs=1) as s:
        idle = [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        assert s.client.get("/get_load").json() == idle
        prompt = qwen.encode(SYSTEM)
        submissions = [
            s.pod.submit(
                request_id=f"load-{i}",
                model=MODEL,
                prompts=[(prompt, prompt)],
                sampling=SamplingParams(max_tokens=4),
                adapter=None,
                param="prompt",
            )
            for i in range(2)
        ]
        running = s.pod.engines[0].cache.num_used * 16  # the KV the first request holds
        assert running >= len(prompt)
        # One runs (max_num_seqs=1), one waits: its prompt counts as load before it holds KV.
        assert s.client.get("/get_load").json() == [
            {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1, "num_tokens": running + len(prompt)}
        ]
        for submission in submissions:
            for choice in submission.choices:
                choice.engine.abort(choice.state)
        assert s.client.get("/get_load").json() == idle


def test_health_generate_is_503_while_sleeping(served: Served) -> None:
    assert served.client.get("/health_generate").status_code == 200
    served.client.post("/sleep")
    assert served.client.get("/health_generate").status_code == 503
    served.client.post("/wake_up")
    assert served.client.get("/health_generate").status_code == 200


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_flush_cache_resets_the_prefix_cache(served: Served, method: str) -> None:
    served.client.post("/v1/completions", json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 1})
    assert served.client.request(method, "/flush_cache").status_code == 200
    assert served.events()[-1] == AllBlocksCleared()
