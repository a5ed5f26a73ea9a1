"""The in-memory index: its bounds, what they evict, and that eviction keeps every map consistent;
how its writes let go of the lock between slices."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from kvindex import MemoryIndex, PodBlocks, open_index
from kvindex.base import ClearPod, Progress, Remove, Store, StoredBlock
from kvindex.memory import (
    DEFAULT_MAX_KEYS,
    DEFAULT_POD_CACHE_SIZE,
    DEFAULT_SLICE_BLOCKS,
    parse_size,
)
from tests.kvindex import MODEL, chain, hashes, keys

pytestmark = pytest.mark.usefixtures("both_cores")

A, B, C = chain(3)
GPU = frozenset({"gpu"})


def assert_consistent(index: MemoryIndex) -> None:
    """The invariants stated in ``kvindex.memory``, checked on a dump of its maps (``state``: the
    same shape from the Python and the compiled core)."""
    state = index._core.state()
    entries = {(m, k, p, t) for (m, k), holders in state["blocks"].items() for p, t in holders}
    reverse = {
        (m, k, p, t) for (m, p), pod in state["pods"].items() for t, ks in pod["tiers"].items() for k in ks
    }
    assert entries == reverse
    assert len(state["blocks"]) == len(index) <= index.max_keys
    for holders in state["blocks"].values():
        assert 0 < len(holders) <= index.pod_cache_size
        assert len(set(holders)) == len(holders)
    for pod in state["pods"].values():
        assert pod["tiers"] and all(pod["tiers"].values())
        assert pod["links"] == pod["engine"]
        held = set().union(*pod["tiers"].values())
        assert set(pod["links"].values()) <= held
    assert index.estimated_bytes == index._core.recount_bytes()
    assert index.max_bytes is None or index.estimated_bytes <= index.max_bytes


def recounted_bytes(index: MemoryIndex) -> int:
    """The cost model, summed from scratch over the maps."""
    return index._core.recount_bytes()


def one_block_bytes(*, model: str = MODEL, pod: str = "pod1", tier: str = "gpu") -> int:
    """What one key held by one ``(pod, tier)`` with one 32-byte-digest engine hash costs."""
    return MemoryIndex()._core.entry_bytes(model=model, pod=pod, tier=tier, digest_size=32)


def test_defaults_match_the_documented_bounds() -> None:
    index = MemoryIndex()

    assert (index.max_keys, index.pod_cache_size) == (DEFAULT_MAX_KEYS, DEFAULT_POD_CACHE_SIZE)
    assert (DEFAULT_MAX_KEYS, DEFAULT_POD_CACHE_SIZE) == (10_000_000, 128)


def test_a_third_key_evicts_the_first_when_two_fit() -> None:
    index = MemoryIndex(max_keys=2)
    for block in (A, B, C):
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[block])

    assert len(index) == 2
    assert index.lookup(model=MODEL, keys=[A.key]) == []
    assert index.lookup(model=MODEL, keys=[B.key, C.key]) == [{"pod1": GPU}] * 2
    resolved = index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes([A, B, C]))
    assert resolved == [None, B.digest, C.digest]
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 2})]
    assert_consistent(index)


def test_the_key_bound_counts_keys_across_models() -> None:
    index = MemoryIndex(max_keys=2)
    index.store(model="m1", pod="pod1", tier="gpu", blocks=[A])
    index.store(model="m2", pod="pod1", tier="gpu", blocks=[A])
    index.store(model="m3", pod="pod1", tier="gpu", blocks=[A])

    assert [p.model for p in index.pod_blocks()] == ["m2", "m3"]
    assert_consistent(index)


def test_a_lookup_hit_makes_a_key_most_recent() -> None:
    index = MemoryIndex(max_keys=2)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A, B])
    index.lookup(model=MODEL, keys=[A.key])
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[C])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": GPU}]
    assert index.lookup(model=MODEL, keys=[B.key]) == []


def test_storing_again_makes_a_key_most_recent() -> None:
    index = MemoryIndex(max_keys=2)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A, B])
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=[A])
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[C])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": GPU, "pod2": GPU}]
    assert index.lookup(model=MODEL, keys=[B.key]) == []


def test_a_store_larger_than_the_bound_keeps_its_last_blocks() -> None:
    index = MemoryIndex(max_keys=2)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A, B, C])

    assert index.lookup(model=MODEL, keys=[B.key, C.key]) == [{"pod1": GPU}] * 2
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [None]
    assert_consistent(index)


def test_a_third_pod_evicts_the_first_when_two_fit_per_key() -> None:
    index = MemoryIndex(pod_cache_size=2)
    for pod in ("pod1", "pod2", "pod3"):
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=[A])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod2": GPU, "pod3": GPU}]
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [None]
    assert [p.pod for p in index.pod_blocks()] == ["pod2", "pod3"]
    assert_consistent(index)


def test_the_pod_bound_counts_pod_and_tier_entries() -> None:
    index = MemoryIndex(pod_cache_size=2)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=[A])
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=[A])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": {"cpu"}, "pod2": GPU}]
    # pod1 still holds A on cpu, so its engine hash stays.
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [A.digest]
    assert_consistent(index)


def test_storing_again_makes_a_pod_entry_most_recent() -> None:
    index = MemoryIndex(pod_cache_size=2)
    for pod in ("pod1", "pod2", "pod1", "pod3"):
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=[A])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": GPU, "pod3": GPU}]


def test_reverse_index_and_engine_map_stay_consistent_under_random_evictions() -> None:
    rng = random.Random(7)
    index = MemoryIndex(max_keys=12, pod_cache_size=3)
    blocks = chain(20)
    pods, tiers = ["p1", "p2", "p3", "p4", "p5"], ["gpu", "cpu"]
    peak = 0
    for step in range(600):
        pod, tier = rng.choice(pods), rng.choice(tiers)
        action = rng.random()
        if action < 0.55:
            start = rng.randrange(20)
            index.store(model=rng.choice(["m1", "m2"]), pod=pod, tier=tier, blocks=blocks[start : start + 6])
        elif action < 0.85:
            index.remove(model="m1", pod=pod, tier=tier, engine_hashes=hashes(rng.sample(blocks, 5)))
        elif action < 0.95:
            index.lookup(model="m2", keys=keys(blocks[: rng.randrange(20)]))
        else:
            index.clear_pod(pod=pod, model=None if step % 2 else "m1")
        assert_consistent(index)
        peak = max(peak, len(index))
    assert peak == index.max_keys  # the workload reaches the bound, so evictions did happen


class CountingLock:
    """A lock that counts how often it was taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def acquire(self) -> bool:
        self._lock.acquire()
        self.taken += 1
        return True

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_apply_updates_takes_the_lock_once_for_the_whole_batch() -> None:
    index = MemoryIndex()
    index._lock = lock = CountingLock()  # type: ignore[assignment]

    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", [A, B]),
            Remove(MODEL, "pod1", "gpu", [A.engine_hash]),
            ClearPod(MODEL, "pod2"),
            Store(MODEL, "pod2", "cpu", [C]),
        ]
    )

    assert counts == [2, 1, 0, 1]
    assert lock.taken == 1


