"""Per-block extra keys, lookahead hashing and the default seed (``kvindex.keys``), as vLLM 0.33
sends and hashes them: a request keyed with its LoRA name, cache salt, multimodal features and
lookahead gets the keys ingest computes from the events of its blocks.

Spec: /work/shared/specs/vllm-kv-events.md section 5; vLLM 0.33 ``v1/core/kv_cache_utils.py``
(``generate_block_hash_extra_keys``, ``_gen_mm_extra_hash_keys``, ``to_event_extra_keys``,
``get_request_block_hasher``, ``resolve_none_hash_seed``).
"""

from __future__ import annotations

import hashlib

import cbor2
import msgpack
import pytest

from kvindex.keys import (
    DEFAULT_SEED,
    ChainMemo,
    MultimodalFeature,
    block_chain,
    block_digest,
    block_extra_keys,
    block_keys,
    key_of,
    keyed_extra,
    root_digest,
)
from registry.config import ServiceConfig
from tests.ingest.captures import VLLM_033_SEED, vllm_033_messages

TOKENS = list(range(1000, 1100))


def reference_keys(tokens, *, seed, block_size, extras) -> list[int]:
    """The chain written the obvious way: cbor2 encodes ``[parent, tokens, extra]`` per block."""
    parent, keys = root_digest(seed), []
    for i, extra in enumerate(extras):
        block = list(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps([parent, block, extra], canonical=True)).digest()
        keys.append(key_of(parent))
    return keys


def captured_stores() -> list[dict]:
    """Every BlockStored of the vLLM 0.33 capture, as the engine's maps."""
    out = []
    for message in vllm_033_messages():
        _, events, _ = msgpack.unpackb(message.frames[2], raw=False)
        out += [e for e in events if e["type"] == "BlockStored"]
    return out


# --- the default seed ----------------------------------------------------------------------------


def test_the_default_seed_is_vllms_seed_without_pythonhashseed():
    assert DEFAULT_SEED == "vllm-none-hash"
    assert root_digest(DEFAULT_SEED) == hashlib.sha256(cbor2.dumps("vllm-none-hash")).digest()
    assert block_keys(list(range(16)), seed=DEFAULT_SEED) == [2233398808101521225]


def test_the_service_config_defaults_to_it():
    assert ServiceConfig().seed == DEFAULT_SEED


# --- extra keys per block, as the events send them -----------------------------------------------


def test_no_extras_is_none_for_every_block():
    assert block_extra_keys(3) == [None, None, None]


def test_the_lora_name_is_in_every_block():
    assert block_extra_keys(3, lora_name="Alice") == [("Alice",)] * 3


def test_the_cache_salt_is_in_block_0_only_after_the_lora_name():
    assert block_extra_keys(3, cache_salt="tenant-42") == [("tenant-42",), None, None]
    assert block_extra_keys(2, lora_name="Alice", cache_salt="s") == [("Alice", "s"), ("Alice",)]
    assert block_extra_keys(0, cache_salt="s") == []
    assert block_extra_keys(2, cache_salt="") == [None, None]  # vLLM ignores an empty salt


def test_a_media_input_is_keyed_in_every_block_it_overlaps_with_its_offset_from_the_block_start():
    image = MultimodalFeature("img-1", offset=5, length=30)  # positions 5..34
    assert block_extra_keys(4, block_size=16, mm_features=[image]) == [
        (("img-1", 5),),
        (("img-1", -11),),
        (("img-1", -27),),
        None,
    ]


def test_lora_then_media_then_salt():
    image = MultimodalFeature("img-1", offset=0, length=4)
    assert block_extra_keys(2, block_size=4, lora_name="A", cache_salt="s", mm_features=[image]) == [
        ("A", ("img-1", 0), "s"),
        ("A",),
    ]


def test_several_media_in_one_block_follow_their_order_whatever_order_they_are_given_in():
    a, b = MultimodalFeature("a", offset=2, length=3), MultimodalFeature("b", offset=6, length=12)
    assert block_extra_keys(2, block_size=8, mm_features=[b, a]) == [(("a", 2), ("b", 6)), (("b", -2),)]


