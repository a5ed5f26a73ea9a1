"""The chain memo (``kvindex.keys.ChainMemo``): the same digests as the plain chain, whatever it
has seen before, how full it is and how many threads share it; bounded, least recently used out
first, a chain's start last."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvindex.keys
from kvindex.keys import ChainMemo, block_keys, chain_digests, extra_keys, root_digest

ROOT = root_digest("42")
VOCAB = 151_936  # Qwen3's


def tokens(n: int, *, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def plain_keys(ids: list[int], **options) -> list[int]:
    return block_keys(ids, seed="42", **options)


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Blocks hashed by each call of the plain chain: the memo's misses, and the plain references.
    With the pure-Python chain, the one a memo is used with (``kvindex.keys.memo_pays``): the
    compiled one keys a plain reference without a call to count."""
    monkeypatch.setattr(kvindex.keys, "_native", None)
    counts: list[int] = []
    plain = kvindex.keys.chain_digests

    def counting(ids, *, block_size, parent, extra=None):
        counts.append(len(ids) // block_size)
        return plain(ids, block_size=block_size, parent=parent, extra=extra)

    monkeypatch.setattr(kvindex.keys, "chain_digests", counting)
    return counts


def test_a_repeated_prompt_is_looked_up_not_hashed(computed: list[int]) -> None:
    memo, ids = ChainMemo(), tokens(400, seed=1)

    first = block_keys(ids, seed="42", memo=memo)
    again = block_keys(ids, seed="42", memo=memo)

    assert first == again == plain_keys(ids)
    assert computed == [25, 25]  # the memo's first call and the plain reference; none for the repeat
    assert len(memo) == 25


@pytest.mark.parametrize("diverge_at", [0, 1, 15, 16, 17, 100, 255, 256, 399])
def test_prompts_sharing_a_prefix_then_diverging_anywhere_in_a_block(
    computed: list[int], diverge_at: int
) -> None:
    memo, ids = ChainMemo(), tokens(400, seed=2)
    other = ids[:diverge_at] + [(t + 1) % VOCAB for t in ids[diverge_at:]]
    block_keys(ids, seed="42", memo=memo)
    computed.clear()

    keys = block_keys(other, seed="42", memo=memo)

    assert keys == plain_keys(other)
    shared_blocks = diverge_at // 16
    assert keys[:shared_blocks] == plain_keys(ids)[:shared_blocks]
    assert computed[0] == 25 - shared_blocks  # only the blocks after the shared ones were hashed


def test_a_growing_conversation_hashes_only_its_new_blocks(computed: list[int]) -> None:
    memo, ids = ChainMemo(), tokens(1000, seed=3)
    previous = 0
    for end in (100, 250, 251, 600, 1000):
        computed.clear()
        keys = block_keys(ids[:end], seed="42", memo=memo)
        new_blocks = end // 16 - previous // 16
        assert computed == ([new_blocks] if new_blocks else [])
        assert keys == plain_keys(ids[:end])
        previous = end


@pytest.mark.parametrize("block_size", [1, 16, 17, 64, 256])
def test_block_sizes_seeds_and_lora_names_never_share_steps(block_size: int) -> None:
    memo, ids = ChainMemo(), tokens(1024, seed=4)
    variants = [
        {"seed": "42"},
        {"seed": ""},
        {"seed": "42", "lora_name": "Alice"},
        {"seed": "42", "lora_name": "Bob"},
    ]
    for _ in range(2):  # the second round reads every variant from the memo
        for variant in variants:
            for size in (block_size, block_size * 2):
                assert block_keys(ids, block_size=size, memo=memo, **variant) == block_keys(
                    ids, block_size=size, **variant
                )


def test_a_chain_continued_from_a_given_parent_equals_the_plain_one() -> None:
    memo, ids = ChainMemo(), tokens(320, seed=5)
    head = chain_digests(ids[:160], parent=ROOT)
    for _ in range(2):
        assert memo.chain_digests(ids[160:], parent=head[-1]) == chain_digests(ids[160:], parent=head[-1])
    short_parent = head[-1][-8:]  # an adopted block's 8-byte digest: not memoized, still right
    assert memo.chain_digests(ids, parent=short_parent) == chain_digests(ids, parent=short_parent)


def test_token_ids_of_any_uint64_and_the_same_errors_as_the_plain_chain() -> None:
    memo = ChainMemo()
    big = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**18, 2**32 - 1, 2**32, 2**64 - 1] * 4
    for _ in range(2):
        assert block_keys(big, seed="42", memo=memo) == plain_keys(big)
    for bad in ([-1] + [0] * 15, [2**64] + [0] * 15):
        with pytest.raises(ValueError, match="unsigned 64-bit") as plain_error:
            plain_keys(bad)
        with pytest.raises(ValueError) as memo_error:
            block_keys(bad, seed="42", memo=memo)
        assert str(memo_error.value) == str(plain_error.value)
    with pytest.raises(ValueError, match="block_size"):
        block_keys(big, seed="42", block_size=0, memo=memo)


