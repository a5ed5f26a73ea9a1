"""The whole write path in one object: SUB sockets -> shard pool -> one applier per worker ->
index. The ``ingest`` command, the tests and ``bench/ingest.py`` all run this same pipeline.

Garbage collection: an in-memory index holds millions of long-lived objects, and CPython's full
collections traverse all of them (hundreds of milliseconds, stalling every worker). So once a
second the pipeline collects what the last second left (short: only young objects are
traversed) and then freezes the survivors out of the collector's reach (``gc.freeze``). Frozen
objects are still freed by reference counting when the index drops them; only a cycle formed
among them later would outlive its use, and the index's structures form none.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Sequence

import zmq

from ingest.applier import EventApplier
from ingest.events import DEFAULT_LIMITS, DecodeLimits
from ingest.pool import DecodingHandler, Receiver, ShardPool
from ingest.stats import IngestStats
from scoring.config import ServiceConfig
from scoring.index import KVIndex


class IngestPipeline:
    def __init__(
        self,
        *,
        index: KVIndex,
        config: Callable[[], ServiceConfig],
        stats: IngestStats | None = None,
        bind: Sequence[str] = (),
        connect: Sequence[str] = (),
        topic: str = "kv@",
        workers: int = 4,
        queue_size: int = 10_000,
        context: zmq.Context | None = None,
        gc_freeze_seconds: float | None = 1.0,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        self.stats = stats or IngestStats()
        self._gc_freeze_seconds = gc_freeze_seconds
        self._stopped = threading.Event()
        self.appliers: list[EventApplier] = []

        def handler_factory(_worker: int):
            applier = EventApplier(index, config=config, stats=self.stats)
            self.appliers.append(applier)
            return DecodingHandler(applier, self.stats, limits)

        self.pool = ShardPool(
            workers=workers, handler_factory=handler_factory, queue_size=queue_size, stats=self.stats
        )
        self.receiver = Receiver(
            pool=self.pool,
            stats=self.stats,
            bind=bind,
            connect=connect,
            topic=topic,
            context=context,
            limits=limits,
        )
        self._thread = threading.Thread(target=self.receiver.run, name="ingest-receiver", daemon=True)

    @property
    def bound(self) -> list[str]:
        """The endpoints actually bound (with the port chosen for ``tcp://...:*``)."""
        return self.receiver.bound

    def start(self) -> None:
        self.pool.start()
        self._thread.start()
        if self._gc_freeze_seconds:
            threading.Thread(target=self._freeze_survivors, name="ingest-gc", daemon=True).start()

    def stop(self, *, drain_timeout: float = 30.0) -> None:
        """Stop receiving, let every worker finish its queue, then return."""
        self.receiver.stop()
        self._stopped.set()
        self._thread.join(5)
        self.pool.drain_and_stop(drain_timeout)

    def _freeze_survivors(self) -> None:
        while not self._stopped.wait(self._gc_freeze_seconds):
            gc.collect()
            gc.freeze()

    def forget_pod(self, pod: str) -> None:
        """Drop per-pod state everywhere (the pod was disabled or deleted)."""
        for applier in self.appliers:
            applier.forget(pod)
        self.stats.forget_pod(pod)
