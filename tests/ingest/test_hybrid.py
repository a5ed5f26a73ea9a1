"""Hybrid models through the write path and back out as scores (ingest/applier.py,
kvindex/kv_cache_groups.py): each KV-cache group is indexed on its own, so a sliding window evicting
its early blocks never takes full attention's, and the read path scores vLLM's hybrid hit. Every
test runs on each index backend."""

from __future__ import annotations

import pytest

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvindex import KVIndex
from kvindex.keys import block_keys
from kvindex.kv_cache_groups import KVCacheGroup, group_holder, group_keys
from registry.config import ModelSettings, ServiceConfig
from registry.models import ModelConfig, Pod
from registry.selectors import load_service_config
from scoring.read_path import score_token_ids
from tests.ingest.conftest import MODEL, ingest_housekeeping
from tests.ingest.test_engine_keying import BLOCK, SEED, Engine, store, vllm_hashes

A = tuple(range(1000, 1000 + 10 * BLOCK))  # 10 full blocks
A_KEYS = block_keys(A, seed=SEED)
HASHES = vllm_hashes(A)
GROUPS = (KVCacheGroup("full_attention"), KVCacheGroup("sliding_window", 2 * BLOCK))  # needs 2 blocks
HYBRID = ServiceConfig(
    seed=SEED,
    default_block_size=BLOCK,
    models={MODEL: ModelSettings(name=MODEL, block_size=BLOCK, kv_cache_groups=GROUPS)},
)


def both_groups(tokens, hashes, **fields) -> list[BlockStored]:
    """What vLLM's block pool publishes for a hybrid model: the same blocks once per group."""
    return [store(tokens, hashes, group_idx=g, **fields) for g in (0, 1)]


def served_a(index: KVIndex, *, pod: str = "pod-a", config: ServiceConfig = HYBRID) -> Engine:
    """``pod`` cached A in both groups, then its window freed and evicted blocks 0-7."""
    engine = Engine(index, pod=pod, config=config)
    engine.send(*both_groups(A, HASHES))
    engine.send(BlockRemoved(HASHES[:8], group_idx=1))
    return engine


def score(index: KVIndex, tokens, config: ServiceConfig = HYBRID) -> dict[str, int]:
    result = score_token_ids(index=index, config=config, model=MODEL, token_ids=tokens)
    return {pod: s.matched_blocks for pod, s in result.scores.items()}


def test_a_window_eviction_leaves_full_attention_s_blocks(index):
    served_a(index)

    assert len(index.lookup(model=MODEL, keys=A_KEYS)) == 10
    window = index.holders(model=MODEL, keys=group_keys(A_KEYS, 1))
    assert [bool(m) for m in window] == [False] * 8 + [True] * 2
    assert window[-1] == {group_holder("pod-a", 1): {"gpu"}}


def test_scores_follow_vllm_s_hybrid_hit(index):
    served_a(index)
    tail = (9, 9, 9)

    assert score(index, A) == {"pod-a": 10}  # the window's last 2 blocks are held
    assert score(index, A[: 9 * BLOCK] + tail) == {}  # blocks 7-8: 7 is gone, and no run of 2 before
    assert score(index, A[: 6 * BLOCK] + tail) == {}
    # Without the groups in the config, full attention alone is scored.
    assert score(index, A[: 6 * BLOCK] + tail, ServiceConfig(seed=SEED, default_block_size=BLOCK)) == {
        "pod-a": 6
    }


def test_a_window_stored_again_makes_its_prefixes_hit_again(index):
    engine = served_a(index)
    engine.send(store(A, HASHES[4:6], parent=HASHES[3], first=4, group_idx=1))

    assert score(index, (*A[: 6 * BLOCK], 9)) == {"pod-a": 6}
    assert score(index, (*A[: 8 * BLOCK], 9)) == {"pod-a": 6}  # blocks 6-7 gone: back to 4-5


def test_a_group_s_chain_continues_from_the_index_after_a_restart(index):
    served_a(index)
    later = Engine(index, config=HYBRID)  # remembers nothing: parents come from the index
    more = A + tuple(range(9000, 9000 + 2 * BLOCK))
    hashes = vllm_hashes(more)
    later.send(*both_groups(more, hashes[10:], parent=hashes[9], first=10))

    assert score(index, more) == {"pod-a": 12}
    assert later.stream.orphaned_blocks == 0


