"""Ingest throughput and event-to-visible latency, through real ZeroMQ sockets.

A publisher (this process) streams pre-encoded 16-block BlockStored batches from 64 pods to an
ingest pipeline running in a child process (the same ``IngestPipeline`` that ``manage.py
ingest`` runs), for each backend and worker count:

1. throughput: everything published at once (nothing dropped: unbounded send queue); blocks/s
   from the first batch received to the last block applied;
2. latency: the same stream paced at half the measured throughput; the ingest process records
   for each batch the time from its timestamp (set when published) to applied in the index.

    .venv/bin/python bench/ingest.py [--backends memory,redis] [--workers 1,2,4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from bench.machine import machine  # noqa: E402
from ingest.events import BlockStored, encode_batch, encode_message  # noqa: E402
from scoring.keys import chain_digests, key_of, root_digest  # noqa: E402

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


def ingest_child(url: str, workers: int, conn) -> None:
    """The ingest side: a pipeline bound on a free port; answers the parent's commands."""
    from ingest.pipeline import IngestPipeline
    from scoring.config import ServiceConfig
    from scoring.index import open_index

    index = open_index(url)
    config = ServiceConfig(seed=SEED, default_block_size=BLOCK)
    pipeline = IngestPipeline(
        index=index, config=lambda: config, bind=["tcp://127.0.0.1:*"], workers=workers, queue_size=100_000
    )
    pipeline.start()
    conn.send(pipeline.bound[0])
    stats = pipeline.stats
    while True:
        command, arg = conn.recv()
        if command == "stop":
            pipeline.stop()
            index.close()
            conn.send("stopped")
            return
        if command == "wait_blocks":  # until `arg` blocks stored in all
            deadline = time.monotonic() + 600
            while sum(s.blocks_stored for s in stats.streams()) < arg and time.monotonic() < deadline:
                time.sleep(0.001)
            pipeline.pool.join_idle(60)
            done = time.time()
            streams = stats.streams()
            first = min(s.first_event_at for s in streams if s.pod != "warmup")
            conn.send({"stored": sum(s.blocks_stored for s in streams), "first": first, "done": done})
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


def run_case(url: str, workers: int, args, streams) -> dict:
    parent, child_conn = mp.Pipe()
    child = mp.get_context("spawn").Process(target=ingest_child, args=(url, workers, child_conn))
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
    for frames in messages:
        pub.send_multipart(frames)
    parent.send(("wait_blocks", expected))
    result = parent.recv()
    elapsed = result["done"] - result["first"]
    throughput = result["stored"] / elapsed
    # Phase 2: latency at half that load, the rest of the streams, paced.
    parent.send(("reset_latency", None))
    parent.recv()
    rate_batches = 0.5 * throughput / args.blocks_per_batch
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
    return {
        "workers": workers,
        "blocks": result["stored"],
        "seconds": round(elapsed, 3),
        "blocks_per_s": round(throughput),
        "latency_load_blocks_per_s": round(rate_batches * args.blocks_per_batch),
        "latency_batches": len(latencies),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 2) if latencies else None,
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2) if latencies else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="memory,redis")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--batches-per-pod", type=int, default=400)
    parser.add_argument("--blocks-per-batch", type=int, default=16)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported")
    parser.add_argument("--redis-url", default=None, help="default: start a throwaway Valkey server")
    parser.add_argument("--out", default=str(ROOT / "var" / "bench" / "ingest.json"))
    args = parser.parse_args()

    streams = make_stream(args.pods, args.batches_per_pod, args.blocks_per_batch)
    server = None
    results = {"machine": machine(), "params": vars(args), "cases": []}
    for backend in args.backends.split(","):
        for workers in map(int, args.workers.split(",")):
            runs = []
            for _ in range(args.repeats):
                if backend == "redis":
                    if args.redis_url is None and server is None:
                        from tests.servers import RedisServer

                        server = RedisServer()
                    url = args.redis_url or server.url
                    import redis

                    redis.Redis.from_url(url).flushall()
                else:
                    url = "memory://"
                runs.append(run_case(url, workers, args, streams))
            median = {
                k: statistics.median(r[k] for r in runs)
                if isinstance(runs[0][k], (int, float))
                else runs[0][k]
                for k in runs[0]
            }
            case = {"backend": backend, **median, "runs": runs}
            results["cases"].append(case)
            print(
                f"{backend:7s} workers={workers}  {case['blocks_per_s']:>9,.0f} blocks/s   "
                f"at {case['latency_load_blocks_per_s']:>8,.0f} blocks/s: "
                f"p50 {case['p50_ms']} ms  p99 {case['p99_ms']} ms",
                flush=True,
            )
    if server is not None:
        server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"machine: {results['machine']}\nresults: {out}")


if __name__ == "__main__":
    main()
