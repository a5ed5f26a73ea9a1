"""Decoding vLLM KV events (ingest/events.py), as specified in vllm-kv-events.md sections 1-2."""

from __future__ import annotations

import dataclasses
import pickle
import re

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.events import (
    MAX_DATA_PARALLEL_RANKS,
    REASONS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    Message,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    parse_seq,
    parse_topic,
)
from ingest.stats import MAX_VISIBLE_SECONDS, IngestStats
from kvindex.kv_cache_groups import MAX_KV_CACHE_GROUPS, MAX_SLIDING_WINDOW
from tests.ingest.captures import vllm_033_messages

U64 = 2**64 - 1


def spec_bytes(notation: str) -> bytes:
    """The spec's byte notation: hex digits, and "quoted" ASCII for string bodies."""
    out = b""
    for token in re.findall(r'"[^"]*"|[0-9a-f]+', notation):
        out += token[1:-1].encode() if token.startswith('"') else bytes.fromhex(token)
    return out


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def stored(**fields) -> BlockStored:
    defaults = {"block_hashes": (7,), "parent_block_hash": None, "token_ids": (1, 2, 3, 4), "block_size": 4}
    return BlockStored(**{**defaults, **fields})


def array_stored(*fields) -> list:
    """A BlockStored as vLLM <= 0.23 sends it; fields start at block_hashes."""
    return ["BlockStored", *fields]


GOOD_STORED = array_stored([7], None, [1, 2, 3, 4], 4, None, "GPU", None)
CLEARED = ["AllBlocksCleared"]


def only_event(payload: bytes):
    batch = decode_batch(payload)
    assert batch.errors == ()
    assert len(batch.events) == 1
    return batch.events[0]


# --- the spec's exact byte vectors ---------------------------------------------------------------

OLDEST = spec_bytes(
    '92 cb3ff8000000000000 93 96 ab"BlockStored" 91 07 c0 94 01020304 04 c0 '
    '92 ac"BlockRemoved" 91 07 91 b0"AllBlocksCleared"'
)
V0_11 = spec_bytes(
    '93 cb3ff8000000000000 91 97 ab"BlockStored" 91 cf27bd352623590b0d c0 94 01020304 04 c0 a3"GPU" 00'
)
MAP_ERA = spec_bytes(
    '93 cb3ff8000000000000 91 84 a4"type" ac"BlockRemoved" ac"block_hashes" 91 07 a6"medium" a3"GPU" '
    'a9"group_idx" 00 00'
)


def test_oldest_vector_has_a_two_element_batch_and_a_six_element_block_stored():
    assert decode_batch(OLDEST) == EventBatch(
        ts=1.5,
        events=(stored(), BlockRemoved(block_hashes=(7,)), AllBlocksCleared()),
        data_parallel_rank=None,
    )


def test_vllm_0_11_vector_carries_medium_and_the_rank():
    assert decode_batch(V0_11) == EventBatch(
        ts=1.5, events=(stored(block_hashes=(0x27BD352623590B0D,)),), data_parallel_rank=0
    )


def test_map_era_vector_has_map_events_in_an_array_batch():
    assert decode_batch(MAP_ERA) == EventBatch(
        ts=1.5, events=(BlockRemoved(block_hashes=(7,), tier="gpu", group_idx=0),), data_parallel_rank=0
    )


@pytest.mark.parametrize(
    ("vector", "events", "options"),
    [
        (
            OLDEST,
            [stored(), BlockRemoved((7,)), AllBlocksCleared()],
            {"schema": "oldest"},
        ),
        (
            V0_11,
            [stored(block_hashes=(0x27BD352623590B0D,), tier="gpu")],
            {"schema": "0.11", "data_parallel_rank": 0},
        ),
        (
            MAP_ERA,
            [BlockRemoved((7,), tier="gpu", group_idx=0)],
            {"layout": "map", "data_parallel_rank": 0},
        ),
    ],
    ids=["oldest", "0.11", "map-era"],
)
def test_encoder_reproduces_the_spec_vectors_byte_for_byte(vector, events, options):
    assert encode_batch(events, ts=1.5, **options) == vector


