"""Keying what vLLM 0.33 and SGLang really send (ingest/applier.py): extra keys as events carry
them, lookahead hashing, report-mode-full re-announcements, the default seed, and SGLang's pages
re-chunked to the model's block size. Every test runs on each index backend.

A block is held by a pod when the index has the key a request computes for it
(``kvindex.keys.block_keys``): the tests ask the index with those keys.
"""

from __future__ import annotations

import hashlib
import time

import cbor2
import pytest

from ingest.applier import EventApplier
from ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_message,
)
from ingest.events import encode_batch as encode
from ingest.stats import IngestStats
from kvindex import KVIndex
from kvindex.keys import DEFAULT_SEED, MultimodalFeature, block_keys, key_of, root_digest
from registry.config import ServiceConfig
from tests.ingest.captures import VLLM_033_MODEL, vllm_033_messages
from tests.ingest.conftest import MODEL, Harness

SEED = "42"
BLOCK = 16
PROMPT = tuple(range(5000, 5200))  # 200 tokens: 12 full blocks of 16 and 8 left over


class Engine:
    """An applier fed one pod's batches, as ingest's worker feeds it."""

    def __init__(self, index: KVIndex, *, pod: str = "pod-a", config: ServiceConfig | None = None) -> None:
        self.index = index
        self.pod = pod
        self.stats = IngestStats()
        config = config or ServiceConfig(seed=SEED, default_block_size=BLOCK)
        self.applier = EventApplier(index, config=lambda: config, stats=self.stats)
        self.seq = 0

    def send(self, *events, schema: str = "latest", layout: str = "map") -> None:
        """Publish ``events`` as bytes in ``schema`` and apply what ingest decodes of them."""
        payload = encode(list(events), ts=time.time(), schema=schema, layout=layout)
        self.send_payload(payload)

    def send_payload(self, payload: bytes, *, model: str = MODEL) -> None:
        batch = decode_batch(payload)
        assert batch.errors == ()
        self.applier.apply(pod=self.pod, model=model, seq=self.seq, batch=batch)
        self.seq += 1

    @property
    def stream(self):
        return next(s for s in self.stats.streams() if s.pod == self.pod)

    def held(self, keys: list[int], *, model: str = MODEL) -> int:
        """How many leading ``keys`` the index says this pod holds."""
        return len(self.index.lookup(model=model, keys=keys, pods=[self.pod]))

    def total(self, *, model: str = MODEL) -> int:
        return sum(p.total for p in self.index.pod_blocks(model=model) if p.pod == self.pod)


def vllm_hashes(tokens, *, seed: str = SEED, extras=None) -> tuple[int, ...]:
    """Engine hashes of a vLLM ``sha256_cbor`` engine, computed the obvious way with cbor2;
    ``extras`` as that engine hashes them (tagged from 0.33)."""
    n = len(tokens) // BLOCK if extras is None else len(extras)
    parent, out = root_digest(seed), []
    for i in range(n):
        extra = None if extras is None else extras[i]
        parent = hashlib.sha256(
            cbor2.dumps([parent, list(tokens[i * BLOCK : (i + 1) * BLOCK]), extra], canonical=True)
        ).digest()
        out.append(key_of(parent))
    return tuple(out)


def store(tokens, hashes, *, parent=None, first=0, **fields) -> BlockStored:
    """Blocks ``first..`` of ``tokens`` with their engine hashes, as one vLLM BlockStored."""
    n = len(hashes)
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens[first * BLOCK : (first + n) * BLOCK]),
        block_size=BLOCK,
        **fields,
    )


@pytest.fixture
def engine(index) -> Engine:
    return Engine(index)


# --- vLLM 0.33: the real capture -----------------------------------------------------------------


