"""Block keys (``kvindex.keys``): vLLM's ``sha256_cbor`` chain, as the spec and real engines define it.

Spec: /work/shared/specs/vllm-kv-events.md section 3. The captures are real vLLM BlockStored
events (Qwen/Qwen3-0.6B, seed "42", block size 16), loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

import hashlib

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.keys import (
    block_digest,
    block_keys,
    chain_digests,
    encode_block,
    extra_keys,
    key_of,
    normalize_hash,
    root_digest,
)

U64_MAX = 2**64 - 1
ROOT_42 = "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780"
ROOT_EMPTY = "8d33f520a3c4cef80d2453aef81b612bfe1cb44c8b2025630ad38662763f13d3"


def reference_chain(tokens, *, block_size, parent, extra=None) -> list[bytes]:
    """The spec's chain written the obvious way, with cbor2 doing all the encoding."""
    extra_obj = list(extra) if extra is not None else None
    digests, prev = [], parent
    for i in range(len(tokens) // block_size):
        block = list(tokens[i * block_size : (i + 1) * block_size])
        prev = hashlib.sha256(cbor2.dumps([prev, block, extra_obj], canonical=True)).digest()
        digests.append(prev)
    return digests


# --- spec vectors -------------------------------------------------------------------------------


def test_root_digest_is_sha256_of_the_cbor_seed_string():
    assert root_digest("42").hex() == ROOT_42
    assert root_digest("").hex() == ROOT_EMPTY
    assert root_digest("42") == hashlib.sha256(cbor2.dumps("42")).digest()


def test_first_block_of_seed_42():
    assert block_keys(list(range(16)), seed="42") == [2863503375995570957]


def test_second_block_chains_from_the_first():
    assert block_keys(list(range(32)), seed="42") == [2863503375995570957, 13957787785847563040]


def test_lora_name_is_the_blocks_extra_key():
    assert block_keys(list(range(16)), seed="42", lora_name="Alice") == [4083386922566575403]
    digest = block_digest(root_digest("42"), range(16), ("Alice",))
    assert key_of(digest) == 4083386922566575403


def test_empty_seed_is_a_different_root():
    assert block_keys(list(range(16)), seed="") == [14620552727165982086]


def test_block_key_is_the_last_8_bytes_big_endian():
    digest = bytes(range(32))
    assert key_of(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert key_of(root_digest("42")) == int(ROOT_42[-16:], 16)


# --- real vLLM captures -------------------------------------------------------------------------


def test_base_capture_all_25_hashes(base_capture):
    assert base_capture["lora_name"] is None
    keys = block_keys(base_capture["token_ids"], seed=base_capture["hash_seed"], block_size=16)
    assert len(keys) == 25
    assert keys == base_capture["block_hashes"]


def test_lora_capture_all_25_hashes(lora_capture):
    keys = block_keys(
        lora_capture["token_ids"],
        seed=lora_capture["hash_seed"],
        block_size=lora_capture["block_size"],
        lora_name=lora_capture["lora_name"],
    )
    assert lora_capture["lora_name"] == "Alice"
    assert keys == lora_capture["block_hashes"]


def test_lora_changes_every_block_key(base_capture, lora_capture):
    assert base_capture["token_ids"] == lora_capture["token_ids"]
    assert not set(base_capture["block_hashes"]) & set(lora_capture["block_hashes"])


@pytest.mark.parametrize("capture_name", ["base_capture", "lora_capture"])
def test_block_by_block_equals_the_whole_chain(capture_name, request):
    capture = request.getfixturevalue(capture_name)
    tokens, extra = capture["token_ids"], extra_keys(lora_name=capture["lora_name"])
    parent, keys = root_digest(capture["hash_seed"]), []
    for i in range(25):
        parent = block_digest(parent, tokens[i * 16 : (i + 1) * 16], extra)
        keys.append(key_of(parent))
    assert keys == capture["block_hashes"]


# --- chaining, partial blocks, block sizes ------------------------------------------------------


@pytest.mark.parametrize("split_block", [1, 10, 24])
def test_continuing_a_chain_from_parent_equals_hashing_at_once(base_capture, split_block):
    tokens, root = base_capture["token_ids"], root_digest("42")
    whole = chain_digests(tokens, parent=root)
    head = chain_digests(tokens[: split_block * 16], parent=root)
    tail = chain_digests(tokens[split_block * 16 :], parent=head[-1])
    assert head + tail == whole

    tail_keys = block_keys(tokens[split_block * 16 :], seed="ignored when parent is given", parent=head[-1])
    assert tail_keys == base_capture["block_hashes"][split_block:]


def test_continuing_a_lora_chain(lora_capture):
    tokens, root = lora_capture["token_ids"], root_digest("42")
    head = chain_digests(tokens[:80], parent=root, extra=("Alice",))
    tail = block_keys(tokens[80:], seed="42", parent=head[-1], lora_name="Alice")
    assert [key_of(d) for d in head] + tail == lora_capture["block_hashes"]


@pytest.mark.parametrize(
    "n_tokens, n_blocks", [(0, 0), (1, 0), (15, 0), (16, 1), (17, 1), (399, 24), (400, 25)]
)
def test_trailing_partial_block_is_dropped(base_capture, n_tokens, n_blocks):
    keys = block_keys(base_capture["token_ids"][:n_tokens], seed="42")
    assert keys == base_capture["block_hashes"][:n_blocks]


@pytest.mark.parametrize("block_size", [1, 7, 32, 64, 256])
def test_other_block_sizes_follow_the_same_scheme(base_capture, block_size):
    tokens, root = base_capture["token_ids"], root_digest("42")
    expected = reference_chain(tokens, block_size=block_size, parent=root)
    assert len(expected) == 400 // block_size
    assert chain_digests(tokens, block_size=block_size, parent=root) == expected
    assert block_keys(tokens, seed="42", block_size=block_size) == [key_of(d) for d in expected]


def test_block_size_32_is_not_two_blocks_of_16(base_capture):
    keys_32 = block_keys(base_capture["token_ids"], seed="42", block_size=32)
    assert not set(keys_32) & set(base_capture["block_hashes"])


@pytest.mark.parametrize("block_size", [0, -16])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ValueError, match="block_size"):
        chain_digests(list(range(32)), block_size=block_size, parent=root_digest("42"))


def test_extra_keys_is_the_lora_name_or_none():
    assert extra_keys() is None
    assert extra_keys(lora_name=None) is None
    assert extra_keys(lora_name="") is None
    assert extra_keys(lora_name="Alice") == ("Alice",)


# --- token ids outside uint64 -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -(2**18), -(2**64), 2**64, 2**70])
def test_token_ids_outside_uint64_are_rejected(bad):
    tokens = [1, 2, bad, 4]
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        encode_block(root_digest("42"), tokens)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        chain_digests(tokens, block_size=4, parent=root_digest("42"))


def test_token_ids_must_be_integers():
    with pytest.raises(TypeError):
        encode_block(root_digest("42"), [1, 2.0, 3])
    with pytest.raises(TypeError):
        chain_digests([1, "2", 3, 4], block_size=2, parent=root_digest("42"))


def test_string_extra_keys_are_not_confused_with_numbers():
    parent = root_digest("42")
    for extra in [("1",), (1,), (True,), (1.0,), (b"1",), ("1",)]:
        assert encode_block(parent, [5], extra) == cbor2.dumps([parent, [5], list(extra)], canonical=True)


# --- normalize_hash -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (12345, 12345),
        (U64_MAX, U64_MAX),
        (-1, U64_MAX),  # old vLLM int64 hashes arrive signed
        (-(2**63), 2**63),
        (-4363240187702324223, 2**64 - 4363240187702324223),
        (2**64, 0),  # wider ints are reduced mod 2**64
        (2**64 + 5, 5),
        (2**100 + 7, 7),
    ],
)
def test_normalize_hash_of_ints_is_mod_2_64(value, expected):
    assert normalize_hash(value) == expected


