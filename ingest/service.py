"""One process's write path, as the settings and a command's options say: the pipeline
(``ingest.pipeline``), its replica membership (``ingest.membership``), the pod liveness prober
(``registry.liveness``) and the once-a-second housekeeping that needs Django (``Housekeeping``).

``manage.py ingest`` runs one ``IngestService`` over the shared index. A serving process run with
``--index in-process`` (``ingest.in_process``) runs one over an index of its own: it connects to
every registered pod's event endpoint (a replica alone: ``SoloMembership``), follows the
registry's writes into its index (``ingest.follower``) and publishes nothing for other processes.

Part of the write path's Django shell (settings, registry writes, the channel layer), not its core.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from prometheus_client.registry import Collector

from ingest.curve import CurveError, EventCurve, load_allowed_keys, load_key_pair, load_public_key
from ingest.events import DecodeLimits
from ingest.follower import RegistryFollower
from ingest.history import HistoryRecorder, blocks_by_pod
from ingest.membership import (
    HEARTBEAT_SECONDS,
    Replica,
    ReplicaCollector,
    ReplicaNameTaken,
    SoloMembership,
    open_membership,
)
from ingest.pipeline import IngestPipeline
from ingest.pool import Admission
from ingest.replay import ReplayClient
from ingest.stats import IngestStats, IngestStatsCollector
from kvindex import KVIndex
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
from registry.runtime import get_index, index_is_shared, index_url, service_config
from registry.services import (
    expire_pods,
    forget_unregistered_pods,
    record_learned_groups,
    record_pods_seen,
    set_pod_health,
)

log = logging.getLogger("ingest")

SOLO_REPLICA = "in-process"
"""The replica name of an ingest that holds every pod with an event endpoint alone."""


class IngestSetupError(Exception):
    """Options or settings an ingest cannot start with (the commands say it as a ``CommandError``)."""


@dataclass(frozen=True, slots=True)
class IngestOptions:
    """What to receive and how (``manage.py ingest``'s options; ``ingest.in_process``'s)."""

    bind: tuple[str, ...] = ()
    """SUB sockets bound here (the engines' PUBs connect)."""
    connect: tuple[str, ...] = ()
    """SUB sockets connected to these engines' bound PUBs."""
    topic: str = "kv@"
    workers: int = 4
    """Worker threads (in each worker process); a pod always maps to one."""
    processes: int = 1
    """Worker processes (more than 1 needs a Redis index and an ``index_factory``)."""
    queue_size: int = 10_000
    replay_port_offset: int | None = None
    """A pod without a registry replay endpoint replays at ``tcp://host:(port + offset)``."""
    replica: str | None = None
    """Run as replica NAME of several ingest processes sharing the fleet (a Redis index)."""
    every_event_endpoint: bool = False
    """Connect to every enabled registered pod's event endpoint, following the registry (a
    replica alone, ``SoloMembership``); exclusive with ``replica``."""

    @property
    def connects(self) -> bool:
        """Whether this ingest connects to engines (which CURVE needs their public key for)."""
        return bool(self.connect) or self.replica is not None or self.every_event_endpoint


def check_setup(options: IngestOptions, *, own_index: bool = False) -> EventCurve | None:
    """Check, before anything starts (no index, no socket), that ``options`` and the settings can
    run; the CURVE of the event sockets (``event_curve``: None, off). ``IngestSetupError`` names
    what to fix. ``own_index``: the index will be this process's alone."""
    if options.replica is not None and options.every_event_endpoint:
        raise IngestSetupError("a replica of several ingests holds a share of the pods, not every one")
    if options.replica is not None and (own_index or not index_is_shared()):
        raise IngestSetupError(
            "--replica needs an index the replicas share (KVCACHE_INDEX_BACKEND=redis or a "
            "redis-cluster:// URL): an in-memory index cannot hold their membership"
        )
    return event_curve(binds=bool(options.bind), connects=options.connects)


class IngestService:
    """The write path of this process, built (sockets bound, replica joined) but not started.

    ``curve``: what ``check_setup`` returned for ``options``. ``dynamo_factory`` opens the store
    the appliers record blocks in as Dynamo's indexer knows them, and ``dynamo`` is the one
    housekeeping prunes (``KVCACHE_DYNAMO_BLOCKS``; none: no records). ``own_index``: ``index`` is
    this process's alone (``--index in-process``): nothing is published for other processes
    (counters, history, live snapshots), and the registry's writes made elsewhere are followed
    into it (``ingest.follower``). ``IngestSetupError`` when the options cannot run."""

    def __init__(
        self,
        options: IngestOptions,
        *,
        index: KVIndex,
        curve: EventCurve | None = None,
        index_factory: Callable[[], KVIndex] | None = None,
        dynamo_factory: Callable[[], DynamoBlockStore | None] | None = None,
        dynamo: DynamoBlockStore | None = None,
        own_index: bool = False,
    ) -> None:
        self.options = options
        self.index = index
        self.own_index = own_index
        self.curve = curve
        self.dynamo = dynamo
        try:
            self.pipeline = IngestPipeline(
                index=index,
                config=service_config,
                bind=options.bind,
                connect=options.connect,
                topic=options.topic,
                workers=options.workers,
                queue_size=options.queue_size,
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
                    port_offset=options.replay_port_offset,
                    timeout=settings.KVCACHE_REPLAY_TIMEOUT_SECONDS,
                    curve=curve if curve is not None and curve.server_key is not None else None,
                ),
                processes=options.processes,
                index_factory=index_factory,
                dynamo_factory=dynamo_factory,
                replica=options.replica is not None or options.every_event_endpoint,
                curve=curve,
            )
        except ValueError as e:  # --processes > 1 over an in-memory index
            raise IngestSetupError(str(e)) from None
        pipeline = self.pipeline
        self.replica: Replica | None = None
        if options.replica is not None:
            self.replica = join_replica(options.replica, pipeline)
        elif options.every_event_endpoint:
            self.replica = solo_replica(pipeline)
        replica = self.replica
        self.prober = liveness_prober(
            index,
            pipeline.stats,
            foreign=(lambda: replica.holding.foreign) if options.replica is not None and replica else None,
            on_return=pipeline.pod_returned,
        )
        self.follower = (
            RegistryFollower(index=index, config=service_config, forget_pod=pipeline.forget_pod)
            if own_index
            else None
        )
        self.housekeeping: Housekeeping | None = None
        self._stopping = threading.Event()
        self._housekeeper: threading.Thread | None = None

    @property
    def stats(self) -> IngestStats:
        return self.pipeline.stats

    def start(self, *, housekeeping_seconds: float | None = None) -> None:
        """Start receiving, the membership's heartbeat, the prober and housekeeping; with
        ``housekeeping_seconds``, a thread runs housekeeping that often (else the caller calls
        ``run_housekeeping``)."""
        self.pipeline.start()
        if self.replica is not None:
            self.replica.start()
        self.housekeeping = Housekeeping(
            self.stats,
            prober=self.prober,
            forget_pod=self.pipeline.forget_pod,
            share=not self.own_index,
            follower=self.follower,
            dynamo=self.dynamo,
        )
        if housekeeping_seconds is not None:
            self._housekeeper = threading.Thread(
                target=self._housekeep, args=(housekeeping_seconds,), name="ingest-housekeeping", daemon=True
            )
            self._housekeeper.start()

    def run_housekeeping(self) -> None:
        assert self.housekeeping is not None, "start() first"
        self.housekeeping.run_once()

    def _housekeep(self, seconds: float) -> None:
        while not self._stopping.wait(seconds):
            self.run_housekeeping()

    def stop(self, *, drain_timeout: float = 30.0) -> None:
        """Stop receiving and drain the queues into the index (at most ``drain_timeout``
        seconds), leave the membership, run housekeeping a last time and stop the prober."""
        self._stopping.set()
        if self._housekeeper is not None:
            self._housekeeper.join(30)
        self.pipeline.stop(drain_timeout=drain_timeout)
        if self.replica is not None:  # after draining: the others take its pods once it wrote them
            self.replica.stop(leave=True)
        if self.housekeeping is not None:
            self.housekeeping.run_once()
            self.housekeeping.close()

    def collectors(self) -> list[Collector]:
        """Its Prometheus collectors: the event stream's counters, the prober's, the replica's."""
        found: list[Collector] = [IngestStatsCollector(self.stats)]
        if self.prober is not None:
            found.append(LivenessCollector(self.prober))
        if self.replica is not None:
            receiver = self.pipeline.receiver
            found.append(ReplicaCollector(self.replica, foreign_messages=lambda: receiver.foreign_messages))
        return found

    def describe(self) -> str:
        """Where it receives, in a line: ``bind ..., connect ..., replica NAME of N``."""
        parts = [*(f"bind {e}" for e in self.pipeline.bound), *(f"connect {e}" for e in self.options.connect)]
        if self.options.replica is not None and self.replica is not None:
            parts.append(f"replica {self.replica.name} of {len(self.replica.holding.members)}")
        if self.options.every_event_endpoint:
            parts.append("every registered event endpoint")
        return ", ".join(parts)


