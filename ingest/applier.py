"""Turns decoded KV events into index updates: the write path's logic, with no I/O of its own
beyond the index calls it stages.

Keying rule (vllm-kv-events.md section 3): a stored block is keyed by the block key we compute
from its ``token_ids``, chained from its parent's digest (found through the pod's engine-hash ->
digest map), with the block's extra keys as the event sends them (the LoRA name, multimodal
``(identifier, offset)`` pairs, the cache salt) and, with lookahead hashing, the tokens after it
(``kvindex.keys.block_chain``, which the read path keys requests with too). Engine hashes are only
handles: for ``BlockRemoved`` and for finding a parent. The chain is never restarted from the root
when the parent is unknown (that yields keys no prompt can match): if the pod's engine hashes have
been equal to our keys (its seed and algorithm are ours), its engine hashes are adopted as keys,
up to its first block with extra keys; otherwise the blocks are skipped and counted as orphaned.

Hash alignment (does the engine hash as we do?) judges only blocks that can tell: a block whose
engine hash equals its key counts as aligned; one that differs counts as misaligned only when
neither it nor any block before it in its chain had extra keys, because vLLM >= 0.33 hashes
extras tagged (``("lora", name, path)``, ...), so such blocks never equal our keys whatever the
seed. Blocks an engine reports again (``kv_cache_report_mode="full"`` re-announces every prefix
hit from block 0 with no parent) are stored again, which refreshes them, and are neither counted
as stored nor judged a second time.

An engine whose blocks are not the model's block size (SGLang reports each page of its radix
cache, 1 token by default) is re-chunked: its token ids are cut into the model's blocks along its
chain, so a page of 1 token or of 64 gives the keys vLLM's 16-token blocks give over the same
tokens; a trailing partial block is not indexed. A model block is removed with the engine block
that completed it; when one engine block completes several model blocks, the others get derived
engine hashes (``sub_block_hash``) that its ``BlockRemoved`` removes too.

Hybrid models (``kvindex.kv_cache_groups``): the blocks of KV-cache group ``g > 0`` (``group_idx``)
are kept under the holder ``<holder>#g<g>`` with masked keys and digests, each group chained,
removed and cleared on its own (an ``AllBlocksCleared`` clears every group); the groups an event
describes (``kv_cache_spec_kind``) are learned, per pod (``IngestStats.learned_groups``). Only group 0's
blocks are judged for hash alignment (the others repeat its hashes).

Batches are *staged* (turned into ``IndexUpdate`` values, counters bumped) and then *flushed*
together: one index round trip for everything a worker found queued.

With a ``DynamoBlockStore`` (``dynamo``), the blocks keyed from their token ids are also recorded
as NVIDIA Dynamo's indexer knows them (``kvindex.dynamo``), before the index stores them, for
``/kv-indexer/dump``: KV-cache group 0's, not re-chunked, without lookahead hashing. A record's
seed comes from its chain's first block (the cache salt): a child finds its parent's among the
blocks this applier recorded last, else in the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from itertools import accumulate, repeat
from operator import eq, itemgetter, or_
from typing import NamedTuple

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from ingest.stats import IngestStats, StreamStats
from kvindex import KVIndex, StoredBlock
from kvindex.base import ClearPod, IndexUpdate, Progress, Remove, Store, Tier, stored_blocks
from kvindex.dynamo import (
    DynamoBlock,
    DynamoBlockStore,
    block_hash_seed,
    dynamo_block_hashes,
    request_identity,
)
from kvindex.keys import (
    DIGEST_SIZE,
    BlockKey,
    Digest,
    ExtraKeys,
    block_chain,
    chain_digests,
    extra_keys,
    key_of,
    keyed_extra,
    root_digest,
)
from kvindex.kv_cache_groups import GROUP_RULES, group_digest, group_holder
from registry.config import DP_RANK_SEPARATOR, ServiceConfig

CACHED_BLOCKS_PER_PROCESS = 32_768
"""What an ingest process keeps of its engines' recent blocks, over all of them and shared out
between its workers (``EventApplier.cache_budget``): parents and re-chunked pages, ~250 bytes
each, ~8 MiB. Past it, the engines a worker heard from least recently are forgotten: a block
chained from one of theirs is then looked up in the index (a round trip, never a wrong key). So
however many pods send, and whatever they send, what ingest keeps of their blocks stays bounded."""

BUDGET_CHECK_SECONDS = 1.0
"""How often a worker counts what it keeps against its ``cache_budget``."""

PARENT_CACHE_SIZE = 8192
"""Engine hash -> digest entries kept per pod, so a parent is usually found without a round trip."""

PAGE_CACHE_SIZE = 32768
"""Engine blocks kept per re-chunked pod (SGLang: a page, often of 1 token) with the model block
their chain is in: a chain continues from a page that ends inside a model block only while it is
remembered here (the index knows only pages that complete a model block)."""

DYNAMO_SEED_CACHE_SIZE = 8192
"""Recently recorded blocks whose Dynamo seed an applier remembers, so a child usually finds its
parent's without a round trip."""

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
                lookahead_token_ids=None
                if event.lookahead_token_ids is None
                else event.lookahead_token_ids[i : i + max_blocks],
            )
        )
    return pieces


