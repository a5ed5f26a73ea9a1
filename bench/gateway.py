"""What the gateway adds to a request: the same request sent to a pod directly, through
``manage.py gateway`` and through a real Envoy routed by our Endpoint Picker (``manage.py epp``,
the same policy: ``bench/envoy_front.py``), side by side in one run.

Real processes: Valkey, ``manage.py simulate`` (2 zero-latency pods, registered with their
addresses), ``manage.py ingest`` (their KV events), ``manage.py gateway --workers 1`` with the
policy under test. Requests are sequential, non-streaming, one output token, over kept-alive
connections; direct and gateway requests alternate, so both see the same machine. The overhead
is the gateway's latency minus the direct one (medians, and per percentile). ``--index
in-process``: the gateway and the picker keep their own index (``--index in-process``), subscribed
to the pods, which bind their KV-event sockets (ingest connects to them too).

Prompts: *short* (a ~60-token completion prompt), *chat* (a ~3,000-token system prompt plus a
question: the prefix store and the chain memo reuse all but the question) and *distinct* (each
request a conversation of its own, ~1,000 tokens of seeded words: nothing to reuse, every token
tokenized and every block hashed, as with the distinct prompts of a production trace).

Every row also reports the gateway's own time (p50 and p90 of ``kvcache_gateway_overhead_seconds``
over the row's requests, read from its ``/metrics``: interpolated within the histogram's buckets,
0.5 / 1 / 2 / 5 / 10 ms) and the CPU time of the gateway process per request (its
``/proc/<pid>/stat`` user + system time over the row, its load scraper included: ~0.01 ms a
request at these rates).

*distinct at N QPS* (``--load-qps``, 0 to skip): distinct prompts arriving as a Poisson process,
streamed, ``--load-output-tokens`` each, so that requests overlap and the gateway relays answers
while it keys new ones; the gateway's own time and CPU per request, no direct twin.

Envoy + the picker (``--envoy``, the default; ``make envoy``): per row its added latency (p50,
p90, p99), the picker's time per pick (``kvcache_epp_pick_seconds``, p50 and p90) and the CPU time
of the picker and of Envoy per request. Before the policies, the *Envoy floor* rows split that
added latency: Envoy alone in front of a pod (``plain``) and Envoy with a picker that names the
pod without looking at the request (``fixed``, ``bench/fixed_picker.py``): Envoy's hop, then the
ext_proc exchange in Python, apart from the choice. The *rate* rows (``--rate-connections``):
distinct short completions as fast as ``wrk`` gets them answered through the gateway and through
Envoy, requests/s and each process's CPU per request.

    .venv/bin/python bench/gateway.py [--requests 300] [--policies kv-load,random]
        [--prompts short,chat,distinct] [--load-qps 6] [--load-requests 240]
        [--loops asyncio,uvloop] [--no-envoy] [--rate-connections 16,64] [--index in-process] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
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

from bench.envoy_front import EnvoyFloor, EnvoyFront  # noqa: E402
from bench.faults import Valkey, free_port, free_port_range, project_env, wait_for  # noqa: E402
from bench.machine import machine  # noqa: E402
from dashboard.gateways import Buckets, parse_gateway_metrics  # noqa: E402
from simulator.loadgen.workload import words  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
WORDS = ["cache", "block", "prefix", "token", "engine", "router", "model", "latency", "memory"]
DISTINCT_TOKENS = 1000
PROMPTS = ("short", "chat", "distinct")


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
    ingest connects to each, so that other subscribers (Dynamo's router, a gateway with an
    in-process index) can connect too."""

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
        self.binds_events = bind_events
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
        self.fronts: list[EnvoyFront] = []
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

    def start_gateway(self, policy: str, loop: str = "asyncio", *, index: str = "shared") -> str:
        """One more gateway (one worker) with ``policy`` on event loop ``loop``; its base URL once
        it serves the model. ``index="in-process"``: the gateway keeps its own index, subscribed
        to the pods' event endpoints (registered by ``simulate --register``: ``bind_events``)."""
        if index == "in-process" and not self.binds_events:
            raise ValueError("an in-process gateway subscribes to the pods: the stack needs bind_events")
        port = free_port()
        args = ("--port", str(port), "--workers", "1", "--policy", policy, "--loop", loop, "--index", index)
        self.gateways.append(self._start("gateway", *args))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{url}/v1/models", b"Qwen"), timeout=60, what="the gateway", every=0.1)
        return url

    def start_envoy(self, policy: str, *, index: str = "shared") -> str:
        """Envoy + the Endpoint Picker with ``policy`` (``bench.envoy_front``) over ``index`` (as
        ``start_gateway``'s); Envoy's base URL once a request through it is routed."""
        front = EnvoyFront(self.env, policy, self.tmp / "envoy", model=MODEL, index=index)
        self.fronts.append(front)
        return front.url

    def stop_gateways(self) -> None:
        for front in self.fronts:
            front.stop()
        self.fronts.clear()
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