def test_array_layout_sends_every_declared_field_including_trailing_nils():
    payload = encode_batch([stored(), BlockRemoved((7,))], ts=1.0)
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.0, None)
    assert events[0] == ["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU", *[None] * 9]
    assert events[1] == ["BlockRemoved", [7], "GPU", None, None, None]


def test_map_layout_omits_only_nil_fields_that_have_a_default():
    payload = encode_batch([stored(), BlockRemoved((7,))], ts=1.0, layout="map", batch_layout="map")
    batch = msgpack.unpackb(payload)
    assert batch == {"ts": 1.0, "events": batch["events"]}
    assert batch["events"][0] == {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert batch["events"][1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}


def test_the_oldest_schema_has_no_rank_to_send():
    with pytest.raises(ValueError, match="data_parallel_rank"):
        encode_batch([], ts=1.0, data_parallel_rank=0, schema="oldest")


# --- the real captures ---------------------------------------------------------------------------


def capture_event(capture: dict) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(capture["block_hashes"]),
        parent_block_hash=capture["parent_block_hash"],
        token_ids=tuple(capture["token_ids"]),
        block_size=capture["block_size"],
        tier=capture["medium"].lower(),
        lora_name=capture["lora_name"],
    )


@pytest.mark.parametrize("name", ["base", "lora"])
@pytest.mark.parametrize("layout", ["array", "map"])
@pytest.mark.parametrize("hash_bytes", [False, True], ids=["int-hashes", "bytes-hashes"])
def test_real_captures_round_trip(request, name, layout, hash_bytes):
    capture = request.getfixturevalue(f"{name}_capture")
    event = capture_event(capture)
    payload = encode_batch(
        [event], ts=1700000000.25, data_parallel_rank=1, layout=layout, hash_bytes=hash_bytes
    )

    batch = decode_batch(payload)

    assert batch == EventBatch(ts=1700000000.25, events=(event,), data_parallel_rank=1)
    assert list(batch.events[0].block_hashes) == capture["block_hashes"]
    assert len(batch.events[0].token_ids) == 25 * 16


# --- vLLM 0.33: maps without None fields, new keys ------------------------------------------------


def test_the_vllm_033_capture_decodes_every_event():
    messages = [decode_message(m.frames) for m in vllm_033_messages()]
    assert [(m.pod, m.model, m.seq) for m in messages] == [
        ("pod-b", "Qwen/Qwen3-0.6B", 0),
        ("pod-c", "Qwen/Qwen3-0.6B", 0),
        ("pod-c", "Qwen/Qwen3-0.6B", 11),
    ]
    assert all(m.batch.errors == () and m.batch.data_parallel_rank == 0 for m in messages)
    plain, _, salted = messages[0].batch.events
    assert plain.extra_keys == (None,) * 4 and plain.group_idx == 0 and plain.lookahead_token_ids is None
    assert (plain.lora_name, plain.lora_id, plain.tier, plain.block_size) == (None, None, "gpu", 16)
    assert salted.extra_keys == (("tenant-42",), None, None, None)
    lora = messages[1].batch.events[0]
    assert (lora.lora_name, lora.lora_id, lora.extra_keys) == ("Alice", 1, (("Alice",),) * 4)
    assert messages[2].batch.events == (AllBlocksCleared(),)


def test_the_keys_vllm_033_added_are_decoded():
    event = {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": [[["img", 2]], [["img", -2]]],
        "locality": "REMOTE",
        "ownership": "kvcr",
        "session_id": "session-1",
        "lookahead_token_ids": [[5, 6], [9, 10]],
    }
    removed = {
        "type": "BlockRemoved",
        "block_hashes": [7],
        "medium": "CPU",
        "locality": "REMOTE",
        "ownership": "kvcr",
    }
    batch = decode_batch(pack([1.0, [event, removed], 0]))
    assert batch.errors == ()
    assert batch.events == (
        BlockStored(
            block_hashes=(7, 8),
            parent_block_hash=None,
            token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
            block_size=4,
            tier="cpu",
            extra_keys=((("img", 2),), (("img", -2),)),
            lookahead_token_ids=((5, 6), (9, 10)),
            locality="REMOTE",
            ownership="kvcr",
            session_id="session-1",
        ),
        BlockRemoved((7,), tier="cpu", locality="REMOTE", ownership="kvcr"),
    )


