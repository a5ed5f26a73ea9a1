"""``python manage.py ingest``: vLLM KV events over ZeroMQ into the index.

A thin shell: it wires the receiver, the shard pool and one ``EventApplier`` per worker (all in
the pure core), and does the housekeeping that needs Django: registering the pods it sees,
sharing its counters, recording the dashboard's history (``ingest.history``), serving Prometheus
metrics, probing the pods' health (``registry.liveness``) and expiring pods long unheard of.
SIGTERM/SIGINT drain the queues and exit 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime, timedelta

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from prometheus_client import CollectorRegistry, start_http_server

from ingest.curve import CurveError, EventCurve, load_allowed_keys, load_key_pair, load_public_key
from ingest.events import DecodeLimits
from ingest.history import HistoryRecorder, blocks_by_pod
from ingest.membership import HEARTBEAT_SECONDS, Replica, ReplicaCollector, ReplicaNameTaken, open_membership
from ingest.pipeline import IngestPipeline
from ingest.pool import Admission
from ingest.processes import refuse_memory_index
from ingest.replay import ReplayClient
from ingest.stats import IngestStats, IngestStatsCollector
from kvindex import KVIndex, open_index
from kvindex.base import IndexUnavailable
from kvindex.dynamo import DynamoBlockStore, prune
from kvindex.shared_stats import (
    instance_id,
    publish_snapshot,
    read_scoring,
    read_snapshots,
    withdraw_snapshot,
)
from registry.liveness import LivenessCollector, LivenessProber, LivenessSettings, probe_targets
from registry.runtime import (
    connect_index,
    dynamo_blocks_factory,
    get_dynamo_blocks,
    get_index,
    index_is_shared,
    index_options,
    index_url,
    service_config,
    set_index,
)
from registry.services import (
    expire_pods,
    forget_unregistered_pods,
    record_learned_groups,
    record_pods_seen,
    set_pod_health,
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
        if options["replica"] is not None:
            check_replica_options(options)
        default_bind = [] if options["connect"] or options["replica"] is not None else ["tcp://*:5557"]
        bind = options["bind"] or default_bind
        connects = bool(options["connect"]) or options["replica"] is not None
        curve = event_curve(binds=bool(bind), connects=connects)
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
        pipeline = IngestPipeline(
            index=index,
            config=service_config,
            bind=bind,
            connect=options["connect"],
            topic=options["topic"],
            workers=options["workers"],
            queue_size=options["queue_size"],
            limits=DecodeLimits(
                max_message_bytes=settings.KVCACHE_INGEST_MAX_MESSAGE_BYTES,
                max_events=settings.KVCACHE_INGEST_MAX_EVENTS,
                max_blocks=settings.KVCACHE_INGEST_MAX_BLOCKS,
                max_pods=settings.KVCACHE_INGEST_MAX_PODS,
            ),
            admission=Admission(
                registered_only=settings.KVCACHE_INGEST_REGISTERED_PODS_ONLY,
                idle_seconds=settings.KVCACHE_INGEST_POD_IDLE_SECONDS,
            ),
            replay=ReplayClient(
                config=service_config,
                port_offset=options["replay_port_offset"],
                timeout=settings.KVCACHE_REPLAY_TIMEOUT_SECONDS,
                curve=curve if curve is not None and curve.server_key is not None else None,
            ),
            processes=processes,
            index_factory=worker_index_factory() if processes > 1 else None,
            dynamo_factory=dynamo_blocks_factory(timeout=settings.KVCACHE_INGEST_INDEX_TIMEOUT),
            replica=options["replica"] is not None,
            curve=curve,
        )
        stats = pipeline.stats
        replica = join_replica(options["replica"], pipeline) if options["replica"] is not None else None
        prober = liveness_prober(
            index,
            stats,
            foreign=(lambda: replica.holding.foreign) if replica else None,
            on_return=pipeline.pod_returned,
        )
        if options["metrics_port"] is not None:
            registry = CollectorRegistry()
            registry.register(IngestStatsCollector(stats))
            if prober is not None:
                registry.register(LivenessCollector(prober))
            if replica is not None:
                foreign_messages = lambda: pipeline.receiver.foreign_messages  # noqa: E731
                registry.register(ReplicaCollector(replica, foreign_messages=foreign_messages))
            start_http_server(options["metrics_port"], registry=registry)

        stopping = threading.Event()

        def on_signal(signum: int, _frame) -> None:
            log.info("received %s: draining", signal.Signals(signum).name)
            stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

        pipeline.start()
        if replica is not None:
            replica.start()
        endpoints = ", ".join(
            [*(f"bind {e}" for e in pipeline.bound), *(f"connect {e}" for e in options["connect"])]
            + ([f"replica {replica.name} of {len(replica.holding.members)}"] if replica else [])
        )
        workers = f"{options['workers']} workers"
        if processes > 1:
            workers += f" in each of {processes} processes"
        if curve is not None:
            workers += f"; CURVE, public key {curve.keys.public.decode()}"
        self.stdout.write(f"ingest: {endpoints}; topic {options['topic']!r}; {workers}")
        self.stdout.flush()

        housekeeping = Housekeeping(
            stats, prober=prober, forget_pod=pipeline.forget_pod, dynamo=get_dynamo_blocks()
        )
        while not stopping.wait(options["housekeeping_interval"]):
            housekeeping.run_once()
        pipeline.stop()
        if replica is not None:  # after draining: the others take its pods once it wrote them
            replica.stop(leave=True)
        housekeeping.run_once()
        housekeeping.close()
        self.stdout.write("ingest: stopped", ending="\n")


def worker_index_factory() -> Callable[[], KVIndex]:
    """How an ``ingest --processes N`` worker process opens the index, without Django: what
    ``connect_index`` does here, as a picklable call."""
    timeout = settings.KVCACHE_INGEST_INDEX_TIMEOUT
    return functools.partial(
        open_index, index_url(), socket_timeout=timeout, socket_connect_timeout=timeout, **index_options()
    )


def event_curve(*, binds: bool, connects: bool) -> EventCurve | None:
    """CURVE on the event sockets as the ``KVCACHE_INGEST_CURVE_*`` settings say (None: off);
    ``CommandError`` when a file is missing or malformed, or the settings do not cover the
    sockets: bound ones (``binds``) need the allowed keys, connected ones (``connects``:
    ``--connect``, ``--replica``) the engines' public key."""
    secret_key_file = settings.KVCACHE_INGEST_CURVE_SECRET_KEY_FILE
    clients_dir = settings.KVCACHE_INGEST_CURVE_CLIENTS_DIR
    server_key_file = settings.KVCACHE_INGEST_CURVE_SERVER_KEY_FILE
    if not secret_key_file:
        if clients_dir or server_key_file:
            raise CommandError(
                "KVCACHE_INGEST_CURVE_CLIENTS_DIR and KVCACHE_INGEST_CURVE_SERVER_KEY_FILE need "
                "KVCACHE_INGEST_CURVE_SECRET_KEY_FILE, ingest's own key pair (manage.py curve_keys)"
            )
        return None
    try:
        keys = load_key_pair(secret_key_file, what="KVCACHE_INGEST_CURVE_SECRET_KEY_FILE")
        if binds and not clients_dir:
            raise CurveError(
                "CURVE on --bind needs KVCACHE_INGEST_CURVE_CLIENTS_DIR: a directory of the public "
                "certificates (NAME.key) of the engines allowed to publish"
            )
        if connects and not server_key_file:
            raise CurveError(
                "CURVE with --connect or --replica needs KVCACHE_INGEST_CURVE_SERVER_KEY_FILE: the "
                "certificate of the public key the engines' bound sockets serve with"
            )
        allowed = (
            load_allowed_keys(clients_dir, what="KVCACHE_INGEST_CURVE_CLIENTS_DIR") if clients_dir else None
        )
        server_key = (
            load_public_key(server_key_file, what="KVCACHE_INGEST_CURVE_SERVER_KEY_FILE")
            if server_key_file
            else None
        )
    except CurveError as e:
        raise CommandError(str(e)) from None
    return EventCurve(keys=keys, allowed=allowed or frozenset(), server_key=server_key)


