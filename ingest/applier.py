"""Turns decoded KV events into index updates: the write path's logic, with no I/O of its own
beyond the index calls it stages.

Keying rule (vllm-kv-events.md section 3): a stored block is keyed by the block key we compute
from its ``token_ids``, chained from its parent's digest (found through the pod's engine-hash ->
digest map), with the block's extra keys (the LoRA name first). Engine hashes are only handles:
for ``BlockRemoved`` and for finding a parent. The chain is never restarted from the root when
the parent is unknown (that yields keys no prompt can match): if the pod's engine hashes have
been equal to our keys (its seed and algorithm are ours), its engine hashes are adopted as keys;
otherwise the blocks are skipped and counted as orphaned.

Batches are *staged* (turned into ``IndexUpdate`` values, counters bumped) and then *flushed*
together: one index round trip for everything a worker found queued.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from ingest.stats import IngestStats, StreamStats
from scoring.config import DP_RANK_SEPARATOR, ServiceConfig
from scoring.index import KVIndex, StoredBlock
from scoring.index.base import ClearPod, IndexUpdate, Progress, Remove, Store
from scoring.keys import DIGEST_SIZE, Digest, block_digest, chain_digests, extra_keys, key_of, root_digest

PARENT_CACHE_SIZE = 8192
"""Engine hash -> digest entries kept per pod, so a parent is usually found without a round trip."""

SLICE_BLOCKS = 2048
"""Blocks a worker keys and writes at a time (keying ~4 ms, writing ~10 ms on Valkey): a larger
batch is staged in slices, other engines' work in between."""


def event_slices(events: Sequence[Event], max_blocks: int) -> Iterator[tuple[list[Event], int]]:
    """``events`` in consecutive runs of about ``max_blocks`` blocks (``AllBlocksCleared``
    counts one), with ``(run, blocks)``: a store or remove of more blocks is cut into several
    events of the same meaning (a cut store's parent is the last block before the cut), so
    applying the runs in order is applying ``events``."""
    run: list[Event] = []
    blocks = 0
    for event in events:
        for piece in _cut(event, max_blocks):
            size = len(piece.block_hashes) if isinstance(piece, BlockStored | BlockRemoved) else 1
            if run and blocks + size > max_blocks:
                yield run, blocks
                run, blocks = [], 0
            run.append(piece)
            blocks += size
    if run:
        yield run, blocks


def _cut(event: Event, max_blocks: int) -> list[Event]:
    hashes = getattr(event, "block_hashes", ())
    if len(hashes) <= max_blocks:
        return [event]
    if isinstance(event, BlockRemoved):
        return [
            dataclasses.replace(event, block_hashes=hashes[i : i + max_blocks])
            for i in range(0, len(hashes), max_blocks)
        ]
    if not isinstance(event, BlockStored) or not event.block_size or not event.token_ids:
        return [event]  # no token layout to cut along (a hash-only offload): one piece
    size = event.block_size
    pieces: list[Event] = []
    for i in range(0, len(hashes), max_blocks):
        last = i + max_blocks >= len(hashes)
        pieces.append(
            dataclasses.replace(
                event,
                block_hashes=hashes[i : i + max_blocks],
                parent_block_hash=event.parent_block_hash if i == 0 else hashes[i - 1],
                token_ids=event.token_ids[i * size :]
                if last
                else event.token_ids[i * size : (i + max_blocks) * size],
                extra_keys=None if event.extra_keys is None else event.extra_keys[i : i + max_blocks],
            )
        )
    return pieces


def holder_id(pod: str, rank: int | None) -> str:
    """The index identity of an engine: the pod, or ``<pod>#dp<r>`` for data-parallel rank r > 0
    (each rank has its own cache and its own engine hashes)."""
    return pod if not rank else f"{pod}{DP_RANK_SEPARATOR}{rank}"


@dataclass(slots=True)
class _PodState:
    """What the applier remembers per engine between events."""

    parents: OrderedDict  # engine hash -> digest, most recent last
    aligned: bool | None = None  # did the last computed block's engine hash equal our key?


