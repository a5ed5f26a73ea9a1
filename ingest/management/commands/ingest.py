"""``python manage.py ingest``: vLLM KV events over ZeroMQ into the index.

A thin shell around ``ingest.service.IngestService`` (the receiver, the shard pool and one
``EventApplier`` per worker, all in the pure core, with the housekeeping that needs Django:
registering the pods it sees, sharing its counters, recording the dashboard's history, probing the
pods' health and expiring pods long unheard of): it reads the options, waits for the index, serves
Prometheus metrics and runs housekeeping until SIGTERM/SIGINT, which drain the queues and exit 0.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from prometheus_client import CollectorRegistry, start_http_server

from ingest.processes import refuse_memory_index
from ingest.service import IngestOptions, IngestService, IngestSetupError, check_setup
from kvindex import KVIndex, open_index
from kvindex.base import IndexUnavailable
from registry.runtime import (
    connect_index,
    dynamo_blocks_factory,
    get_dynamo_blocks,
    get_index,
    index_options,
    index_url,
    set_index,
)

log = logging.getLogger("ingest")


class Command(BaseCommand):
    help = "Consume vLLM KV events (ZeroMQ SUB) into the KV-block index."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--bind",
            action="append",
            default=[],
            metavar="ENDPOINT",
            help="Bind a SUB socket here (repeatable). Default tcp://*:5557 when no --connect is given.",
        )
        parser.add_argument(
            "--connect",
            action="append",
            default=[],
            metavar="ENDPOINT",
            help="Connect a SUB socket to an engine's PUB endpoint (repeatable).",
        )
        parser.add_argument("--topic", default="kv@", help="Topic prefix to subscribe to (default kv@).")
        parser.add_argument(
            "--workers", type=int, default=4, help="Worker threads; a pod always maps to one."
        )
        parser.add_argument(
            "--processes",
            type=int,
            default=1,
            help="Worker processes, each with --workers threads; a pod always maps to one (default 1: "
            "the workers run in this process). More than 1 needs a Redis index.",
        )
        parser.add_argument(
            "--queue-size", type=int, default=10_000, help="Messages queued per worker at most."
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="Serve Prometheus metrics of this process on this port (default: none).",
        )
        parser.add_argument(
            "--replay-port-offset",
            type=int,
            default=settings.KVCACHE_REPLAY_PORT_OFFSET,
            metavar="K",
            help="Ask a pod without a registry replay_endpoint for missed batches at "
            "tcp://host:(port + K) of its address (default: KVCACHE_REPLAY_PORT_OFFSET, else none).",
        )
        parser.add_argument(
            "--housekeeping-interval",
            type=float,
            default=1.0,
            help="Seconds between registry updates and stats publication (default 1).",
        )
        parser.add_argument(
            "--replica",
            default=None,
            metavar="NAME",
            help="Run as replica NAME of several ingest processes sharing the fleet (a Redis index): "
            "it holds a consistent-hash share of the pods with a registry event_endpoint and connects "
            "to them, and takes over a stopped replica's pods within 10 s. No default --bind then.",
        )

    def handle(self, *args, **options) -> None:
        replica = options["replica"]
        default_bind = [] if options["connect"] or replica is not None else ["tcp://*:5557"]
        ingest = IngestOptions(
            bind=tuple(options["bind"] or default_bind),
            connect=tuple(options["connect"]),
            topic=options["topic"],
            workers=options["workers"],
            processes=options["processes"],
            queue_size=options["queue_size"],
            replay_port_offset=options["replay_port_offset"],
            replica=replica,
        )
        try:
            curve = check_setup(ingest)
        except IngestSetupError as e:
            raise CommandError(str(e)) from None
        # Longer than a score waits (KVCACHE_INGEST_INDEX_TIMEOUT): a write may queue behind others.
        set_index(connect_index(timeout=settings.KVCACHE_INGEST_INDEX_TIMEOUT))
        index = get_index()
        processes = options["processes"]
        if processes > 1:
            try:
                refuse_memory_index(index)
            except ValueError as e:
                raise CommandError(str(e)) from None
        wait_for_index(index, timeout=60.0)
        try:
            service = IngestService(
                ingest,
                index=index,
                curve=curve,
                index_factory=worker_index_factory() if processes > 1 else None,
                dynamo_factory=dynamo_blocks_factory(timeout=settings.KVCACHE_INGEST_INDEX_TIMEOUT),
                dynamo=get_dynamo_blocks(),
            )
        except IngestSetupError as e:
            raise CommandError(str(e)) from None
        if options["metrics_port"] is not None:
            registry = CollectorRegistry()
            for collector in service.collectors():
                registry.register(collector)
            start_http_server(options["metrics_port"], registry=registry)

        stopping = threading.Event()

        def on_signal(signum: int, _frame) -> None:
            log.info("received %s: draining", signal.Signals(signum).name)
            stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

        service.start()
        workers = f"{options['workers']} workers"
        if processes > 1:
            workers += f" in each of {processes} processes"
        if service.curve is not None:
            workers += f"; CURVE, public key {service.curve.keys.public.decode()}"
        self.stdout.write(f"ingest: {service.describe()}; topic {options['topic']!r}; {workers}")
        self.stdout.flush()

        while not stopping.wait(options["housekeeping_interval"]):
            service.run_housekeeping()
        service.stop()
        self.stdout.write("ingest: stopped", ending="\n")


def worker_index_factory() -> Callable[[], KVIndex]:
    """How an ``ingest --processes N`` worker process opens the index, without Django: what
    ``connect_index`` does here, as a picklable call."""
    timeout = settings.KVCACHE_INGEST_INDEX_TIMEOUT
    return functools.partial(
        open_index, index_url(), socket_timeout=timeout, socket_connect_timeout=timeout, **index_options()
    )


def wait_for_index(index, *, timeout: float) -> None:
    """Wait until the index answers (a server started alongside may still be coming up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            index.ping()
            return
        except IndexUnavailable as e:
            if time.monotonic() > deadline:
                raise CommandError(f"the index is unreachable: {e}") from e
            log.info("waiting for the index: %s", e)
            time.sleep(0.5)