def apply_capture(index: KVIndex) -> dict[str, Engine]:
    engines = {pod: Engine(index, pod=pod) for pod in ("pod-b", "pod-c")}
    for message in vllm_033_messages():
        decoded = decode_message(message.frames)
        assert decoded.batch.errors == ()
        engine = engines[decoded.pod]
        engine.applier.apply(pod=decoded.pod, model=decoded.model, seq=decoded.seq, batch=decoded.batch)
    return engines


def captured(pod: str) -> list[BlockStored]:
    message = next(m for m in vllm_033_messages() if m.pod == pod and m.seq == 0)
    return [e for e in decode_message(message.frames).batch.events if isinstance(e, BlockStored)]


def test_the_vllm_033_capture_is_keyed_as_requests_with_its_salt_and_lora_key_it(index):
    plain_1, plain_2, salted = captured("pod-b")
    engines = apply_capture(index)
    pod_b = engines["pod-b"]
    keys_of = {
        "plain_1": block_keys(plain_1.token_ids, seed=SEED),
        "plain_2": block_keys(plain_2.token_ids, seed=SEED),
        "salted": block_keys(salted.token_ids, seed=SEED, cache_salt="tenant-42"),
    }
    assert keys_of["plain_1"] == list(plain_1.block_hashes)  # plain blocks: engine hash == key
    held = {name: pod_b.held(keys, model=VLLM_033_MODEL) for name, keys in keys_of.items()}
    assert held == {"plain_1": 4, "plain_2": 5, "salted": 4}
    # The salted request repeats plain_2's first 48 tokens: the salt keeps its blocks apart.
    assert salted.token_ids[:48] == plain_2.token_ids[:48]
    assert not set(keys_of["salted"]) & set(keys_of["plain_2"])
    # The salted blocks' engine hashes are tagged: not judged, so the pod stays fully aligned.
    assert (pod_b.stream.aligned_blocks, pod_b.stream.misaligned_blocks) == (9, 0)
    assert pod_b.stream.blocks_stored == 13


def test_the_vllm_033_lora_blocks_are_keyed_by_the_bare_name_and_not_judged(index):
    lora = captured("pod-c")[0]
    assert lora.extra_keys == (("Alice",),) * 4
    pod_c = Engine(index, pod="pod-c")
    message = next(m for m in vllm_033_messages() if m.pod == "pod-c" and m.seq == 0)
    decoded = decode_message(message.frames)
    pod_c.applier.apply(pod="pod-c", model=decoded.model, seq=0, batch=decoded.batch)
    keys = block_keys(lora.token_ids, seed=SEED, lora_name="Alice")
    assert pod_c.held(keys, model=VLLM_033_MODEL) == 4
    assert (pod_c.stream.aligned_blocks, pod_c.stream.misaligned_blocks) == (12, 0)


def test_the_vllm_033_clear_drops_that_pod_only(index):
    engines = apply_capture(index)
    assert engines["pod-c"].total(model=VLLM_033_MODEL) == 0
    assert engines["pod-b"].total(model=VLLM_033_MODEL) == 13


# --- extra keys: salt, images, alignment ---------------------------------------------------------


def test_a_chain_continued_after_a_salted_block_stays_salted_and_unjudged(engine):
    salted = vllm_hashes(PROMPT[:64], extras=[[["cache_salt", "s"]], None, None, None])
    engine.send(store(PROMPT, salted[:2], extra_keys=(("s",), None)))
    engine.send(store(PROMPT, salted[2:], parent=salted[1], first=2, extra_keys=(None, None)))
    assert engine.held(block_keys(PROMPT[:64], seed=SEED, cache_salt="s")) == 4
    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks, engine.stream.orphaned_blocks) == (
        0,
        0,
        0,
    )


def test_a_foreign_seed_is_still_judged_misaligned_on_plain_blocks(engine):
    foreign = vllm_hashes(PROMPT, seed="other")
    engine.send(store(PROMPT, foreign[:3]))
    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks) == (0, 3)
    assert engine.held(block_keys(PROMPT, seed=SEED)) == 3


