"""The write path end to end: real ZMQ PUB sockets -> ingest pipeline -> each index backend.

Every test runs once per backend (the ``index`` fixture), so memory and Redis are held to the
same behaviour.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time

import msgpack
import pytest

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeLimits, encode_message
from ingest.pool import MAX_MODELS_PER_POD, MAX_RANKS_PER_POD
from ingest.ratelimit import RateLimitedLog
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from tests.events import stored_event as stored
from tests.ingest.conftest import MODEL, Harness, Publisher
from tests.servers import wait_until

SEED = "42"


def held_blocks(harness: Harness, keys: list[int], pod: str, model: str = MODEL) -> int:
    """How many leading ``keys`` the index says ``pod`` holds."""
    return len(harness.index.lookup(model=model, keys=keys, pods=[pod]))


def capture_keys(capture: dict) -> list[int]:
    return block_keys(capture["token_ids"], seed=SEED, lora_name=capture["lora_name"])


@pytest.mark.parametrize("layout", ["array", "map"])
@pytest.mark.parametrize("hash_bytes", [False, True], ids=["int-hashes", "bytes-hashes"])
@pytest.mark.parametrize("capture_name", ["base", "lora"])
def test_real_captures_land_as_their_25_keys(harness, capture_name, layout, hash_bytes, request):
    capture = request.getfixturevalue(f"{capture_name}_capture")
    pub = harness.publisher("pod-a")
    pub.send([stored(capture)], layout=layout, hash_bytes=hash_bytes)
    harness.sync("pod-a")

    holders = harness.index.lookup(model=MODEL, keys=capture["block_hashes"])
    assert len(holders) == 25
    assert all(h == {"pod-a": frozenset({"gpu"})} for h in holders)
    stream = harness.stream("pod-a")
    assert (stream.blocks_stored, stream.aligned_blocks, stream.misaligned_blocks) == (25, 25, 0)


def test_block_removed_removes_the_block_and_breaks_the_prefix_there(harness, base_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture)])
    pub.send([BlockRemoved(block_hashes=(base_capture["block_hashes"][10],), tier="gpu", group_idx=None)])
    harness.sync("pod-a")

    assert held_blocks(harness, capture_keys(base_capture), "pod-a") == 10
    assert harness.stream("pod-a").blocks_removed == 1


def test_all_blocks_cleared_removes_that_pod_only(harness, base_capture):
    a, b = harness.publisher("pod-a"), harness.publisher("pod-b")
    a.send([stored(base_capture)])
    b.send([stored(base_capture)])
    harness.sync("pod-a")
    harness.sync("pod-b")
    a.send([AllBlocksCleared()])
    harness.sync("pod-a")

    keys = capture_keys(base_capture)
    assert held_blocks(harness, keys, "pod-a") == 0
    assert held_blocks(harness, keys, "pod-b") == 25


def test_lora_blocks_are_keyed_apart_from_base_blocks(harness, base_capture, lora_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(lora_capture)])
    harness.sync("pod-a")

    assert held_blocks(harness, capture_keys(lora_capture), "pod-a") == 25
    assert held_blocks(harness, capture_keys(base_capture), "pod-a") == 0


def test_chain_continues_across_events_through_the_parent_hash(harness, base_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture, last=13)])
    pub.send([stored(base_capture, first=13, parent=base_capture["block_hashes"][12])])
    harness.sync("pod-a")

    assert held_blocks(harness, capture_keys(base_capture), "pod-a") == 25


def test_foreign_algorithm_engine_is_indexed_by_token_ids_and_removed_by_its_own_hashes(
    harness, base_capture
):
    """An engine hashing differently (vLLM's default pickle sha256, or another seed) reports
    hashes nobody can recompute: we still key its blocks from their token ids."""
    foreign = [random.Random(i).getrandbits(64) for i in range(25)]
    pub = harness.publisher("pod-x")
    pub.send([stored(base_capture, last=13, block_hashes=tuple(foreign[:13]))])
    pub.send([stored(base_capture, first=13, parent=foreign[12], block_hashes=tuple(foreign[13:]))])
    harness.sync("pod-x")
    keys = capture_keys(base_capture)
    assert held_blocks(harness, keys, "pod-x") == 25
    stream = harness.stream("pod-x")
    assert (stream.aligned_blocks, stream.misaligned_blocks, stream.hash_alignment) == (0, 25, 0.0)

    pub.send([BlockRemoved(block_hashes=(foreign[20],), tier="gpu", group_idx=None)])
    harness.sync("pod-x")
    assert held_blocks(harness, keys, "pod-x") == 20


def test_unknown_parent_is_never_rechained_from_the_root(harness, base_capture):
    """A misaligned pod whose parent we never saw: its blocks are skipped and counted."""
    foreign = [random.Random(100 + i).getrandbits(64) for i in range(25)]
    pub = harness.publisher("pod-x")
    pub.send([stored(base_capture, first=13, parent=foreign[12], block_hashes=tuple(foreign[13:]))])
    harness.sync("pod-x")

    assert harness.stream("pod-x").orphaned_blocks == 12
    assert harness.index.pod_blocks(model=MODEL) == []


def test_aligned_pod_with_unknown_parent_adopts_its_engine_hashes(harness, base_capture):
    """A pod whose hashes have equalled our keys: an unknown parent (e.g. events lost in a gap)
    does not lose its blocks: its engine hashes are our keys."""
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture, last=5)])  # proves alignment
    pub.send([stored(base_capture, first=13, parent=base_capture["block_hashes"][12])])  # 5..12 lost
    harness.sync("pod-a")

    holders = harness.index.lookup(model=MODEL, keys=base_capture["block_hashes"][13:], pods=["pod-a"])
    assert len(holders) == 12
    assert harness.stream("pod-a").orphaned_blocks == 0


def test_hash_only_offload_event_adds_a_tier_to_known_blocks(harness, base_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture)])
    unknown = 12345
    offload = stored(base_capture, last=3, token_ids=(), tier="cpu")
    pub.send([BlockStored(**{**_fields(offload), "block_hashes": (*offload.block_hashes, unknown)})])
    harness.sync("pod-a")

    holders = harness.index.lookup(model=MODEL, keys=capture_keys(base_capture))
    assert [h["pod-a"] for h in holders[:4]] == [frozenset({"gpu", "cpu"})] * 3 + [frozenset({"gpu"})]
    assert harness.stream("pod-a").orphaned_blocks == 1


def test_resent_block_stored_is_idempotent(harness, base_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture)])
    pub.send([stored(base_capture)])
    harness.sync("pod-a")

    assert harness.index.pod_blocks(model=MODEL)[0].blocks_by_tier == {"gpu": 25}


def test_data_parallel_ranks_are_separate_engines(harness, base_capture):
    pub = harness.publisher("pod-a")
    pub.send([stored(base_capture)], rank=0)
    pub.send([stored(base_capture, last=4)], rank=1)
    harness.sync("pod-a")

    holders = harness.index.lookup(model=MODEL, keys=capture_keys(base_capture))
    assert set(holders[0]) == {"pod-a", "pod-a#dp1"}
    assert {s.rank for s in harness.stats.streams() if s.pod == "pod-a"} == {0, 1}


def test_seq_gaps_and_restarts_are_counted(harness, base_capture):
    pub = harness.publisher("pod-a")
    stream = harness.stream("pod-a")
    # Warming the subscription up may itself have lost the first batches: count from here.
    before = (stream.seq_gaps, stream.missed_batches, stream.restarts)
    pub.next_seq += 3  # three batches lost on the way
    pub.send([stored(base_capture, last=2)])
    harness.sync("pod-a")
    pub.next_seq = 0  # the engine restarted
    pub.send([stored(base_capture, last=2)])
    harness.sync("pod-a")

    after = (stream.seq_gaps, stream.missed_batches, stream.restarts)
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == (1, 3, 1)


def test_poison_messages_are_counted_and_the_next_good_event_still_lands(harness, base_capture):
    pub = harness.publisher("pod-a")
    good_payload = msgpack.packb([0.0, [], None])
    topic, seq, _ = encode_message("pod-a", MODEL, 99, good_payload)
    poison = [
        [topic],  # one frame
        [topic, seq],  # two frames
        [topic, b"\x00\x01", good_payload],  # short seq
        [b"kv@\xff\xfe@model", seq, good_payload],  # topic not UTF-8
        [b"kv@@" + MODEL.encode(), seq, good_payload],  # empty pod
        [topic, seq, b"\xc1garbage"],  # not msgpack
        [topic, seq, msgpack.packb("a string")],  # not a batch
        [
            topic,
            seq,
            msgpack.packb([0.0, [["BlockStored", "not-a-list", None, [1, 2], 16]], None]),
        ],  # field types
    ]
    for frames in poison:
        pub.send_frames(frames)
    pub.next_seq = 100
    pub.send([stored(base_capture)])
    harness.sync("pod-a")

    assert held_blocks(harness, capture_keys(base_capture), "pod-a") == 25
    counted = sum(harness.stats.unattributed_errors.values()) + sum(
        harness.stream("pod-a").decode_errors.values()
    )
    assert counted == len(poison)


def test_over_limit_input_is_counted_by_reason_and_never_applied_in_part(harness, base_capture):
    pub = harness.publisher("pod-a")
    huge = msgpack.packb([0.0, [["AllBlocksCleared"]] * 1_000_000, None])  # ~18 MB (issue 9)
    many = msgpack.packb([0.0, [["AllBlocksCleared"]] * 5000, None])
    topic, seq, _ = encode_message("pod-a", MODEL, 99, b"")
    for payload in (huge, many):
        pub.send_frames([topic, seq, payload])
    long_pod = encode_message("p" * 300, MODEL, 1, msgpack.packb([0.0, [], None]))
    pub.send_frames(long_pod)
    pub.next_seq = 100
    too_many_blocks = stored(base_capture)
    too_many_blocks = dataclasses.replace(
        too_many_blocks, block_hashes=tuple(range(70_000)), token_ids=(1,) * (70_000 * 16)
    )
    pub.send([too_many_blocks, stored(base_capture)])  # the first is skipped, the second lands
    harness.sync("pod-a")

    assert held_blocks(harness, capture_keys(base_capture), "pod-a") == 25
    errors = harness.stream("pod-a").decode_errors
    assert (errors["too_large"], errors["too_many_events"], errors["too_many_blocks"]) == (1, 1, 1)
    assert harness.stats.unattributed_errors["topic"] == 1  # the 300-character pod name
    assert all(s.pod != "p" * 300 for s in harness.stats.streams())


def test_pods_beyond_the_limit_are_counted_and_skipped_until_one_is_forgotten(index, base_capture):
    config = ServiceConfig(seed=SEED, default_block_size=16)
    harness = Harness(index, config, limits=DecodeLimits(max_pods=2))
    try:
        harness.publisher("pod-a")
        harness.publisher("pod-b")
        c = Publisher(harness.context, harness.endpoint, pod="pod-c")
        harness.publishers.append(c)

        def sent_and(condition):
            def check():
                c.send([stored(base_capture)])
                time.sleep(0.005)
                return condition()

            return check

        refused = sent_and(lambda: harness.stats.unattributed_errors["too_many_pods"] > 0)
        wait_until(refused, what="pod-c refused")
        assert harness.stream_of("pod-c") is None
        assert held_blocks(harness, capture_keys(base_capture), "pod-c") == 0

        harness.pipeline.forget_pod("pod-b")  # e.g. expired from the registry: its place is free
        wait_until(sent_and(lambda: harness.stream_of("pod-c")), what="pod-c accepted")
        harness.sync("pod-c")
        assert held_blocks(harness, capture_keys(base_capture), "pod-c") == 25
    finally:
        harness.close()


def test_a_hundred_concurrent_engines(harness, base_capture):
    """100 engines publish at once, each its own blocks; every block lands on its own pod."""
    pods = [f"pod-{i:03d}" for i in range(100)]
    publishers = {pod: harness.publisher(pod) for pod in pods}
    keys = capture_keys(base_capture)

    def run(pod: str) -> None:
        pub = publishers[pod]
        for first in range(0, 25, 5):
            parent = None if first == 0 else base_capture["block_hashes"][first - 1]
            pub.send([stored(base_capture, first=first, last=first + 5, parent=parent)])

    threads = [threading.Thread(target=run, args=(pod,)) for pod in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pod in pods:
        harness.sync(pod, timeout=20)

    holders = harness.index.lookup(model=MODEL, keys=keys)
    assert len(holders) == 25
    assert all(set(h) == set(pods) for h in holders)
    assert sum(b.total for b in harness.index.pod_blocks(model=MODEL)) == 25 * 100


def test_a_disabled_pod_is_ignored(harness, base_capture):
    from dataclasses import replace

    pub = harness.publisher("pod-a")
    harness.config = replace(harness.config, disabled_pods=frozenset({"pod-a"}))
    pub.send([stored(base_capture)])
    harness.sync("pod-a")

    assert held_blocks(harness, capture_keys(base_capture), "pod-a") == 0
    assert harness.stream("pod-a").ignored_batches == 1


def _fields(event: BlockStored) -> dict:
    return {name: getattr(event, name) for name in event.__slots__}


def test_a_flood_of_malformed_messages_is_logged_a_line_per_reason_not_a_line_each(harness, caplog):
    pub = harness.publisher("pod-a")
    topic, seq, _ = encode_message("pod-a", MODEL, 99, b"")
    with caplog.at_level(logging.WARNING, logger="ingest.pool"):
        for _ in range(300):
            pub.send_frames([topic, seq, b"\xc1garbage"])
        pub.next_seq = 100
        pub.send([])
        harness.sync("pod-a")
    assert harness.stream("pod-a").decode_errors["msgpack"] == 300  # every one counted
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) <= 1  # at most one line per reason per 10 s


def test_the_rate_limited_log_says_how_many_it_left_out(caplog):
    limited = RateLimitedLog(logging.getLogger("tests.ratelimit"), interval=0.05)
    with caplog.at_level(logging.WARNING, logger="tests.ratelimit"):
        logged = [limited.warning("msgpack", "bad payload %d", i) for i in range(100)]
        assert limited.warning("topic", "bad topic")  # another reason has its own budget
        time.sleep(0.06)
        assert limited.warning("msgpack", "bad payload again")
    assert logged.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "bad payload 0",
        "bad topic",
        "bad payload again (and 99 more msgpack in the last 0.05s, not logged)",
    ]


def test_a_pod_sends_for_a_few_models_and_ranks_at_most(harness, base_capture):
    """What ingest keeps of a pod is per model and per data-parallel rank, so a pod that names a
    new one in every message would grow it without end: past ``MAX_MODELS_PER_POD`` models and
    ``MAX_RANKS_PER_POD`` ranks its messages are counted and skipped."""
    first = harness.publisher("pod-a", model="model-0")
    others = [
        Publisher(harness.context, harness.endpoint, pod="pod-a", model=f"model-{m}")
        for m in range(1, MAX_MODELS_PER_POD + 1)
    ]
    harness.publishers += others

    def refused() -> bool:
        for other in others:  # until their subscriptions are through
            other.send([])
        time.sleep(0.01)
        return harness.stats.unattributed_errors["too_many_models"] > 0

    wait_until(refused, what="too_many_models")
    assert {s.model for s in harness.stats.streams() if s.pod == "pod-a"} <= {
        f"model-{m}" for m in range(MAX_MODELS_PER_POD)
    }
    for rank in range(1, MAX_RANKS_PER_POD + 1):
        first.send([stored(base_capture, last=1)], rank=rank)
    wait_until(lambda: harness.stream("pod-a").decode_errors["too_many_ranks"] == 1, what="too_many_ranks")
    harness.pipeline.pool.join_idle(5)
    assert {s.rank for s in harness.stats.streams() if s.pod == "pod-a"} == set(range(MAX_RANKS_PER_POD))