def test_a_block_between_media_has_none():
    a, b = MultimodalFeature("a", offset=0, length=4), MultimodalFeature("b", offset=12, length=4)
    assert block_extra_keys(4, block_size=4, mm_features=[a, b]) == [(("a", 0),), None, None, (("b", 0),)]


def test_with_lookahead_a_block_also_sees_media_starting_in_its_lookahead_tokens():
    image = MultimodalFeature("img", offset=16, length=4)
    assert block_extra_keys(2, block_size=16, mm_features=[image]) == [None, (("img", 0),)]
    assert block_extra_keys(2, block_size=16, mm_features=[image], lookahead_tokens=1) == [
        (("img", 16),),
        (("img", 0),),
    ]


@pytest.mark.parametrize(
    "fields",
    [("", 0, 1), ("img", -1, 1), ("img", 0, 0), (b"img", 0, 1), ("img", 1.0, 1)],
    ids=["empty-id", "negative-offset", "empty", "bytes-id", "float-offset"],
)
def test_a_malformed_media_input_is_refused(fields):
    with pytest.raises(ValueError, match="multimodal"):
        MultimodalFeature(*fields)


# --- keys of a request equal the keys of its blocks' events --------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"lora_name": "Alice"},
        {"cache_salt": "tenant-42"},
        {"lora_name": "Alice", "cache_salt": "tenant-42"},
        {"mm_features": [MultimodalFeature("img", 20, 40)]},
        {"mm_features": [MultimodalFeature("img", 20, 40)], "cache_salt": "s", "lora_name": "L"},
    ],
    ids=["plain", "lora", "salt", "lora-salt", "image", "all"],
)
def test_block_keys_hash_each_blocks_extras_as_sent(options):
    extras = block_extra_keys(6, block_size=16, **options)
    wire = [None if e is None else [list(k) if isinstance(k, tuple) else k for k in e] for e in extras]
    expected = reference_keys(TOKENS, seed="42", block_size=16, extras=wire)
    assert block_keys(TOKENS, seed="42", block_size=16, **options) == expected
    assert block_keys(TOKENS, seed="42", block_size=16, memo=ChainMemo(), **options) == expected


def test_the_salt_and_the_image_change_only_the_keys_from_their_block_on():
    plain = block_keys(TOKENS, seed="42")
    imaged = block_keys(TOKENS, seed="42", mm_features=[MultimodalFeature("img", 40, 8)])
    assert imaged[:2] == plain[:2] and not set(imaged[2:]) & set(plain)
    assert not set(block_keys(TOKENS, seed="42", cache_salt="s")) & set(plain)


def test_a_salt_needs_a_chain_from_the_root():
    with pytest.raises(ValueError, match="cache_salt"):
        block_keys(TOKENS, seed="42", parent=root_digest("42"), cache_salt="s")


def test_the_captured_salted_store_is_keyed_as_a_salted_request():
    """vLLM 0.33 sent ``extra_keys=[["tenant-42"], None, None, None]``: the request keyed with that
    salt gets the keys of those blocks, and neither equals the engine hashes (tagged salt)."""
    event = next(e for e in captured_stores() if e["extra_keys"][0] == ["tenant-42"])
    extras = [None if e is None else tuple(e) for e in event["extra_keys"]]
    from_event = [
        key_of(d)
        for d in block_chain(event["token_ids"], block_size=16, parent=root_digest("42"), extras=extras)
    ]
    assert block_keys(event["token_ids"], seed=VLLM_033_SEED, cache_salt="tenant-42") == from_event
    assert not set(from_event) & set(event["block_hashes"])
    tagged = hashlib.sha256(
        cbor2.dumps(
            [root_digest("42"), event["token_ids"][:16], [["cache_salt", "tenant-42"]]], canonical=True
        )
    ).digest()
    assert key_of(tagged) == event["block_hashes"][0]  # why: vLLM 0.33 hashes the salt tagged