def test_labels_of_another_type_are_dropped_and_the_event_kept():
    event = {"type": "BlockStored", "block_hashes": [7], "token_ids": [1, 2, 3, 4], "block_size": 4}
    odd = {**event, "locality": {"rack": 1}, "ownership": 3, "session_id": b"\xff"}
    assert only_event(pack([1.0, [odd]])) == stored()


@pytest.mark.parametrize(
    "lookahead",
    [[[5]], [[5], [6], [7]], [5, 6], [[5], ["x"]], [[5], [-1]]],
    ids=["too-few", "too-many", "not-nested", "not-ints", "negative"],
)
def test_lookahead_token_ids_must_be_one_token_array_per_block(lookahead):
    event = {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "token_ids": [1] * 8,
        "block_size": 4,
        "lookahead_token_ids": lookahead,
    }
    error = assert_skipped(event, "field")
    assert "lookahead_token_ids" in error.message


# --- SGLang: its port of vLLM's publisher ---------------------------------------------------------


def test_sglang_batches_of_array_events_with_five_fields_and_signed_hashes():
    """SGLang's structs (``disaggregation/kv_events.py``) are ``array_like``: a batch
    ``[ts, events]``, ``BlockStored = [tag, hashes, parent, token_ids, block_size, lora_id]`` (later
    versions append ``medium``), ``BlockRemoved = [tag, hashes]``; hashes are signed int64 and a
    page of 1 token is one block."""
    payload = pack(
        [
            1.5,
            [
                ["BlockStored", [-3], None, [11], 1, None],
                ["BlockStored", [4], -3, [12], 1, None, "GPU"],
                ["BlockRemoved", [-3]],
                ["BlockRemoved", [4], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    minus_3 = 2**64 - 3
    assert decode_batch(payload) == EventBatch(
        1.5,
        (
            BlockStored((minus_3,), None, (11,), 1),
            BlockStored((4,), minus_3, (12,), 1),
            BlockRemoved((minus_3,)),
            BlockRemoved((4,)),
            AllBlocksCleared(),
        ),
    )


def test_a_later_sglang_batch_carries_its_attention_data_parallel_rank_third():
    assert decode_batch(pack([1.5, [["AllBlocksCleared"]], 2])).data_parallel_rank == 2


# --- hashes --------------------------------------------------------------------------------------


def test_negative_int64_hashes_are_taken_mod_2_64():
    event = only_event(pack([1.0, [array_stored([-1, -(2**63), 5], -5, [], 16, None, "GPU")], 0]))
    assert event.block_hashes == (U64, 2**63, 5)
    assert event.parent_block_hash == 2**64 - 5


@pytest.mark.parametrize("length", [8, 16, 32, 64])
def test_bytes_hashes_of_any_length_keep_their_last_8_bytes_big_endian(length):
    digest = bytes(range(200, 200 - length, -1))
    expected = int.from_bytes(digest[-8:], "big")
    event = only_event(pack([1.0, [array_stored([digest, 7], digest, [], 16, None, "GPU")], 0]))
    assert event.block_hashes == (expected, 7)
    assert event.parent_block_hash == expected


@pytest.mark.parametrize("parent", [None, 0, b"\x00" * 8], ids=["nil", "zero", "zero-bytes"])
def test_a_nil_or_zero_parent_means_no_parent(parent):
    event = only_event(pack([1.0, [array_stored([7], parent, [1, 2, 3, 4], 4, None, "GPU")], 0]))
    assert event.parent_block_hash is None


# --- tolerant reading: missing and unknown fields -----------------------------------------------


def test_missing_trailing_block_stored_fields_are_nil():
    payload = pack([1.0, [array_stored([7], None, [1, 2, 3, 4], 4), array_stored([8])]])
    batch = decode_batch(payload)
    assert batch.errors == ()
    assert batch.data_parallel_rank is None
    assert batch.events == (
        stored(),
        BlockStored(block_hashes=(8,), parent_block_hash=None, token_ids=(), block_size=0),
    )


def test_missing_block_removed_medium_is_gpu():
    assert only_event(pack([1.0, [["BlockRemoved", [7]]]])) == BlockRemoved((7,), tier="gpu")


def test_missing_map_fields_are_nil():
    assert only_event(pack([1.0, [{"type": "BlockStored", "block_hashes": [7]}]])) == BlockStored(
        block_hashes=(7,), parent_block_hash=None, token_ids=(), block_size=0
    )


def test_every_block_stored_field_is_read_from_its_array_position():
    extra = [["Alice"], ["Alice", ["mm-hash", 3]]]
    payload = pack([1.0, [array_stored([7, 8], 6, [1] * 8, 4, 3, "CPU", "Alice", extra, 2)], 0])
    assert only_event(payload) == BlockStored(
        block_hashes=(7, 8),
        parent_block_hash=6,
        token_ids=(1,) * 8,
        block_size=4,
        lora_id=3,
        tier="cpu",
        lora_name="Alice",
        extra_keys=(("Alice",), ("Alice", ("mm-hash", 3))),
        group_idx=2,
    )


def test_unknown_trailing_array_elements_are_ignored():
    declared = [None, "GPU", None, None, 0, "full_attention", 128, None, None, None, None]
    event = array_stored([7], None, [1, 2, 3, 4], 4, *declared, "new")
    batch = decode_batch(pack([1.0, [event, ["BlockRemoved", [7], "GPU", 0, None, None, "new"]], 0, "new"]))
    described = stored(group_idx=0, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=128)
    assert batch == EventBatch(1.0, (described, BlockRemoved((7,), group_idx=0)), 0)


def test_unknown_map_keys_are_ignored():
    event = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 4096,
        "priority": {"tenant": "t1"},
        "future_hashes": [[1, 2]],
    }
    batch = decode_batch(pack({"ts": 1.0, "events": [event], "data_parallel_rank": 2, "future": True}))
    described = stored(kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096)
    assert batch == EventBatch(1.0, (described,), 2)


def test_a_group_description_of_another_type_is_dropped_not_the_event():
    event = array_stored([7], None, [1, 2, 3, 4], 4, None, "GPU", None, None, 1, 7, "4096")
    assert decode_batch(pack([1.0, [event]])) == EventBatch(1.0, (stored(group_idx=1),), None)


def test_batch_may_be_a_map_without_a_rank():
    assert decode_batch(pack({"ts": 2, "events": [CLEARED]})) == EventBatch(2.0, (AllBlocksCleared(),), None)


def test_bytes_keys_tags_and_strings_from_odd_producers_are_read_as_text():
    event = {
        b"type": b"BlockStored",
        b"block_hashes": [7],
        b"token_ids": [1, 2, 3, 4],
        b"block_size": 4,
        b"medium": b"CPU",
        b"lora_name": b"Alice",
    }
    payload = pack({b"ts": 1.0, b"events": [event, [b"BlockRemoved", [7], b"GPU"]]})
    assert decode_batch(payload).events == (
        stored(tier="cpu", lora_name="Alice"),
        BlockRemoved((7,), tier="gpu"),
    )


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", "gpu"),
        ("gpu", "gpu"),
        ("Cpu", "cpu"),
        ("FS", "fs"),
        ("obj", "obj"),
        ("STORAGE", "storage"),
        ("NVMe", "nvme"),
        (None, "gpu"),
        ("", "gpu"),
        (b"CPU", "cpu"),
    ],
)
def test_medium_is_compared_case_insensitively_and_nil_means_gpu(medium, tier):
    payload = pack([1.0, [array_stored([7], None, [], 16, None, medium), ["BlockRemoved", [7], medium]]])
    assert [e.tier for e in decode_batch(payload).events] == [tier, tier]


# --- skipped events: the batch is kept ----------------------------------------------------------


def assert_skipped(event: object, reason: str) -> DecodeError:
    """``event`` sits between two good events; it alone is skipped, with ``reason``."""
    batch = decode_batch(pack([1.0, [GOOD_STORED, event, CLEARED], 0]))
    assert batch.events == (stored(), AllBlocksCleared())
    assert len(batch.errors) == 1
    error = batch.errors[0]
    assert (error.reason, error.index) == (reason, 1)
    assert "event 1" in str(error)
    return error


def test_an_unknown_tag_is_skipped_and_reported_apart_from_malformed_events():
    error = assert_skipped(["BlockMoved", [7], "GPU", "CPU"], "unknown_tag")
    assert "BlockMoved" in error.message
    assert_skipped({"type": "BlockPinned", "block_hashes": [7]}, "unknown_tag")


@pytest.mark.parametrize(
    "event",
    [[], 42, "BlockStored", None, [3, [7]], [None], {"block_hashes": [7]}, {"type": 5}, [b"\xff\xfe"]],
    ids=[
        "empty-array",
        "int",
        "string",
        "nil",
        "int-tag",
        "nil-tag",
        "map-without-type",
        "int-type",
        "non-utf8-tag",
    ],
)
def test_an_event_that_is_not_a_tagged_array_or_typed_map_is_skipped(event):
    assert_skipped(event, "event")


WRONG_FIELDS = {
    "token_ids a string": array_stored([7], None, "1234", 4),
    "token_ids with a float": array_stored([7], None, [1, 2.5, 3, 4], 4),
    "token_ids with a negative": array_stored([7], None, [1, -2, 3, 4], 4),
    "token_ids with a nil": array_stored([7], None, [1, None, 3, 4], 4),
    "block_hashes not a list": array_stored(7, None, [1, 2, 3, 4], 4),
    "block_hashes nil": array_stored(None, None, [1, 2, 3, 4], 4),
    "block_hashes with a string": array_stored(["7"], None, [1, 2, 3, 4], 4),
    "block_hashes with a float": array_stored([7.0], None, [1, 2, 3, 4], 4),
    "block_hashes with a bool": array_stored([True], None, [1, 2, 3, 4], 4),
    "block_hashes with empty bytes": array_stored([b""], None, [1, 2, 3, 4], 4),
    "parent a string": array_stored([7], "p", [1, 2, 3, 4], 4),
    "block_size a string": array_stored([7], None, [1, 2, 3, 4], "4"),
    "block_size negative": array_stored([7], None, [1, 2, 3, 4], -4),
    "lora_id a string": array_stored([7], None, [1, 2, 3, 4], 4, "1"),
    "medium an int": array_stored([7], None, [1, 2, 3, 4], 4, None, 1),
    "lora_name an int": array_stored([7], None, [1, 2, 3, 4], 4, None, "GPU", 5),
    "extra_keys a string": array_stored([7], None, [1, 2, 3, 4], 4, None, "GPU", None, "Alice"),
    "extra_keys entry a string": array_stored([7], None, [1, 2, 3, 4], 4, None, "GPU", None, ["Alice"]),
    "extra_keys one entry short": array_stored([7, 8], None, [1] * 8, 4, None, "GPU", None, [["Alice"]]),
    "group_idx a string": array_stored([7], None, [1, 2, 3, 4], 4, None, "GPU", None, None, "0"),
    "removed block_hashes nil": ["BlockRemoved", None, "GPU"],
    "removed medium a list": ["BlockRemoved", [7], ["GPU"]],
    "map token_ids a string": {"type": "BlockStored", "block_hashes": [7], "token_ids": "1234"},
    "map block_hashes a map": {"type": "BlockRemoved", "block_hashes": {"7": 7}},
}


@pytest.mark.parametrize("event", WRONG_FIELDS.values(), ids=WRONG_FIELDS.keys())
def test_a_field_of_the_wrong_type_skips_only_that_event(event):
    assert_skipped(event, "field")


def test_every_error_of_a_batch_is_reported_with_its_index():
    payload = pack([1.0, [["Nope"], GOOD_STORED, array_stored("x"), 5], 0])
    batch = decode_batch(payload)
    assert batch.events == (stored(),)
    assert [(e.reason, e.index) for e in batch.errors] == [("unknown_tag", 0), ("field", 2), ("event", 3)]


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_a_ts_that_is_not_finite_is_counted_and_the_events_still_apply(ts):
    batch = decode_batch(pack([ts, [GOOD_STORED], 0]))
    assert batch.events == (stored(),)
    assert batch.ts == 0.0  # unknown: no lag or latency is computed from it
    assert [(e.reason, e.index) for e in batch.errors] == [("batch", None)]
    assert "not a finite number" in str(batch.errors[0])


# --- unreadable payloads raise ------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x92\xcb\x3f",
        pack([1.0, []]) + b"\x00",
        b"\xa2\xff\xfe",
        b"\x81\x80\x01",
        b"not msgpack",
    ],
    ids=["empty", "reserved-byte", "truncated", "trailing-bytes", "non-utf8-string", "map-as-key", "text"],
)
def test_a_payload_that_is_not_one_msgpack_value_raises(payload):
    with pytest.raises(DecodeError) as raised:
        decode_batch(payload)
    assert raised.value.reason == "msgpack"
    assert raised.value.index is None


