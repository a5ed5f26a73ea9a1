"""Hybrid models: KV-cache groups beside full attention, and vLLM's rule for a prefix hit over them.

A hybrid model (sliding-window or Mamba layers next to full-attention ones: Gemma 3, gpt-oss,
Qwen3-Next, Jamba...) has one KV-cache group per kind of layer. vLLM caches a block once per
group: a ``BlockStored`` / ``BlockRemoved`` event carries its ``group_idx``, and the groups evict
independently (a sliding window frees the blocks that left its window while decoding, so they go
first). Group 0 is full attention; the model config lists the groups in vLLM's order
(``ModelSettings.kv_cache_groups``), or ingest learns each pod's from the events that describe
them (``kv_cache_spec_kind``): a pod's description is applied to its own hit only
(``ServiceConfig.kv_cache_groups_of``).

Index identity: group 0 is indexed as any model is. A group ``g > 0`` is indexed under the holder
``<holder>#g<g>`` (``group_holder``), with its block keys and digests masked (``group_key``,
``group_digest``: XOR with a fixed mask of the group, so ``key_of`` still maps a masked digest to
its masked key, and a group-0 lookup never meets another group's entry). Its engine hashes stay
as sent: each group holder has an engine-hash map of its own.

The hit (vLLM ``HybridKVCacheCoordinator.find_longest_cache_hit``, same block size in every
group): the full-attention run ``L`` bounds the hit; each other group then finds, scanning from
block ``L - 1`` down, the last block ``i`` that ends ``need`` consecutive blocks it holds, and cuts
the hit to ``i + 1`` (or to its leading run from block 0 when that is shorter than ``need``);
``need`` is ``cdiv(window - 1, block_size)`` for a sliding window and 1 for Mamba (only the state
at the hit's last block is needed). Repeated over the groups until no group cuts any more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvindex.base import HolderMap
from kvindex.keys import BlockKey, Digest

MAX_KV_CACHE_GROUPS = 32
"""The most KV-cache groups a model may have: vLLM's hybrid models have two to four (one per kind
of layer, split by layer count). Ingest refuses an event of a group beyond (``group_idx`` sizes
what is kept of each pod)."""

MAX_SLIDING_WINDOW = 1 << 24
"""The longest sliding window, in tokens, an event may describe (the longest real ones: 128k)."""

GROUP_SEPARATOR = "#g"
"""KV-cache group ``g > 0`` of index holder ``H`` is indexed as ``H#g<g>``."""

