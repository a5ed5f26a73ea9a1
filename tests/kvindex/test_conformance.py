"""What every index backend guarantees (upstream's shared suite, plus what we promise beyond it).

Each test runs against the in-memory index, a real Valkey server and a real Valkey Cluster of 3
masters.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterator

import pytest

from kvindex import KVIndex, MemoryIndex, PodBlocks, StoredBlock, open_index
from kvindex.base import ClearPod, IndexUpdate, Progress, Remove, Store
from tests.kvindex import MODEL, chain, hashes, keys

A, B, C, D = chain(4)
FOUR = [A, B, C, D]
GPU = frozenset({"gpu"})
CPU = frozenset({"cpu"})


@pytest.fixture(
    params=[
        "memory",
        "memory-python",
        "memory-max-bytes",
        "redis",
        "redis-compact",
        "redis-cluster",
        "redis-cluster-compact",
    ]
)
def index(request: pytest.FixtureRequest) -> Iterator[KVIndex]:
    if request.param == "memory":
        # Its bound on entries per key is its own (test_memory); 50 writers x 2 tiers must fit.
        idx: KVIndex = MemoryIndex(pod_cache_size=1000)
    elif request.param == "memory-python":  # the pure-Python fallback of the compiled maps and chain
        request.getfixturevalue("python_fallback")
        idx = MemoryIndex(pod_cache_size=1000, native=False)
    elif request.param == "memory-max-bytes":
        # The same, with a byte budget that every test fits in, so the bookkeeping runs throughout.
        idx = MemoryIndex(pod_cache_size=1000, max_bytes=64 << 20)
    elif request.param == "redis-cluster":
        idx = open_index(request.getfixturevalue("redis_cluster_url"))
    elif request.param == "redis-cluster-compact":
        idx = open_index(request.getfixturevalue("redis_cluster_url") + "?layout=compact")
    elif request.param == "redis-compact":
        idx = open_index(request.getfixturevalue("redis_url") + "?layout=compact")
    else:
        idx = open_index(request.getfixturevalue("redis_url"))
    yield idx
    idx.close()


@pytest.fixture(
    params=["memory", "memory-python", "redis", "redis-compact", "redis-cluster", "redis-cluster-compact"]
)
def tiny_slices(request: pytest.FixtureRequest) -> Iterator[KVIndex]:
    """An index that cuts every write into slices of at most 3 blocks, hashes or entries."""
    if request.param == "memory":
        idx: KVIndex = MemoryIndex(pod_cache_size=1000, slice_blocks=3)
    elif request.param == "memory-python":
        request.getfixturevalue("python_fallback")
        idx = MemoryIndex(pod_cache_size=1000, slice_blocks=3, native=False)
    elif request.param == "redis-cluster":
        idx = open_index(request.getfixturevalue("redis_cluster_url"), slice_blocks=3)
    elif request.param == "redis-cluster-compact":
        idx = open_index(request.getfixturevalue("redis_cluster_url"), slice_blocks=3, layout="compact")
    elif request.param == "redis-compact":
        idx = open_index(request.getfixturevalue("redis_url"), slice_blocks=3, layout="compact")
    else:
        idx = open_index(request.getfixturevalue("redis_url"), slice_blocks=3)
    yield idx
    idx.close()


def adopted(n: int, *, first: int = 1) -> list[StoredBlock]:
    """``n`` adopted blocks (digest = the key's 8 bytes, engine hash = key + 10**12): cheap in bulk."""
    return [
        StoredBlock(key=k, engine_hash=10**12 + k, digest=k.to_bytes(8, "big"))
        for k in range(first, first + n)
    ]


# -- store and lookup --------------------------------------------------------------------------


def test_lookup_returns_every_pod_that_stored_the_blocks(index: KVIndex) -> None:
    for pod in ("pod1", "pod2", "pod3"):
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=FOUR)

    assert index.lookup(model=MODEL, keys=keys(FOUR)) == [{"pod1": GPU, "pod2": GPU, "pod3": GPU}] * 4


def test_pod_and_tier_together_are_the_identity(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=[A])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": {"gpu", "cpu"}}]
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 1, "cpu": 1})]


