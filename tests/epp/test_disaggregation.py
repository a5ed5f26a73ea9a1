"""Prefill/decode disaggregation through Envoy and our Endpoint Picker: the picker names the decode
pod as the destination and the prefill pod in ``x-prefiller-host-port``; the decode pod's sidecar
(``gateway.sidecar``) runs the prefill step there, then its pod answers. Real Envoy, real
simulated pods serving vLLM's NixlConnector protocol, a real ingest and index."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.sidecar import Sidecar, SidecarSettings
from simulator.pod import PodTokenizer
from tests.epp.test_envoy import Front, complete, live
from tests.gateway.test_gateway import LONG, MODEL, System, _system, _upstream
from tests.servers import Served
from tokenization.tokenizers import TokenizerRegistry


@pytest.fixture(scope="module")
def tokenizer() -> PodTokenizer:
    return PodTokenizer(TokenizerRegistry(), MODEL)


@pytest.fixture
def front(tokenizer, tmp_path) -> Iterator[Front]:
    """Two prefill pods and two decode pods, each decode pod behind its sidecar (the address the
    registry has for it, as a pool's target port is the sidecar's)."""
    for system in _system(System(tokenizer, pods=4)):
        first, second, third, fourth = sorted(system.addresses)
        system.roles = {first: "prefill", second: "prefill", third: "decode", fourth: "decode"}
        system.engines = dict(system.addresses)  # type: ignore[attr-defined] (the pods themselves)
        for pod in (third, fourth):
            sidecar = Served(Sidecar(SidecarSettings(decode=system.addresses[pod])))
            system.gateways.append(sidecar)
            system.addresses[pod] = sidecar.address
        made = Front(system, tmp_path)
        yield made
        made.close()


def roles(front: Front, role: str) -> set[str]:
    return {pod for pod, r in front.system.roles.items() if r == role}


def test_the_decode_pods_sidecar_runs_the_prefill_step_the_picker_chose(front: Front) -> None:
    picker = front.picker(speculative_seconds=0.0)  # the index alone decides
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    first = complete(envoy.url, LONG, max_tokens=4)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvcache-pd"] == "disaggregated"
    prefilled_on = first.headers["x-kvcache-prefill-pod"]
    assert prefilled_on in roles(front, "prefill")
    assert first.headers["x-kvcache-pod"] in roles(front, "decode")
    assert first.json()["usage"]["completion_tokens"] == 4
    assert "x-prefiller-host-port" not in first.headers
    front.system.applied()
    for _ in range(3):  # the prefix is where it was computed: the same prefill pod
        again = complete(envoy.url, LONG + " and then something else")
        assert again.headers["x-kvcache-prefill-pod"] == prefilled_on
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    counts = picker.router.metrics
    assert counts.pd_requests.labels("disaggregated")._value.get() == 4
    assert counts.hits.labels("kv-load")._value.get() >= 3  # the prefill pods' prefix hits


def test_a_streamed_answer_comes_through_the_sidecar_and_envoy(front: Front) -> None:
    envoy = front.envoy(front.picker().address)
    envoy.wait_for_hosts(live(front))
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{envoy.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["x-kvcache-pd"] == "disaggregated"
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
    assert len([t for t in texts if t]) == 4


def test_a_decode_pod_without_a_sidecar_serves_the_request_whole_and_it_is_counted(front: Front) -> None:
    system = front.system
    for pod in roles(front, "decode"):
        system.addresses[pod] = system.engines[pod]  # the engines themselves: no sidecar
    picker = front.picker()
    envoy = front.envoy(picker.address)
    envoy.wait_for_hosts(live(front))
    response = complete(envoy.url, LONG, max_tokens=2)
    assert response.status_code == 200
    assert response.headers["x-kvcache-pd"] == "fallback"
    assert "x-kvcache-prefill-pod" not in response.headers
    assert picker.router.metrics.pd_fallbacks.labels("no_sidecar")._value.get() == 1


def test_a_clients_own_prefiller_header_never_reaches_a_sidecar(front: Front) -> None:
    """Who sets ``x-prefiller-host-port`` chooses where a sidecar sends the prompt: only the
    picker may. A client's is removed on a request the picker does not disaggregate."""
    system = front.system
    seen = []

    async def recorder(scope, receive, send):
        seen.append(scope["path"])
        await _upstream(scope, receive, send, chunks=[b"{}"])

    elsewhere = Served(recorder, lifespan="off")
    system.gateways.append(elsewhere)
    for pod in roles(front, "prefill"):  # only the pods behind sidecars, none prefills: served whole
        del system.roles[pod]
        del system.addresses[pod]
    envoy = front.envoy(front.picker().address)
    envoy.wait_for_hosts(live(front))
    response = httpx.post(
        f"{envoy.url}/v1/completions",
        json={"model": MODEL, "prompt": LONG, "max_tokens": 2},
        headers={"x-prefiller-host-port": elsewhere.address},
        timeout=30,
    )
    assert response.status_code == 200
    assert "x-kvcache-pd" not in response.headers
    assert seen == []
