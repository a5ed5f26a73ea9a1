"""Turns decoded KV events into index updates: the write path's logic, with no I/O of its own.

Keying rule (vllm-kv-events.md section 3): a stored block is keyed by the block key we compute
from its ``token_ids``, chained from its parent's digest (found through the pod's engine-hash ->
digest map), with the event's ``lora_name`` as extra key. Engine hashes are only handles: for
``BlockRemoved`` and for finding a parent. The chain is never restarted from the root when the
parent is unknown (that yields keys no prompt can match): if the pod's engine hashes have been
equal to our keys (its seed and algorithm are ours), its engine hashes are adopted as keys;
otherwise the blocks are skipped and counted as orphaned.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ingest.stats import IngestStats, StreamStats
from scoring.config import ServiceConfig
from scoring.index import KVIndex, StoredBlock
from scoring.keys import DIGEST_SIZE, Digest, block_digest, extra_keys, key_of, root_digest

log = logging.getLogger(__name__)

PARENT_CACHE_SIZE = 8192
"""Engine hash -> digest entries kept per pod, so a parent is usually found without a round trip."""


def holder_id(pod: str, rank: int | None) -> str:
    """The index identity of an engine: the pod, or ``<pod>#dp<r>`` for data-parallel rank r > 0
    (each rank has its own cache and its own engine hashes)."""
    return pod if not rank else f"{pod}#dp{rank}"


@dataclass(slots=True)
class _PodState:
    """What the applier remembers per engine between events."""

    parents: OrderedDict  # engine hash -> digest, most recent last
    aligned: bool | None = None  # did the last computed block's engine hash equal our key?


class EventApplier:
    """Applies batches to ``index``. One instance per worker; a pod is only ever applied by one
    worker (events of a pod stay in order), so per-pod state needs no lock."""

    def __init__(self, index: KVIndex, *, config: Callable[[], ServiceConfig], stats: IngestStats) -> None:
        self.index = index
        self.config = config
        self.stats = stats
        self._pods: dict[tuple[str, str], _PodState] = {}

    def apply(
        self, *, pod: str, model: str, seq: int, batch: EventBatch, received_at: float | None = None
    ) -> None:
        now = received_at if received_at is not None else time.time()
        rank = batch.data_parallel_rank or 0
        stream = self.stats.stream(pod, rank, model)
        stream.batches += 1
        stream.last_event_at = now
        stream.lag_seconds = max(0.0, now - batch.ts) if batch.ts else 0.0
        stream.observe_seq(seq)
        for error in batch.errors:
            stream.decode_errors[error.reason] += 1
        config = self.config()
        if pod in config.disabled_pods:
            stream.ignored_batches += 1
            return
        holder = holder_id(pod, rank)
        state = self._pods.get((holder, model))
        if state is None:
            state = self._pods[(holder, model)] = _PodState(parents=OrderedDict())
        for event in batch.events:
            stream.events += 1
            if isinstance(event, BlockStored):
                self._store(event, model=model, holder=holder, state=state, stream=stream, config=config)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    state.parents.pop(h, None)
                stream.blocks_removed += self.index.remove(
                    model=model, pod=holder, tier=event.tier, engine_hashes=event.block_hashes
                )
            elif isinstance(event, AllBlocksCleared):
                state.parents.clear()
                self.index.clear_pod(pod=holder, model=model)
                stream.clears += 1
        if batch.ts and batch.events:
            self.stats.observe_visible(time.time() - batch.ts)

    def forget(self, pod: str) -> None:
        """Drop what is remembered of ``pod`` (it was disabled or deleted)."""
        for key in [k for k in self._pods if k[0] == pod or k[0].startswith(pod + "#dp")]:
            del self._pods[key]

    # --- BlockStored ---------------------------------------------------------------------

    def _store(
        self,
        event: BlockStored,
        *,
        model: str,
        holder: str,
        state: _PodState,
        stream: StreamStats,
        config: ServiceConfig,
    ) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        if not event.token_ids:
            blocks = self._hash_only_blocks(event, model=model, holder=holder, state=state, stream=stream)
        else:
            blocks = self._computed_blocks(
                event, model=model, holder=holder, state=state, stream=stream, config=config
            )
        if blocks:
            self.index.store(model=model, pod=holder, tier=event.tier, blocks=blocks)
            stream.blocks_stored += len(blocks)
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
        extra = extra_keys(lora_name=event.lora_name)
        per_block_extra = event.extra_keys
        blocks: list[StoredBlock] = []
        aligned = 0
        for i, engine_hash in enumerate(hashes):
            block_extra = extra
            if per_block_extra is not None and i < len(per_block_extra) and per_block_extra[i]:
                block_extra = (*(extra or ()), *per_block_extra[i])
            parent = block_digest(parent, tokens[i * block_size : (i + 1) * block_size], block_extra)
            key = key_of(parent)
            aligned += key == engine_hash
            blocks.append(StoredBlock(key, engine_hash, parent))
        stream.aligned_blocks += aligned
        stream.misaligned_blocks += len(hashes) - aligned
        state.aligned = blocks[-1].key == blocks[-1].engine_hash
        return blocks

    def _resolve(self, engine_hashes, *, model: str, holder: str, state: _PodState) -> list[Digest | None]:
        parents = state.parents
        found = [parents.get(h) for h in engine_hashes]
        missing = [h for h, d in zip(engine_hashes, found, strict=True) if d is None]
        if missing:
            resolved = dict(
                zip(missing, self.index.resolve(model=model, pod=holder, engine_hashes=missing), strict=True)
            )
            found = [d if d is not None else resolved[h] for h, d in zip(engine_hashes, found, strict=True)]
        return found