@pytest.mark.parametrize(
    "batch",
    [
        5,
        "batch",
        None,
        [],
        [1.0],
        ["now", []],
        [None, []],
        [1.0, {"a": 1}],
        [1.0, "events"],
        [1.0, [], "0"],
        [1.0, [], 1.5],
        {"ts": 1.0},
        {"events": []},
        {"ts": "now", "events": []},
    ],
)
def test_a_batch_that_is_not_an_event_batch_array_or_map_raises(batch):
    with pytest.raises(DecodeError) as raised:
        decode_batch(pack(batch))
    assert raised.value.reason == "batch"


# --- framing: topic, seq, frames ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"kv@pod-1@Qwen/Qwen3-0.6B", ("pod-1", "Qwen/Qwen3-0.6B")),
        (b"kv@10.0.0.1:8000@meta-llama/Llama-3.1-8B", ("10.0.0.1:8000", "meta-llama/Llama-3.1-8B")),
        (b"kv@pod-1@org/model@main", ("pod-1", "org/model@main")),
        ("kv@pöd@mödel".encode(), ("pöd", "mödel")),
    ],
)
def test_topic_is_prefix_pod_at_model(topic, expected):
    assert parse_topic(topic) == expected


def test_topic_prefix_is_configurable():
    assert parse_topic(b"engine/pod-1@m", prefix="engine/") == ("pod-1", "m")
    assert parse_topic(b"pod-1@m", prefix="") == ("pod-1", "m")


