"""Mutated KV-event messages, as an outsider on the event port (or a broken engine) sends them.

``EventFuzzer(seed)`` yields ZeroMQ messages (``[topic, seq, payload]``) built from valid vLLM
batches in every layout and then mutated: a field of an event or of the batch replaced by a value
of another type or by an extreme one (huge and negative integers, NaN, long strings, deep nesting,
nested maps), bit flips and cuts in the payload, made-up and broken topics, extreme and
out-of-order seqs, missing or extra frames. Every message names a pod of its own kind
(``fuzz-<n>`` and some made-up names), never a pod a test publishes valid events for. The same
seed gives the same messages (tests and ``bench/hostile.py`` repeat their runs).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

MODEL = "fuzz/model"

_INTS = (
    -1,
    -(2**63),
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    10**6,
    4097,
    65_536,
)
_KINDS = ("full_attention", "sliding_window", "mamba", "full_attentiof", "", "x" * 300)


def _extreme(rng: random.Random, depth: int = 0) -> Any:
    """A value of any msgpack type, often an extreme one."""
    choice = rng.randrange(14)
    if choice < 3:
        return rng.choice(_INTS)
    if choice == 3:
        return rng.getrandbits(64)
    if choice == 4:
        return rng.choice((float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 3.5))
    if choice == 5:
        return rng.choice(_KINDS)
    if choice == 6:
        return rng.randbytes(rng.choice((0, 1, 8, 9, 33, 4096)))
    if choice == 7:
        return None
    if choice == 8:
        return rng.choice((True, False))
    if choice == 9:
        deep: Any = []
        for _ in range(rng.choice((10, 100, 1000))):
            deep = [deep]
        return deep
    if choice == 10 and depth < 2:
        key = rng.choice((rng.getrandbits(64), -1, "type", b"k", 2.5, None))
        return {key: _extreme(rng, depth + 1)}
    if choice == 11 and depth < 2:
        return [_extreme(rng, depth + 1) for _ in range(rng.randrange(4))]
    if choice == 12:
        return [rng.choice(_INTS) for _ in range(rng.choice((1, 16, 300)))]
    return "s" * rng.choice((1, 255, 70_000))


def _mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` (a decoded batch) with one element somewhere replaced by ``_extreme``."""
    if isinstance(value, list) and value and depth < 6:
        i = rng.randrange(len(value))
        if rng.random() < 0.35:
            value[i] = _extreme(rng)
        else:
            value[i] = _mutate(value[i], rng, depth + 1)
        if rng.random() < 0.05:
            value.append(_extreme(rng))
        return value
    if isinstance(value, dict) and value and depth < 6:
        key = rng.choice(list(value))
        if rng.random() < 0.35:
            value[key] = _extreme(rng)
        elif rng.random() < 0.1:
            value[rng.choice((rng.getrandbits(64), "type", b"events", -1, "x" * 300))] = _extreme(rng)
        else:
            value[key] = _mutate(value[key], rng, depth + 1)
        return value
    return _extreme(rng)


class EventFuzzer:
    """Hostile messages, endlessly (see the module docstring)."""

    def __init__(self, seed: int, *, pods: int = 200) -> None:
        self.rng = random.Random(seed)
        self.pods = [f"fuzz-{i}" for i in range(pods)]
        self.seqs: dict[str, int] = {}

    def _valid_events(self) -> list:
        rng = self.rng
        n = rng.choice((1, 2, 4, 16))
        hashes = tuple(rng.getrandbits(64) for _ in range(n))
        group = rng.choice((None, 0, 1, 2))
        spec = {}
        if rng.random() < 0.3:
            spec = {"kv_cache_spec_kind": rng.choice(_KINDS[:3]), "kv_cache_spec_sliding_window": 512}
        events: list = [
            BlockStored(
                hashes,
                rng.choice((None, rng.getrandbits(64))),
                tuple(rng.randrange(150_000) for _ in range(16 * n)),
                16,
                None,
                rng.choice(("gpu", "cpu")),
                rng.choice((None, "lora-a")),
                None,
                group,
                **spec,
            )
        ]
        if rng.random() < 0.3:
            events.append(BlockRemoved(hashes[: rng.randrange(n + 1)], group_idx=group))
        if rng.random() < 0.05:
            events.append(AllBlocksCleared())
        return events

    def _payload(self) -> bytes:
        rng = self.rng
        layout = rng.choice(("array", "map"))
        payload = encode_batch(
            self._valid_events(),
            ts=1.0,
            data_parallel_rank=rng.choice((None, 0, 1)),
            layout=layout,
            batch_layout=rng.choice(("array", "map")),
            hash_bytes=rng.random() < 0.2,
        )
        kind = rng.randrange(10)
        if kind < 5:  # a field replaced
            return msgpack.packb(
                _mutate(msgpack.unpackb(payload, strict_map_key=False), rng), use_bin_type=True
            )
        if kind < 7:  # bit flips
            data = bytearray(payload)
            for _ in range(rng.choice((1, 2, 8))):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            return bytes(data)
        if kind == 7:  # cut, or followed by garbage
            return (
                payload[: rng.randrange(len(payload))] if rng.random() < 0.5 else payload + rng.randbytes(9)
            )
        if kind == 8:  # any value at all
            return msgpack.packb(_extreme(rng), use_bin_type=True)
        return payload  # valid: the fuzz pods' streams also have good batches

    def _topic(self) -> bytes:
        rng = self.rng
        kind = rng.randrange(20)
        if kind == 0:
            return rng.randbytes(rng.choice((0, 3, 40)))
        if kind == 1:
            return f"kv@made-up-{rng.getrandbits(40)}@{MODEL}".encode()
        if kind == 2:
            return b"kv@" + b"p" * rng.choice((255, 300)) + b"@" + MODEL.encode()
        if kind == 3:
            return f"kv@{rng.choice(self.pods)}@fuzz/model-{rng.randrange(50)}".encode()
        return f"kv@{rng.choice(self.pods)}@{MODEL}".encode()

    def _seq(self, topic: bytes) -> bytes:
        rng = self.rng
        kind = rng.randrange(12)
        if kind == 0:
            return rng.randbytes(rng.choice((0, 4, 8, 12)))
        if kind == 1:
            return rng.getrandbits(64).to_bytes(8, "big")
        if kind == 2:
            return rng.choice((0, 2**63, 2**64 - 1)).to_bytes(8, "big")
        key = topic.decode(errors="replace")
        seq = self.seqs.get(key, -1) + (1 if kind > 4 else rng.choice((-5, 0, 2, 100, 10**6)))
        seq = max(0, min(seq, 2**64 - 1))
        self.seqs[key] = seq
        return seq.to_bytes(8, "big")

    def messages(self) -> Iterator[list[bytes]]:
        rng = self.rng
        while True:
            topic = self._topic()
            frames = [topic, self._seq(topic), self._payload()]
            if rng.random() < 0.02:
                frames = frames[: rng.randrange(1, 3)] if rng.random() < 0.5 else [*frames, b"extra"]
            yield frames