@pytest.mark.parametrize("size", [8, 16, 32, 64])
def test_normalize_hash_of_bytes_is_the_last_8_bytes_big_endian(size):
    value = bytes(range(100, 100 + size))
    expected = int.from_bytes(value[-8:], "big")
    assert normalize_hash(value) == expected
    assert normalize_hash(bytearray(value)) == expected
    assert normalize_hash(memoryview(value)) == expected


def test_normalize_hash_of_a_digest_is_its_block_key(base_capture):
    digest = chain_digests(base_capture["token_ids"][:16], parent=root_digest("42"))[0]
    assert normalize_hash(digest) == key_of(digest) == base_capture["block_hashes"][0]


def test_normalize_hash_of_short_bytes_is_their_value():
    assert normalize_hash(b"\x01\x02") == 0x0102


@pytest.mark.parametrize(
    "value, error",
    [(b"", ValueError), (True, TypeError), (False, TypeError), ("123", TypeError), (1.0, TypeError)],
)
def test_normalize_hash_rejects(value, error):
    with pytest.raises(error):
        normalize_hash(value)


# --- the hand-written encoder is cbor2, byte for byte -------------------------------------------

# CBOR head-size boundaries, the uint64 edges, and the edge of the encoder's token look-up table.
BOUNDARY_IDS = [
    0,
    1,
    23,
    24,
    255,
    256,
    65535,
    65536,
    2**18 - 1,
    2**18,
    2**32 - 1,
    2**32,
    U64_MAX - 1,
    U64_MAX,
]

