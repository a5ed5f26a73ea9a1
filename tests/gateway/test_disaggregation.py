"""Prefill/decode disaggregation through the gateway, over real sockets: four simulated pods (two
prefill, two decode) serving vLLM's NixlConnector protocol, publishing KV events into a real
ingest pipeline and index; hand-made pods for what the simulator does not do on purpose."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from simulator.pod import PodTokenizer
from tests.gateway.test_gateway import LONG, MODEL, System, _system, _upstream, complete
from tests.servers import Served
from tokenization.tokenizers import TokenizerRegistry


@pytest.fixture(scope="module")
def tokenizer() -> PodTokenizer:
    return PodTokenizer(TokenizerRegistry(), MODEL)


@pytest.fixture
def pd(tokenizer) -> Iterator[System]:
    system = System(tokenizer, pods=4)
    first, second, third, fourth = sorted(system.addresses)
    system.roles = {first: "prefill", second: "prefill", third: "decode", fourth: "decode"}
    yield from _system(system)


def prefill_pods(system: System) -> set[str]:
    return {pod for pod, role in system.roles.items() if role == "prefill"}


def decode_pods(system: System) -> set[str]:
    return {pod for pod, role in system.roles.items() if role == "decode"}


def metric(url: str, name: str) -> float:
    """A sample of the gateway's ``/metrics`` (``name`` with its labels), 0 when absent; the
    gateway's metrics are its process's: a test reads differences."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


def stub(system: System, name: str, role: str, *, status: int = 200, body: bytes = b"{}") -> None:
    """A hand-made pod ``name`` of ``role`` answering ``status`` and ``body`` to everything."""
    served = Served(lambda s, r, w: _upstream(s, r, w, chunks=[body], status=status), lifespan="off")
    system.gateways.append(served)
    system.extra[name] = served.address
    system.roles[name] = role


