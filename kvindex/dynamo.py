"""Our blocks as NVIDIA Dynamo's KV indexer (``python -m dynamo.indexer``, 1.6) knows them, so that
``/kv-indexer/dump`` can hand a Dynamo indexer that recovers from us (``--peers``) the blocks our
index holds, and its own ``/query`` then answers as ours does.

Dynamo keys a block by its *Dynamo block hash* (its dump's ``tokens_hash``): XXH3-64 of the block's
token ids as little-endian u32, followed by its multimodal objects' hashes as little-endian u64 in
ascending order, with the seed ``block_hash_seed``: 1337 plus XXH3-64 of the LoRA name (seed 0)
plus XXH3-64 of the cache salt (seed 1), modulo 2**64, an absent or empty name adding nothing.
It is not chained: a block's place is its path in Dynamo's radix tree, from its parent. Our index
keeps neither tokens nor parents (a block key is a digest chained over every block before it), so
ingest records, per ``(model, block key)``, a ``DynamoBlock``: the parent's block key, the seed
of the block's request (a salt keys only the first block of a chain: its children inherit it)
and the Dynamo block hash. A record is a property of the block, the same for every holder.

Records live beside the index (``DynamoBlockStore``: in this process, or in one Redis HASH per
model) and are written before the index stores the block. Nothing removes a record when its
block leaves the index: ``held_blocks``, which every dump calls, and ``prune``, which ingest
calls every few minutes, delete those whose block nobody holds any more, once they are
``PRUNE_GRACE_SECONDS`` old and only if unchanged since read (a block stored again meanwhile
keeps its record).

Pure core: no Django; the Redis store is handed its client.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol
from urllib.parse import quote

import xxhash

from kvindex.base import HolderMap, IndexUnavailable, KVIndex, Tier
from kvindex.keys import BlockKey, ExtraKeys

XXH3_SEED = 1337
"""Dynamo's seed for a block without LoRA or salt."""

PRUNE_GRACE_SECONDS = 60
"""A record whose block nobody holds is kept this long after it was written: ingest writes the
record before the index stores the block."""

SCAN_BLOCKS = 4096
"""Records read (and their holders looked up) at a time by ``held_blocks``."""

_U64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest
_RECORD = struct.Struct(">QQQI")  # parent key (0: none), seed, Dynamo block hash, written at (Unix s)


