"""``ingest --processes N``: the shard workers as worker processes, on real ZeroMQ sockets and a
real Valkey. Pods spread over the processes, each pod's batches stay in order, the counters of
every process add up in the main one, a killed process is replaced, an in-memory index is
refused, and the command drains and exits 0."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import zmq

from ingest.events import BlockRemoved, encode_batch, encode_message
from ingest.pipeline import IngestPipeline
from ingest.processes import CONFIG_PUSH_SECONDS, STATS_SECONDS, ProcessShardPool
from kvindex import open_index
from kvindex.epochs import READY, parse_marker
from kvindex.keys import block_keys
from kvindex.shared_stats import STATS_KEY
from registry.config import ServiceConfig
from tests.events import stored_event as stored
from tests.ingest.conftest import MODEL, Publisher
from tests.ingest.test_replay import Fixture
from tests.servers import free_port, service_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
SEED = "42"


class ProcessHarness:
    """A pipeline of two worker processes writing to the Valkey at ``redis_url``."""

    def __init__(self, redis_url: str) -> None:
        self.index = open_index(redis_url)
        self.context = zmq.Context()
        self.pipeline = IngestPipeline(
            index=self.index,
            config=lambda: ServiceConfig(seed=SEED, default_block_size=16),
            bind=["tcp://127.0.0.1:*"],
            workers=2,
            context=self.context,
            processes=2,
            index_factory=functools.partial(open_index, redis_url),
        )
        self.pipeline.start()
        self.publishers: dict[str, Publisher] = {}

    @property
    def pool(self) -> ProcessShardPool:
        assert isinstance(self.pipeline.pool, ProcessShardPool)
        return self.pipeline.pool

    def stream(self, pod: str):
        return next((s for s in self.pipeline.stats.streams() if s.pod == pod), None)

    def publisher(self, pod: str) -> Publisher:
        """A publisher whose messages are known to arrive (warmed up with empty batches)."""
        pub = self.publishers[pod] = Publisher(self.context, self.pipeline.bound[0], pod=pod)

        def arrived() -> bool:
            pub.send([])
            time.sleep(0.01)
            return self.stream(pod) is not None

        wait_until(arrived, what=f"{pod}'s subscription")
        return pub

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until every batch published so far is applied and its counts merged here."""
        last = {pod: pub.last_seq for pod, pub in self.publishers.items()}

        def received() -> bool:
            return all((s := self.stream(pod)) is not None and s.last_seq == seq for pod, seq in last.items())

        wait_until(received, timeout=timeout, what="every pod's last batch")
        self.pool.join_idle(timeout)

    def held(self, pod: str, keys: list[int]) -> int:
        return len(self.index.lookup(model=MODEL, keys=keys, pods=[pod]))

    def close(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        self.pipeline.stop(drain_timeout=10)
        self.context.destroy(linger=0)
        self.index.close()


@pytest.fixture
def harness(redis_url) -> Iterator[ProcessHarness]:
    h = ProcessHarness(redis_url)
    yield h
    h.close()


def test_pods_spread_over_the_processes_keep_their_order_and_count_in_the_main_process(harness, base_capture):
    pods = [f"pod-{i}" for i in range(12)]
    assert {harness.pool.shard(pod) for pod in pods} == {0, 1}
    keys = block_keys(base_capture["token_ids"], seed=SEED)
    hashes = tuple(base_capture["block_hashes"])
    pubs = [harness.publisher(pod) for pod in pods]
    for pub in pubs:
        pub.send([stored(base_capture)])
        pub.send([BlockRemoved(block_hashes=(hashes[10],), tier="gpu", group_idx=None)])
    harness.sync()

    for pod in pods:
        assert harness.held(pod, keys) == 10
        stream = harness.stream(pod)
        assert (stream.blocks_stored, stream.blocks_removed, stream.aligned_blocks) == (25, 1, 25)
    assert sum(harness.pipeline.stats.visible_buckets) >= 2 * len(pods)  # latencies merged too

    # Stores and removes of the same blocks, interleaved over pods: applied out of order, some
    # pod would end up holding all of them, or none.
    for _ in range(5):
        for pub in pubs:
            pub.send([stored(base_capture)])
        for pub in pubs:
            pub.send([BlockRemoved(block_hashes=hashes, tier="gpu", group_idx=None)])
    for pub in pubs:
        pub.send([stored(base_capture, last=13)])
    harness.sync()
    assert [harness.held(pod, keys) for pod in pods] == [13] * len(pods)


def test_a_killed_worker_process_is_replaced_and_its_pods_go_on(harness, base_capture):
    pub = harness.publisher("pod-a")
    process = harness.pool.shard("pod-a")
    keys = block_keys(base_capture["token_ids"], seed=SEED)
    pub.send([stored(base_capture, last=13)])
    harness.sync()
    assert harness.stream("pod-a").blocks_stored == 13

    os.kill(harness.pool.pid(process), signal.SIGKILL)
    wait_until(lambda: harness.pool.restarts[process] == 1, what="the death noticed")
    wait_until(lambda: harness.pool._up[process], timeout=30, what="a new worker process")

    # The engine goes on where it was (its seq follows the one the index recorded); the new
    # process had to catch the pod up first, with no replay endpoint to ask.
    pub.send([stored(base_capture, first=13, parent=base_capture["block_hashes"][12])])
    harness.sync()
    assert harness.held("pod-a", keys) == 25
    stream = harness.stream("pod-a")
    assert stream.blocks_stored == 25  # counted on from the dead process's figures
    assert stream.replay_failures["no_endpoint"] >= 1  # the catch-up after the restart


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_forgotten_pod_is_forgotten_by_its_process_too(harness, base_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture, last=13)])
    harness.sync()
    harness.pipeline.forget_pod("pod-a")
    time.sleep(3 * STATS_SECONDS)  # reports taken before the forget must not bring it back
    assert harness.stream("pod-a") is None

    pub.send([stored(base_capture)])  # back: counted afresh, in the main process as in its own
    harness.sync()
    assert harness.stream("pod-a").blocks_stored == 25


