"""The ZMQ shard pool: receive KV-event messages and hand each to the worker its pod hashes to.

``fnv1a_32(pod) % workers`` routes every message of one pod to the same worker, so a pod's events
are applied in order while different pods proceed in parallel (the reference does the same).
Queues are bounded: when a worker falls behind, the receiver says so (a counter and a log line)
and waits for room, so memory stays bounded and ZeroMQ's own high-water mark applies upstream
(a publisher past it drops, which the seq numbers then show as gaps).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from ingest.applier import EventApplier, holder_id
from ingest.curve import EventCurve
from ingest.events import DEFAULT_LIMITS, DecodeError, DecodeLimits, decode_batch, parse_seq, parse_topic
from ingest.ratelimit import RateLimitedLog
from ingest.replay import ReplayClient
from ingest.resync import CatchUp, StreamKeeper
from ingest.stats import IngestStats
from kvindex.base import IndexUnavailable
from registry.config import ServiceConfig

log = logging.getLogger(__name__)

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def fnv1a_32(data: bytes) -> int:
    """32-bit FNV-1a, as the reference uses to shard pods over workers."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


@dataclass(frozen=True, slots=True)
class Received:
    """One message as the receiver hands it to a worker: framing checked, payload not decoded."""

    pod: str
    model: str
    seq: int
    payload: bytes
    received_at: float


@dataclass(frozen=True, slots=True)
class Adopt(CatchUp):
    """Not a replay: engine ``rank`` of ``pod`` was indexed by another ingest replica until now
    (``ingest.membership``), so what its worker remembers of it is stale. The worker takes the
    seq the index records (``recorded``, read when the pod was taken; None: nothing applied) as
    the engine's last one. Queued before the pod's first live message and its catch-up, which
    then starts from there. (A ``CatchUp`` so that it travels where the pod's catch-ups do.)"""

    recorded: int | None = None


class Handler(Protocol):
    """What a worker drives: a step of each message it has (``steps``: one slice each), then
    one ``flush`` for them all, until every message is done."""

    def steps(self, item: Received | CatchUp) -> Iterator[None]: ...

    def flush(self) -> None: ...


@dataclass(slots=True)
class _Job:
    """A pod's messages in a worker, oldest first, and the steps of the oldest once started."""

    pod: str
    items: deque = field(default_factory=deque)
    steps: Iterator[None] | None = None


def _next_or_none(q: queue.Queue) -> object | None:
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


MAX_BACKOFF_SECONDS = 0.5
"""The longest a worker waits between tries while the index is unreachable: a restarted server
is written to within this of answering again."""

_STOP = object()
MAX_MESSAGES_PER_FLUSH = 64
"""Messages in one parcel, which a worker stages and then flushes in one index round trip."""


class Dispatcher(Protocol):
    """Where the receiver hands messages: a ``ShardPool`` (threads) or, with ``ingest
    --processes N``, an ``ingest.processes.ProcessShardPool``."""

    def shard(self, pod: str) -> int: ...

    def forget_pod(self, pod: str) -> None: ...

    def submit_parcel(self, worker: int, items: list[Received | CatchUp]) -> None: ...


