"""The block cache against vLLM's block pool: stored blocks and parents, eviction order, events."""

from __future__ import annotations

import pytest

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.keys import block_keys
from simulator.cache import BlockCache

B = 4  # tokens per block in these tests


def chain(first: int, n_blocks: int) -> tuple[list[int], list[int]]:
    """Token ids and keys of ``n_blocks`` full blocks starting at token ``first``."""
    tokens = list(range(first, first + n_blocks * B))
    return tokens, block_keys(tokens, seed="42", block_size=B)


def take(cache: BlockCache, keys: list[int], tokens: list[int]) -> list[int]:
    """What the engine does for a prompt: hit the cached prefix, allocate the rest, store all."""
    hits = cache.cached_prefix(keys)
    blocks = cache.allocate(hits, len(keys) - len(hits))
    cache.store(blocks, keys, start=len(hits), end=len(keys), token_ids=tokens)
    return blocks


def test_new_blocks_are_stored_once_with_their_parent_and_tokens() -> None:
    cache = BlockCache(num_blocks=8, block_size=B)
    tokens, keys = chain(0, 3)
    take(cache, keys, tokens)
    assert cache.drain_events() == [
        BlockStored(block_hashes=tuple(keys), parent_block_hash=None, token_ids=tuple(tokens), block_size=B)
    ]
    # The same prefix again: all hits, nothing new to report.
    take(cache, keys, tokens)
    assert cache.drain_events() == []


def test_extending_a_chain_names_the_last_cached_block_as_parent() -> None:
    cache = BlockCache(num_blocks=8, block_size=B)
    tokens, keys = chain(0, 4)
    take(cache, keys[:2], tokens)
    cache.drain_events()
    take(cache, keys, tokens)
    (stored,) = cache.drain_events()
    assert stored.block_hashes == tuple(keys[2:])
    assert stored.parent_block_hash == keys[1]
    assert stored.token_ids == tuple(tokens[2 * B :])


def test_a_key_already_held_elsewhere_splits_the_event_and_is_not_repeated() -> None:
    cache = BlockCache(num_blocks=8, block_size=B)
    tokens, keys = chain(0, 3)
    take(cache, keys, tokens)
    cache.drain_events()
    blocks = cache.allocate([], 3)  # the same chain computed again in other blocks
    cache.store(blocks, keys, start=0, end=3, token_ids=tokens)
    assert cache.drain_events() == []
    assert len(cache) == 3


def test_lora_name_and_id_are_reported() -> None:
    cache = BlockCache(num_blocks=4, block_size=B)
    tokens = list(range(B))
    keys = block_keys(tokens, seed="42", block_size=B, lora_name="Alice")
    blocks = cache.allocate([], 1)
    cache.store(blocks, keys, start=0, end=1, token_ids=tokens, lora_name="Alice", lora_id=3)
    (stored,) = cache.drain_events()
    assert (stored.lora_name, stored.lora_id, stored.tier) == ("Alice", 3, "gpu")


def test_eviction_takes_the_least_recently_used_chain_tail_first() -> None:
    cache = BlockCache(num_blocks=6, block_size=B)
    old_tokens, old = chain(0, 3)
    new_tokens, new = chain(1000, 3)
    cache.release(take(cache, old, old_tokens))
    cache.release(take(cache, new, new_tokens))
    assert cache.keys_in_eviction_order() == [old[2], old[1], old[0], new[2], new[1], new[0]]
    cache.drain_events()

    blocks = cache.allocate([], 2)
    assert cache.drain_events() == [
        BlockRemoved(block_hashes=(old[2],)),
        BlockRemoved(block_hashes=(old[1],)),
    ]
    # What is left of the old chain is still a usable prefix.
    assert cache.cached_prefix(old) == cache.cached_prefix(old[:1])
    assert len(cache.cached_prefix(old)) == 1
    cache.release(blocks)


def test_a_hit_refreshes_a_chain_so_the_other_is_evicted_first() -> None:
    cache = BlockCache(num_blocks=4, block_size=B)
    a_tokens, a = chain(0, 2)
    b_tokens, b = chain(1000, 2)
    cache.release(take(cache, a, a_tokens))
    cache.release(take(cache, b, b_tokens))
    cache.release(take(cache, a, a_tokens))  # a used again: most recent now
    cache.drain_events()
    cache.allocate([], 2)
    assert cache.drain_events() == [BlockRemoved(block_hashes=(b[1],)), BlockRemoved(block_hashes=(b[0],))]


def test_free_blocks_without_a_key_are_reused_before_any_eviction() -> None:
    cache = BlockCache(num_blocks=4, block_size=B)
    tokens, keys = chain(0, 2)
    cache.release(take(cache, keys, tokens))
    partial = cache.allocate([], 2)  # blocks never stored (e.g. partial last blocks)
    cache.release(partial)
    cache.drain_events()
    cache.allocate([], 2)
    assert cache.drain_events() == []
    assert len(cache.cached_prefix(keys)) == 2


def test_held_blocks_are_never_evicted_and_free_hits_do_not_count_as_room() -> None:
    cache = BlockCache(num_blocks=3, block_size=B)
    tokens, keys = chain(0, 2)
    held = take(cache, keys, tokens)
    assert not cache.can_allocate([], 2)
    cache.release(held)
    hits = cache.cached_prefix(keys)
    assert cache.can_allocate(hits, 1)
    assert not cache.can_allocate(hits, 2)  # taking the hits leaves one free block
    with pytest.raises(ValueError):
        cache.allocate(hits, 2)


def test_usage_counts_held_blocks_only() -> None:
    cache = BlockCache(num_blocks=4, block_size=B)
    tokens, keys = chain(0, 2)
    blocks = take(cache, keys, tokens)
    assert cache.usage == 0.5
    cache.release(blocks)
    assert cache.usage == 0.0
    assert len(cache) == 2


def test_reset_clears_every_key_only_when_nothing_is_held() -> None:
    cache = BlockCache(num_blocks=4, block_size=B)
    tokens, keys = chain(0, 2)
    blocks = take(cache, keys, tokens)
    cache.drain_events()
    assert cache.reset() is False
    assert cache.drain_events() == []
    cache.release(blocks)
    assert cache.reset() is True
    assert cache.drain_events() == [AllBlocksCleared()]
    assert len(cache) == 0
    assert cache.cached_prefix(keys) == []
