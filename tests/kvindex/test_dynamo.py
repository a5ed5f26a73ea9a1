"""``kvindex.dynamo``: Dynamo's block hashes as Dynamo 1.6.1 computes them, the records' stores on
each backend, which recorded blocks each holder holds (and the pruning of the others), and the
runs a holder's blocks are dumped as.

``DYNAMO_HASHES`` are what ``dynamo._core.compute_block_hash_for_seq`` (Dynamo 1.6.1,
``var/dynamo``) answered; with ``var/dynamo`` installed, random sequences are checked against it
live too.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import redis

from bench.dynamo import DYNAMO_VENV, dynamo_installed
from kvindex import MemoryIndex, StoredBlock, open_index
from kvindex.dynamo import (
    PRUNE_GRACE_SECONDS,
    DynamoBlock,
    MemoryDynamoBlockStore,
    RedisDynamoBlockStore,
    Run,
    block_hash_seed,
    dynamo_block_hashes,
    held_blocks,
    mm_hash,
    pack,
    prune,
    request_identity,
    runs,
    unpack,
)

TOKENS = list(range(1000, 1064))  # 4 blocks of 16
# compute_block_hash_for_seq(TOKENS, 16, ...) in Dynamo 1.6.1
DYNAMO_HASHES = {
    "plain": [17863182269597592868, 14340445833846710668, 8209021226136440894, 12055221101765250463],
    "lora Alice": [9769233157392405385, 7054017672912309302, 15417586263653342030, 6829631708631946697],
    "namespace s": [107109337908029474, 12996020142932219455, 17993171643964901943, 15681958323630218009],
}
# compute_block_hash_for_seq(TOKENS[:16], 16, ...)
ALICE_AND_S = 9987833157881605164  # lora_name="Alice", cache_namespace="s"
ALICE_MM_5_3 = 3299403559505345467  # lora_name="Alice", block_mm_infos: objects with mm_hash 5 and 3


def test_block_hashes_are_dynamos() -> None:
    assert dynamo_block_hashes(TOKENS, block_size=16) == DYNAMO_HASHES["plain"]
    alice = block_hash_seed(lora_name="Alice")
    assert dynamo_block_hashes(TOKENS, block_size=16, seed=alice) == DYNAMO_HASHES["lora Alice"]
    salted = block_hash_seed(cache_salt="s")
    assert dynamo_block_hashes(TOKENS, block_size=16, seed=salted) == DYNAMO_HASHES["namespace s"]
    both = block_hash_seed(lora_name="Alice", cache_salt="s")
    assert dynamo_block_hashes(TOKENS[:16], block_size=16, seed=both) == [ALICE_AND_S]
    mm = dynamo_block_hashes(TOKENS[:16], block_size=16, seed=alice, mm_hashes=[[5, 3]])
    assert mm == [ALICE_MM_5_3]


def test_block_hashes_drop_a_partial_block_and_refuse_what_is_not_a_u32() -> None:
    assert dynamo_block_hashes(TOKENS[:40], block_size=16) == DYNAMO_HASHES["plain"][:2]
    assert block_hash_seed(lora_name="", cache_salt="") == block_hash_seed()
    with pytest.raises(ValueError, match="32-bit"):
        dynamo_block_hashes([1 << 32] * 16, block_size=16)


@pytest.mark.skipif(not dynamo_installed(), reason="Dynamo is not installed: run `make bench-dynamo`")
def test_block_hashes_match_dynamo_live() -> None:
    rng = random.Random(7)
    cases = [
        {
            "tokens": [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 200))],
            "block_size": rng.choice([1, 4, 16, 64]),
            "lora_name": rng.choice([None, "", "Alice", "ünï"]),
            "cache_namespace": rng.choice([None, "", "tenant-42", "s"]),
        }
        for _ in range(40)
    ]
    script = (
        "import json, sys\n"
        "from dynamo._core import compute_block_hash_for_seq as h\n"
        "print(json.dumps([h(c['tokens'], c['block_size'], lora_name=c['lora_name'],"
        " cache_namespace=c['cache_namespace']) for c in json.load(sys.stdin)]))\n"
    )
    answer = subprocess.run(
        [str(DYNAMO_VENV / "bin" / "python"), "-c", script],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    expected = json.loads(answer.stdout)
    for case, hashes in zip(cases, expected, strict=True):
        seed = block_hash_seed(lora_name=case["lora_name"], cache_salt=case["cache_namespace"])
        assert dynamo_block_hashes(case["tokens"], block_size=case["block_size"], seed=seed) == hashes


def test_the_salt_and_media_of_a_block_come_from_its_extra_keys_as_vllm_sends_them() -> None:
    assert request_identity(None, lora_name=None) == (None, [])
    assert request_identity(("Alice", "tenant-42"), lora_name="Alice") == ("tenant-42", [])
    assert request_identity(("tenant-42",), lora_name=None) == ("tenant-42", [])
    assert request_identity(("Alice",), lora_name="Alice") == (None, [])
    digest = "ab" * 32
    salt, objects = request_identity(("Alice", (digest, 0), ("img-1", -4), "s"), lora_name="Alice")
    assert (salt, objects) == ("s", [0xABABABABABABABAB, mm_hash("img-1")])


def test_records_pack_into_28_bytes_and_back() -> None:
    block = DynamoBlock(parent=(1 << 64) - 1, seed=block_hash_seed(lora_name="x"), block_hash=42)
    raw = pack(block, 1_800_000_000.7)
    assert len(raw) == 28
    assert unpack(raw) == (block, 1_800_000_000)
    assert unpack(pack(DynamoBlock(None, 1337, 7), 0))[0].parent is None


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest):
    clock = [1000.0]
    if request.param == "memory":
        made = MemoryDynamoBlockStore(clock=lambda: clock[0])
    else:
        url = request.getfixturevalue("redis_url")
        made = RedisDynamoBlockStore(redis.Redis.from_url(url), clock=lambda: clock[0])
    made.clock = clock
    yield made
    made.close()


def test_a_store_records_gets_scans_and_forgets_only_unchanged_records(store) -> None:
    blocks = {k: DynamoBlock(None if k == 1 else k - 1, 1337, 100 + k) for k in range(1, 5001)}
    store.record(model="m", blocks=blocks)
    store.record(model="other", blocks={1: DynamoBlock(None, 1, 2)})
    assert store.models() == ["m", "other"]
    assert store.get(model="m", keys=[2, 9999, 1]) == [blocks[2], None, blocks[1]]
    scanned = dict(kv for chunk in store.scan(model="m") for kv in chunk)
    assert {k: unpack(raw)[0] for k, raw in scanned.items()} == blocks
    assert store.forget(model="m", records={3: scanned[3], 4: b"not what is stored"}) == 1
    store.clock[0] += 5
    store.record(model="m", blocks={5: blocks[5]})  # written again: another stamp
    assert store.forget(model="m", records={5: scanned[5]}) == 0
    assert store.get(model="m", keys=[3, 4, 5]) == [None, blocks[4], blocks[5]]


def test_the_memory_store_keeps_the_blocks_written_last() -> None:
    store = MemoryDynamoBlockStore(max_blocks=3)
    for key in range(1, 6):
        store.record(model="m", blocks={key: DynamoBlock(None, 1337, key)})
    assert [b is not None for b in store.get(model="m", keys=[1, 2, 3, 4, 5])] == [
        False,
        False,
        True,
        True,
        True,
    ]


def chain(*keys: int) -> dict[int, DynamoBlock]:
    """Records of blocks chained in this order, the first a chain's first."""
    return {key: DynamoBlock(keys[i - 1] if i else None, 1337, key * 10) for i, key in enumerate(keys)}


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_held_blocks_are_each_holders_recorded_blocks_by_tier_and_stale_records_go(backend, request) -> None:
    index = MemoryIndex() if backend == "memory" else open_index(request.getfixturevalue("redis_url"))
    clock = [10_000.0]
    store = MemoryDynamoBlockStore(clock=lambda: clock[0])
    records = chain(1, 2, 3) | chain(7)
    store.record(model="m", blocks=records)
    index.store(
        model="m", pod="7", tier="gpu", blocks=[StoredBlock(k, k, k.to_bytes(8, "big")) for k in (1, 2)]
    )
    index.store(model="m", pod="7#dp1", tier="cpu", blocks=[StoredBlock(1, 1, (1).to_bytes(8, "big"))])
    held = held_blocks(index, store, model="m", now=clock[0] + PRUNE_GRACE_SECONDS)
    assert held == {"7": {"gpu": {1: records[1], 2: records[2]}}, "7#dp1": {"cpu": {1: records[1]}}}
    assert store.get(model="m", keys=[3, 7]) == [records[3], records[7]]  # not yet stale
    held_blocks(index, store, model="m", now=clock[0] + PRUNE_GRACE_SECONDS + 1)
    assert store.get(model="m", keys=[1, 2, 3, 7]) == [records[1], records[2], None, None]
    index.close()


