"""Ingest throughput, its CPU cost, and event-to-visible latency, through real ZeroMQ sockets.

A publisher (this process) streams pre-encoded 16-block BlockStored batches from 64 pods to an
ingest pipeline running in a child process (the same ``IngestPipeline`` that ``manage.py
ingest`` runs), for each backend, worker count and process count (``--processes``: passed to
``IngestPipeline(processes=N)`` when N > 1):

1. throughput: the first half of every pod's stream, encoded beforehand, published at once
   (nothing dropped: unbounded send queue); blocks/s from the first batch sent to the last block
   applied. Per million blocks, over the same interval: CPU seconds of the ingest process and
   its children (``/proc``), of the publisher, and of the Valkey server(s) (``INFO cpu``), and
   the servers' script time (``INFO commandstats``); bytes of server memory per (block, pod)
   entry (``INFO memory`` ``used_memory``, after less before, over the blocks stored: every
   block has one holder here). For the cluster, the balance of the model's block keys over the
   masters (the largest deviation from their mean, in %).
2. latency: the rest of the stream paced at half the measured throughput (or ``--latency-rate``
   blocks/s, e.g. the 10,000 of issue 27); the ingest process records for each batch the time
   from its timestamp (set when published) to applied in the index (with worker processes, only
   when their stats reach the parent's).

Backends: ``memory``; ``redis``, one Valkey server on ``--base-port`` (or ``--redis-url``), and
``redis-compact``, the same with the index's compact layout (``kvindex/redis.py``);
``cluster``, a 3-master Valkey Cluster on the three ports after it (``bench/cluster.py``), and
``cluster-compact``, the same with the compact layout (``kvindex/cluster.py``).
The ingest pipeline binds ``--base-port + 30``.

    .venv/bin/python bench/ingest.py [--backends memory,redis,cluster] [--workers 1,2,4]
        [--processes 1,2] [--repeats 3] [--base-port 17200] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from bench.cluster import Servers, balance  # noqa: E402
from bench.machine import machine  # noqa: E402
from ingest.events import BlockStored, encode_batch, encode_message  # noqa: E402
from kvindex.keys import chain_digests, key_of, root_digest  # noqa: E402

MODEL = "bench/model"
SEED = "42"
BLOCK = 16


def make_stream(
    pods: int, batches_per_pod: int, blocks_per_batch: int
) -> list[list[tuple[str, BlockStored]]]:
    """Per pod, its events in order: one chain of aligned ``blocks_per_batch``-block events."""
    rng = random.Random(7)
    streams = []
    for p in range(pods):
        tokens = [rng.randrange(151_000) for _ in range(batches_per_pod * blocks_per_batch * BLOCK)]
        keys = [key_of(d) for d in chain_digests(tokens, block_size=BLOCK, parent=root_digest(SEED))]
        events = []
        for b in range(batches_per_pod):
            lo = b * blocks_per_batch
            event = BlockStored(
                block_hashes=tuple(keys[lo : lo + blocks_per_batch]),
                parent_block_hash=keys[lo - 1] if lo else None,
                token_ids=tuple(tokens[lo * BLOCK : (lo + blocks_per_batch) * BLOCK]),
                block_size=BLOCK,
                lora_id=None,
                tier="gpu",
                lora_name=None,
                extra_keys=None,
                group_idx=None,
            )
            events.append((f"pod-{p:03d}", event))
        streams.append(events)
    return streams


def frames_for(pod: str, seq: int, event: BlockStored) -> list[bytes]:
    return encode_message(pod, MODEL, seq, encode_batch([event], ts=time.time()))


def ingest_child(url: str, workers: int, processes: int, port: int, conn) -> None:
    """The ingest side: a pipeline bound on ``port``; answers the parent's commands."""
    from ingest.pipeline import IngestPipeline
    from kvindex import open_index
    from registry.config import ServiceConfig

    index = open_index(url)
    config = ServiceConfig(seed=SEED, default_block_size=BLOCK)
    several = {"processes": processes, "index_factory": functools.partial(open_index, url)}
    pipeline = IngestPipeline(
        index=index,
        config=lambda: config,
        bind=[f"tcp://127.0.0.1:{port}"],
        workers=workers,
        queue_size=100_000,
        **(several if processes > 1 else {}),
    )
    pipeline.start()
    conn.send(pipeline.bound[0])
    stats = pipeline.stats

    def stored() -> int:
        """Blocks stored: the stats, or (worker processes report theirs a little later) the
        index's count, whichever is higher."""
        counted = sum(s.blocks_stored for s in stats.streams())
        if processes > 1 and url != "memory://":
            counted = max(counted, sum(sum(p.blocks_by_tier.values()) for p in index.pod_blocks(model=MODEL)))
        return counted

    while True:
        command, arg = conn.recv()
        if command == "stop":
            pipeline.stop()
            index.close()
            conn.send("stopped")
            return
        if command == "wait_blocks":  # until `arg` blocks stored in all
            deadline = time.monotonic() + 120
            pause = 0.002 if processes == 1 else 0.05
            while (n := stored()) < arg and time.monotonic() < deadline:
                time.sleep(pause)
            done = time.time()
            pipeline.pool.join_idle(60)  # and, from worker processes, their stats reported
            conn.send({"stored": n, "done": done})
        elif command == "reset_latency":
            stats.recent_visible_latencies.clear()
            conn.send("ok")
        elif command == "latency":
            conn.send(list(stats.recent_visible_latencies))
        elif command == "batches":
            conn.send(sum(s.batches for s in stats.streams()))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of process ``pid``, and of it with its live descendants
    (``/proc``)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [child for child, parent in parents.items() if parent == p and child not in tree]
    return ticks.get(pid, 0) / _TICKS, sum(ticks.get(p, 0) for p in tree) / _TICKS