def test_lookup_filtered_by_pods_keeps_only_those_pods(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=FOUR)

    assert index.lookup(model=MODEL, keys=keys(FOUR), pods={"pod1"}) == [{"pod1": GPU}] * 4
    assert index.lookup(model=MODEL, keys=keys(FOUR), pods=["pod2", "pod999"]) == [{"pod2": GPU}] * 4
    assert index.lookup(model=MODEL, keys=keys(FOUR), pods={"pod999"}) == []
    assert index.lookup(model=MODEL, keys=keys(FOUR), pods=set()) == []


def test_lookup_stops_at_the_first_key_without_a_holder(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A, B, D])

    assert index.lookup(model=MODEL, keys=keys(FOUR)) == [{"pod1": GPU}] * 2
    assert index.lookup(model=MODEL, keys=[C.key, D.key]) == []
    assert index.lookup(model=MODEL, keys=[]) == []


def test_holders_answers_every_key_without_stopping_at_a_miss(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A, B, D])
    index.store(model=MODEL, pod="pod2", tier="cpu", blocks=[D])

    assert index.holders(model=MODEL, keys=keys(FOUR)) == [
        {"pod1": GPU},
        {"pod1": GPU},
        {},
        {"pod1": GPU, "pod2": CPU},
    ]
    assert index.holders(model=MODEL, keys=[C.key]) == [{}]
    assert index.holders(model=MODEL, keys=[]) == []
    assert index.holders(model="other/model", keys=keys(FOUR)) == [{}] * 4


def test_filtered_lookup_stops_where_the_wanted_pods_stop(index: KVIndex) -> None:
    index.store(model=MODEL, pod="long", tier="gpu", blocks=FOUR)
    index.store(model=MODEL, pod="short", tier="gpu", blocks=[A, B])

    assert index.lookup(model=MODEL, keys=keys(FOUR), pods={"short"}) == [{"short": GPU}] * 2
    assert len(index.lookup(model=MODEL, keys=keys(FOUR))) == 4


def test_store_is_idempotent(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)

    assert index.lookup(model=MODEL, keys=keys(FOUR)) == [{"pod1": GPU}] * 4
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 4})]
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[A.engine_hash]) == 1
    assert index.lookup(model=MODEL, keys=[A.key]) == []


def test_models_are_separate_indexes(index: KVIndex) -> None:
    index.store(model="model-a", pod="pod1", tier="gpu", blocks=FOUR)

    assert index.lookup(model="model-b", keys=keys(FOUR)) == []
    assert index.resolve(model="model-b", pod="pod1", engine_hashes=[A.engine_hash]) == [None]


def test_empty_writes_change_nothing(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[])

    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[]) == 0
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[]) == []
    assert index.pod_blocks() == []


# -- remove and the engine-hash map ------------------------------------------------------------


def test_remove_evicts_exactly_the_pod_and_tier_given(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=FOUR)
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=FOUR)

    removed = index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes([A, B]))

    assert removed == 2
    after = index.lookup(model=MODEL, keys=keys(FOUR))
    assert after[:2] == [{"pod1": CPU, "pod2": GPU}] * 2
    assert after[2:] == [{"pod1": {"gpu", "cpu"}, "pod2": GPU}] * 2


def test_remove_counts_only_entries_that_were_there(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])

    assert index.remove(model=MODEL, pod="pod1", tier="cpu", engine_hashes=[A.engine_hash]) == 0
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[A.engine_hash, 12345]) == 1
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[A.engine_hash]) == 0
    assert index.remove(model=MODEL, pod="nobody", tier="gpu", engine_hashes=[A.engine_hash]) == 0


def test_resolve_maps_engine_hashes_to_digests_while_the_pod_holds_them(index: KVIndex) -> None:
    misaligned = chain(2, engine_hash_offset=1000)  # an engine that hashes differently
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=misaligned)

    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[1000, 1001, 7]) == [
        misaligned[0].digest,
        misaligned[1].digest,
        None,
    ]
    assert index.resolve(model=MODEL, pod="pod2", engine_hashes=[1000]) == [None]

    index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[1000])

    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[1000, 1001]) == [None, misaligned[1].digest]


def test_engine_hash_goes_only_when_the_pod_holds_the_block_on_no_tier(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=[A])
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=[A])

    index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[A.engine_hash])
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [A.digest]

    index.remove(model=MODEL, pod="pod1", tier="cpu", engine_hashes=[A.engine_hash])
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [None]
    assert index.resolve(model=MODEL, pod="pod2", engine_hashes=[A.engine_hash]) == [A.digest]


