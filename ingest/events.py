"""vLLM KV-cache events: ZeroMQ frames and msgpack payloads in, immutable event values out.

Pure core, no Django import. What it accepts is specified in vllm-kv-events.md, sections 1
and 2, checked against vLLM's own source:

* a message is three frames, ``topic`` (``kv@<pod>@<model>``), ``seq`` (8 bytes big-endian,
  longer tolerated) and ``payload`` (msgpack);
* the payload is an ``EventBatch``, an array ``[ts, events, data_parallel_rank]`` (two elements
  in the oldest vLLM) or a map with those keys;
* each event is a positional array whose element 0 is the tag (vLLM <= 0.23, and SGLang) or a
  map with a ``"type"`` key (vLLM >= 0.24). Missing trailing fields are nil, and so are fields a
  map leaves out (vLLM 0.33 omits every None field that has a default); unknown trailing elements
  and unknown map keys are ignored, never an error.

SGLang publishes through a port of vLLM's publisher with the oldest shape: batches ``[ts, events]``
(``[ts, events, attn_dp_rank]`` in later versions), ``BlockStored`` as ``[tag, block_hashes,
parent_block_hash, token_ids, block_size, lora_id]`` (``medium`` appended later), one event per
page, its page size as ``block_size`` (1 by default), and signed int64 hashes.

Errors are values: a payload that cannot be read raises :class:`DecodeError`; one bad event in an
otherwise good batch is skipped and reported in ``EventBatch.errors`` so that the rest of the
batch still applies. Every error carries a ``reason`` from :data:`REASONS`, the label it is
counted under.

Hashes are normalised with :func:`kvindex.keys.normalize_hash`: unsigned 64-bit ints whatever the
engine sent (uint64, negative int64 or bytes). ``decode_batch`` is on the hot path (hundreds of
thousands of blocks per second), hence direct indexing and whole-container type checks instead of
per-field reflection.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias

import msgpack

from kvindex.keys import MAX_BLOCK_SIZE, normalize_hash
from kvindex.kv_cache_groups import MAX_KV_CACHE_GROUPS, MAX_SLIDING_WINDOW

__all__ = [
    "DEFAULT_LIMITS",
    "REASONS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "DecodeLimits",
    "Event",
    "EventBatch",
    "Message",
    "decode_batch",
    "decode_message",
    "encode_batch",
    "encode_message",
    "parse_seq",
    "parse_topic",
]

DEFAULT_TIER: Final = "gpu"
SEQ_SIZE: Final = 8
MAX_DATA_PARALLEL_RANKS: Final = 1024
"""A batch's ``data_parallel_rank`` is below this (each rank of a pod is a stream of its own, with
its own state: a larger one is refused before anything is kept of it)."""
_U64: Final = (1 << 64) - 1

REASONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "frames": "a ZeroMQ message without exactly 3 frames (topic, seq, payload)",
        "topic": "a topic that is not UTF-8 'kv@<pod>@<model>' with a non-empty pod and model",
        "seq": "a seq frame shorter than 8 bytes",
        "msgpack": "a payload that is not one complete msgpack value",
        "batch": "a payload that is not an EventBatch array or map (ts, events, data_parallel_rank)",
        "event": "an event that is neither an array with a tag nor a map with a string 'type'",
        "unknown_tag": "an event of a type this decoder does not know (skipped, counted apart)",
        "field": "a known event with a field of the wrong type or shape",
        "too_large": "a payload over the message size limit (the whole batch is skipped)",
        "too_many_events": "a batch with more events than the limit (the whole batch is skipped)",
        "too_many_blocks": "an event with more block hashes or token ids than the limit (skipped)",
        "too_many_pods": "a message of a new unregistered pod when ingest already receives from the most "
        "unregistered pods it may (none of them quiet long enough to give its place)",
        "unregistered_pod": "a message of a pod not registered for that model, refused "
        "(KVCACHE_INGEST_REGISTERED_PODS_ONLY)",
        "too_many_models": "a message of a pod for one more model than a pod may send for",
        "too_many_ranks": "a batch of one more data-parallel rank than a pod may have",
    }
)
"""Every ``DecodeError.reason``, with what it means. The keys are metric label values."""


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """How much one message may carry; past a limit the input is counted and skipped, never
    applied in part. Defaults fit any real engine: vLLM batches a few events, and one event
    holds at most a request's blocks (``max_model_len / block_size``)."""

    max_message_bytes: int = 2 * 1024 * 1024  # unpacking is not sliced: ~40 ms at 2 MiB
    max_events: int = 4096
    max_blocks: int = 65536
    max_name_chars: int = 256  # pod and model names (topic parts)
    max_pods: int = 4096  # unregistered pods one ingest process receives from at once (each costs state)