def holder_id(pod: str, rank: int | None) -> str:
    """The index identity of an engine: the pod, or ``<pod>#dp<r>`` for data-parallel rank r > 0
    (each rank has its own cache and its own engine hashes)."""
    return pod if not rank else f"{pod}{DP_RANK_SEPARATOR}{rank}"


def sub_block_hash(engine_hash: int, i: int) -> int:
    """The engine hash we give the model block ``i`` places before the last one an engine block
    completed (``i >= 1``; the last one keeps ``engine_hash``): a re-chunked engine block of 64
    tokens holds four 16-token blocks, and the index maps one engine hash to one block."""
    data = engine_hash.to_bytes(8, "big") + i.to_bytes(4, "big")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@lru_cache(maxsize=64)
def _one_tier(tier: str) -> frozenset[str]:
    return frozenset((tier,))


class _Known(NamedTuple):
    """A block the applier saw a pod store, under its engine hash."""

    digest: Digest
    tiers: frozenset[str]  # the tiers it was stored on since
    comparable: bool  # its chain had no extra keys up to it, or its engine hash equalled its key


_new_known = partial(tuple.__new__, _Known)  # _Known(...) without a Python call: one per block
_first, _second, _third = itemgetter(0), itemgetter(1), itemgetter(2)


class _Page(NamedTuple):
    """Where a re-chunked engine block ends: the digest of the last model block its chain
    completed (the root when none) and the tokens after that block (fewer than a model block)."""

    digest: Digest
    tail: tuple[int, ...]


@dataclass(slots=True)
class _PodState:
    """What the applier remembers per engine between events."""

    parents: OrderedDict  # engine hash -> _Known, most recent last
    block_size: int = 0  # the model's block size this state was built with
    aligned: bool | None = None  # did the last judged block's engine hash equal our key?
    pages: OrderedDict = field(default_factory=OrderedDict)  # re-chunked: engine hash -> _Page
    sub_blocks: int = 1  # the most model blocks one engine block of this pod completed
    group: int = 0  # a hybrid model's KV-cache group: its digests are masked in the index
    base: str = ""  # a group > 0: the holder of group 0, whose chain it shares


