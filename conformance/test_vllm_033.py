"""vLLM 0.33's own prefix cache against our scores, per request and pod.

Each scenario runs three pods of its own model: vLLM ``KVCacheManager``s serving requests and
publishing what they cache through vLLM's ``ZmqEventPublisher`` into our running ``ingest``. At
each step, for every request of the scenario and every pod, the leading blocks vLLM's cache holds
(its own lookup) must equal the blocks our ``/api/v1/score`` matches for that pod. A scenario checks
everything first and asserts once, so its failure lists every (request, pod) that differs.
"""

from __future__ import annotations

import pytest

from conformance.engines import TextPrompts
from conformance.fleet import Fleet
from conformance.spec import BLOCK_SIZE, Image, Prompt

SYSTEM = (
    "You are the dispatch assistant of a regional freight company. Answer in short, plain sentences. "
    "Quote shipment numbers exactly as given, never guess a delivery date, and say so when the manifest "
    "does not contain the answer. The manifest lists, per shipment, its origin depot, its destination, "
    "the declared weight in kilograms, the pallet count and the promised delivery window. "
)
QUESTIONS = (
    "Which shipments leave the Rotterdam depot on Tuesday?",
    "How many pallets does shipment 4471-B carry, and is it over the weight limit?",
    "List every shipment bound for Lyon with a delivery window before Friday noon.",
    "Summarise the manifest in three sentences for the night shift.",
)
ANSWER = (
    " Shipments 4471-B, 4480-A and 4492-C leave Rotterdam on Tuesday morning; 4480-A is the only one "
    "with a delivery window that closes the same day, so it goes first."
)


def tokens(start: int, count: int) -> tuple[int, ...]:
    """``count`` distinct token ids from ``start``: a synthetic prompt no other one shares."""
    return tuple(range(start, start + count))


def agrees(fleet: Fleet) -> None:
    """Fail with every (request, pod) that differed, each with vLLM's blocks and ours."""
    if fleet.differences():
        pytest.fail(fleet.report(), pytrace=False)


def test_plain_prompts(fleet, qwen3: TextPrompts):
    """Text prompts sharing a system prompt, a decoded answer cached and followed up, three pods."""
    pods = fleet("plain")
    asks = [qwen3.prompt(f"question {i}", SYSTEM + question) for i, question in enumerate(QUESTIONS)]
    follow_up = qwen3.prompt(
        "follow-up of question 0", SYSTEM + QUESTIONS[0] + ANSWER + " Which is heaviest?"
    )
    everything = [*asks, follow_up]
    pods.check("nothing served", everything)
    pods.serve(0, asks[0], generated=qwen3.encode(ANSWER))
    pods.serve(1, asks[1])
    pods.serve(2, asks[2])
    pods.check("one question per pod", everything)
    pods.serve(0, asks[1])
    pods.serve(2, follow_up)
    pods.check("pod 0 served question 1 too, pod 2 the follow-up", everything)
    agrees(pods)


def test_lora(fleet, qwen3: TextPrompts):
    """The same prompt through the base model and two adapters: three different chains."""
    pods = fleet("lora")
    text = SYSTEM + QUESTIONS[3]
    base, alice, bob = (
        qwen3.prompt(f"{name or 'base'}", text, lora_name=name) for name in (None, "Alice", "Bob")
    )
    alice_longer = qwen3.prompt("Alice, longer", text + ANSWER, lora_name="Alice")
    pods.serve(0, alice)
    pods.serve(1, base)
    pods.serve(2, bob)
    pods.check("one adapter per pod", [base, alice, bob, alice_longer])
    pods.serve(1, alice_longer)
    pods.check("pod 1 served Alice too", [base, alice, bob, alice_longer])
    agrees(pods)


def test_eviction(fleet):
    """A pool of 12 blocks: later requests evict earlier ones' blocks (``BlockRemoved``)."""
    pods = fleet("eviction", num_blocks=1 + 12)  # block 0 is vLLM's null block
    a = Prompt("A", tokens(1000, 5 * BLOCK_SIZE + 3))
    b = Prompt("B (2 blocks of A)", a.token_ids[: 2 * BLOCK_SIZE] + tokens(2000, 3 * BLOCK_SIZE + 3))
    c = Prompt("C", tokens(3000, 5 * BLOCK_SIZE + 3))
    d = Prompt("D", tokens(4000, 5 * BLOCK_SIZE + 3))
    everything = [a, b, c, d]
    pods.serve(1, a)
    for step, prompt in enumerate(everything):
        pods.serve(0, prompt)
        pods.check(f"pod 0 served {prompt.label} (request {step + 1})", everything)
    assert pods[0].published["BlockRemoved"], "the scenario must evict"
    agrees(pods)


def test_prefix_cache_reset(fleet):
    """``reset_prefix_cache`` on one pod (``AllBlocksCleared``), then it caches again."""
    pods = fleet("reset")
    a = Prompt("A", tokens(1000, 6 * BLOCK_SIZE + 5))
    b = Prompt("B", tokens(2000, 4 * BLOCK_SIZE + 1))
    pods.serve(0, a)
    pods.serve(0, b)
    pods.serve(1, a)
    pods.check("before the reset", [a, b])
    pods[0].reset_prefix_cache()
    pods.sync()
    pods.check("pod 0 reset", [a, b])
    pods.serve(0, b)
    pods.check("pod 0 served B again", [a, b])
    assert pods[0].published["AllBlocksCleared"] == 1
    agrees(pods)