@pytest.mark.parametrize(
    "topic",
    [
        b"",
        b"kv",
        b"kv@pod-1",
        b"kv@@model",
        b"kv@pod-1@",
        b"vk@pod-1@model",
        b"KV@pod-1@model",
        b"kv@\xff@model",
    ],
    ids=[
        "empty",
        "prefix-only",
        "no-model",
        "empty-pod",
        "empty-model",
        "other-prefix",
        "prefix-case",
        "non-utf8",
    ],
)
def test_a_bad_topic_raises(topic):
    with pytest.raises(DecodeError) as raised:
        parse_topic(topic)
    assert raised.value.reason == "topic"


@pytest.mark.parametrize("seq", [0, 1, 2**32, U64])
def test_seq_is_8_bytes_big_endian_unsigned(seq):
    assert parse_seq(seq.to_bytes(8, "big")) == seq


def test_a_longer_seq_frame_is_read_from_its_first_8_bytes():
    assert parse_seq(b"\x00" * 7 + b"\x05" + b"stream-id") == 5
    assert parse_seq((9).to_bytes(8, "big") + b"\x01") == 9


@pytest.mark.parametrize("frame", [b"", b"\x00" * 7])
def test_a_short_seq_frame_raises(frame):
    with pytest.raises(DecodeError) as raised:
        parse_seq(frame)
    assert raised.value.reason == "seq"


