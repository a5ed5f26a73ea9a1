"""Specifications of the KV-block index: a suite every backend passes, and one file per backend.

The helpers below build small, real block chains (vLLM ``sha256_cbor``, seed "42", block size 16)
so that keys and digests in these tests are the ones an engine would report.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from scoring.index.base import StoredBlock
from scoring.index.memory import MemoryIndex
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


def assert_cluster_consistent(masters: list) -> None:
    """The invariants of ``scoring.index.cluster``, read straight from every master (plain
    ``redis.Redis`` clients), once no write is in flight: block entries and reverse entries are
    the same set, no dirty entry or lease is left, the tier counts count the reverse sets, and
    each holder's engine map is the inverse of its key -> hashes map and points at held keys."""
    blocks: set[tuple[bytes, bytes, bytes]] = set()  # (model, K, "P@T")
    reverse: set[tuple[bytes, bytes, bytes]] = set()
    counts: dict[tuple[bytes, bytes], dict[bytes, int]] = {}  # (model, P) -> tier -> count
    engine_maps: dict[tuple[bytes, bytes], dict[bytes, bytes]] = {}
    hashes_of: dict[tuple[bytes, bytes], dict[bytes, bytes]] = {}
    leftovers = []
    for server in masters:
        for name in server.scan_iter(match=b"kv.2:*", count=1000):
            if b":b:{" in name:
                model, _, key = name[5:-1].partition(b":b:{")
                blocks |= {(model, key, entry) for entry in server.get(name).split(b" ")}
                continue
            if not name.startswith(b"kv.2:{") or b"@" not in name:
                continue  # model-wide keys: pods set, epoch marker
            tag, _, kind = name[6:].partition(b"}:")
            model, _, pod = tag.partition(b"@")
            if kind == b"r":
                for entry in server.smembers(name):
                    tier, _, key = entry.partition(b" ")
                    reverse.add((model, key, pod + b"@" + tier))
            elif kind == b"n":
                counts[model, pod] = {t: int(n) for t, n in server.hgetall(name).items()}
            elif kind == b"e":
                engine_maps[model, pod] = server.hgetall(name)
            elif kind == b"k":
                hashes_of[model, pod] = server.hgetall(name)
            elif kind in (b"d", b"lease"):
                leftovers.append(name)
    assert leftovers == []
    assert blocks == reverse
    by_tier: dict[tuple[bytes, bytes], dict[bytes, int]] = {}
    for model, _, entry in reverse:
        pod, _, tier = entry.partition(b"@")
        tiers = by_tier.setdefault((model, pod), {})
        tiers[tier] = tiers.get(tier, 0) + 1
    assert counts == by_tier
    assert hashes_of.keys() <= engine_maps.keys()
    for (model, pod), engine in engine_maps.items():
        key_of_hash = {h: b"%016x" % key_of(digest) for h, digest in engine.items()}
        linked = {h: k for k, hs in hashes_of.get((model, pod), {}).items() for h in hs.split(b" ")}
        assert all(h != k for h, k in linked.items())  # a link of a key to itself is implied
        linked |= {h: k for h, k in key_of_hash.items() if h == k}
        assert linked == key_of_hash
        held = {k for m, k, entry in reverse if m == model and entry.partition(b"@")[0] == pod}
        assert set(key_of_hash.values()) <= held


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
