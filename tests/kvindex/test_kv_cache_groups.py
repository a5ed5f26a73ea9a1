"""A hybrid model's KV-cache groups (kvindex/kv_cache_groups.py): the hit rule of vLLM's hybrid
coordinator, the index identity of a group, and the registry's description of the groups.
(``make conformance`` checks the same rule against vLLM's own ``KVCacheManager``.)"""

from __future__ import annotations

import random

import pytest
from django.core.exceptions import ValidationError

from kvindex.keys import key_of
from kvindex.kv_cache_groups import (
    KVCacheGroup,
    group_digest,
    group_hit,
    group_holder,
    group_key,
    group_keys,
    groups_from_json,
    groups_to_json,
    hybrid_hit,
    hybrid_run,
    other_groups,
    split_group,
)
from registry.config import owner_pod
from registry.models import validate_kv_cache_groups

GPU = frozenset({"gpu"})


def held(pattern: str) -> list[bool]:
    """``"xx.x"`` -> blocks 0, 1 and 3 held."""
    return [c == "x" for c in pattern]


@pytest.mark.parametrize(
    ("group", "needed"),
    [
        (KVCacheGroup("full_attention"), None),
        (KVCacheGroup("mla_attention"), None),
        (KVCacheGroup("sliding_window", 32), 2),  # cdiv(31, 16)
        (KVCacheGroup("sliding_window", 33), 2),
        (KVCacheGroup("sliding_window", 34), 3),
        (KVCacheGroup("sliding_window", 4096), 256),
        (KVCacheGroup("sliding_window_mla", 1), 0),
        (KVCacheGroup("mamba"), 1),
        (KVCacheGroup("a_future_kind"), None),
    ],
)
def test_the_blocks_a_group_needs_at_the_end_of_a_hit(group: KVCacheGroup, needed: int | None) -> None:
    assert group.needed_blocks(16) == needed


def test_a_window_hit_ends_at_the_last_run_of_needed_blocks_before_the_limit() -> None:
    # vLLM's own example: [NULL, NULL, 8, 3, NULL, 9] -> [NULL, NULL, 8, 3] with 2 blocks needed.
    assert group_hit(held("..xx.x"), 6, 2) == 4
    assert group_hit(held("..xx.x"), 3, 2) == 0  # the run 2-3 ends past the limit
    assert group_hit(held("xxxxxx"), 5, 2) == 5
    assert group_hit(held("x....."), 6, 2) == 1  # no run of 2: the leading run, shorter
    assert group_hit(held("......"), 6, 2) == 0
    assert group_hit(held("..x..x"), 6, 1) == 6  # Mamba: the last block held
    assert group_hit(held("..x..."), 6, 0) == 3  # a 1-token window still needs a block


def test_a_full_attention_group_cuts_a_hit_to_its_leading_run() -> None:
    assert group_hit(held("xxx.xx"), 6, None) == 3
    assert group_hit(held("xxxxxx"), 4, None) == 4


def test_the_hit_is_the_longest_prefix_whose_window_every_group_holds() -> None:
    """Against the rule written the slow way: the longest l <= the full-attention run such that
    every group holds its needed blocks before l (all of [0, l) when l is shorter)."""
    rng = random.Random(11)
    for _ in range(2000):
        n = rng.randrange(0, 12)
        full_run = rng.randrange(0, n + 1)
        groups = [
            ([rng.random() < 0.6 for _ in range(n)], rng.choice([None, 0, 1, 2, 3]))
            for _ in range(rng.randrange(1, 3))
        ]

        def allowed(length: int, groups=groups) -> bool:
            for blocks, needed in groups:
                start = 0 if needed is None else max(0, length - max(needed, 1))
                if not all(blocks[start:length]):
                    return False
            return True

        assert hybrid_hit(full_run, groups) == max(x for x in range(full_run + 1) if allowed(x))


def test_each_pod_s_run_is_cut_to_its_own_hit() -> None:
    run = [{"a": GPU, "b": GPU}] * 6
    window = [
        {"b#g1": GPU},
        {"b#g1": GPU},
        {"b#g1": GPU},
        {},
        {"a#g1": GPU},
        {"a#g1": GPU},
    ]
    assert (
        hybrid_run(run, every_holder(run, [(1, 2)]), {1: window})
        == [{"a": GPU, "b": GPU}] * 3 + [{"a": GPU}] * 3
    )


