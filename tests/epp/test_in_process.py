"""``manage.py epp --index in-process`` as a real process behind a real Envoy, with no Valkey: the
picker keeps its own index and subscribes to the KV events of two simulated pods (``manage.py
simulate``, their PUBs bound and registered with their event endpoints) itself, and picks the pod
that holds a request's prefix."""

from __future__ import annotations

import httpx

from tests.epp.harness import Envoy
from tests.ports import free_port
from tests.simulated_fleet import MODEL, Process, SimulatedFleet, eventually, per_pod, prompt, samples


def test_the_picker_keeps_its_own_index_and_picks_the_pod_holding_the_prefix(tmp_path) -> None:
    fleet = SimulatedFleet(tmp_path)
    grpc_port, metrics_port, endpoints = free_port(), free_port(), tmp_path / "pool.json"
    epp = envoy = None
    try:
        cached = prompt("picker")
        before = fleet.complete(fleet.urls["sim-1"], cached)  # before the picker runs: replayed to it
        blocks = before.json()["usage"]["prompt_tokens"] // 16
        epp = Process(
            fleet.env, tmp_path / "epp.log",
            "epp", "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
            "--endpoints-file", str(endpoints), "--index", "in-process",
        )  # fmt: skip

        def metrics() -> str:
            assert epp.alive(), epp.output()
            try:
                return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).text
            except httpx.HTTPError:
                return ""

        eventually(
            lambda: per_pod(metrics(), "kvcache_index_admissions_total").get("sim-1", 0) >= blocks,
            timeout=60,
            what="sim-1's replay in the picker's index",
        )
        assert samples(metrics(), "kvcache_ingest_replica_pods") == {(("replica", "in-process"),): 2.0}
        envoy = Envoy(f"127.0.0.1:{grpc_port}", endpoints)
        envoy.wait_for_hosts({url.removeprefix("http://") for url in fleet.urls.values()})

        def through_envoy(text: str) -> httpx.Response:
            body = {"model": MODEL, "prompt": text, "max_tokens": 1}
            answer = httpx.post(f"{envoy.url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvcache-pod"] == answer.headers["x-simulated-pod"]
            return answer

        for _ in range(3):  # by its KV hits, not by load or chance
            assert through_envoy(cached).headers["x-kvcache-pod"] == "sim-1"
        fresh = prompt("fresh")
        admitted = per_pod(metrics(), "kvcache_index_admissions_total")
        answer = through_envoy(fresh)
        pod, fresh_blocks = answer.headers["x-kvcache-pod"], answer.json()["usage"]["prompt_tokens"] // 16
        eventually(
            lambda: (
                per_pod(metrics(), "kvcache_index_admissions_total").get(pod, 0)
                >= admitted.get(pod, 0) + fresh_blocks
            ),
            what=f"{pod}'s events in the picker's index",
        )
        for _ in range(3):
            assert through_envoy(fresh).headers["x-kvcache-pod"] == pod
    finally:
        if envoy is not None:
            envoy.stop()
        code = epp.stop() if epp is not None else 0
        fleet.stop()
    assert code == 0, epp.output()
    assert "in-process index: every registered event endpoint" in epp.output()
