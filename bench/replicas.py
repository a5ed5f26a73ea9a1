"""Ingest replicas: how long a crashed replica's pods go unindexed, with the default timings.

Pods are the simulator's publishers with a bound PUB (each registered with its event endpoint)
and a replay ROUTER, storing a block every ``--interval`` seconds each. Two replicas, each an
``IngestPipeline`` in replica mode with its membership in a throwaway Valkey (as ``ingest
--replica`` runs them, heartbeat ``HEARTBEAT_SECONDS``, TTL ``TTL_SECONDS``), share them out.
Then one of them is killed: it stops heartbeating and receiving without leaving, what a crash
looks like to the other. Per run:

* taken: from the kill until the survivor holds every pod (issue 10's target: within 10 s);
* indexed: from the kill until the index has applied, for every pod of the killed replica,
  every batch it published before the survivor took it (caught up through the replay);
* leave: from a graceful stop (``replica.stop(leave=True)``, what SIGTERM does) until the
  survivor holds every pod.

    .venv/bin/python bench/replicas.py [--runs 5] [--pods 16] [--interval 0.05] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import zmq  # noqa: E402

from bench.machine import machine  # noqa: E402
from ingest.events import BlockStored  # noqa: E402
from ingest.membership import HEARTBEAT_SECONDS, TTL_SECONDS, RedisMembership, Replica  # noqa: E402
from ingest.pipeline import IngestPipeline  # noqa: E402
from ingest.replay import ReplayClient  # noqa: E402
from kvindex import open_index  # noqa: E402
from registry.config import ServiceConfig  # noqa: E402
from simulator.publisher import EventPublisher  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

MODEL = "bench/replicas"
SEED = "42"
BLOCK = 16


class Pod:
    """A publishing engine: a block stored every ``interval`` seconds, in one chain."""

    def __init__(self, context: zmq.Context, pod: str) -> None:
        self.publisher = EventPublisher(
            context,
            endpoint="tcp://127.0.0.1:*",
            pod_id=pod,
            model=MODEL,
            replay_endpoint="tcp://127.0.0.1:*",
            buffer_steps=10_000,
        )
        self.pod = pod
        self.blocks = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        task = self._loop.create_task(self.publisher.serve_replay())
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(task)

    def store(self) -> int:
        """Publish the next block; returns its batch's seq."""
        i = self.blocks
        self.blocks += 1
        event = BlockStored(
            block_hashes=(10**9 + i,),
            parent_block_hash=10**9 + i - 1 if i else None,
            token_ids=tuple(range(i * BLOCK, (i + 1) * BLOCK)),
            block_size=BLOCK,
        )
        return self.publisher.publish([event])

    def close(self) -> None:
        self._loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(self._loop)])
        self._thread.join(5)
        self.publisher.close()


class ReplicaNode:
    """One ``ingest --replica``: its pipeline (connecting to the pods it holds) and membership."""

    def __init__(self, url: str, name: str, config, context: zmq.Context) -> None:
        self.index = open_index(url)
        self.pipeline = IngestPipeline(
            index=self.index,
            config=config,
            workers=2,
            context=context,
            replay=ReplayClient(config=config, context=context, timeout=1.0),
            epoch_check_seconds=None,
            replica=True,
        )
        self.store = RedisMembership(redis.Redis.from_url(url))
        self.replica = Replica(
            name=name,
            store=self.store,
            config=config,
            on_change=lambda h: self.pipeline.hold(h.held, foreign=h.foreign),
        )
        self.replica.join()
        self.pipeline.start()
        self.replica.start()

    @property
    def held(self) -> set[str]:
        return set(self.replica.holding.held)

    def stop(self, *, leave: bool) -> None:
        if leave:
            self.pipeline.stop(drain_timeout=5)
            self.replica.stop(leave=True)
        else:
            self.replica.stop(leave=False)
            self.pipeline.stop(drain_timeout=5)

    def close(self) -> None:
        self.store.close()
        self.index.close()