DEFAULT_LIMITS: Final = DecodeLimits()


class DecodeError(Exception):
    """Input that could not be decoded. ``reason`` is one of :data:`REASONS`; ``message`` says
    what was wrong for a human; ``index`` is the event's position in its batch, when it is about
    one event."""

    def __init__(self, reason: str, message: str = "", index: int | None = None) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown decode error reason {reason!r}")
        super().__init__(reason, message, index)
        self.reason = reason
        self.message = message
        self.index = index

    def __str__(self) -> str:
        where = "" if self.index is None else f"event {self.index}: "
        return f"{self.reason}: {where}{self.message}"


ExtraKeys: TypeAlias = tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """An engine cached full blocks: ``block_hashes`` are the engine hashes of consecutive blocks,
    chained from ``parent_block_hash`` (``None`` when the first block starts a sequence).

    ``token_ids`` holds ``block_size`` tokens per block, or nothing for a hash-only event (a block
    copied to another tier). ``block_size`` is 0 when the engine did not send one. ``tier`` is the
    engine's ``medium`` lower-cased (``"gpu"``, ``"cpu"``, ...). ``lora_id`` is deprecated in
    vLLM; ``lora_name`` names the LoRA adapter (``None`` without one).

    ``extra_keys`` (vLLM ``distributed/kv_events.py``; ``None`` before vLLM added it) has exactly
    one entry per block: the tuple vLLM itself hashed as that block's extra keys, or ``None``.
    vLLM builds it in ``v1/core/kv_cache_utils.generate_block_hash_extra_keys`` as the LoRA name
    first, then multimodal ``(identifier, offset)`` pairs, then ``cache_salt`` (first block only),
    then prompt-embedding hashes; so a consumer hashes ``extra_keys[i]`` as it is for block ``i``
    (the LoRA name is already in it, never prepend ``lora_name`` again), and only without
    ``extra_keys`` falls back to ``(lora_name,)`` per block, or ``None`` without an adapter.

    ``group_idx`` is the KV-cache group of hybrid models (``None`` when not sent);
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` describe it when the publisher sends
    them (vLLM's offloading connectors do; its GPU block pool does not):
    ``kvindex.kv_cache_groups``.

    vLLM 0.33 added ``lookahead_token_ids``: with lookahead hashing, the tokens after each block
    that its hash also covers, one tuple per block (``None`` when lookahead hashing is off); a
    block is keyed with them (``kvindex.keys.keyed_extra``). ``locality`` ("LOCAL" / "REMOTE"
    tier), ``ownership`` (the secondary tier that stored it) and ``session_id`` (the request
    context that reported it) are kept as sent: they do not change what a block is.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    tier: str = DEFAULT_TIER
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None
    group_idx: int | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """An engine evicted blocks from ``tier`` (vLLM sends one hash per event); ``locality`` and
    ``ownership`` as in :class:`BlockStored`."""

    block_hashes: tuple[int, ...]
    tier: str = DEFAULT_TIER
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One payload: events in engine order, and the events that were skipped (``errors``)."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    errors: tuple[DecodeError, ...] = ()


@dataclass(frozen=True, slots=True)
class Message:
    """One ZeroMQ message: who sent it (``pod``, ``model``), its ``seq`` and its batch."""

    pod: str
    model: str
    seq: int
    batch: EventBatch


# --- framing -------------------------------------------------------------------------------------


def parse_topic(
    topic: bytes, prefix: str = "kv@", *, max_name_chars: int = DEFAULT_LIMITS.max_name_chars
) -> tuple[str, str]:
    """``(pod, model)`` of a ``<prefix><pod>@<model>`` topic.

    The pod ends at the first ``@`` after the prefix and the model is everything after it, so
    model names keep their ``/`` and any ``@`` (``org/model@rev``), and pod ids such as
    ``10.0.0.1:8000`` pass unchanged. Raises ``DecodeError("topic")`` for non-UTF-8, a missing
    prefix, an empty pod or model, or one longer than ``max_name_chars``.
    """
    try:
        text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("topic", f"topic is not UTF-8: {bytes(topic)[:64]!r}") from None
    if not text.startswith(prefix):
        raise DecodeError("topic", f"topic {text!r} does not start with {prefix!r}")
    pod, at, model = text[len(prefix) :].partition("@")
    if not at or not pod or not model:
        raise DecodeError("topic", f"topic {text[:300]!r} is not {prefix}<pod>@<model>")
    if len(pod) > max_name_chars or len(model) > max_name_chars:
        raise DecodeError(
            "topic", f"a pod or model name longer than {max_name_chars} characters: {text[:80]!r}..."
        )
    return pod, model


def parse_seq(frame: bytes) -> int:
    """The batch sequence number: the first 8 bytes, big-endian unsigned. Longer frames are
    accepted (later vLLM may append a stream id); shorter ones raise ``DecodeError("seq")``."""
    if len(frame) < SEQ_SIZE:
        raise DecodeError("seq", f"seq frame has {len(frame)} bytes, expected at least {SEQ_SIZE}")
    return int.from_bytes(frame[:SEQ_SIZE], "big")


def decode_message(
    frames: list[bytes], prefix: str = "kv@", limits: DecodeLimits = DEFAULT_LIMITS
) -> Message:
    """Decode a whole ``[topic, seq, payload]`` message; any other frame count is
    ``DecodeError("frames")``."""
    if len(frames) != 3:
        raise DecodeError("frames", f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    pod, model = parse_topic(topic, prefix, max_name_chars=limits.max_name_chars)
    return Message(pod, model, parse_seq(seq), decode_batch(payload, limits))


def encode_message(pod: str, model: str, seq: int, payload: bytes, prefix: str = "kv@") -> list[bytes]:
    """The three frames vLLM publishes for ``payload``; the inverse of :func:`decode_message`."""
    if not pod or "@" in pod:
        raise ValueError(f"pod {pod!r} must be non-empty and contain no '@'")
    if not model:
        raise ValueError("model must be non-empty")
    if not 0 <= seq <= _U64:
        raise ValueError(f"seq {seq} is not an unsigned 64-bit integer")
    return [f"{prefix}{pod}@{model}".encode(), seq.to_bytes(SEQ_SIZE, "big"), payload]


# --- payload decoding ----------------------------------------------------------------------------

_unpackb = msgpack.unpackb
_INT_ONLY: Final = frozenset((int,))
# Short arrays are padded to this many elements (the tag and every declared field, in vLLM's
# declaration order), so that a missing trailing field reads as nil.
_STORED_ARRAY_WIDTH: Final = 16
_REMOVED_ARRAY_WIDTH: Final = 6
_NILS: Final = (None,) * _STORED_ARRAY_WIDTH
# The media the spec lists, in both cases, so that the common case is one dict look-up.
_TIERS: Final[dict[Any, str]] = {
    None: DEFAULT_TIER,
    **{m: m.lower() for medium in ("GPU", "CPU", "FS", "OBJ", "STORAGE") for m in (medium, medium.lower())},
}


def _field(name: str, expected: str, value: object) -> DecodeError:
    shown = repr(value) if type(value) is int else type(value).__name__  # msgpack ints have <= 20 digits
    return DecodeError("field", f"{name} must be {expected}, not {shown}")


def _text(value: bytes, reason: str, what: str) -> str:
    """Some producers send strings as msgpack bin; they must still be UTF-8."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(reason, f"{what} is not UTF-8: {value[:64]!r}") from None


