"""Specifications of the KV-block index: a suite every backend passes, and one file per backend.

The helpers below build small, real block chains (vLLM ``sha256_cbor``, seed "42", block size 16)
so that keys and digests in these tests are the ones an engine would report.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable

from kvindex.base import StoredBlock
from kvindex.keys import chain_digests, key_of, root_digest
from kvindex.memory import MemoryIndex

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


def tag(key: int) -> str:
    """The hash tag of block ``key``'s name in the cluster's layout: base64url of its 8 bytes
    after a zero byte, less the first character."""
    return base64.urlsafe_b64encode(b"\0" + key.to_bytes(8, "big")).decode()[1:]


def assert_cluster_consistent(masters: list) -> None:
    """The invariants of ``kvindex.cluster``, read straight from every master (plain
    ``redis.Redis`` clients), once no write is in flight: block entries and reverse entries are
    the same set, every block starts with its digest's head, no dirty entry or lease is left, the
    tier counts count the reverse sets, and each holder's engine map with the implied links is
    the inverse of its key -> hashes map and points at held keys."""
    blocks: set[tuple[bytes, bytes, bytes]] = set()  # (model, K as 8 bytes, "P@T")
    reverse: set[tuple[bytes, bytes, bytes]] = set()
    counts: dict[tuple[bytes, bytes], dict[bytes, int]] = {}  # (model, P) -> tier -> count
    engine_maps: dict[tuple[bytes, bytes], dict[bytes, bytes]] = {}
    hashes_of: dict[tuple[bytes, bytes], dict[bytes, bytes]] = {}
    leftovers = []
    for server in masters:
        for name in server.scan_iter(match=b"kv.3*", count=1000):
            layout, _, name = name.partition(b":")  # kv.3 or kv.3c (compact): one of them per test
            name = b"kv.3:" + name
            if b":b:{" in name:
                model, _, tag = name[5:-1].partition(b":b:{")
                key = base64.urlsafe_b64decode(b"A" + tag + b"=")[1:]
                value = server.get(layout + name[4:])
                head, entries = value[:24], value[24:]
                assert len(head) == 24 and entries and not entries.startswith(b" ")
                blocks |= {(model, key, entry) for entry in entries.split(b" ")}
                continue
            if not name.startswith(b"kv.3:{") or b"@" not in name:
                continue  # model-wide keys: pods set, epoch marker
            tag, _, kind = name[6:].partition(b"}:")
            model, _, pod = tag.partition(b"@")
            if kind == b"r" and layout == b"kv.3c":  # per tier T: "T:#" -> "m s n", "T:i" -> keys
                buckets = server.hgetall(layout + name[4:])
                for field, value in buckets.items():
                    tier, _, i = field.rpartition(b":")
                    if i == b"#":
                        m, s, n = map(int, value.split())
                        held = [buckets.get(tier + b":%d" % j, b"") for j in range(m + s)]
                        assert sum(map(len, held)) == 8 * n and n <= 32 * (m + s)
                        assert m + s == 1 or n >= 8 * (m + s)
                        assert all(len(blob) % 8 == 0 for blob in held)
                        for blob in held:
                            for at in range(0, len(blob), 8):
                                reverse.add((model, blob[at : at + 8], pod + b"@" + tier))
                    else:
                        m, s, _ = map(int, buckets[tier + b":#"].split())
                        assert int(i) < m + s  # a bucket of its tier's state
            elif kind == b"r":
                for entry in server.smembers(name):
                    reverse.add((model, entry[-8:], pod + b"@" + entry[:-9]))
            elif kind == b"n":
                counts[model, pod] = {t: int(n) for t, n in server.hgetall(layout + name[4:]).items()}
            elif kind == b"e":
                engine_maps[model, pod] = server.hgetall(layout + name[4:])
            elif kind == b"k":
                hashes_of[model, pod] = server.hgetall(layout + name[4:])
            elif kind in (b"d", b"lease"):
                leftovers.append(layout + name[4:])
    assert leftovers == []
    assert blocks == reverse
    by_tier: dict[tuple[bytes, bytes], dict[bytes, int]] = {}
    held: dict[tuple[bytes, bytes], set[bytes]] = {}
    for model, key, entry in reverse:
        pod, _, tier = entry.partition(b"@")
        tiers = by_tier.setdefault((model, pod), {})
        tiers[tier] = tiers.get(tier, 0) + 1
        held.setdefault((model, pod), set()).add(key)
    assert counts == by_tier
    for holder in engine_maps.keys() | hashes_of.keys():
        explicit = engine_maps.get(holder, {})
        assert all(h != k and len(h) == len(k) == 8 for h, k in explicit.items())  # implied: not written
        lists = hashes_of.get(holder, {})
        linked = {}
        for k, hs in lists.items():
            words = {hs[i : i + 8] for i in range(0, len(hs), 8)}
            assert words != {k}  # a key's list that is just itself is implied
            linked |= {h: k for h in words}
        assert {h: k for h, k in linked.items() if h != k} == explicit
        assert set(explicit.values()) | set(lists) <= held.get(holder, set())


def agrees_with_the_memory_index(
    index,
    *,
    steps: int,
    check: Callable[[], None],
    check_every: int,
    filter_by_pod: bool = False,
    scale: int = 1,
) -> None:
    """Run the same random workload of stores, removes and clears on ``index`` and on an in-memory
    index (unbounded for it: nothing is evicted), each answer compared; ``check`` (the backend's
    own invariants) runs every ``check_every`` steps and at the end. Lookups are compared (also
    restricted to the step's pod with ``filter_by_pod``), resolves and pod counts too. ``scale``
    multiplies the blocks and the size of each store and remove (pods of hundreds of blocks)."""
    rng = random.Random(11)
    oracle = MemoryIndex()
    # Two engines that hash differently, reusing engine hashes 77.. for different blocks.
    blocks = chain(12 * scale) + chain(4 * scale, first_token=1000 * scale, engine_hash_offset=77)
    blocks += chain(3 * scale, first_token=2000 * scale, engine_hash_offset=77)
    # Engine hashes that are another block's key: an implied link re-pointed to an explicit one.
    blocks += [
        StoredBlock(key=blocks[i + 3].key, engine_hash=blocks[i].key, digest=blocks[i + 3].digest)
        for i in range(3)
    ]
    models, pods, tiers = ["m1", "m@2"], ["p1", "p:2", "p@3"], ["gpu", "cpu"]
    for step in range(steps):
        model, pod, tier = rng.choice(models), rng.choice(pods), rng.choice(tiers)
        action = rng.random()
        if action < 0.5:
            start = rng.randrange(len(blocks))
            args = {"model": model, "pod": pod, "tier": tier, "blocks": blocks[start : start + 5 * scale]}
            index.store(**args)
            oracle.store(**args)
        elif action < 0.85:
            removed = hashes(rng.sample(blocks, 4 * scale))
            args = {"model": model, "pod": pod, "tier": tier, "engine_hashes": removed}
            assert index.remove(**args) == oracle.remove(**args)
        elif action < 0.95:
            assert index.clear_pod(pod=pod, model=model) == oracle.clear_pod(pod=pod, model=model)
        else:
            assert index.clear_model(model=model) == oracle.clear_model(model=model)
        if step % check_every == 0:
            check()
        for m in models:
            for wanted in (None, {pod}) if filter_by_pod else (None,):
                assert index.lookup(model=m, keys=keys(blocks), pods=wanted) == oracle.lookup(
                    model=m, keys=keys(blocks), pods=wanted
                )
            assert index.resolve(model=m, pod=pod, engine_hashes=hashes(blocks)) == oracle.resolve(
                model=m, pod=pod, engine_hashes=hashes(blocks)
            )
    assert index.pod_blocks() == oracle.pod_blocks() != []
    check()