def test_removing_from_one_group_leaves_the_other(index):
    engine = served_a(index)
    engine.send(BlockRemoved(HASHES[5:], group_idx=0))

    assert len(index.lookup(model=MODEL, keys=A_KEYS)) == 5
    assert [bool(m) for m in index.holders(model=MODEL, keys=group_keys(A_KEYS, 1))][-2:] == [True, True]


def test_a_clear_clears_every_group(index):
    engine = served_a(index)
    engine.send(AllBlocksCleared())

    assert index.lookup(model=MODEL, keys=A_KEYS) == []
    assert index.holders(model=MODEL, keys=group_keys(A_KEYS, 1)) == [{}] * 10
    assert index.pod_blocks(model=MODEL) == []


def test_only_group_0_is_judged_and_every_group_counts_as_stored(index):
    engine = served_a(index)

    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks) == (10, 0)
    assert (engine.stream.blocks_stored, engine.stream.blocks_removed) == (20, 8)


def test_groups_that_events_describe_are_learned(index):
    engine = Engine(index, config=HYBRID)
    engine.send(
        store(A, HASHES[:2], group_idx=0, kv_cache_spec_kind="full_attention"),
        store(
            A, HASHES[:2], group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32
        ),
    )

    assert engine.stats.learned_groups == {
        ("pod-a", MODEL): {0: ("full_attention", None), 1: ("sliding_window", 32)}
    }
    assert engine.stats.snapshot()["learned_groups"] == [
        ["pod-a", MODEL, {"0": ["full_attention", None], "1": ["sliding_window", 32]}]
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_data_parallel_ranks_keep_their_groups_apart(index, rank):
    engine = Engine(index, config=HYBRID)
    batch_rank = rank or None
    for seq, events in enumerate([both_groups(A, HASHES), [BlockRemoved(HASHES[:8], group_idx=1)]]):
        engine.applier.apply(
            pod="pod-a", model=MODEL, seq=seq, batch=EventBatch(1.0, tuple(events), batch_rank)
        )
    holder = "pod-a#dp1" if rank else "pod-a"

    assert {p.pod for p in index.pod_blocks(model=MODEL)} == {holder, group_holder(holder, 1)}
    assert score(index, A) == {holder: 10}


@pytest.mark.django_db(transaction=True)
def test_housekeeping_writes_the_groups_events_describe_into_the_registry(settings, redis_url):
    """Through a real pipeline: an event that describes its group (``kv_cache_spec_kind``) ends in
    its pod's ``learned_kv_cache_groups``, and that pod's scores follow them while the model's
    config names none; no other pod's do, and no model config is made for them."""
    settings.REDIS_URL = redis_url
    settings.KVCACHE_INDEX_BACKEND = "redis"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    with ingest_housekeeping(redis_url) as (harness, housekeeping):
        pub = harness.publisher("pod-a")
        pub.send(
            [
                store(
                    A,
                    HASHES[:2],
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=64,
                )
            ]
        )
        harness.sync("pod-a")
        harness.publisher("pod-b").send([store(A, HASHES[:2])])
        harness.sync("pod-b")
        housekeeping.run_once()
        housekeeping.run_once()  # unchanged: nothing written again

    described = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 64}]
    assert Pod.objects.get(pod_id="pod-a").learned_kv_cache_groups == described
    assert Pod.objects.get(pod_id="pod-b").learned_kv_cache_groups == []
    assert not ModelConfig.objects.filter(name=MODEL).exists()
    config = load_service_config()
    assert config.model(MODEL).kv_cache_groups == ()
    assert config.kv_cache_groups_of(MODEL, "pod-a#dp1") == (
        KVCacheGroup("full_attention"),
        KVCacheGroup("sliding_window", 64),
    )
    assert config.kv_cache_groups_of(MODEL, "pod-b") == ()
    assert config.kv_cache_group_variants() == {MODEL: 1}
    ModelConfig.objects.create(name=MODEL, kv_cache_groups=[{"kind": "full_attention"}, {"kind": "mamba"}])
    assert load_service_config().kv_cache_groups_of(MODEL, "pod-a")[1] == KVCacheGroup(
        "mamba"
    )  # the config wins