def test_image_blocks_are_keyed_as_a_request_with_that_image(engine):
    image = MultimodalFeature("img-hash", offset=10, length=30)  # blocks 0, 1 and 2
    wire = ((("img-hash", 10),), (("img-hash", -6),), (("img-hash", -22),), None, None)
    tagged = [[["mm", "img-hash", 10]], [["mm", "img-hash", -6]], [["mm", "img-hash", -22]], None, None]
    engine.send(store(PROMPT, vllm_hashes(PROMPT, extras=tagged), extra_keys=wire))
    assert engine.held(block_keys(PROMPT[:80], seed=SEED, mm_features=[image])) == 5
    assert engine.held(block_keys(PROMPT[:80], seed=SEED)) == 0
    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks) == (0, 0)


def test_an_aligned_pod_adopts_engine_hashes_only_up_to_its_first_block_with_extras(engine):
    hashes = vllm_hashes(PROMPT)
    engine.send(store(PROMPT, hashes[:2]))  # proves alignment
    lost_parent = hashes[5]
    engine.send(store(PROMPT, hashes[6:9], parent=lost_parent, first=6, extra_keys=(None, ("x",), None)))
    assert engine.held(list(hashes[6:7])) == 1
    assert engine.stream.orphaned_blocks == 2


# --- lookahead hashing ---------------------------------------------------------------------------


def lookahead_store(tokens, n, lookahead, *, seed=SEED, lora=None):
    """n blocks of a vLLM engine with ``num_hash_lookahead_tokens=lookahead``: each hashed with
    ``(E, *next tokens)``, the next tokens sent in ``lookahead_token_ids``."""
    after = [tuple(tokens[(i + 1) * BLOCK : (i + 1) * BLOCK + lookahead]) for i in range(n)]
    tagged = None if lora is None else [["lora", lora, "/adapters/" + lora]]
    hashes = vllm_hashes(tokens, seed=seed, extras=[[tagged, *a] for a in after])
    extra_keys = None if lora is None else ((lora,),) * n
    return store(tokens, hashes, lookahead_token_ids=tuple(after), extra_keys=extra_keys, lora_name=lora)


def test_lookahead_blocks_are_held_only_for_prompts_with_the_same_next_tokens(engine):
    engine.send(lookahead_store(PROMPT, 3, 2))
    assert engine.held(block_keys(PROMPT[:50], seed=SEED, lookahead_tokens=2)) == 3
    other_next = (*PROMPT[:48], 1, 2)
    assert engine.held(block_keys(other_next, seed=SEED, lookahead_tokens=2)) == 2
    assert engine.held(block_keys(PROMPT[:50], seed=SEED)) == 0  # keyed without lookahead: other keys
    # Without extras vLLM hashes (None, *tokens), exactly our key: the pod is aligned.
    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks) == (3, 0)


def test_lookahead_with_a_lora_is_keyed_and_not_judged(engine):
    engine.send(lookahead_store(PROMPT, 3, 1, lora="Alice"))
    assert engine.held(block_keys(PROMPT[:49], seed=SEED, lora_name="Alice", lookahead_tokens=1)) == 3
    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks) == (0, 0)


# --- kv_cache_report_mode="full" -----------------------------------------------------------------


def test_report_mode_full_re_announcements_count_once(engine):
    hashes = vllm_hashes(PROMPT)
    keys = block_keys(PROMPT, seed=SEED)
    engine.send(store(PROMPT, hashes[:6]))
    engine.send(store(PROMPT, hashes[:4]))  # a prefix hit of 4 blocks, re-announced from block 0
    engine.send(store(PROMPT, hashes[6:8], parent=hashes[5], first=6))
    engine.send(store(PROMPT, hashes[:8]))
    stream = engine.stream
    assert engine.total() == 8
    assert engine.held(keys) == 8
    assert (stream.blocks_stored, stream.aligned_blocks, stream.misaligned_blocks) == (8, 8, 0)
    assert stream.orphaned_blocks == 0

    engine.send(BlockRemoved(block_hashes=(hashes[2],)))
    assert engine.held(keys) == 2
    engine.send(store(PROMPT, hashes[:3]))  # re-announced after its eviction: stored again
    assert (engine.held(keys), engine.total(), stream.blocks_stored) == (8, 8, 9)


