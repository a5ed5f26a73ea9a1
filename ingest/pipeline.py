"""The whole write path in one object: SUB sockets -> shard pool -> one applier per worker ->
index. The ``ingest`` command, the tests and ``bench/ingest.py`` all run this same pipeline.

With ``processes=N`` (N > 1, Redis backends) the shard workers run in N worker processes
(``ingest.processes``): this process keeps the SUB sockets, the epochs and catch-ups and the
merged stats, and each worker process opens its own index through ``index_factory``.

Garbage collection: an in-memory index holds millions of long-lived objects, and CPython's full
collections traverse all of them (hundreds of milliseconds, stalling every worker). So once a
second the pipeline collects what the last second left (short: only young objects are
traversed) and then freezes the survivors out of the collector's reach (``gc.freeze``). Frozen
objects are still freed by reference counting when the index drops them; only a cycle formed
among them later would outlive its use, and the index's structures form none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import zmq

from ingest.applier import CACHED_BLOCKS_PER_PROCESS, EventApplier, holder_id
from ingest.curve import EventCurve
from ingest.events import DEFAULT_LIMITS, DecodeLimits
from ingest.pool import DEFAULT_ADMISSION, Admission, Adopt, DecodingHandler, Receiver, ShardPool
from ingest.processes import ProcessShardPool, ReplaySettings, refuse_memory_index
from ingest.replay import ReplayClient, ReplayFailed
from ingest.resync import CatchUp, Fetched
from ingest.stats import IngestStats
from kvindex import IndexUnavailable, KVIndex
from kvindex.dynamo import DynamoBlockStore
from kvindex.epochs import READY, RESYNCING, marker, new_token, parse_marker
from registry.config import DP_RANK_SEPARATOR, ServiceConfig

log = logging.getLogger(__name__)

EPOCH_CHECK_SECONDS = 0.5
"""How often ingest looks at the index's epoch markers (a lost index is noticed within this)."""

REPLAY_FETCHERS = 16
"""Threads that read catch-up replays at once (each one waits at most the replay timeout)."""

