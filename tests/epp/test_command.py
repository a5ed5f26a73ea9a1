"""``manage.py epp`` as a process behind a real Envoy, its pods an InferencePool's: the pool read
from ``FakeApiServer`` (tests/epp/test_kubernetes.py: the Kubernetes API's list and watch of pods,
GET of an InferencePool; no kube-apiserver is installable here) through ``KUBECONFIG``, its ready
pods a simulated pod; a pod turning ready later is routed to as soon as the watch says so."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import yaml
from aiohttp import web

from bench.faults import project_env
from simulator.config import EngineConfig, LatencyConfig, PodConfig
from simulator.fleet import Fleet, FleetConfig, FleetThread
from simulator.pod import PodTokenizer
from tests.epp.harness import Envoy, free_port
from tests.epp.test_kubernetes import NAMESPACE, SELECTOR, TOKEN, FakeApiServer, pod
from tests.servers import wait_until
from tokenization.tokenizers import TokenizerRegistry

ROOT = Path(__file__).resolve().parents[2]
MODEL = "Qwen/Qwen3-0.6B"


class ApiThread:
    """``FakeApiServer`` on a loopback port, served from a thread with its own event loop."""

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = self.call(self._start())

    async def _start(self) -> web.AppRunner:
        runner = web.AppRunner(self.api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def close(self) -> None:
        self.call(self.api.end_watches())
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)


def kubeconfig(path: Path, port: int) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "epp", "user": {"token": TOKEN}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "epp", "namespace": NAMESPACE}}
                ],
                "current-context": "fake",
            }
        )
    )
    return path


def pool_hosts(endpoints: Path) -> set[str] | None:
    """The ``ip:port`` of the endpoints file the picker writes for Envoy (``None``: not yet)."""
    if not endpoints.exists():
        return None
    assignment = json.loads(endpoints.read_text())["resources"][0]
    addresses = (
        e["endpoint"]["address"]["socket_address"] for g in assignment["endpoints"] for e in g["lb_endpoints"]
    )
    return {f"{a['address']}:{a['port_value']}" for a in addresses}


def test_the_epp_command_routes_to_an_inference_pools_ready_pods(tmp_path) -> None:
    config = PodConfig(
        pod_id="sim-0",
        model=MODEL,
        engine=EngineConfig(block_size=16, kv_cache_size=512),
        latency=LatencyConfig(prefill_overhead_ms=1, prefill_time_per_token_ms=0, inter_token_latency_ms=1),
    )
    fleet = Fleet(
        FleetConfig(pod=config, pods=1, base_port=0), tokenizer=PodTokenizer(TokenizerRegistry(), MODEL)
    )
    running = FleetThread(fleet)
    first = fleet.pods[0].url.removeprefix("http://")
    port = int(first.rpartition(":")[2])  # the pool's target port: the simulated pod's
    api = FakeApiServer()
    api.pools["vllm"] = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "vllm", "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": dict(SELECTOR)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "kvcache-epp", "port": {"number": 9002}},
        },
    }
    served = ApiThread(api)
    served.call(api.put(pod("vllm-a", "127.0.0.1")))
    served.call(api.put(pod("vllm-b", "127.0.0.2", ready=False)))
    env = project_env(
        tmp_path,
        "redis://127.0.0.1:1/0",
        KVCACHE_INDEX_BACKEND="memory",
        KUBECONFIG=str(kubeconfig(tmp_path / "kubeconfig", served.port)),
    )
    grpc_port, endpoints = free_port(), tmp_path / "pool.json"
    epp = subprocess.Popen(
        [sys.executable, "manage.py", "epp", "--grpc-port", str(grpc_port), "--metrics-port", "0",
         "--pool-name", "vllm", "--pool-namespace", NAMESPACE, "--pool-model", MODEL,
         "--endpoints-file", str(endpoints)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    envoy, output = None, ""
    try:
        wait_until(lambda: pool_hosts(endpoints) == {first}, what="the pool's pods", timeout=60)
        envoy = Envoy(f"127.0.0.1:{grpc_port}", endpoints)
        envoy.wait_for_hosts({first})
        answer = httpx.post(
            f"{envoy.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 1},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvcache-pod"] == first  # pods are known by their address
        assert answer.headers["x-simulated-pod"] == "sim-0"
        # The watch: the pod leaving empties the pool, and the picker says 503 at once.
        served.call(api.delete("vllm-a"))
        wait_until(lambda: pool_hosts(endpoints) == set(), what="the pod gone from the pool")
        gone = httpx.post(f"{envoy.url}/v1/completions", json={"model": MODEL, "prompt": "hello"}, timeout=10)
        assert gone.status_code == 503
        assert [q["labelSelector"] for q in api.list_requests()] == ["app.kubernetes.io/name=vllm-qwen3"]
    finally:
        if envoy is not None:
            envoy.stop()
        os.killpg(epp.pid, signal.SIGTERM)
        output = epp.communicate(timeout=20)[0].decode()
        print(output)  # shown when the test fails
        served.close()
        running.close()
    assert epp.returncode == 0, output
    assert "Pool: pods of serving" in output