def test_a_large_store_lets_go_of_the_lock_between_slices() -> None:
    index = MemoryIndex()
    index._lock = lock = CountingLock()  # type: ignore[assignment]
    blocks = [StoredBlock(key=k, engine_hash=k, digest=k.to_bytes(8, "big")) for k in range(1, 65537)]

    counts = index.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 3)])

    assert counts == [65536, 0]
    assert lock.taken == 65536 // DEFAULT_SLICE_BLOCKS == 16  # the progress rides on the last hold
    lock.taken = 0
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks)) == 65536
    assert lock.taken == 16


class CheckingLock(CountingLock):
    """A lock that checks the invariants of ``index`` (and notes its progress and blocks) each
    time it is let go, so at every moment a reader could take it."""

    def __init__(self, index: MemoryIndex) -> None:
        super().__init__()
        self.index = index
        self.seen: list[tuple[dict, int]] = []  # (progress, keys indexed) at each release

    def release(self) -> None:
        assert_consistent(self.index)
        self.seen.append((dict(self.index._progress), len(self.index)))
        super().release()


def test_every_invariant_holds_whenever_a_write_in_slices_lets_go_of_the_lock() -> None:
    index = MemoryIndex(slice_blocks=3)
    index._lock = lock = CheckingLock(index)  # type: ignore[assignment]
    blocks = chain(10)

    index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", blocks),
            Store(MODEL, "pod1", "cpu", blocks[:7]),
            Store(MODEL, "pod2", "gpu", blocks[:4]),
            Remove(MODEL, "pod1", "gpu", hashes(blocks[2:9])),
            ClearPod(MODEL, "pod1"),
        ]
    )
    assert index.clear_model(model=MODEL) == 4

    assert lock.taken > 10
    assert index.pod_blocks() == []


