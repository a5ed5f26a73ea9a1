"""In-process index: bounded, LRU-evicting, consistent across its three maps.

``MemoryIndex`` keeps the lock, the slices, the progress, epochs and speculation; the maps live in
a core: the compiled ``kvindex.native`` ``Core`` (C++, ``kvindex/native/core.hpp``: names interned,
flat hash tables, ~200 bytes per entry) when it is built, else ``PyCore`` below, with the same
calls, answers and invariants (``tests/kvindex/test_native.py`` holds them to each other). The
cost model's constants differ (``Core.entry_bytes``); the rest of this docstring describes
``PyCore``.

State, all guarded by one lock:

* ``_blocks``: ``(model, block key) -> _Block`` in least-recently-used order (a store or a
  lookup hit refreshes a key). At most ``max_keys`` entries; the oldest goes first.
* ``_Block.holders``: the ``(pod, tier)`` entries of one key, oldest first, at most
  ``pod_cache_size`` of them; storing one more evicts the oldest.
* ``_pods[model][pod]``: a ``_PodState`` with the reverse index (tier -> keys), the engine-hash
  map (engine hash -> digest) and, to keep those two consistent, key -> engine hashes.
* ``_progress[(model, holder)]``: the seq of the last ``Progress`` applied (clears leave it);
  ``_epochs[model]``: the epoch markers, which live as long as this object.

Slices: a write holds the lock for at most ``slice_blocks`` blocks, engine hashes or cleared
entries of work (7-12 ms at the default; in one piece, a 65536-block store held it for ~225 ms and
a 65536-hash remove ~215 ms, ``bench/index_slices.py``), then lets waiting threads in and takes it
again; small updates of one ``apply_updates`` share one hold. Every invariant below holds whenever
the lock is free.

Invariants (``_drop_entry`` is the one place an entry leaves, whatever the reason):

* ``(pod, tier)`` is in ``_blocks[(model, key)].holders`` iff ``key`` is in
  ``_pods[model][pod].tiers[tier]``;
* every engine hash of a pod maps to a digest whose key the pod holds on at least one tier;
* no empty containers: a block without holders, a tier without keys, a pod without tiers and a
  model without pods are deleted;
* ``_bytes`` is the cost model below summed over every entry in the three maps; so it is 0 when
  the index is empty. It is kept incrementally: where an entry goes in or leaves, never by a scan.

Cost model (``estimated_bytes``, bounded by ``max_bytes``): an estimate of the memory the three
maps hold, from per-entry constants measured once at import with ``sys.getsizeof`` plus the
lengths of the strings and digests stored:

* a ``(model, key)`` entry: ``KEY_ENTRY_BYTES + len(model)`` (its ``OrderedDict`` slot, the
  ``(model, key)`` tuple, the key int, the ``_Block`` and its holders dict with one holder);
* a ``(pod, tier)`` holder of a key: ``HOLDER_ENTRY_BYTES + len(pod) + len(tier)`` (its slot in
  the holders dict, the ``(pod, tier)`` tuple, the key's slot in the reverse-index set);
* an engine hash: ``ENGINE_ENTRY_BYTES + len(digest)`` (its slot in the engine map, the hash
  int, the digest bytes, its slot and a one-element set in ``hashes_of``).

Each entry is charged as if it owned its tuple and strings, though one store shares them, so the
estimate errs high; per-pod and per-model containers (a handful) are not counted.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from decimal import Decimal
from itertools import islice

from kvindex.base import (
    ClearPod,
    HolderMap,
    IndexUpdate,
    LookupQuery,
    PodBlocks,
    Progress,
    Remove,
    Store,
    StoredBlock,
    Tier,
    slices,
    speculated_runs,
    speculation_points,
)
from kvindex.keys import BlockKey, Digest, key_of
from kvindex.native import module as _native
from kvindex.native import reason as native_reason

DEFAULT_MAX_KEYS = 10_000_000
DEFAULT_POD_CACHE_SIZE = 128
"""Holders kept per key. Upstream keeps 10; a fleet whose pods all cache one long system prompt
would then show only 10 of them warm, so we keep enough for a large fleet (and Redis keeps all)."""
MAX_SPECULATIVE_KEYS = 200_000
"""Speculation points kept (least recently written go first): ~25 per 3,000-token request."""
DEFAULT_SLICE_BLOCKS = 4096
"""Blocks, engine hashes or cleared entries handled per hold of the lock: ~7 ms for a store, ~12 ms
for a remove, ~8 ms for a clear (``bench/index_slices.py``; a collection of CPython's oldest
generation, which stops every thread anyway, can add tens of ms to one)."""


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?", re.IGNORECASE)
_UNITS = {"b": 1} | {
    unit: base**power
    for power, prefix in enumerate("kmgt", start=1)
    for unit, base in ((f"{prefix}b", 1000), (f"{prefix}ib", 1024))
}


def parse_size(size: str | int) -> int:
    """A byte count from ``size``: an int, or a number with an optional unit, case-insensitive:
    ``B``, decimal ``KB MB GB TB`` (powers of 1000) or binary ``KiB MiB GiB TiB`` (powers of
    1024). ``"42MB"`` is 42_000_000, ``"42MiB"`` is 44_040_192, ``"1.5GB"`` is 1_500_000_000;
    ``_`` may separate digits; a fraction of a byte is dropped. ``ValueError`` for anything else.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 0:
            raise ValueError(f"a size cannot be negative: {size}")
        return size
    match = _SIZE.fullmatch(size.strip().replace("_", "")) if isinstance(size, str) else None
    if match is None:
        raise ValueError(
            f"not a size: {size!r}; write a number with an optional unit, e.g. 2GiB, 42MB, 1.5GB "
            "(B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024)"
        )
    number, unit = match.groups()
    return int(Decimal(number) * _UNITS[(unit or "b").lower()])


