"""The compiled hot path (``kvindex.native``) against the pure-Python code it replaces: SHA-256
against hashlib, the key chain against ``chain_digests_python`` (digests and errors), and the
index's maps against ``PyCore``, answer for answer and map for map, under random operations with
hostile values and under the hostile event stream the decoder survives (``tests/security``)."""

from __future__ import annotations

import hashlib
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.applier import EventApplier
from ingest.events import DecodeError, decode_message
from ingest.stats import IngestStats
from kvindex import MemoryIndex
from kvindex.base import StoredBlock
from kvindex.keys import _encode_extra, chain_digests_python, key_of, keys_of, root_digest
from kvindex.memory import PyCore
from kvindex.native import module as native
from registry.config import ServiceConfig
from tests.security.hostile_events import EventFuzzer

pytestmark = pytest.mark.skipif(native is None, reason="the compiled hot path is not built")

ROOT = root_digest("42")
U64 = (1 << 64) - 1


def test_the_compiled_module_loaded_with_openssls_sha256() -> None:
    """``make install`` builds it, and libcrypto (the library hashlib uses) is found."""
    assert native is not None and native.sha256_backend == "openssl"


@pytest.mark.parametrize("size", [*range(0, 140), 1000, 4096, 65537])
def test_the_portable_sha256_is_hashlibs(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert native.sha256_portable(data) == hashlib.sha256(data).digest()


tokens = st.lists(
    st.one_of(
        st.integers(0, 23),
        st.integers(0, 70_000),
        st.integers(0, 1 << 32),
        st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, U64]),
    ),
    max_size=80,
)
extras = st.sampled_from([None, ("lora-a",), ("a", ("mm", 3)), ("salt",), (("mm", 0), "salt")])
parents = st.one_of(st.just(ROOT), st.binary(min_size=0, max_size=48))


@settings(max_examples=400, deadline=None)
@given(tokens=tokens, block_size=st.sampled_from([1, 2, 3, 16, 23, 24, 32]), parent=parents, extra=extras)
def test_the_compiled_chain_hashes_what_the_python_chain_hashes(tokens, block_size, parent, extra) -> None:
    want = chain_digests_python(tokens, block_size=block_size, parent=parent, extra=extra)
    assert native.chain_digests(tokens, block_size, parent, _encode_extra(extra)) == want
    assert native.chain_digests(tuple(tokens), block_size, parent, _encode_extra(extra)) == want
    assert native.chain_keys(tokens, block_size, parent, _encode_extra(extra)) == keys_of(want)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.integers(0, U64),
            st.integers(max_value=-1),
            st.integers(min_value=U64 + 1),
            st.sampled_from([True, 1.0, "1", None, b"1"]),
        ),
        max_size=12,
    )
)
def test_the_compiled_token_check_finds_the_first_invalid_token_as_python_does(values) -> None:
    import kvindex.keys

    found = native.first_invalid_token(values)
    kvindex_native, kvindex.keys._native = kvindex.keys._native, None
    try:
        want = kvindex.keys.first_invalid_token(values)
    finally:
        kvindex.keys._native = kvindex_native
    assert (None if found < 0 else found) == want


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([1, -1], ValueError),
        ([1 << 64], ValueError),
        ([-(1 << 80)], ValueError),
        (["7"], TypeError),
        ([1.0], TypeError),
        ([None], TypeError),
    ],
)
def test_the_compiled_chain_refuses_what_the_python_chain_refuses(bad: list, error: type) -> None:
    with pytest.raises(error):
        chain_digests_python(bad, block_size=1, parent=ROOT)
    with pytest.raises(error):
        native.chain_digests(bad, 1, ROOT, _encode_extra(None))


def test_the_compiled_chain_refuses_a_block_size_below_one() -> None:
    with pytest.raises(ValueError, match="block_size"):
        native.chain_digests([1, 2], 0, ROOT, _encode_extra(None))


def _blocks(rng: random.Random, chains: list[list[StoredBlock]]) -> list[StoredBlock]:
    """A run of some chain, sometimes with hostile twists: an engine hash re-pointed at another
    digest, an adopted (8-byte) digest, a digest of another length, extreme hashes."""
    chain = rng.choice(chains)
    start = rng.randrange(len(chain))
    run = list(chain[start : start + rng.randrange(1, 8)])
    for i, b in enumerate(run):
        twist = rng.random()
        if twist < 0.05:
            run[i] = StoredBlock(b.key, rng.choice([0, U64, b.engine_hash ^ 1]), b.digest)
        elif twist < 0.10:
            run[i] = StoredBlock(b.engine_hash, b.engine_hash, b.engine_hash.to_bytes(8, "big"))
        elif twist < 0.13:
            digest = rng.randbytes(rng.choice([1, 9, 31]))
            run[i] = StoredBlock(key_of(digest), b.engine_hash, digest)
        elif twist < 0.18:
            other = rng.choice(rng.choice(chains))
            run[i] = StoredBlock(other.key, b.engine_hash, other.digest)  # same hash, other block
    return run