def test_a_block_stored_on_another_tier_is_counted_there_but_judged_once(engine):
    hashes = vllm_hashes(PROMPT)
    engine.send(store(PROMPT, hashes[:2]))
    engine.send(store(PROMPT, hashes[:2], tier="cpu"))
    assert engine.index.pod_blocks(model=MODEL)[0].blocks_by_tier == {"gpu": 2, "cpu": 2}
    assert (engine.stream.blocks_stored, engine.stream.aligned_blocks) == (4, 2)
    engine.send(BlockRemoved(block_hashes=(hashes[1],), tier="cpu"))
    engine.send(store(PROMPT, hashes[2:3], parent=hashes[1], first=2))  # gpu still holds the parent
    assert engine.held(block_keys(PROMPT, seed=SEED)) == 3 and engine.stream.orphaned_blocks == 0


def test_report_mode_full_through_the_pipeline_needs_no_gap_handling(index):
    harness = Harness(index, ServiceConfig(seed=SEED, default_block_size=BLOCK))
    try:
        hashes = vllm_hashes(PROMPT)
        pub = harness.publisher("pod-a")
        stream = harness.stream("pod-a")
        before = (stream.seq_gaps, stream.restarts, stream.lost_state_clears)
        for first, last, parent in [(0, 6, None), (0, 4, None), (6, 8, hashes[5]), (0, 8, None)]:
            pub.send([store(PROMPT, hashes[first:last], parent=parent, first=first)], layout="map")
        harness.sync("pod-a")
        assert (stream.seq_gaps, stream.restarts, stream.lost_state_clears) == before
        assert (stream.blocks_stored, stream.orphaned_blocks, stream.resyncing) == (8, 0, False)
        assert len(index.lookup(model=MODEL, keys=block_keys(PROMPT, seed=SEED), pods=["pod-a"])) == 8
    finally:
        harness.close()


# --- the default seed ----------------------------------------------------------------------------


def test_an_engine_without_pythonhashseed_is_aligned_with_the_default_config(index):
    engine = Engine(index, config=ServiceConfig(default_block_size=BLOCK))
    engine.send(store(PROMPT, vllm_hashes(PROMPT, seed=DEFAULT_SEED)))
    assert (engine.stream.aligned_blocks, engine.stream.misaligned_blocks) == (12, 0)
    assert engine.held(block_keys(PROMPT, seed=DEFAULT_SEED)) == 12


# --- SGLang: pages of any size, re-chunked to the model's blocks ---------------------------------


class SGLangRadix:
    """The events of SGLang's radix cache (``mem_cache/radix_cache.py``): one BlockStored per page
    of a new node, its parent the page before it (the parent node's last page; none under the
    root), hashes SHA-256 over the page's tokens chained from the page before, as signed int64."""

    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.hex: dict[int, str] = {}  # event hash -> its page's hex digest

    def insert(
        self, tokens, *, shared: int = 0, parent: int | None = None
    ) -> tuple[list[BlockStored], list[int]]:
        """The events of a node holding ``tokens[shared:]`` (page-aligned, as SGLang caches it)
        under the node ending at token ``shared`` (whose last page hash is ``parent``)."""
        events, hashes = [], []
        end = len(tokens) // self.page * self.page
        prior = None if parent is None else self.hex[parent]
        for start in range(shared, end, self.page):
            page = tokens[start : start + self.page]
            h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
            for t in page:
                h.update(t.to_bytes(4, "little"))
            prior = h.hexdigest()
            value = int(prior[:16], 16)
            value = value - 2**64 if value >= 2**63 else value
            self.hex[value & (2**64 - 1)] = prior
            events.append(
                BlockStored(
                    block_hashes=(value & (2**64 - 1),),
                    parent_block_hash=parent,
                    token_ids=tuple(page),
                    block_size=len(page),
                )
            )
            parent = value & (2**64 - 1)
            hashes.append(parent)
        return events, hashes


