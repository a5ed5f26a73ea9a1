"""Specifications of the KV-block index: a suite every backend passes, and one file per backend.

The helpers below build small, real block chains (vLLM ``sha256_cbor``, seed "42", block size 16)
so that keys and digests in these tests are the ones an engine would report.
"""

from __future__ import annotations

from scoring.index.base import StoredBlock
from scoring.keys import chain_digests, key_of, root_digest

MODEL = "Qwen/Qwen3-0.6B"


def chain(n: int, *, first_token: int = 0, engine_hash_offset: int | None = None) -> list[StoredBlock]:
    """``n`` chained blocks of the tokens ``first_token, first_token + 1, ...``.

    By default the engine hash equals the block key (an engine hashing as we do); with
    ``engine_hash_offset`` the engine hashes are ``offset + i`` instead (an engine that does not).
    """
    digests = chain_digests(range(first_token, first_token + 16 * n), parent=root_digest("42"))
    return [
        StoredBlock(
            key=key_of(d),
            engine_hash=key_of(d) if engine_hash_offset is None else engine_hash_offset + i,
            digest=d,
        )
        for i, d in enumerate(digests)
    ]


def keys(blocks: list[StoredBlock]) -> list[int]:
    return [b.key for b in blocks]


def hashes(blocks: list[StoredBlock]) -> list[int]:
    return [b.engine_hash for b in blocks]