def event_curve(*, binds: bool, connects: bool) -> EventCurve | None:
    """CURVE on the event sockets as the ``KVCACHE_INGEST_CURVE_*`` settings say (None: off);
    ``IngestSetupError`` when a file is missing or malformed, or the settings do not cover the
    sockets: bound ones (``binds``) need the allowed keys, connected ones (``connects``:
    ``--connect``, ``--replica``, every event endpoint) the engines' public key."""
    secret_key_file = settings.KVCACHE_INGEST_CURVE_SECRET_KEY_FILE
    clients_dir = settings.KVCACHE_INGEST_CURVE_CLIENTS_DIR
    server_key_file = settings.KVCACHE_INGEST_CURVE_SERVER_KEY_FILE
    if not secret_key_file:
        if clients_dir or server_key_file:
            raise IngestSetupError(
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
        raise IngestSetupError(str(e)) from None
    return EventCurve(keys=keys, allowed=allowed or frozenset(), server_key=server_key)


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
        raise IngestSetupError(f"--replica {name}: {e}") from e
    return replica


def solo_replica(pipeline: IngestPipeline) -> Replica:
    """A replica alone (``SoloMembership``): ``pipeline`` holds every enabled pod with an event
    endpoint, as the registry has them from one heartbeat to the next; joined, not started."""
    replica = Replica(
        name=SOLO_REPLICA,
        store=SoloMembership(),
        config=service_config,
        on_change=lambda holding: pipeline.hold(holding.held, foreign=holding.foreign),
    )
    replica.join()
    return replica


class Housekeeping:
    """Once a second: record pods seen since last time, delete the unregistered pods the receiver
    evicted (their rows and blocks), follow the registry into an index of this process's own
    (``follower``), publish the counters (with ``share``: into Redis, and to the channel-layer
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
        share: bool = True,
        follower: RegistryFollower | None = None,
        dynamo: DynamoBlockStore | None = None,
    ) -> None:
        self.stats = stats
        self.dynamo = dynamo
        self._next_prune = time.monotonic() + DYNAMO_PRUNE_SECONDS
        self._pruning: threading.Thread | None = None
        self.prober = prober
        self.forget_pod = forget_pod or stats.forget_pod
        self.follower = follower
        self._registered: dict[str, float] = {}
        self._next_expiry = float("-inf")  # monotonic
        self._trim = _malloc_trim()
        self._next_trim = time.monotonic() + TRIM_INTERVAL_SECONDS
        self._learned_groups: dict = {}
        self._instance = instance_id()
        self._redis = redis.Redis.from_url(settings.REDIS_URL) if share and index_is_shared() else None
        self._channel_layer = get_channel_layer() if share else None
        self._history = HistoryRecorder()
        if prober is not None:
            prober.start()

    def run_once(self) -> None:
        steps = [
            (self._forget_evicted, "delete the evicted unregistered pods"),
            (self._register_pods, "update the pod registry"),
            (self._expire_pods, "expire pods"),
            (self._record_learned_groups, "record the KV-cache groups learned from events"),
        ]
        if self.follower is not None:  # first: a pod it forgets is not registered again from old events
            steps.insert(0, (self.follower.run_once, "follow the registry's changes into this index"))
        for step, what in steps:
            try:
                step()
            except Exception:  # one failing step must not keep the others from running
                log.exception("could not %s", what)
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