class ShardPool:
    """``workers`` threads, each draining its own bounded queue through ``handler``.

    ``sharded_by``: the pods given to this pool are already those of one shard of
    ``fnv1a_32(pod) % sharded_by`` (one of that many worker processes), so the threads divide
    by the rest of the hash (``fnv1a_32(pod) // sharded_by % workers``); else every pod of a
    process would hash to the same thread."""

    def __init__(
        self,
        *,
        workers: int,
        handler_factory: Callable[[int], Handler],
        queue_size: int,
        stats: IngestStats,
        sharded_by: int = 1,
    ):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.stats = stats
        self._sharded_by = sharded_by
        # Queues hold parcels of up to MAX_MESSAGES_PER_FLUSH messages; queue_size counts messages.
        parcels = max(2, -(-queue_size // MAX_MESSAGES_PER_FLUSH))
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=parcels) for _ in range(workers)]
        self._handlers = [handler_factory(i) for i in range(workers)]
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"ingest-worker-{i}", daemon=True)
            for i in range(workers)
        ]
        self._last_full_log = 0.0
        self._stopping = threading.Event()
        self._give_up_at = float("inf")
        self._shard_of: dict[str, int] = {}
        self._in_jobs = [0] * workers  # messages taken from each queue and not done yet

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def shard(self, pod: str) -> int:
        found = self._shard_of.get(pod)
        if found is None:
            found = self._shard_of[pod] = fnv1a_32(pod.encode()) // self._sharded_by % len(self.queues)
        return found

    def forget_pod(self, pod: str) -> None:
        """``pod`` is gone: its shard is worked out again if it comes back."""
        self._shard_of.pop(pod, None)

    def submit(self, item: Received | CatchUp) -> None:
        """Queue one message (or catch-up) for its pod's worker (see ``submit_parcel``)."""
        self.submit_parcel(self.shard(item.pod), [item])

    def submit_parcel(self, worker: int, items: list[Received | CatchUp]) -> None:
        """Queue ``items`` (all of pods that shard to ``worker``, at most
        ``MAX_MESSAGES_PER_FLUSH``) as one parcel: one queue operation for many messages, which
        halves the cost of handing work between threads. Waits (and says so) when that worker
        is behind."""
        q = self.queues[worker]
        try:
            q.put_nowait(items)
        except queue.Full:
            self.stats.queue_full[worker] += 1
            now = time.monotonic()
            if now - self._last_full_log > 5:
                self._last_full_log = now
                log.warning(
                    "ingest worker %d is behind: its queue of %d messages is full; receiving waits",
                    worker,
                    q.maxsize * MAX_MESSAGES_PER_FLUSH,
                )
            q.put(items)

    def join_idle(self, timeout: float) -> None:
        """Wait until every queued message has been handled (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        # A parcel moves into the worker's jobs (counted) before it is marked done in the queue.
        while any(q.unfinished_tasks for q in self.queues) or any(self._in_jobs):
            if time.monotonic() > deadline:
                raise TimeoutError("ingest workers did not become idle")
            time.sleep(0.002)

    def idle(self) -> bool:
        """Whether every message queued so far has been handled (written)."""
        return not any(q.unfinished_tasks for q in self.queues) and not any(self._in_jobs)

    def depths(self) -> list[int]:
        return [q.qsize() for q in self.queues]

    def drain_and_stop(self, timeout: float = 30.0) -> None:
        """Let every worker finish what is queued, then stop them."""
        deadline = time.monotonic() + timeout
        self._give_up_at = deadline
        self._stopping.set()
        for q in self.queues:
            q.put(_STOP)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, worker: int) -> None:
        """Round after round: take what is queued into per-pod jobs, let every pod with work
        stage its oldest messages up to one slice (``SLICE_BLOCKS`` blocks, at most
        ``MAX_MESSAGES_PER_FLUSH`` messages), flush once for all of them. A pod's messages stay
        in order; a pod with a huge message gets a slice per round while the other pods'
        messages go on between its slices. At most a queue's worth of messages is taken into
        jobs, so a worker that falls behind still fills its queue (and the receiver waits)."""
        handler = self._handlers[worker]
        q = self.queues[worker]
        room = q.maxsize * MAX_MESSAGES_PER_FLUSH
        jobs: deque[_Job] = deque()  # pods with work, in turn
        by_pod: dict[str, _Job] = {}
        stopping = False
        while True:
            parcel = q.get() if not jobs and not stopping else None
            while parcel is not None or (self._in_jobs[worker] < room and (parcel := _next_or_none(q))):
                if parcel is _STOP:
                    stopping = True
                else:
                    self._in_jobs[worker] += len(parcel)
                    for item in parcel:
                        job = by_pod.get(item.pod)
                        if job is None:
                            job = by_pod[item.pod] = _Job(item.pod)
                            jobs.append(job)
                        job.items.append(item)
                q.task_done()
                parcel = None
            if not jobs:
                if stopping:
                    return
                continue
            done = 0
            for _ in range(len(jobs)):
                job = jobs.popleft()
                done += self._turn(worker, handler, job)
                if job.items:
                    jobs.append(job)
                else:
                    del by_pod[job.pod]
            self._retrying(worker, handler.flush, "the last round")
            self._in_jobs[worker] -= done  # handled once written: join_idle waits for the flush

    def _turn(self, worker: int, handler: Handler, job: _Job) -> int:
        """The job's turn in a round: steps of its oldest messages until one yields (its slice
        is staged) or ``MAX_MESSAGES_PER_FLUSH`` are done; returns how many were done. While
        the index is unreachable a message starts over after a backoff (its writes are
        idempotent); any other error is logged and the message dropped (a bug in one message
        cannot kill the worker)."""
        done = 0
        backoff = 0.05
        while job.items and done < MAX_MESSAGES_PER_FLUSH:
            if job.steps is None:
                job.steps = handler.steps(job.items[0])
            try:
                next(job.steps)
                return done  # a slice is staged: the round flushes it, the rest waits a turn
            except StopIteration:
                pass
            except IndexUnavailable as e:
                job.steps = None
                if not (self._stopping.is_set() and time.monotonic() > self._give_up_at):
                    log.warning(
                        "ingest worker %d: index unreachable (%s); retrying in %.2fs", worker, e, backoff
                    )
                    time.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                    continue
                log.error(
                    "ingest worker %d dropped a message of %s: index unreachable: %s", worker, job.pod, e
                )
            except Exception:
                log.exception("ingest worker %d failed on a message from %s", worker, job.pod)
            job.steps = None
            job.items.popleft()
            done += 1
        return done

    def _retrying(self, worker: int, step: Callable[[], None], pod: str) -> None:
        """Run one step. While the index is unreachable, retry with backoff rather than lose
        data (staging and flushing are idempotent); any other error is logged and skipped so a
        bug in one message cannot kill the worker."""
        backoff = 0.05
        while True:
            try:
                step()
                return
            except IndexUnavailable as e:
                if self._stopping.is_set() and time.monotonic() > self._give_up_at:
                    log.error(
                        "ingest worker %d dropped updates (last from %s): index unreachable: %s",
                        worker,
                        pod,
                        e,
                    )
                    return
                log.warning("ingest worker %d: index unreachable (%s); retrying in %.2fs", worker, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Exception:
                log.exception("ingest worker %d failed on a message from %s", worker, pod)
                return


MALFORMED_LOG = RateLimitedLog(log)
"""Where the receiver and the workers report bad input (reasons are few: the dict stays small)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """Which pods' messages the receiver takes (anyone who reaches the event port can name any pod).

    Registered pods (the registry's ``registered_pods``) always. Other pods, unless
    ``registered_only``: at most ``DecodeLimits.max_pods`` at once; when that many are admitted,
    the one heard from least recently gives its place to a new pod if it has been quiet for
    ``idle_seconds`` (and is forgotten: ``Receiver.on_evict``), else the new pod's message is
    refused (``too_many_pods``). So a flood of made-up pod names can neither take a registered
    pod's place nor keep a real unregistered pod out for longer than the flood goes on. Any pod
    sends for at most ``MAX_MODELS_PER_POD`` models (``too_many_models``): what ingest keeps of a
    pod is per model.
    ``registered_only``: a message is taken only from a pod registered for that model
    (``unregistered_pod`` otherwise): the registry is the allow-list."""

    registered_only: bool = False
    idle_seconds: float = 600.0