def test_report_mode_full(fleet):
    """``kv_cache_report_mode="full"`` re-announces prefix hits from block 0 (no parent); evicting
    them afterwards must leave nothing behind (no double count)."""
    pods = fleet("report-full", num_blocks=1 + 12)
    a = Prompt("A", tokens(1000, 4 * BLOCK_SIZE + 2))
    a_more = a.extended("A + 2 blocks", tokens(1500, 2 * BLOCK_SIZE + 2))
    c = Prompt("C", tokens(3000, 5 * BLOCK_SIZE + 3))
    d = Prompt("D", tokens(4000, 5 * BLOCK_SIZE + 3))
    everything = [a, a_more, c, d]
    pods.serve(0, a)
    pods.serve(0, a_more, report_mode="full")  # re-announces A's 4 blocks, stores 2 more
    pods.serve(1, a, report_mode="full")  # no hit: nothing to re-announce
    pods.serve(0, a, report_mode="full")  # a pure re-announcement
    pods.check("A re-announced twice on pod 0", everything)
    pods.serve(0, c)
    pods.serve(0, d)
    pods.check("pod 0 evicted A for C and D", everything)
    assert pods[0].published["BlockRemoved"], "the scenario must evict the re-announced blocks"
    agrees(pods)


def test_cache_salt(fleet, qwen3: TextPrompts):
    """``cache_salt`` (block 0's extra key): salted chains meet only the same salt."""
    pods = fleet("salt")
    text = SYSTEM + QUESTIONS[2]
    plain = qwen3.prompt("no salt", text)
    tenant_a = qwen3.prompt("salt tenant-a", text, cache_salt="tenant-a")
    tenant_b = qwen3.prompt("salt tenant-b", text, cache_salt="tenant-b")
    tenant_a_longer = qwen3.prompt("salt tenant-a, longer", text + ANSWER, cache_salt="tenant-a")
    everything = [plain, tenant_a, tenant_b, tenant_a_longer]
    pods.serve(0, tenant_a)
    pods.serve(1, plain)
    pods.serve(2, tenant_b)
    pods.check("one salt per pod", everything)
    agrees(pods)


IMAGE_TOKEN = 151655  # Qwen-VL's <|image_pad|>: an image's placeholder tokens all carry it


def test_image(fleet):
    """An image's placeholder tokens: vLLM keys the blocks they touch with (identifier, offset)."""
    pods = fleet("image")
    before, after = tokens(1000, 10), tokens(2000, 30)
    placeholders = (IMAGE_TOKEN,) * 64
    ids = before + placeholders + after  # 104 tokens: blocks 0-4 hold image tokens, 5 does not

    def with_images(label: str, *images: Image, token_ids: tuple[int, ...] = ids) -> Prompt:
        return Prompt(label, token_ids, images=images)

    cat = with_images("cat at 10", Image("sha256:cat", offset=10, length=64))
    dog = with_images("dog at 10", Image("sha256:dog", offset=10, length=64))
    no_image = with_images("same tokens, no image")
    shifted = with_images(
        "cat at 12",
        Image("sha256:cat", offset=12, length=64),
        token_ids=tokens(1000, 12) + placeholders + after,
    )
    everything = [cat, dog, no_image, shifted]
    pods.serve(0, cat)
    pods.serve(1, dog)
    pods.serve(2, no_image)
    pods.check("one image per pod", everything)
    agrees(pods)


def test_lookahead(fleet):
    """``num_hash_lookahead_tokens=2``: a block hits only when the 2 tokens after it match too."""
    pods = fleet("lookahead")
    a = Prompt("A", tokens(1000, 4 * BLOCK_SIZE + 6))
    other_next = Prompt("A's 4 blocks, other next tokens", (*a.token_ids[: 4 * BLOCK_SIZE], 7, 8, 9))
    exact = Prompt("A's 4 blocks exactly", a.token_ids[: 4 * BLOCK_SIZE])
    one_more = Prompt("A's 4 blocks + 1 token", a.token_ids[: 4 * BLOCK_SIZE + 1])
    everything = [a, other_next, exact, one_more]
    pods.serve(0, a)
    pods.serve(1, other_next)
    pods.check("A on pod 0, its blocks with other next tokens on pod 1", everything)
    assert pods[0].manager.block_pool.num_hash_lookahead_tokens == 2
    agrees(pods)


def test_hybrid_sliding_window(fleet):
    """A hybrid model: full attention + a 32-token sliding window, one block pool. Evicting the
    window's early blocks (freed while decoding) shortens vLLM's hit for prompts that end there."""
    pods = fleet("hybrid", num_blocks=1 + 30)
    a = Prompt("A (10 blocks)", tokens(1000, 10 * BLOCK_SIZE))
    tail = tokens(9000, 5)
    prefixes = [a] + [
        Prompt(f"A's first {n} blocks + other tokens", a.token_ids[: n * BLOCK_SIZE] + tail)
        for n in (2, 4, 6, 9)
    ]
    b = Prompt("B", tokens(5000, 6 * BLOCK_SIZE + 4))
    pods.serve(0, a, generated=tokens(7000, 20))
    pods.serve(1, a)
    pods.check("A on pods 0 and 1", [*prefixes, b])
    pods.serve(0, b)
    pods.check("pod 0 served B, evicting window blocks of A", [*prefixes, b])
    assert pods[0].published["BlockRemoved"], "the scenario must evict"
    cut = [p.label for p in prefixes if pods[0].cached_blocks(p) < pods[0].full_attention_blocks(p)]
    assert cut, "the scenario must have the window cut a hit that full attention alone would give"
    agrees(pods)
