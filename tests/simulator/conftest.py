"""Fixtures for the simulator: the real Qwen3 tokenizer, zero-latency pods, a ZeroMQ collector."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ingest.events import Message, decode_message
from simulator.config import EngineConfig, LatencyConfig, PodConfig
from simulator.pod import PodTokenizer
from tests.servers import wait_until
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
ZERO_LATENCY = LatencyConfig(prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=0)


@pytest.fixture(scope="session")
def qwen() -> PodTokenizer:
    """Qwen/Qwen3-0.6B's tokenizer through the manager's registry (offline, from the package)."""
    return PodTokenizer(TokenizerRegistry(), MODEL)


def pod_config(**engine: object) -> PodConfig:
    """A zero-latency pod config; ``engine`` overrides ``EngineConfig`` fields."""
    return PodConfig(
        pod_id="sim-0",
        model=MODEL,
        engine=EngineConfig(**{"hash_seed": "42", **engine}),
        latency=ZERO_LATENCY,
    )


class Collector:
    """A SUB socket bound on a free loopback port, drained by a thread (a SUB must keep polling for
    the connecting PUBs' pipes to get its subscription). ``messages`` are decoded in arrival order."""

    def __init__(self, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.subscribe(b"kv@")
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.peers = 0
        self.messages: list[Message] = []
        self.topics: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(10):
                if sock is self._monitor:
                    recv_monitor_message(self._monitor)
                    self.peers += 1
                else:
                    frames = self.socket.recv_multipart()
                    self.topics.append(frames[0])
                    self.messages.append(decode_message(frames))

    def wait_peers(self, n: int) -> None:
        """Until ``n`` publishers have connected, and their subscription had time to reach them."""
        wait_until(lambda: self.peers >= n, what=f"{n} publishers")
        time.sleep(0.05)

    def events(self) -> list:
        return [event for message in self.messages for event in message.batch.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.disable_monitor()
        self._monitor.close()
        self.socket.close()


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def collector(zmq_context: zmq.Context) -> Iterator[Collector]:
    c = Collector(zmq_context)
    yield c
    c.close()
