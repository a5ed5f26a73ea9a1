"""ASCII text tokenized word by word through a cache: the tokenizer's answer, at a third of its cost.

A byte-level BPE tokenizer of the GPT-4 / Qwen family tokenizes in steps: added tokens
(``<|im_start|>``...) are cut out of the text first, the rest is normalized (NFC), split into
pre-tokens ("words") by one regular expression, and each word is mapped to bytes and merged by
BPE on its own. A word's tokens therefore depend on the word alone, and the same words come back
prompt after prompt. ``tokenizers`` spends most of a prompt's time in the split: its regular
expression engine (Oniguruma, with Unicode classes and a look-ahead) took 0.9 of the 1.2 ms of a
1,000-token prompt on this project's machine; BPE hits its own cache.

:class:`WordCacheTokenizer` does the same steps for **ASCII text**, where the pattern's Unicode
classes are plain ASCII ones (letters ``A-Za-z``, numbers ``0-9``, white space the six ASCII
spaces) and NFC changes nothing: the added tokens with one ``re`` pattern (longest first at the
leftmost match, as ``tokenizers``' matcher), the split with the pattern translated to ASCII
classes for ``re``, each word's tokens from a bounded cache (a word it has not seen is tokenized
by ``tokenizers`` itself: the model, without the split), and the encoding assembled in C
(``itertools``), with the ids, character offsets and word ids ``tokenizers`` gives.

It is built only for a tokenizer of exactly that shape (:func:`word_cache_tokenizer` says None
otherwise) and used only for ASCII text; anything else goes to ``tokenizers`` whole. The property
tests (``tests/tokenization/test_word_cache.py``) hold it to ``tokenizers``' answer, ids, offsets
and word ids, on adversarial ASCII (every control character, white-space runs before words,
contractions in both cases, digits, added tokens inside and across words).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate, chain, repeat
from operator import add, itemgetter
from typing import Any

from tokenizers import Tokenizer

DEFAULT_MAX_WORDS = 1 << 17
"""Words kept (~25 MiB at most): when full, the cache starts again empty."""

# A cached word: its token ids, and each token's first and past-the-end character in the word.
_IDS, _STARTS, _ENDS = itemgetter(0), itemgetter(1), itemgetter(2)

# The pre-tokenizer pattern of the GPT-4 family as Qwen2 / Qwen3 ship it, and its ASCII form:
# \p{L} is [A-Za-z], \p{N} is [0-9], and \s / \S (White_Space) are the six ASCII spaces; (?i:)
# folds ASCII letters only in ASCII text.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPACE = r"\t\n\x0b\x0c\r "
ASCII_PATTERNS = {
    QWEN_PATTERN: (
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^{_SPACE}A-Za-z0-9]+[\r\n]*|"
        rf"[{_SPACE}]*[\r\n]+|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
    ),
}
"""Pre-tokenizer patterns this module knows, and their ASCII translation for ``re``."""


class Encoding:
    """What ``tokenizers.Encoding`` gives the prefix store: ids, character offsets, word ids."""

    __slots__ = ("ids", "offsets", "word_ids")

    def __init__(self, ids: list[int], offsets: list[tuple[int, int]], word_ids: list[int | None]) -> None:
        self.ids = ids
        self.offsets = offsets
        self.word_ids = word_ids

    def __len__(self) -> int:
        return len(self.ids)


class WordCacheTokenizer:
    """``encode(text)`` for ASCII text, equal to ``tokenizers``' ``encode(text,
    add_special_tokens=False)`` for the tokenizer it was built from (thread-safe: the cache is a
    dict, each of its reads and writes atomic)."""

    def __init__(
        self, *, pattern: str, added: dict[str, int], words: Tokenizer, max_words: int = DEFAULT_MAX_WORDS
    ) -> None:
        self._split = re.compile(pattern, re.ASCII).findall
        longest_first = sorted(added, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, longest_first))) if added else None
        self._added_ids = added
        self._words = words  # the same model and byte mapping, no normalizer, no split
        self._cache: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        self.max_words = max_words

    def encode(self, text: str) -> Encoding:
        """The encoding of ``text``, which must be ASCII (``ValueError`` otherwise)."""
        if not text.isascii():
            raise ValueError("WordCacheTokenizer encodes ASCII text only")
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        word_ids: list[int | None] = []
        position = word = 0  # word: the next word id (an added token is a word of its own)
        if self._added is not None:
            for match in self._added.finditer(text):
                start, end = match.span()
                if start > position:
                    word = self._encode_words(
                        text[position:start], position, word, ids, starts, ends, word_ids
                    )
                ids.append(self._added_ids[match.group()])
                starts.append(start)
                ends.append(end)
                word_ids.append(word)
                word += 1
                position = end
        if position < len(text):
            self._encode_words(text[position:], position, word, ids, starts, ends, word_ids)
        return Encoding(ids, list(zip(starts, ends, strict=True)), word_ids)

    def _encode_words(
        self,
        text: str,
        base: int,
        word: int,
        ids: list[int],
        starts: list[int],
        ends: list[int],
        word_ids: list[int | None],
    ) -> int:
        """Appends the tokens of ``text`` (no added token in it), which starts at character
        ``base`` and whose first word gets id ``word``; returns the next word id."""
        words = self._split(text)
        if not words:
            return word
        found = list(map(self._cache.get, words))
        if None in found:
            found = self._fill(words, found)
        token_ids = list(map(_IDS, found))
        counts = list(map(len, token_ids))
        at = list(chain.from_iterable(map(repeat, accumulate(map(len, words), initial=base), counts)))
        ids.extend(chain.from_iterable(token_ids))
        starts.extend(map(add, at, chain.from_iterable(map(_STARTS, found))))
        ends.extend(map(add, at, chain.from_iterable(map(_ENDS, found))))
        word_ids.extend(chain.from_iterable(map(repeat, range(word, word + len(words)), counts)))
        return word + len(words)

    def _fill(self, words: list[str], found: list[Any]) -> list[Any]:
        """``found`` with the words the cache lacked tokenized now (and cached)."""
        cache = self._cache
        missing = sorted({w for w, entry in zip(words, found, strict=True) if entry is None})
        if len(cache) + len(missing) > self.max_words:
            cache.clear()
        for word, encoding in zip(
            missing, self._words.encode_batch(missing, add_special_tokens=False), strict=True
        ):
            offsets = encoding.offsets
            cache[word] = (tuple(encoding.ids), tuple(s for s, _ in offsets), tuple(e for _, e in offsets))
        found = list(map(cache.get, words))
        if None in found:  # another thread cleared the cache meanwhile
            found = [entry or _entry(self._words, w) for w, entry in zip(words, found, strict=True)]
        return found


def _entry(words: Tokenizer, word: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A word's tokens and offsets straight from ``tokenizers`` (a cache cleared meanwhile)."""
    encoding = words.encode(word, add_special_tokens=False)
    offsets = encoding.offsets
    return tuple(encoding.ids), tuple(s for s, _ in offsets), tuple(e for _, e in offsets)