class EventApplier:
    """Stages batches as index updates and flushes them. One instance per worker; a pod is only
    ever applied by one worker (its events stay in order), so per-pod state needs no lock."""

    def __init__(self, index: KVIndex, *, config: Callable[[], ServiceConfig], stats: IngestStats) -> None:
        self.index = index
        self.config = config
        self.stats = stats
        self._pods: dict[tuple[str, str], _PodState] = {}
        self._updates: list[IndexUpdate] = []
        self._counts: list[tuple[StreamStats | None, str]] = []  # per update: the counter it adds to
        self._batch_times: list[float] = []
        self._staged_blocks = 0  # blocks staged since the last flush (stage_steps' budget)
        self._seed: str | None = None

    def apply(
        self, *, pod: str, model: str, seq: int, batch: EventBatch, received_at: float | None = None
    ) -> None:
        """Stage and flush one batch."""
        self.stage(pod=pod, model=model, seq=seq, batch=batch, received_at=received_at)
        self.flush()

    def stage(
        self,
        *,
        pod: str,
        model: str,
        seq: int,
        batch: EventBatch,
        received_at: float | None = None,
        replayed: bool = False,
    ) -> None:
        """Count ``batch`` and turn its events into pending index updates, followed by the
        engine's progress (``seq``), which the index writes atomically with the last of them.
        A ``replayed`` batch (missed live, asked from the engine) counts as such and stays out
        of the lag and latency figures, which describe the live stream."""
        for _ in self.stage_steps(
            pod=pod, model=model, seq=seq, batch=batch, received_at=received_at, replayed=replayed
        ):
            self.flush()

    def stage_steps(
        self,
        *,
        pod: str,
        model: str,
        seq: int,
        batch: EventBatch,
        received_at: float | None = None,
        replayed: bool = False,
    ) -> Iterator[None]:
        """``stage``, a slice at a time: before staging the next slice, it yields whenever
        ``SLICE_BLOCKS`` blocks or more are staged since the last ``flush`` (the caller flushes
        there, and may let other engines' work in meanwhile), so no batch, however large,
        holds a worker or the index for long. The progress follows the last slice."""
        now = received_at if received_at is not None else time.time()
        rank = batch.data_parallel_rank or 0
        stream = self.stats.stream(pod, rank, model)
        stream.batches += 1
        stream.last_event_at = now
        if replayed:
            stream.replayed_batches += 1
        else:
            stream.lag_seconds = max(0.0, now - batch.ts) if batch.ts else 0.0
        holder = holder_id(pod, rank)
        for error in batch.errors:
            stream.decode_errors[error.reason] += 1
        for events, blocks in event_slices(batch.events, SLICE_BLOCKS):
            if self._staged_blocks and self._staged_blocks + blocks > SLICE_BLOCKS:
                yield
            self._staged_blocks += blocks
            yield from self._stage_events(pod=pod, model=model, holder=holder, events=events, stream=stream)
        self._updates.append(Progress(model, holder, seq))
        self._counts.append((None, ""))
        if batch.ts and batch.events and not replayed:
            self._batch_times.append(batch.ts)

    def clear_steps(self, *, model: str, holder: str) -> Iterator[None]:
        """Clear what the index holds of engine ``holder`` (its state was lost, or it restarted),
        after anything staged: as ``stage_steps``, flush where it yields."""
        self._pods.pop((holder, model), None)
        yield from self._clear_index_steps(model, holder)

    def _clear_index_steps(self, model: str, holder: str) -> Iterator[None]:
        """The engine's entries out of the index, ``SLICE_BLOCKS`` at a time (an engine may hold
        a hundred thousand blocks: ~1 s of Valkey's time in one go), yielding between: first so
        that what is staged is written before, then after every slice but the last."""
        if self._updates:
            yield
        while not self.index.clear_pod_slice(pod=holder, model=model, limit=SLICE_BLOCKS)[1]:
            yield

    def _stage_events(
        self, *, pod: str, model: str, holder: str, events: Sequence[Event], stream: StreamStats
    ) -> Iterator[None]:
        config = self.config()
        if config.seed != self._seed:
            # Every digest remembered was chained from the old seed's root: forget them all.
            self._pods.clear()
            self._seed = config.seed
        if pod in config.disabled_pods:
            stream.ignored_batches += 1
            self._clear_disabled(pod)
            return
        state = self._pods.get((holder, model))
        if state is None:
            state = self._pods[(holder, model)] = _PodState(parents=OrderedDict())
        cleared = False  # was the event before an AllBlocksCleared?
        for event in events:
            stream.events += 1
            if isinstance(event, BlockStored):
                self._stage_store(
                    event, model=model, holder=holder, state=state, stream=stream, config=config
                )
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    state.parents.pop(h, None)
                self._pend(Remove(model, holder, event.tier, event.block_hashes), stream, "blocks_removed")
            elif isinstance(event, AllBlocksCleared):
                state.parents.clear()
                stream.clears += 1
                if not cleared:  # a repeat clears nothing more
                    yield from self._clear_index_steps(model, holder)
            cleared = isinstance(event, AllBlocksCleared)

    def flush(self) -> None:
        """Apply every pending update in one round trip. On ``IndexUnavailable`` nothing pending
        is lost: calling ``flush`` again retries it (updates are idempotent)."""
        if self._updates:
            results = self.index.apply_updates(self._updates)
            for (stream, counter), n in zip(self._counts, results, strict=True):
                if counter:
                    setattr(stream, counter, getattr(stream, counter) + n)
            self._updates, self._counts = [], []
        self._staged_blocks = 0
        if self._batch_times:
            now = time.time()
            for ts in self._batch_times:
                self.stats.observe_visible(now - ts)
            self._batch_times = []

    def discard_staged(self, mark: int) -> None:
        """Drop updates staged after ``mark`` (``pending``): a message whose staging failed half
        way is staged again from scratch."""
        del self._updates[mark:]
        del self._counts[mark:]

    @property
    def pending(self) -> int:
        return len(self._updates)

    def forget(self, pod: str) -> None:
        """Drop what is remembered of ``pod`` (it was disabled or deleted)."""
        for key in [k for k in self._pods if k[0] == pod or k[0].startswith(pod + "#dp")]:
            del self._pods[key]

    def _clear_disabled(self, pod: str) -> None:
        """The first batch of a pod after it was disabled clears what this worker indexed for it,
        ordered after anything of it still staged (the web process cleared it when disabling,
        but an in-flight flush could have written after that)."""
        for holder, model in [k for k in self._pods if k[0] == pod or k[0].startswith(pod + "#dp")]:
            del self._pods[(holder, model)]
            self._updates.append(ClearPod(model, holder))
            self._counts.append((None, ""))

    def _pend(self, update: IndexUpdate, stream: StreamStats, counter: str) -> None:
        self._updates.append(update)
        self._counts.append((stream, counter))

    # --- BlockStored ---------------------------------------------------------------------

    def _stage_store(
        self,
        event: BlockStored,
        *,
        model: str,
        holder: str,
        state: _PodState,
        stream: StreamStats,
        config: ServiceConfig,
    ) -> None:
        if not event.block_hashes:
            return
        if not event.token_ids:
            blocks = self._hash_only_blocks(event, model=model, holder=holder, state=state, stream=stream)
        else:
            blocks = self._computed_blocks(
                event, model=model, holder=holder, state=state, stream=stream, config=config
            )
        if not blocks:
            return
        self._pend(Store(model, holder, event.tier, blocks), stream, "blocks_stored")
        stream.resyncing = False  # it stores again: what it holds from now on is known
        parents = state.parents
        for b in blocks:
            parents[b.engine_hash] = b.digest
            parents.move_to_end(b.engine_hash)
        while len(parents) > PARENT_CACHE_SIZE:
            parents.popitem(last=False)

    def _hash_only_blocks(
        self, event: BlockStored, *, model: str, holder: str, state: _PodState, stream: StreamStats
    ) -> list[StoredBlock]:
        """An offload event (no token ids): add a tier to blocks already known by engine hash."""
        digests = self._resolve(event.block_hashes, model=model, holder=holder, state=state)
        blocks = [StoredBlock(key_of(d), h, d) for h, d in zip(event.block_hashes, digests, strict=True) if d]
        stream.orphaned_blocks += len(event.block_hashes) - len(blocks)
        return blocks

    def _computed_blocks(
        self,
        event: BlockStored,
        *,
        model: str,
        holder: str,
        state: _PodState,
        stream: StreamStats,
        config: ServiceConfig,
    ) -> list[StoredBlock]:
        hashes = event.block_hashes
        block_size = event.block_size or config.model(model).block_size
        tokens = event.token_ids
        if block_size <= 0 or len(tokens) < len(hashes) * block_size:
            stream.decode_errors["token_count"] += 1
            return []
        if event.parent_block_hash is None:
            parent: Digest | None = root_digest(config.seed)
        else:
            parent = self._resolve([event.parent_block_hash], model=model, holder=holder, state=state)[0]
        if parent is None or len(parent) != DIGEST_SIZE:
            # Parent unknown (or adopted, so its digest is unknown): the chain cannot continue.
            if state.aligned:
                return [StoredBlock(h, h, h.to_bytes(8, "big")) for h in hashes]
            stream.orphaned_blocks += len(hashes)
            return []
        # vLLM >= 0.11 sends each block's extra keys (LoRA name first, multimodal ids, cache
        # salt) and they are hashed as sent; older engines only send lora_name.
        n = len(hashes)
        per_block = event.extra_keys
        if per_block is None:
            digests = chain_digests(
                tokens[: n * block_size],
                block_size=block_size,
                parent=parent,
                extra=extra_keys(lora_name=event.lora_name),
            )
        else:
            digests = []
            for i in range(n):
                parent = block_digest(parent, tokens[i * block_size : (i + 1) * block_size], per_block[i])
                digests.append(parent)
        blocks = [StoredBlock(key_of(d), h, d) for d, h in zip(digests, hashes, strict=True)]
        aligned = sum(b.key == b.engine_hash for b in blocks)
        stream.aligned_blocks += aligned
        stream.misaligned_blocks += len(hashes) - aligned
        state.aligned = blocks[-1].key == blocks[-1].engine_hash
        return blocks

    def _resolve(
        self, engine_hashes: Sequence[int], *, model: str, holder: str, state: _PodState
    ) -> list[Digest | None]:
        """Digests of engine hashes: from this pod's recent blocks, else from the index (after
        flushing, so that what was staged is visible)."""
        parents = state.parents
        found = [parents.get(h) for h in engine_hashes]
        missing = [h for h, d in zip(engine_hashes, found, strict=True) if d is None]
        if missing:
            self.flush()
            resolved = dict(
                zip(missing, self.index.resolve(model=model, pod=holder, engine_hashes=missing), strict=True)
            )
            found = [d if d is not None else resolved[h] for h, d in zip(engine_hashes, found, strict=True)]
        return found