def test_every_engine_hash_of_a_dropped_block_goes(index: KVIndex) -> None:
    # After a restart with another hash seed, an engine reports the same block under a new hash.
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=chain(1, engine_hash_offset=1000))
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=chain(1, engine_hash_offset=2000))

    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[2000]) == 1
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[1000, 2000]) == [None, None]


def test_an_engine_hash_reported_again_points_at_the_newest_block(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=chain(1, engine_hash_offset=7))
    other = chain(1, first_token=100, engine_hash_offset=7)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=other)

    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[7]) == [other[0].digest]
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[7]) == 1
    assert index.lookup(model=MODEL, keys=keys(other)) == []
    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": GPU}]  # still held, by no hash


# -- clearing and counting ---------------------------------------------------------------------


def test_clear_pod_removes_only_that_pod(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=[A, B])
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=FOUR)

    assert index.clear_pod(pod="pod1", model=MODEL) == 6

    assert index.lookup(model=MODEL, keys=keys(FOUR)) == [{"pod2": GPU}] * 4
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [None]
    assert index.resolve(model=MODEL, pod="pod2", engine_hashes=[A.engine_hash]) == [A.digest]
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod2", {"gpu": 4})]
    assert index.clear_pod(pod="pod1", model=MODEL) == 0


def test_clear_pod_without_a_model_clears_it_under_every_model(index: KVIndex) -> None:
    for model in ("model-a", "model-b"):
        index.store(model=model, pod="pod1", tier="gpu", blocks=FOUR)
        index.store(model=model, pod="pod2", tier="gpu", blocks=[A])

    assert index.clear_pod(pod="pod1") == 8

    assert index.pod_blocks() == [
        PodBlocks("model-a", "pod2", {"gpu": 1}),
        PodBlocks("model-b", "pod2", {"gpu": 1}),
    ]


def test_clear_pod_under_one_model_leaves_the_others(index: KVIndex) -> None:
    for model in ("model-a", "model-b"):
        index.store(model=model, pod="pod1", tier="gpu", blocks=[A])

    assert index.clear_pod(pod="pod1", model="model-a") == 1
    assert index.lookup(model="model-b", keys=[A.key]) == [{"pod1": GPU}]


def test_clear_model_removes_everything_under_it_and_nothing_else(index: KVIndex) -> None:
    for model in ("model-a", "model-b"):
        index.store(model=model, pod="pod1", tier="gpu", blocks=FOUR)
        index.store(model=model, pod="pod2", tier="cpu", blocks=[A])

    assert index.clear_model(model="model-a") == 5

    assert index.lookup(model="model-a", keys=keys(FOUR)) == []
    assert index.resolve(model="model-a", pod="pod1", engine_hashes=[A.engine_hash]) == [None]
    assert index.lookup(model="model-b", keys=[A.key]) == [{"pod1": GPU, "pod2": CPU}]
    assert [(p.model, p.pod) for p in index.pod_blocks()] == [("model-b", "pod1"), ("model-b", "pod2")]
    assert index.clear_model(model="model-a") == 0


def test_pod_blocks_counts_live_blocks_by_tier_sorted_by_model_then_pod(index: KVIndex) -> None:
    index.store(model="m2", pod="pod-b", tier="gpu", blocks=FOUR)
    index.store(model="m2", pod="pod-a", tier="gpu", blocks=[A])
    index.store(model="m1", pod="pod-z", tier="cpu", blocks=[A, B])
    index.store(model="m1", pod="pod-z", tier="gpu", blocks=[A])
    index.remove(model="m2", pod="pod-b", tier="gpu", engine_hashes=[D.engine_hash])

    assert index.pod_blocks() == [
        PodBlocks("m1", "pod-z", {"cpu": 2, "gpu": 1}),
        PodBlocks("m2", "pod-a", {"gpu": 1}),
        PodBlocks("m2", "pod-b", {"gpu": 3}),
    ]
    assert index.pod_blocks(model="m1") == [PodBlocks("m1", "pod-z", {"cpu": 2, "gpu": 1})]
    assert index.pod_blocks(model="unknown") == []