def bodies(kind: str, n: int, *, start: int = 0) -> list[tuple[str, dict]]:
    """(path, body) of ``n`` requests: distinct questions over one shared prefix (``short``,
    ``chat``), or conversations that share nothing (``distinct``: requests ``start`` to
    ``start + n``, each ~1,000 tokens of seeded words)."""
    if kind == "distinct":
        return [("/v1/chat/completions", distinct_body(i)) for i in range(start, start + n)]
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


def distinct_body(i: int, *, max_tokens: int = 1, stream: bool = False) -> dict:
    """Conversation ``i``: one user message of ~1,000 tokens of seeded words, its own from the
    first word."""
    text = words(random.Random(f"gateway-bench/distinct/{i}"), DISTINCT_TOKENS)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return {**body, "stream": True} if stream else body


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_time(gateway_url: str) -> Buckets:
    """The gateway's ``kvcache_gateway_overhead_seconds`` histogram so far."""
    return parse_gateway_metrics(httpx.get(f"{gateway_url}/metrics", timeout=5).text).overhead


class GatewayUse:
    """What the gateway spent over a stretch of requests: its own time and its CPU time."""

    def __init__(self, gateway_url: str, pid: int) -> None:
        self.url, self.pid = gateway_url, pid
        self.own, self.cpu = own_time(gateway_url), cpu_seconds(pid)

    def report(self, requests: int) -> dict:
        own = own_time(self.url).since(self.own)
        p50, p90 = own.quantile(0.5), own.quantile(0.9)
        return {
            "own_p50_ms": None if p50 is None else round(1000 * p50, 3),
            "own_p90_ms": None if p90 is None else round(1000 * p90, 3),
            "cpu_ms_per_request": round(1000 * (cpu_seconds(self.pid) - self.cpu) / requests, 3),
        }


class FrontUse:
    """What Envoy + the picker spent over a stretch of requests: the picker's time per pick and
    both processes' CPU time."""

    def __init__(self, front: EnvoyFront) -> None:
        self.front = front
        self.picks = front.pick_seconds()
        self.cpu = {name: cpu_seconds(pid) for name, pid in front.pids.items()}

    def report(self, requests: int) -> dict:
        picks = self.front.pick_seconds().since(self.picks)
        p50, p90 = picks.quantile(0.5), picks.quantile(0.9)
        cpu = {
            f"{name}_cpu_ms_per_request": round(1000 * (cpu_seconds(pid) - self.cpu[name]) / requests, 3)
            for name, pid in self.front.pids.items()
        }
        return {
            "pick_p50_ms": None if p50 is None else round(1000 * p50, 3),
            "pick_p90_ms": None if p90 is None else round(1000 * p90, 3),
            **cpu,
        }


def measure(
    gateway_url: str, pid: int, pod_url: str, kind: str, requests: int, front: EnvoyFront | None = None
) -> dict:
    """Each request sent directly, through the gateway and (with ``front``) through Envoy + the
    picker, one after the other: the same prompts, the same moment of the machine."""
    targets = [("gateway", gateway_url)] + ([("envoy", front.url)] if front is not None else [])
    direct: list[float] = []
    through: dict[str, list[float]] = {name: [] for name, _ in targets}
    with httpx.Client(timeout=30) as client:
        # Warm every path (connections, caches, the prefix); distinct prompts warm with their own.
        for path, body in bodies(kind, 20, start=10**6):
            for url in (pod_url, *(url for _, url in targets)):
                client.post(url + path, json=body)
        use = GatewayUse(gateway_url, pid)
        front_use = FrontUse(front) if front is not None else None
        for path, body in bodies(kind, requests):
            for url, into in ((pod_url, direct), *((url, through[name]) for name, url in targets)):
                started = time.perf_counter()
                response = client.post(url + path, json=body)
                into.append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, response.text
        used = use.report(requests)
        front_used = front_use.report(requests) if front_use is not None else {}
    overhead = [t - d for t, d in zip(through["gateway"], direct, strict=True)]
    result = {
        "direct_p50_ms": round(statistics.median(direct), 3),
        "gateway_p50_ms": round(statistics.median(through["gateway"]), 3),
        "overhead_p50_ms": round(statistics.median(overhead), 3),
        "overhead_p90_ms": round(percentile(overhead, 0.9), 3),
        "overhead_p99_ms": round(percentile(overhead, 0.99), 3),
        **used,
        "requests": requests,
    }
    if front is not None:
        added = [t - d for t, d in zip(through["envoy"], direct, strict=True)]
        result |= {
            "envoy_p50_ms": round(statistics.median(through["envoy"]), 3),
            "envoy_overhead_p50_ms": round(statistics.median(added), 3),
            "envoy_overhead_p90_ms": round(percentile(added, 0.9), 3),
            "envoy_overhead_p99_ms": round(percentile(added, 0.99), 3),
            **front_used,
        }
    return result