GROUP_RULES: Mapping[str, str] = {
    "full_attention": "full",
    "mla_attention": "full",
    "sink_full_attention": "full",
    "sliding_window": "window",
    "sliding_window_mla": "window",
    "mamba": "mamba",
}
"""vLLM's ``KVCacheSpecKind`` values we score, each with the hit rule of its manager: a prefix
(full attention), a window's last blocks, Mamba's last block."""


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV-cache group of a model: vLLM's spec kind, and the window in tokens of a sliding one."""

    kind: str
    sliding_window: int | None = None

    @property
    def rule(self) -> str:
        """The hit rule: "full", "window" or "mamba" (``GROUP_RULES``; an unknown kind counts as full)."""
        return GROUP_RULES.get(self.kind, "full")

    def needed_blocks(self, block_size: int) -> int | None:
        """How many consecutive blocks ending at the hit this group must hold: ``None`` for full
        attention (every block from the first), ``cdiv(window - 1, block_size)`` for a window
        (vLLM ``SlidingWindowManager._contiguous_blocks_for_hit``), 1 for Mamba."""
        if self.rule == "window":
            return -(-((self.sliding_window or 1) - 1) // block_size)
        return 1 if self.rule == "mamba" else None


def groups_from_json(value: object) -> tuple[KVCacheGroup, ...]:
    """The groups of a registry JSON list (``[{"kind": ..., "sliding_window": ...}]``); what is not
    such a list reads as none."""
    if not isinstance(value, list):
        return ()
    out = []
    for group in value:
        if not isinstance(group, dict) or not isinstance(group.get("kind"), str):
            return ()
        window = group.get("sliding_window")
        out.append(KVCacheGroup(group["kind"], window if isinstance(window, int) else None))
    return tuple(out)


def groups_to_json(groups: Iterable[KVCacheGroup]) -> list[dict]:
    """``groups_from_json``'s inverse (``sliding_window`` only when there is one)."""
    out: list[dict] = []
    for group in groups:
        item: dict = {"kind": group.kind}
        if group.sliding_window is not None:
            item["sliding_window"] = group.sliding_window
        out.append(item)
    return out


def other_groups(groups: Sequence[KVCacheGroup], block_size: int) -> list[tuple[int, int | None]]:
    """``(group_idx, needed blocks)`` of every group after group 0: what a hit must also ask."""
    return [(g, group.needed_blocks(block_size)) for g, group in enumerate(groups) if g]


# --- index identity of a group ---------------------------------------------------------------


def group_holder(holder: str, group: int) -> str:
    """The index holder of ``holder``'s group ``group`` (``holder`` itself for group 0)."""
    return holder if not group else f"{holder}{GROUP_SEPARATOR}{group}"


def split_group(holder: str) -> tuple[str, int]:
    """``group_holder``'s inverse: ``"pod#dp1#g2"`` -> ``("pod#dp1", 2)``, ``"pod"`` -> ``("pod", 0)``."""
    base, sep, group = holder.rpartition(GROUP_SEPARATOR)
    if sep and group.isdigit():
        return base, int(group)
    return holder, 0


def is_group_holder(holder: str) -> bool:
    """Whether ``holder`` is a KV-cache group ``g > 0`` of another holder: its entries repeat
    group 0's blocks, so block counts of pods leave it out."""
    return split_group(holder)[1] > 0


@lru_cache(maxsize=64)
def _mask(group: int) -> bytes:
    return hashlib.sha256(f"kvcache-group-{group}".encode()).digest()


@lru_cache(maxsize=64)
def _key_mask(group: int) -> int:
    return int.from_bytes(_mask(group)[-8:], "big")


def group_digest(digest: Digest, group: int) -> Digest:
    """``digest`` as group ``group`` indexes it (and back: the mask is its own inverse); group 0
    unchanged. Keeps ``key_of(group_digest(d, g)) == group_key(key_of(d), g)`` for any length."""
    if not group:
        return digest
    mask = _mask(group)[-len(digest) :]
    return (int.from_bytes(digest, "big") ^ int.from_bytes(mask, "big")).to_bytes(len(digest), "big")


def group_key(key: BlockKey, group: int) -> BlockKey:
    """A block key as group ``group`` indexes it; group 0 unchanged."""
    return key ^ _key_mask(group) if group else key


def group_keys(keys: Sequence[BlockKey], group: int) -> list[BlockKey]:
    mask = _key_mask(group) if group else 0
    return [key ^ mask for key in keys]


# --- the hit rule ------------------------------------------------------------------------------


def group_hit(held: Sequence[bool], limit: int, needed: int | None) -> int:
    """The blocks of a hit of at most ``limit`` that a group allows, from whether it holds each
    block: its leading run for full attention (``needed`` ``None``), else vLLM
    ``SlidingWindowManager`` / ``MambaManager`` ``find_longest_cache_hit`` (without EAGLE or
    alignment)."""
    limit = min(limit, len(held))
    if needed is None:
        for i in range(limit):
            if not held[i]:
                return i
        return limit
    run = 0
    for i in range(limit - 1, -1, -1):
        if held[i]:
            run += 1
            if run >= max(needed, 1):
                return i + run
        else:
            run = 0
    return run


def hybrid_hit(full_run: int, others: Sequence[tuple[Sequence[bool], int | None]]) -> int:
    """The hit over every group: ``full_run`` blocks held by full attention, then each other
    group's ``(held, needed)`` cutting it, to a fixed point (module docstring)."""
    hit = full_run
    while True:
        cut = hit
        for held, needed in others:
            cut = group_hit(held, cut, needed)
        if cut >= hit:
            return hit
        hit = cut


def hybrid_run(
    run: Sequence[HolderMap],
    holder_groups: Mapping[str, Sequence[tuple[int, int | None]]],
    reads: Mapping[int, Sequence[HolderMap]],
) -> list[HolderMap]:
    """Group 0's held run (``KVIndex.lookup``) cut, holder by holder, to its hit over its groups:
    ``holder_groups`` gives a holder's other groups (``other_groups``: index and needed blocks;
    a holder not in it has none), ``reads`` the holders of the run's keys in each of those groups
    (``KVIndex.holders`` of ``group_keys``). A holder leaves the maps from its hit on; the run
    ends at the first map left empty."""
    if not run or not holder_groups:
        return list(run)
    full_run: dict[str, int] = {}
    alive = set(run[0])
    for i, block in enumerate(run):
        alive.intersection_update(block)
        for holder in alive:
            full_run[holder] = i + 1
    hits = {}
    for holder, length in full_run.items():
        others = [
            ([group_holder(holder, g) in reads[g][i] for i in range(length)], needed)
            for g, needed in holder_groups.get(holder, ())
        ]
        hits[holder] = hybrid_hit(length, others) if others else length
    out: list[HolderMap] = []
    for i, block in enumerate(run):
        kept = {holder: tiers for holder, tiers in block.items() if hits.get(holder, 0) > i}
        if not kept:
            break
        out.append(kept if len(kept) < len(block) else block)
    return out