def check_replica_options(options: dict) -> None:
    """``--replica`` needs an index the replicas share."""
    if not index_is_shared():
        raise CommandError(
            "--replica needs an index the replicas share (KVCACHE_INDEX_BACKEND=redis or a "
            "redis-cluster:// URL): an in-memory index cannot hold their membership"
        )


def join_replica(name: str, pipeline: IngestPipeline) -> Replica:
    """Replica ``name`` of the ingest processes sharing the fleet (``ingest.membership``),
    joined (its first heartbeat done, its first share handed to ``pipeline``), not started."""
    try:
        store = open_membership(index_url(), timeout=HEARTBEAT_SECONDS)
        replica = Replica(
            name=name,
            store=store,
            config=service_config,
            on_change=lambda holding: pipeline.hold(holding.held, foreign=holding.foreign),
        )
        replica.join()
    except (ValueError, ReplicaNameTaken, IndexUnavailable) as e:
        raise CommandError(f"--replica {name}: {e}") from e
    return replica


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


class Housekeeping:
    """Once a second: record pods seen since last time, delete the unregistered pods the receiver
    evicted (their rows and blocks), publish the counters (into Redis, and to the channel-layer
    group ``KVCACHE_STATS_GROUP`` for the dashboards watching live) and record the dashboard's
    history into Redis (``ingest.history``); once a minute: expire pods not heard from for
    ``KVCACHE_POD_EXPIRE_DAYS`` (``forget_pod``: what the pipeline holds of them goes too); every
    ``DYNAMO_PRUNE_SECONDS``, in a thread of its own, delete the Dynamo block records (``dynamo``,
    with ``KVCACHE_DYNAMO_BLOCKS``) of blocks nobody holds. Runs ``prober`` (if any) from
    construction until ``close``."""

    def __init__(
        self,
        stats: IngestStats,
        *,
        prober: LivenessProber | None = None,
        forget_pod: Callable[[str], None] | None = None,
        dynamo: DynamoBlockStore | None = None,
    ) -> None:
        self.stats = stats
        self.dynamo = dynamo
        self._next_prune = time.monotonic() + DYNAMO_PRUNE_SECONDS
        self._pruning: threading.Thread | None = None
        self.prober = prober
        self.forget_pod = forget_pod or stats.forget_pod
        self._registered: dict[str, float] = {}
        self._next_expiry = float("-inf")  # monotonic
        self._trim = _malloc_trim()
        self._next_trim = time.monotonic() + TRIM_INTERVAL_SECONDS
        self._learned_groups: dict = {}
        self._instance = instance_id()
        self._redis = redis.Redis.from_url(settings.REDIS_URL) if index_is_shared() else None
        self._channel_layer = get_channel_layer()
        self._history = HistoryRecorder()
        if prober is not None:
            prober.start()

    def run_once(self) -> None:
        try:
            self._forget_evicted()
        except Exception:
            log.exception("could not delete the evicted unregistered pods")
        try:
            self._register_pods()
        except Exception:
            log.exception("could not update the pod registry")
        try:
            self._expire_pods()
        except Exception:
            log.exception("could not expire pods")
        try:
            self._record_learned_groups()
        except Exception:
            log.exception("could not record the KV-cache groups learned from events")
        snapshot = {**self.stats.snapshot(), "instance": self._instance}
        if self._redis is not None:
            try:
                publish_snapshot(self._redis, snapshot, instance=self._instance)
            except redis.RedisError as e:
                log.warning("could not publish ingest stats: %s", e)
        if self._channel_layer is not None:
            try:
                async_to_sync(self._channel_layer.group_send)(
                    settings.KVCACHE_STATS_GROUP, {"type": "ingest.snapshot", "snapshot": snapshot}
                )
            except Exception as e:  # the layer's backend errors (Redis, OS, its own) are not one type
                log.warning("could not send ingest stats to the channel layer: %s", e)
        if self._redis is not None:  # after the live numbers went out: they are not kept waiting
            try:
                self._record_history(snapshot)
            except redis.RedisError as e:
                log.warning("could not record the dashboard history: %s", e)
        self._prune_dynamo_blocks()
        if self._trim is not None and time.monotonic() >= self._next_trim:
            self._next_trim = time.monotonic() + TRIM_INTERVAL_SECONDS
            self._trim()

    def _prune_dynamo_blocks(self) -> None:
        if self.dynamo is None or time.monotonic() < self._next_prune:
            return
        if self._pruning is not None and self._pruning.is_alive():
            return
        self._next_prune = time.monotonic() + DYNAMO_PRUNE_SECONDS
        self._pruning = threading.Thread(
            target=self._prune_dynamo_models, name="ingest-dynamo-prune", daemon=True
        )
        self._pruning.start()

    def _prune_dynamo_models(self) -> None:
        try:
            for model in self.dynamo.models():
                prune(get_index(), self.dynamo, model=model)
        except Exception:
            log.exception("could not prune the Dynamo block records")

    def _record_history(self, snapshot: dict) -> None:
        """The dashboard history's point: from this process's ``snapshot`` (as published) and the
        other ingest processes' (read from Redis)."""
        try:
            blocks = blocks_by_pod(get_index().pod_blocks())
        except IndexUnavailable:
            blocks = None
        self._history.record(
            self._redis,
            now=time.time(),
            snapshots=[snapshot, *read_snapshots(self._redis, besides=self._instance)],
            blocks=blocks,
            scoring=read_scoring(self._redis),
        )

    def _register_pods(self) -> None:
        seen = {}
        for s in self.stats.streams():
            # A stream opened without an event (a catch-up replay of a registered pod) has no
            # last event: registering it would date its last_seen 1970, and expiry would delete it.
            if s.last_event_at > 0 and self._registered.get(s.pod, -1.0) < s.last_event_at:
                first, last = seen.get(s.pod, (s.model, s.first_event_at, s.last_event_at))[1:]
                seen[s.pod] = (s.model, min(first, s.first_event_at), max(last, s.last_event_at))
        if seen:
            record_pods_seen((pod, model, first, last) for pod, (model, first, last) in seen.items())
            for pod, (_, _, last) in seen.items():
                self._registered[pod] = last

    def _forget_evicted(self) -> None:
        evicted = self.stats.take_evicted()
        for pod in evicted:
            self._registered.pop(pod, None)
        if evicted:
            deleted = forget_unregistered_pods(evicted)
            log.info(
                "%d unregistered pods gave their place to new ones (%d registry rows deleted)",
                len(evicted),
                deleted,
            )

    def _record_learned_groups(self) -> None:
        """The KV-cache groups each pod's events described, into the registry when they change, for
        the pods already in it: a pod whose first event came after this round recorded the pods
        seen gets its row next round, and its groups then (else they were skipped for want of
        a row, and never written, as nothing changed since). Only the pods whose groups changed
        since the last round are written: a round costs what changed, not the fleet (a query
        naming every pod, each round of a flood of fuzzed groups, kept ~100 kB of prepared
        statement per pod count in SQLite's statement cache)."""
        learned = {
            key: dict(groups)
            for key, groups in list(self.stats.learned_groups.items())
            if key[0] in self._registered
        }
        changed = {key: groups for key, groups in learned.items() if self._learned_groups.get(key) != groups}
        if changed:
            record_learned_groups(changed)
        self._learned_groups = learned

    def _expire_pods(self) -> None:
        days = settings.KVCACHE_POD_EXPIRE_DAYS
        if days <= 0 or time.monotonic() < self._next_expiry:
            return
        self._next_expiry = time.monotonic() + EXPIRY_INTERVAL_SECONDS
        for pod in expire_pods(last_seen_before=datetime.now(UTC) - timedelta(days=days)):
            log.info("pod %s expired: not heard from for %s days", pod, days)
            self.forget_pod(pod)
            self._registered.pop(pod, None)

    def close(self) -> None:
        if self.prober is not None:
            self.prober.stop()
        if self._redis is not None:
            with contextlib.suppress(redis.RedisError):
                withdraw_snapshot(self._redis, instance=self._instance)
            self._redis.close()


