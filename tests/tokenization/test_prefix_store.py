"""Prefix store: cached prefixes are reused, the uncovered tail is always tokenized, and the result
equals a full tokenization of the prompt with the real Qwen3 tokenizer on real text."""

from __future__ import annotations

import argparse
import inspect
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tokenization import train_tiny_tokenizer
from tokenization.prefix_store import Encoding, PrefixStore, TooManyTokens, chunk_char_ends
from tokenization.tokenizers import LoadedTokenizer, TokenizerRegistry

CHUNK = 256


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def qwen() -> LoadedTokenizer:
    return TokenizerRegistry().get("Qwen/Qwen3-0.6B")


@pytest.fixture(scope="module")
def english(base_capture: dict) -> str:
    """Real English prose and Python source, ASCII only, over 100 KB."""
    text = base_capture["prompt"] + "\n\n" + inspect.getsource(textwrap) + inspect.getsource(argparse)
    assert text.isascii() and len(text) > 100_000
    return text


# Real-world non-ASCII text: CJK, accents (precomposed and combining), emoji with modifiers,
# Cyrillic, Arabic, whitespace runs and the chat markup the Qwen3 template produces.
MIXED = (
    "<|im_start|>user\n東京は日本の首都です。人口は約1400万人で、世界有数の大都市圏を形成している。\n"
    "Ünïcödé naïve café, and a decomposed e\u0301 too; emoji 🙂👍🏽🇯🇵 in  double  spaces.\n"
    'Привет, мир! Как дела?   مرحبا بالعالم\n\n\t<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>\n'
)


@pytest.fixture(scope="module")
def mixed(english: str) -> str:
    text = (MIXED + english[:3000]) * 6
    assert not text.isascii()
    return text


@dataclass
class Renamed:
    """The same tokenizer under another identity, as two models with different files would be."""

    tokenizer: LoadedTokenizer
    key: str

    seam_chars = 21
    supports_prefix_reuse = True

    def encode(self, text: str) -> Encoding:
        return self.tokenizer.encode(text)


def test_a_new_prompt_is_tokenized_in_full_and_stored_as_one_chunk_per_256_bytes(
    qwen: LoadedTokenizer, english: str
) -> None:
    store = PrefixStore()
    prompt = english[:5000]

    tokenization = store.tokenize(qwen, prompt)

    assert tokenization.from_prefix_store is False
    assert tokenization.reused_tokens == 0
    assert tokenization.token_ids == qwen.encode(prompt).ids
    assert len(store) == 5000 // CHUNK


def test_a_prompt_seen_before_is_answered_from_the_store(qwen: LoadedTokenizer, english: str) -> None:
    store = PrefixStore()
    prompt = english[:5000]
    store.tokenize(qwen, prompt)

    again = store.tokenize(qwen, prompt)

    assert again.from_prefix_store is True
    assert again.token_ids == qwen.encode(prompt).ids
    assert again.reused_tokens > 0.9 * len(again.token_ids)


def test_the_uncovered_tail_is_tokenized_not_dropped(qwen: LoadedTokenizer, english: str) -> None:
    store = PrefixStore()
    store.tokenize(qwen, english[:8000])
    prompt = english[:8000] + english[20000:21200]  # 87% cached

    tokenization = store.tokenize(qwen, prompt)

    full = qwen.encode(prompt).ids
    assert tokenization.from_prefix_store is True
    assert tokenization.token_ids == full
    assert tokenization.reused_tokens < len(full) - 200  # the new text's tokens were added


def test_cached_chunks_are_used_from_80_percent_coverage_of_the_prompt_bytes(
    qwen: LoadedTokenizer, english: str
) -> None:
    cached = english[: 40 * CHUNK]
    shared = english[: 32 * CHUNK]  # 32 cached chunks
    exactly_80 = shared + english[20000 : 20000 + 8 * CHUNK]  # 8192 / 10240 bytes
    just_below = exactly_80 + "."  # 8192 / 10241 bytes
    results = {}
    for prompt in (exactly_80, just_below):
        store = PrefixStore()
        store.tokenize(qwen, cached)
        results[prompt] = store.tokenize(qwen, prompt)

    assert results[exactly_80].from_prefix_store is True
    assert results[just_below].from_prefix_store is False
    assert results[exactly_80].token_ids == qwen.encode(exactly_80).ids
    assert results[just_below].token_ids == qwen.encode(just_below).ids


def test_a_token_belongs_to_the_chunk_its_last_byte_is_in() -> None:
    """Upstream's rule, in bytes: "é" (2 bytes) at bytes 255-256 ends in the second chunk, so the
    first chunk's tokens end by character 255 and the second's by character 511."""
    prompt = "a" * 255 + "é" + "b" * 300
    data = prompt.encode()

    assert chunk_char_ends(prompt, data, CHUNK) == [255, 511]
    assert chunk_char_ends("x" * 600, b"x" * 600, CHUNK) == [256, 512]