def test_a_pod_whose_last_block_goes_is_no_longer_listed(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[A.engine_hash])

    assert index.pod_blocks() == []


# -- batched updates ---------------------------------------------------------------------------


def mixed_updates(model: str) -> list[IndexUpdate]:
    """Stores, removes and a clear whose result depends on their order."""
    return [
        Store(model, "pod1", "gpu", FOUR),
        Store(model, "pod2", "gpu", [A, B]),
        Store(model, "pod1", "cpu", [A]),
        Remove(model, "pod1", "gpu", [A.engine_hash, B.engine_hash, 12345]),
        ClearPod(model, "pod2"),
        Store(model, "pod2", "cpu", [C, D]),
        Remove(model, "pod1", "cpu", [A.engine_hash]),
        Store(model, "pod1", "gpu", []),
        Remove(model, "pod1", "gpu", []),
        Store(model, "pod3", "gpu", [A]),
    ]


def apply_one_by_one(index: KVIndex, updates: list[IndexUpdate]) -> list[int]:
    counts = []
    for u in updates:
        if isinstance(u, Store):
            index.store(model=u.model, pod=u.pod, tier=u.tier, blocks=u.blocks)
            counts.append(len(u.blocks))
        elif isinstance(u, Remove):
            counts.append(index.remove(model=u.model, pod=u.pod, tier=u.tier, engine_hashes=u.engine_hashes))
        else:
            counts.append(index.clear_pod(pod=u.pod, model=u.model))
    return counts


def state(index: KVIndex, model: str) -> tuple:
    """Everything a reader can see under ``model``."""
    return (
        [index.lookup(model=model, keys=[k]) for k in keys(FOUR)],
        {
            pod: index.resolve(model=model, pod=pod, engine_hashes=hashes(FOUR))
            for pod in ("pod1", "pod2", "pod3")
        },
        [(p.pod, p.blocks_by_tier) for p in index.pod_blocks(model=model)],
    )


def test_apply_updates_applies_them_in_order_and_counts_each(index: KVIndex) -> None:
    counts = index.apply_updates(mixed_updates(MODEL))

    assert counts == [4, 2, 1, 2, 2, 2, 1, 0, 0, 1]
    assert index.lookup(model=MODEL, keys=keys(FOUR)) == [{"pod3": GPU}]
    assert index.lookup(model=MODEL, keys=[C.key, D.key]) == [{"pod1": GPU, "pod2": CPU}] * 2
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(FOUR)) == [
        None,
        None,
        C.digest,
        D.digest,
    ]
    assert index.pod_blocks() == [
        PodBlocks(MODEL, "pod1", {"gpu": 2}),
        PodBlocks(MODEL, "pod2", {"cpu": 2}),
        PodBlocks(MODEL, "pod3", {"gpu": 1}),
    ]


def test_apply_updates_does_what_the_single_calls_do(index: KVIndex) -> None:
    batched = index.apply_updates(mixed_updates("batched"))
    one_by_one = apply_one_by_one(index, mixed_updates("single"))

    assert batched == one_by_one
    assert state(index, "batched") == state(index, "single")


def test_apply_updates_keeps_the_order_of_a_store_and_a_remove(index: KVIndex) -> None:
    assert index.apply_updates(
        [Store(MODEL, "pod1", "gpu", [A]), Remove(MODEL, "pod1", "gpu", [A.engine_hash])]
    ) == [1, 1]
    assert index.lookup(model=MODEL, keys=[A.key]) == []

    assert index.apply_updates(
        [Remove(MODEL, "pod1", "gpu", [A.engine_hash]), Store(MODEL, "pod1", "gpu", [A])]
    ) == [0, 1]
    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": GPU}]


def test_apply_updates_of_nothing_changes_nothing(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)

    assert index.apply_updates([]) == []
    assert index.apply_updates([Store(MODEL, "pod1", "gpu", []), Remove(MODEL, "pod1", "gpu", [])]) == [0, 0]
    assert index.apply_updates([ClearPod(MODEL, "nobody"), ClearPod("no-model", "pod1")]) == [0, 0]
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 4})]


