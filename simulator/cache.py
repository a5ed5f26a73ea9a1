"""The prefix cache of one simulated engine: vLLM's block pool (``v1/core/block_pool.py``), no I/O.

A fixed number of blocks of ``block_size`` tokens. A block is *cached* when it holds a block key
(it was full and stored); requests hold blocks through a reference count. Invariants:

* every block with ``ref == 0`` is in the free queue, and no other block is;
* a key maps to at most one block (``_cached``), and that block holds the key;
* allocation takes blocks from the head of the free queue; a cached block taken there is evicted
  (one ``BlockRemoved`` per block). Released blocks go to the tail in reverse chain order, so the
  least recently used chain goes first and, within a chain, its last block before its first (a
  prefix stays usable as long as possible). Released blocks that hold no key go to the head: they
  cost nothing to reuse, so they are reused before any cached block is evicted;
* ``BlockStored`` is emitted for new keys only, in chain order, one event per run of consecutive
  new blocks, with the parent key of the run (``None`` for the first block of a sequence).

Events accumulate until :meth:`BlockCache.drain_events` takes them (one batch per engine step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["BlockCache"]


@dataclass(slots=True)
class _Block:
    ref: int = 0
    key: int | None = None
    # When the KV of this block is computed (engine clock): a request that hits a block still being
    # prefilled by another request cannot produce its first token before then.
    ready_at: float = 0.0


class BlockCache:
    """``num_blocks`` blocks of ``block_size`` tokens, keyed by block key, LRU-evicted."""

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self._events: list[Event] = []

    # --- reads ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached or not): what allocation can draw from."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's ``kv_cache_usage_perc``), 0.0 to 1.0."""
        return self.num_used / self.num_blocks

    def __contains__(self, key: int) -> bool:
        return key in self._cached

    def __len__(self) -> int:
        """How many blocks hold a key."""
        return len(self._cached)

    def cached_keys(self) -> list[int]:
        """Every key a block holds (what the engine's KV events say it stores)."""
        return list(self._cached)

    def cached_prefix(self, keys: Sequence[int]) -> list[int]:
        """Block ids holding the longest prefix of ``keys`` that is cached (contiguous from the
        first key, as vLLM matches: a hole ends the prefix)."""
        found: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, hits: Sequence[int], new_blocks: int) -> bool:
        """Whether :meth:`allocate` can take ``hits`` and ``new_blocks`` more now. Hit blocks that
        are free stop being free once taken, so they do not count as room for new blocks."""
        free_hits = sum(1 for b in hits if self._blocks[b].ref == 0)
        return new_blocks <= len(self._free) - free_hits

    def ready_at(self, blocks: Sequence[int]) -> float:
        """When the last of ``blocks`` has its KV computed (0.0 for none)."""
        return max((self._blocks[b].ready_at for b in blocks), default=0.0)

    def keys_in_eviction_order(self) -> list[int]:
        """Keys of the free cached blocks, the next one to be evicted first."""
        return [key for b in self._free if (key := self._blocks[b].key) is not None]

    # --- writes ---------------------------------------------------------------------------------

    def allocate(self, hits: Sequence[int], new_blocks: int) -> list[int]:
        """Take the cached ``hits`` (a reference each) and ``new_blocks`` fresh blocks; returns the
        block ids, hits first. Evicts from the head of the free queue as needed. Raises
        ``ValueError`` when there is no room (check :meth:`can_allocate` first)."""
        if not self.can_allocate(hits, new_blocks):
            raise ValueError(f"no room for {new_blocks} new blocks")
        for b in hits:
            block = self._blocks[b]
            if block.ref == 0:
                del self._free[b]
            block.ref += 1
        taken = list(hits)
        for _ in range(new_blocks):
            b, _ = self._free.popitem(last=False)
            block = self._blocks[b]
            if block.key is not None:
                del self._cached[block.key]
                self._events.append(BlockRemoved(block_hashes=(block.key,)))
                block.key = None
            block.ref = 1
            block.ready_at = 0.0
            taken.append(b)
        return taken

    def store(
        self,
        blocks: Sequence[int],
        keys: Sequence[int],
        *,
        start: int,
        end: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        lora_id: int | None = None,
        ready_at: float = 0.0,
    ) -> int:
        """Cache ``blocks[start:end]`` of one sequence under ``keys[start:end]``; ``token_ids`` are
        the sequence's tokens from its first block. Keys another block already holds are left
        alone (no duplicate ``BlockStored``). Returns how many blocks were newly cached."""
        size = self.block_size
        stored = 0
        run_start: int | None = None
        for i in range(start, end + 1):
            new = False
            if i < end:
                block = self._blocks[blocks[i]]
                key = keys[i]
                if block.key is None and key not in self._cached:
                    block.key = key
                    block.ready_at = ready_at
                    self._cached[key] = blocks[i]
                    new = True
                    stored += 1
            if new and run_start is None:
                run_start = i
            elif not new and run_start is not None:
                self._events.append(
                    BlockStored(
                        block_hashes=tuple(keys[run_start:i]),
                        parent_block_hash=keys[run_start - 1] if run_start > 0 else None,
                        token_ids=tuple(token_ids[run_start * size : i * size]),
                        block_size=size,
                        lora_id=lora_id,
                        lora_name=lora_name,
                    )
                )
                run_start = None
        return stored

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks`` (one sequence's blocks, in chain order).
        Blocks nobody holds any more become free: cached ones at the tail, last block first."""
        for b in reversed(blocks):
            block = self._blocks[b]
            if block.ref <= 0:
                raise ValueError(f"block {b} released more often than taken")
            block.ref -= 1
            if block.ref == 0:
                self._free[b] = None
                if block.key is None:
                    self._free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forget every key (``AllBlocksCleared``), as vLLM's ``reset_prefix_cache``: only when no
        request holds a block; returns whether it reset."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._blocks:
            block.key = None
            block.ready_at = 0.0
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[Event]:
        """The events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events