def send_sglang(engine: Engine, events: list[BlockStored]) -> None:
    """As SGLang's publisher sends them: ``[ts, events]`` of 6-element arrays, signed hashes."""
    for event in events:
        assert event.block_hashes[0] < 2**64
    payload = encode(events, ts=time.time(), schema="oldest", layout="array")
    engine.send_payload(payload)


@pytest.mark.parametrize("page_size", [1, 4, 16, 32, 64, 24])
def test_sglang_pages_are_keyed_as_the_models_blocks_over_the_same_tokens(engine, page_size):
    events, _ = SGLangRadix(page_size).insert(PROMPT)
    send_sglang(engine, events)
    cached = len(PROMPT) // page_size * page_size  # SGLang caches whole pages only
    keys = block_keys(PROMPT[:cached], seed=SEED)
    assert len(keys) == cached // BLOCK  # the partial trailing block is left out
    assert engine.held(block_keys(PROMPT, seed=SEED)) == len(keys)
    assert engine.total() == len(keys)
    assert engine.stream.orphaned_blocks == 0
    # SGLang's hashes are never ours: judged misaligned when its pages are the model's blocks,
    # not judged at all when they are re-chunked (hashes of other blocks cannot be compared).
    assert engine.stream.hash_alignment == (0.0 if page_size == BLOCK else None)