def test_apply_updates_rejects_what_is_not_an_update_before_applying_any(index: KVIndex) -> None:
    with pytest.raises(TypeError):
        index.apply_updates([Store(MODEL, "pod1", "gpu", [A]), ("store", MODEL)])  # type: ignore[list-item]

    assert index.pod_blocks() == []


def test_apply_updates_agrees_with_single_calls_on_a_random_workload(index: KVIndex) -> None:
    rng = random.Random(5)
    # Engine hashes 77.. name different blocks in the second chain: they get re-pointed.
    blocks = chain(10) + chain(4, first_token=1000, engine_hash_offset=77) + chain(3, engine_hash_offset=77)
    pods, tiers = ["p1", "p2", "p3"], ["gpu", "cpu"]
    for _ in range(40):
        batch: list[IndexUpdate] = []
        for _ in range(rng.randrange(1, 12)):
            pod, tier, action = rng.choice(pods), rng.choice(tiers), rng.random()
            if action < 0.55:
                start = rng.randrange(len(blocks))
                batch.append(Store(MODEL, pod, tier, blocks[start : start + rng.randrange(1, 7)]))
            elif action < 0.9:
                batch.append(Remove(MODEL, pod, tier, hashes(rng.sample(blocks, 4))))
            else:
                batch.append(ClearPod(MODEL, pod))
        mirrored = [dataclasses.replace(u, model="single") for u in batch]

        assert index.apply_updates(batch) == apply_one_by_one(index, mirrored)
        for pod in pods:
            assert index.resolve(model=MODEL, pod=pod, engine_hashes=hashes(blocks)) == index.resolve(
                model="single", pod=pod, engine_hashes=hashes(blocks)
            )
        for k in keys(blocks):
            assert index.lookup(model=MODEL, keys=[k]) == index.lookup(model="single", keys=[k])
    assert [(p.pod, p.blocks_by_tier) for p in index.pod_blocks(model=MODEL)] == [
        (p.pod, p.blocks_by_tier) for p in index.pod_blocks(model="single")
    ]


def test_apply_updates_in_slices_agrees_with_whole_updates_on_a_random_workload(
    tiny_slices: KVIndex,
) -> None:
    rng = random.Random(8)
    oracle = MemoryIndex(pod_cache_size=1000)  # slices of 4096: every update here is whole
    blocks = chain(10) + chain(4, first_token=1000, engine_hash_offset=77) + chain(3, engine_hash_offset=77)
    pods, tiers = ["p1", "p2", "p3"], ["gpu", "cpu"]
    for n in range(40):
        batch: list[IndexUpdate] = []
        for _ in range(rng.randrange(1, 12)):
            pod, tier, action = rng.choice(pods), rng.choice(tiers), rng.random()
            if action < 0.5:
                start = rng.randrange(len(blocks))
                batch.append(Store(MODEL, pod, tier, blocks[start : start + rng.randrange(1, 11)]))
            elif action < 0.8:
                batch.append(Remove(MODEL, pod, tier, hashes(rng.sample(blocks, rng.randrange(1, 9)))))
            elif action < 0.9:
                batch.append(ClearPod(MODEL, pod))
            else:
                batch.append(Progress(MODEL, pod, n))

        assert tiny_slices.apply_updates(batch) == oracle.apply_updates(batch)
        for pod in pods:
            assert tiny_slices.resolve(model=MODEL, pod=pod, engine_hashes=hashes(blocks)) == oracle.resolve(
                model=MODEL, pod=pod, engine_hashes=hashes(blocks)
            )
        for k in keys(blocks):
            assert tiny_slices.lookup(model=MODEL, keys=[k]) == oracle.lookup(model=MODEL, keys=[k])
        assert tiny_slices.pod_blocks() == oracle.pod_blocks()
        assert tiny_slices.progress() == oracle.progress()


def test_a_clear_in_slices_removes_the_whole_pod_and_counts_every_entry(tiny_slices: KVIndex) -> None:
    blocks = chain(10)
    tiny_slices.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    tiny_slices.store(model=MODEL, pod="pod1", tier="cpu", blocks=blocks[:5])
    tiny_slices.store(model=MODEL, pod="pod2", tier="gpu", blocks=blocks[:2])

    assert tiny_slices.apply_updates([ClearPod(MODEL, "pod1"), Progress(MODEL, "pod1", 3)]) == [15, 0]
    assert tiny_slices.pod_blocks() == [PodBlocks(MODEL, "pod2", {"gpu": 2})]
    assert tiny_slices.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks)) == [None] * 10
    assert tiny_slices.progress() == {(MODEL, "pod1"): 3}
    assert tiny_slices.clear_model(model=MODEL) == 2
    assert tiny_slices.pod_blocks() == []