EXPIRY_INTERVAL_SECONDS = 60.0
"""How often housekeeping looks for pods to expire."""

TRIM_INTERVAL_SECONDS = 10.0
"""How often housekeeping hands the memory freed since back to the system (``malloc_trim``)."""

DYNAMO_PRUNE_SECONDS = 300.0
"""How often housekeeping deletes the Dynamo block records of blocks nobody holds any more
(``KVCACHE_DYNAMO_BLOCKS``): the records then number the blocks held plus a few minutes' churn."""


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none. Ingest's bursts (a stats
    snapshot of thousands of streams each second, a backlog of messages) free memory that glibc
    keeps for itself: trimming gives it back, so that what ingest shows is what it keeps (4,096
    flood pods: 46 MB of resident growth instead of 65, ``bench/hostile.py``)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    return None if trim is None else lambda: trim(0)


def quiet_pods(stats: IngestStats) -> set[str]:
    """Registered pods ingest has had no KV event from for ``DASHBOARD_STALE_SECONDS``."""
    heard: dict[str, float] = {}
    for s in stats.streams():
        heard[s.pod] = max(heard.get(s.pod, 0.0), s.last_event_at)
    quiet_since = time.time() - settings.DASHBOARD_STALE_SECONDS
    return {pod for pod in service_config().pods if heard.get(pod, 0.0) < quiet_since}


def liveness_prober(
    index: KVIndex,
    stats: IngestStats,
    *,
    foreign: Callable[[], Collection[str]] | None = None,
    on_return: Callable[[str], object] | None = None,
) -> LivenessProber | None:
    """The pod prober of this process: it probes the registry's enabled pods that have an address
    and writes their health back (``KVCACHE_POD_*``); ``None`` when KVCACHE_POD_DOWN_SECONDS is 0.
    ``foreign``: the pods another ingest replica holds (and probes), left out. ``on_return``: a
    pod answers again after being down (the pipeline checks its engines did not restart)."""
    if settings.KVCACHE_POD_DOWN_SECONDS <= 0:
        return None

    def targets() -> dict[str, str]:
        found = probe_targets(service_config())
        if foreign is not None:
            skipped = foreign()
            found = {pod: address for pod, address in found.items() if pod not in skipped}
        return found

    return LivenessProber(
        targets=targets,
        quiet=lambda: quiet_pods(stats),
        index=index,
        on_change=set_pod_health,
        on_return=on_return,
        settings=LivenessSettings(
            down_seconds=settings.KVCACHE_POD_DOWN_SECONDS,
            forget_seconds=settings.KVCACHE_POD_FORGET_SECONDS,
        ),
    )