def block_hash_seed(*, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Dynamo's XXH3 seed for the blocks of a request with this LoRA adapter and cache salt."""
    seed = XXH3_SEED
    if lora_name:
        seed += _xxh3(lora_name.encode(), 0)
    if cache_salt:
        seed += _xxh3(cache_salt.encode(), 1)
    return seed & _U64


def mm_hash(identifier: str) -> int:
    """A multimodal object's 64-bit hash from vLLM's identifier: a 64-digit hex digest's first 16
    digits, else XXH3-64 of the identifier. Dynamo's ``/query`` takes no multimodal input, so this
    only has to keep such blocks apart from text-only ones."""
    if len(identifier) == 64:
        try:
            return int(identifier[:16], 16)
        except ValueError:
            pass
    return _xxh3(identifier.encode(), 0)


def dynamo_block_hashes(
    tokens: Sequence[int],
    *,
    block_size: int,
    seed: int = XXH3_SEED,
    mm_hashes: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """The Dynamo block hash of every full block of ``tokens`` (``mm_hashes[i]``: block i's
    multimodal objects). ``ValueError`` for a token id that is not a u32."""
    n = len(tokens) // block_size if block_size > 0 else 0
    try:
        packed = struct.pack(f"<{n * block_size}I", *tokens[: n * block_size])
    except struct.error:
        raise ValueError("Dynamo hashes token ids as unsigned 32-bit integers") from None
    width = 4 * block_size
    out = []
    for i in range(n):
        data = packed[i * width : (i + 1) * width]
        objects = mm_hashes[i] if mm_hashes is not None and i < len(mm_hashes) else ()
        if objects:
            data += struct.pack(f"<{len(objects)}Q", *sorted(objects))
        out.append(_xxh3(data, seed))
    return out


def request_identity(extra: ExtraKeys, *, lora_name: str | None) -> tuple[str | None, list[int]]:
    """The cache salt and the multimodal hashes in a block's extra keys as vLLM sends them (the
    LoRA name first, ``(identifier, offset)`` pairs, the salt on a chain's first block):
    ``(salt, mm hashes)``; the salt is the first string after the LoRA name."""
    salt: str | None = None
    objects: list[int] = []
    for i, item in enumerate(extra or ()):
        if isinstance(item, str):
            if i == 0 and lora_name and item == lora_name:
                continue
            if salt is None:
                salt = item
        elif isinstance(item, (tuple, list)) and item and isinstance(item[0], str):
            objects.append(mm_hash(item[0]))
    return salt, objects


class DynamoBlock(NamedTuple):
    """A block as Dynamo's indexer knows it (module docstring)."""

    parent: BlockKey | None  # the block key of the block before it; None for a chain's first
    seed: int
    block_hash: int


def pack(block: DynamoBlock, written_at: float) -> bytes:
    """A record as stores keep it: 28 bytes. A parent key of 0 stands for none (a block key is 0
    with a probability of 2**-64)."""
    return _RECORD.pack(block.parent or 0, block.seed, block.block_hash, int(written_at) & 0xFFFF_FFFF)


def unpack(raw: bytes) -> tuple[DynamoBlock, int]:
    """``(record, written at)`` of what ``pack`` wrote."""
    parent, seed, block_hash, written_at = _RECORD.unpack(raw)
    return DynamoBlock(parent or None, seed, block_hash), written_at


class DynamoBlockStore(Protocol):
    """Where ``DynamoBlock`` records live, per model and block key. Thread-safe."""

    def record(self, *, model: str, blocks: Mapping[BlockKey, DynamoBlock]) -> None:
        """Write (or overwrite) these records, stamped now."""

    def get(self, *, model: str, keys: Sequence[BlockKey]) -> list[DynamoBlock | None]:
        """The record of each key (``None``: none)."""

    def scan(self, *, model: str) -> Iterator[list[tuple[BlockKey, bytes]]]:
        """Every record of ``model``, packed, about ``SCAN_BLOCKS`` at a time (a record written
        during the scan may be missed, none is given twice)."""

    def forget(self, *, model: str, records: Mapping[BlockKey, bytes]) -> int:
        """Delete each key whose packed record is still the one given; returns how many."""

    def models(self) -> list[str]:
        """The models with records."""

    def close(self) -> None:
        """Release connections."""


class MemoryDynamoBlockStore:
    """Records in this process, at most ``max_blocks`` of them (the least recently written go
    first)."""

    def __init__(self, *, max_blocks: int = 10_000_000, clock: Any = time.time) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._clock = clock
        self._records: OrderedDict[tuple[str, BlockKey], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, *, model: str, blocks: Mapping[BlockKey, DynamoBlock]) -> None:
        now = self._clock()
        with self._lock:
            records = self._records
            for key, block in blocks.items():
                records[(model, key)] = pack(block, now)
                records.move_to_end((model, key))
            while len(records) > self.max_blocks:
                records.popitem(last=False)

    def get(self, *, model: str, keys: Sequence[BlockKey]) -> list[DynamoBlock | None]:
        with self._lock:
            found = [self._records.get((model, key)) for key in keys]
        return [None if raw is None else unpack(raw)[0] for raw in found]

    def scan(self, *, model: str) -> Iterator[list[tuple[BlockKey, bytes]]]:
        with self._lock:
            items = [(key, raw) for (m, key), raw in self._records.items() if m == model]
        for start in range(0, len(items), SCAN_BLOCKS):
            yield items[start : start + SCAN_BLOCKS]

    def forget(self, *, model: str, records: Mapping[BlockKey, bytes]) -> int:
        gone = 0
        with self._lock:
            for key, raw in records.items():
                if self._records.get((model, key)) == raw:
                    del self._records[(model, key)]
                    gone += 1
        return gone

    def models(self) -> list[str]:
        with self._lock:
            return sorted({m for m, _ in self._records})

    def close(self) -> None:
        pass


_FORGET = """
local gone = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    gone = gone + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return gone
"""


class RedisDynamoBlockStore:
    """Records in Redis or Valkey (one server, or a cluster client): per model, the HASH
    ``kvdyn.1:{M}`` (``M`` the model percent-encoded) of block key (8 bytes, big-endian) -> packed
    record, and the SET ``kvdyn.1:models``. Connection errors and time-outs surface as
    ``IndexUnavailable``."""

    PREFIX = "kvdyn.1"

    def __init__(self, client: Any, *, clock: Any = time.time) -> None:
        self._client = client
        self._clock = clock
        self._forget = client.register_script(_FORGET)
        self._known: set[str] = set()  # models this client added to the models SET

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisDynamoBlockStore:
        """A store on the Redis ``url`` (``options`` go to ``redis.Redis.from_url``)."""
        import redis  # only when a Redis store is used

        options.setdefault("socket_connect_timeout", 5)
        return cls(redis.Redis.from_url(url, decode_responses=False, **options))

    def _name(self, model: str) -> str:
        return f"{self.PREFIX}:{{{quote(model, safe='') or '%'}}}"

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        import redis

        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise IndexUnavailable(f"the Redis store of Dynamo block records is unreachable: {exc}") from exc

    def record(self, *, model: str, blocks: Mapping[BlockKey, DynamoBlock]) -> None:
        if not blocks:
            return
        now = self._clock()
        mapping = {key.to_bytes(8, "big"): pack(block, now) for key, block in blocks.items()}
        self._call(self._client.hset, self._name(model), mapping=mapping)
        if model not in self._known:
            self._call(self._client.sadd, f"{self.PREFIX}:models", model.encode())
            self._known.add(model)

    def get(self, *, model: str, keys: Sequence[BlockKey]) -> list[DynamoBlock | None]:
        if not keys:
            return []
        fields = [key.to_bytes(8, "big") for key in keys]
        found = self._call(self._client.hmget, self._name(model), fields)
        return [None if raw is None else unpack(raw)[0] for raw in found]

    def scan(self, *, model: str) -> Iterator[list[tuple[BlockKey, bytes]]]:
        cursor = 0
        while True:
            cursor, chunk = self._call(self._client.hscan, self._name(model), cursor, count=SCAN_BLOCKS)
            if chunk:
                yield [(int.from_bytes(field, "big"), raw) for field, raw in chunk.items()]
            if not int(cursor):
                return

    def forget(self, *, model: str, records: Mapping[BlockKey, bytes]) -> int:
        args: list[bytes] = []
        for key, raw in records.items():
            args += [key.to_bytes(8, "big"), raw]
        if not args:
            return 0
        return int(self._call(self._forget, keys=[self._name(model)], args=args))

    def models(self) -> list[str]:
        return sorted(m.decode() for m in self._call(self._client.smembers, f"{self.PREFIX}:models"))

    def close(self) -> None:
        self._client.close()


HeldBlocks = dict[str, dict[Tier, dict[BlockKey, DynamoBlock]]]
"""holder -> tier -> the recorded blocks it holds there."""


def held_blocks(
    index: KVIndex, store: DynamoBlockStore, *, model: str, now: float | None = None
) -> HeldBlocks:
    """Per index holder and tier, the recorded blocks of ``model`` it holds; deletes the records
    of blocks nobody holds (module docstring). One ``holders`` read per ``SCAN_BLOCKS`` records."""
    out: HeldBlocks = {}
    for key, block, held in _held_records(index, store, model=model, now=now):
        for holder, tiers in held.items():
            for tier in tiers:
                out.setdefault(holder, {}).setdefault(tier, {})[key] = block
    return out


def prune(index: KVIndex, store: DynamoBlockStore, *, model: str, now: float | None = None) -> int:
    """Delete the records of ``model``'s blocks nobody holds (module docstring); returns how many
    records are left."""
    return sum(1 for _ in _held_records(index, store, model=model, now=now))


def _held_records(
    index: KVIndex, store: DynamoBlockStore, *, model: str, now: float | None
) -> Iterator[tuple[BlockKey, DynamoBlock, HolderMap]]:
    """Every record of a block someone holds, with its holders; deletes the stale others."""
    now = time.time() if now is None else now
    for chunk in store.scan(model=model):
        holders: list[HolderMap] = index.holders(model=model, keys=[key for key, _ in chunk])
        stale: dict[BlockKey, bytes] = {}
        for (key, raw), held in zip(chunk, holders, strict=True):
            block, written_at = unpack(raw)
            if held:
                yield key, block, held
            elif now - written_at > PRUNE_GRACE_SECONDS:
                stale[key] = raw
        if stale:
            store.forget(model=model, records=stale)


class Run(NamedTuple):
    """Consecutive blocks of one chain, as one Dynamo ``stored`` event: ``parent`` is the block
    key before the first (None: a chain's first), ``blocks`` ``(block key, Dynamo block hash)``."""

    parent: BlockKey | None
    blocks: list[tuple[BlockKey, int]]


def runs(blocks: Mapping[BlockKey, DynamoBlock]) -> list[Run]:
    """What one holder holds on one tier as Dynamo stored events, every parent's run before its
    children's: a run goes on while a block has exactly one child held. Blocks that cannot be
    reached from a chain's first block through blocks held here are left out (Dynamo refuses a
    block whose parent it does not hold; our lookups cannot match them either)."""
    children: dict[BlockKey | None, list[BlockKey]] = {}
    for key, block in blocks.items():
        children.setdefault(block.parent, []).append(key)
    out: list[Run] = []
    pending = [(None, key) for key in sorted(children.get(None, ()), reverse=True)]
    while pending:
        parent, key = pending.pop()
        run = [(key, blocks[key].block_hash)]
        below = children.get(key, ())
        while len(below) == 1:
            key = below[0]
            run.append((key, blocks[key].block_hash))
            below = children.get(key, ())
        out.append(Run(parent, run))
        pending.extend((key, child) for child in sorted(below, reverse=True))
    return out
