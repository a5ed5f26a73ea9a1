"""Ingest recording blocks as NVIDIA Dynamo's indexer knows them (``EventApplier(dynamo=...)``,
``kvindex.dynamo``): each block keyed from its token ids gets its parent's key, its chain's seed
(LoRA, and the salt of the chain's first block, inherited by every later block, even one stored
by another applier) and its Dynamo block hash; what Dynamo could not match is not recorded."""

from __future__ import annotations

import time

from ingest.applier import EventApplier
from ingest.events import BlockStored, EventBatch, decode_message
from ingest.stats import IngestStats
from kvindex import MemoryIndex
from kvindex.dynamo import DynamoBlock, MemoryDynamoBlockStore, block_hash_seed, dynamo_block_hashes
from kvindex.keys import MultimodalFeature, block_extra_keys, block_keys
from registry.config import ServiceConfig
from tests.ingest.captures import VLLM_033_MODEL, vllm_033_messages

SEED = "42"
BLOCK = 16
MODEL = "m"
TOKENS = tuple(range(5000, 5000 + 6 * BLOCK))


class Recorder:
    """An applier that records Dynamo blocks, fed one pod's events."""

    def __init__(self, index: MemoryIndex, store: MemoryDynamoBlockStore, *, block_size: int = BLOCK) -> None:
        config = ServiceConfig(seed=SEED, default_block_size=block_size)
        self.applier = EventApplier(index, config=lambda: config, stats=IngestStats(), dynamo=store)
        self.seq = 0

    def send(self, *events: BlockStored, pod: str = "7", model: str = MODEL) -> None:
        batch = EventBatch(ts=time.time(), events=events)
        self.applier.apply(pod=pod, model=model, seq=self.seq, batch=batch)
        self.seq += 1


def stored(first: int, last: int, *, parent: int | None = None, tokens=TOKENS, **fields) -> BlockStored:
    """Blocks ``first..last-1`` of ``tokens`` (engine hash of block i: 100 + i)."""
    return BlockStored(
        block_hashes=tuple(range(100 + first, 100 + last)),
        parent_block_hash=parent,
        token_ids=tuple(tokens[first * BLOCK : last * BLOCK]),
        block_size=fields.pop("block_size", BLOCK),
        lora_id=None,
        tier="gpu",
        lora_name=fields.pop("lora_name", None),
        **fields,
    )


def records(keys: list[int], hashes: list[int], seed: int) -> dict[int, DynamoBlock]:
    return {key: DynamoBlock(keys[i - 1] if i else None, seed, hashes[i]) for i, key in enumerate(keys)}


def recorded(store: MemoryDynamoBlockStore, keys: list[int]) -> dict[int, DynamoBlock | None]:
    return dict(zip(keys, store.get(model=MODEL, keys=keys), strict=True))


def test_a_chain_stored_in_two_events_is_recorded_block_by_block() -> None:
    store = MemoryDynamoBlockStore()
    Recorder(MemoryIndex(), store).send(stored(0, 2), stored(2, 6, parent=101))
    keys = block_keys(TOKENS, seed=SEED)
    assert recorded(store, keys) == records(keys, dynamo_block_hashes(TOKENS, block_size=BLOCK), 1337)


def test_a_salt_keys_every_block_of_its_chain_and_a_lora_each_block() -> None:
    store, index = MemoryDynamoBlockStore(), MemoryIndex()
    salted = block_extra_keys(2, lora_name="Alice", cache_salt="tenant-42")
    Recorder(index, store).send(stored(0, 2, lora_name="Alice", extra_keys=tuple(salted)))
    # The chain goes on in another ingest process: the parent's seed comes from the store.
    Recorder(index, store).send(
        stored(2, 6, parent=101, lora_name="Alice", extra_keys=tuple(block_extra_keys(4, lora_name="Alice")))
    )
    keys = block_keys(TOKENS, seed=SEED, lora_name="Alice", cache_salt="tenant-42")
    seed = block_hash_seed(lora_name="Alice", cache_salt="tenant-42")
    hashes = dynamo_block_hashes(TOKENS, block_size=BLOCK, seed=seed)
    assert recorded(store, keys) == records(keys, hashes, seed)


def test_the_vllm_033_capture_is_recorded_with_its_salt() -> None:
    store, index = MemoryDynamoBlockStore(), MemoryIndex()
    config = ServiceConfig(seed=SEED, default_block_size=BLOCK)
    appliers = {}
    for message in vllm_033_messages():
        decoded = decode_message(message.frames)
        applier = appliers.setdefault(
            decoded.pod, EventApplier(index, config=lambda: config, stats=IngestStats(), dynamo=store)
        )
        applier.apply(pod=decoded.pod, model=decoded.model, seq=decoded.seq, batch=decoded.batch)
    message = next(m for m in vllm_033_messages() if m.pod == "pod-b" and m.seq == 0)
    salted = [e for e in decode_message(message.frames).batch.events if isinstance(e, BlockStored)][2]
    tokens = salted.token_ids
    keys = block_keys(tokens, seed=SEED, cache_salt="tenant-42")
    seed = block_hash_seed(cache_salt="tenant-42")
    got = store.get(model=VLLM_033_MODEL, keys=keys)
    assert got == list(records(keys, dynamo_block_hashes(tokens, block_size=BLOCK, seed=seed), seed).values())


def test_media_are_mixed_into_their_blocks_hashes() -> None:
    store = MemoryDynamoBlockStore()
    image = MultimodalFeature("ab" * 32, offset=20, length=8)
    extras = block_extra_keys(2, mm_features=[image])
    Recorder(MemoryIndex(), store).send(stored(0, 2, extra_keys=tuple(extras)))
    keys = block_keys(TOKENS[: 2 * BLOCK], seed=SEED, mm_features=[image])
    plain = dynamo_block_hashes(TOKENS[: 2 * BLOCK], block_size=BLOCK)
    media = dynamo_block_hashes(TOKENS[: 2 * BLOCK], block_size=BLOCK, mm_hashes=[[], [0xABABABABABABABAB]])
    assert [b.block_hash for b in store.get(model=MODEL, keys=keys)] == [plain[0], media[1]]
    assert media[1] != plain[1]


def test_what_dynamo_could_not_match_is_not_recorded() -> None:
    store, index = MemoryDynamoBlockStore(), MemoryIndex()
    recorder = Recorder(index, store)
    recorder.send(stored(0, 2, tokens=[1 << 32] * (2 * BLOCK)))  # not u32
    recorder.send(stored(0, 2, group_idx=1))  # a hybrid model's second KV-cache group
    recorder.send(stored(0, 2, lookahead_token_ids=((1, 2), (3, 4))))  # lookahead hashing
    recorder.send(stored(0, 4, block_size=8), pod="sglang")  # re-chunked pages
    assert store.models() == []
    assert sum(p.total for p in index.pod_blocks()) > 0
