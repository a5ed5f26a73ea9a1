"""What the gateway adds to a request: the same request sent to a pod directly and through
``manage.py gateway``, side by side in one run.

Real processes: Valkey, ``manage.py simulate`` (2 zero-latency pods, registered with their
addresses), ``manage.py ingest`` (their KV events), ``manage.py gateway --workers 1`` with the
policy under test. Requests are sequential, non-streaming, one output token, over kept-alive
connections; direct and gateway requests alternate, so both see the same machine. The overhead
is the gateway's latency minus the direct one (medians, and per percentile).

Prompts: *short* (a ~60-token completion prompt) and *chat* (a ~3,000-token system prompt plus a
question: tokenizing it, with the chat template, is most of the gateway's own work).

    .venv/bin/python bench/gateway.py [--requests 300] [--policies kv-load,random]
        [--loops asyncio,uvloop] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.faults import Valkey, free_port, free_port_range, project_env, wait_for  # noqa: E402
from bench.machine import machine  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
WORDS = ["cache", "block", "prefix", "token", "engine", "router", "model", "latency", "memory"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


ZERO_LATENCY = (
    "--prefill-overhead-ms",
    "0",
    "--prefill-time-per-token-ms",
    "0",
    "--inter-token-latency-ms",
    "0",
)


class Stack:
    """Valkey, ``ingest`` and ``simulate`` (``pods`` pods of :data:`MODEL`, registered with their
    addresses, publishing to ingest; ``simulate_args`` set their engine and latency) as child
    processes; gateways are started and stopped on top of them. With ``bind_events`` each pod
    binds its KV-event socket (vLLM's default; ``events_endpoint``, pod ``i`` on its port + i) and
    ingest connects to each, so that other subscribers (Dynamo's router) can connect too."""

    def __init__(
        self, *, pods: int = 2, simulate_args: tuple[str, ...] = ZERO_LATENCY, bind_events: bool = False
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvgateway-"))
        self.valkey = Valkey()
        # The routing benchmark (bench/routing.py) compares the gateway's matched blocks with the
        # pods' cached tokens, and its one load generator stands for many clients.
        self.env = project_env(
            self.tmp,
            self.valkey.url,
            KVCACHE_POD_DOWN_SECONDS="0",
            KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER="true",
            KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT="0",
        )
        self.pod_port = free_port_range(pods)
        if bind_events:
            events_port = free_port_range(pods)
            self.events_endpoint = f"tcp://*:{events_port}"
            sockets = [
                arg for i in range(pods) for arg in ("--connect", f"tcp://127.0.0.1:{events_port + i}")
            ]
        else:
            ingest_port = free_port()
            self.events_endpoint = f"tcp://127.0.0.1:{ingest_port}"
            sockets = ["--bind", self.events_endpoint]
        self.procs = [
            self._start("ingest", *sockets, "--workers", "1"),
            self._start(
                "simulate",
                "--pods",
                str(pods),
                "--base-port",
                str(self.pod_port),
                "--events-endpoint",
                self.events_endpoint,
                "--register",
                *simulate_args,
            ),
        ]
        self.gateways: list[subprocess.Popen] = []
        self.pod_url = f"http://127.0.0.1:{self.pod_port}"
        self.pod_urls = {f"sim-{i}": f"http://127.0.0.1:{self.pod_port + i}" for i in range(pods)}
        for url in self.pod_urls.values():
            wait_for(lambda url=url: _answers(f"{url}/health"), timeout=60, what="the pods", every=0.1)

    def _start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start_gateway(self, policy: str, loop: str = "asyncio") -> str:
        """One more gateway (one worker) with ``policy`` on event loop ``loop``; its base URL once
        it serves the model."""
        port = free_port()
        args = ("--port", str(port), "--workers", "1", "--policy", policy, "--loop", loop)
        self.gateways.append(self._start("gateway", *args))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{url}/v1/models", b"Qwen"), timeout=60, what="the gateway", every=0.1)
        return url

    def stop_gateways(self) -> None:
        for gateway in self.gateways:
            gateway.send_signal(signal.SIGTERM)
        for gateway in self.gateways:
            gateway.wait(20)
        self.gateways.clear()

    def close(self) -> None:
        self.stop_gateways()
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.valkey.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _answers(url: str, needle: bytes = b"") -> bool:
    try:
        response = httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and needle in response.content


def bodies(kind: str, n: int) -> list[tuple[str, dict]]:
    """(path, body) of ``n`` requests: distinct questions over one shared prefix."""
    system = " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(1500))
    out = []
    for i in range(n):
        question = f"question {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(20))
        if kind == "short":
            out.append(("/v1/completions", {"model": MODEL, "prompt": question, "max_tokens": 1}))
        else:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            out.append(("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}))
    return out


def measure(gateway_url: str, pod_url: str, kind: str, requests: int) -> dict:
    direct, through = [], []
    with httpx.Client(timeout=30) as client:
        for path, body in bodies(kind, 20):  # warm both (connections, caches, the prefix)
            client.post(pod_url + path, json=body)
            client.post(gateway_url + path, json=body)
        for path, body in bodies(kind, requests):
            for url, into in ((pod_url, direct), (gateway_url, through)):
                started = time.perf_counter()
                response = client.post(url + path, json=body)
                into.append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, response.text
    overhead = [t - d for t, d in zip(through, direct, strict=True)]
    return {
        "direct_p50_ms": round(statistics.median(direct), 3),
        "gateway_p50_ms": round(statistics.median(through), 3),
        "overhead_p50_ms": round(statistics.median(overhead), 3),
        "overhead_p90_ms": round(percentile(overhead, 0.9), 3),
        "overhead_p99_ms": round(percentile(overhead, 0.99), 3),
        "requests": requests,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--policies", default="kv-load,random")
    parser.add_argument("--loops", default="asyncio", help="the gateway's event loops: asyncio,uvloop")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "gateway.json")
    args = parser.parse_args(argv)
    report: dict = {"machine": machine(requests=args.requests), "results": []}
    stack = Stack()
    try:
        for loop in args.loops.split(","):
            for policy in args.policies.split(","):
                stack.stop_gateways()
                url = stack.start_gateway(policy, loop)
                for kind in ("short", "chat"):
                    result = {
                        "policy": policy,
                        "loop": loop,
                        "prompt": kind,
                        **measure(url, stack.pod_url, kind, args.requests),
                    }
                    report["results"].append(result)
                    print(json.dumps(result), flush=True)
    finally:
        stack.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
