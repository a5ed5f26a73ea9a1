"""The whole write path in one object: SUB sockets -> shard pool -> one applier per worker ->
index. The ``ingest`` command, the tests and ``bench/ingest.py`` all run this same pipeline."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import zmq

from ingest.applier import EventApplier
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
    ) -> None:
        self.stats = stats or IngestStats()
        self.appliers: list[EventApplier] = []

        def handler_factory(_worker: int):
            applier = EventApplier(index, config=config, stats=self.stats)
            self.appliers.append(applier)
            return DecodingHandler(applier, self.stats)

        self.pool = ShardPool(
            workers=workers, handler_factory=handler_factory, queue_size=queue_size, stats=self.stats
        )
        self.receiver = Receiver(
            pool=self.pool, stats=self.stats, bind=bind, connect=connect, topic=topic, context=context
        )
        self._thread = threading.Thread(target=self.receiver.run, name="ingest-receiver", daemon=True)

    @property
    def bound(self) -> list[str]:
        """The endpoints actually bound (with the port chosen for ``tcp://...:*``)."""
        return self.receiver.bound

    def start(self) -> None:
        self.pool.start()
        self._thread.start()

    def stop(self, *, drain_timeout: float = 30.0) -> None:
        """Stop receiving, let every worker finish its queue, then return."""
        self.receiver.stop()
        self._thread.join(5)
        self.pool.drain_and_stop(drain_timeout)

    def forget_pod(self, pod: str) -> None:
        """Drop per-pod state everywhere (the pod was disabled or deleted)."""
        for applier in self.appliers:
            applier.forget(pod)
        self.stats.forget_pod(pod)