def _slot_bytes(make: type) -> int:
    """The mean bytes per entry of a large container of type ``make``, over one doubling of its
    size (its table's load, and so the cost per entry, varies within one)."""
    empty = sys.getsizeof(make())
    sizes = range(1024, 2048, 128)
    return round(sum((sys.getsizeof(make(dict.fromkeys(range(n)))) - empty) / n for n in sizes) / len(sizes))


_INT_BYTES = sys.getsizeof(1 << 63)  # a 64-bit key or engine hash
_PAIR_BYTES = sys.getsizeof(("", 0))
HOLDER_ENTRY_BYTES = _slot_bytes(dict) + _PAIR_BYTES + _slot_bytes(set)
"""Bytes of one ``(pod, tier)`` holder of a key, besides ``len(pod) + len(tier)``."""
ENGINE_ENTRY_BYTES = _slot_bytes(dict) * 2 + _INT_BYTES + sys.getsizeof(b"") + sys.getsizeof({0})
"""Bytes of one engine hash, besides ``len(digest)``."""


class _Block:
    """The holders of one ``(model, key)``, oldest first, and a cached ``HolderMap`` of them."""

    __slots__ = ("holders", "view")

    def __init__(self) -> None:
        self.holders: dict[tuple[str, Tier], None] = {}
        self.view: HolderMap | None = None

    def holder_map(self) -> HolderMap:
        """pod -> tiers, computed once per change of ``holders``. Never hand it out: copy it."""
        view = self.view
        if view is None:
            view = {}
            for pod, tier in self.holders:
                tiers = view.get(pod)
                view[pod] = frozenset((tier,)) if tiers is None else tiers | {tier}
            self.view = view
        return view


KEY_ENTRY_BYTES = (
    _slot_bytes(OrderedDict)
    + _PAIR_BYTES
    + _INT_BYTES
    + sys.getsizeof(_Block())
    + sys.getsizeof({("", ""): None})
)
"""Bytes of one ``(model, key)`` entry, besides ``len(model)``."""