def every_holder(run, groups):
    """Every holder of ``run`` with the same other groups (a model config's)."""
    return {holder: groups for block in run for holder in block}


def test_only_a_holder_with_groups_of_its_own_is_cut_on_them() -> None:
    """Each pod is scored over its own groups: what one pod's events say of its groups cuts its
    own hit, never another pod's."""
    run = [{"a": GPU, "b": GPU}] * 3
    assert hybrid_run(run, {"a": [(1, 2)]}, {1: [{}] * 3}) == [{"b": GPU}] * 3
    assert hybrid_run(run, {}, {}) == run


def test_a_pod_whose_window_holds_nothing_leaves_the_run() -> None:
    run = [{"a": GPU, "b": GPU}] * 3
    assert hybrid_run(run, every_holder(run, [(1, 2)]), {1: [{"a#g1": GPU}] * 3}) == [{"a": GPU}] * 3
    assert hybrid_run(run, every_holder(run, [(1, 2)]), {1: [{}] * 3}) == []


def test_a_run_is_cut_where_the_pod_s_own_prefix_ends() -> None:
    run = [{"a": GPU, "b": GPU}, {"a": GPU, "b": GPU}, {"a": GPU}]  # b holds 2, a holds 3
    window = [{"a#g1": GPU, "b#g1": GPU}] * 3
    assert hybrid_run(run, every_holder(run, [(1, 2)]), {1: window}) == run


def test_data_parallel_ranks_are_cut_on_their_own_groups() -> None:
    run = [{"p": GPU, "p#dp1": GPU}] * 4
    window = [{"p#g1": GPU, "p#dp1#g1": GPU}] * 2 + [{"p#g1": GPU}] * 2
    assert (
        hybrid_run(run, every_holder(run, [(1, 2)]), {1: window})
        == [{"p": GPU, "p#dp1": GPU}] * 2 + [{"p": GPU}] * 2
    )


def test_a_group_is_indexed_under_its_own_holder_and_masked_keys() -> None:
    assert group_holder("pod", 0) == "pod"
    assert group_holder("pod#dp1", 2) == "pod#dp1#g2"
    assert split_group("pod#dp1#g2") == ("pod#dp1", 2)
    assert split_group("pod#dp1") == ("pod#dp1", 0)
    assert owner_pod("pod#dp1#g2") == owner_pod("pod#g1") == "pod"
    digest = bytes(range(32))
    for group in (1, 2, 7):
        masked = group_digest(digest, group)
        assert masked != digest and group_digest(masked, group) == digest
        assert key_of(masked) == group_key(key_of(digest), group)
        short = digest[-8:]  # an adopted block's digest is its key's 8 bytes
        assert key_of(group_digest(short, group)) == group_key(key_of(short), group)
    assert group_digest(digest, 0) == digest and group_key(5, 0) == 5
    assert len({group_key(5, g) for g in range(5)}) == 5
    assert group_keys([1, 2], 3) == [group_key(1, 3), group_key(2, 3)]


def test_the_registry_describes_groups_in_vllm_s_order() -> None:
    groups = [
        {"kind": "full_attention"},
        {"kind": "sliding_window", "sliding_window": 4096},
        {"kind": "mamba"},
    ]
    validate_kv_cache_groups(groups)
    validate_kv_cache_groups([])
    parsed = groups_from_json(groups)
    assert parsed == (
        KVCacheGroup("full_attention"),
        KVCacheGroup("sliding_window", 4096),
        KVCacheGroup("mamba"),
    )
    assert groups_to_json(parsed) == groups
    assert other_groups(parsed, 16) == [(1, 256), (2, 1)]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"kind": "full_attention"}, "must be a list"),
        ([{"kind": "mamba"}], "group 0 must be full attention"),
        ([{"kind": "full_attention"}, {"kind": "sliding_window"}], "needs its sliding_window"),
        ([{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 0}], "needs its"),
        ([{"kind": "full_attention"}, {"kind": "rope"}], "kind must be one of"),
        ([{"kind": "full_attention", "sliding_window": 8}], "only kind"),
        ([{"kind": "full_attention", "block_size": 8}], "only kind"),
    ],
)
def test_the_registry_refuses_groups_it_cannot_score_saying_why(value: object, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        validate_kv_cache_groups(value)
