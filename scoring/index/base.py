"""The index interface every backend implements, and the small value types it speaks.

Identity: an entry is ``(pod, tier)`` under a ``(model, block key)``; ``pod1@gpu`` and
``pod1@cpu`` are two entries. Per pod, the index also keeps the engine hash -> digest map that
``BlockRemoved`` events and parent look-ups go through, and keeps it consistent: an engine hash
never points at a block the pod no longer holds.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scoring.keys import BlockKey, Digest

Tier = str
"""A storage tier, lower case: "gpu" (vLLM's default medium), "cpu", "fs", ..."""

HolderMap = dict[str, frozenset[Tier]]
"""The holders of one block key: pod -> the tiers it holds the block on."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block a pod reported as stored.

    ``digest`` is the full 32-byte chain digest when we computed it from token ids, or the 8-byte
    big-endian key itself when the block was adopted by engine hash (no chain can continue from
    it). ``key`` is always ``key_of(digest)``.
    """

    key: BlockKey
    engine_hash: int
    digest: Digest


@dataclass(frozen=True, slots=True)
class PodBlocks:
    """Live block counts of one pod under one model, by tier."""

    model: str
    pod: str
    blocks_by_tier: dict[Tier, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.blocks_by_tier.values())


@dataclass(frozen=True, slots=True)
class Store:
    """``store`` as a value, for ``apply_updates``."""

    model: str
    pod: str
    tier: Tier
    blocks: Sequence[StoredBlock]


@dataclass(frozen=True, slots=True)
class Remove:
    """``remove`` as a value, for ``apply_updates``."""

    model: str
    pod: str
    tier: Tier
    engine_hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class ClearPod:
    """``clear_pod`` (of one model) as a value, for ``apply_updates``."""

    model: str
    pod: str


IndexUpdate = Store | Remove | ClearPod

LookupQuery = tuple[Sequence[BlockKey], Collection[str] | None]
"""One ``lookup``'s arguments, for ``lookup_many``: the keys, and the pods (``None``: every pod)."""


class IndexUnavailable(RuntimeError):
    """The backing store cannot be reached (the API answers 503)."""


class KVIndex(Protocol):
    """What ingest writes and scoring reads. All methods are thread-safe."""

    def store(self, *, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        """Record that ``pod`` holds ``blocks`` on ``tier``; idempotent. Atomic per call."""

    def remove(self, *, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        """Drop ``(pod, tier)`` from the blocks these engine hashes map to; returns how many
        entries went. Unknown hashes are ignored. When the pod no longer holds a block on any
        tier, its engine-hash entry goes too. Atomic per call."""

    def apply_updates(self, updates: Sequence[IndexUpdate]) -> list[int]:
        """Apply ``updates`` in order, each exactly as (and as atomically as) its single-call
        counterpart, in one round trip for all of them. Returns, per update, the number of
        blocks stored, entries removed or entries cleared. Readers may see a prefix of the
        sequence applied, never part of one update."""

    def resolve(self, *, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        """The digest each engine hash of ``pod`` maps to (``None`` when unknown)."""

    def lookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """Holders of ``keys`` in order, restricted to ``pods`` when given, stopping before the
        first key that has no (remaining) holder: the result is the longest held run from
        ``keys[0]``, which is all that prefix scoring needs. One round trip. An empty ``pods``
        matches nothing (``[]``). The maps are read-only: blocks with the same holders may share
        one map object (the scorer then scores their run at the cost of one)."""

    def lookup_many(self, *, model: str, queries: Sequence[LookupQuery]) -> list[list[HolderMap]]:
        """``lookup`` for each ``(keys, pods)`` query under ``model``, in order, in one round trip."""

    def clear_pod(self, *, pod: str, model: str | None = None) -> int:
        """Remove every entry of ``pod`` (under ``model``, or under every model); returns how
        many (key, tier) entries went."""

    def clear_model(self, *, model: str) -> int:
        """Remove everything indexed under ``model`` (its seed or block size changed); returns
        how many (key, pod, tier) entries went."""

    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        """Live block counts per (model, pod), sorted by model then pod."""

    def ping(self) -> None:
        """Raise ``IndexUnavailable`` when the backing store cannot be reached."""

    def close(self) -> None:
        """Release connections; the index is unusable afterwards."""