class ProcessFixture(Fixture):
    """``tests.ingest.test_replay``'s engines with replay endpoints, feeding two processes."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(open_index(redis_url))
        self.pipeline_options = {"processes": 2, "index_factory": functools.partial(open_index, redis_url)}


def test_missed_batches_and_catch_ups_are_replayed_by_the_pods_own_process(redis_url):
    fx = ProcessFixture(redis_url)
    try:
        fx.start_ingest()
        engines = [fx.engine(f"pod-{i}") for i in range(4)]
        assert {fx.pipeline.pool.shard(e.pod) for e in engines} == {0, 1}
        time.sleep(2 * CONFIG_PUSH_SECONDS)  # the processes have the replay endpoints
        for engine in engines:  # a gap: the live batch waits for the replayed ones
            for _ in range(3):
                engine.store(lost=True)
            engine.store()
        for engine in engines:
            fx.sync(engine)
            assert fx.held(engine) == 5
            assert fx.recoveries(engine.pod)[2] == 3

        fx.stop_ingest()  # the engines go on while ingest is down: caught up on start
        for engine in engines:
            engine.store()
            engine.evict_last()
            engine.store()
        fx.start_ingest()
        for engine in engines:
            fx.sync(engine)
            assert fx.held(engine) == 6

        # The index loses its data: every engine is replayed from 0 in its own process, and the
        # catch-ups' completions (run in the main process) mark the model ready again.
        token = wait_until(lambda: parse_marker(fx.index.epochs([MODEL])[0]), what="a marker")[0]
        redis.Redis.from_url(redis_url).flushall()
        for engine in engines:
            wait_until(lambda e=engine: fx.held(e) == 6, timeout=10, what=f"{engine.pod} rebuilt")
        wait_until(lambda: parse_marker(fx.index.epochs([MODEL])[0])[1] == READY, what="ready")
        assert parse_marker(fx.index.epochs([MODEL])[0])[0] != token
        assert fx.pipeline.stats.index_losses == 1
    finally:
        fx.close()
        fx.index.close()


def test_the_in_memory_index_is_refused(tmp_path, redis_url):
    with pytest.raises(ValueError, match="in-memory index lives in one process"):
        IngestPipeline(
            index=open_index("memory://"),
            config=ServiceConfig,
            bind=["tcp://127.0.0.1:*"],
            processes=2,
            index_factory=functools.partial(open_index, "memory://"),
        )
    env = service_env(tmp_path, redis_url, KVCACHE_INDEX_BACKEND="memory")
    done = subprocess.run(
        [sys.executable, "manage.py", "ingest", "--bind", "tcp://127.0.0.1:0", "--processes", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("CommandError: --processes > 1 needs a Redis index"), done.stderr


@pytest.mark.parametrize("layout", ["fast", "compact"])
def test_the_command_runs_two_processes_and_exits_0_on_sigterm_to_its_group(
    tmp_path, redis_url, base_capture, layout
):
    env = service_env(tmp_path, redis_url, KVCACHE_INDEX_LAYOUT=layout)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "manage.py", "ingest",
            "--bind", f"tcp://127.0.0.1:{port}",
            "--processes", "2",
            "--housekeeping-interval", "0.2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    index = open_index(redis_url, layout=layout)  # the workers write in it
    client = redis.Redis.from_url(redis_url)
    payload = encode_batch([stored(base_capture)], ts=time.time())
    seqs = {"pod-a": 0, "pod-b": 0, "pod-c": 0}

    def landed() -> bool:
        for pod in seqs:  # re-sending is harmless, and beats ZeroMQ's slow joiner
            pub.send_multipart(encode_message(pod, MODEL, seqs[pod], payload))
            seqs[pod] += 1
        time.sleep(0.05)
        held = [len(index.lookup(model=MODEL, keys=base_capture["block_hashes"], pods=[p])) for p in seqs]
        return held == [25] * len(seqs)

    try:
        wait_until(landed, timeout=30, what="the capture in the index, from every pod")

        def shared() -> dict:
            snaps = [json.loads(v) for v in client.hgetall(STATS_KEY).values()]
            return {s["pod"]: s for snap in snaps for s in snap["streams"] if s["blocks_stored"]}

        wait_until(lambda: set(shared()) == set(seqs), timeout=10, what="every pod's stats shared")
        os.killpg(proc.pid, signal.SIGTERM)  # as ``python -m stack`` stops it: the workers get it too
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, output
        assert "in each of 2 processes" in output and "ingest: stopped" in output
        assert "Traceback" not in output
        wait_until(lambda: not group_alive(proc.pid), what="the worker processes gone too")
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pub.close(0)
        context.term()
        index.close()