def run_case(url: str, workers: int, processes: int, args, streams, servers: Servers | None) -> dict:
    parent, child_conn = mp.Pipe()
    child = mp.get_context("spawn").Process(
        target=ingest_child, args=(url, workers, processes, args.base_port + 30, child_conn)
    )
    child.start()
    endpoint = parent.recv()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop in the benchmark: we measure the consumer
    pub.connect(endpoint)
    warm = BlockStored((), None, (), BLOCK, None, "gpu", None, None, None)
    seq = 0
    while True:  # ZeroMQ's slow joiner: until the subscription is through
        pub.send_multipart(frames_for("warmup", seq, warm))
        seq += 1
        time.sleep(0.01)
        parent.send(("batches", None))
        if parent.recv() > 0:
            break
    half = args.batches_per_pod // 2
    seqs = {}
    # Phase 1: throughput, the first half of every pod's stream at once.
    messages = []
    for stream in streams:
        for b, (pod, event) in enumerate(stream[:half]):
            messages.append(frames_for(pod, b, event))
            seqs[pod] = b
    expected = len(messages) * args.blocks_per_batch
    time.sleep(0.5)  # the warm-up applied and the child idle before the counters are read
    if servers:
        servers.reset_stats()
    before = servers.snapshot() if servers else None
    main_cpu, ingest_cpu = tree_cpu_seconds(child.pid)
    publisher_cpu = time.process_time()
    first = time.time()
    for frames in messages:
        pub.send_multipart(frames)
    parent.send(("wait_blocks", expected))
    result = parent.recv()
    publisher_cpu = time.process_time() - publisher_cpu
    main_after, ingest_after = tree_cpu_seconds(child.pid)
    after = servers.snapshot() if servers else None
    elapsed = result["done"] - first
    throughput = result["stored"] / elapsed
    stored = result["stored"]
    per_million = 1e6 / stored
    costs = {
        "ingest_cpu_s_per_M": round((ingest_after - ingest_cpu) * per_million, 2),
        "ingest_main_cpu_s_per_M": round((main_after - main_cpu) * per_million, 2),
        "publisher_cpu_s_per_M": round(publisher_cpu * per_million, 2),
        "wire_bytes_per_block": round(sum(len(f) for frames in messages for f in frames) / expected, 1),
    }
    if servers:
        costs |= {
            "valkey_cpu_s_per_M": round((after["cpu"] - before["cpu"]) * per_million, 2),
            "valkey_script_s_per_M": round((after["usec"] - before["usec"]) / 1e6 * per_million, 2),
            "valkey_bytes_in_per_block": round((after["in"] - before["in"]) / stored, 1),
            "valkey_bytes_out_per_block": round((after["out"] - before["out"]) / stored, 1),
            "bytes_per_entry": round((after["memory"] - before["memory"]) / stored, 1),
        }
    # Phase 2: latency at half that load (or --latency-rate), the rest of the streams, paced.
    parent.send(("reset_latency", None))
    parent.recv()
    rate_batches = (args.latency_rate or 0.5 * throughput) / args.blocks_per_batch
    rest = [(pod, b, event) for stream in streams for b, (pod, event) in enumerate(stream) if b >= half]
    rest.sort(key=lambda item: item[1])  # round-robin over pods, in each pod's order
    budget = min(len(rest), int(rate_batches * args.latency_seconds))
    start = time.perf_counter()
    for i, (pod, b, event) in enumerate(rest[:budget]):
        due = start + i / rate_batches
        while (now := time.perf_counter()) < due:
            time.sleep(min(0.0005, due - now))
        pub.send_multipart(frames_for(pod, b, event))
    parent.send(("wait_blocks", expected + budget * args.blocks_per_batch))
    parent.recv()
    parent.send(("latency", None))
    latencies = parent.recv()
    parent.send(("stop", None))
    parent.recv()
    child.join(30)
    pub.close(0)
    ctx.term()
    if servers and servers.kind == "cluster":
        counts = servers.key_counts(b"kv.3*:bench%2Fmodel:b:{*")
        costs |= {"block_keys_per_master": counts, "balance_pct": round(balance(counts), 1)}
    return {
        "workers": workers,
        "processes": processes,
        "blocks": result["stored"],
        "seconds": round(elapsed, 3),
        "blocks_per_s": round(throughput),
        **costs,
        "latency_load_blocks_per_s": round(rate_batches * args.blocks_per_batch),
        "latency_batches": len(latencies),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 2) if latencies else None,
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2) if latencies else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="memory,redis,cluster")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--processes", default="1", help="ingest worker processes, e.g. 1,2")
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--batches-per-pod", type=int, default=400)
    parser.add_argument("--blocks-per-batch", type=int, default=16)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument(
        "--latency-rate",
        type=float,
        default=None,
        help="blocks/s of the latency phase (default: half the measured throughput); the streams "
        "must be long enough: --batches-per-pod >= 2 x rate x seconds / pods / blocks per batch",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported")
    parser.add_argument("--redis-url", default=None, help="default: start a throwaway Valkey server")
    parser.add_argument("--base-port", type=int, default=17200, help="servers and ingest on ports from it")
    parser.add_argument("--out", default=str(ROOT / "var" / "bench" / "ingest.json"))
    args = parser.parse_args()

    from ingest.pipeline import IngestPipeline

    has_processes = "processes" in inspect.signature(IngestPipeline).parameters
    streams = make_stream(args.pods, args.batches_per_pod, args.blocks_per_batch)
    started: dict[str, Servers] = {}
    results = {"machine": machine(), "params": vars(args), "cases": []}
    cases = []
    for backend in args.backends.split(","):
        for processes in map(int, args.processes.split(",")):
            if processes > 1 and (backend == "memory" or not has_processes):
                why = "an in-memory index" if has_processes else "IngestPipeline has no `processes`"
                print(f"{backend:7s} processes={processes}: skipped ({why})")
                continue
            cases += [(backend, processes, workers) for workers in map(int, args.workers.split(","))]
    runs: dict[tuple[str, int, int], list[dict]] = {case: [] for case in cases}
    try:
        for _ in range(args.repeats):  # the cases interleaved, so that the host's noise hits them alike
            for backend, processes, workers in cases:
                servers = None
                if backend == "memory":
                    url = "memory://"
                elif backend in ("redis", "redis-compact") and args.redis_url:
                    servers = Servers.external(args.redis_url)
                    url = args.redis_url + ("?layout=compact" if backend == "redis-compact" else "")
                else:
                    kind = backend.removesuffix("-compact")
                    if kind not in started:
                        started[kind] = Servers(kind, args.base_port)
                    servers = started[kind]
                    url = servers.url + ("?layout=compact" if backend.endswith("-compact") else "")
                if servers:
                    servers.flush()
                run = run_case(url, workers, processes, args, streams, servers)
                runs[backend, processes, workers].append(run)
                print(
                    f"  {backend} processes={processes} workers={workers}: {run['blocks_per_s']:,} blocks/s"
                )
    finally:
        for servers in started.values():
            servers.stop()
    for (backend, _, _), case_runs in runs.items():
        case = {"backend": backend, **median_of(case_runs), "runs": case_runs}
        results["cases"].append(case)
        print_case(case)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"machine: {results['machine']}\nresults: {out}")


def median_of(runs: list[dict]) -> dict:
    """Per field, the runs' median (numbers) or the first run's value."""
    return {
        k: statistics.median(r[k] for r in runs)
        if isinstance(runs[0][k], (int, float)) and all(r[k] is not None for r in runs)
        else runs[0][k]
        for k in runs[0]
    }


def print_case(case: dict) -> None:
    costs = f"ingest {case['ingest_cpu_s_per_M']} CPU s/M blocks (main {case['ingest_main_cpu_s_per_M']})"
    if "valkey_cpu_s_per_M" in case:
        costs += (
            f", valkey {case['valkey_cpu_s_per_M']} CPU s/M ({case['valkey_script_s_per_M']} in scripts), "
            f"{case['bytes_per_entry']} B/entry"
        )
    if "balance_pct" in case:
        costs += f", keys per master +-{case['balance_pct']}%"
    print(
        f"{case['backend']:7s} processes={case['processes']} workers={case['workers']}  "
        f"{case['blocks_per_s']:>9,.0f} blocks/s  ({costs})   "
        f"at {case['latency_load_blocks_per_s']:>8,.0f} blocks/s: "
        f"p50 {case['p50_ms']} ms  p99 {case['p99_ms']} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
