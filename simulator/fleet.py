"""N simulated pods in one process and one asyncio loop: a uvicorn server per pod, a ZeroMQ
publisher per pod and data-parallel rank.

Addresses, for pod ``i`` (0-based) and rank ``r`` of ``dp`` ranks:

* HTTP on ``base_port + i`` (``base_port`` 0: a free port per pod); pod id ``sim-<i>`` or, with
  ``pod_id_style="hostport"``, ``<host>:<port>``;
* events: an endpoint the PUB *connects* to (the manager's bound SUB, llm-d style) is shared by
  every pod, rank ``r`` using port + r as in vLLM; an endpoint the PUB *binds* cannot be shared, so
  pod ``i`` rank ``r`` binds port + i * dp + r;
* replay (optional, always bound): port + i * dp + r.

The listening sockets are bound before the pods are built, so a ``hostport`` pod id names the port
really used and a port conflict fails the start instead of a pod later.

Every pod has the template's ``role``, except in a P/D fleet (``prefill_pods`` N > 0): pods 0 to
N - 1 are ``prefill`` pods, the others ``decode`` pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Literal

import uvicorn
import zmq

from ingest.curve import EventCurve
from ingest.events import Layout
from simulator.config import PodConfig
from simulator.pod import Pod, PodTokenizer
from simulator.publisher import (
    DEFAULT_BUFFER_STEPS,
    DEFAULT_HWM,
    EventPublisher,
    ReplayLayout,
    offset_endpoint,
    should_bind,
)
from simulator.server import create_app

__all__ = ["Fleet", "FleetConfig", "PublishConfig", "RunningPod", "pod_id_for"]

log = logging.getLogger("simulator")

PodIdStyle = Literal["sim", "hostport"]


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """Where and how the pods publish KV events (``endpoint`` ``None``: they do not).
    ``curve``: every pod publishes and replays over CURVE with this key pair (and, for a PUB that
    connects, ingest's public key as ``server_key``: required then)."""

    endpoint: str | None = "tcp://127.0.0.1:5557"
    layout: Layout = "map"
    replay_endpoint: str | None = None
    replay_layout: ReplayLayout = "topic"
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    curve: EventCurve | None = None

    def __post_init__(self) -> None:
        connects = self.endpoint is not None and not should_bind(self.endpoint)
        if self.curve is not None and connects and self.curve.server_key is None:
            raise ValueError(
                "a CURVE publisher that connects to ingest needs ingest's public key "
                "(simulate --curve-server-key-file)"
            )


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """``pods`` copies of ``pod`` (its ``pod_id`` is replaced per pod, and its ``role`` in a P/D
    fleet: the first ``prefill_pods`` pods prefill, the others decode)."""

    pod: PodConfig
    pods: int = 1
    host: str = "127.0.0.1"
    base_port: int = 8000
    pod_id_style: PodIdStyle = "sim"
    publish: PublishConfig = field(default_factory=PublishConfig)
    prefill_pods: int = 0

    def __post_init__(self) -> None:
        if self.pods < 1:
            raise ValueError("pods must be >= 1")
        if not 0 <= self.prefill_pods <= self.pods:
            raise ValueError(f"prefill_pods must be 0 to pods ({self.pods}), not {self.prefill_pods}")
        if self.prefill_pods and self.pod.role != "both":
            raise ValueError(
                f"prefill_pods gives each pod its role: the template's must be 'both', not {self.pod.role!r}"
            )
        if not 0 <= self.base_port <= 65535 - (self.pods - 1):
            raise ValueError("base_port + pods - 1 must be a TCP port")
        if self.pod_id_style not in ("sim", "hostport"):
            raise ValueError("pod_id_style must be 'sim' or 'hostport'")

    def role_of(self, index: int) -> str:
        """The role of pod ``index``."""
        if not self.prefill_pods:
            return self.pod.role
        return "prefill" if index < self.prefill_pods else "decode"


def pod_id_for(style: PodIdStyle, index: int, host: str, port: int) -> str:
    """``sim-<index>`` or ``<host>:<port>``."""
    return f"sim-{index}" if style == "sim" else f"{host}:{port}"


@dataclass(eq=False)
class RunningPod:
    """A started pod: its core, where it serves, what it publishes on."""

    pod: Pod
    port: int
    url: str
    publishers: list[EventPublisher]
    server: uvicorn.Server
    task: asyncio.Task | None = None

    @property
    def pod_id(self) -> str:
        return self.pod.config.pod_id


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the fleet: N servers share one process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP.
    # Without it every answer on a kept-alive connection waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Fleet:
    """Start with ``await fleet.start()`` (or ``async with``), stop with ``await fleet.stop()``.

    ``tokenizer`` is the model's tokenizer as the manager uses it, shared by every pod (build it
    before the loop runs: loading may read the registry)."""

    def __init__(
        self, config: FleetConfig, *, tokenizer: PodTokenizer, graceful_timeout: float = 2.0
    ) -> None:
        if tokenizer.model != config.pod.model:
            raise ValueError(f"the tokenizer is {tokenizer.model!r}'s, the pods serve {config.pod.model!r}")
        self.config = config
        self.tokenizer = tokenizer
        self.graceful_timeout = graceful_timeout
        self.pods: list[RunningPod] = []
        self._context: zmq.Context | None = None
        self._replay_tasks: list[asyncio.Task] = []
        self._sockets: list[socket.socket] = []
        self._publishers: list[EventPublisher] = []

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def endpoints(self, index: int) -> list[tuple[str | None, str | None]]:
        """(events endpoint, replay endpoint) of each rank of pod ``index``."""
        c, dp = self.config.publish, self.config.pod.data_parallel_size
        out = []
        for rank in range(dp):
            events = None
            if c.endpoint:
                shift = index * dp + rank if should_bind(c.endpoint) else rank
                events = offset_endpoint(c.endpoint, shift)
            replay = offset_endpoint(c.replay_endpoint, index * dp + rank) if c.replay_endpoint else None
            out.append((events, replay))
        return out

    async def start(self) -> None:
        """Bind every socket, build the pods, start serving; returns once every server listens."""
        c = self.config
        try:
            self._context = zmq.Context()
            for i in range(c.pods):
                self.pods.append(self._start_pod(i, self.tokenizer))
            while not all(p.server.started for p in self.pods):
                failed = [p for p in self.pods if p.task is not None and p.task.done()]
                if failed:
                    failed[0].task.result()
                    raise RuntimeError(f"the HTTP server of {failed[0].pod_id} stopped during start")
                await asyncio.sleep(0.01)
        except BaseException:
            await self.stop()
            raise

    def _start_pod(self, index: int, tokenizer: PodTokenizer) -> RunningPod:
        c = self.config
        sock = _listen(c.host, c.base_port + index if c.base_port else 0)
        self._sockets.append(sock)
        port = sock.getsockname()[1]
        pod_id = pod_id_for(c.pod_id_style, index, c.host, port)
        publishers = []
        assert self._context is not None
        for rank, (events, replay) in enumerate(self.endpoints(index)):
            if events is None:
                continue
            publisher = EventPublisher(
                self._context,
                endpoint=events,
                pod_id=pod_id,
                model=c.pod.model,
                data_parallel_rank=rank,
                layout=c.publish.layout,
                replay_endpoint=replay,
                replay_layout=c.publish.replay_layout,
                buffer_steps=c.publish.buffer_steps,
                hwm=c.publish.hwm,
                curve=c.publish.curve,
            )
            publishers.append(publisher)
            self._publishers.append(publisher)
            self._replay_tasks.append(asyncio.create_task(publisher.serve_replay()))
        pod = Pod(
            dataclasses.replace(c.pod, pod_id=pod_id, role=c.role_of(index)),
            tokenizer=tokenizer,
            on_events=[p.publish for p in publishers] if publishers else None,
        )
        server = _EmbeddedServer(
            uvicorn.Config(
                create_app(pod),
                lifespan="off",
                log_config=None,
                log_level="warning",  # N pods would log N start-up lines each
                access_log=False,
                timeout_graceful_shutdown=self.graceful_timeout,
            )
        )
        url_host = "127.0.0.1" if c.host in ("0.0.0.0", "") else f"[{c.host}]" if ":" in c.host else c.host
        running = RunningPod(
            pod=pod, port=port, url=f"http://{url_host}:{port}", publishers=publishers, server=server
        )
        running.task = asyncio.create_task(server.serve(sockets=[sock]))
        return running

    async def stop(self) -> None:
        """Stop serving (in-flight requests get ``graceful_timeout`` seconds), close every socket."""
        for p in self.pods:
            p.server.should_exit = True
        tasks = [p.task for p in self.pods if p.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in self._replay_tasks:
            task.cancel()
        await asyncio.gather(*self._replay_tasks, return_exceptions=True)
        for publisher in self._publishers:
            publisher.close()
        for sock in self._sockets:
            sock.close()
        if self._context is not None:
            self._context.term()
        self.pods, self._replay_tasks, self._sockets, self._publishers = [], [], [], []
        self._context = None


class FleetThread:
    """A fleet served from an event loop in a thread of its own, so the caller's thread may block
    (tests, benchmarks): started at once, ``call`` runs a coroutine on its loop, ``close`` stops it."""

    def __init__(self, fleet: Fleet, *, start_timeout: float = 30.0) -> None:
        self.fleet = fleet
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet", daemon=True)
        self.thread.start()
        self.call(fleet.start(), timeout=start_timeout)

    def call(self, coroutine, timeout: float = 10.0):
        """Run ``coroutine`` on the fleet's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.fleet.stop(), timeout=30.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