DEFAULT_ADMISSION = Admission()

MAX_RANKS_PER_POD = 64
"""Data-parallel ranks one pod may publish for (the ranks of one engine: a node's GPUs at most,
usually; a batch of one more is skipped, ``too_many_ranks``)."""

MAX_MODELS_PER_POD = 4
"""An engine serves one model (its topic names it; LoRA adapters are not models there): four leave
room for a pod renamed in place. What ingest keeps of a pod is per model, so a pod naming a new
model in every message would grow it without end."""


class Receiver:
    """SUB sockets (bound and/or connected) read by one thread, feeding a ``ShardPool``, taking
    the messages of the pods ``admission`` admits (``config`` says which pods are registered).
    ``curve``: every socket speaks CURVE (``ingest.curve``), as the server where it binds (the
    ZAP handler of ``context`` must be started first) and as the client where it connects."""

    def __init__(
        self,
        *,
        pool: Dispatcher,
        stats: IngestStats,
        bind: Sequence[str] = (),
        connect: Sequence[str] = (),
        topic: str = "kv@",
        rcvhwm: int = 100_000,
        context: zmq.Context | None = None,
        limits: DecodeLimits = DEFAULT_LIMITS,
        managed_connect: bool = False,
        config: Callable[[], ServiceConfig] = ServiceConfig,
        admission: Admission = DEFAULT_ADMISSION,
        on_evict: Callable[[str], None] = lambda pod: None,
        curve: EventCurve | None = None,
    ) -> None:
        if not bind and not connect and not managed_connect:
            raise ValueError("give at least one endpoint to bind or connect")
        self.pool = pool
        self.stats = stats
        self.topic = topic
        self.limits = limits
        self.config = config
        self.admission = admission
        self.on_evict = on_evict
        """Called, on the receiving thread, with an unregistered pod that gave its place."""
        self.context = context or zmq.Context.instance()
        self.curve = curve
        # A frame over 16 times the payload limit is never buffered (ZeroMQ drops the connection
        # that sends it, which reconnects; uncounted): one frame of gigabytes would otherwise be
        # held whole before decoding could count it too large. Below that a payload over the limit
        # is received, counted (too_large) and skipped.
        self._max_frame_bytes = 16 * limits.max_message_bytes
        self.sockets: list[zmq.Socket] = []
        self.bound: list[str] = []
        for endpoint, do_bind in [(e, True) for e in bind] + [(e, False) for e in connect]:
            sock = self.context.socket(zmq.SUB)
            self.sockets.append(sock)
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            try:
                if curve is not None:
                    curve.secure(sock, server=do_bind)
                if do_bind:
                    sock.bind(endpoint)
                    self.bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
                else:
                    sock.connect(endpoint)
            except zmq.ZMQError:
                for opened in self.sockets:  # nothing left open to hold its context's term()
                    opened.close(0)
                raise
        self._stop = threading.Event()
        self._models: dict[str, tuple[str, ...]] = {}  # admitted pods -> the models they send for
        # Admitted unregistered pods -> when they last sent (monotonic), least recent first.
        self._unregistered: OrderedDict[str, float] = OrderedDict()
        self._rcvhwm = rcvhwm
        # The connect set (``set_connected``): wished by any thread, applied by the receiving one.
        self._wanted: frozenset[str] | None = None
        self._wanted_lock = threading.Lock()
        self._managed: zmq.Socket | None = None
        self.connected: frozenset[str] = frozenset()
        self.foreign: frozenset[str] = frozenset()
        """Pods whose messages are dropped: another ingest replica holds them (``set_connected``)."""
        self.foreign_messages = 0

    def stop(self) -> None:
        self._stop.set()

    def set_connected(self, endpoints: Collection[str], *, foreign: Collection[str] = ()) -> None:
        """Connect one SUB socket to exactly ``endpoints`` (engines' bound PUBs), adding and
        dropping connections within a poll (100 ms), and drop the messages of the ``foreign``
        pods from now on, whichever socket they arrive on (another replica holds them)."""
        self.foreign = frozenset(foreign)
        with self._wanted_lock:
            self._wanted = frozenset(endpoints)

    def _apply_connections(self, poller: zmq.Poller) -> None:
        """On the receiving thread (ZeroMQ sockets are not thread-safe): make the connections
        of the managed socket what ``set_connected`` last asked for."""
        with self._wanted_lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        if self._managed is None:
            self._managed = self.context.socket(zmq.SUB)
            self.sockets.append(self._managed)
            self._managed.setsockopt(zmq.RCVHWM, self._rcvhwm)
            self._managed.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
            self._managed.setsockopt(zmq.LINGER, 0)
            self._managed.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            if self.curve is not None:
                self.curve.secure(self._managed, server=False)
            poller.register(self._managed, zmq.POLLIN)
        connected = set(self.connected)
        for endpoint in sorted(connected - wanted):
            connected.discard(endpoint)
            try:
                self._managed.disconnect(endpoint)
            except zmq.ZMQError as e:
                log.warning("could not disconnect from %s: %s", endpoint, e)
        for endpoint in sorted(wanted - connected):
            try:
                self._managed.connect(endpoint)
            except zmq.ZMQError as e:
                log.warning("could not connect to %s: %s", endpoint, e)
                continue
            connected.add(endpoint)
        self.connected = frozenset(connected)

    def forget_pod(self, pod: str) -> None:
        """``pod`` is gone (deleted from the registry): it no longer holds a place."""
        self._models.pop(pod, None)
        self._unregistered.pop(pod, None)

    def run(self) -> None:
        """Receive until ``stop()``; never raises on bad input (it is counted)."""
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._apply_connections(poller)
                for sock, _ in poller.poll(100):
                    # Drain what is ready without going back to poll for every message, and
                    # hand it over in per-worker parcels.
                    parcels: dict[int, list[Received]] = {}
                    for _ in range(1000):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        item = self._accept(frames)
                        if item is None:
                            continue
                        worker = self.pool.shard(item.pod)
                        parcel = parcels.setdefault(worker, [])
                        parcel.append(item)
                        if len(parcel) >= MAX_MESSAGES_PER_FLUSH:
                            self.pool.submit_parcel(worker, parcels.pop(worker))
                    for worker, parcel in parcels.items():
                        self.pool.submit_parcel(worker, parcel)
        finally:
            for sock in self.sockets:
                sock.close(0)

    def _accept(self, frames: list[bytes]) -> Received | None:
        """The message, framing checked; None (and counted) when it is malformed."""
        try:
            if len(frames) != 3:
                raise DecodeError("frames", f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            pod, model = parse_topic(frames[0], self.topic, max_name_chars=self.limits.max_name_chars)
            seq = parse_seq(frames[1])
            if pod in self.foreign:
                self.foreign_messages += 1
                return None
            self._admit(pod, model)
        except DecodeError as e:
            self.stats.unattributed_errors[e.reason] += 1
            MALFORMED_LOG.warning(e.reason, "skipped a malformed message: %s", e)
            return None
        return Received(pod, model, seq, frames[2], time.time())

    def _admit(self, pod: str, model: str) -> None:
        """Take a message of ``pod`` for ``model``, or raise ``DecodeError`` (see ``Admission``).
        The registry is read only for a pod or a model not admitted yet, or at the limit."""
        models = self._models.get(pod)
        if models is not None and model in models:  # the common case: a pod and model admitted
            if pod in self._unregistered:
                self._unregistered[pod] = time.monotonic()
                self._unregistered.move_to_end(pod)
            return
        config = self.config()
        registered = pod in config.registered_pods
        if self.admission.registered_only and not (registered and config.pods.get(pod) == model):
            raise DecodeError("unregistered_pod", f"{pod[:80]!r} is not registered for {model[:80]!r}")
        if models is not None:
            if len(models) >= MAX_MODELS_PER_POD:
                raise DecodeError("too_many_models", f"{pod[:80]!r} already sends for {len(models)} models")
            self._models[pod] = (*models, model)
            return
        if not registered:
            if len(self._unregistered) >= self.limits.max_pods:
                self._make_room(config)
            self._unregistered[pod] = time.monotonic()
        self._models[pod] = (model,)

    def _make_room(self, config: ServiceConfig) -> None:
        """At the limit: the least recent unregistered pod moves out of the count if it has been
        registered since, or gives its place if it has been quiet for ``idle_seconds``; else
        ``too_many_pods``. One pod looked at: the cost stays constant however long a flood."""
        oldest, last = next(iter(self._unregistered.items()))
        if oldest in config.registered_pods:
            del self._unregistered[oldest]
            return
        if time.monotonic() - last < self.admission.idle_seconds:
            raise DecodeError(
                "too_many_pods", f"already {len(self._unregistered)} unregistered pods, none quiet for long"
            )
        del self._unregistered[oldest]
        self._models.pop(oldest, None)
        self.stats.pods_evicted += 1
        self.on_evict(oldest)


class DecodingHandler:
    """A worker's handler: decode each payload (a bad one is counted against its pod) and stage
    it through the worker's stream keeper (which keeps each engine's seqs whole, replaying what
    was missed); flush applies everything staged in one round trip. Catch-ups go to the keeper
    too; their ``done`` callbacks run once what they staged is written."""

    def __init__(
        self,
        applier: EventApplier,
        stats: IngestStats,
        limits: DecodeLimits = DEFAULT_LIMITS,
        *,
        replay: ReplayClient | None = None,
        progress: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        self.applier = applier
        self.stats = stats
        self.limits = limits
        self.keeper = StreamKeeper(applier, stats, limits=limits, replay=replay, progress=progress)
        self._after_flush: list[Callable[[], None]] = []
        self._ranks: dict[str, set[int]] = {}  # the data-parallel ranks of each pod of this worker

    def steps(self, item: Received | CatchUp) -> Iterator[None]:
        """Stage ``item``, a slice at a time: the worker flushes where this yields, and lets
        other pods' work in between. Should a step fail, what it staged is dropped (the worker
        then starts ``item`` over: what earlier steps wrote is written again, harmlessly)."""
        if isinstance(item, Adopt):
            self.adopt(item)
            return
        mark = self.applier.pending
        try:
            if isinstance(item, CatchUp):
                for _ in self.keeper.catch_up(item):
                    yield
                    mark = self.applier.pending
                if item.done is not None:
                    self._after_flush.append(item.done)
                return
            try:
                batch = decode_batch(item.payload, self.limits)
            except DecodeError as e:
                stream = self.stats.stream(item.pod, 0, item.model)
                stream.batches += 1
                stream.decode_errors[e.reason] += 1
                stream.last_seq = item.seq
                self.keeper.skipped(pod=item.pod, model=item.model, seq=item.seq)
                MALFORMED_LOG.warning(e.reason, "skipped an undecodable batch from %.80s: %s", item.pod, e)
                return
            if not self._rank_admitted(item.pod, batch.data_parallel_rank or 0):
                stream = self.stats.stream(item.pod, 0, item.model)
                stream.batches += 1
                stream.decode_errors["too_many_ranks"] += 1
                MALFORMED_LOG.warning("too_many_ranks", "skipped a batch of %.80s: too many ranks", item.pod)
                return
            for _ in self.keeper.accept(
                pod=item.pod, model=item.model, seq=item.seq, batch=batch, received_at=item.received_at
            ):
                yield
                mark = self.applier.pending
        except Exception:
            self.applier.discard_staged(mark)
            raise

    def _rank_admitted(self, pod: str, rank: int) -> bool:
        """Whether ``pod`` may have data-parallel rank ``rank``: at most ``MAX_RANKS_PER_POD`` of
        them (every rank is a stream of its own, with state of its own)."""
        ranks = self._ranks.get(pod)
        if ranks is None:
            ranks = self._ranks[pod] = set()
        if rank not in ranks:
            if len(ranks) >= MAX_RANKS_PER_POD:
                return False
            ranks.add(rank)
        return True

    def forget(self, pod: str) -> None:
        """Drop what this worker remembers of ``pod`` (it was disabled, deleted or evicted)."""
        self.applier.forget(pod)
        self.keeper.forget(pod)
        self._ranks.pop(pod, None)

    def adopt(self, item: Adopt) -> None:
        """Forget what the keeper remembers of the engine and start it over from ``recorded``."""
        self.keeper.adopt(model=item.model, holder=holder_id(item.pod, item.rank), recorded=item.recorded)

    def flush(self) -> None:
        self.applier.flush()
        done, self._after_flush = self._after_flush, []
        for callback in done:
            callback()
