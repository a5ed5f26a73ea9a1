"""``--index in-process``: a serving process (the gateway, the Endpoint Picker, the web server) that
keeps the index in its own memory and fills it from the engines' KV events itself, as llm-d's
router and Dynamo's do, for fleets that need no shared store. ``--index shared`` (the default)
reads the index ``KVCACHE_INDEX_BACKEND`` names, which ``manage.py ingest`` fills: the one for
shared, replicated state.

In this mode the process opens ``KVCACHE_IN_PROCESS_INDEX`` (a ``memory://`` URL: its bounds) as
its own index (``registry.runtime.use_own_index``) and runs an ``ingest.service.IngestService``
over it: it connects to the event endpoint of every enabled pod of the registry, following
additions and removals within a few seconds (a replica alone: ``ingest.membership.SoloMembership``),
and to the ``--ingest-connect`` endpoints, and binds ``--ingest-bind`` for engines that connect;
it asks each engine's replay endpoint for what it missed (at start: all its replay buffer holds;
after a gap: the gap), checks its pods' health (``registry.liveness``), registers the pods it
hears from as ``manage.py ingest`` does, and does to its index what the registry's writes do to a
shared one (``ingest.follower``). Its counters join the process's Prometheus metrics
(``kvcache_index_*``, ``kvcache_ingest_*``, ``kvcache_liveness_*``). Each process in this mode
holds a full, independent index: two replicas of the gateway subscribe twice.

A uvicorn-served command runs its application in worker processes: it hands the options to them
through the environment (``hand_to_workers``), and the application's lifespan starts the ingest
(``InProcessIndex.from_environment``). The index lives in one process, so such a command serves
from one worker in this mode.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import zmq
from django.conf import settings
from prometheus_client import CollectorRegistry

from ingest.service import IngestOptions, IngestService, IngestSetupError, check_setup
from kvindex import open_index
from registry.runtime import use_own_index

__all__ = [
    "INDEX_MODES",
    "InProcessIndex",
    "IngestSetupError",
    "add_arguments",
    "hand_to_workers",
    "options_from",
]

INDEX_MODES = ("shared", "in-process")
ENVIRONMENT = "KVCACHE_IN_PROCESS_INGEST"
"""How a command hands the in-process ingest's options to its worker processes (JSON)."""
DEFAULT_WORKERS = 1
"""Worker threads of an in-process ingest (a pod always maps to one). One: the serving process's
threads share one interpreter lock, and a second worker only adds hand-offs (``bench/indexer.py``,
327,680 blocks: 5.8 CPU s per million blocks with one, 6.8 with two; docs/performance.md)."""
DRAIN_SECONDS = 5.0
"""How long a stopping process lets its ingest write what it received (its stop stays under 10 s)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--index`` and the in-process ingest's options, for a serving command."""
    group = parser.add_argument_group("the index")
    group.add_argument(
        "--index",
        choices=INDEX_MODES,
        default="shared",
        help="shared (default): the index KVCACHE_INDEX_BACKEND names, filled by manage.py ingest; "
        "in-process: this process keeps its own (KVCACHE_IN_PROCESS_INDEX) and subscribes to every "
        "registered pod's event endpoint itself, with replay and liveness (one worker process then)",
    )
    group.add_argument(
        "--ingest-connect",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="with --index in-process: connect to this engine's KV-event PUB too (repeatable)",
    )
    group.add_argument(
        "--ingest-bind",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="with --index in-process: bind a SUB socket here for engines that connect (repeatable)",
    )
    group.add_argument(
        "--ingest-workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"with --index in-process: ingest's worker threads (default {DEFAULT_WORKERS})",
    )


def options_from(parsed: Mapping[str, Any]) -> IngestOptions | None:
    """The in-process ingest a command's parsed options ask for (``None``: ``--index shared``),
    checked as ``check_setup`` checks it; ``IngestSetupError`` says what to fix."""
    if parsed["index"] != "in-process":
        if parsed["ingest_connect"] or parsed["ingest_bind"]:
            raise IngestSetupError("--ingest-connect and --ingest-bind go with --index in-process")
        return None
    if not settings.KVCACHE_IN_PROCESS_INDEX.startswith("memory://"):
        raise IngestSetupError(
            f"KVCACHE_IN_PROCESS_INDEX must be a memory:// URL, not {settings.KVCACHE_IN_PROCESS_INDEX!r}"
        )
    if parsed["ingest_workers"] < 1:
        raise IngestSetupError("--ingest-workers must be at least 1")
    options = IngestOptions(
        bind=tuple(parsed["ingest_bind"]),
        connect=tuple(parsed["ingest_connect"]),
        workers=parsed["ingest_workers"],
        replay_port_offset=settings.KVCACHE_REPLAY_PORT_OFFSET,
        every_event_endpoint=True,
    )
    check_setup(options, own_index=True)
    return options


def hand_to_workers(options: IngestOptions | None) -> None:
    """Pass ``options`` (``None``: shared mode) to the worker processes a command is about to start."""
    if options is None:
        os.environ.pop(ENVIRONMENT, None)
    else:
        os.environ[ENVIRONMENT] = json.dumps(dataclasses.asdict(options))


class InProcessIndex:
    """This process's own index and the ingest that fills it (module docstring)."""

    def __init__(self, options: IngestOptions) -> None:
        self.options = options
        self.service: IngestService | None = None
        self._registered: list[tuple[CollectorRegistry, list]] = []

    @classmethod
    def from_environment(cls) -> InProcessIndex | None:
        """The in-process index a command handed to this worker process (``None``: shared mode)."""
        value = os.environ.get(ENVIRONMENT)
        if not value:
            return None
        fields = json.loads(value)
        return cls(IngestOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}))

    def start(self) -> None:
        """Open the index, make it this process's and start filling it. Call it from a thread
        that runs no event loop (it reads the registry); ``IngestSetupError`` when it cannot
        start (a setting, a socket that cannot bind)."""
        curve = check_setup(self.options, own_index=True)
        index = open_index(settings.KVCACHE_IN_PROCESS_INDEX)
        use_own_index(index)
        try:
            self.service = IngestService(self.options, index=index, curve=curve, own_index=True)
        except zmq.ZMQError as error:  # an endpoint that cannot be bound or connected
            raise IngestSetupError(f"the in-process ingest cannot start: {error}") from error
        self.service.start(housekeeping_seconds=1.0)

    async def astart(self, registry: CollectorRegistry) -> str:
        """``start`` from an event loop (in a thread: it reads the registry), then its counters
        into ``registry``; returns ``describe()``. ``IngestSetupError`` when it cannot start."""
        await asyncio.get_running_loop().run_in_executor(None, self.start)
        self.register_metrics(registry)
        return self.describe()

    async def astop(self) -> None:
        """``stop`` from an event loop (in a thread: it drains the ingest)."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Add the ingest's collectors to ``registry`` (the process's metrics), until ``stop``."""
        assert self.service is not None, "start() first"
        collectors = self.service.collectors()
        for collector in collectors:
            registry.register(collector)
        self._registered.append((registry, collectors))

    def describe(self) -> str:
        assert self.service is not None, "start() first"
        return f"in-process index: {self.service.describe()}; {self.options.workers} ingest workers"

    def stop(self) -> None:
        """Stop receiving and write what was received (at most ``DRAIN_SECONDS``)."""
        for registry, collectors in self._registered:
            for collector in collectors:
                registry.unregister(collector)
        self._registered.clear()
        if self.service is not None:
            self.service.stop(drain_timeout=DRAIN_SECONDS)
            self.service = None