def test_a_progress_is_let_out_with_the_last_slice_of_the_update_before_it() -> None:
    index = MemoryIndex(slice_blocks=3)
    index._lock = lock = CheckingLock(index)  # type: ignore[assignment]

    index.apply_updates([Store(MODEL, "pod1", "gpu", chain(10)), Progress(MODEL, "pod1", 4)])

    assert lock.seen == [({}, 3), ({}, 6), ({}, 8), ({(MODEL, "pod1"): 4}, 10)]  # slices 3, 3, 2, 2


def test_apply_updates_keeps_the_bounds() -> None:
    index = MemoryIndex(max_keys=2, pod_cache_size=2)

    index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", [A, B]),
            Store(MODEL, "pod2", "gpu", [A]),
            Store(MODEL, "pod3", "gpu", [A]),
            Store(MODEL, "pod1", "gpu", [C]),
        ]
    )

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod2": GPU, "pod3": GPU}]
    assert index.lookup(model=MODEL, keys=[B.key]) == []
    assert index.lookup(model=MODEL, keys=[C.key]) == [{"pod1": GPU}]
    assert_consistent(index)


def test_close_empties_the_index() -> None:
    index = MemoryIndex()
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    index.close()

    assert len(index) == 0 and index.pod_blocks() == []


@pytest.mark.parametrize(
    "options", [{"max_keys": 0}, {"pod_cache_size": 0}, {"max_bytes": 0}, {"slice_blocks": 0}]
)
def test_bounds_must_be_positive(options: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        MemoryIndex(**options)


def test_open_index_reads_memory_options_from_the_url() -> None:
    index = open_index("memory://?max_keys=1_000&pod_cache_size=3&slice_blocks=64")

    assert isinstance(index, MemoryIndex)
    assert (index.max_keys, index.pod_cache_size, index.slice_blocks) == (1000, 3, 64)
    assert open_index("memory://?max_keys=5", max_keys=7).max_keys == 7
    assert open_index("memory://").max_keys == DEFAULT_MAX_KEYS


@pytest.mark.parametrize(
    "url",
    [
        "memory://?max_key=5",
        "memory://?max_keys=lots",
        "memory://?max_bytes=lots",
        "memory://?max_bytes=2GB2",
        "memory://?max_bytes=0",
        "postgres://localhost/db",
        "localhost:6379",
    ],
)
def test_open_index_rejects_what_it_cannot_open(url: str) -> None:
    with pytest.raises(ValueError):
        open_index(url)


# -- the byte budget ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("2GiB", 2_147_483_648),
        ("42MB", 42_000_000),
        ("42MiB", 44_040_192),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        (1024, 1024),
        ("1_000", 1000),
        ("7B", 7),
        ("3kb", 3000),
        ("3 KiB", 3072),
        ("2tb", 2_000_000_000_000),
        ("1TiB", 1 << 40),
        ("0.5kib", 512),
        (" 2gib ", 2_147_483_648),
    ],
)
def test_parse_size_reads_decimal_and_binary_units(size: str | int, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize(
    "size", ["", "GiB", "lots", "-1MB", -1, "1.5k", "2 GiBs", "10MBB", "1e9", "2PB", "1.2.3MB", None, 1.5]
)
def test_parse_size_rejects_anything_else(size: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(size)  # type: ignore[arg-type]


def test_a_byte_budget_evicts_the_least_recently_used_keys_first() -> None:
    index = MemoryIndex(max_bytes=2 * one_block_bytes())
    for block in (A, B, C):
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[block])
        assert index.estimated_bytes <= index.max_bytes
        assert_consistent(index)

    assert len(index) == 2 and index.estimated_bytes == 2 * one_block_bytes()
    assert index.lookup(model=MODEL, keys=[A.key]) == []
    assert index.lookup(model=MODEL, keys=[B.key, C.key]) == [{"pod1": GPU}] * 2
    # The evicted key's engine hash went with it.
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes([A, B, C])) == [
        None,
        B.digest,
        C.digest,
    ]


def test_a_lookup_hit_protects_a_key_from_the_byte_budget() -> None:
    index = MemoryIndex(max_bytes=2 * one_block_bytes())
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A, B])
    index.lookup(model=MODEL, keys=[A.key])
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[C])

    assert index.lookup(model=MODEL, keys=[A.key]) == [{"pod1": GPU}]
    assert index.lookup(model=MODEL, keys=[B.key]) == []
    assert_consistent(index)