class EventApplier:
    """Stages batches as index updates and flushes them. One instance per worker; a pod is only
    ever applied by one worker (its events stay in order), so per-pod state needs no lock."""

    def __init__(
        self,
        index: KVIndex,
        *,
        config: Callable[[], ServiceConfig],
        stats: IngestStats,
        cache_budget: int = CACHED_BLOCKS_PER_PROCESS,
        dynamo: DynamoBlockStore | None = None,
    ) -> None:
        self.index = index
        self.dynamo = dynamo
        self._dynamo_records: dict[str, dict[BlockKey, DynamoBlock]] = {}  # model -> to write
        self._dynamo_seeds: OrderedDict[tuple[str, BlockKey], int] = OrderedDict()
        self.config = config
        self.stats = stats
        self._pods: dict[tuple[str, str], _PodState] = {}
        self._groups: dict[tuple[str, str], set[int]] = {}  # (holder, model) -> groups > 0 seen
        self._updates: list[IndexUpdate] = []
        self._counts: list[tuple[StreamStats | None, str]] = []  # per update: the counter it adds to
        self._batch_times: list[float] = []
        self._staged_blocks = 0  # blocks staged since the last flush (stage_steps' budget)
        self._seed: str | None = None
        self.cache_budget = cache_budget
        self._budget_checked_at = time.monotonic()

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
        for group_holder_id in self._group_holders(model, holder):
            self._pods.pop((group_holder_id, model), None)
        yield from self._clear_index_steps(model, holder)

    def _group_holders(self, model: str, holder: str) -> list[str]:
        """``holder`` and the holders of its KV-cache groups: those seen, and the model's."""
        groups = self._groups.get((holder, model), set()) | set(
            range(1, len(self.config().model(model).kv_cache_groups))
        )
        return [holder, *(group_holder(holder, g) for g in sorted(groups))]

    def _clear_index_steps(self, model: str, holder: str) -> Iterator[None]:
        """The engine's entries (every KV-cache group's) out of the index, ``SLICE_BLOCKS`` at a
        time (an engine may hold a hundred thousand blocks: ~1 s of Valkey's time in one go),
        yielding between: first so that what is staged is written before, then after every
        slice but the last."""
        if self._updates:
            yield
        for cleared in self._group_holders(model, holder):
            while not self.index.clear_pod_slice(pod=cleared, model=model, limit=SLICE_BLOCKS)[1]:
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
        block_size = config.model(model).block_size
        cleared = False  # was the event before an AllBlocksCleared?
        for event in events:
            stream.events += 1
            if isinstance(event, AllBlocksCleared):
                for group_holder_id in self._group_holders(model, holder):
                    state = self._pods.get((group_holder_id, model))
                    if state is not None:
                        state.parents.clear()
                        state.pages.clear()
                stream.clears += 1
                if not cleared:  # a repeat clears nothing more
                    yield from self._clear_index_steps(model, holder)
            else:
                group = event.group_idx or 0
                indexed_as, state = self._state(model, holder, group, block_size)
                if isinstance(event, BlockStored):
                    kind = event.kv_cache_spec_kind
                    if kind in GROUP_RULES:  # an unknown kind says nothing we use
                        window = event.kv_cache_spec_sliding_window if GROUP_RULES[kind] == "window" else None
                        self.stats.learn_group(pod, model, group, kind, window)
                    self._stage_store(
                        event, model=model, holder=indexed_as, state=state, stream=stream, config=config
                    )
                else:
                    hashes = _forget(state, event)
                    self._pend(Remove(model, indexed_as, event.tier, hashes), stream, "blocks_removed")
            cleared = isinstance(event, AllBlocksCleared)

    def _state(self, model: str, holder: str, group: int, block_size: int) -> tuple[str, _PodState]:
        """The holder a KV-cache group of ``holder`` is indexed as, and what is remembered of it."""
        indexed_as = group_holder(holder, group)
        state = self._pods.pop((indexed_as, model), None)  # put back last: most recently used
        if state is None or state.block_size != block_size:
            # Digests and re-chunked pages were cut at the model's block size: a new one starts over.
            state = _PodState(parents=OrderedDict(), block_size=block_size, group=group, base=holder)
            if group:
                self._groups.setdefault((holder, model), set()).add(group)
        self._pods[(indexed_as, model)] = state
        return indexed_as, state

    def flush(self) -> None:
        """Apply every pending update in one round trip. On ``IndexUnavailable`` nothing pending
        is lost: calling ``flush`` again retries it (updates are idempotent)."""
        if self._dynamo_records:
            for model, records in list(self._dynamo_records.items()):
                self.dynamo.record(model=model, blocks=records)
                del self._dynamo_records[model]
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
        if time.monotonic() - self._budget_checked_at >= BUDGET_CHECK_SECONDS:
            self.keep_budget()

    def keep_budget(self) -> int:
        """Forget the engines heard from least recently until what is kept of their blocks is
        under ``cache_budget`` (an engine's own state counts as two blocks); returns how many
        engine states went."""
        self._budget_checked_at = time.monotonic()
        kept = sum(len(s.parents) + len(s.pages) + 2 for s in self._pods.values())
        if kept <= self.cache_budget:
            return 0
        forgotten = 0
        for key in list(self._pods):  # least recently used first
            state = self._pods.pop(key)
            kept -= len(state.parents) + len(state.pages) + 2
            forgotten += 1
            if kept <= self.cache_budget * 3 // 4:  # room for a while, not a check every second
                break
        return forgotten

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
        for key in [k for k in list(self._pods) if k[0] == pod or k[0].startswith(pod + "#")]:
            self._pods.pop(key, None)
        for key in [k for k in list(self._groups) if k[0] == pod or k[0].startswith(pod + "#")]:
            self._groups.pop(key, None)

    def _clear_disabled(self, pod: str) -> None:
        """The first batch of a pod after it was disabled clears what this worker indexed for it,
        ordered after anything of it still staged (the web process cleared it when disabling,
        but an in-flight flush could have written after that)."""
        for holder, model in [k for k in self._pods if k[0] == pod or k[0].startswith(pod + "#")]:
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
        judged: list[bool] | None = None  # per block: may a differing engine hash count as misaligned?
        if not event.token_ids:
            blocks = self._hash_only_blocks(event, model=model, holder=holder, state=state, stream=stream)
        elif event.block_size and event.block_size != config.model(model).block_size:
            blocks = self._rechunked_blocks(
                event, model=model, holder=holder, state=state, stream=stream, config=config
            )
            judged = [False] * len(blocks)
        else:
            blocks, judged = self._computed_blocks(
                event, model=model, holder=holder, state=state, stream=stream, config=config
            )
        if not blocks:
            return
        if state.group:
            judged = None  # the other groups repeat group 0's engine hashes: judged there
        tier = event.tier
        parents = state.parents
        hashes = list(map(_second, blocks))
        if parents.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes):
            # Every block is new to this pod (the usual case): the loop below, in bulk.
            repeated: list[StoredBlock] = []
            fresh = blocks
            aligned, misaligned, last_judged = _remember_new(blocks, hashes, judged, tier, parents)
        else:
            repeated, fresh, aligned, misaligned, last_judged = _remember(blocks, judged, tier, parents)
        while len(parents) > PARENT_CACHE_SIZE:
            parents.popitem(last=False)
        stream.aligned_blocks += aligned
        stream.misaligned_blocks += misaligned
        if last_judged is not None:
            state.aligned = last_judged
        if state.group:
            repeated, fresh = _in_group(repeated, state.group), _in_group(fresh, state.group)
        if repeated:
            self._pend(Store(model, holder, tier, repeated), stream, "")
        if fresh:
            self._pend(Store(model, holder, tier, fresh), stream, "blocks_stored")
        stream.resyncing = False  # it stores again: what it holds from now on is known

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
    ) -> tuple[list[StoredBlock], list[bool] | None]:
        """The event's blocks keyed from their token ids, and per block whether its engine hash
        can be judged against its key (``None``: none can)."""
        hashes = event.block_hashes
        n = len(hashes)
        block_size = event.block_size or config.model(model).block_size
        tokens = event.token_ids
        if block_size <= 0 or len(tokens) < n * block_size:
            stream.decode_errors["token_count"] += 1
            return [], None
        # vLLM >= 0.11 sends each block's extra keys; older engines only send lora_name.
        sent: Sequence[ExtraKeys] = (
            event.extra_keys if event.extra_keys is not None else (extra_keys(lora_name=event.lora_name),) * n
        )
        parent, comparable = self._parent(
            event.parent_block_hash, seed=config.seed, model=model, holder=holder, state=state
        )
        if parent is None or len(parent) != DIGEST_SIZE:
            # Parent unknown (or adopted, so its digest is unknown): the chain cannot continue.
            # An aligned pod's engine hashes are its keys, up to its first block with extras.
            adopted: list[StoredBlock] = []
            if state.aligned:
                for h, extra in zip(hashes, sent, strict=True):
                    if extra is not None:
                        break
                    adopted.append(StoredBlock(h, h, h.to_bytes(8, "big")))
            stream.orphaned_blocks += n - len(adopted)
            return adopted, None
        lookahead = event.lookahead_token_ids
        extras = (
            sent if lookahead is None else [keyed_extra(e, t) for e, t in zip(sent, lookahead, strict=True)]
        )
        digests = block_chain(tokens, block_size=block_size, parent=parent, extras=extras)
        if self.dynamo is not None and not state.group and lookahead is None:
            self._describe(
                event, model=model, parent=parent, digests=digests, sent=sent, block_size=block_size
            )
        blocks = stored_blocks(digests, hashes)
        matched = map(eq, map(_first, blocks), hashes)
        if sent.count(None) == n:  # no extras: comparable from the first matched block on
            return blocks, list(accumulate(matched, or_, initial=comparable))[1:]
        judged: list[bool] = []
        for is_key, extra in zip(matched, sent, strict=True):
            comparable = (comparable and extra is None) or is_key
            judged.append(comparable)
        return blocks, judged

    def _describe(
        self,
        event: BlockStored,
        *,
        model: str,
        parent: Digest,
        digests: Sequence[Digest],
        sent: Sequence[ExtraKeys],
        block_size: int,
    ) -> None:
        """Stage the Dynamo records of an event's blocks, chained from the digest ``parent``
        (module docstring). An event whose token ids are not u32 (Dynamo's type) has none."""
        before = None if event.parent_block_hash is None else key_of(parent)
        if before is None:
            salt, _ = request_identity(sent[0], lora_name=event.lora_name)
            seed = block_hash_seed(lora_name=event.lora_name, cache_salt=salt)
        else:
            seed = self._dynamo_seed(model, before, lora_name=event.lora_name)
        objects = [request_identity(extra, lora_name=event.lora_name)[1] for extra in sent]
        try:
            tokens = event.token_ids[: len(digests) * block_size]
            hashes = dynamo_block_hashes(tokens, block_size=block_size, seed=seed, mm_hashes=objects)
        except ValueError:
            return
        records = self._dynamo_records.setdefault(model, {})
        seeds = self._dynamo_seeds
        for digest, block_hash in zip(digests, hashes, strict=True):
            key = key_of(digest)
            records[key] = DynamoBlock(before, seed, block_hash)
            seeds[(model, key)] = seed
            seeds.move_to_end((model, key))
            before = key
        while len(seeds) > DYNAMO_SEED_CACHE_SIZE:
            seeds.popitem(last=False)

    def _dynamo_seed(self, model: str, parent: BlockKey, *, lora_name: str | None) -> int:
        """The Dynamo seed of ``parent``'s chain: remembered, staged, or read from the store;
        without a record, the seed of the LoRA alone (the parent is then not in dumps either)."""
        seed = self._dynamo_seeds.get((model, parent))
        if seed is None:
            staged = self._dynamo_records.get(model, {}).get(parent)
            found = staged or self.dynamo.get(model=model, keys=[parent])[0]
            seed = found.seed if found is not None else block_hash_seed(lora_name=lora_name)
        return seed

    def _rechunked_blocks(
        self,
        event: BlockStored,
        *,
        model: str,
        holder: str,
        state: _PodState,
        stream: StreamStats,
        config: ServiceConfig,
    ) -> list[StoredBlock]:
        """The model blocks an engine block of another size completes along its chain (module
        docstring). Extra keys other than the LoRA name and lookahead hashing cannot be cut
        across block sizes: such events are counted (``decode_errors["rechunk_extras"]``) and
        their blocks orphaned."""
        hashes, tokens = event.block_hashes, event.token_ids
        size, page = config.model(model).block_size, event.block_size
        n = len(hashes)
        if size <= 0 or len(tokens) < n * page:
            stream.decode_errors["token_count"] += 1
            return []
        extra = extra_keys(lora_name=event.lora_name)
        if event.lookahead_token_ids is not None or (
            event.extra_keys is not None and any(e != extra for e in event.extra_keys)
        ):
            stream.decode_errors["rechunk_extras"] += 1
            stream.orphaned_blocks += n
            return []
        start = self._page(
            event.parent_block_hash, size, page, seed=config.seed, model=model, holder=holder, state=state
        )
        if start is None:
            stream.orphaned_blocks += n
            return []
        digest, tail = start
        pages = state.pages
        blocks: list[StoredBlock] = []
        for i, h in enumerate(hashes):
            pending = tail + tuple(tokens[i * page : (i + 1) * page])
            full = len(pending) // size
            if full:
                digests = chain_digests(pending[: full * size], block_size=size, parent=digest, extra=extra)
                for j, d in enumerate(digests):
                    engine_hash = h if j == full - 1 else sub_block_hash(h, full - 1 - j)
                    blocks.append(StoredBlock(key_of(d), engine_hash, d))
                digest = digests[-1]
                state.sub_blocks = max(state.sub_blocks, full)
            tail = pending[full * size :]
            pages[h] = _Page(digest, tail)
            pages.move_to_end(h)
        while len(pages) > PAGE_CACHE_SIZE:
            pages.popitem(last=False)
        return blocks

    def _parent(
        self, engine_hash: int | None, *, seed: str, model: str, holder: str, state: _PodState
    ) -> tuple[Digest | None, bool]:
        """The digest a parent engine hash stands for (the root for none; ``None``: unknown),
        and whether blocks chained from it may be judged for alignment: a parent learned from
        the index only when its own engine hash was its key."""
        if engine_hash is None:
            return root_digest(seed), True
        known = state.parents.get(engine_hash)
        if known is not None:
            return known.digest, known.comparable
        digest = self._resolve([engine_hash], model=model, holder=holder, state=state)[0]
        return digest, digest is not None and key_of(digest) == engine_hash

    def _page(
        self,
        engine_hash: int | None,
        size: int,
        page: int,
        *,
        seed: str,
        model: str,
        holder: str,
        state: _PodState,
    ) -> _Page | None:
        """Where a re-chunked chain goes on from (``None``: unknown). A page the applier forgot
        is found in the index when it completed a model block, which ends on a block boundary
        (so leaves no tail) when one size divides the other."""
        if engine_hash is None:
            return _Page(root_digest(seed), ())
        found = state.pages.get(engine_hash)
        if found is not None:
            return found
        if size % page and page % size:
            return None
        digest = self._resolve([engine_hash], model=model, holder=holder, state=state)[0]
        return _Page(digest, ()) if digest is not None and len(digest) == DIGEST_SIZE else None

    def _resolve(
        self, engine_hashes: Sequence[int], *, model: str, holder: str, state: _PodState
    ) -> list[Digest | None]:
        """Digests of engine hashes: from this pod's recent blocks, else from the index (after
        flushing, so that what was staged is visible). A KV-cache group > 0 falls back on group
        0's: every group hashes the same chain, and a window that dropped a block still continues
        its chain from it (vLLM's next ``BlockStored`` names it as the parent)."""
        parents = state.parents
        found = [None if (k := parents.get(h)) is None else k.digest for h in engine_hashes]
        missing = [h for h, d in zip(engine_hashes, found, strict=True) if d is None]
        if missing:
            self.flush()
            answers = self.index.resolve(model=model, pod=holder, engine_hashes=missing)
            if state.group:
                answers = [None if d is None else group_digest(d, state.group) for d in answers]
            resolved = dict(zip(missing, answers, strict=True))
            found = [d if d is not None else resolved[h] for h, d in zip(engine_hashes, found, strict=True)]
        if state.group and None in found:
            base = self._pods.get((state.base, model)) or _PodState(parents=OrderedDict())
            missing = [h for h, d in zip(engine_hashes, found, strict=True) if d is None]
            fallback = dict(
                zip(missing, self._resolve(missing, model=model, holder=state.base, state=base), strict=True)
            )
            found = [d if d is not None else fallback[h] for h, d in zip(engine_hashes, found, strict=True)]
        return found


