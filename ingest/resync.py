"""Keeping each engine's stream of batches whole: seq gaps, engine restarts, replay, lost state.

An engine (a pod, or one data-parallel rank of it) numbers its batches 0, 1, 2, ... The last seq
applied per engine is written to the index together with its batch (``Progress``), so it
survives an ingest restart and vanishes with the index's data. For a live batch with seq ``s``
of an engine whose last applied seq is ``l`` (None: nothing applied, as far as the index knows):

* ``s == l + 1`` (``s == 0`` when ``l`` is None): it is applied.
* ``s <= l`` and a catch-up replay already applied ``s``: a duplicate, skipped.
* ``s <= l`` otherwise: the engine restarted (a new publisher counts from 0, over an empty
  cache): what the index holds of it is cleared, then it goes on as if ``l`` were None.
* ``s`` beyond that: batches were missed. They are asked from the engine's replay endpoint
  (``ingest.replay``) and applied in order, before ``s``. When the replay cannot cover them (no
  endpoint, timeout, its buffer no longer reaches back), the engine's blocks are cleared, what
  the replay did return that leads up to ``s`` without a hole is applied, and the engine is
  marked resyncing until it stores again: the index may then miss blocks, never hold stale ones.

A :class:`CatchUp` asks an engine for everything after ``l`` without waiting for a live batch:
on ingest start (batches sent while it was down) and after the index lost its data (``lost``:
everything from seq 0; an engine that cannot replay is cleared and marked). When a pod answers
its health probes again after being down (``returned``), its engine may have restarted meanwhile
with an empty cache, and a restart shows in its seqs only once it sends: until then its old
blocks would be scored. So its replay is asked from ``l`` itself: batch ``l`` must be there, with
the timestamp of the batch applied as ``l``, for the engine to be the same; then what follows is
applied. Anything else (its buffer begins anew or later, no replay) counts as a restart: what the
index holds of it is cleared, and it goes on as an engine nothing was applied of.

One keeper per shard worker, so an engine's batches, replays and catch-ups are applied by one
thread in order. Replays run on that thread, each bounded by the replay client's timeout.
State changes only once everything a message needs is staged: when staging fails half way (the
index became unreachable) the worker retries the message from scratch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass

from ingest.applier import EventApplier, holder_id
from ingest.events import DecodeError, DecodeLimits, EventBatch, decode_batch
from ingest.ratelimit import RateLimitedLog
from ingest.replay import ReplayClient, ReplayFailed
from ingest.stats import IngestStats, StreamStats

log = logging.getLogger(__name__)
REPLAY_LOG = RateLimitedLog(log)

Batches = list[tuple[int, bytes]]


@dataclass(frozen=True, slots=True)
class Fetched:
    """A replay read ahead of time, from seq ``start``: its batches, or why it failed."""

    start: int
    batches: Batches
    failure: ReplayFailed | None = None


@dataclass(frozen=True, slots=True)
class CatchUp:
    """Work for a pod's shard worker: replay what engine ``rank`` buffers beyond what was
    applied. ``lost``: the index lost the engine's state (replay it all, from seq 0; clear and
    mark it when that fails). ``fetched``: the replay, read by another thread (so that an engine
    that does not answer costs that thread its timeout, not the worker); used when it reaches
    back far enough, else the worker asks again. ``done`` runs once the result is written."""

    pod: str
    model: str
    rank: int = 0
    lost: bool = False
    done: Callable[[], None] | None = None
    fetched: Fetched | None = None
    returned: bool = False  # the pod answers again after being down: did its engine restart?


@dataclass(slots=True)
class _Engine:
    last: int | None  # the last seq applied; None: none as far as the index knows
    replayed_through: int = -1  # live batches up to this seq were applied from a catch-up
    take_next: bool = False  # its state is given up for lost: the next live batch starts afresh
    last_ts: float | None = None  # the timestamp of batch ``last`` (which life of the engine sent it)


class StreamKeeper:
    """Applies one worker's live batches and catch-ups through its applier, in seq order."""

    def __init__(
        self,
        applier: EventApplier,
        stats: IngestStats,
        *,
        limits: DecodeLimits,
        replay: ReplayClient | None,
        progress: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        self.applier = applier
        self.stats = stats
        self.limits = limits
        self.replay = replay
        self._progress = dict(progress or {})
        self._engines: dict[tuple[str, str], _Engine] = {}

    def adopt(self, *, model: str, holder: str, recorded: int | None) -> None:
        """Start engine ``holder`` of ``model`` over from ``recorded``, the last seq the index
        records of it (``None``: nothing applied): another ingest replica applied it until now,
        so what this keeper remembers of it is stale (``ingest.membership``)."""
        key = (model, holder)
        self._engines.pop(key, None)
        if recorded is None:
            self._progress.pop(key, None)
        else:
            self._progress[key] = recorded

    def accept(
        self, *, pod: str, model: str, seq: int, batch: EventBatch, received_at: float
    ) -> Iterator[None]:
        """Stage the live batch ``seq`` of ``pod``, and before it what the rules above say; a
        slice at a time (``EventApplier.stage_steps``: flush where it yields)."""
        rank = batch.data_parallel_rank or 0
        holder = holder_id(pod, rank)
        engine = self._engine(model, holder)
        stream = self.stats.stream(pod, rank, model)
        stream.last_seq = seq
        last = None if engine.take_next else engine.last
        if last is not None and seq <= last:
            if seq <= engine.replayed_through:
                stream.duplicates += 1
                return
            stream.restarts += 1
            yield from self.applier.clear_steps(model=model, holder=holder)
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected and not engine.take_next and pod not in self.applier.config().disabled_pods:
            stream.seq_gaps += 1
            stream.missed_batches += seq - expected
            yield from self._recover(pod, model, rank, stream, start=expected, before=seq, must_cover=True)
        yield from self.applier.stage_steps(
            pod=pod, model=model, seq=seq, batch=batch, received_at=received_at
        )
        engine.last, engine.take_next, engine.last_ts = seq, False, batch.ts

    def catch_up(self, item: CatchUp) -> Iterator[None]:
        """Stage what engine ``item.rank`` of ``item.pod`` buffers beyond what was applied (a
        slice at a time, as ``accept``)."""
        holder = holder_id(item.pod, item.rank)
        engine = self._engine(item.model, holder)
        stream = self.stats.stream(item.pod, item.rank, item.model)
        returned = item.returned and not item.lost and engine.last is not None
        if returned and not (yield from self._same_engine(item, engine, stream)):
            return
        start = 0 if item.lost or engine.last is None else engine.last + 1
        prefetched = item.fetched if item.fetched is not None and item.fetched.start <= start else None
        through = yield from self._recover(
            item.pod,
            item.model,
            item.rank,
            stream,
            start=start,
            before=None,
            must_cover=item.lost,
            prefetched=prefetched,
        )
        if through is not None:
            engine.last = engine.replayed_through = through
            engine.take_next = False
        elif item.lost:
            engine.last, engine.take_next = None, True

    def _same_engine(
        self, item: CatchUp, engine: _Engine, stream: StreamStats
    ) -> Generator[None, None, bool]:
        """Whether the engine that answers again is the one whose batch ``engine.last`` was
        applied: its replay from that seq begins with it, same timestamp. If not, it restarted:
        its blocks are cleared (``False``); what it sent since is then replayed from seq 0 when
        its next live batch shows a gap."""
        last = engine.last
        assert last is not None
        fetched, failure = self._fetch(item.pod, item.rank, last)
        if fetched and fetched[0][0] == last and engine.last_ts is not None:
            try:
                if decode_batch(fetched[0][1], self.limits).ts == engine.last_ts:
                    return True
            except DecodeError as e:
                stream.decode_errors[e.reason] += 1
        stream.restarts += 1
        yield from self.applier.clear_steps(model=item.model, holder=holder_id(item.pod, item.rank))
        engine.last, engine.last_ts, engine.replayed_through, engine.take_next = None, None, -1, False
        REPLAY_LOG.warning(
            "returned",
            "%.80s rank %d answers again and its batch %d is not the one applied (%s): it restarted; "
            "its blocks were cleared",
            item.pod,
            item.rank,
            last,
            failure or (f"its buffer starts at seq {fetched[0][0]}" if fetched else "its buffer is empty"),
        )
        return False

    def skipped(self, *, pod: str, model: str, seq: int) -> None:
        """A live batch of ``pod`` that could not be decoded (counted elsewhere): its seq is
        consumed, so that it does not read as a gap (replaying it would fail the same way)."""
        engine = self._engine(model, holder_id(pod, 0))
        if engine.last is None or seq > engine.last:
            engine.last = seq

    def forget(self, pod: str) -> None:
        """Drop what is remembered of ``pod``'s engines (the pod was disabled or deleted)."""
        for key in [k for k in list(self._engines) if k[1] == pod or k[1].startswith(pod + "#dp")]:
            self._engines.pop(key, None)
            self._progress.pop(key, None)

    def _engine(self, model: str, holder: str) -> _Engine:
        engine = self._engines.get((model, holder))
        if engine is None:
            engine = self._engines[(model, holder)] = _Engine(last=self._progress.pop((model, holder), None))
        return engine

    def _recover(
        self,
        pod: str,
        model: str,
        rank: int,
        stream: StreamStats,
        *,
        start: int,
        before: int | None,
        must_cover: bool,
        prefetched: Fetched | None = None,
    ) -> Generator[None, None, int | None]:
        """Replay engine ``rank`` of ``pod`` from ``start`` (up to ``before``, exclusive, when
        given) and stage it; returns the last seq staged (None: none). When the replay cannot
        cover what was missed, the engine is cleared and marked: always when the buffer no
        longer reaches back to ``start``, and when it could not be read if ``must_cover``
        (batches are known to be missing)."""
        if prefetched is not None:
            fetched = [b for b in prefetched.batches if b[0] >= start]
            failure = prefetched.failure
        else:
            fetched, failure = self._fetch(pod, rank, start)
        if before is not None:
            fetched = [b for b in fetched if b[0] < before]
        run = _unbroken_tail(fetched)
        if before is not None and run and run[-1][0] != before - 1:
            run = []  # the batches right before the live one are missing: nothing leads up to it
        # Covered: the run starts where asked; or, for a catch-up, nothing was sent since.
        covered = run[0][0] == start if run else failure is None and before is None and not fetched
        if not covered:
            reason = failure.reason if failure else "overrun"
            stream.replay_failures[reason] += 1
            clear = must_cover or failure is None
            if clear:
                stream.lost_state_clears += 1
                stream.resyncing = True
                yield from self.applier.clear_steps(model=model, holder=holder_id(pod, rank))
            REPLAY_LOG.warning(
                reason,
                "%.80s rank %d: could not replay from seq %d (%s)%s",
                pod,
                rank,
                start,
                failure or f"the engine's buffer starts at seq {run[0][0] if run else '-'}",
                "; its blocks were cleared until it stores again" if clear else "",
            )
        now = time.time()
        for seq, payload in run:
            try:
                batch = decode_batch(payload, self.limits)
            except DecodeError as e:
                stream.decode_errors[e.reason] += 1
                continue
            yield from self.applier.stage_steps(
                pod=pod, model=model, seq=seq, batch=batch, received_at=now, replayed=True
            )
            self._engine(model, holder_id(pod, rank)).last_ts = batch.ts
        return run[-1][0] if run else None

    def _fetch(self, pod: str, rank: int, start: int) -> tuple[Batches, ReplayFailed | None]:
        """Engine ``rank`` of ``pod``'s buffered batches from seq ``start``, or why not. The
        failure is kept without its traceback: the traceback holds the caller's frame, which
        would hold the exception, a cycle that outlives the frame when the pipeline freezes it
        (gc)."""
        try:
            if self.replay is None:
                raise ReplayFailed("no_endpoint", "ingest runs without replay")
            return self.replay.fetch(pod, rank, start), None
        except ReplayFailed as e:
            return [], e.with_traceback(None)


def _unbroken_tail(batches: Batches) -> Batches:
    """The longest run at the end of ``batches`` whose seqs follow one another."""
    i = len(batches) - 1
    while i > 0 and batches[i - 1][0] == batches[i][0] - 1:
        i -= 1
    return batches[max(i, 0) :]
