"""``tiktoken`` gives ``tokenizers``' answer for ASCII text: the same ids, character offsets and
word ids (the prefix store cuts and joins chunks by the last two), for the real Qwen3 tokenizer."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.tokenization import qwen_tokenizer_dir, train_tiny_tokenizer
from tokenization.ascii_bpe import (
    AsciiBpeTokenizer,
    _byte_level_decoder,
    _mergeable_ranks,
    ascii_bpe_tokenizer,
)
from tokenization.prefix_store import PrefixStore
from tokenization.tokenizers import TokenizerRegistry

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
def words(qwen: Tokenizer) -> AsciiBpeTokenizer:
    built = ascii_bpe_tokenizer(qwen)
    assert built is not None, "the Qwen3 tokenizer has the shape tiktoken reproduces"
    return built


def assert_same(qwen: Tokenizer, words: AsciiBpeTokenizer, text: str) -> None:
    expected = qwen.encode_batch([text], add_special_tokens=False)[0]
    got = words.encode(text)
    assert got.ids == expected.ids
    assert list(got.offsets) == expected.offsets
    assert list(got.word_ids) == expected.word_ids
    # Read one at a time, from the end too, as the prefix store does.
    assert [got.offsets[t] for t in range(-len(got), len(got))] == expected.offsets * 2
    assert [got.word_ids[t] for t in range(len(got))] == expected.word_ids
    assert got.ends == [end for _, end in expected.offsets]
    assert len(got) == len(expected)


@settings(max_examples=1500, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=40).map("".join))
def test_ascii_text_is_tokenized_as_tokenizers_does(
    qwen: Tokenizer, words: AsciiBpeTokenizer, text: str
) -> None:
    assert_same(qwen, words, text)


def test_a_chat_prompt_is_tokenized_as_tokenizers_does(qwen: Tokenizer, words: AsciiBpeTokenizer) -> None:
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
    assert_same(qwen, words, text)
    assert_same(qwen, words, text[::-1])


def test_every_token_of_the_vocabulary_is_itself_when_tokenized_alone(qwen: Tokenizer) -> None:
    """``tiktoken`` takes a word that is a token whole as that token; ``tokenizers`` merges its
    bytes: the two agree only if merging each token's bytes gives the token back."""
    config = json.loads(qwen.to_str())
    config.update(
        normalizer=None,
        pre_tokenizer={
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        added_tokens=[],
        post_processor=None,
    )
    model_only = Tokenizer.from_str(json.dumps(config))
    vocab = config["model"]["vocab"]
    decode = _byte_level_decoder()
    texts = [bytes(decode[c] for c in token).decode("latin-1") for token in vocab]
    ascii_tokens = {t: i for t, i in zip(texts, vocab.values(), strict=True) if t.isascii()}
    got = model_only.encode_batch(list(ascii_tokens), add_special_tokens=False)
    wrong = [t for (t, i), encoding in zip(ascii_tokens.items(), got, strict=True) if encoding.ids != [i]]
    assert len(ascii_tokens) > 20_000
    assert wrong == []


def test_non_ascii_text_is_refused_and_the_registry_sends_it_to_tokenizers() -> None:
    registry = TokenizerRegistry()
    loaded = registry.get(QWEN)
    assert loaded.ascii_bpe is not None
    with pytest.raises(ValueError, match="ASCII"):
        loaded.ascii_bpe.encode("café")
    for text in ("naïve café, 東京 🙂", "plain ascii <|im_start|>user"):
        expected = loaded.backend.encode_batch([text], add_special_tokens=False)[0]
        got = loaded.encode(text)
        assert (got.ids, list(got.offsets), list(got.word_ids)) == (
            expected.ids,
            expected.offsets,
            expected.word_ids,
        )


def test_the_prefix_store_gives_the_same_tokens_and_chunks_through_tiktoken(qwen: Tokenizer) -> None:
    """The store's chunks (offsets and word ids decide their cuts) are byte for byte those it
    writes from ``tokenizers``' encoding, and a longer prompt reuses them to the same ids."""
    registry = TokenizerRegistry(prefix_store=PrefixStore())
    loaded = registry.get(QWEN)
    plain = TokenizerRegistry(prefix_store=PrefixStore()).get(QWEN)
    object.__setattr__(plain, "ascii_bpe", None)  # the same tokenizer through tokenizers alone
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


def test_a_tokenizer_of_another_shape_goes_to_tokenizers(tmp_path) -> None:
    tiny = Tokenizer.from_file(str(train_tiny_tokenizer(tmp_path / "tiny")))
    assert ascii_bpe_tokenizer(tiny) is None  # ByteLevel with its own regex, no Split
    config = json.loads(Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json")).to_str())
    config["normalizer"] = {"type": "NFKC"}
    assert ascii_bpe_tokenizer(Tokenizer.from_str(json.dumps(config))) is None
    config["normalizer"] = {"type": "NFC"}
    config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] += "|x"
    assert ascii_bpe_tokenizer(Tokenizer.from_str(json.dumps(config))) is None


def test_merges_that_do_not_make_tokens_in_id_order_go_to_tokenizers() -> None:
    """``tiktoken`` merges the pair whose result has the lowest id; ``tokenizers`` the pair that
    comes first in the merges: a vocabulary where the two orders differ is refused."""
    config = json.loads(Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json")).to_str())
    model = config["model"]
    assert _mergeable_ranks(model) is not None
    model["merges"][10], model["merges"][11] = model["merges"][11], model["merges"][10]
    assert _mergeable_ranks(model) is None
    model["merges"][10], model["merges"][11] = model["merges"][11], model["merges"][10]
    del model["merges"][-1]  # a token no merge makes
    assert _mergeable_ranks(model) is None


def _word_starts(expected) -> list[int]:
    """Where ``tokenizers``' words start: the tokens whose word id differs from the one before."""
    words = expected.word_ids
    return [start for t, (start, _) in enumerate(expected.offsets) if t == 0 or words[t] != words[t - 1]]


@settings(max_examples=800, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=40).map("".join), data=st.data())
def test_the_last_word_start_in_a_range_is_the_one_tokenizers_gives(
    qwen: Tokenizer, words: AsciiBpeTokenizer, text: str, data: st.DataObject
) -> None:
    """The prefix store cuts chunks at the last word start before a point; it is found by
    splitting a few words back from there, not the whole text."""
    starts = _word_starts(qwen.encode_batch([text], add_special_tokens=False)[0])
    low = data.draw(st.integers(-2, len(text) + 2))
    high = data.draw(st.integers(low - 3, len(text) + 2))
    in_range = [p for p in starts if low <= p <= high]
    assert words.encode(text).last_word_start(low, high) == (in_range[-1] if in_range else -1)


@pytest.mark.parametrize(
    "text",
    [
        "x" * 300,  # one word longer than the look back: the whole text is split
        "a" + " " * 200 + "b",
        "!" * 300 + "a b",
        "9" * 100 + "!?" * 100,
        "<|im_start|>" + " \n" * 90 + "<|im_end|>" + "word " * 60,
    ],
)
def test_every_last_word_start_of_long_words_and_runs(
    qwen: Tokenizer, words: AsciiBpeTokenizer, text: str
) -> None:
    starts = _word_starts(qwen.encode_batch([text], add_special_tokens=False)[0])
    encoding = words.encode(text)
    for high in range(len(text) + 1):
        for low in (0, high - 70, high - 3, high):
            in_range = [p for p in starts if low <= p <= high]
            assert encoding.last_word_start(low, high) == (in_range[-1] if in_range else -1), (low, high)