def measure_floor(pod_url: str, kind: str, requests: int, floors: dict[str, EnvoyFloor]) -> dict:
    """What Envoy + the picker's added latency is made of: each request sent directly, through
    Envoy alone (``plain``) and through Envoy and a picker that names the pod without looking
    (``fixed``): Envoy's hop, then the ext_proc exchange, apart from the choice."""
    times: dict[str, list[float]] = {"direct": [], **{name: [] for name in floors}}
    with httpx.Client(timeout=30) as client:
        for path, body in bodies(kind, 20, start=10**6):
            for url in (pod_url, *(f.url for f in floors.values())):
                client.post(url + path, json=body)
        for path, body in bodies(kind, requests):
            for name, url in (("direct", pod_url), *((n, f.url) for n, f in floors.items())):
                started = time.perf_counter()
                response = client.post(url + path, json=body)
                times[name].append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, response.text
    result = {"direct_p50_ms": round(statistics.median(times["direct"]), 3), "requests": requests}
    for name in floors:
        added = [t - d for t, d in zip(times[name], times["direct"], strict=True)]
        result[f"{name}_added_p50_ms"] = round(statistics.median(added), 3)
        result[f"{name}_added_p99_ms"] = round(percentile(added, 0.99), 3)
    return result


WRK_SCRIPT = """
-- Distinct short completions (a counter in each prompt), as bench/gateway.py's short row sends them.
local n = 0
local words = "%s"
local run = tostring(os.time())
request = function()
  n = n + 1
  local prompt = "question " .. n .. " of run " .. run .. ": " .. words
  local body = '{"model": "%s", "max_tokens": 1, "prompt": "' .. prompt .. '"}'
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end
"""


def measure_rate(url: str, pids: dict[str, int], *, connections: int, seconds: int, workdir: Path) -> dict:
    """Distinct short completions as fast as ``wrk`` gets them answered over ``connections``
    connections: requests/s, latency, and each of ``pids``' CPU per request (the requests/s one
    core of it would carry: 1000 / its CPU ms per request)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: make bench-deps")
    words = " ".join(WORDS[j % len(WORDS)] for j in range(20))
    script = workdir / "rate.lua"
    script.write_text(WRK_SCRIPT % (words, MODEL))
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    argv = [
        wrk,
        "-t1",
        f"-c{connections}",
        f"-d{seconds}s",
        "--latency",
        "-s",
        str(script),
        url + "/v1/completions",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    requests = int(next(line for line in out.splitlines() if "requests in" in line).split()[0])
    rate = float(next(line for line in out.splitlines() if line.startswith("Requests/sec")).split()[1])
    non_2xx = next((int(line.split()[-1]) for line in out.splitlines() if "Non-2xx" in line), 0)
    latency = {
        line.split()[0]: _ms(line.split()[1])
        for line in out.splitlines()
        if line.strip().startswith(("50%", "99%"))
    }
    cpu = {
        f"{name}_cpu_ms_per_request": round(1000 * (cpu_seconds(pid) - before[name]) / max(requests, 1), 3)
        for name, pid in pids.items()
    }
    return {
        "connections": connections,
        "requests_per_s": rate,
        "non_2xx": non_2xx,
        "p50_ms": latency.get("50%"),
        "p99_ms": latency.get("99%"),
        **cpu,
    }


def _ms(text: str) -> float:
    """wrk's latency (``1.23ms``, ``456.00us``, ``1.20s``) in ms."""
    for unit, scale in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if text.endswith(unit):
            return round(float(text.removesuffix(unit)) * scale, 3)
    return float(text)