def test_fewer_tokens_than_a_block_have_no_keys() -> None:
    memo = ChainMemo()
    assert block_keys(tokens(15, seed=6), seed="42", memo=memo) == []
    assert block_keys([], seed="42", memo=memo) == []
    assert len(memo) == 0


def test_the_memo_is_bounded_and_stays_exact_while_it_evicts() -> None:
    memo = ChainMemo(capacity=50)
    prompts = [tokens(16 * 30, seed=seed) for seed in range(10)]
    for ids in prompts * 3:
        assert block_keys(ids, seed="42", memo=memo) == plain_keys(ids)
        assert len(memo) <= 50


def test_least_recently_used_steps_go_first_and_a_chains_start_last(computed: list[int]) -> None:
    memo = ChainMemo(capacity=6)
    old, new = tokens(16 * 4, seed=7), tokens(16 * 4, seed=8)
    block_keys(old, seed="42", memo=memo)
    block_keys(new, seed="42", memo=memo)  # 8 steps for 6 places: old's last two blocks go
    computed.clear()

    assert block_keys(old, seed="42", memo=memo) == plain_keys(old)

    assert computed == [2, 4]  # old's first two blocks were still there
    assert len(memo) == 6


def test_capacity_zero_disables_the_memo() -> None:
    memo, ids = ChainMemo(capacity=0), tokens(64, seed=9)
    assert block_keys(ids, seed="42", memo=memo) == plain_keys(ids)
    assert len(memo) == 0
    with pytest.raises(ValueError):
        ChainMemo(capacity=-1)


def test_threads_sharing_one_memo_all_get_exact_keys() -> None:
    memo = ChainMemo(capacity=400)  # small enough to evict while the threads run
    system = tokens(16 * 40 + 7, seed=10)
    prompts = [system + tokens(random.Random(i).randrange(1, 200), seed=100 + i) for i in range(24)]
    expected = {i: plain_keys(ids, lora_name=("A" if i % 3 == 0 else None)) for i, ids in enumerate(prompts)}
    failures: list[int] = []

    def work(offset: int) -> None:
        for j in range(60):
            i = (offset + j) % len(prompts)
            lora = "A" if i % 3 == 0 else None
            if block_keys(prompts[i], seed="42", lora_name=lora, memo=memo) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(offset,)) for offset in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    assert len(memo) <= 400


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(range(4)),  # which shared prefix
            st.integers(min_value=0, max_value=80),  # how much of it
            st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=40),  # the tail
            st.sampled_from([None, "Alice"]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([1, 4, 16]),
    st.integers(min_value=0, max_value=30),
)
def test_any_sequence_of_requests_gets_the_plain_chains_keys(requests, block_size, capacity) -> None:
    memo = ChainMemo(capacity=capacity)
    prefixes = [tokens(80, seed=seed) for seed in range(4)]
    for which, length, tail, lora in requests:
        ids = prefixes[which][:length] + tail
        assert block_keys(ids, seed="42", block_size=block_size, lora_name=lora, memo=memo) == block_keys(
            ids, seed="42", block_size=block_size, lora_name=lora
        )
        assert len(memo) <= capacity


def test_extra_keys_of_any_kind_are_exact() -> None:
    memo, ids = ChainMemo(), tokens(64, seed=11)
    for extra in (None, ("Alice",), ("Alice", "mm-hash"), (1,), (True,), (1.0,), extra_keys(lora_name="x")):
        for _ in range(2):
            assert memo.chain_digests(ids, parent=ROOT, extra=extra) == chain_digests(
                ids, parent=ROOT, extra=extra
            )