def _remember(
    blocks: list[StoredBlock], judged: list[bool] | None, tier: Tier, parents: OrderedDict
) -> tuple[list[StoredBlock], list[StoredBlock], int, int, bool | None]:
    """Record ``blocks`` in the pod's recent ``parents``: (blocks stored again on the same
    tier, blocks to store, aligned and misaligned counts, whether the last judged block was
    aligned, ``None`` when none was judged)."""
    tiers = _one_tier(tier)
    get = parents.get
    fresh: list[StoredBlock] = []
    repeated: list[StoredBlock] = []
    aligned = misaligned = 0
    last_judged: bool | None = None
    for i, b in enumerate(blocks):
        key, h, digest = b
        known = get(h)
        if known is not None and known[0] == digest:
            if tier in known.tiers:
                repeated.append(b)  # reported again (report mode "full", a resend): refresh only
            else:
                parents[h] = known._replace(tiers=known.tiers | tiers)
                fresh.append(b)
            parents.move_to_end(h)
            continue
        matched = key == h
        if judged is not None and (matched or judged[i]):
            last_judged = matched
            aligned += matched
            misaligned += not matched
        parents[h] = _new_known((digest, tiers, matched or (judged is not None and judged[i])))
        if known is not None:
            parents.move_to_end(h)  # a new key is appended last already
        fresh.append(b)
    return repeated, fresh, aligned, misaligned, last_judged