def measure_loaded(gateway_url: str, pid: int, *, qps: float, requests: int, output_tokens: int) -> dict:
    """Distinct prompts at ``qps`` (Poisson arrivals, seeded), streamed: the gateway's own time and
    CPU per request while it relays the answers of the requests before."""

    async def run() -> tuple[float, int]:
        arrivals = random.Random(f"gateway-bench/arrivals/{qps}")
        in_flight, most = 0, 0
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def one(i: int) -> None:
                nonlocal in_flight, most
                in_flight += 1
                most = max(most, in_flight)
                body = distinct_body(i, max_tokens=output_tokens, stream=True)
                try:
                    async with client.stream(
                        "POST", f"{gateway_url}/v1/chat/completions", json=body
                    ) as answer:
                        assert answer.status_code == 200, await answer.aread()
                        async for _ in answer.aiter_bytes():
                            pass
                finally:
                    in_flight -= 1

            started = time.perf_counter()
            tasks = []
            for i in range(requests):
                tasks.append(asyncio.create_task(one(2 * 10**6 + i)))
                await asyncio.sleep(arrivals.expovariate(qps))
            await asyncio.gather(*tasks)
            return time.perf_counter() - started, most

    use = GatewayUse(gateway_url, pid)
    seconds, most = asyncio.run(run())
    return {**use.report(requests), "rate_qps": round(requests / seconds, 2), "most_in_flight": most}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--policies", default="kv-load,random")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="rows: short,chat,distinct")
    parser.add_argument("--load-qps", type=float, default=6.0, help="distinct prompts at this rate (0: none)")
    parser.add_argument("--load-requests", type=int, default=240)
    parser.add_argument("--load-output-tokens", type=int, default=64)
    parser.add_argument("--loops", default="asyncio", help="the gateway's event loops: asyncio,uvloop")
    parser.add_argument(
        "--envoy", action=argparse.BooleanOptionalAction, default=True,
        help="Envoy + the picker beside the gateway (make envoy)",
    )  # fmt: skip
    parser.add_argument("--rate-connections", default="16", help="rate rows over these connections (wrk)")
    parser.add_argument("--rate-seconds", type=int, default=15)
    parser.add_argument(
        "--index", choices=("shared", "in-process"), default="shared",
        help="the gateway's and the picker's index: Valkey's, filled by ingest (default), or their own "
        "(--index in-process: each subscribes to the pods, which then bind their event sockets)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "gateway.json")
    args = parser.parse_args(argv)
    report: dict = {"machine": machine(requests=args.requests), "index": args.index, "results": []}
    stack = Stack(bind_events=args.index == "in-process")
    try:
        if args.envoy:  # Envoy's own hop and the ext_proc exchange, before any policy's choice
            pod_address = stack.pod_url.removeprefix("http://")
            floors = {
                mode: EnvoyFloor(stack.env, pod_address, stack.tmp / "floor", mode)
                for mode in ("plain", "fixed")
            }
            try:
                for kind in args.prompts.split(","):
                    result = {"policy": "-", "loop": "-", "prompt": f"{kind}: Envoy floor",
                              **measure_floor(stack.pod_url, kind, args.requests, floors)}  # fmt: skip
                    report["results"].append(result)
                    print(json.dumps(result), flush=True)
            finally:
                for floor in floors.values():
                    floor.stop()
        for loop in args.loops.split(","):
            for policy in args.policies.split(","):
                stack.stop_gateways()
                url = stack.start_gateway(policy, loop, index=args.index)
                pid = stack.gateways[-1].pid
                front = None
                if args.envoy:
                    stack.start_envoy(policy, index=args.index)
                    front = stack.fronts[-1]
                rows = [
                    (kind, functools.partial(measure, url, pid, stack.pod_url, kind, args.requests, front))
                    for kind in args.prompts.split(",")
                ]
                for connections in [int(c) for c in args.rate_connections.split(",") if c] if front else []:
                    for name, target, pids in (
                        ("gateway", url, {"gateway": pid}),
                        ("envoy", front.url, front.pids),
                    ):
                        rate = functools.partial(
                            measure_rate, target, pids, connections=connections, seconds=args.rate_seconds,
                            workdir=stack.tmp,
                        )  # fmt: skip
                        rows.append((f"rate via {name}", rate))
                if args.load_qps > 0:
                    loaded = functools.partial(
                        measure_loaded,
                        url,
                        pid,
                        qps=args.load_qps,
                        requests=args.load_requests,
                        output_tokens=args.load_output_tokens,
                    )
                    rows.append((f"distinct at {args.load_qps:g} QPS", loaded))
                for kind, run in rows:
                    result = {"policy": policy, "loop": loop, "prompt": kind, **run()}
                    report["results"].append(result)
                    print(json.dumps(result), flush=True)
    finally:
        stack.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
