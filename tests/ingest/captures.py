"""The real vLLM 0.33.0 capture (``vllm/vllm-0.33-messages.txt``): three multipart messages as
vLLM's own ``ZmqEventPublisher`` sent them (``KVCacheManager``, ``sha256_cbor``, seed "42", block
size 16), loaded as frames for tests that decode or apply them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from tests.servers import FIXTURES

VLLM_033_SEED = "42"
VLLM_033_MODEL = "Qwen/Qwen3-0.6B"


@dataclass(frozen=True)
class CapturedMessage:
    """One message of the capture: its three frames, and the topic and seq the file names."""

    frames: list[bytes]
    pod: str
    seq: int


@cache
def vllm_033_messages() -> tuple[CapturedMessage, ...]:
    """The capture's messages, in file order: pod-b's first batch (a plain store of 4 blocks, a
    plain one of 5, and one of 4 under ``cache_salt="tenant-42"``), pod-c's first (LoRA "Alice",
    then two plain stores) and pod-c's ``AllBlocksCleared`` (seq 11)."""
    text = (FIXTURES / "vllm" / "vllm-0.33-messages.txt").read_text()
    out = []
    for header, frames in re.findall(r"## message index \d+ \(([^)]*)\)\n((?:frame\d: [0-9a-f]*\n?)+)", text):
        topic, seq = re.fullmatch(r"kv@([^@]+)@.+ seq=(\d+)", header).groups()
        hexes = re.findall(r"frame\d: ([0-9a-f]*)", frames)
        out.append(CapturedMessage([bytes.fromhex(h) for h in hexes], topic, int(seq)))
    return tuple(out)