def test_the_coverage_threshold_is_configurable(qwen: LoadedTokenizer, english: str) -> None:
    store = PrefixStore(min_coverage=0.5)
    store.tokenize(qwen, english[: 20 * CHUNK])
    prompt = english[: 12 * CHUNK] + english[20000 : 20000 + 8 * CHUNK]  # 60% cached

    assert store.tokenize(qwen, prompt).from_prefix_store is True
    assert PrefixStore(min_coverage=0.8).tokenize(qwen, prompt).from_prefix_store is False


def test_chunks_are_keyed_by_tokenizer(qwen: LoadedTokenizer, english: str) -> None:
    store = PrefixStore()
    prompt = english[:5000]
    store.tokenize(qwen, prompt)

    other = store.tokenize(Renamed(qwen, key="another tokenizer.json"), prompt)

    assert other.from_prefix_store is False
    assert len(store) == 2 * (5000 // CHUNK)


def test_a_different_tokenizer_gets_its_own_tokens_for_the_same_text(
    qwen: LoadedTokenizer, english: str, tmp_path: Path
) -> None:
    tiny = TokenizerRegistry(model_sources={"tiny": str(train_tiny_tokenizer(tmp_path / "tiny"))}.get).get(
        "tiny"
    )
    store = PrefixStore()
    prompt = english[:5000]
    store.tokenize(qwen, prompt)

    first, second = store.tokenize(tiny, prompt), store.tokenize(tiny, prompt)

    assert first.token_ids == second.token_ids == tiny.encode(prompt).ids
    assert (first.from_prefix_store, second.from_prefix_store) == (False, True)


def test_prompts_shorter_than_a_chunk_bypass_the_store(qwen: LoadedTokenizer) -> None:
    store = PrefixStore()

    store.tokenize(qwen, "Hello world")
    again = store.tokenize(qwen, "Hello world")

    assert again.from_prefix_store is False
    assert again.token_ids == [9707, 1879]
    assert len(store) == 0


def test_the_lru_holds_at_most_capacity_chunks_and_evicts_the_oldest(
    qwen: LoadedTokenizer, english: str
) -> None:
    store = PrefixStore(capacity=10)
    prompt = english[: 40 * CHUNK]

    store.tokenize(qwen, prompt)

    assert len(store) == 10
    # The first 30 chunks were evicted: the chain breaks at chunk 0.
    assert store.tokenize(qwen, prompt).from_prefix_store is False


def test_a_prompt_over_max_tokens_is_refused_before_anything_is_stored(
    qwen: LoadedTokenizer, english: str
) -> None:
    store = PrefixStore()
    count = len(qwen.encode(english).ids)
    with pytest.raises(TooManyTokens) as refused:
        store.tokenize(qwen, english, max_tokens=count - 1)
    assert (refused.value.count, refused.value.limit) == (count, count - 1)
    assert len(store) == 0
    assert store.tokenize(qwen, english, max_tokens=count).token_ids == qwen.encode(english).ids
    with pytest.raises(TooManyTokens):  # also when the tokens come from the store
        store.tokenize(qwen, english, max_tokens=count - 1)
    with pytest.raises(TooManyTokens):  # and below one chunk, where the store is bypassed
        store.tokenize(qwen, "a short prompt", max_tokens=1)


def test_capacity_zero_disables_the_store(qwen: LoadedTokenizer, english: str) -> None:
    store = PrefixStore(capacity=0)

    store.tokenize(qwen, english[:5000])

    assert store.tokenize(qwen, english[:5000]).from_prefix_store is False
    assert len(store) == 0


def test_a_growing_conversation_keeps_hitting_and_stays_exact(qwen: LoadedTokenizer, mixed: str) -> None:
    store = PrefixStore()
    turns = [mixed[i : i + 700] for i in range(0, 7000, 700)]
    prompt = mixed[:6000]
    store.tokenize(qwen, prompt)

    for turn in turns:
        prompt += turn
        tokenization = store.tokenize(qwen, prompt)
        assert tokenization.from_prefix_store is True
        assert tokenization.token_ids == qwen.encode(prompt).ids


def test_non_ascii_prompts_are_chunked_by_bytes_and_reused_exactly(qwen: LoadedTokenizer, mixed: str) -> None:
    store = PrefixStore()
    prompt = mixed[:6000]

    store.tokenize(qwen, prompt)
    again = store.tokenize(qwen, prompt)

    assert len(store) == len(prompt.encode()) // CHUNK
    assert again.from_prefix_store is True
    assert again.token_ids == qwen.encode(prompt).ids


# Continuations chosen to change how the text just before them is split: a word or number that
# goes on, whitespace runs, half of a special token, a combining accent, an emoji modifier.
AWKWARD_CONTINUATIONS = [
    "",
    "ing and more words",
    "0000 more digits",
    "      \n\n   indented",
    "\n\n\n",
    "<|im_start|>assistant\n",
    "start|> split marker",
    "\u0301\u0301 accents",
    "🏽 skin tone",
    "'s contraction",
    ".\n\nNew paragraph.",
    " \t \r\n mixed whitespace",
]


@pytest.mark.parametrize("text_name", ["english", "mixed"])
def test_a_prefix_cached_by_another_continuation_gives_the_full_tokenization(
    qwen: LoadedTokenizer, text_name: str, request: pytest.FixtureRequest
) -> None:
    """The seam: the cached chunks were tokenized with other text after them. Cut the shared
    prefix at many places (mid-word, mid-character, inside whitespace) and continue differently."""
    text: str = request.getfixturevalue(text_name)
    rng = random.Random(20240611)
    hits = 0
    for _ in range(120):
        cut = rng.randrange(CHUNK, 9000)
        before = rng.choice(AWKWARD_CONTINUATIONS) + text[rng.randrange(0, 9000) :][: rng.randrange(0, 1500)]
        after = rng.choice(AWKWARD_CONTINUATIONS) + text[rng.randrange(0, 9000) :][: rng.randrange(0, 100)]
        store = PrefixStore()
        store.tokenize(qwen, text[:cut] + before)

        prompt = text[:cut] + after
        tokenization = store.tokenize(qwen, prompt)

        assert tokenization.token_ids == qwen.encode(prompt).ids, (cut, before[:30], after[:30])
        hits += tokenization.from_prefix_store
    assert hits > 80  # most of them did come from the store


def test_a_store_shared_by_many_overlapping_prompts_stays_exact(qwen: LoadedTokenizer, mixed: str) -> None:
    """Chunks written by different prompts meet at seams they split differently; the store
    must never glue such chunks together into a wrong tokenization."""
    rng = random.Random(7)
    store = PrefixStore()
    hits = 0
    for _ in range(300):
        prompt = mixed[: rng.randrange(CHUNK, 9000)] + "".join(rng.choices(AWKWARD_CONTINUATIONS, k=3))
        tokenization = store.tokenize(qwen, prompt)
        assert tokenization.token_ids == qwen.encode(prompt).ids
        hits += tokenization.from_prefix_store
    assert hits > 150


def test_a_special_token_completed_after_the_cached_text_is_not_split_by_the_seam(
    qwen: LoadedTokenizer, english: str
) -> None:
    """The cached text ends with "<|im_": in the cached prompt that was plain text, in this one it
    is the start of the <|im_start|> token. The cut must be before it (the seam margin)."""
    shared = english[: 2 * CHUNK - len("<|im_")] + "<|im_"
    store = PrefixStore()
    store.tokenize(qwen, shared + "foo bar baz " * 40)
    prompt = shared + "start|>user\nhello there"

    tokenization = store.tokenize(qwen, prompt)

    assert tokenization.from_prefix_store is True
    assert tokenization.token_ids == qwen.encode(prompt).ids
    assert qwen.backend.token_to_id("<|im_start|>") in tokenization.token_ids


def test_chunks_that_split_their_common_boundary_differently_are_not_glued_together(
    qwen: LoadedTokenizer, english: str
) -> None:
    """A long prompt stores " unbelievable" as the first token of chunk 7; a second prompt
    that stops at " unbel" rewrites chunk 6 with " unbel"'s own tokens. A third prompt following
    the first must not take chunk 6 from the second and chunk 7 from the first."""
    boundary = 7 * CHUNK
    prefix = english[: boundary - len(" unbel")] + " unbel"
    first = prefix + "ievable things happen here " + english[5000:8000]
    second = prefix + "!!"
    third = first[:3000] + " and then a different ending"
    store = PrefixStore()
    store.tokenize(qwen, first)
    store.tokenize(qwen, second)

    tokenization = store.tokenize(qwen, third)

    assert tokenization.token_ids == qwen.encode(third).ids


def test_cuts_are_only_made_at_word_starts(tmp_path: Path) -> None:
    """With a SentencePiece-style tokenizer, text restarted in the middle of a word gets a "▁"
    word mark it does not have in context; restarting at a word start is exact."""
    path = train_tiny_tokenizer(tmp_path / "metaspace", style="metaspace")
    tokenizer = TokenizerRegistry(model_sources={"m": str(path)}.get).get("m")
    text = "unquickly brownest foxes overjumped lazier dogs retokenizing prefixes " * 12
    store = PrefixStore()
    store.tokenize(tokenizer, text + "and the first ending " * 10)
    prompt = text + "but another ending"

    tokenization = store.tokenize(tokenizer, prompt)

    assert tokenization.from_prefix_store is True
    assert tokenization.token_ids == tokenizer.encode(prompt).ids


def test_the_capture_prompt_is_reused_exactly(qwen: LoadedTokenizer, base_capture: dict) -> None:
    store = PrefixStore()
    prompt = base_capture["prompt"]
    store.tokenize(qwen, prompt)

    again = store.tokenize(qwen, prompt)

    assert again.from_prefix_store is True
    assert again.token_ids[:400] == base_capture["token_ids"]
    assert len(again.token_ids) == 402


def test_a_prompt_that_is_not_valid_unicode_is_a_clear_value_error(qwen: LoadedTokenizer) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        PrefixStore().tokenize(qwen, "text with a lone surrogate \ud800 in it")