def test_a_message_is_topic_seq_payload():
    payload = encode_batch([stored()], ts=1.5, data_parallel_rank=0)
    frames = encode_message("10.0.0.1:8000", "Qwen/Qwen3-0.6B", 42, payload)
    assert frames == [b"kv@10.0.0.1:8000@Qwen/Qwen3-0.6B", (42).to_bytes(8, "big"), payload]
    assert decode_message(frames) == Message(
        pod="10.0.0.1:8000", model="Qwen/Qwen3-0.6B", seq=42, batch=EventBatch(1.5, (stored(),), 0)
    )


@pytest.mark.parametrize("count", [0, 1, 2, 4])
def test_a_message_without_exactly_3_frames_raises(count):
    frames = [b"kv@pod@model", (1).to_bytes(8, "big"), pack([1.0, []]), b"extra"]
    with pytest.raises(DecodeError) as raised:
        decode_message((frames * 2)[:count])
    assert raised.value.reason == "frames"


@pytest.mark.parametrize(
    ("pod", "model", "seq"), [("", "m", 0), ("a@b", "m", 0), ("p", "", 0), ("p", "m", -1)]
)
def test_encode_message_refuses_what_could_not_be_decoded_back(pod, model, seq):
    with pytest.raises(ValueError):
        encode_message(pod, model, seq, b"")


