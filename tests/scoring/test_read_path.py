"""What a request gets through the read path's caches (prefix store, chain memo) is what it would
get without them: the same token ids and block keys, for conversations that share a long prefix
and then diverge anywhere, and for salted, multimodal and lookahead requests over a prompt the
caches hold plain, with the real Qwen3 tokenizer and chat template. What cannot be keyed is an
``InvalidInput`` naming the field."""

from __future__ import annotations

import argparse
import inspect
import random

import pytest

from kvindex.keys import MultimodalFeature, block_keys, memo_pays
from registry.config import ModelSettings, ServiceConfig
from scoring.read_path import (
    BLOCK_KEY_MEMO,
    ChatRequest,
    InvalidInput,
    KeyedRequest,
    key_chat,
    key_prompt,
    key_token_ids,
)
from tokenization.prefix_store import PrefixStore
from tokenization.tokenizers import LoadedTokenizer, TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def cached() -> TokenizerRegistry:
    """A registry with a fresh prefix store, and an empty chain memo: both start cold."""
    BLOCK_KEY_MEMO.clear()
    return TokenizerRegistry(prefix_store=PrefixStore())


@pytest.fixture(scope="module")
def qwen() -> LoadedTokenizer:
    return TokenizerRegistry(prefix_store=PrefixStore(capacity=0)).get(MODEL)


@pytest.fixture(scope="module")
def system(base_capture: dict) -> str:
    """A ~3,000-token system prompt: real prose, then real Python source."""
    return (base_capture["prompt"] + "\n\n" + inspect.getsource(argparse))[:12_000]


def config(*, block_size: int = 16) -> ServiceConfig:
    return ServiceConfig(seed="42", models={MODEL: ModelSettings(name=MODEL, block_size=block_size)})


def reference(qwen: LoadedTokenizer, keyed: KeyedRequest, *, block_size: int, lora: str | None) -> tuple:
    """The token ids and keys of the rendered prompt, computed without any cache."""
    ids = qwen.encode(keyed.templated).ids
    return ids, block_keys(ids, seed="42", block_size=block_size, lora_name=lora)


def conversations(system: str) -> list[list[dict]]:
    """Requests as a chat client sends them: one system prompt, questions that share words and
    differ anywhere (mid-word, so mid-block), growing multi-turn threads, non-ASCII and text parts."""
    rng = random.Random(7)
    words = system.split()
    base = " ".join(words[200:260])
    out = []
    for _ in range(24):
        cut = rng.randrange(len(base))
        question = base[:cut] + rng.choice(["x", "Ü", " 東京", "?", "\n"]) + base[cut:][: rng.randrange(80)]
        out.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    thread = [{"role": "system", "content": system}]
    for turn in range(4):
        thread = [*thread, {"role": "user", "content": f"Turn {turn}: {base[: 40 * (turn + 1)]}"}]
        out.append(thread)
        thread = [*thread, {"role": "assistant", "content": f"Answer {turn}: " + "ok " * (turn * 7)}]
    parts = [{"type": "text", "text": system[:6000]}, {"type": "text", "text": "émoji 🙂 and more"}]
    out.append([{"role": "system", "content": parts}, {"role": "user", "content": base[:90]}])
    return out


@pytest.mark.parametrize(("block_size", "lora"), [(16, None), (16, "Alice"), (32, None)])
def test_chat_requests_get_the_uncached_token_ids_and_keys(
    cached: TokenizerRegistry, qwen: LoadedTokenizer, system: str, block_size: int, lora: str | None
) -> None:
    previous: list[int] = []
    mid_block_divergences = 0
    for messages in conversations(system) * 2:  # the second round is served from the caches
        keyed = key_chat(
            tokenizers=cached,
            config=config(block_size=block_size),
            model=MODEL,
            chat=ChatRequest(messages=messages, add_generation_prompt=True),
            lora_name=lora,
        )
        ids, keys = reference(qwen, keyed, block_size=block_size, lora=lora)

        assert keyed.tokenization.token_ids == ids
        assert keyed.keys == keys
        assert keyed.token_count == len(ids)

        common = zip(previous, ids, strict=False)
        first_difference = next((i for i, (a, b) in enumerate(common) if a != b), None)
        if first_difference is not None and first_difference % block_size:
            mid_block_divergences += 1
        previous = ids

    assert mid_block_divergences >= 10  # the requests really do diverge inside a block


