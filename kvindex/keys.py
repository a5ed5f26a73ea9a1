"""Block keys: vLLM's ``sha256_cbor`` prefix-cache hash chain (compiled in ``kvindex.native`` when
it is built, in pure Python otherwise: the same digests).

Vocabulary used across the project:

* **digest** - the full 32-byte SHA-256 of one block, the chain state that the next block's
  hash is computed from (vLLM's ``BlockHash``).
* **block key** - the last 8 bytes of a digest as a big-endian unsigned int. It is the value vLLM
  puts in its KV events when the engine runs ``sha256_cbor``, and the key of the index.
* **engine hash** - whatever 64-bit value an engine reported for a block. It equals the block key
  only when the engine hashes as we do (same algorithm and seed): see ``ingest.applier``.

The chain (vLLM ``v1/core/kv_cache_utils.py``)::

    root      = sha256(cbor(seed))                                  # seed is a str
    digest[i] = sha256(cbor([digest[i-1] or root, tokens[i*B:(i+1)*B], extra[i]]))
    key[i]    = int.from_bytes(digest[i][-8:], "big")

with canonical CBOR. Only full blocks are hashed; a trailing partial block is dropped.

``extra[i]`` is block ``i``'s extra keys exactly as vLLM's KV events send them
(``BlockStored.extra_keys``): the bare LoRA name, ``(mm_identifier, offset)`` pairs, then the
``cache_salt`` (block 0 only); ``None`` when there are none. :func:`block_extra_keys` computes them
for a request, so a prompt is keyed the way the events of its blocks are. With lookahead hashing
(vLLM ``num_hash_lookahead_tokens``), block ``i`` is keyed with ``(extra[i], *next_tokens)``
(:func:`keyed_extra`): it matches only when the tokens after it match too.

vLLM >= 0.33 hashes the extras *tagged* (``("lora", name, path)``, ``("mm", id, offset)``,
``("cache_salt", salt)``), so its engine hashes of such blocks never equal our keys; older engines
hash them as sent. Either way a block's key depends only on its tokens and its extras as sent, and
the read path computes the same key from the same request.

Prompts repeat long prefixes (a system prompt, earlier turns), so without the compiled chain the
read path keys them through a :class:`ChainMemo`: a bounded LRU of chain steps that turns the shared
blocks into one dictionary look-up each instead of an encoding and a SHA-256 (the compiled chain
hashes a block faster than that look-up: :func:`memo_pays`).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import cbor2

from kvindex.native import module as _native

BlockKey = int
Digest = bytes
ExtraKeys = tuple | None

_U64 = (1 << 64) - 1
_sha256 = hashlib.sha256
_KEY_OF_DIGEST = "24xQ"  # a 32-byte digest's block key, as a struct format: its bytes 24..32

DEFAULT_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 4096
"""vLLM's --block-size takes 1, 8, 16, 32, 64, 128 or 256 tokens; hybrid (attention + Mamba) models
may pick a larger one themselves (a multiple of 16, e.g. 528). 4096 leaves room for those: the
registry refuses more, and so does ingest in an event."""
DIGEST_SIZE = 32

DEFAULT_SEED = "vllm-none-hash"
"""The seed of a vLLM >= 0.33 engine hashing with ``sha256`` or ``sha256_cbor`` and started without
``PYTHONHASHSEED`` (vLLM's ``DEFAULT_NONE_HASH_SEED``), hence our default: out of the box, such an
engine's chain root is ``root_digest(DEFAULT_SEED)``. Engines before 0.33, and ``xxhash`` ones, draw a
random root when ``PYTHONHASHSEED`` is unset: only an explicit seed makes them reproducible."""


def key_of(digest: Digest) -> BlockKey:
    """The block key of a digest: its last 8 bytes, big-endian (works for any length >= 8)."""
    return int.from_bytes(digest[-8:], "big")


@lru_cache(maxsize=64)
def root_digest(seed: str) -> Digest:
    """The digest every chain starts from: ``sha256(cbor(seed))``. ``seed`` is the engines'
    ``PYTHONHASHSEED`` as a string (:data:`DEFAULT_SEED` when it is unset, from vLLM 0.33)."""
    return _sha256(cbor2.dumps(seed, canonical=True)).digest()


def _uint_head(major: int, n: int) -> bytes:
    """Canonical CBOR head for ``major`` type with argument ``n`` (RFC 8949 section 3)."""
    mt = major << 5
    if n < 24:
        return bytes((mt | n,))
    if n < 0x100:
        return bytes((mt | 24, n))
    if n < 0x10000:
        return bytes((mt | 25,)) + struct.pack(">H", n)
    if n < 0x100000000:
        return bytes((mt | 26,)) + struct.pack(">I", n)
    return bytes((mt | 27,)) + struct.pack(">Q", n)


# Encoded tokens for the common vocabulary range, so that encoding a block is a table look-up
# per token plus one join. Larger ids fall back to _uint_head.
_TOKEN_TABLE_SIZE = 1 << 16
_TOKEN_TABLE: tuple[bytes, ...] = tuple(_uint_head(0, n) for n in range(_TOKEN_TABLE_SIZE))
# Array heads for every token count up to 1023 (block sizes in practice are 16..256).
_ARRAY_HEADS: tuple[bytes, ...] = tuple(_uint_head(4, n) for n in range(1024))
_BLOCK_HEAD_32 = b"\x83\x58\x20"  # a 3-element array, then a 32-byte string: the usual parent
_NIL = b"\xf6"


def _encode_token(t: int) -> bytes:
    if 0 <= t < _TOKEN_TABLE_SIZE:
        return _TOKEN_TABLE[t]
    if t < 0 or t > _U64:
        raise ValueError(f"token id {t} is not an unsigned 64-bit integer")
    return _uint_head(0, t)


_HEAD_U32 = struct.Struct(">BI").pack
"""The CBOR of a uint32 above the table (``0x1a`` and 4 bytes): ids 65,536 and up, a third or more
of today's vocabularies (Qwen3's 151,936, Llama 3's 128,256), in one call each instead of
``_uint_head``'s branches (key chains of such ids in half the time: docs/performance.md)."""


def _encode_tokens(tokens: Sequence[int]) -> list[bytes]:
    """The CBOR of each token id, in order. ValueError for an id outside uint64."""
    table, size, u32 = _TOKEN_TABLE, _TOKEN_TABLE_SIZE, _HEAD_U32
    # A negative id would index the table from its end: filter it out and notice below.
    encoded = [
        table[t] if t < size else u32(0x1A, t) if t < 0x100000000 else _encode_token(t)
        for t in tokens
        if t >= 0
    ]
    if len(encoded) != len(tokens):
        encoded = [_encode_token(t) for t in tokens]
    return encoded


def _block_head(parent: Digest) -> bytes:
    """The array head plus the parent's byte-string head: the bytes before ``parent``."""
    return _BLOCK_HEAD_32 if len(parent) == 32 else b"\x83" + _uint_head(2, len(parent))


def _array_head(n: int) -> bytes:
    return _ARRAY_HEADS[n] if n < len(_ARRAY_HEADS) else _uint_head(4, n)


def _encode_extra(extra: ExtraKeys) -> bytes:
    if extra is None:
        return _NIL
    if all(type(k) is str for k in extra):
        return _encode_str_extra(tuple(extra))
    return cbor2.dumps(list(extra), canonical=True)


@lru_cache(maxsize=1024)
def _encode_str_extra(extra: tuple[str, ...]) -> bytes:
    """Extra keys made of strings only (LoRA name, multimodal hashes, cache salt) repeat block
    after block. Cached by value, which is safe only because a str never equals a non-str (the
    int 1, True and 1.0 are equal dict keys but encode differently)."""
    return cbor2.dumps(list(extra), canonical=True)


def encode_block(parent: Digest, tokens: Sequence[int], extra: ExtraKeys = None) -> bytes:
    """Canonical CBOR of ``[parent, tokens, extra]``, byte-identical to
    ``cbor2.dumps([parent, list(tokens), extra], canonical=True)`` for token ids in uint64 (a
    property test holds it to that); ValueError for an id outside. ``extra`` other than ``None``
    is encoded by cbor2, and cached when it holds strings only (a LoRA name)."""
    parts = [_block_head(parent), parent, _array_head(len(tokens))]
    parts += _encode_tokens(tokens)
    parts.append(_encode_extra(extra))
    return b"".join(parts)


def block_digest(parent: Digest, tokens: Sequence[int], extra: ExtraKeys = None) -> Digest:
    """The digest of one full block chained from ``parent``."""
    return _sha256(encode_block(parent, tokens, extra)).digest()


def chain_digests(
    tokens: Sequence[int],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent: Digest,
    extra: ExtraKeys = None,
) -> list[Digest]:
    """Digests of every full block of ``tokens``, chained from ``parent``; the same digests as
    calling :func:`block_digest` block after block.

    ``extra`` is applied to every block (vLLM puts the LoRA name in each block's extra keys).
    A trailing partial block is dropped, as vLLM never hashes one. Computed by the compiled chain
    (``kvindex.native``) when it is built, else by :func:`chain_digests_python`: the same digests,
    ``ValueError`` for a token id outside uint64 and ``TypeError`` for one that is not an int.
    """
    if _native is not None:
        return _native.chain_digests(tokens, block_size, parent, _encode_extra(extra))
    return chain_digests_python(tokens, block_size=block_size, parent=parent, extra=extra)


def chain_digests_python(
    tokens: Sequence[int],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent: Digest,
    extra: ExtraKeys = None,
) -> list[Digest]:
    """:func:`chain_digests` in pure Python (the fallback, and what the tests hold the compiled
    chain to)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(tokens) // block_size * block_size
    # Only the parent differs from block to block: encode the tokens and the extra keys once.
    encoded = _encode_tokens(tokens[:n])
    array_head, tail = _array_head(block_size), _encode_extra(extra)
    sha256 = _sha256
    join = b"".join
    out: list[Digest] = []
    prev = parent
    head = _block_head(prev)
    for i in range(0, n, block_size):
        prev = sha256(join((head, prev, array_head, join(encoded[i : i + block_size]), tail))).digest()
        head = _BLOCK_HEAD_32  # every digest after the first parent is 32 bytes long
        out.append(prev)
    return out


DEFAULT_CHAIN_MEMO_STEPS = 65_536
"""Chain steps a :class:`ChainMemo` keeps by default: 1M tokens of prefixes at block size 16, in
about 22 MiB (~350 bytes a step at block size 16, 8 more per token of a larger block)."""

_TOKEN_WORD = "Q"  # a token id as the memo stores it: unsigned 64-bit, the range vLLM hashes
assert array(_TOKEN_WORD).itemsize == 8


def first_invalid_token(tokens: Sequence[object]) -> int | None:
    """The index of the first of ``tokens`` that is not an int in 0..2**64-1 (a token id vLLM
    hashes), or ``None``."""
    if _native is not None:
        found = _native.first_invalid_token(tokens)
        return None if found < 0 else found
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or not 0 <= t <= _U64:
            return i
    return None


def memo_pays() -> bool:
    """Whether a :class:`ChainMemo` keys a repeated prefix faster than the chain hashes it: only
    for the pure-Python chain (the compiled one hashes a block in ~0.3 us, a memo look-up costs
    more; docs/performance.md)."""
    return _native is None


class ChainMemo:
    """Thread-safe LRU of chain steps: ``(extra keys, parent digest, block tokens) -> digest``.

    Invariant: a step is stored only as computed by :func:`chain_digests`, under a name that is the
    whole input of that computation: the canonical CBOR of the extra keys (one complete CBOR item,
    so never the start of another one), the 32-byte parent digest, then the block's token ids as
    uint64 (their length gives the block size). So a chain read through the memo equals the chain
    computed without it. A chain is read from its start up to the first step the memo lacks; the
    rest is computed and stored. ``capacity`` bounds the steps kept (least recently used out
    first; 0 disables the memo). Parents other than 32-byte digests are not memoized.
    """

    def __init__(self, *, capacity: int = DEFAULT_CHAIN_MEMO_STEPS) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._steps: OrderedDict[bytes, Digest] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()

    def chain_digests(
        self,
        tokens: Sequence[int],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        parent: Digest,
        extra: ExtraKeys = None,
    ) -> list[Digest]:
        """What :func:`chain_digests` returns (and raises) for the same arguments."""
        n = len(tokens) // block_size * block_size if block_size > 0 else 0
        if self.capacity == 0 or n == 0 or len(parent) != DIGEST_SIZE:
            return chain_digests(tokens, block_size=block_size, parent=parent, extra=extra)
        try:
            packed = array(_TOKEN_WORD, tokens[:n]).tobytes()
        except (OverflowError, TypeError):  # not a uint64: the plain chain says what is wrong
            return chain_digests(tokens, block_size=block_size, parent=parent, extra=extra)
        width = block_size * array(_TOKEN_WORD).itemsize
        extra_head = _encode_extra(extra)
        digests: list[Digest] = []
        names: list[bytes] = []
        prev = parent
        with self._lock:
            steps = self._steps
            for start in range(0, len(packed), width):
                name = extra_head + prev + packed[start : start + width]
                digest = steps.get(name)
                if digest is None:
                    break
                digests.append(digest)
                names.append(name)
                prev = digest
            if len(names) * block_size == n:
                self._keep(names, digests)
                return digests
        known = len(names)
        computed = chain_digests(
            tokens[known * block_size : n], block_size=block_size, parent=prev, extra=extra
        )
        for i, digest in enumerate(computed, start=known):
            names.append(extra_head + prev + packed[i * width : (i + 1) * width])
            prev = digest
        digests += computed
        with self._lock:
            self._keep(names, digests)
        return digests

    def _keep(self, names: list[bytes], digests: list[Digest]) -> None:
        """Store or refresh one chain's steps, its first step last: a chain is read from its start,
        so its start must outlive its end in the LRU. The caller holds the lock."""
        steps = self._steps
        refresh = steps.move_to_end
        for name, digest in zip(reversed(names), reversed(digests), strict=True):
            try:
                refresh(name)
            except KeyError:  # a new step (or one evicted since it was read): it goes last
                steps[name] = digest
        while len(steps) > self.capacity:
            steps.popitem(last=False)


def block_keys(
    tokens: Sequence[int],
    *,
    seed: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent: Digest | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultimodalFeature] = (),
    lookahead_tokens: int = 0,
    memo: ChainMemo | None = None,
) -> list[BlockKey]:
    """Block keys of ``tokens`` as vLLM ``sha256_cbor`` computes them, with each block's extra keys
    as vLLM's events send them (:func:`block_extra_keys`), so that they equal the keys ingest
    computes from those events.

    ``parent`` continues an existing chain (its digest); otherwise the chain starts at the root
    of ``seed``. ``lora_name`` is the first extra key of every block, ``cache_salt`` one of the
    first block (so it needs a chain from the root: ``ValueError`` with ``parent``), and
    ``mm_features`` add ``(identifier, offset)`` to the blocks their placeholder tokens overlap
    (positions count from ``tokens[0]``). ``lookahead_tokens`` (the engines'
    ``num_hash_lookahead_tokens``) keys every block with the tokens after it too, so only blocks
    followed by that many tokens are keyed. ``memo`` reuses (and keeps) chain steps computed
    before: the same keys, faster for a repeated prefix.
    """
    if cache_salt and parent is not None:
        raise ValueError("cache_salt keys the first block of a chain: it cannot continue a parent")
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    start = parent if parent is not None else root_digest(seed)
    chain = chain_digests if memo is None else memo.chain_digests
    if not cache_salt and not mm_features and not lookahead_tokens:
        extra = extra_keys(lora_name=lora_name)
        if memo is None and _native is not None:
            return _native.chain_keys(tokens, block_size, start, _encode_extra(extra))
        digests = chain(tokens, block_size=block_size, parent=start, extra=extra)
    else:
        n = max(0, (len(tokens) - max(lookahead_tokens, 0)) // block_size)
        extras = block_extra_keys(
            n,
            block_size=block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_features=mm_features,
            lookahead_tokens=lookahead_tokens,
        )
        if lookahead_tokens:
            extras = [
                keyed_extra(extra, tokens[(i + 1) * block_size : (i + 1) * block_size + lookahead_tokens])
                for i, extra in enumerate(extras)
            ]
        digests = block_chain(tokens, block_size=block_size, parent=start, extras=extras, memo=memo)
    return keys_of(digests)


def keys_of(digests: Sequence[Digest]) -> list[BlockKey]:
    """:func:`key_of` of each digest, in one unpacking when all are 32 bytes long."""
    if set(map(len, digests)) == {DIGEST_SIZE}:
        return list(struct.unpack(">" + _KEY_OF_DIGEST * len(digests), b"".join(digests)))
    return [key_of(d) for d in digests]


def extra_keys(*, lora_name: str | None = None) -> ExtraKeys:
    """The per-block extra keys vLLM hashes: the LoRA name first; ``None`` when there are none."""
    return (lora_name,) if lora_name else None


@dataclass(frozen=True, slots=True)
class MultimodalFeature:
    """One multimodal input of a prompt as vLLM hashes it: ``identifier`` is vLLM's hash of the
    media (``mm_features[i].identifier``, the engine computes it from the media itself), and its
    placeholder tokens are ``length`` positions from ``offset`` in the prompt's token ids."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if type(self.identifier) is not str or not self.identifier:
            raise ValueError("a multimodal identifier must be a non-empty string")
        if type(self.offset) is not int or self.offset < 0:
            raise ValueError(f"a multimodal offset must be a non-negative int, not {self.offset!r}")
        if type(self.length) is not int or self.length <= 0:
            raise ValueError(f"a multimodal length must be a positive int, not {self.length!r}")

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_extra_keys(
    num_blocks: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultimodalFeature] = (),
    lookahead_tokens: int = 0,
) -> list[ExtraKeys]:
    """The extra keys of the first ``num_blocks`` blocks of a request, exactly as a vLLM 0.33
    engine sends them in ``BlockStored.extra_keys`` (``to_event_extra_keys`` of
    ``generate_block_hash_extra_keys``): per block, the LoRA name, then ``(identifier, offset)``
    for each multimodal input whose placeholder tokens overlap the block (``offset`` = the input's
    first position minus the block's: negative once the input started in an earlier block), then
    ``cache_salt`` in block 0 only; ``None`` for a block with none of them.

    With ``lookahead_tokens`` (L), a block's window for multimodal inputs also covers the L tokens
    after it, as vLLM's lookahead hashing does. Inputs are taken in order of their offset."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if lookahead_tokens < 0:
        raise ValueError("lookahead_tokens must be >= 0")
    lora = (lora_name,) if lora_name else ()
    if not mm_features:
        plain = lora or None
        if not cache_salt:
            return [plain] * num_blocks
        return [(*lora, cache_salt)] + [plain] * (num_blocks - 1) if num_blocks else []
    features = sorted(mm_features, key=lambda f: f.offset)
    out: list[ExtraKeys] = []
    first = 0  # the first input a block can still overlap
    for i in range(num_blocks):
        start = i * block_size
        end = start + block_size
        media, first = _multimodal_keys(features, start, end + lookahead_tokens, first)
        if lookahead_tokens:
            # The next block starts at `end`: it must see again the inputs still open there.
            while first > 0 and features[first - 1].end > end:
                first -= 1
        keys = (*lora, *media, *((cache_salt,) if cache_salt and i == 0 else ()))
        out.append(keys or None)
    return out


def _multimodal_keys(
    features: Sequence[MultimodalFeature], start: int, end: int, first: int
) -> tuple[list[tuple[str, int]], int]:
    """``(identifier, offset - start)`` of the inputs from ``features[first]`` that overlap the
    window ``[start, end)``, and the input the next window starts from; vLLM's
    ``_gen_mm_extra_hash_keys`` walk (inputs sorted by offset): an input that ends inside the
    window lets the next one in, one that goes on past it ends the walk."""
    keys: list[tuple[str, int]] = []
    if features[-1].end <= start:
        return keys, first
    i = first
    while i < len(features):
        feature = features[i]
        if end <= feature.offset:
            break
        if start >= feature.end:
            i += 1
            continue
        keys.append((feature.identifier, feature.offset - start))
        if end < feature.end:
            break
        i += 1
    return keys, i


def keyed_extra(extra: ExtraKeys, lookahead_token_ids: Sequence[int] | None = None) -> ExtraKeys:
    """The extra keys a block is hashed with: its extra keys as sent, or, with lookahead hashing,
    ``(extra, *lookahead_token_ids)`` (vLLM hashes ``(E, *tokens)``; ``E`` is ``None`` without
    extras, so such a block's engine hash can still equal our key)."""
    if lookahead_token_ids is None:
        return extra
    return (extra, *lookahead_token_ids)


def _same_extra(a: ExtraKeys, b: ExtraKeys) -> bool:
    """Whether two blocks' extra keys encode the same: equal, and made of strings only when not
    the same object (``1 == True == 1.0`` would pass ``==`` with different encodings)."""
    return a is b or (a is not None and a == b and all(type(k) is str for k in a))


def block_chain(
    tokens: Sequence[int],
    *,
    block_size: int,
    parent: Digest,
    extras: Sequence[ExtraKeys],
    memo: ChainMemo | None = None,
) -> list[Digest]:
    """Digests of ``len(extras)`` full blocks of ``tokens`` chained from ``parent``, block ``i``
    keyed with ``extras[i]``: what :func:`block_digest` gives block after block. Runs of blocks
    with the same extra keys go through :func:`chain_digests` (or ``memo``) at once. The one
    function both ingest (extras from events) and the read path (extras of a request) key with.
    ``ValueError`` when ``tokens`` holds fewer than ``len(extras)`` blocks."""
    n = len(extras)
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if len(tokens) < n * block_size:
        raise ValueError(f"{len(tokens)} tokens do not fill {n} blocks of {block_size}")
    chain = chain_digests if memo is None else memo.chain_digests
    if n and extras[0] is None and extras.count(None) == n:  # no extras (the usual case): one run
        return chain(tokens[: n * block_size], block_size=block_size, parent=parent)
    out: list[Digest] = []
    prev = parent
    i = 0
    while i < n:
        j = i + 1
        while j < n and _same_extra(extras[j], extras[i]):
            j += 1
        run = tokens[i * block_size : j * block_size]
        out += chain(run, block_size=block_size, parent=prev, extra=extras[i])
        prev = out[-1]
        i = j
    return out


def normalize_hash(value: int | bytes) -> int:
    """An engine hash as an unsigned 64-bit int: ints mod 2**64 (old negative int64 hashes),
    bytes of any length by their last 8 bytes big-endian (vLLM's int mode sends that value)."""
    if isinstance(value, bool):
        raise TypeError("a block hash cannot be a bool")
    if isinstance(value, int):
        return value & _U64
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        if not b:
            raise ValueError("a block hash cannot be empty bytes")
        return int.from_bytes(b[-8:], "big")
    raise TypeError(f"a block hash must be int or bytes, not {type(value).__name__}")