# -- slices of large writes --------------------------------------------------------------------


def everything(index: KVIndex, blocks: list[StoredBlock]) -> tuple:
    """What a reader can see of ``blocks`` under ``MODEL`` (pods pod1 and pod2)."""
    return (
        index.lookup(model=MODEL, keys=keys(blocks)),
        index.lookup(model=MODEL, keys=keys(blocks), pods={"pod2"}),
        [index.resolve(model=MODEL, pod=pod, engine_hashes=hashes(blocks)) for pod in ("pod1", "pod2")],
        index.pod_blocks(),
    )


def test_a_65536_block_store_and_its_removal_match_the_same_in_small_writes(index: KVIndex) -> None:
    blocks = adopted(65536)
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=blocks[:1000])

    assert index.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 1)]) == [
        65536,
        0,
    ]
    whole = everything(index, blocks)
    assert index.progress() == {(MODEL, "pod1"): 1}
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks)) == 65536
    after_whole_remove = everything(index, blocks)

    for i in range(0, 65536, 1000):
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks[i : i + 1000])
    assert everything(index, blocks) == whole
    removed = sum(
        index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks[i : i + 1000]))
        for i in range(0, 65536, 1000)
    )
    assert removed == 65536
    assert everything(index, blocks) == after_whole_remove
    assert after_whole_remove[0] == [{"pod2": GPU}] * 1000
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod2", {"gpu": 1000})]


def test_clear_pod_of_a_big_pod_counts_every_entry(index: KVIndex) -> None:
    blocks = adopted(20000)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=blocks[:7000])
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=blocks[:10])

    assert index.clear_pod(pod="pod1", model=MODEL) == 27000
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod2", {"gpu": 10})]
    assert index.lookup(model=MODEL, keys=keys(blocks)) == [{"pod2": GPU}] * 10
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks[:5])) == [None] * 5
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    assert index.clear_model(model=MODEL) == 20010
    assert index.pod_blocks() == []


# -- progress ----------------------------------------------------------------------------------


def test_progress_is_recorded_per_model_and_holder(index: KVIndex) -> None:
    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", FOUR),
            Progress(MODEL, "pod1", 7),
            Progress(MODEL, "pod1#dp1", 2),
            Progress("other-model", "pod1", 40),
        ]
    )

    assert counts == [4, 0, 0, 0]
    assert index.progress() == {(MODEL, "pod1"): 7, (MODEL, "pod1#dp1"): 2, ("other-model", "pod1"): 40}
    assert index.progress(model=MODEL) == {(MODEL, "pod1"): 7, (MODEL, "pod1#dp1"): 2}
    assert index.progress(model="unknown") == {}


def test_a_later_progress_replaces_the_seq_even_a_lower_one(index: KVIndex) -> None:
    index.apply_updates([Progress(MODEL, "pod1", 7)])
    index.apply_updates([Store(MODEL, "pod1", "gpu", [A]), Progress(MODEL, "pod1", 9)])
    assert index.progress() == {(MODEL, "pod1"): 9}

    index.apply_updates([Store(MODEL, "pod1", "gpu", [B]), Progress(MODEL, "pod1", 0)])  # a restart
    assert index.progress() == {(MODEL, "pod1"): 0}


def test_progress_follows_the_update_it_ends_in_the_same_call(index: KVIndex) -> None:
    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", FOUR),
            Progress(MODEL, "pod1", 1),
            Remove(MODEL, "pod1", "gpu", [D.engine_hash]),
            Progress(MODEL, "pod1", 2),
            Store(MODEL, "pod2", "gpu", [A]),
            ClearPod(MODEL, "pod2"),
            Progress(MODEL, "pod2", 5),
        ]
    )

    assert counts == [4, 0, 1, 0, 1, 1, 0]
    assert index.lookup(model=MODEL, keys=keys(FOUR)) == [{"pod1": GPU}] * 3
    assert index.progress() == {(MODEL, "pod1"): 2, (MODEL, "pod2"): 5}


