"""``manage.py gateway --index in-process`` as real processes, with no Valkey anywhere: two
replicas of the gateway, each keeping its own index and subscribing to the KV events of two
simulated pods (``manage.py simulate``, their PUBs bound and registered with their event
endpoints) itself, with replay, liveness and the registry followed.

The tests run in order on one fleet and one pair of gateways (the last one deletes a pod)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.core.management import CommandError, call_command

from tests.ports import free_port
from tests.simulated_fleet import MODEL, Process, SimulatedFleet, eventually, per_pod, prompt, samples

BEFORE = prompt("before")
"""Cached on sim-1 before any gateway started: the gateways learn it from sim-1's replay."""


@dataclass
class Gateway:
    process: Process
    url: str

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def admitted(self) -> dict[str, float]:
        """Blocks stored into this gateway's own index, per pod."""
        return per_pod(self.metrics(), "kvcache_index_admissions_total")


@dataclass
class Stack:
    fleet: SimulatedFleet
    gateways: list[Gateway]
    before_blocks: int
    """The full blocks of ``BEFORE``."""


def blocks_of(answer: httpx.Response) -> int:
    """The full blocks of the prompt a pod answered (16 tokens each)."""
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens"] // 16


def start_gateway(fleet: SimulatedFleet, tmp: Path, name: str) -> Gateway:
    port = free_port()
    process = Process(fleet.env, tmp / f"{name}.log", "gateway", "--port", str(port), "--index", "in-process")
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert process.alive(), process.output()
        try:
            return MODEL in httpx.get(f"{url}/v1/models", timeout=1).text
        except httpx.HTTPError:
            return False

    eventually(serving, timeout=60, what=f"{name} serving")
    return Gateway(process, url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("in-process-gateway")
    fleet = SimulatedFleet(tmp)
    gateways: list[Gateway] = []
    try:
        before_blocks = blocks_of(fleet.complete(fleet.urls["sim-1"], BEFORE))
        gateways = [start_gateway(fleet, tmp, f"gateway-{i}") for i in range(2)]
        yield Stack(fleet, gateways, before_blocks)
    finally:
        codes = [gateway.process.stop() for gateway in gateways]
        fleet.stop()
    outputs = "\n".join(g.process.output() for g in gateways)
    assert codes == [0] * len(gateways), outputs  # SIGTERM drains ingest and exits 0


def routed(url: str, text: str) -> tuple[str, int]:
    answer = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-simulated-pod"] == answer.headers["x-kvcache-pod"]
    return answer.headers["x-kvcache-pod"], int(answer.headers["x-kvcache-matched-blocks"])


def test_each_replica_learns_what_a_pod_cached_before_it_started_from_the_pods_replay(stack: Stack):
    blocks = stack.before_blocks
    for gateway in stack.gateways:
        eventually(lambda g=gateway: g.admitted().get("sim-1", 0) >= blocks, what="sim-1's replay")
        metrics = gateway.metrics()
        assert per_pod(metrics, "kvcache_ingest_replayed_batches_total")["sim-1"] >= 1
        assert samples(metrics, "kvcache_ingest_replica_pods") == {(("replica", "in-process"),): 2.0}
        eventually(
            lambda g=gateway: samples(g.metrics(), "kvcache_liveness_pods")[(("health", "up"),)] == 2.0,
            what="both pods probed up",
        )
        assert routed(gateway.url, BEFORE) == ("sim-1", blocks)


def test_a_prefix_routed_by_one_replica_goes_to_the_same_pod_through_the_other(stack: Stack):
    first, second = stack.gateways
    text = prompt("shared")
    before = [g.admitted() for g in stack.gateways]
    answer = httpx.post(
        f"{first.url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=30
    )
    pod, blocks = answer.headers["x-kvcache-pod"], blocks_of(answer)
    assert answer.headers["x-kvcache-matched-blocks"] == "0"
    for gateway, admitted in zip(stack.gateways, before, strict=True):  # both saw the pod's events
        eventually(
            lambda g=gateway, a=admitted: g.admitted().get(pod, 0) >= a.get(pod, 0) + blocks,
            what=f"{pod}'s events in each replica's index",
        )
    assert routed(second.url, text) == (pod, blocks)
    assert routed(first.url, text) == (pod, blocks)


def test_a_pod_deleted_from_the_registry_is_let_go_and_forgotten(stack: Stack):
    text = prompt("deleted")
    blocks = blocks_of(stack.fleet.complete(stack.fleet.urls["sim-0"], text))
    for gateway in stack.gateways:
        eventually(lambda g=gateway: g.admitted().get("sim-0", 0) >= blocks, what="sim-0's blocks")
    # Each second, housekeeping records the pods heard from in the registry: a row deleted before
    # it recorded their last events is made again (a pod that publishes is registered again, as
    # with manage.py ingest). Deleted after that, it stays deleted.
    time.sleep(2.5)
    with sqlite3.connect(stack.fleet.tmp / "db.sqlite3") as db:  # as another process's delete does
        db.execute("delete from scoring_pod where pod_id = 'sim-0'")
    for gateway in stack.gateways:

        def forgotten(g: Gateway = gateway) -> bool:
            metrics = g.metrics()
            held = samples(metrics, "kvcache_ingest_replica_pods")[(("replica", "in-process"),)]
            return held == 1.0 and "sim-0" not in per_pod(metrics, "kvcache_index_admissions_total")

        eventually(forgotten, timeout=10, what="sim-0 let go and forgotten")
        assert "pod sim-0 left the registry" in gateway.process.output()
        assert routed(gateway.url, text)[0] == "sim-1"  # the only pod left


def test_the_command_refuses_what_an_in_process_index_cannot_do(settings):
    with pytest.raises(CommandError, match="one worker process"):
        call_command("gateway", index="in-process", workers=2)
    with pytest.raises(CommandError, match="go with --index in-process"):
        call_command("gateway", ingest_connect=["tcp://127.0.0.1:5557"])
    settings.KVCACHE_IN_PROCESS_INDEX = "redis://127.0.0.1:6379/0"
    with pytest.raises(CommandError, match="KVCACHE_IN_PROCESS_INDEX must be a memory:// URL"):
        call_command("gateway", index="in-process")
