"""The index interface every backend implements, and the small value types it speaks.

Identity: an entry is ``(pod, tier)`` under a ``(model, block key)``; ``pod1@gpu`` and
``pod1@cpu`` are two entries. Per pod, the index also keeps the engine hash -> digest map that
``BlockRemoved`` events and parent look-ups go through, and keeps it consistent: an engine hash
never points at a block the pod no longer holds.

Besides the blocks, two small records let ingest notice what the index lost or missed:

* progress: per ``(model, holder)``, the seq of the last event batch applied, written by a
  ``Progress`` update atomically with the last update of that batch (``apply_updates``);
* epoch markers: one opaque string per model (``set_epoch`` / ``epochs``), which only the loss of
  the backing store's data removes (a Redis ``FLUSHALL`` or a restart without persistence).

Speculative entries (``speculate`` / ``speculated``): a router's guess that a pod is about to
hold a request's blocks, shared with the other routers (replicas of one gateway) until the pod's
own KV events can say so. They expire after the seconds given, are kept apart from the blocks
(a lookup never sees them) and only at every ``SPECULATION_STRIDE``-th block of a chain and its
last: block keys are chained, so holding the key at a position means holding the whole prefix up
to it.

Slices: no write holds the backend (the Redis server, the memory index's lock) for long. A store
or remove of more than the backend's ``slice_blocks`` blocks or engine hashes is applied in
several slices of at most that many, and a ``clear_pod`` (``clear_model``) removes at most that
many entries per slice. Each slice is atomic and keeps every invariant; a reader may see a prefix
of the slices of one update applied. Updates and slices are applied in order, and a store or
remove of at most ``slice_blocks`` is one slice, so atomic. (A cluster spreads one slice's blocks
over several masters, each written at its own moment: there a reader may also see part of a
slice; ``cluster``'s module docstring says what still holds.)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import NamedTuple, Protocol, TypeVar

from kvindex.keys import BlockKey, Digest, keys_of

Tier = str
"""A storage tier, lower case: "gpu" (vLLM's default medium), "cpu", "fs", ..."""

HolderMap = dict[str, frozenset[Tier]]
"""The holders of one block key: pod -> the tiers it holds the block on."""


class StoredBlock(NamedTuple):
    """One block a pod reported as stored.

    ``digest`` is the full 32-byte chain digest when we computed it from token ids, or the 8-byte
    big-endian key itself when the block was adopted by engine hash (no chain can continue from
    it). ``key`` is always ``key_of(digest)``. A tuple, so that ingest makes one per block cheaply
    (:func:`stored_blocks`).
    """

    key: BlockKey
    engine_hash: int
    digest: Digest


_new_stored_block = partial(tuple.__new__, StoredBlock)


def stored_blocks(digests: Sequence[Digest], engine_hashes: Sequence[int]) -> list[StoredBlock]:
    """``StoredBlock(key_of(d), h, d)`` for each digest and engine hash, in bulk: the keys in one
    unpacking, the tuples without a Python call each (ingest makes one per block it applies)."""
    return list(map(_new_stored_block, zip(keys_of(digests), engine_hashes, digests, strict=True)))


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


@dataclass(frozen=True, slots=True)
class Progress:
    """The last event ``seq`` applied for ``pod`` (an index holder: a pod, or ``pod#dp<r>``)
    under ``model``, for ``apply_updates``. Written atomically with the update right before it
    when that update is of the same model (see ``KVIndex.apply_updates``); a lower seq than the
    recorded one (an engine restarted) simply replaces it."""

    model: str
    pod: str
    seq: int


IndexUpdate = Store | Remove | ClearPod | Progress

LookupQuery = tuple[Sequence[BlockKey], Collection[str] | None]
"""One ``lookup``'s arguments, for ``lookup_many``: the keys, and the pods (``None``: every pod)."""


SPECULATION_STRIDE = 8
"""Speculative entries are kept at every 8th block of a chain (128 tokens at 16 per block) and at
its last: 1/8 of the writes and reads, prefixes matched to within 8 blocks."""


def speculation_points(n: int) -> list[int]:
    """The positions in a chain of ``n`` keys that speculative entries are written and read at:
    every ``SPECULATION_STRIDE``-th and the last."""
    points = list(range(SPECULATION_STRIDE - 1, n, SPECULATION_STRIDE))
    if n and (not points or points[-1] != n - 1):
        points.append(n - 1)
    return points


def speculated_runs(points: Sequence[int], holders: Sequence[Collection[str]]) -> dict[str, int]:
    """Per pod, the blocks up to and including the last of ``points`` it holds without a gap from
    the first (``holders``: the pods speculated at each point, in order); pods with none left out."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for point, present in zip(points, holders, strict=True):
        alive = set(present) if alive is None else alive.intersection(present)
        if not alive:
            break
        for pod in alive:
            out[pod] = point + 1
    return out


class IndexUnavailable(RuntimeError):
    """The backing store cannot be reached (the API answers 503)."""


_T = TypeVar("_T")


def slices(items: Sequence[_T], size: int) -> list[Sequence[_T]]:
    """``items`` cut, in order, into the fewest slices of at most ``size`` (``size >= 1``), whose
    lengths differ by at most one; ``[items]`` itself when it fits in one."""
    if len(items) <= size:
        return [items]
    count = -(-len(items) // size)
    length, longer = divmod(len(items), count)  # the first `longer` slices get one more
    bounds = [i * length + min(i, longer) for i in range(count + 1)]
    return [items[start:end] for start, end in pairwise(bounds)]


class KVIndex(Protocol):
    """What ingest writes and scoring reads. All methods are thread-safe."""

    slice_blocks: int
    """The most blocks, engine hashes or cleared entries one slice of a write handles."""

    def store(self, *, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        """Record that ``pod`` holds ``blocks`` on ``tier``; idempotent. Atomic per slice (module
        docstring): a call of at most ``slice_blocks`` blocks is atomic."""

    def remove(self, *, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        """Drop ``(pod, tier)`` from the blocks these engine hashes map to; returns how many
        entries went. Unknown hashes are ignored. When the pod no longer holds a block on any
        tier, its engine-hash entry goes too. Atomic per slice (module docstring)."""

    def apply_updates(self, updates: Sequence[IndexUpdate]) -> list[int]:
        """Apply ``updates`` in order, each exactly as (and as atomically as) its single-call
        counterpart, in as few round trips as the slices allow (one for a batch of small stores
        and removes). Returns, per update, the number of blocks stored, entries removed or entries
        cleared (0 for a ``Progress``). Readers may see a prefix of the sequence applied, and of
        the slices of one update, never part of one slice.

        A ``Progress`` is applied in order too, and atomically with the (last slice of the)
        update right before it when that update is of the same model: no reader, and no crash,
        can leave the seq recorded without that update, or the update without the seq. Otherwise
        (first in the list, another model, or an empty store or remove before it) it is written
        on its own."""

    def progress(self, *, model: str | None = None) -> dict[tuple[str, str], int]:
        """``(model, holder) -> seq`` of the last ``Progress`` applied, under ``model`` or every
        model (Redis: every model in its ``models`` set). ``clear_pod`` and ``clear_model`` leave it:
        it records what was applied, not what is held."""

    def epochs(self, models: Sequence[str]) -> list[str | None]:
        """The epoch marker of each model, in order (``None``: there is none); one round trip."""

    def set_epoch(self, *, model: str, value: str, if_absent: bool = False) -> bool:
        """Write ``model``'s epoch marker, an opaque string; with ``if_absent`` only when it has
        none. Returns whether it was written. Clears leave it; only the loss of the backing
        store's data removes it."""

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

    def holders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """The holders of every one of ``keys``, in order, with an empty map for a key nobody holds
        (``lookup`` stops there; this does not): what the other KV-cache groups of a hybrid model
        are scored from (``kvindex.kv_cache_groups``). One round trip."""

    def speculate(self, *, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """Take ``pod`` to hold ``keys`` (a request's block keys, in order) for ``seconds``: a
        router's speculative entry, seen by every reader of this index through ``speculated``
        (module docstring). Bounded: entries expire; the memory index also keeps at most a fixed
        number of them."""

    def speculated(self, *, model: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        """Per pod, how many leading ``keys`` an unexpired speculative entry says it holds (to the
        last speculation point it holds: a multiple of ``SPECULATION_STRIDE``, or all of them);
        pods with none left out. One round trip."""

    def clear_pod(self, *, pod: str, model: str | None = None) -> int:
        """Remove every entry of ``pod`` (under ``model``, or under every model), in slices;
        returns how many (key, tier) entries went."""

    def clear_pod_slice(self, *, pod: str, model: str, limit: int) -> tuple[int, bool]:
        """Remove at most ``limit`` (>= 1) entries of ``pod`` under ``model``, atomically; returns
        how many went and whether the pod is now gone. Called until it says so, it is
        ``clear_pod`` in pieces that leave the index consistent in between (for a caller that
        has other work to do between them)."""

    def clear_model(self, *, model: str) -> int:
        """Remove everything indexed under ``model`` (its seed or block size changed), pod by
        pod, in slices; returns how many (key, pod, tier) entries went. Entries stored while it
        runs may stay."""

    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        """Live block counts per (model, pod), sorted by model then pod."""

    def ping(self) -> None:
        """Raise ``IndexUnavailable`` when the backing store cannot be reached."""

    def close(self) -> None:
        """Release connections; the index is unusable afterwards."""