def _str_keys(d: dict, reason: str) -> dict:
    return {(_text(k, reason, "map key") if type(k) is bytes else k): v for k, v in d.items()}


def _hash(value: object, name: str) -> int:
    try:
        return normalize_hash(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise DecodeError("field", f"{name}: {e}") from None


def _block_hashes(value: object) -> tuple[int, ...]:
    if type(value) is not tuple:
        raise _field("block_hashes", "an array of hashes", value)
    if set(map(type, value)) == _INT_ONLY:
        # msgpack ints are within [-2**63, 2**64): only negative int64 hashes need the mask.
        return value if min(value) >= 0 else tuple(h & _U64 for h in value)
    return tuple(_hash(h, "block_hashes") for h in value)


def _parent(value: object) -> int | None:
    if value is None:
        return None
    # Simulators send 0 for "no parent"; a real hash of 0 is not worth telling apart.
    return _hash(value, "parent_block_hash") or None


def _tier(medium: object) -> str:
    try:
        return _TIERS[medium]
    except (KeyError, TypeError):
        pass
    if type(medium) is bytes:
        medium = _text(medium, "field", "medium")
    if type(medium) is not str:
        raise _field("medium", "a string or nil", medium)
    return medium.lower() or DEFAULT_TIER


def _optional_int(value: object, name: str) -> int | None:
    if value is None or (type(value) is int and value >= 0):
        return value  # type: ignore[return-value]
    raise _field(name, "a non-negative int or nil", value)


def _group(value: object) -> int | None:
    """``group_idx``: nil, or a KV-cache group below ``MAX_KV_CACHE_GROUPS`` (a group sizes what is
    kept of each pod, so a larger one is refused before anything is kept of it)."""
    if value is None or (type(value) is int and 0 <= value < MAX_KV_CACHE_GROUPS):
        return value  # type: ignore[return-value]
    raise _field("group_idx", f"an int from 0 to {MAX_KV_CACHE_GROUPS - 1} or nil", value)


def _label(value: object) -> str | None:
    """``locality``, ``ownership``, ``session_id``, ``kv_cache_spec_kind``: kept when a string, else
    dropped. They do not change what a block is, so a producer that sends another type loses
    them, not the event (so does a ``kv_cache_spec_sliding_window`` that is not a positive int)."""
    if type(value) is str:
        return value
    if type(value) is bytes:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _lookahead(value: object, n: int) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if type(value) is not tuple or len(value) != n:
        raise DecodeError("field", f"lookahead_token_ids must be an array of {n} token arrays")
    for tokens in value:
        if type(tokens) is not tuple:
            raise _field("lookahead_token_ids entry", "an array of ints", tokens)
        try:
            array("Q", tokens)
        except (TypeError, OverflowError):
            raise DecodeError("field", "lookahead_token_ids must be unsigned ints") from None
    return value  # type: ignore[return-value]


def _stored(
    hashes: Any,
    parent: Any,
    tokens: Any,
    block_size: Any,
    lora_id: Any,
    medium: Any,
    lora_name: Any,
    extra: Any,
    group_idx: Any,
    lookahead: Any = None,
    locality: Any = None,
    ownership: Any = None,
    session_id: Any = None,
    spec_kind: Any = None,
    spec_window: Any = None,
) -> BlockStored:
    hashes = _block_hashes(hashes)
    if type(tokens) is tuple:
        if tokens:
            try:
                array("Q", tokens)  # one C pass: every token an int in [0, 2**64)
            except (TypeError, OverflowError):
                raise DecodeError("field", "token_ids must be unsigned ints") from None
    elif tokens is None:
        tokens = ()
    else:
        raise _field("token_ids", "an array of ints", tokens)
    if block_size is None:
        block_size = 0
    elif type(block_size) is not int or not 0 <= block_size <= MAX_BLOCK_SIZE:
        raise _field("block_size", f"an int from 0 to {MAX_BLOCK_SIZE}", block_size)
    if lora_name is not None and type(lora_name) is not str:
        if type(lora_name) is not bytes:
            raise _field("lora_name", "a string or nil", lora_name)
        lora_name = _text(lora_name, "field", "lora_name")
    if extra is not None:
        if type(extra) is not tuple:
            raise _field("extra_keys", "an array or nil", extra)
        if len(extra) != len(hashes):
            raise DecodeError("field", f"extra_keys has {len(extra)} entries for {len(hashes)} blocks")
        for keys in extra:
            if keys is not None and type(keys) is not tuple:
                raise _field("extra_keys entry", "an array or nil", keys)
    return BlockStored(
        hashes,
        _parent(parent),
        tokens,
        block_size,
        _optional_int(lora_id, "lora_id"),
        _tier(medium),
        lora_name or None,
        extra,
        _group(group_idx),
        _lookahead(lookahead, len(hashes)),
        _label(locality),
        _label(ownership),
        _label(session_id),
        _label(spec_kind),
        spec_window if type(spec_window) is int and 0 < spec_window <= MAX_SLIDING_WINDOW else None,
    )


def _removed(
    hashes: Any, medium: Any, group_idx: Any, locality: Any = None, ownership: Any = None
) -> BlockRemoved:
    return BlockRemoved(
        _block_hashes(hashes),
        _tier(medium),
        _group(group_idx),
        _label(locality),
        _label(ownership),
    )


_CLEARED: Final = AllBlocksCleared()


def _stored_from_array(ev: tuple) -> BlockStored:
    if len(ev) < _STORED_ARRAY_WIDTH:
        ev += _NILS[: _STORED_ARRAY_WIDTH - len(ev)]
    return _stored(*ev[1:10], ev[15], ev[12], ev[13], ev[14], ev[10], ev[11])


def _removed_from_array(ev: tuple) -> BlockRemoved:
    if len(ev) < _REMOVED_ARRAY_WIDTH:
        ev += _NILS[: _REMOVED_ARRAY_WIDTH - len(ev)]
    return _removed(ev[1], ev[2], ev[3], ev[4], ev[5])


def _stored_from_map(ev: dict) -> BlockStored:
    get = ev.get
    return _stored(
        get("block_hashes"),
        get("parent_block_hash"),
        get("token_ids"),
        get("block_size"),
        get("lora_id"),
        get("medium"),
        get("lora_name"),
        get("extra_keys"),
        get("group_idx"),
        get("lookahead_token_ids"),
        get("locality"),
        get("ownership"),
        get("session_id"),
        get("kv_cache_spec_kind"),
        get("kv_cache_spec_sliding_window"),
    )


def _removed_from_map(ev: dict) -> BlockRemoved:
    get = ev.get
    return _removed(get("block_hashes"), get("medium"), get("group_idx"), get("locality"), get("ownership"))


_FROM_ARRAY: Final = {
    "BlockStored": _stored_from_array,
    "BlockRemoved": _removed_from_array,
    "AllBlocksCleared": lambda ev: _CLEARED,
}
_FROM_MAP: Final = {
    "BlockStored": _stored_from_map,
    "BlockRemoved": _removed_from_map,
    "AllBlocksCleared": lambda ev: _CLEARED,
}


def _event(ev: object) -> Event:
    if type(ev) is tuple:
        if not ev:
            raise DecodeError("event", "empty event array")
        tag = ev[0]
        decoders: dict = _FROM_ARRAY
    elif type(ev) is dict:
        tag = ev.get("type")
        if tag is None:
            ev = _str_keys(ev, "event")
            tag = ev.get("type")
        decoders = _FROM_MAP
    else:
        raise DecodeError("event", f"an event must be an array or a map, not {type(ev).__name__}")
    if type(tag) is bytes:
        tag = _text(tag, "event", "event type")
    if type(tag) is not str:
        raise DecodeError("event", f"event type must be a string, not {type(tag).__name__}")
    decode = decoders.get(tag)
    if decode is None:
        raise DecodeError("unknown_tag", f"unknown event type {tag[:64]!r}")
    return decode(ev)


def decode_batch(payload: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> EventBatch:
    """Decode one msgpack ``EventBatch`` payload, in any layout vLLM has used.

    Raises ``DecodeError`` with reason ``"msgpack"`` (not one complete msgpack value) or
    ``"batch"`` (not an array ``[ts, events, rank?]`` or a map with ``ts`` and ``events``). Events
    that cannot be decoded are left out of ``events`` and reported in ``errors`` with their index;
    a ``ts`` that is not finite is reported there too (without an index) and read as 0.0 (unknown).
    ``limits``: a payload over ``max_message_bytes`` (before it is unpacked) or with more than
    ``max_events`` events raises ``DecodeError`` (``too_large``, ``too_many_events``); an event with
    more than ``max_blocks`` hashes or token ids is left out (``too_many_blocks``).
    """
    if len(payload) > limits.max_message_bytes:
        raise DecodeError("too_large", f"{len(payload)} bytes, over the limit of {limits.max_message_bytes}")
    try:
        obj = _unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise DecodeError("msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if type(obj) is tuple:
        if len(obj) < 2:
            raise DecodeError("batch", f"batch array has {len(obj)} elements, expected 2 or 3")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif type(obj) is dict:
        if "events" not in obj:
            obj = _str_keys(obj, "batch")
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    else:
        raise DecodeError("batch", f"batch must be an array or a map, not {type(obj).__name__}")
    if type(ts) is not float:
        if type(ts) is not int:
            raise DecodeError("batch", f"ts must be a number, not {type(ts).__name__}")
        ts = float(ts)
    errors: list[DecodeError] = []
    if not math.isfinite(ts):
        # The events are good: apply them, without a time (a NaN or an infinity would poison
        # every latency statistic it reached), and count the bad field.
        errors.append(DecodeError("batch", f"ts {ts!r} is not a finite number: applied without a time"))
        ts = 0.0
    if type(events) is not tuple:
        raise DecodeError("batch", f"events must be an array, not {type(events).__name__}")
    if len(events) > limits.max_events:
        raise DecodeError("too_many_events", f"{len(events)} events, over the limit of {limits.max_events}")
    if rank is not None and not (type(rank) is int and 0 <= rank < MAX_DATA_PARALLEL_RANKS):
        raise DecodeError(
            "batch", f"data_parallel_rank must be an int from 0 to {MAX_DATA_PARALLEL_RANKS - 1} or nil"
        )

    out: list[Event] = []
    append = out.append
    # Token ids are bounded through blocks: no real block holds more than 1024 tokens.
    max_blocks, max_tokens = limits.max_blocks, limits.max_blocks * 1024
    for i, ev in enumerate(events):
        try:
            event = _event(ev)
            if isinstance(event, BlockStored | BlockRemoved) and (
                len(event.block_hashes) > max_blocks
                or (isinstance(event, BlockStored) and len(event.token_ids) > max_tokens)
            ):
                raise DecodeError(
                    "too_many_blocks", f"{len(event.block_hashes)} blocks, over the limit of {max_blocks}"
                )
            append(event)
        except DecodeError as e:
            errors.append(DecodeError(e.reason, e.message, i))
    return EventBatch(ts, tuple(out), rank, tuple(errors))


# --- encoding (tests, simulator) -----------------------------------------------------------------

Layout: TypeAlias = Literal["array", "map"]
Schema: TypeAlias = Literal["oldest", "0.11", "latest"]

# vLLM's declared fields in declaration order, which is also the array order after the tag.
_STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")
# How many of those fields each schema declares (BlockStored, BlockRemoved), and whether its
# EventBatch has data_parallel_rank. "oldest" and "0.11" are the spec's byte vectors; "oldest" is
# also SGLang's shape, and "0.11" later SGLang's (medium appended, the batch's third element is
# its attention data-parallel rank).
_SCHEMAS: Final[dict[str, tuple[int, int, bool]]] = {
    "oldest": (5, 1, False),
    "0.11": (6, 2, True),
    "latest": (len(_STORED_FIELDS), len(_REMOVED_FIELDS), True),
}
# Fields with a default in vLLM's msgspec structs. vLLM encodes with omit_defaults, which drops
# them from maps when nil; msgspec never omits anything from array_like structs.
_DEFAULTED: Final = frozenset(
    (
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
        "data_parallel_rank",
    )
)


def _pack_struct(tag: str | None, names: tuple[str, ...], values: tuple, layout: Layout) -> list | dict:
    if layout == "array":
        return [tag, *values] if tag is not None else list(values)
    out: dict[str, Any] = {"type": tag} if tag is not None else {}
    for name, value in zip(names, values, strict=True):
        if value is not None or name not in _DEFAULTED:
            out[name] = value
    return out


def encode_batch(
    batch_events: Iterable[Event],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    layout: Layout = "array",
    batch_layout: Layout = "array",
    hash_bytes: bool = False,
    schema: Schema = "latest",
) -> bytes:
    """A payload exactly as vLLM's msgspec encoder writes ``batch_events``.

    ``layout`` is the events' layout: positional arrays with every declared field, trailing nils
    included (vLLM <= 0.23), or maps without nil defaulted fields (vLLM >= 0.24). The batch itself
    is an array unless ``batch_layout="map"``. ``schema`` picks the declared fields: ``"oldest"``
    (no medium, no data_parallel_rank: SGLang's shape too), ``"0.11"`` (up to medium: later
    SGLang's) or ``"latest"`` (vLLM 0.33's, up to ``lookahead_token_ids``). Hashes are
    uint64 ints, or 8-byte big-endian bytes with ``hash_bytes``; ``tier`` is sent upper-case as
    vLLM's ``medium``. ``decode_batch`` inverts it for the fields the schema carries.
    """
    n_stored, n_removed, has_rank = _SCHEMAS[schema]
    if data_parallel_rank is not None and not has_rank:
        raise ValueError(f"schema {schema!r} has no data_parallel_rank")

    def h(value: int) -> int | bytes:
        return value.to_bytes(8, "big") if hash_bytes else value

    events: list[list | dict] = []
    for ev in batch_events:
        if type(ev) is BlockStored:
            values = (
                [h(x) for x in ev.block_hashes],
                None if ev.parent_block_hash is None else h(ev.parent_block_hash),
                list(ev.token_ids),
                ev.block_size,
                ev.lora_id,
                ev.tier.upper(),
                ev.lora_name,
                ev.extra_keys,
                ev.group_idx,
                ev.kv_cache_spec_kind,
                ev.kv_cache_spec_sliding_window,
                ev.locality,
                ev.ownership,
                ev.session_id,
                ev.lookahead_token_ids,
            )
            events.append(_pack_struct("BlockStored", _STORED_FIELDS[:n_stored], values[:n_stored], layout))
        elif type(ev) is BlockRemoved:
            hashes = [h(x) for x in ev.block_hashes]
            values = (hashes, ev.tier.upper(), ev.group_idx, ev.locality, ev.ownership)
            events.append(
                _pack_struct("BlockRemoved", _REMOVED_FIELDS[:n_removed], values[:n_removed], layout)
            )
        elif type(ev) is AllBlocksCleared:
            events.append(_pack_struct("AllBlocksCleared", (), (), layout))
        else:
            raise TypeError(f"not an event: {ev!r}")
    names = ("ts", "events", "data_parallel_rank")[: 3 if has_rank else 2]
    batch = _pack_struct(None, names, (float(ts), events, data_parallel_rank)[: len(names)], batch_layout)
    return msgpack.packb(batch, use_bin_type=True)