def _chains(rng: random.Random) -> list[list[StoredBlock]]:
    chains = []
    for c in range(6):
        tokens = [rng.randrange(150_000) for _ in range(16 * 12)]
        digests = chain_digests_python(tokens, block_size=16, parent=ROOT)
        hashes = [rng.getrandbits(64) if c % 2 else key_of(d) for d in digests]
        chains.append([StoredBlock(key_of(d), h, d) for d, h in zip(digests, hashes, strict=True)])
    return chains


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_maps_answer_as_the_python_maps_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    chains = _chains(rng)
    max_keys, pod_cache_size = rng.choice([(8, 2), (30, 3), (1000, 128)])
    cores = [PyCore(max_keys, pod_cache_size, None), native.Core(max_keys, pod_cache_size, None)]
    pods, tiers, models = ["p1", "p2", "p3", "p4"], ["gpu", "cpu", "disk"], ["m1", "m2"]
    for _ in range(700):
        model, pod, tier = rng.choice(models), rng.choice(pods), rng.choice(tiers)
        action = rng.random()
        if action < 0.45:
            blocks = _blocks(rng, chains)
            answers = [core.store(model, pod, tier, blocks) for core in cores]
        elif action < 0.65:
            hashes = [b.engine_hash for b in rng.sample(rng.choice(chains), 5)] + [0, U64, -1, 1 << 70]
            answers = [core.remove(model, pod, tier, hashes) for core in cores]
        elif action < 0.75:
            keys = [*[b.key for b in rng.choice(chains)][: rng.randrange(13)], -5]
            wanted = rng.choice([None, frozenset({"p1", "p2"}), frozenset()])
            answers = [core.lookup(model, keys, wanted) for core in cores]
        elif action < 0.8:
            keys = [b.key for b in rng.choice(chains)] + [1 << 70]
            answers = [core.holders(model, keys) for core in cores]
        elif action < 0.87:
            hashes = [b.engine_hash for b in rng.choice(chains)] + [-1, 1 << 64]
            answers = [core.resolve(model, pod, hashes) for core in cores]
        elif action < 0.95:
            # A whole pod: which entries a partial slice takes first is each map's own order
            # (test_memory holds partial slices to the invariants, with both cores).
            answers = [core.clear_pod_slice(model, pod, 1 << 30) for core in cores]
        else:
            answers = [
                (sorted(core.models_held()), sorted(core.pods_of(model)), sorted(core.pod_blocks(model)))
                for core in cores
            ]
        assert answers[0] == answers[1]
        assert len(cores[0]) == len(cores[1])
    assert cores[0].state() == cores[1].state()


def test_a_pod_holds_at_most_64_tiers_in_the_compiled_maps() -> None:
    """Tiers are an engine's own strings: the compiled maps keep 64 per pod and count the blocks
    of a 65th as refused, instead of growing."""
    chain = _chains(random.Random(1))[0]
    core = native.Core(1000, 128, None)
    for t in range(64):
        core.store("m", "p", f"tier-{t}", chain[:1])
    core.store("m", "p", "one-too-many", chain[:3])

    assert core.refused_tiers == 3
    assert core.pod_blocks("m") == [("p", {f"tier-{t}": 1 for t in range(64)})]
    core.store("m", "other-pod", "one-too-many", chain[:3])
    assert dict(core.pod_blocks("m"))["other-pod"] == {"one-too-many": 3}


def _fuzzed_index(native_core: bool, monkeypatch: pytest.MonkeyPatch, messages: int) -> MemoryIndex:
    import kvindex.keys

    with monkeypatch.context() as patch:
        if not native_core:
            patch.setattr(kvindex.keys, "_native", None)
        index = MemoryIndex(native=native_core, max_keys=20_000, pod_cache_size=8)
        config = ServiceConfig(seed="42", default_block_size=16)
        applier = EventApplier(index, config=lambda: config, stats=IngestStats())
        for frames in itertools.islice(EventFuzzer(seed=26).messages(), messages):
            try:
                message = decode_message(frames)
            except DecodeError:
                continue
            applier.apply(pod=message.pod, model=message.model, seq=message.seq, batch=message.batch)
    return index


def test_the_hostile_event_stream_leaves_both_indexes_in_the_same_state(monkeypatch) -> None:
    """The fuzzed messages of tests/security (every field, type and size mutated, bit flips, cut
    frames) through the decoder and the applier into the compiled and the Python index: neither
    fails, and they end holding exactly the same entries."""
    compiled = _fuzzed_index(True, monkeypatch, 6000)
    python = _fuzzed_index(False, monkeypatch, 6000)

    assert len(compiled) > 1000
    assert compiled._core.state() == python._core.state()
    assert compiled.pod_blocks() == python.pod_blocks()