def test_runs_put_every_parent_first_and_leave_out_what_no_chain_reaches() -> None:
    held = (
        chain(1, 2, 3, 4)
        | chain(1, 2, 5, 6)
        | chain(1, 2, 5, 8)
        | chain(9)
        | {11: DynamoBlock(10, 1337, 110)}
    )
    assert runs(held) == [
        Run(None, [(1, 10), (2, 20)]),
        Run(2, [(3, 30), (4, 40)]),
        Run(2, [(5, 50)]),
        Run(5, [(6, 60)]),
        Run(5, [(8, 80)]),
        Run(None, [(9, 90)]),
    ]
    assert runs({}) == []


def test_prune_deletes_the_stale_records_of_blocks_nobody_holds_and_counts_the_rest() -> None:
    index = MemoryIndex()
    clock = [10_000.0]
    store = MemoryDynamoBlockStore(clock=lambda: clock[0])
    store.record(model="m", blocks=chain(1, 2, 3))
    index.store(model="m", pod="7", tier="gpu", blocks=[StoredBlock(1, 1, (1).to_bytes(8, "big"))])
    assert prune(index, store, model="m", now=clock[0]) == 1
    assert len(dict(kv for chunk in store.scan(model="m") for kv in chunk)) == 3
    assert prune(index, store, model="m", now=clock[0] + PRUNE_GRACE_SECONDS + 1) == 1
    assert store.get(model="m", keys=[1, 2, 3]) == [chain(1)[1], None, None]