def dead(system: System, name: str, role: str) -> None:
    """A pod ``name`` of ``role`` where nothing listens."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        system.extra[name] = f"127.0.0.1:{unused.getsockname()[1]}"
    system.roles[name] = role


def test_a_prompt_is_computed_on_a_prefill_pod_and_decoded_on_a_decode_pod(pd: System) -> None:
    url = pd.gateway(speculative_seconds=0.0)  # the index alone decides
    names = [
        'kvcache_gateway_pd_requests_total{decision="disaggregated"}',
        'kvcache_gateway_pd_step_seconds_count{step="prefill"}',
        'kvcache_gateway_pd_step_seconds_count{step="transfer"}',
    ]
    before = [metric(url, name) for name in names]
    first = complete(url, LONG, max_tokens=4)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvcache-pd"] == "disaggregated"
    prefilled_on = first.headers["x-kvcache-prefill-pod"]
    assert prefilled_on in prefill_pods(pd)
    assert first.headers["x-kvcache-pod"] in decode_pods(pd)
    assert first.headers["x-kvcache-prefill-matched-blocks"] == "0"
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "length"  # the decode pod's answer, not the prefill's one token
    assert first.json()["usage"]["completion_tokens"] == 4

    # The prefill pod computed the prompt and published its blocks: the next request sharing the
    # prefix goes to it, however loaded the other is; the decode pod pulled the blocks and holds
    # them too, so its answer reports them cached.
    pd.applied()
    for _ in range(3):
        again = complete(url, LONG + " and then something else", max_tokens=2)
        assert again.headers["x-kvcache-pd"] == "disaggregated"
        assert again.headers["x-kvcache-prefill-pod"] == prefilled_on
        assert int(again.headers["x-kvcache-prefill-matched-blocks"]) >= 20
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [metric(url, name) - b for name, b in zip(names, before, strict=True)] == [4, 4, 4]


def test_a_streamed_chat_is_prefilled_then_streamed_from_the_decode_pod(pd: System) -> None:
    url = pd.gateway()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["x-kvcache-pd"] == "disaggregated"
        assert response.headers["x-kvcache-prefill-pod"] in prefill_pods(pd)
        assert response.headers["x-kvcache-pod"] in decode_pods(pd)
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content") is not None]
    assert len(content) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_a_prefill_pod_that_is_down_is_skipped_for_the_next(pd: System) -> None:
    dead(pd, "a-dead-prefill", "prefill")  # round-robin ranks by name: it comes first
    url = pd.gateway(policy="round-robin")
    response = complete(url, LONG)
    assert response.status_code == 200
    assert response.headers["x-kvcache-pd"] == "disaggregated"
    assert response.headers["x-kvcache-prefill-pod"] in prefill_pods(pd) - {"a-dead-prefill"}


@pytest.mark.parametrize(
    ("prefill", "reason"),
    [
        (lambda system: dead(system, "p", "prefill"), "connect"),
        (lambda system: stub(system, "p", "prefill", status=503, body=b"overloaded"), "status"),
        (lambda system: stub(system, "p", "prefill", body=b'{"choices": []}'), "no_transfer_params"),
    ],
    ids=["down", "5xx", "no-transfer-params"],
)
def test_a_failed_prefill_step_falls_back_to_the_decode_pod_serving_it_whole(
    pd: System, prefill, reason
) -> None:
    for pod in prefill_pods(pd):
        pd.roles[pod] = "decode"
    prefill(pd)
    url = pd.gateway()
    names = [
        f'kvcache_gateway_pd_fallbacks_total{{reason="{reason}"}}',
        'kvcache_gateway_pd_requests_total{decision="fallback"}',
    ]
    before = [metric(url, name) for name in names]
    response = complete(url, LONG, max_tokens=3)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvcache-pd"] == "fallback"
    assert "x-kvcache-prefill-pod" not in response.headers
    assert response.headers["x-kvcache-pod"] in decode_pods(pd) - {"p"}
    assert response.json()["usage"]["completion_tokens"] == 3
    assert [metric(url, name) - b for name, b in zip(names, before, strict=True)] == [1, 1]


def test_a_prefill_pods_refusal_of_the_request_is_the_clients_answer(pd: System) -> None:
    for pod in prefill_pods(pd):
        del pd.roles[pod]
        pd.addresses.pop(pod)
    refusal = b'{"error": {"message": "the prompt is too long", "type": "BadRequestError", "code": 400}}'
    stub(pd, "p", "prefill", status=400, body=refusal)
    response = complete(pd.gateway(), LONG)
    assert response.status_code == 400
    assert response.content == refusal
    assert response.headers["x-kvcache-pod"] == "p"
    assert response.headers["x-kvcache-pd"] == "prefill_refused"


def test_a_decode_pod_that_is_down_after_the_prefill_is_skipped_for_the_next(pd: System) -> None:
    dead(pd, "a-dead-decode", "decode")
    url = pd.gateway(policy="round-robin")
    response = complete(url, LONG, max_tokens=2)
    assert response.status_code == 200
    assert response.headers["x-kvcache-pd"] == "disaggregated"
    assert response.headers["x-kvcache-pod"] in decode_pods(pd) - {"a-dead-decode"}


def test_a_prompt_below_the_threshold_is_served_whole_by_a_decode_pod(pd: System) -> None:
    url = pd.gateway(pd_threshold_tokens=64)
    name = 'kvcache_gateway_pd_requests_total{decision="short_prompt"}'
    before = metric(url, name)
    short = complete(url, "a short question")
    assert short.status_code == 200
    assert short.headers["x-kvcache-pd"] == "short_prompt"
    assert "x-kvcache-prefill-pod" not in short.headers
    assert short.headers["x-kvcache-pod"] in decode_pods(pd)
    long = complete(url, LONG)
    assert long.headers["x-kvcache-pd"] == "disaggregated"
    assert metric(url, name) - before == 1


def test_a_model_without_both_roles_is_served_whole(pd: System) -> None:
    for pod in decode_pods(pd):
        pd.roles[pod] = "prefill"  # prefill pods alone: each serves whole requests
    response = complete(pd.gateway(), LONG)
    assert response.status_code == 200
    assert "x-kvcache-pd" not in response.headers
    assert response.json()["choices"][0]["finish_reason"] == "length"