@pytest.mark.usefixtures("both_cores")
def test_the_caches_serve_a_repeated_prefix(cached: TokenizerRegistry, system: str) -> None:
    request = conversations(system)
    keyed = [
        key_chat(
            tokenizers=cached,
            config=config(),
            model=MODEL,
            chat=ChatRequest(messages=messages, add_generation_prompt=True),
        )
        for messages in request[:3]
    ]
    assert keyed[0].tokenization.from_prefix_store is False
    for later in keyed[1:]:
        assert later.tokenization.from_prefix_store is True
        assert later.tokenization.reused_tokens > 0.9 * later.token_count
    # The pure-Python chain keys through the memo: one step per distinct block, the shared system
    # prompt's blocks keyed once. The compiled chain hashes faster than the memo looks up.
    distinct_blocks = {key for k in keyed for key in k.keys}
    if memo_pays():
        assert len(BLOCK_KEY_MEMO) == len(distinct_blocks) < sum(len(k.keys) for k in keyed)
    else:
        assert len(BLOCK_KEY_MEMO) == 0


def test_completion_prompts_sharing_a_prefix_get_the_uncached_keys(
    cached: TokenizerRegistry, qwen: LoadedTokenizer, system: str
) -> None:
    rng = random.Random(3)
    for _ in range(20):
        cut = rng.randrange(len(system) - 2000, len(system))
        prompt = system[:cut] + rng.choice([" and then", "X", "\t\n", "ü"]) * rng.randrange(1, 30)
        keyed = key_prompt(tokenizers=cached, config=config(), model=MODEL, prompt=prompt)
        ids = qwen.encode(prompt).ids
        assert keyed.tokenization.token_ids == ids
        assert keyed.keys == block_keys(ids, seed="42")


def test_salted_media_and_lookahead_requests_get_their_own_uncached_keys_after_plain_ones(
    cached: TokenizerRegistry, qwen: LoadedTokenizer, system: str
) -> None:
    """The chain memo names a step by its extra keys, and the prefix store keeps only tokens: a
    salted, an image or a lookahead request that follows the plain one over the same prompt (both
    caches warm) gets the keys computed without any cache, never the plain ones."""
    prompt = system[:4000]
    ids = qwen.encode(prompt).ids
    image = MultimodalFeature("img", offset=40, length=100)
    plain = key_prompt(tokenizers=cached, config=config(), model=MODEL, prompt=prompt).keys
    lookahead = ServiceConfig(
        seed="42", models={MODEL: ModelSettings(name=MODEL, block_size=16, hash_lookahead_tokens=3)}
    )
    for options, settings, expected in [
        ({"cache_salt": "s"}, config(), block_keys(ids, seed="42", cache_salt="s")),
        ({"mm_features": [image]}, config(), block_keys(ids, seed="42", mm_features=[image])),
        (
            {"cache_salt": "s", "lora_name": "A"},
            config(),
            block_keys(ids, seed="42", cache_salt="s", lora_name="A"),
        ),
        ({}, lookahead, block_keys(ids, seed="42", lookahead_tokens=3)),
        ({}, config(), plain),
    ]:
        keyed = key_prompt(tokenizers=cached, config=settings, model=MODEL, prompt=prompt, **options)
        assert keyed.tokenization.from_prefix_store
        assert keyed.keys == expected
    salted = block_keys(ids, seed="42", cache_salt="s")
    assert not set(salted) & set(plain)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (
            {"mm_features": [MultimodalFeature("img", offset=30, length=5)]},
            "mm_features",
        ),  # 32 tokens: ends at 35
        ({"cache_salt": "\ud800"}, "cache_salt"),
        ({"lora_name": "\udc00"}, "lora_name"),
        ({"mm_features": [MultimodalFeature("\ud800", offset=0, length=1)]}, "mm_features"),
        ({}, "token_ids"),
    ],
)
def test_what_cannot_be_keyed_is_invalid_input_naming_the_field(options: dict, field: str) -> None:
    token_ids = list(range(32)) if field != "token_ids" else [*range(31), 2**64]
    with pytest.raises(InvalidInput) as raised:
        key_token_ids(config=config(), model=MODEL, token_ids=token_ids, memo=None, **options)
    assert raised.value.field == field