# --- values --------------------------------------------------------------------------------------


def test_decode_errors_have_a_known_reason_and_survive_pickling():
    error = DecodeError("field", "token_ids must be unsigned ints", 3)
    assert error.reason in REASONS
    assert str(error) == "field: event 3: token_ids must be unsigned ints"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.reason, copy.message, copy.index) == ("field", error.message, 3)
    with pytest.raises(ValueError, match="unknown decode error reason"):
        DecodeError("oops", "")


def test_events_are_immutable_values():
    event = only_event(pack([1.0, [GOOD_STORED]]))
    assert event == stored() and hash(event) == hash(stored())
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.tier = "cpu"  # type: ignore[misc]


# --- properties ----------------------------------------------------------------------------------

hashes = st.integers(0, U64)
small_ints = st.none() | st.integers(0, 2**31)
groups = st.none() | st.integers(0, MAX_KV_CACHE_GROUPS - 1)
ranks = st.none() | st.integers(0, MAX_DATA_PARALLEL_RANKS - 1)
tiers = st.sampled_from(["gpu", "cpu", "fs", "obj", "storage"]) | st.text(
    "abcdefghijklmnopqrstuvwxyz", min_size=1
)
# vLLM's extra keys: LoRA name, multimodal (identifier, offset), cache_salt, prompt-embedding hashes.
extra_key = (
    st.text() | st.tuples(st.text(), st.integers(0, 99)) | st.binary(max_size=32) | st.integers(-(2**63), U64)
)
extra_entry = st.none() | st.lists(extra_key, min_size=1, max_size=3).map(tuple)
labels = st.none() | st.text(max_size=8)


@st.composite
def block_stored(draw) -> BlockStored:
    n = draw(st.integers(0, 5))
    block_size = draw(st.integers(1, 6))
    token = st.integers(0, 2**32)
    tokens = st.just(()) | st.lists(token, min_size=n * block_size, max_size=n * block_size).map(tuple)
    return BlockStored(
        block_hashes=tuple(draw(st.lists(hashes, min_size=n, max_size=n))),
        parent_block_hash=draw(st.none() | st.integers(1, U64)),
        token_ids=draw(tokens),
        block_size=block_size,
        lora_id=draw(small_ints),
        tier=draw(tiers),
        lora_name=draw(st.none() | st.text(min_size=1)),
        extra_keys=draw(st.none() | st.lists(extra_entry, min_size=n, max_size=n).map(tuple)),
        group_idx=draw(groups),
        lookahead_token_ids=draw(
            st.none() | st.lists(st.lists(token, max_size=3).map(tuple), min_size=n, max_size=n).map(tuple)
        ),
        locality=draw(labels),
        ownership=draw(labels),
        session_id=draw(labels),
    )