def word_cache_tokenizer(
    backend: Tokenizer, *, max_words: int = DEFAULT_MAX_WORDS
) -> WordCacheTokenizer | None:
    """A :class:`WordCacheTokenizer` for ``backend`` when it has exactly the shape this module
    reproduces: an NFC normalizer or none; a pre-tokenizer made of one ``Split`` (a pattern of
    :data:`ASCII_PATTERNS`, ``Isolated``, not inverted) then ``ByteLevel`` without prefix space
    or regex; a BPE model without dropout; added tokens that match as they are (no
    ``single_word``, ``lstrip``, ``rstrip`` or ``normalized``). None for any other."""
    config = json.loads(backend.to_str())
    if config.get("normalizer") not in (None, {"type": "NFC"}):
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or pattern not in ASCII_PATTERNS
        or split.get("behavior") != "Isolated"
        or split.get("invert")
    ):
        return None
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex")
    ):
        return None
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return None
    added = config.get("added_tokens") or []
    if any(a.get("single_word") or a.get("lstrip") or a.get("rstrip") or a.get("normalized") for a in added):
        return None
    if any(not a["content"] or not a["content"].isascii() for a in added):
        return None
    config["normalizer"] = None
    config["pre_tokenizer"] = byte_level
    config["added_tokens"] = []
    config["post_processor"] = None
    config["truncation"] = None
    config["padding"] = None
    words = Tokenizer.from_str(json.dumps(config))
    return WordCacheTokenizer(
        pattern=ASCII_PATTERNS[pattern],
        added={a["content"]: a["id"] for a in added},
        words=words,
        max_words=max_words,
    )