@pytest.mark.parametrize("page_size", [1, 8, 64])
def test_a_branch_off_an_sglang_node_continues_from_the_page_it_shares(engine, page_size):
    radix = SGLangRadix(page_size)
    first, hashes = radix.insert(PROMPT)
    shared = 40 if page_size < 64 else 64  # the radix tree splits the node at a page boundary
    second_prompt = (*PROMPT[:shared], *range(9000, 9100))
    second, _ = radix.insert(second_prompt, shared=shared, parent=hashes[shared // page_size - 1])
    send_sglang(engine, first)
    send_sglang(engine, second)
    cached = len(second_prompt) // page_size * page_size
    assert engine.held(block_keys(second_prompt, seed=SEED)) == cached // BLOCK
    assert engine.stream.orphaned_blocks == 0


@pytest.mark.parametrize("page_size", [1, 8, 64])
def test_evicting_an_sglang_leaf_removes_the_model_blocks_it_completed(engine, page_size):
    radix = SGLangRadix(page_size)
    shared = 64
    first, hashes = radix.insert(PROMPT[:128])
    second_prompt = (*PROMPT[:shared], *range(9000, 9064))
    second, leaf_hashes = radix.insert(second_prompt, shared=shared, parent=hashes[shared // page_size - 1])
    send_sglang(engine, first + second)
    assert engine.total() == 12
    send_sglang_removed(engine, leaf_hashes)
    assert engine.held(block_keys(second_prompt, seed=SEED)) == shared // BLOCK
    assert engine.held(block_keys(PROMPT[:128], seed=SEED)) == 8
    assert engine.total() == 8


def send_sglang_removed(engine: Engine, hashes: list[int]) -> None:
    removed = [BlockRemoved(block_hashes=(h,)) for h in hashes]  # one event per page, as SGLang does
    engine.send_payload(encode(removed, ts=time.time(), schema="oldest", layout="array"))


def test_sglang_clear_drops_everything_and_chains_start_again(engine):
    radix = SGLangRadix(1)
    events, _ = radix.insert(PROMPT[:40])
    send_sglang(engine, events)
    engine.send_payload(encode([AllBlocksCleared()], ts=time.time(), schema="oldest"))
    assert engine.total() == 0
    send_sglang(engine, SGLangRadix(1).insert(PROMPT[:40])[0])
    assert engine.held(block_keys(PROMPT[:40], seed=SEED)) == 2


def test_a_page_whose_parent_was_never_seen_is_orphaned_not_rechained(engine):
    events, _ = SGLangRadix(1).insert(PROMPT[:40])
    send_sglang(engine, events[20:])
    assert engine.total() == 0
    assert engine.stream.orphaned_blocks == 20


def test_blocks_of_another_size_with_a_salt_cannot_be_cut_and_are_counted(engine):
    event = BlockStored(
        block_hashes=(1, 2),
        parent_block_hash=None,
        token_ids=PROMPT[:64],
        block_size=32,
        extra_keys=(("salt",), None),
    )
    engine.send(event)
    assert engine.total() == 0
    assert engine.stream.decode_errors["rechunk_extras"] == 1
    assert engine.stream.orphaned_blocks == 2


def test_a_vllm_engine_with_larger_blocks_is_re_chunked_and_removed_whole(engine):
    """A 32-token-block engine under a 16-token model config: keys at 16, removal per 32."""
    hashes = vllm_hashes(PROMPT)  # any distinct values do as engine hashes
    event = BlockStored(
        block_hashes=hashes[:3], parent_block_hash=None, token_ids=PROMPT[:96], block_size=32, lora_name="A"
    )
    engine.send(event)
    keys = block_keys(PROMPT, seed=SEED, lora_name="A")
    assert engine.held(keys) == 6
    engine.send(BlockRemoved(block_hashes=(hashes[1],)))
    assert engine.held(keys) == 2 and engine.total() == 4


def test_sglang_bytes_decode_as_its_events(engine):
    """The exact bytes msgspec 0.22 writes for SGLang's structs (``array_like``, which never omits
    a field; ``[ts, events]``; signed int64 hashes; ``medium`` as later SGLang appends it)."""
    payload = bytes.fromhex(
        "92cb3ff8000000000000"  # [1.5,
        "92"  # [
        "97ab426c6f636b53746f72656491fbc0910701c0c0"  # ["BlockStored", [-5], nil, [7], 1, nil, nil]
        "93ac426c6f636b52656d6f76656491fba3475055"  # ["BlockRemoved", [-5], "GPU"]]]
    )
    minus_5 = 2**64 - 5
    assert decode_batch(payload) == EventBatch(
        1.5,
        (
            BlockStored(block_hashes=(minus_5,), parent_block_hash=None, token_ids=(7,), block_size=1),
            BlockRemoved(block_hashes=(minus_5,)),
        ),
    )


def test_past_its_budget_a_worker_forgets_the_engines_heard_from_least_recently(index):
    """What a worker keeps of its engines' blocks is bounded over all of them: past the budget the
    least recent engines' parents go, and a block chained from one of them later is keyed from the
    index instead (the same key)."""
    engines = {pod: Engine(index, pod=pod) for pod in ("pod-a", "pod-b", "pod-c")}
    applier = engines["pod-a"].applier
    for engine in engines.values():
        engine.applier = applier  # one worker for the three pods
    hashes = vllm_hashes(PROMPT)
    for engine in engines.values():
        engine.send(store(PROMPT[: 6 * BLOCK], hashes[:6]))
    applier.cache_budget = 12  # two engines' six parents and states, not three
    assert applier.keep_budget() >= 1
    engines["pod-a"].send(store(PROMPT[6 * BLOCK : 12 * BLOCK], hashes[6:12], parent=hashes[5]))

    assert engines["pod-a"].held(block_keys(PROMPT, seed=SEED)) == 12  # chained through the index
    assert engines["pod-a"].stream.orphaned_blocks == 0