def wait_for(condition, *, timeout: float, step: float = 0.02) -> float:
    """Seconds until ``condition()`` held (``inf`` after ``timeout``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            return float("inf")
        time.sleep(step)
    return time.monotonic() - started


def one_run(url: str, pods: dict[str, Pod], config, context: zmq.Context, interval: float) -> dict:
    index = open_index(url)
    stop = threading.Event()
    sent: dict[str, int] = {}

    def publish() -> None:
        while not stop.is_set():
            for name, pod in pods.items():
                sent[name] = pod.store()
            stop.wait(interval)

    a = ReplicaNode(url, "r1", config, context)
    b = ReplicaNode(url, "r2", config, context)
    publisher = threading.Thread(target=publish, daemon=True)
    try:
        shared = wait_for(lambda: len(a.held) + len(b.held) == len(pods) and a.held and b.held, timeout=20)
        assert shared < float("inf"), "the pods were never shared out"
        publisher.start()
        time.sleep(2.0)  # both replicas indexing live
        orphans = sorted(b.held)
        killed = time.monotonic()
        b.stop(leave=False)
        taken = wait_for(lambda: a.held == set(pods), timeout=30)
        # What the orphans published up to the moment they were taken: all of it in the index.
        due = {pod: sent[pod] for pod in orphans}

        def indexed() -> bool:
            progress = index.progress(model=MODEL)
            return all(progress.get((MODEL, pod), -1) >= seq for pod, seq in due.items())

        wait_for(indexed, timeout=30)
        caught_up = time.monotonic() - killed
        # A graceful leave: r2 again, then it stops as SIGTERM stops it.
        b.close()
        b = ReplicaNode(url, "r2", config, context)
        wait_for(lambda: b.held, timeout=20)
        left = time.monotonic()
        b.stop(leave=True)
        leave = wait_for(lambda: a.held == set(pods), timeout=30)
        return {
            "orphans": len(orphans),
            "taken_s": round(taken, 2),
            "indexed_s": round(caught_up, 2),
            "leave_s": round(leave, 2),
            "_left_at": left,
        }
    finally:
        stop.set()
        if publisher.is_alive():
            publisher.join(5)
        for node in (a, b):
            with contextlib.suppress(Exception):
                node.stop(leave=True)
            node.close()
        index.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between a pod's blocks")
    parser.add_argument("--out", default=str(ROOT / "var" / "bench" / "replicas.json"))
    args = parser.parse_args()

    server = RedisServer()
    context = zmq.Context()
    pods = {f"pod-{i:02d}": Pod(context, f"pod-{i:02d}") for i in range(args.pods)}
    config_value = ServiceConfig(
        seed=SEED,
        default_block_size=BLOCK,
        pods=dict.fromkeys(pods, MODEL),
        replay_endpoints={name: p.publisher.replay_bound_endpoint for name, p in pods.items()},
        event_endpoints={name: p.publisher.bound_endpoint for name, p in pods.items()},
    )
    runs = []
    try:
        for n in range(args.runs):
            run = one_run(server.url, pods, lambda: config_value, context, args.interval)
            run.pop("_left_at")
            runs.append(run)
            print(f"run {n + 1}: {run}", flush=True)
            redis.Redis.from_url(server.url).flushall()
    finally:
        for pod in pods.values():
            pod.close()
        context.destroy(linger=0)
        server.stop()
    summary = {
        key: {"median": statistics.median(r[key] for r in runs), "max": max(r[key] for r in runs)}
        for key in ("taken_s", "indexed_s", "leave_s")
    }
    print(
        f"heartbeat {HEARTBEAT_SECONDS} s, TTL {TTL_SECONDS} s, {args.pods} pods: "
        + ", ".join(f"{k} median {v['median']} s (max {v['max']})" for k, v in summary.items())
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"machine": machine(), "args": vars(args), "runs": runs, "summary": summary}, indent=2)
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