block_removed = st.builds(
    BlockRemoved, st.lists(hashes, max_size=3).map(tuple), tiers, groups, labels, labels
)
any_events = st.lists(block_stored() | block_removed | st.just(AllBlocksCleared()), max_size=6)
layouts = st.sampled_from(["array", "map"])


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_events=any_events,
    ts=st.floats(allow_nan=False, allow_infinity=False),  # a non-finite ts reads as 0.0 (tested above)
    rank=ranks,
    layout=layouts,
    batch_layout=layouts,
    hash_bytes=st.booleans(),
)
def test_encode_then_decode_is_the_identity(batch_events, ts, rank, layout, batch_layout, hash_bytes):
    payload = encode_batch(
        batch_events,
        ts=ts,
        data_parallel_rank=rank,
        layout=layout,
        batch_layout=batch_layout,
        hash_bytes=hash_bytes,
    )
    assert decode_batch(payload) == EventBatch(ts, tuple(batch_events), rank)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=12)
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
FIELD_NAMES = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
field_names = st.sampled_from(
    [*FIELD_NAMES, "medium", "lora_name", "extra_keys", "group_idx", "lookahead_token_ids", "locality"]
)
fuzzed_arrays = st.builds(lambda tag, rest: [tag, *rest], tags, st.lists(msgpack_values, max_size=17))
fuzzed_maps = st.builds(
    lambda tag, rest: {"type": tag, **rest}, tags, st.dictionaries(field_names, msgpack_values)
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(msgpack_values | fuzzed_arrays | fuzzed_maps, max_size=5))
def test_any_event_either_decodes_or_is_reported_never_crashes(raw_events):
    batch = decode_batch(pack([1.0, raw_events, 0]))
    assert len(batch.events) + len(batch.errors) == len(raw_events)
    assert all(e.reason in REASONS for e in batch.errors)


@settings(deadline=None)
@given(st.binary(max_size=40) | msgpack_values.map(pack))
def test_any_payload_either_decodes_or_raises_decode_error(payload):
    try:
        decode_batch(payload)
    except DecodeError as e:
        assert e.reason in ("msgpack", "batch")


def test_latencies_the_clocks_cannot_explain_are_not_recorded():
    stats = IngestStats()
    for seconds in (float("nan"), float("inf"), -float("inf"), MAX_VISIBLE_SECONDS * 2, -1e300):
        stats.observe_visible(seconds)
    assert (sum(stats.visible_buckets), stats.visible_sum) == (0, 0.0)
    stats.observe_visible(-0.002)  # an engine clock a little ahead of ours
    stats.observe_visible(0.5)
    assert (sum(stats.visible_buckets), stats.visible_sum) == (2, 0.5)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("group_idx", MAX_KV_CACHE_GROUPS, "field"),
        ("group_idx", 2**63, "field"),
        ("group_idx", 2**64 - 1, "field"),
        ("block_size", 4097, "field"),
        ("block_size", 2**63, "field"),
    ],
)
def test_a_value_that_would_size_what_is_kept_is_refused_before_anything_is_kept(field, value, reason):
    """Every value that sizes a structure of ingest (a pod's KV-cache groups, a block's tokens) is
    range-checked in decoding: the event is skipped and counted, nothing is kept of it."""
    good = BlockStored((1,), None, tuple(range(16)), 16, None, "gpu", None, None, 0)
    bad = BlockStored(**{f: getattr(good, f) for f in good.__slots__} | {field: value})
    batch = decode_batch(encode_batch([good, bad], ts=1.0, layout="map"))
    assert batch.events == (good,)
    assert [(e.reason, e.index) for e in batch.errors] == [(reason, 1)]


@pytest.mark.parametrize("rank", [MAX_DATA_PARALLEL_RANKS, 2**63])
def test_a_data_parallel_rank_beyond_the_limit_refuses_the_batch(rank):
    payload = msgpack.packb([1.0, [], rank])
    with pytest.raises(DecodeError, match="data_parallel_rank") as refused:
        decode_batch(payload)
    assert refused.value.reason == "batch"


def test_a_sliding_window_beyond_the_limit_describes_nothing():
    stored = BlockStored((1,), None, (), 0, None, "gpu", None, None, 1, kv_cache_spec_kind="sliding_window")
    fields = {f: getattr(stored, f) for f in stored.__slots__}
    too_long = BlockStored(**fields | {"kv_cache_spec_sliding_window": MAX_SLIDING_WINDOW + 1})
    [event] = decode_batch(encode_batch([too_long], ts=1.0, layout="map")).events
    assert event.kv_cache_spec_sliding_window is None