def test_progress_with_no_write_before_it_is_recorded_on_its_own(index: KVIndex) -> None:
    counts = index.apply_updates(
        [
            Progress(MODEL, "pod1", 1),  # first
            Store("other-model", "pod1", "gpu", [A]),
            Progress(MODEL, "pod2", 2),  # after another model's update
            Store(MODEL, "pod3", "gpu", []),
            Progress(MODEL, "pod3", 3),  # after an empty store
            Remove(MODEL, "pod4", "gpu", []),
            Progress(MODEL, "pod4", 4),  # after an empty remove
            Progress(MODEL, "pod4", 5),  # after another progress
        ]
    )

    assert counts == [0, 1, 0, 0, 0, 0, 0, 0]
    assert index.progress(model=MODEL) == {
        (MODEL, "pod1"): 1,
        (MODEL, "pod2"): 2,
        (MODEL, "pod3"): 3,
        (MODEL, "pod4"): 5,
    }
    assert index.pod_blocks() == [PodBlocks("other-model", "pod1", {"gpu": 1})]


def test_clears_leave_progress(index: KVIndex) -> None:
    index.apply_updates([Store(MODEL, "pod1", "gpu", FOUR), Progress(MODEL, "pod1", 12)])
    index.apply_updates([Store("other-model", "pod1", "gpu", FOUR), Progress("other-model", "pod1", 4)])

    index.clear_pod(pod="pod1")
    index.clear_model(model=MODEL)

    assert index.progress() == {(MODEL, "pod1"): 12, ("other-model", "pod1"): 4}
    assert index.pod_blocks() == []


# -- epoch markers -----------------------------------------------------------------------------


def test_a_model_without_an_epoch_marker_has_none(index: KVIndex) -> None:
    assert index.epochs([MODEL]) == [None]
    assert index.epochs([]) == []


def test_set_epoch_if_absent_writes_only_the_first_marker(index: KVIndex) -> None:
    assert index.set_epoch(model=MODEL, value="first", if_absent=True) is True
    assert index.set_epoch(model=MODEL, value="second", if_absent=True) is False
    assert index.epochs([MODEL]) == ["first"]

    assert index.set_epoch(model=MODEL, value="third") is True
    assert index.epochs([MODEL]) == ["third"]


def test_epochs_reads_several_models_in_order(index: KVIndex) -> None:
    index.set_epoch(model="m1", value="abc:ready")
    index.set_epoch(model="m/3", value="")

    assert index.epochs(["m/3", "m2", "m1", "m1"]) == ["", None, "abc:ready", "abc:ready"]


def test_clears_leave_the_epoch_marker(index: KVIndex) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=FOUR)
    index.set_epoch(model=MODEL, value="token")

    index.clear_pod(pod="pod1", model=MODEL)
    index.clear_model(model=MODEL)

    assert index.epochs([MODEL]) == ["token"]


# -- names -------------------------------------------------------------------------------------


def test_names_with_separators_are_kept_apart_from_look_alikes(index: KVIndex) -> None:
    index.store(model="a@b", pod="c", tier="gpu", blocks=[A])
    index.store(model="a", pod="b@c", tier="gpu", blocks=[A, B])

    assert index.lookup(model="a@b", keys=keys(FOUR)) == [{"c": GPU}]
    assert index.lookup(model="a", keys=keys(FOUR)) == [{"b@c": GPU}] * 2
    assert index.pod_blocks() == [PodBlocks("a", "b@c", {"gpu": 2}), PodBlocks("a@b", "c", {"gpu": 1})]


@pytest.mark.parametrize(
    "name",
    ["org/model:v1", "10.0.0.1:8000", "a@b@c", "{tag}", "100%", "%41", "with space", "naïve", "x:t:gpu", ""],
)
def test_any_model_pod_and_tier_name_round_trips(index: KVIndex, name: str) -> None:
    index.store(model=name, pod=name, tier=name, blocks=[A])
    index.store(model=name, pod=name + "@", tier="gpu", blocks=[A])

    assert index.lookup(model=name, keys=[A.key], pods={name}) == [{name: frozenset({name})}]
    assert index.pod_blocks(model=name) == sorted(
        [PodBlocks(name, name, {name: 1}), PodBlocks(name, name + "@", {"gpu": 1})], key=lambda p: p.pod
    )
    assert index.resolve(model=name, pod=name, engine_hashes=[A.engine_hash]) == [A.digest]
    assert index.clear_pod(pod=name, model=name) == 1
    assert index.lookup(model=name, keys=[A.key]) == [{name + "@": GPU}]