token_ids = st.one_of(
    st.sampled_from(BOUNDARY_IDS),
    st.integers(min_value=0, max_value=151_935),  # Qwen-sized vocabulary: the common case
    st.integers(min_value=0, max_value=U64_MAX),
)
parents = st.one_of(st.binary(min_size=32, max_size=32), st.binary(min_size=0, max_size=64))
extras = st.one_of(
    st.none(),
    st.tuples(st.text(max_size=40)),  # a LoRA name
    st.lists(
        st.one_of(
            st.text(max_size=70),
            st.integers(min_value=-(2**70), max_value=2**70),
            st.binary(max_size=40),
        ),
        max_size=4,
    ).map(tuple),
)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 23, 24, 25, 255, 256, 1023, 1024, 1025, 65535, 65536])
def test_every_array_length_has_its_canonical_head(n):
    parent, tokens = root_digest("42"), [7] * n
    expected = cbor2.dumps([parent, tokens, None], canonical=True)
    assert encode_block(parent, tokens) == expected
    if n:
        assert chain_digests(tokens, block_size=n, parent=parent) == [hashlib.sha256(expected).digest()]


@settings(max_examples=600, deadline=None)
@given(parent=parents, tokens=st.lists(token_ids, max_size=64), extra=extras)
def test_encode_block_is_byte_identical_to_cbor2(parent, tokens, extra):
    expected = cbor2.dumps([parent, list(tokens), list(extra) if extra is not None else None], canonical=True)
    assert encode_block(parent, tokens, extra) == expected
    assert encode_block(parent, tuple(tokens), extra) == expected
    assert block_digest(parent, tokens, extra) == hashlib.sha256(expected).digest()


@settings(max_examples=300, deadline=None)
@given(
    parent=parents,
    tokens=st.lists(token_ids, max_size=100),
    block_size=st.integers(min_value=1, max_value=20),
    extra=extras,
)
def test_chain_digests_equals_the_cbor2_reference(parent, tokens, block_size, extra):
    expected = reference_chain(tokens, block_size=block_size, parent=parent, extra=extra)
    assert chain_digests(tokens, block_size=block_size, parent=parent, extra=extra) == expected