class _PodState:
    """What one pod holds under one model: the reverse index and the engine-hash map."""

    __slots__ = ("engine", "hashes_of", "tiers")

    def __init__(self) -> None:
        self.tiers: dict[Tier, set[BlockKey]] = {}
        self.engine: dict[int, Digest] = {}
        self.hashes_of: dict[BlockKey, set[int]] = {}

    def holds(self, key: BlockKey) -> bool:
        return any(key in keys for keys in self.tiers.values())


class MemoryIndex:
    """A ``KVIndex`` in this process's memory. Thread-safe: every method takes one lock.

    ``max_keys`` bounds the number of ``(model, block key)`` entries (least recently stored or
    looked up goes first); ``max_bytes``, when set, bounds ``estimated_bytes`` the same way (keys
    go, least recent first, until it fits); ``pod_cache_size`` bounds the ``(pod, tier)`` entries
    per key (oldest stored goes first). Evictions keep the reverse index and the engine-hash map
    consistent. ``slice_blocks`` bounds the work done per hold of the lock (module docstring).
    """

    in_process = True  # lookups do no I/O: the fast path may run them on its event loop

    def __init__(
        self,
        *,
        max_keys: int = DEFAULT_MAX_KEYS,
        pod_cache_size: int = DEFAULT_POD_CACHE_SIZE,
        max_bytes: int | None = None,
        slice_blocks: int = DEFAULT_SLICE_BLOCKS,
        native: bool | None = None,
    ) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        if pod_cache_size < 1:
            raise ValueError("pod_cache_size must be at least 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be at least 1 (or None for no byte budget)")
        if slice_blocks < 1:
            raise ValueError("slice_blocks must be at least 1")
        self.max_keys = max_keys
        self.pod_cache_size = pod_cache_size
        self.max_bytes = max_bytes
        self.slice_blocks = slice_blocks
        self._lock = threading.Lock()
        if native is None:
            native = _native is not None
        elif native and _native is None:
            raise RuntimeError(f"the compiled index is not available: {native_reason}")
        make = _native.Core if native else PyCore
        self._core: PyCore = make(max_keys, pod_cache_size, max_bytes)
        self._progress: dict[tuple[str, str], int] = {}
        self._epochs: dict[str, str] = {}
        # (model, key) -> pod -> expiry (monotonic), under a lock of its own: routers' guesses
        # never wait for ingest's writes.
        self._speculative: OrderedDict[tuple[str, BlockKey], dict[str, float]] = OrderedDict()
        self._speculative_lock = threading.Lock()

    def __len__(self) -> int:
        """The number of ``(model, block key)`` entries (never more than ``max_keys``)."""
        return len(self._core)

    @property
    def estimated_bytes(self) -> int:
        """The cost model (module docstring) summed over every entry; never more than
        ``max_bytes`` after a write returns."""
        return self._core.bytes

    # -- writes ---------------------------------------------------------------------------------

    def store(self, *, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        """Record ``blocks`` for ``(pod, tier)``, refreshing their recency; idempotent.

        Bounds are enforced as each block goes in (per-key pod bound) and at the end of each
        slice (global key bound), so a call larger than ``max_keys`` keeps only its last
        ``max_keys`` blocks.
        """
        if blocks:
            self._apply([Store(model, pod, tier, blocks)])

    def remove(self, *, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        """Drop ``(pod, tier)`` from the blocks these engine hashes map to; see ``KVIndex``."""
        return self._apply([Remove(model, pod, tier, engine_hashes)])[0]

    def clear_pod(self, *, pod: str, model: str | None = None) -> int:
        """Remove every entry of ``pod``; returns the number of ``(key, tier)`` entries."""
        with self._lock:
            models = self._core.models_held() if model is None else [model]
        return sum(self._apply([ClearPod(m, pod) for m in models]))

    def clear_pod_slice(self, *, pod: str, model: str, limit: int) -> tuple[int, bool]:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        with self._lock:
            return self._core.clear_pod_slice(model, pod, limit)

    def apply_updates(self, updates: Sequence[IndexUpdate]) -> list[int]:
        """Apply ``updates`` in order (see ``KVIndex``), under as few holds of the lock as the
        slices allow: the lock is let go only where the work of one hold would pass
        ``slice_blocks``, never between an update and the ``Progress`` after it. ``TypeError``
        for anything that is not an ``IndexUpdate``, before any is applied."""
        for update in updates:
            if not isinstance(update, (Store, Remove, ClearPod, Progress)):
                raise TypeError(f"not an index update: {update!r}")
        return self._apply(updates)

    def clear_model(self, *, model: str) -> int:
        """Remove everything under ``model``, pod by pod, in slices; returns the number of
        ``(key, pod, tier)`` entries."""
        with self._lock:
            pods = self._core.pods_of(model)
        return sum(self._apply([ClearPod(model, pod) for pod in pods]))

    def set_epoch(self, *, model: str, value: str, if_absent: bool = False) -> bool:
        with self._lock:
            if if_absent and model in self._epochs:
                return False
            self._epochs[model] = value
            return True

    # -- reads ----------------------------------------------------------------------------------

    def resolve(self, *, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        with self._lock:
            return self._core.resolve(model, pod, engine_hashes)

    def lookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """Holders of the longest held run of ``keys``; every key returned becomes most recent."""
        wanted = pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
        with self._lock:
            return self._core.lookup(model, keys, wanted)

    def lookup_many(self, *, model: str, queries: Sequence[LookupQuery]) -> list[list[HolderMap]]:
        return [self.lookup(model=model, keys=keys, pods=pods) for keys, pods in queries]

    def holders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """Holders of every key (``{}`` where none); every key held becomes most recent."""
        with self._lock:
            return self._core.holders(model, keys)

    def speculate(self, *, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> None:
        now = time.monotonic()
        until = now + seconds
        with self._speculative_lock:
            entries = self._speculative
            for point in speculation_points(len(keys)):
                ident = (model, keys[point])
                holders = entries.get(ident)
                if holders is None:
                    holders = entries[ident] = {}
                else:
                    entries.move_to_end(ident)
                    for other in [p for p, expiry in holders.items() if expiry <= now]:
                        del holders[other]
                holders[pod] = until
            while len(entries) > MAX_SPECULATIVE_KEYS:
                entries.popitem(last=False)

    def speculated(self, *, model: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        points = speculation_points(len(keys))
        now = time.monotonic()
        with self._speculative_lock:
            get = self._speculative.get
            holders = [
                [pod for pod, expiry in get((model, keys[point]), {}).items() if expiry > now]
                for point in points
            ]
        return speculated_runs(points, holders)

    def progress(self, *, model: str | None = None) -> dict[tuple[str, str], int]:
        with self._lock:
            return {held: seq for held, seq in self._progress.items() if model is None or held[0] == model}

    def epochs(self, models: Sequence[str]) -> list[str | None]:
        with self._lock:
            return [self._epochs.get(m) for m in models]

    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        with self._lock:
            models = sorted(self._core.models_held()) if model is None else [model]
            return [
                PodBlocks(model=m, pod=pod, blocks_by_tier=counts)
                for m in models
                for pod, counts in sorted(self._core.pod_blocks(m))
            ]

    def ping(self) -> None:
        """Always reachable."""

    def close(self) -> None:
        """Drop everything."""
        with self._lock:
            self._core.close()
            self._progress.clear()
            self._epochs.clear()

    # -- the writes, in slices -------------------------------------------------------------------

    def _apply(self, updates: Sequence[IndexUpdate]) -> list[int]:
        """``apply_updates`` of valid ``updates``: each store and remove cut with ``slices``, a
        clear done ``slice_blocks`` entries at a time, the lock let go (``_let_readers_in``)
        before a slice that would take the work done under this hold past ``slice_blocks``."""
        budget = self.slice_blocks
        counts = [0] * len(updates)
        self._lock.acquire()
        try:
            held = 0  # blocks, engine hashes and entries handled under this hold of the lock
            for i, update in enumerate(updates):
                if isinstance(update, Progress):
                    self._progress[(update.model, update.pod)] = update.seq
                elif isinstance(update, ClearPod):
                    done = False
                    while not done:
                        if held >= budget:
                            held = self._let_readers_in()
                        removed, done = self._core.clear_pod_slice(update.model, update.pod, budget - held)
                        counts[i] += removed
                        held += removed
                elif isinstance(update, Store):
                    for part in slices(update.blocks, budget):
                        if held and held + len(part) > budget:
                            held = self._let_readers_in()
                        if part:
                            self._core.store(update.model, update.pod, update.tier, part)
                        counts[i] += len(part)
                        held += len(part)
                else:
                    for part in slices(update.engine_hashes, budget):
                        if held and held + len(part) > budget:
                            held = self._let_readers_in()
                        counts[i] += self._core.remove(update.model, update.pod, update.tier, part)
                        held += len(part)
        finally:
            self._lock.release()
        return counts

    def _let_readers_in(self) -> int:
        """Let go of the lock and take it again (requires it); returns 0, the work done under
        the new hold. Without the pause, this thread would take the lock back before a waiting
        thread had woken up."""
        self._lock.release()
        time.sleep(0)
        self._lock.acquire()
        return 0


class PyCore:
    """The index's maps in pure Python (module docstring): what the compiled ``kvindex.native``
    ``Core`` keeps in C++, with the same calls and answers, used when it is not built (or with
    ``MemoryIndex(native=False)``). Not thread-safe: ``MemoryIndex`` calls it under its lock."""

    def __init__(self, max_keys: int, pod_cache_size: int, max_bytes: int | None) -> None:
        self.max_keys = max_keys
        self.pod_cache_size = pod_cache_size
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[tuple[str, BlockKey], _Block] = OrderedDict()
        self._pods: dict[str, dict[str, _PodState]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes(self) -> int:
        return self._bytes

    @staticmethod
    def entry_bytes(*, model: str, pod: str, tier: Tier, digest_size: int) -> int:
        """What one key held by one ``(pod, tier)`` with one engine hash costs."""
        return (
            KEY_ENTRY_BYTES
            + len(model)
            + HOLDER_ENTRY_BYTES
            + len(pod)
            + len(tier)
            + ENGINE_ENTRY_BYTES
            + digest_size
        )

    def close(self) -> None:
        self._blocks.clear()
        self._pods.clear()
        self._bytes = 0

    # -- reads ----------------------------------------------------------------------------------

    def resolve(self, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        state = self._pods.get(model, {}).get(pod)
        if state is None:
            return [None] * len(engine_hashes)
        get = state.engine.get
        return [get(h) for h in engine_hashes]

    def lookup(self, model: str, keys: Sequence[BlockKey], wanted: Collection[str] | None) -> list[HolderMap]:
        out: list[HolderMap] = []
        get = self._blocks.get
        touch = self._blocks.move_to_end
        for key in keys:
            ident = (model, key)
            block = get(ident)
            if block is None:
                break
            view = block.holder_map()
            if wanted is None:
                holders = dict(view)
            else:
                holders = {pod: tiers for pod, tiers in view.items() if pod in wanted}
                if not holders:
                    break
            touch(ident)
            out.append(holders)
        return out

    def holders(self, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        out: list[HolderMap] = []
        get = self._blocks.get
        touch = self._blocks.move_to_end
        for key in keys:
            ident = (model, key)
            block = get(ident)
            if block is None:
                out.append({})
                continue
            touch(ident)
            out.append(dict(block.holder_map()))
        return out

    def models_held(self) -> list[str]:
        return list(self._pods)

    def pods_of(self, model: str) -> list[str]:
        return list(self._pods.get(model, ()))

    def pod_blocks(self, model: str) -> list[tuple[str, dict[Tier, int]]]:
        return [
            (pod, {t: len(k) for t, k in state.tiers.items()})
            for pod, state in self._pods.get(model, {}).items()
        ]

    def recount_bytes(self) -> int:
        """The cost model summed from scratch over every map (the tests check ``bytes``)."""
        total = 0
        for (model, _), block in self._blocks.items():
            total += KEY_ENTRY_BYTES + len(model)
            total += sum(HOLDER_ENTRY_BYTES + len(pod) + len(tier) for pod, tier in block.holders)
        for pods in self._pods.values():
            for state in pods.values():
                total += sum(ENGINE_ENTRY_BYTES + len(digest) for digest in state.engine.values())
        return total

    def state(self) -> dict:
        """Every map as plain data, in the shape of the compiled ``Core.state`` (for the tests'
        invariant checks)."""
        return {
            "blocks": {ident: list(block.holders) for ident, block in self._blocks.items()},
            "pods": {
                (model, pod): {
                    "tiers": {t: set(keys) for t, keys in state.tiers.items()},
                    "links": {h: k for k, hs in state.hashes_of.items() for h in hs},
                    "engine": {h: key_of(d) for h, d in state.engine.items()},
                }
                for model, pods in self._pods.items()
                for pod, state in pods.items()
            },
        }

    # -- writes ---------------------------------------------------------------------------------

    def clear_pod_slice(self, model: str, pod: str, limit: int) -> tuple[int, bool]:
        """At most ``limit`` (>= 1) entries of ``clear_pod`` under one model: how many went, and
        whether the pod is gone. Requires the lock."""
        pods = self._pods.get(model)
        state = pods.get(pod) if pods else None
        if state is None:
            return 0, True
        if sum(map(len, state.tiers.values())) <= limit:
            return self._clear_pod(model, pod), True
        removed = 0
        for tier, keys in list(state.tiers.items()):
            part = list(islice(keys, limit - removed))
            for key in part:
                self._drop_entry(model, key, self._blocks[(model, key)], pod, tier)
            removed += len(part)
            if removed == limit:
                break
        return removed, False

    def store(self, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        """``store`` of a non-empty ``blocks``;"""
        entry = (pod, tier)
        state = self._pods.setdefault(model, {}).get(pod)
        if state is None:
            state = self._pods[model][pod] = _PodState()
        tier_keys = state.tiers.setdefault(tier, set())
        all_blocks = self._blocks
        # Bytes added are charged once, after the loop; what leaves is charged in _drop_entry. The
        # pod bound below drops holders of other (pod, tier)s, never a key nor this pod's engine
        # hashes, so the growth of _blocks, tier_keys and state.engine counts the new keys, holders
        # and engine hashes; only digest lengths are summed per block.
        digest_bytes = 0
        keys_before, holders_before, hashes_before = len(all_blocks), len(tier_keys), len(state.engine)
        for b in blocks:
            key = b.key
            old = state.engine.get(b.engine_hash)
            if old != b.digest:
                digest_bytes += len(b.digest)
                if old is not None:
                    digest_bytes -= len(old)
                    self._unlink_hash(state, key_of(old), b.engine_hash)
                state.engine[b.engine_hash] = b.digest
                state.hashes_of.setdefault(key, set()).add(b.engine_hash)
            ident = (model, key)
            block = all_blocks.get(ident)
            if block is None:
                block = all_blocks[ident] = _Block()
            else:
                all_blocks.move_to_end(ident)
                block.holders.pop(entry, None)
            block.holders[entry] = None
            block.view = None
            tier_keys.add(key)
            if len(block.holders) > self.pod_cache_size:
                # The oldest entry, never the one just added: it is last and the bound is >= 1.
                old_pod, old_tier = next(iter(block.holders))
                self._drop_entry(model, key, block, old_pod, old_tier)
        self._bytes += (
            digest_bytes
            + (len(state.engine) - hashes_before) * ENGINE_ENTRY_BYTES
            + (len(all_blocks) - keys_before) * (KEY_ENTRY_BYTES + len(model))
            + (len(tier_keys) - holders_before) * (HOLDER_ENTRY_BYTES + len(pod) + len(tier))
        )
        budget = self.max_bytes
        while len(all_blocks) > self.max_keys or (budget is not None and self._bytes > budget and all_blocks):
            (old_model, old_key), block = all_blocks.popitem(last=False)
            for old_pod, old_tier in list(block.holders):
                self._drop_entry(old_model, old_key, block, old_pod, old_tier)

    def remove(self, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        """``remove``;"""
        removed = 0
        entry = (pod, tier)
        pods = self._pods.get(model)
        for engine_hash in engine_hashes:
            state = pods.get(pod) if pods else None
            if state is None:  # the pod holds nothing (any more): every hash is unknown
                break
            digest = state.engine.get(engine_hash)
            if digest is None:
                continue
            key = key_of(digest)
            block = self._blocks.get((model, key))
            if block is not None and entry in block.holders:
                self._drop_entry(model, key, block, pod, tier)
                removed += 1
        return removed

    def _clear_pod(self, model: str, pod: str) -> int:
        """``clear_pod`` under one model;"""
        pods = self._pods.get(model)
        state = pods.pop(pod, None) if pods else None
        if state is None:
            return 0
        removed = 0
        for tier, keys in state.tiers.items():
            entry = (pod, tier)
            for key in keys:
                ident = (model, key)
                block = self._blocks[ident]
                del block.holders[entry]
                block.view = None
                if not block.holders:
                    del self._blocks[ident]
                    self._bytes -= KEY_ENTRY_BYTES + len(model)
            removed += len(keys)
            self._bytes -= (HOLDER_ENTRY_BYTES + len(pod) + len(tier)) * len(keys)
        self._bytes -= _engine_bytes(state)
        if not pods:
            del self._pods[model]
        return removed

    # -- invariant keeping ----------------------------------------------------------------------

    def _drop_entry(self, model: str, key: BlockKey, block: _Block, pod: str, tier: Tier) -> None:
        """Remove ``(pod, tier)`` from ``block`` and from the pod's reverse index; when the pod
        no longer holds ``key`` on any tier, its engine hashes for ``key`` go too. Deletes what
        becomes empty (the block from ``_blocks`` if it is still there, the pod, the model).

        Requires ``(pod, tier)`` in ``block.holders`` (and so ``key`` in the reverse index)."""
        del block.holders[(pod, tier)]
        block.view = None
        freed = HOLDER_ENTRY_BYTES + len(pod) + len(tier)
        if not block.holders:
            # The caller may have popped it already (global eviction); it is charged here either way.
            self._blocks.pop((model, key), None)
            freed += KEY_ENTRY_BYTES + len(model)
        pods = self._pods[model]
        state = pods[pod]
        keys = state.tiers[tier]
        keys.discard(key)
        if not keys:
            del state.tiers[tier]
        if not state.holds(key):
            for engine_hash in state.hashes_of.pop(key, ()):
                freed += ENGINE_ENTRY_BYTES + len(state.engine.pop(engine_hash))
        self._bytes -= freed
        if not state.tiers:
            del pods[pod]
            if not pods:
                del self._pods[model]

    @staticmethod
    def _unlink_hash(state: _PodState, key: BlockKey, engine_hash: int) -> None:
        """Forget that ``engine_hash`` points at ``key`` (it is about to point elsewhere)."""
        hashes = state.hashes_of.get(key)
        if hashes is not None:
            hashes.discard(engine_hash)
            if not hashes:
                del state.hashes_of[key]


def _engine_bytes(state: _PodState) -> int:
    """The cost of every engine hash of ``state`` (for dropping a whole pod at once)."""
    return len(state.engine) * ENGINE_ENTRY_BYTES + sum(map(len, state.engine.values()))