# -- concurrency -------------------------------------------------------------------------------


def test_100_concurrent_writers_and_readers_leave_a_consistent_index(index: KVIndex) -> None:
    blocks = chain(16)
    errors: list[BaseException] = []
    start = threading.Barrier(100)

    def writer(n: int) -> None:
        pod = f"pod{n}"
        rng = random.Random(n)
        start.wait()
        for _ in range(5):
            index.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks)
            index.store(model=MODEL, pod=pod, tier="cpu", blocks=blocks[:4])
            index.remove(model=MODEL, pod=pod, tier="gpu", engine_hashes=hashes(rng.sample(blocks, 4)))
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks)
        index.remove(model=MODEL, pod=pod, tier="gpu", engine_hashes=hashes(blocks[8:]))

    def reader(_: int) -> None:
        start.wait()
        for _ in range(10):
            for holders in index.lookup(model=MODEL, keys=keys(blocks)):
                assert holders and all(tiers <= {"gpu", "cpu"} for tiers in holders.values())
            index.lookup(model=MODEL, keys=keys(blocks), pods={"pod0", "pod1"})
            index.pod_blocks()

    def run(target, n: int) -> None:
        try:
            target(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(writer if n % 2 else reader, n)) for n in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    writers = sorted(f"pod{n}" for n in range(1, 100, 2))
    assert index.pod_blocks() == [PodBlocks(MODEL, pod, {"gpu": 8, "cpu": 4}) for pod in writers]
    looked_up = index.lookup(model=MODEL, keys=keys(blocks))
    assert looked_up[:4] == [dict.fromkeys(writers, frozenset({"gpu", "cpu"}))] * 4
    assert looked_up[4:] == [dict.fromkeys(writers, GPU)] * 4
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks[7:9])) == [
        blocks[7].digest,
        None,
    ]


# -- speculative entries -----------------------------------------------------------------------

LONG = keys(chain(20))  # speculation points 7, 15 and 19


def test_a_speculative_entry_is_read_back_by_its_prefix_to_the_last_point_it_holds(
    index: KVIndex,
) -> None:
    index.speculate(model=MODEL, pod="pod1", keys=LONG, seconds=30)

    assert index.speculated(model=MODEL, keys=LONG) == {"pod1": 20}
    # A request sharing the first 18 blocks: the points 7 and 15 are held, 17 (its last) is not.
    assert index.speculated(model=MODEL, keys=LONG[:18]) == {"pod1": 16}
    assert index.speculated(model=MODEL, keys=LONG[:7]) == {}  # its only point, 6, was never written
    assert index.speculated(model=MODEL, keys=keys(chain(20, first_token=1))) == {}
    assert index.speculated(model="another/model", keys=LONG) == {}
    assert index.speculated(model=MODEL, keys=[]) == {}


def test_speculative_entries_of_several_pods_live_side_by_side(index: KVIndex) -> None:
    index.speculate(model=MODEL, pod="pod1", keys=LONG, seconds=30)
    index.speculate(model=MODEL, pod="pod 2@x", keys=LONG[:16], seconds=30)
    index.speculate(model=MODEL, pod="pod1", keys=LONG, seconds=30)  # again: one entry, renewed

    assert index.speculated(model=MODEL, keys=LONG) == {"pod1": 20, "pod 2@x": 16}


def test_speculative_entries_expire_and_are_not_blocks(index: KVIndex) -> None:
    index.speculate(model=MODEL, pod="pod1", keys=LONG, seconds=0.3)
    index.speculate(model=MODEL, pod="pod2", keys=LONG, seconds=30)

    assert index.lookup(model=MODEL, keys=LONG) == []
    assert index.pod_blocks() == []
    assert index.speculated(model=MODEL, keys=LONG) == {"pod1": 20, "pod2": 20}
    time.sleep(0.4)
    assert index.speculated(model=MODEL, keys=LONG) == {"pod2": 20}