SUBSCRIBED_SECONDS = 2.0
"""When the start-up catch-up runs again. An engine's PUB drops what it sends until ingest's
subscription has reached it (ZeroMQ reconnects every 100 ms), so a batch sent right after the
first catch-up can be lost; if the engine then goes idle, no later batch would reveal the gap."""


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
        admission: Admission = DEFAULT_ADMISSION,
        replay: ReplayClient | None = None,
        epoch_check_seconds: float | None = EPOCH_CHECK_SECONDS,
        processes: int = 1,
        index_factory: Callable[[], KVIndex] | None = None,
        dynamo_factory: Callable[[], DynamoBlockStore | None] | None = None,
        replica: bool = False,
        curve: EventCurve | None = None,
    ) -> None:
        """``processes`` > 1 runs ``workers`` threads in each of that many worker processes;
        then ``index_factory`` (picklable: a worker process calls it to open its own handle on
        ``index``) is required, and an in-memory ``index`` is refused (``ValueError``).
        ``curve``: the SUB sockets speak CURVE (``ingest.curve``); with ``bind``, a ZAP handler
        on ``context`` admits the allowed keys from before the sockets bind until ``stop``.
        ``dynamo_factory`` (picklable too): opens the store the appliers record blocks in as
        Dynamo's indexer knows them (``kvindex.dynamo``; none without it)."""
        if processes > 1:
            refuse_memory_index(index)
            if index_factory is None:
                raise ValueError("processes > 1 needs an index_factory for the worker processes")
        self.stats = stats or IngestStats()
        self.index = index
        self.dynamo = dynamo_factory() if dynamo_factory is not None and processes <= 1 else None
        self.config = config
        self.replay = replay
        self._gc_freeze_seconds = gc_freeze_seconds
        self._epoch_check_seconds = epoch_check_seconds
        self._stopped = threading.Event()
        self.appliers: list[EventApplier] = []
        self.handlers: list[DecodingHandler] = []
        # What the index says was applied of each engine: where catch-ups and gap checks start.
        self.progress = index.progress()
        self._epochs: dict[str, str] = {}  # model -> the token of the data this process indexed
        self._pending: dict[str, int] = {}  # model -> catch-ups before its marker says ready
        self._epoch_lock = threading.Lock()
        self._fetchers = (
            ThreadPoolExecutor(REPLAY_FETCHERS, thread_name_prefix="ingest-replay") if replay else None
        )
        # Replica mode (``hold``): the pods this process holds, and those another replica does.
        self.replica = replica
        self._held: frozenset[str] = frozenset()
        self._foreign: frozenset[str] = frozenset()
        self._hold_lock = threading.Lock()
        self._started = False

        def handler_factory(_worker: int):
            budget = CACHED_BLOCKS_PER_PROCESS // workers
            applier = EventApplier(
                index, config=config, stats=self.stats, cache_budget=budget, dynamo=self.dynamo
            )
            self.appliers.append(applier)
            handler = DecodingHandler(applier, self.stats, limits, replay=replay, progress=self.progress)
            self.handlers.append(handler)
            return handler

        self.pool: ShardPool | ProcessShardPool
        if processes > 1:
            assert index_factory is not None
            self.pool = ProcessShardPool(
                processes=processes,
                threads=workers,
                queue_size=queue_size,
                stats=self.stats,
                config=config,
                index_factory=index_factory,
                dynamo_factory=dynamo_factory,
                limits=limits,
                replay=ReplaySettings.of(replay) if replay else None,
                gc_freeze_seconds=gc_freeze_seconds,
                on_restart=self._catch_up_process,
            )
        else:
            self.pool = ShardPool(
                workers=workers, handler_factory=handler_factory, queue_size=queue_size, stats=self.stats
            )
        context = context or zmq.Context.instance()
        self._authenticator = curve.start_authenticator(context) if curve is not None and bind else None
        try:
            self.receiver = Receiver(
                pool=self.pool,
                stats=self.stats,
                bind=bind,
                connect=connect,
                topic=topic,
                context=context,
                limits=limits,
                managed_connect=replica,
                config=config,
                admission=admission,
                on_evict=self._evicted,
                curve=curve,
            )
        except BaseException:
            self._stop_authenticator()
            raise
        self._thread = threading.Thread(target=self.receiver.run, name="ingest-receiver", daemon=True)

    @property
    def bound(self) -> list[str]:
        """The endpoints actually bound (with the port chosen for ``tcp://...:*``)."""
        return self.receiver.bound

    def start(self) -> None:
        """Start receiving; first queue a catch-up of every engine that can replay (what it
        sent while ingest was down), and mark the models whose index data is missing."""
        with self._hold_lock:
            self._started = True
        self.pool.start()
        self._start_epochs()
        self._thread.start()
        if self._gc_freeze_seconds:
            threading.Thread(target=self._freeze_survivors, name="ingest-gc", daemon=True).start()
        if self._epoch_check_seconds:
            threading.Thread(target=self._watch_epochs, name="ingest-epochs", daemon=True).start()
        threading.Thread(target=self._catch_up_once_subscribed, name="ingest-catch-up", daemon=True).start()

    def engines(self, model: str | None = None) -> list[tuple[str, str, int]]:
        """``(pod, model, rank)`` of every engine this process knows: registered pods (rank 0),
        engines with recorded progress and engines it received from; disabled pods left out."""
        config = self.config()
        found = {(pod, m, 0) for pod, m in config.pods.items()}
        for m, holder in self.progress:
            pod, _, rank = holder.partition(DP_RANK_SEPARATOR)
            found.add((pod, m, int(rank) if rank.isdigit() else 0))
        found.update((s.pod, s.model, s.rank) for s in self.stats.streams())
        if self.replica:
            heard = {s.pod for s in self.stats.streams()}
            found = {e for e in found if self._indexes(e[0], heard)}
        return sorted(
            e for e in found if (model is None or e[1] == model) and e[0] not in config.disabled_pods
        )

    def check_epochs(self) -> list[str]:
        """Compare the index's epoch markers with what this process indexed; a model whose
        marker vanished (or was replaced) lost its data: mark it resyncing and replay every
        engine of it from seq 0. Returns the models found lost."""
        with self._epoch_lock:
            models = sorted({m for _, m, _ in self.engines()} | set(self._epochs))
        values = self.index.epochs(models)
        lost = []
        for model, value in zip(models, values, strict=True):
            parsed = parse_marker(value)
            with self._epoch_lock:
                mine = self._epochs.get(model)
                if mine is None:  # a model new to this process
                    if parsed is None:
                        self._claim(model, READY)
                    else:
                        self._epochs[model] = parsed[0]
                    continue
                if parsed is not None and parsed[0] == mine:
                    if parsed[1] == RESYNCING and not self._pending.get(model):
                        self.index.set_epoch(model=model, value=marker(mine, READY))  # a retry
                    continue
                self.stats.index_losses += 1
                lost.append(model)
                self._claim(model, RESYNCING)
            log.warning("the index lost the data of %s: replaying every engine of it", model)
            self._catch_up(model, lost=True)
        return lost

    def resyncing(self) -> list[str]:
        """Models this process is rebuilding (their catch-ups still run)."""
        with self._epoch_lock:
            return sorted(m for m, n in self._pending.items() if n)

    def _start_epochs(self) -> None:
        """On start: models without a marker have no data here (new, or lost while ingest was
        down) and are marked resyncing until their catch-ups ran; every engine is caught up."""
        with self._epoch_lock:
            models = sorted({m for _, m, _ in self.engines()})
        for model, value in zip(models, self.index.epochs(models), strict=True):
            parsed = parse_marker(value)
            with self._epoch_lock:
                if parsed is None:
                    self._claim(model, RESYNCING)
                else:
                    self._epochs[model] = parsed[0]
            self._catch_up(model, lost=False)

    def _claim(self, model: str, state: str) -> None:
        """Write a new marker for ``model`` unless another process wrote one first (then that
        one is adopted). Caller holds ``_epoch_lock``."""
        token = new_token()
        if self.index.set_epoch(model=model, value=marker(token, state), if_absent=True):
            self._epochs[model] = token
            return
        parsed = parse_marker(self.index.epochs([model])[0])
        self._epochs[model] = parsed[0] if parsed else token

    def _catch_up_process(self, process: int) -> None:
        """Worker process ``process`` was restarted: catch up every engine of its pods (from
        the seqs the index records), as on start."""
        assert isinstance(self.pool, ProcessShardPool)
        pool = self.pool
        for model in sorted({m for _, m, _ in self.engines()}):
            self._catch_up(model, lost=False, pods=lambda pod: pool.shard(pod) == process)

    def _catch_up(self, model: str, *, lost: bool, pods: Callable[[str], bool] | None = None) -> None:
        """Queue a catch-up of every engine of ``model`` (of the ``pods`` it names, if given);
        once all ran, a marker of this process that says resyncing says ready. The replays are
        read by a pool of threads first (from the seq the index records, or 0), all at once:
        engines that do not answer cost their timeout there, not the shard workers."""
        engines = [e for e in self.engines(model) if pods is None or pods(e[0])]
        if not lost:
            config = self.config()
            engines = [e for e in engines if e[0] not in config.down_pods]
        with self._epoch_lock:
            self._pending[model] = self._pending.get(model, 0) + len(engines) + 1
        recorded: dict[tuple[str, str], int] = {}
        if not lost:
            with contextlib.suppress(IndexUnavailable):  # then read from 0: the same, longer
                recorded = self.index.progress(model=model)
        for pod, _, rank in engines:
            item = CatchUp(pod, model, rank, lost=lost, done=lambda m=model: self._caught_up(m))
            if self._fetchers is None:
                self.pool.submit(item)
                continue
            seq = recorded.get((model, holder_id(pod, rank)))
            self._fetchers.submit(self._fetch_then_queue, item, 0 if seq is None else seq + 1)
        self._caught_up(model)  # the +1: marks ready at once when there was nothing to catch up

    def _fetch_then_queue(self, item: CatchUp, start: int) -> None:
        fetched = None
        try:
            assert self.replay is not None
            fetched = Fetched(start, self.replay.fetch(item.pod, item.rank, start))
        except ReplayFailed as e:
            fetched = Fetched(start, [], e.with_traceback(None))  # kept: no cycle through this frame
        except Exception:
            log.exception("reading the replay of %s failed; its worker asks again", item.pod)
        self.pool.submit(dataclasses.replace(item, fetched=fetched))

    def _caught_up(self, model: str) -> None:
        with self._epoch_lock:
            self._pending[model] -= 1
            if self._pending[model]:
                return
            token = self._epochs.get(model)
        try:
            parsed = parse_marker(self.index.epochs([model])[0])
            if parsed == (token, RESYNCING):
                self.index.set_epoch(model=model, value=marker(token, READY))
                log.info("the index data of %s is rebuilt", model)
        except IndexUnavailable as e:
            log.warning("could not mark %s ready: %s (the next check retries)", model, e)

    def _catch_up_once_subscribed(self) -> None:
        if self._stopped.wait(SUBSCRIBED_SECONDS):
            return
        for model in sorted({m for _, m, _ in self.engines()}):
            self._catch_up(model, lost=False)

    def _watch_epochs(self) -> None:
        while not self._stopped.wait(self._epoch_check_seconds):
            try:
                self.check_epochs()
            except IndexUnavailable as e:
                log.warning("could not check the index's epoch markers: %s", e)
            except Exception:
                log.exception("checking the index's epoch markers failed")

    def stop(self, *, drain_timeout: float = 30.0) -> None:
        """Stop receiving, let every worker finish its queue, then return."""
        self.receiver.stop()
        self._stopped.set()
        self._thread.join(5)
        self._stop_authenticator()  # after the receiver closed the sockets it answered for
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=False, cancel_futures=True)
        self.pool.drain_and_stop(drain_timeout)

    def _stop_authenticator(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    def _freeze_survivors(self) -> None:
        while not self._stopped.wait(self._gc_freeze_seconds):
            gc.collect()
            gc.freeze()

    # -- replica mode: the pods this process holds (``ingest.membership``) -------------------------

    def hold(self, held: Mapping[str, str], *, foreign: Collection[str]) -> None:
        """Index exactly the ``held`` pods (pod -> the endpoint its engine's PUB binds) of those
        the replicas share out, and ignore the messages of the ``foreign`` ones (another replica
        holds them). The receiver connects to the held endpoints (and drops the others) within a
        poll. A pod newly held was indexed by another replica (or by none) until now: its worker
        first adopts the seq the index records of each of its engines (queued before the pod's
        first live message), then the engines are caught up from there through their replay
        endpoints, once at once and once more ``SUBSCRIBED_SECONDS`` later (what an engine sent
        before the new subscription reached it). Pods without an event endpoint are received
        as without replicas (``bind``)."""
        with self._hold_lock:
            if self._stopped.is_set():
                return
            taken = sorted(set(held) - self._held)
            self._held, self._foreign = frozenset(held), frozenset(foreign)
            recorded = self._adopt(taken) if self._started and taken else None
            self.receiver.set_connected(set(held.values()), foreign=self._foreign)
        if recorded is not None:
            self._catch_up_taken(recorded)
            threading.Thread(
                target=self._catch_up_taken_once_subscribed, args=(taken,), name="ingest-take", daemon=True
            ).start()

    def _indexes(self, pod: str, heard: Collection[str]) -> bool:
        """Replica mode: whether this process indexes ``pod``'s engines (catch-ups, epochs): a
        pod it holds, or a pod no replica holds (no event endpoint) that it has ``heard`` from."""
        return pod in self._held or (pod not in self._foreign and pod in heard)

    def _adopt(self, pods: Collection[str]) -> dict[tuple[str, str, int], int | None]:
        """Queue an ``Adopt`` for every engine of ``pods`` with the seq the index records (none
        when the index cannot say: the workers then go on from what they remember); returns
        ``(pod, model, rank) -> recorded seq`` of the engines."""
        engines = {e for e in self.engines() if e[0] in pods}
        try:
            recorded = self.index.progress()
        except IndexUnavailable as e:
            log.warning("could not read where the pods taken over stand (%s): they catch up from memory", e)
            return dict.fromkeys(engines)
        for m, holder in recorded:
            pod, _, rank = holder.partition(DP_RANK_SEPARATOR)
            if pod in pods:
                engines.add((pod, m, int(rank) if rank.isdigit() else 0))
        out = {}
        for pod, model, rank in sorted(engines):
            seq = out[(pod, model, rank)] = recorded.get((model, holder_id(pod, rank)))
            self.pool.submit(Adopt(pod, model, rank, recorded=seq))
        return out

    def _catch_up_taken(self, engines: Mapping[tuple[str, str, int], int | None]) -> None:
        """Catch ``engines`` up from their recorded seqs (+1), the replays read by the fetchers."""
        for (pod, model, rank), seq in engines.items():
            item = CatchUp(pod, model, rank)
            if self._fetchers is None:
                self.pool.submit(item)
                continue
            with contextlib.suppress(RuntimeError):  # the pipeline stopped meanwhile
                self._fetchers.submit(self._fetch_then_queue, item, 0 if seq is None else seq + 1)

    def _catch_up_taken_once_subscribed(self, pods: list[str]) -> None:
        if self._stopped.wait(SUBSCRIBED_SECONDS):
            return
        with self._hold_lock:
            pods = [pod for pod in pods if pod in self._held]
        recorded: dict[tuple[str, str], int] = {}
        with contextlib.suppress(IndexUnavailable):  # then read from 0: the same, longer
            recorded = self.index.progress()
        self._catch_up_taken(
            {(p, m, r): recorded.get((m, holder_id(p, r))) for p, m, r in self.engines() if p in pods}
        )

    def pod_returned(self, pod: str) -> None:
        """``pod`` answers its health probes again after being down: each of its engines is
        checked for a restart meanwhile, before it sends (``ingest.resync``, ``returned``)."""
        for p, model, rank in self.engines():
            if p == pod:
                self.pool.submit(CatchUp(pod, model, rank, returned=True))

    def forget_pod(self, pod: str) -> None:
        """Drop per-pod state everywhere (the pod was disabled, deleted or expired): it no longer
        holds a place in the receiver either."""
        self._forget_workers(pod)
        self.receiver.forget_pod(pod)
        self.stats.forget_pod(pod)

    def _evicted(self, pod: str) -> None:
        """An unregistered pod gave its place in the receiver (``Admission``): what the workers
        remember of it goes, and housekeeping deletes its registry row and its blocks."""
        self._forget_workers(pod)
        self.stats.evicted(pod)

    def _forget_workers(self, pod: str) -> None:
        for handler in self.handlers:
            handler.forget(pod)
        self.pool.forget_pod(pod)