def _remember_new(
    blocks: list[StoredBlock],
    hashes: list[int],
    judged: list[bool] | None,
    tier: Tier,
    parents: OrderedDict,
) -> tuple[int, int, bool | None]:
    """``_remember`` of blocks none of which ``parents`` holds (distinct engine hashes), with
    C loops: every block is fresh; a block is comparable when its key is its engine hash or
    it is judged, and counts as aligned or misaligned only then."""
    matched = list(map(eq, map(_first, blocks), hashes))
    aligned = misaligned = 0
    last_judged: bool | None = None
    if judged is None:
        comparable = matched
    else:
        comparable = list(map(or_, matched, judged))
        counted = comparable.count(True)
        if counted:
            aligned = matched.count(True)
            misaligned = counted - aligned
            last_judged = matched[len(comparable) - 1 - comparable[::-1].index(True)]
    known = map(_new_known, zip(map(_third, blocks), repeat(_one_tier(tier)), comparable, strict=False))
    parents.update(zip(hashes, known, strict=True))
    return aligned, misaligned, last_judged


def _in_group(blocks: list[StoredBlock], group: int) -> list[StoredBlock]:
    """``blocks`` as KV-cache group ``group`` indexes them: masked keys and digests."""
    out = []
    for b in blocks:
        digest = group_digest(b.digest, group)
        out.append(StoredBlock(key_of(digest), b.engine_hash, digest))
    return out


def _forget(state: _PodState, event: BlockRemoved) -> Sequence[int]:
    """Drop what ``event`` removes from what the applier remembers of the pod; returns the engine
    hashes the index must remove: those sent and, for a re-chunked pod whose engine blocks
    complete several model blocks, their ``sub_block_hash`` too."""
    hashes: Sequence[int] = event.block_hashes
    if state.sub_blocks > 1:
        hashes = [*hashes, *(sub_block_hash(h, i) for h in hashes for i in range(1, state.sub_blocks))]
    parents, pages, tier = state.parents, state.pages, event.tier
    for h in hashes:
        known = parents.get(h)
        if known is not None:
            tiers = known.tiers - {tier}
            if tiers:
                parents[h] = known._replace(tiers=tiers)  # another tier still holds it
            else:
                del parents[h]
        if pages:
            pages.pop(h, None)
    return hashes
