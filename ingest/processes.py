"""``ingest --processes N``: the shard workers as N processes, so that decoding, keying and
index writes use every core (one ingest process is bound by the GIL: its worker threads only
overlap index round trips). Redis backends only: the in-memory index lives in one process.

The main process keeps what must be in one place: the SUB sockets and the framing checks
(``Receiver``), the epoch markers and catch-up coordination (``IngestPipeline``), the merged
stats and housekeeping. It hands each pod's raw messages, in parcels, to process
``fnv1a_32(pod) % N`` (the rule threads shard by), which runs a ``ShardPool`` of worker threads
with their own appliers, stream keepers (seqs, gaps and replays, ``ingest.resync``) and index
connection, exactly as one ingest process does.

Channels, ZeroMQ over ``ipc://`` in a private temporary directory:

* main -> process p: a PUSH connected to p's bound PULL, carrying in order parcels of raw
  messages (one msgpack frame: pod, model, seq, payload and received time of each, nothing
  decoded), catch-ups (with their replays when read ahead), registry snapshots (a
  ``ServiceConfig``, sent when it changes), forgotten pods, idle marks and stop. One ordered
  channel per process keeps a pod's messages and catch-ups in order. The main process connects,
  so what is queued for a process that dies waits for its successor. A process that falls
  behind fills its bounded queues, then the hand-off's high-water mark (``queue_size``
  messages), and receiving waits (counted as ``queue_full`` of ``p<p>``), as with threads;
  only while the process is being restarted is a full hand-off dropped instead (logged): those
  batches are seq gaps its successor replays.
* processes -> main: one PULL bound by the main process: ``ready``, then every
  ``STATS_SECONDS`` a report: the stats delta (``ingest.stats.StatsShipper``), the catch-ups
  done (their callbacks run in the main process) and the last idle mark reached.

A process that dies is noticed (its sentinel) and started again: its catch-ups in flight are
sent again, and every engine of its pods is caught up (``on_restart``: ``IngestPipeline``
queues the catch-ups, as on start); the successor reads the recorded seqs from the index, and
the stream-keeping rules rebuild the rest (replay, or clear and resync until it stores again).

What lags in the main process: the streams' counters and gauges, the event-to-index latencies
and the workers' own ``queue_full`` counts arrive within ``STATS_SECONDS`` (plus a report's
transit); a process that dies loses what it counted after its last report. Registry snapshots
reach the workers within ``CONFIG_PUSH_SECONDS`` of the main process loading them.

Workers are spawned (no fork: ZeroMQ contexts and threads do not survive one), import no
Django (the registry snapshot comes from the main process) and leave stopping to the main
process, which tells them once they drained: a Ctrl-C or a SIGTERM sent to the whole process
group (``python -m stack`` does) reaches them too. They ignore SIGINT; after a SIGTERM a worker
exits on its own if no stop follows within ``SIGTERM_GRACE_SECONDS`` (a main process exiting
without stopping them terminates them, and waits for that). A worker whose main process is gone
exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq

from ingest.applier import CACHED_BLOCKS_PER_PROCESS, EventApplier
from ingest.curve import EventCurve
from ingest.events import DEFAULT_LIMITS, DecodeLimits
from ingest.pool import MAX_MESSAGES_PER_FLUSH, Adopt, DecodingHandler, Received, ShardPool, fnv1a_32
from ingest.ratelimit import RateLimitedLog
from ingest.replay import ReplayClient, ReplayFailed
from ingest.resync import CatchUp, Fetched
from ingest.stats import IngestStats, StatsShipper, merge_stats
from kvindex import IndexUnavailable, KVIndex, MemoryIndex
from kvindex.dynamo import DynamoBlockStore
from registry.config import ServiceConfig

log = logging.getLogger(__name__)
DROP_LOG = RateLimitedLog(log)

STATS_SECONDS = 0.25
"""How often a worker process reports its stats delta (what the main process's figures lag by)."""

CONFIG_PUSH_SECONDS = 0.5
"""How often the main process looks for a new registry snapshot to send to its workers."""

READY_TIMEOUT_SECONDS = 60.0
"""How long a worker process may take to start (imports, the index's first answer)."""

RESTART_BACKOFF_SECONDS = (0.5, 10.0)
"""Wait before starting a dead worker process again: the first, doubling to the second while
its successors die young (within ``STABLE_SECONDS``)."""

STABLE_SECONDS = 10.0

SIGTERM_GRACE_SECONDS = 5.0
"""How long a worker process waits after a SIGTERM for its main process's stop."""

FEED_BURST = 16
"""Hand-offs a worker process reads before it passes on what it holds of them (a pod's partial
parcel waits at most that many)."""

_MESSAGES = b"m"
_CATCH_UP = b"c"
_CONFIG = b"cfg"
_FORGET = b"forget"
_MARK = b"mark"
_STOP = b"stop"
_READY = b"ready"
_REPORT = b"report"
_STOPPED = b"stopped"


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """What a worker process needs to build its own ``ReplayClient`` (the registry's endpoints
    come with the snapshot)."""

    port_offset: int | None
    timeout: float
    max_batches: int
    max_bytes: int
    curve: EventCurve | None = None

    @classmethod
    def of(cls, client: ReplayClient) -> ReplaySettings:
        return cls(client.port_offset, client.timeout, client.max_batches, client.max_bytes, client.curve)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process starts from (pickled to it by ``spawn``)."""

    process: int
    processes: int
    incarnation: int
    inbox: str  # the endpoint it binds and reads its work from
    outbox: str  # the endpoint it reports to
    index_factory: Callable[[], KVIndex]
    dynamo_factory: Callable[[], DynamoBlockStore | None] | None
    config: ServiceConfig
    threads: int
    queue_size: int
    limits: DecodeLimits
    replay: ReplaySettings | None
    gc_freeze_seconds: float | None
    stats_seconds: float
    log_level: int
    parent_pid: int


def refuse_memory_index(index: KVIndex) -> None:
    """Raise ``ValueError`` (one line, for the command to show) when ``index`` lives in this
    process: worker processes could not share it."""
    if isinstance(index, MemoryIndex):
        raise ValueError(
            "--processes > 1 needs a Redis index (KVCACHE_INDEX_BACKEND=redis or redis-cluster://): "
            "the in-memory index lives in one process"
        )


class ProcessShardPool:
    """``processes`` worker processes, each with ``threads`` worker threads; the pool the
    receiver and the pipeline hand work to when ingest runs several processes (the same calls
    as ``ShardPool``: ``shard``, ``submit``, ``submit_parcel``, ``join_idle``, ``start``,
    ``drain_and_stop``). Thread-safe: each process's channel has a lock."""

    def __init__(
        self,
        *,
        processes: int,
        threads: int,
        queue_size: int,
        stats: IngestStats,
        config: Callable[[], ServiceConfig],
        index_factory: Callable[[], KVIndex],
        dynamo_factory: Callable[[], DynamoBlockStore | None] | None = None,
        limits: DecodeLimits = DEFAULT_LIMITS,
        replay: ReplaySettings | None = None,
        gc_freeze_seconds: float | None = 1.0,
        stats_seconds: float = STATS_SECONDS,
        on_restart: Callable[[int], None] | None = None,
    ) -> None:
        if processes < 2:
            raise ValueError("a process pool needs at least 2 processes")
        if threads < 1:
            raise ValueError("workers must be at least 1")
        self.processes = processes
        self.stats = stats
        self.config = config
        self.on_restart = on_restart
        self._spec = functools.partial(
            WorkerSpec,
            processes=processes,
            index_factory=index_factory,
            dynamo_factory=dynamo_factory,
            threads=threads,
            queue_size=queue_size,
            limits=limits,
            replay=replay,
            gc_freeze_seconds=gc_freeze_seconds,
            stats_seconds=stats_seconds,
            parent_pid=os.getpid(),
        )
        self._mp = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="kvingest-")
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)  # also when not stopped
        self._context = zmq.Context()
        self._reports = self._context.socket(zmq.PULL)
        self._reports.setsockopt(zmq.LINGER, 0)
        self._outbox = f"ipc://{self._dir}/reports"
        self._reports.bind(self._outbox)
        # The hand-off holds about queue_size messages: half on each side of the channel.
        self._hwm = max(2, queue_size // MAX_MESSAGES_PER_FLUSH // 2)
        self._inboxes: list[zmq.Socket] = []
        for p in range(processes):
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 20)
            sock.connect(self._inbox(p))
            self._inboxes.append(sock)
        self._locks = [threading.Lock() for _ in range(processes)]
        self._procs: list = [None] * processes
        self._incarnations = [0] * processes
        self._started_at = [0.0] * processes
        self._ready = [threading.Event() for _ in range(processes)]
        self._stopped = [threading.Event() for _ in range(processes)]
        self._up = [False] * processes
        self.restarts = [0] * processes
        self.dropped = [0] * processes  # messages dropped while their process was restarting
        self._config_sent: list[ServiceConfig | None] = [None] * processes
        self._catch_ups: dict[int, tuple[int, CatchUp]] = {}  # id -> (process, item), until done
        self._catch_up_ids = itertools.count(1)
        self._state_lock = threading.Lock()  # guards _catch_ups, _forgotten, the marks
        self._forgotten: dict[str, tuple[int, int]] = {}  # pod -> (process, number of its forget)
        self._forgets_sent = [0] * processes
        self._marks_sent = [0] * processes
        self._marks_reached = [0] * processes
        self._shard_of: dict[str, int] = {}
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._give_up_at = float("inf")
        self._last_full_log = 0.0
        self._threads = [
            threading.Thread(target=self._read_reports, name="ingest-reports", daemon=True),
            threading.Thread(target=self._watch, name="ingest-processes", daemon=True),
            threading.Thread(target=self._push_config, name="ingest-config", daemon=True),
        ]

    def _inbox(self, process: int) -> str:
        return f"ipc://{self._dir}/in-{process}"

    # -- the calls of a ShardPool ---------------------------------------------------------------

    def start(self) -> None:
        """Start every worker process and wait until each is ready (raises ``RuntimeError``
        when one exits first or takes longer than ``READY_TIMEOUT_SECONDS``)."""
        self._threads[0].start()
        for p in range(self.processes):
            self._spawn(p)
        for p in range(self.processes):
            if not self._await_ready(p, READY_TIMEOUT_SECONDS):
                code = self._procs[p].exitcode
                self.drain_and_stop(1.0)
                raise RuntimeError(f"ingest worker process {p} did not start (exit code {code})")
            self._up[p] = True
        for thread in self._threads[1:]:
            thread.start()

    def shard(self, pod: str) -> int:
        found = self._shard_of.get(pod)
        if found is None:
            found = self._shard_of[pod] = fnv1a_32(pod.encode()) % self.processes
        return found

    def submit(self, item: Received | CatchUp) -> None:
        """Queue one message or catch-up (or ``Adopt``) for its pod's process. A catch-up with
        a ``done`` is kept until its process says it is done (then ``done`` runs here), and sent
        again if that process dies first; the others need not be: a restarted process reads the
        recorded seqs from the index, and all its engines are caught up."""
        process = self.shard(item.pod)
        if isinstance(item, Received):
            self.submit_parcel(process, [item])
            return
        number = 0
        if item.done is not None:
            with self._state_lock:
                number = next(self._catch_up_ids)
                self._catch_ups[number] = (process, item)
        self._send_catch_up(process, number, item)

    def submit_parcel(self, worker: int, items: list[Received | CatchUp]) -> None:
        """Queue ``items`` (of pods that shard to process ``worker``) as one hand-off: their
        raw payloads in one frame. Waits (and says so) when that process is behind."""
        if any(isinstance(item, CatchUp) for item in items):
            for item in items:
                self.submit(item)
            return
        body = msgpack.packb([(m.pod, m.model, m.seq, m.payload, m.received_at) for m in items])
        if not self._send(worker, [_MESSAGES, body]):
            self.dropped[worker] += len(items)
            DROP_LOG.warning(
                "restarting",
                "ingest worker process %d is restarting and its hand-off is full: dropped %d messages "
                "(%d so far; its successor replays them as seq gaps)",
                worker,
                len(items),
                self.dropped[worker],
            )

    def forget_pod(self, pod: str) -> None:
        """Drop what ``pod``'s process remembers of it (the pod was disabled, deleted or evicted)."""
        process = self.shard(pod)
        self._shard_of.pop(pod, None)
        with self._state_lock:
            self._forgets_sent[process] += 1
            number = self._forgets_sent[process]
            self._forgotten[pod] = (process, number)
        self._send(process, [_FORGET, msgpack.packb([number, pod])])

    def join_idle(self, timeout: float) -> None:
        """Wait until every process has handled what was queued for it so far, and reported
        the counts (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        wanted = []
        for p in range(self.processes):
            with self._state_lock:
                self._marks_sent[p] += 1
                mark = self._marks_sent[p]
            self._send(p, [_MARK, str(mark).encode()])
            wanted.append(mark)
        while any(self._marks_reached[p] < mark for p, mark in enumerate(wanted)):
            if time.monotonic() > deadline:
                raise TimeoutError("ingest worker processes did not become idle")
            time.sleep(0.002)

    def drain_and_stop(self, timeout: float = 30.0) -> None:
        """Let every process finish what is queued for it and report, then stop it; what is
        still running at the deadline is killed."""
        deadline = time.monotonic() + timeout
        self._give_up_at = deadline
        self._stopping.set()
        for p in range(self.processes):
            if self._procs[p] is not None and self._procs[p].is_alive():
                remaining = max(0.0, deadline - time.monotonic())
                self._send(p, [_STOP, f"{remaining:.3f}".encode()])
        for p, proc in enumerate(self._procs):
            if proc is None:
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("ingest worker process %d did not stop in time: killed", p)
                proc.kill()
                proc.join(5)
            else:
                self._stopped[p].wait(max(0.0, min(1.0, deadline - time.monotonic())))  # its last report
        self._closed.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5)
        for lock, sock in zip(self._locks, self._inboxes, strict=True):
            with lock:  # a sender gives up within a poll (100 ms) once closed
                sock.close(0)
        self._reports.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- processes ------------------------------------------------------------------------------

    def pid(self, process: int) -> int | None:
        """The pid of worker process ``process`` (None before it started)."""
        proc = self._procs[process]
        return None if proc is None else proc.pid

    def _spawn(self, p: int) -> None:
        self._incarnations[p] += 1
        self._ready[p].clear()
        self._stopped[p].clear()
        config = self.config()
        spec = self._spec(
            process=p,
            incarnation=self._incarnations[p],
            inbox=self._inbox(p),
            outbox=self._outbox,
            config=config,
            log_level=logging.getLogger("ingest").getEffectiveLevel(),
        )
        proc = self._mp.Process(target=run_worker, args=(spec,), name=f"ingest-process-{p}", daemon=True)
        proc.start()
        self._procs[p] = proc
        self._started_at[p] = time.monotonic()
        self._config_sent[p] = config

    def _await_ready(self, p: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._ready[p].wait(0.05):
            if not self._procs[p].is_alive() or time.monotonic() > deadline or self._stopping.is_set():
                return self._ready[p].is_set()
        return True

    def _watch(self) -> None:
        """Notice a worker process that died, and start it again (not while stopping)."""
        while not self._stopping.is_set():
            sentinels = {proc.sentinel: p for p, proc in enumerate(self._procs) if proc is not None}
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.2):
                if self._stopping.is_set():
                    return
                self._restart(sentinels[sentinel])

    def _restart(self, p: int) -> None:
        self._up[p] = False
        self.restarts[p] += 1
        proc = self._procs[p]
        proc.join()
        young = time.monotonic() - self._started_at[p] < STABLE_SECONDS
        log.error(
            "ingest worker process %d (pid %s) died (exit code %s): starting it again, and catching "
            "up its pods",
            p,
            proc.pid,
            proc.exitcode,
        )
        first, most = RESTART_BACKOFF_SECONDS
        backoff = first if not young else min(most, first * 2 ** min(self.restarts[p], 5))
        while not self._stopping.wait(backoff):
            self._spawn(p)
            if self._await_ready(p, READY_TIMEOUT_SECONDS):
                break
            log.error("ingest worker process %d did not start (exit code %s)", p, self._procs[p].exitcode)
            self._procs[p].kill()
            self._procs[p].join(5)
            backoff = min(most, backoff * 2)
        if self._stopping.is_set():
            return
        self._up[p] = True
        log.info("ingest worker process %d is back (pid %s)", p, self._procs[p].pid)
        with self._state_lock:
            again = sorted((n, item) for n, (q, item) in self._catch_ups.items() if q == p)
            # The new process knows nothing of the pods forgotten before: none of its stats to skip.
            self._forgotten = {pod: f for pod, f in self._forgotten.items() if f[0] != p}
        for number, item in again:
            self._send_catch_up(p, number, item)
        if self.on_restart is not None:
            try:
                self.on_restart(p)
            except Exception:
                log.exception("catching up the pods of ingest worker process %d failed", p)

    # -- channels -------------------------------------------------------------------------------

    def _send(self, p: int, frames: list[bytes]) -> bool:
        """Send ``frames`` to process ``p``, waiting while its hand-off is full; False (not
        sent) when it is full while the process is being restarted, or past the stop deadline."""
        sock = self._inboxes[p]
        with self._locks[p]:
            if self._closed.is_set():
                return False
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
            self.stats.queue_full[f"p{p}"] += 1
            now = time.monotonic()
            if now - self._last_full_log > 5 and self._up[p]:
                self._last_full_log = now
                log.warning(
                    "ingest worker process %d is behind: its hand-off (%d messages) is full; receiving waits",
                    p,
                    2 * self._hwm * MAX_MESSAGES_PER_FLUSH,
                )
            while True:
                if sock.poll(100, zmq.POLLOUT):
                    try:
                        sock.send_multipart(frames, zmq.NOBLOCK)
                        return True
                    except zmq.Again:
                        continue
                if not self._up[p] or time.monotonic() > self._give_up_at or self._closed.is_set():
                    return False

    def _send_catch_up(self, p: int, number: int, item: CatchUp) -> None:
        fetched = item.fetched
        body = msgpack.packb(
            [
                number,
                item.pod,
                item.model,
                item.rank,
                item.lost,
                None
                if fetched is None
                else [
                    fetched.start,
                    fetched.batches,
                    fetched.failure.reason if fetched.failure else None,
                    str(fetched.failure) if fetched.failure else None,
                ],
                [item.recorded] if isinstance(item, Adopt) else None,
                getattr(item, "returned", False),
            ]
        )
        self._send(p, [_CATCH_UP, body])  # if dropped (restarting), the restart sends it again

    def _push_config(self) -> None:
        """Send each process the registry snapshot when it changed (a seed, a disabled pod...)."""
        while not self._stopping.wait(CONFIG_PUSH_SECONDS):
            try:
                config = self.config()
            except Exception:
                log.exception("could not read the registry for the ingest worker processes")
                continue
            body = None
            for p in range(self.processes):
                if self._up[p] and self._config_sent[p] != config:
                    body = body or pickle.dumps(config)
                    if self._send(p, [_CONFIG, body]):
                        self._config_sent[p] = config

    def _read_reports(self) -> None:
        poller = zmq.Poller()
        poller.register(self._reports, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    kind, body = self._reports.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._on_report(kind, body)
                except Exception:
                    log.exception("could not take a report of an ingest worker process")

    def _on_report(self, kind: bytes, body: bytes) -> None:
        if kind in (_READY, _STOPPED):
            p, incarnation = msgpack.unpackb(body)
            if incarnation == self._incarnations[p]:
                (self._ready if kind == _READY else self._stopped)[p].set()
            return
        report = pickle.loads(body)
        p = report["process"]
        current = report["incarnation"] == self._incarnations[p]
        skip = set()
        with self._state_lock:  # the pods forgotten after the process took these stats
            for pod, (q, number) in list(self._forgotten.items()):
                if q == p and number > report["forgets"]:
                    skip.add(pod)
                elif q == p and current:
                    del self._forgotten[pod]
        merge_stats(self.stats, report["stats"], queue_prefix=f"p{p}.", skip_pods=skip)
        for number in report["done"]:
            with self._state_lock:
                found = self._catch_ups.pop(number, None)
            if found is not None and found[1].done is not None:
                try:
                    found[1].done()
                except Exception:
                    log.exception("a catch-up's completion failed")
        if current:
            self._marks_reached[p] = max(self._marks_reached[p], report["mark"])


# -- the worker process ---------------------------------------------------------------------------


_STOP_RECEIVED = threading.Event()  # this worker process was told to stop (and drains)


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's main: read work from the main process, apply it, report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process stops us
    signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s [%(processName)s]: %(message)s"
    )
    _Worker(spec).run()


def _on_sigterm(_signum: int, _frame: object) -> None:
    threading.Thread(target=_exit_unless_stopped, name="ingest-sigterm", daemon=True).start()


def _exit_unless_stopped() -> None:
    if not _STOP_RECEIVED.wait(SIGTERM_GRACE_SECONDS):
        log.warning("ingest worker process: SIGTERM and no stop from the main process; exiting")
        os._exit(1)


class _Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.config = spec.config
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.RCVHWM, max(2, spec.queue_size // MAX_MESSAGES_PER_FLUSH // 2))
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(spec.inbox)
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)  # the last report gets out before we exit
        self.outbox.connect(spec.outbox)
        self.stats = IngestStats()
        self.shipper = StatsShipper(self.stats)
        self.index = spec.index_factory()
        refuse_memory_index(self.index)
        self.dynamo = spec.dynamo_factory() if spec.dynamo_factory is not None else None
        progress = self._read_progress()
        replay = None
        if spec.replay is not None:
            replay = ReplayClient(
                config=lambda: self.config,
                context=self.context,
                # Field by field: asdict would turn the CURVE keys' dataclasses into dicts too.
                **{f.name: getattr(spec.replay, f.name) for f in dataclasses.fields(spec.replay)},
            )
        self.handlers: list[DecodingHandler] = []

        def handler_factory(_worker: int) -> DecodingHandler:
            applier = EventApplier(
                self.index,
                config=lambda: self.config,
                stats=self.stats,
                cache_budget=CACHED_BLOCKS_PER_PROCESS // spec.threads,
                dynamo=self.dynamo,
            )
            handler = DecodingHandler(applier, self.stats, spec.limits, replay=replay, progress=progress)
            self.handlers.append(handler)
            return handler

        self.pool = ShardPool(
            workers=spec.threads,
            handler_factory=handler_factory,
            queue_size=spec.queue_size,
            stats=self.stats,
            sharded_by=spec.processes,
        )
        self._done: deque[int] = deque()
        self._wake = threading.Event()
        self._quit = threading.Event()
        self._mark = 0
        self._mark_reported = 0
        self._forgets = 0

    def _read_progress(self) -> dict:
        backoff = 0.05
        while True:
            try:
                return self.index.progress()
            except IndexUnavailable as e:
                self._exit_if_orphaned()
                log.warning("ingest worker process %d: index unreachable (%s)", self.spec.process, e)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _exit_if_orphaned(self) -> None:
        if os.getppid() != self.spec.parent_pid:
            log.error("ingest worker process %d: the main process is gone; exiting", self.spec.process)
            os._exit(1)

    def run(self) -> None:
        self.pool.start()
        if self.spec.gc_freeze_seconds:
            threading.Thread(target=self._freeze_survivors, name="ingest-gc", daemon=True).start()
        self.outbox.send_multipart([_READY, msgpack.packb([self.spec.process, self.spec.incarnation])])
        reporter = threading.Thread(target=self._report_loop, name="ingest-report", daemon=True)
        reporter.start()
        drain_timeout = self._feed()
        self.pool.drain_and_stop(drain_timeout)
        self._quit.set()
        self._wake.set()
        reporter.join()
        self._report()
        self.outbox.send_multipart([_STOPPED, msgpack.packb([self.spec.process, self.spec.incarnation])])
        self.inbox.close(0)
        self.outbox.close()
        self.context.term()
        with contextlib.suppress(Exception):
            self.index.close()

    def _feed(self) -> float:
        """Take work from the main process into the thread pool until told to stop; returns
        how long draining may take. The hand-offs already waiting (up to ``FEED_BURST``) are
        read together and regrouped per thread in parcels of up to ``MAX_MESSAGES_PER_FLUSH``,
        one queue operation each, as the receiver does; anything else is handled in its place
        in the order."""
        inbox, pool = self.inbox, self.pool
        parcels: dict[int, list[Received]] = {}
        burst = 0
        while True:
            if not parcels and not inbox.poll(500):
                self._exit_if_orphaned()
                continue
            kind = body = None
            if burst < FEED_BURST:
                with contextlib.suppress(zmq.Again):
                    kind, body = inbox.recv_multipart(zmq.NOBLOCK)
            if kind == _MESSAGES:
                burst += 1
                for pod, model, seq, payload, received_at in msgpack.unpackb(body):
                    worker = pool.shard(pod)
                    parcel = parcels.setdefault(worker, [])
                    parcel.append(Received(pod, model, seq, payload, received_at))
                    if len(parcel) >= MAX_MESSAGES_PER_FLUSH:
                        pool.submit_parcel(worker, parcels.pop(worker))
                continue
            for worker, parcel in parcels.items():  # what came before, first
                pool.submit_parcel(worker, parcel)
            parcels, burst = {}, 0
            if kind is None:
                continue
            if kind == _CATCH_UP:
                pool.submit(self._catch_up(body))
            elif kind == _CONFIG:
                self.config = pickle.loads(body)
            elif kind == _FORGET:
                number, pod = msgpack.unpackb(body)
                for handler in self.handlers:
                    handler.forget(pod)
                self.stats.forget_pod(pod)
                self._forgets = number
            elif kind == _MARK:
                self._mark = int(body)
                self._wake.set()
            elif kind == _STOP:
                _STOP_RECEIVED.set()
                return float(body)

    def _catch_up(self, body: bytes) -> CatchUp:
        number, pod, model, rank, lost, fetched, adopt, returned = msgpack.unpackb(body)
        if adopt is not None:
            return Adopt(pod, model, rank, recorded=adopt[0])
        if fetched is not None:
            start, batches, reason, message = fetched
            failure = ReplayFailed(reason, message) if reason is not None else None
            fetched = Fetched(start, [(seq, payload) for seq, payload in batches], failure)
        done = functools.partial(self._caught_up, number) if number else None
        return CatchUp(pod, model, rank, lost=lost, done=done, fetched=fetched, returned=returned)

    def _caught_up(self, number: int) -> None:
        self._done.append(number)
        self._wake.set()

    def _report_loop(self) -> None:
        while not self._quit.is_set():
            waiting = self._mark > self._mark_reported  # a join_idle waits: look again soon
            self._wake.wait(0.005 if waiting else self.spec.stats_seconds)
            self._wake.clear()
            if not self._quit.is_set():
                self._report()

    def _report(self) -> None:
        # Read the mark and the forgets before the stats: the stats then hold at least as much.
        mark, forgets = self._mark, self._forgets
        idle = self.pool.idle()
        done = []
        while self._done:
            done.append(self._done.popleft())
        report = {
            "process": self.spec.process,
            "incarnation": self.spec.incarnation,
            "mark": mark if idle else 0,
            "forgets": forgets,
            "stats": self.shipper.take(),
            "done": done,
        }
        if idle:
            self._mark_reported = mark
        self.outbox.send_multipart([_REPORT, pickle.dumps(report)])

    def _freeze_survivors(self) -> None:  # as IngestPipeline does
        while not self._quit.wait(self.spec.gc_freeze_seconds):
            gc.collect()
            gc.freeze()