def test_the_byte_budget_charges_every_holder_of_a_key() -> None:
    index = MemoryIndex(max_bytes=one_block_bytes() + one_block_bytes(pod="pod2"))
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=[A])  # A now costs two holders' worth
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[B])

    assert index.lookup(model=MODEL, keys=[A.key]) == []
    assert index.lookup(model=MODEL, keys=[B.key]) == [{"pod1": GPU}]
    assert index.resolve(model=MODEL, pod="pod2", engine_hashes=[A.engine_hash]) == [None]
    assert_consistent(index)


def test_a_budget_below_one_key_keeps_nothing() -> None:
    index = MemoryIndex(max_bytes=one_block_bytes() - 1)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])

    assert len(index) == 0 and index.estimated_bytes == 0 and index.pod_blocks() == []
    assert_consistent(index)


def test_the_byte_budget_keeps_every_map_consistent_under_random_workloads() -> None:
    rng = random.Random(11)
    index = MemoryIndex(max_bytes=10 * one_block_bytes(), pod_cache_size=3)
    blocks, adopted = chain(20), chain(8, first_token=5000, engine_hash_offset=100)
    pods, tiers = ["p1", "p2", "pod-with-a-long-name"], ["gpu", "cpu"]
    evicted = False
    for step in range(600):
        pod, tier = rng.choice(pods), rng.choice(tiers)
        action = rng.random()
        if action < 0.55:
            start = rng.randrange(20)
            batch = rng.choice([blocks[start : start + 6], adopted[start % 8 :]])
            before = set(index._core.state()["blocks"])
            index.store(model=rng.choice(["m1", "m2"]), pod=pod, tier=tier, blocks=batch)
            # A store drops a key only to fit the budget (the pod bound drops holders, not keys).
            evicted = evicted or not before <= set(index._core.state()["blocks"])
        elif action < 0.85:
            index.remove(model="m1", pod=pod, tier=tier, engine_hashes=hashes(rng.sample(blocks, 5)))
        elif action < 0.95:
            index.lookup(model="m2", keys=keys(blocks[: rng.randrange(20)]))
        else:
            index.clear_pod(pod=pod, model=None if step % 2 else "m1")
        assert_consistent(index)  # includes estimated_bytes == a recount and <= max_bytes
    assert evicted


def _fill(index: MemoryIndex) -> None:
    index.store(model="m1", pod="pod1", tier="gpu", blocks=[A, B, C])
    index.store(model="m1", pod="pod2", tier="cpu", blocks=[A, B])
    index.store(model="m2", pod="pod1", tier="gpu", blocks=chain(3, engine_hash_offset=7))


@pytest.mark.parametrize(
    "clear",
    [
        pytest.param(lambda index: index.close(), id="close"),
        pytest.param(lambda index: [index.clear_pod(pod=p) for p in ("pod1", "pod2")], id="clear_pod"),
        pytest.param(lambda index: [index.clear_model(model=m) for m in ("m1", "m2")], id="clear_model"),
        pytest.param(
            lambda index: index.apply_updates(
                [
                    Remove("m1", "pod1", "gpu", hashes([A, B, C])),
                    Remove("m1", "pod2", "cpu", hashes([A, B])),
                    Remove("m2", "pod1", "gpu", [7, 8, 9]),
                ]
            ),
            id="remove",
        ),
    ],
)
def test_estimated_bytes_returns_to_zero_when_everything_is_cleared(
    clear: Callable[[MemoryIndex], object],
) -> None:
    index = MemoryIndex(max_bytes=1 << 20)
    _fill(index)
    assert index.estimated_bytes == recounted_bytes(index) > 0

    clear(index)

    assert len(index) == 0 and index.estimated_bytes == 0
    assert_consistent(index)


def test_estimated_bytes_is_kept_without_a_budget_too() -> None:
    index = MemoryIndex()
    _fill(index)

    assert index.max_bytes is None and index.estimated_bytes == recounted_bytes(index) > 0


def test_open_index_reads_a_byte_budget_from_the_url() -> None:
    assert open_index("memory://?max_bytes=2GiB").max_bytes == 2_147_483_648
    assert open_index("memory://?max_bytes=42MB&max_keys=10").max_bytes == 42_000_000
    assert open_index("memory://?max_bytes=42MiB").max_bytes == 44_040_192
    assert open_index("memory://?max_bytes=1GB", max_bytes=1000).max_bytes == 1000
    assert open_index("memory://").max_bytes is None
