"""A real write path for tests: ZMQ PUB sockets -> ``IngestPipeline`` -> a real index."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import zmq

from ingest.events import DEFAULT_LIMITS, DecodeLimits, encode_batch, encode_message
from ingest.pipeline import IngestPipeline
from ingest.service import Housekeeping
from kvindex import KVIndex, open_index
from registry.config import ServiceConfig
from registry.runtime import set_index
from tests.servers import wait_until

MODEL = "Qwen/Qwen3-0.6B"


class Publisher:
    """One engine's PUB socket, connected to the pipeline's bound SUB, with its own seq."""

    def __init__(self, context: zmq.Context, endpoint: str, *, pod: str, model: str = MODEL) -> None:
        self.pod = pod
        self.model = model
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(endpoint)
        self.next_seq = 0

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def send_frames(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def send(
        self, events: list, *, layout: str = "array", hash_bytes: bool = False, rank: int | None = None
    ) -> int:
        """Publish one batch; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(
            events, ts=time.time(), data_parallel_rank=rank, layout=layout, hash_bytes=hash_bytes
        )
        self.socket.send_multipart(encode_message(self.pod, self.model, seq, payload))
        return seq

    def close(self) -> None:
        self.socket.close()


class Harness:
    """The pipeline under test plus helpers to publish into it and wait for the result."""

    def __init__(
        self,
        index: KVIndex,
        config: ServiceConfig,
        *,
        workers: int = 2,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        self.index = index
        self.config = config
        self.context = zmq.Context()
        self.pipeline = IngestPipeline(
            index=index,
            config=lambda: self.config,
            bind=["tcp://127.0.0.1:*"],
            workers=workers,
            context=self.context,
            limits=limits,
        )
        self.pipeline.start()
        self.endpoint = self.pipeline.bound[0]
        self.publishers: list[Publisher] = []

    @property
    def stats(self):
        return self.pipeline.stats

    def publisher(self, pod: str, model: str = MODEL) -> Publisher:
        """A connected publisher whose messages are known to reach the pipeline (ZeroMQ drops
        what a PUB sends before the subscription arrives, so warm up with empty batches)."""
        pub = Publisher(self.context, self.endpoint, pod=pod, model=model)
        self.publishers.append(pub)

        def arrived() -> bool:
            pub.send([])
            time.sleep(0.005)
            return any(s.pod == pod and s.batches for s in self.stats.streams())

        wait_until(arrived, what=f"{pod}'s subscription")
        self.sync(pod)
        return pub

    def sync(self, pod: str, *, timeout: float = 5.0) -> None:
        """Wait until every batch published so far by ``pod`` has been applied."""
        last_sent = next(p for p in self.publishers if p.pod == pod).last_seq

        def received() -> bool:
            return any(s.pod == pod and s.last_seq == last_sent for s in self.stats.streams())

        wait_until(received, timeout=timeout, what=f"{pod}'s batches up to seq {last_sent}")
        self.pipeline.pool.join_idle(timeout)

    def stream_of(self, pod: str, rank: int = 0):
        """The pod's stream stats, None before its first batch."""
        return next((s for s in self.stats.streams() if s.pod == pod and s.rank == rank), None)

    def stream(self, pod: str, rank: int = 0):
        return next(s for s in self.stats.streams() if s.pod == pod and s.rank == rank)

    def close(self) -> None:
        for pub in self.publishers:
            pub.close()
        self.pipeline.stop(drain_timeout=5)
        self.context.destroy(linger=0)  # a failed test must not leave term() waiting


@pytest.fixture(params=["memory", "memory-python", "redis", "redis-cluster", "redis-cluster-compact"])
def index(request) -> Iterator[KVIndex]:
    """Each backend in turn: the write path must behave the same on all of them (the cluster in
    both layouts: its holder scripts differ; the in-memory one compiled and in pure Python)."""
    if request.param == "memory":
        url = "memory://"
    elif request.param == "memory-python":
        request.getfixturevalue("python_fallback")
        url = "memory://"
    elif request.param.startswith("redis-cluster"):
        url = request.getfixturevalue("redis_cluster_url")
        url += "?layout=compact" if request.param.endswith("-compact") else ""
    else:
        url = request.getfixturevalue("redis_url")
    idx = open_index(url)
    yield idx
    idx.close()


@pytest.fixture
def harness(index: KVIndex) -> Iterator[Harness]:
    h = Harness(index, ServiceConfig(seed="42", default_block_size=16))
    yield h
    h.close()


@contextlib.contextmanager
def ingest_housekeeping(redis_url: str) -> Iterator[tuple[Harness, Housekeeping]]:
    """A real ingest pipeline writing to the Redis index at ``redis_url`` (the process's index
    while it runs), with the ``ingest`` command's housekeeping for it."""
    index = open_index(redis_url)
    set_index(index)
    harness = Harness(index, ServiceConfig(seed="42", default_block_size=16))
    housekeeping = Housekeeping(harness.stats)
    try:
        yield harness, housekeeping
    finally:
        housekeeping.close()
        harness.close()
        set_index(None)
        index.close()
