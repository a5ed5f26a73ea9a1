"""The word cache gives ``tokenizers``' answer for ASCII text: the same ids, character offsets and
word ids (the prefix store cuts and joins chunks by the last two), for the real Qwen3 tokenizer."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.tokenization import qwen_tokenizer_dir, train_tiny_tokenizer
from tokenization.prefix_store import PrefixStore
from tokenization.tokenizers import TokenizerRegistry
from tokenization.word_cache import WordCacheTokenizer, word_cache_tokenizer

QWEN = "Qwen/Qwen3-0.6B"

# Pieces that stress each branch of the split: every ASCII character (controls included), runs of
# white space before words and line ends, contractions in both cases, digit runs, long words, the
# added tokens whole and cut, and text glued to them.
PIECES = [chr(c) for c in range(128)] + [
    "'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'ll", "'Ll", "'d", "'x", "  ", "   ", "\n\n", " \n ",
    "\r\n", "\t\t", " \x0b\x0c", "Hello", " world", "2026", "3.50", "x" * 40, "ABCdef",
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>",
    "<|", "|>", "<|im_", "start|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))


@pytest.fixture(scope="module")
def words(qwen: Tokenizer) -> WordCacheTokenizer:
    built = word_cache_tokenizer(qwen)
    assert built is not None, "the Qwen3 tokenizer has the shape the word cache reproduces"
    return built


def assert_same(qwen: Tokenizer, words: WordCacheTokenizer, text: str) -> None:
    expected = qwen.encode_batch([text], add_special_tokens=False)[0]
    got = words.encode(text)
    assert got.ids == expected.ids
    assert got.offsets == expected.offsets
    assert got.word_ids == expected.word_ids
    assert len(got) == len(expected)


@settings(max_examples=1500, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=40).map("".join))
def test_ascii_text_is_tokenized_as_tokenizers_does(
    qwen: Tokenizer, words: WordCacheTokenizer, text: str
) -> None:
    assert_same(qwen, words, text)


def test_a_chat_prompt_is_tokenized_as_tokenizers_does_with_the_cache_warm_and_cold(qwen: Tokenizer) -> None:
    rng = random.Random(7)
    vocabulary = [
        "cache",
        "Block",
        "prefix's",
        "token",
        "2048",
        "router,",
        "(model)",
        "latency.",
        "--",
        "x=1;",
    ]
    body = " ".join(rng.choice(vocabulary) for _ in range(600))
    question = body[:300]
    text = f"<|im_start|>system\n{body}<|im_end|>\n<|im_start|>user\n{question}?<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    cold = word_cache_tokenizer(qwen)
    assert cold is not None
    assert_same(qwen, cold, text)  # every word new
    assert_same(qwen, cold, text)  # every word cached


def test_the_cache_is_bounded_and_still_right_once_it_starts_again(qwen: Tokenizer) -> None:
    small = word_cache_tokenizer(qwen, max_words=8)
    assert small is not None
    text = " ".join(f"word{i} Thing{i % 5}" for i in range(50))
    assert_same(qwen, small, text)
    assert len(small._cache) <= 8 + len(set(text.split()))  # cleared when full, then refilled
    assert_same(qwen, small, text[::-1])


def test_non_ascii_text_is_refused_and_the_registry_sends_it_to_tokenizers() -> None:
    registry = TokenizerRegistry()
    loaded = registry.get(QWEN)
    assert loaded.word_cache is not None
    with pytest.raises(ValueError, match="ASCII"):
        loaded.word_cache.encode("café")
    for text in ("naïve café, 東京 🙂", "plain ascii <|im_start|>user"):
        expected = loaded.backend.encode_batch([text], add_special_tokens=False)[0]
        got = loaded.encode(text)
        assert (got.ids, got.offsets, got.word_ids) == (expected.ids, expected.offsets, expected.word_ids)


def test_the_prefix_store_gives_the_same_tokens_and_chunks_through_the_word_cache(qwen: Tokenizer) -> None:
    """The store's chunks (offsets and word ids decide their cuts) are byte for byte those it
    writes from ``tokenizers``' encoding, and a longer prompt reuses them to the same ids."""
    registry = TokenizerRegistry(prefix_store=PrefixStore())
    loaded = registry.get(QWEN)
    plain = TokenizerRegistry(prefix_store=PrefixStore()).get(QWEN)
    object.__setattr__(plain, "word_cache", None)  # the same tokenizer without the cache
    rng = random.Random(11)
    prompt = " ".join(rng.choice(["alpha", "Beta's", "42", "gamma\n", "delta,", "  eps"]) for _ in range(700))
    through_words = registry.prefix_store.tokenize(loaded, prompt)
    through_tokenizers = PrefixStore()
    expected = through_tokenizers.tokenize(plain, prompt)
    assert through_words.token_ids == expected.token_ids
    assert dict(registry.prefix_store._chunks) == dict(through_tokenizers._chunks)
    longer = prompt + " and a question at the end?"
    again = registry.prefix_store.tokenize(loaded, longer)
    assert again.from_prefix_store
    assert again.token_ids == qwen.encode(longer, add_special_tokens=False).ids


def test_a_tokenizer_of_another_shape_gets_no_word_cache(tmp_path) -> None:
    tiny = Tokenizer.from_file(str(train_tiny_tokenizer(tmp_path / "tiny")))
    assert word_cache_tokenizer(tiny) is None  # ByteLevel with its own regex, no Split
    config = json.loads(Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json")).to_str())
    config["normalizer"] = {"type": "NFKC"}
    assert word_cache_tokenizer(Tokenizer.from_str(json.dumps(config))) is None
    config["normalizer"] = {"type": "NFC"}
    config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] += "|x"
    assert word_cache_tokenizer(Tokenizer.from_str(json.dumps(config))) is None