def test_the_captured_plain_stores_are_the_engines_own_hashes():
    plain = [e for e in captured_stores() if not any(e["extra_keys"])]
    assert len(plain) == 4
    for event in plain:
        assert block_keys(event["token_ids"], seed=VLLM_033_SEED) == event["block_hashes"]


def test_the_captured_lora_store_is_keyed_by_the_bare_name_not_the_engines_tagged_hash():
    event = next(e for e in captured_stores() if e["lora_name"] == "Alice")
    assert event["extra_keys"] == [["Alice"]] * 4
    keys = block_keys(event["token_ids"], seed=VLLM_033_SEED, lora_name="Alice")
    assert keys == reference_keys(event["token_ids"], seed="42", block_size=16, extras=[["Alice"]] * 4)
    assert not set(keys) & set(event["block_hashes"])


# --- lookahead hashing ---------------------------------------------------------------------------


def test_with_lookahead_each_block_is_keyed_with_the_tokens_after_it():
    """vLLM hashes ``(parent, block tokens, (E, *next L tokens))``; ``E`` is None without extras,
    so such keys equal a plain ``sha256_cbor`` engine's hashes."""
    keys = block_keys(TOKENS[:50], seed="42", block_size=16, lookahead_tokens=2)
    extras = [[None, *TOKENS[(i + 1) * 16 : (i + 1) * 16 + 2]] for i in range(3)]
    assert keys == reference_keys(TOKENS, seed="42", block_size=16, extras=extras)


def test_with_lookahead_a_block_is_keyed_only_once_its_lookahead_tokens_exist():
    assert len(block_keys(TOKENS[:48], seed="42", block_size=16, lookahead_tokens=1)) == 2
    assert len(block_keys(TOKENS[:49], seed="42", block_size=16, lookahead_tokens=1)) == 3


def test_with_lookahead_a_different_next_token_is_a_different_block():
    a = block_keys(TOKENS[:33], seed="42", block_size=16, lookahead_tokens=1)
    b = block_keys([*TOKENS[:32], 7], seed="42", block_size=16, lookahead_tokens=1)
    assert a[0] == b[0] and a[1] != b[1]


def test_with_lookahead_the_extras_go_first():
    keys = block_keys(TOKENS[:17], seed="42", block_size=16, lora_name="A", lookahead_tokens=1)
    assert keys == reference_keys(TOKENS, seed="42", block_size=16, extras=[[["A"], TOKENS[16]]])


def test_keyed_extra_is_the_extras_alone_without_lookahead():
    assert keyed_extra(("A",)) == ("A",)
    assert keyed_extra(None) is None
    assert keyed_extra(None, (5, 6)) == (None, 5, 6)
    assert keyed_extra(("A",), [5]) == (("A",), 5)


# --- block_chain: the one chain both sides key with ----------------------------------------------


def test_block_chain_is_block_digest_block_after_block():
    extras = [("s",), None, None, ("A", ("img", 0)), ("A", ("img", -16)), (None, 1, 2)]
    parent, expected = root_digest("42"), []
    for i, extra in enumerate(extras):
        parent = block_digest(parent, TOKENS[i * 16 : (i + 1) * 16], extra)
        expected.append(parent)
    assert block_chain(TOKENS, block_size=16, parent=root_digest("42"), extras=extras) == expected
    memo = ChainMemo()
    for _ in range(2):
        assert (
            block_chain(TOKENS, block_size=16, parent=root_digest("42"), extras=extras, memo=memo) == expected
        )


def test_block_chain_keeps_apart_extras_that_are_equal_but_encode_differently():
    extras = [(1,), (True,)]  # 1 == True, but CBOR encodes them differently
    got = block_chain(TOKENS, block_size=16, parent=root_digest("42"), extras=extras)
    assert got[1] == block_digest(got[0], TOKENS[16:32], (True,))


def test_block_chain_needs_the_tokens_of_every_block():
    with pytest.raises(ValueError, match="tokens"):
        block_chain(TOKENS[:20], block_size=16, parent=root_digest("42"), extras=[None, None])
