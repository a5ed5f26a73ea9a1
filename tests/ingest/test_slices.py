"""Large input is applied in slices, other pods' work in between: a batch cut into slices means
exactly what it meant whole, and one pod's huge batch does not hold its worker."""

from __future__ import annotations

import time

import pytest

from ingest.applier import SLICE_BLOCKS, event_slices
from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.keys import chain_digests, key_of, root_digest
from registry.config import ServiceConfig
from tests.ingest.conftest import MODEL, Harness
from tests.servers import wait_until

SEED = "42"
BLOCK = 4


def chain(n: int, *, first_token: int = 0) -> BlockStored:
    """An aligned store of ``n`` blocks (engine hashes equal our keys)."""
    tokens = tuple((first_token + i) % 150_000 for i in range(n * BLOCK))
    keys = [key_of(d) for d in chain_digests(tokens, block_size=BLOCK, parent=root_digest(SEED))]
    return BlockStored(block_hashes=tuple(keys), parent_block_hash=None, token_ids=tokens, block_size=BLOCK)


def test_a_cut_store_chains_each_piece_to_the_last_block_before_it() -> None:
    event = chain(10)
    runs = list(event_slices([event], 4))
    assert [blocks for _, blocks in runs] == [4, 4, 2]
    pieces = [piece for run, _ in runs for piece in run]
    assert [p.parent_block_hash for p in pieces] == [None, event.block_hashes[3], event.block_hashes[7]]
    assert sum((p.block_hashes for p in pieces), ()) == event.block_hashes
    assert sum((p.token_ids for p in pieces), ()) == event.token_ids


def test_runs_hold_at_most_the_slice_and_keep_the_order() -> None:
    events = [
        chain(3),
        BlockRemoved(block_hashes=tuple(range(9))),
        AllBlocksCleared(),
        chain(2, first_token=5),
    ]
    runs = list(event_slices(events, 5))
    assert all(blocks <= 5 for _, blocks in runs)
    flat = [e for run, _ in runs for e in run]
    assert [type(e).__name__ for e in flat] == [
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
        "AllBlocksCleared",
        "BlockStored",
    ]
    assert sum((e.block_hashes for e in flat if isinstance(e, BlockRemoved)), ()) == tuple(range(9))


@pytest.fixture
def one_worker(index):
    harness = Harness(index, ServiceConfig(seed=SEED, default_block_size=BLOCK), workers=1)
    yield harness
    harness.close()


def test_a_store_of_many_slices_lands_whole_and_is_removed_whole(one_worker: Harness) -> None:
    pub = one_worker.publisher("big")
    event = chain(5 * SLICE_BLOCKS + 7)
    pub.send([event])
    one_worker.sync("big", timeout=30)
    keys = list(event.block_hashes)
    assert len(one_worker.index.lookup(model=MODEL, keys=keys)) == len(keys)
    assert one_worker.stream("big").blocks_stored == len(keys)

    pub.send([BlockRemoved(block_hashes=event.block_hashes[len(keys) // 2 :])])
    one_worker.sync("big", timeout=30)
    assert len(one_worker.index.lookup(model=MODEL, keys=keys)) == len(keys) // 2
    pub.send([AllBlocksCleared(), AllBlocksCleared()])
    one_worker.sync("big", timeout=30)
    assert one_worker.index.lookup(model=MODEL, keys=keys) == []


def test_a_huge_batch_does_not_hold_up_another_pod_on_its_worker(one_worker: Harness) -> None:
    big, small = one_worker.publisher("big"), one_worker.publisher("small")
    huge = chain(8 * SLICE_BLOCKS)  # the most one event may carry (~0.3 MB here)
    little = chain(1, first_token=7)
    applied_at: dict[str, float] = {}

    def progress(pod: str) -> int | None:
        return one_worker.index.progress(model=MODEL).get((MODEL, pod))

    big.send([huge])
    small.send([little])
    deadline = time.monotonic() + 60
    while len(applied_at) < 2 and time.monotonic() < deadline:
        for pub in (big, small):
            if pub.pod not in applied_at and progress(pub.pod) == pub.last_seq:
                applied_at[pub.pod] = time.monotonic()
        time.sleep(0.001)
    # One worker, the huge batch first in its queue: the small one still lands long before it.
    assert applied_at["small"] < applied_at["big"]
    wait_until(lambda: one_worker.index.lookup(model=MODEL, keys=[little.block_hashes[0]]), what="small")
