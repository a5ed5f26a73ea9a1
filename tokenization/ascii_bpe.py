"""ASCII text tokenized by ``tiktoken``: ``tokenizers``' answer at a sixth of its cost.

A byte-level BPE tokenizer of the GPT-4 / Qwen family tokenizes in steps: added tokens
(``<|im_start|>``...) are cut out of the text first, the rest is normalized (NFC), split into
pre-tokens ("words") by one regular expression, and each word is mapped to bytes and merged by
BPE on its own. ``tokenizers`` spends most of a 1,000-token prompt's 1.2-1.4 ms in the split (its
Oniguruma engine); ``tiktoken`` (OpenAI's BPE, in Rust) does the split and the merges in
0.18 ms, with the GIL released.

The two agree when the vocabulary is ``tiktoken``'s kind: the merges, in priority order, make
tokens of increasing id (``tiktoken`` merges by the id of the result, ``tokenizers`` by the merge's
place in the list), and a word that is a token whole is that token (``tiktoken`` looks a word up
before merging). Qwen2's and Qwen3's vocabularies were made by ``tiktoken``; the first condition
is checked when the tokenizer is built, both are held by the property tests
(``tests/tokenization/test_ascii_bpe.py``) against ``tokenizers``' ids, offsets and word ids.

:class:`AsciiBpeTokenizer` is used for **ASCII text** only, where NFC changes nothing and every
token is whole characters: a token's character offsets are its byte lengths summed, and the
tokens tile the text. The added tokens are cut out here (longest first at the leftmost match, as
``tokenizers``' matcher), not by ``tiktoken``. The prefix store reads every token's end but the
start and word of only a few tokens near each chunk's cut: :class:`Encoding` keeps the ends and
works out the rest when asked (the words by the pattern's ASCII form in ``re``). It is built only
for a tokenizer of exactly that shape (:func:`ascii_bpe_tokenizer` says None otherwise).
"""

from __future__ import annotations

import json
import re
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import overload

import tiktoken
from tokenizers import Tokenizer

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
    """What ``tokenizers.Encoding`` gives the prefix store: ids, character offsets, word ids.

    ``ends`` (each token's past-the-end character) is made with the ids; ``offsets`` and
    ``word_ids`` are sequences that work out an item when it is read."""

    __slots__ = ("_words", "ends", "ids")

    def __init__(self, ids: list[int], ends: list[int], words: _Words) -> None:
        self.ids = ids
        self.ends = ends
        self._words = words

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def offsets(self) -> _Offsets:
        return _Offsets(self.ends)

    @property
    def word_ids(self) -> _WordIds:
        return _WordIds(self.ends, self._words)

    @property
    def starts(self) -> list[int]:
        """Each token's first character."""
        return [0, *self.ends[:-1]] if self.ends else []

    def last_word_start(self, low: int, high: int) -> int:
        """The last character in ``low..high`` where a word starts (an added token is a word of
        its own), or -1 if none does."""
        return self._words.last_start(low, high)


class _Offsets(Sequence[tuple[int, int]]):
    """Each token's (start, end) in characters: the tokens tile the text."""

    __slots__ = ("_ends",)

    def __init__(self, ends: list[int]) -> None:
        self._ends = ends

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, t: int) -> tuple[int, int]: ...
    @overload
    def __getitem__(self, t: slice) -> list[tuple[int, int]]: ...
    def __getitem__(self, t: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(len(self)))]
        return _token_start(self._ends, t), self._ends[t]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip([0, *self._ends], self._ends, strict=False)


def _token_start(ends: list[int], t: int) -> int:
    """Token ``t``'s first character (``t`` may count from the end): the end of the one before."""
    ends[t]  # IndexError for a token that is not there
    t %= len(ends)
    return ends[t - 1] if t else 0


_WITNESS_CHARS = 64
"""How far back :meth:`_Words.last_start` looks for a place where a word is sure to start before
it splits the whole text."""


class _Words:
    """Where the words of the text start (an added token is a word of its own), found when asked:
    all of them (:meth:`starts`), or the last one in a range (:meth:`last_start`), which splits
    only a few words before the range's end.

    The few words are enough because the split never looks back: a split started where a word
    starts finds the same words from there on as the whole text's split. Words surely start at
    the text's start, at added tokens' edges, before and after every digit (a digit is a word
    of its own in the pattern) and after a letter that a non-letter follows (no word of the
    pattern goes on past its letters)."""

    __slots__ = ("_added", "_added_starts", "_split", "_starts", "_text")

    def __init__(self, text: str, added: list[tuple[int, int]], split: re.Pattern[str]) -> None:
        self._text, self._added, self._split = text, added, split
        self._added_starts = [start for start, _ in added]
        self._starts: list[int] | None = None

    def last_start(self, low: int, high: int) -> int:
        """The last word start in ``low..high``, or -1."""
        low, high = max(low, 0), min(high, len(self._text) - 1)
        if high < low:
            return -1
        # The added token at or before ``high``, if any: the text between it and the next one
        # is split on its own.
        a = bisect_right(self._added_starts, high) - 1
        segment_start = 0
        segment_end = self._added_starts[a + 1] if a + 1 < len(self._added) else len(self._text)
        if a >= 0:
            start, end = self._added[a]
            if high < end:  # inside an added token: only its start is a word start
                return start if start >= low else -1
            segment_start = end
        found = self._last_in_segment(segment_start, segment_end, max(low, segment_start), high)
        if found < 0 and a >= 0 and self._added[a][0] >= low:
            return self._added[a][0]
        return found

    def _last_in_segment(self, segment_start: int, segment_end: int, low: int, high: int) -> int:
        text = self._text
        witness = high
        floor = max(segment_start, high - _WITNESS_CHARS)
        while witness > floor and not _surely_starts(text, witness):
            witness -= 1
        if witness != segment_start and not _surely_starts(text, witness):
            starts = self.starts()
            found = starts[bisect_right(starts, high) - 1]
            return found if found >= low else -1
        found = -1
        for match in self._split.finditer(text, witness, segment_end):
            if match.start() > high:
                break
            found = match.start()
        return found if found >= low else -1

    def starts(self) -> list[int]:
        if self._starts is None:
            starts: list[int] = []
            position = 0
            for start, end in [*self._added, (len(self._text), len(self._text))]:
                if start > position:
                    words = self._split.findall(self._text, position, start)
                    starts.extend(accumulate(map(len, words[:-1]), initial=position))
                if end > start:
                    starts.append(start)
                position = end
            self._starts = starts
        return self._starts


def _surely_starts(text: str, i: int) -> bool:
    """Whether a word of the Qwen split surely starts at ``i`` (0 < i < len(text)), whatever
    comes before: see :class:`_Words`."""
    before, here = text[i - 1], text[i]
    return here.isdigit() or before.isdigit() or (before.isalpha() and not here.isalpha())


class _WordIds(Sequence[int]):
    """Each token's word: the number of words that start before the token's start."""

    __slots__ = ("_ends", "_words")

    def __init__(self, ends: list[int], words: _Words) -> None:
        self._ends, self._words = ends, words

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, t: int) -> int: ...
    @overload
    def __getitem__(self, t: slice) -> list[int]: ...
    def __getitem__(self, t: int | slice) -> int | list[int]:
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(len(self)))]
        return bisect_right(self._words.starts(), _token_start(self._ends, t)) - 1

    def __iter__(self) -> Iterator[int]:
        if not self._ends:
            return iter(())
        starts = self._words.starts()
        return (bisect_right(starts, start) - 1 for start in [0, *self._ends[:-1]])


class AsciiBpeTokenizer:
    """``encode(text)`` for ASCII text, equal to ``tokenizers``' ``encode(text,
    add_special_tokens=False)`` for the tokenizer it was built from (thread-safe: it keeps no
    state between calls)."""

    def __init__(self, *, pattern: str, added: dict[str, int], ranks: dict[bytes, int]) -> None:
        """``pattern``: the pre-tokenizer's (a key of :data:`ASCII_PATTERNS`); ``ranks``: every
        token's bytes and id, the ids in the order the merges make them."""
        self._split = re.compile(ASCII_PATTERNS[pattern], re.ASCII)
        longest_first = sorted(added, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, longest_first))) if added else None
        self._added_ids = added
        bpe = tiktoken.Encoding(name="ascii-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self._bpe = bpe.encode_ordinary
        # Each token's length in bytes (in characters, for ASCII): a compact table, read once per
        # token of every prompt.
        lengths = array("H", bytes(2 * len(ranks)))
        for token, rank in ranks.items():
            lengths[rank] = len(token)
        self._lengths = lengths

    def encode(self, text: str) -> Encoding:
        """The encoding of ``text``, which must be ASCII (``ValueError`` otherwise)."""
        if not text.isascii():
            raise ValueError("AsciiBpeTokenizer encodes ASCII text only")
        ids: list[int] = []
        lengths: list[int] = []
        added: list[tuple[int, int]] = []  # the added tokens' spans
        position = 0
        if self._added is not None:
            for match in self._added.finditer(text):
                start, end = match.span()
                if start > position:
                    self._encode_words(text[position:start], ids, lengths)
                ids.append(self._added_ids[match.group()])
                lengths.append(end - start)
                added.append((start, end))
                position = end
        if position < len(text):
            self._encode_words(text[position:], ids, lengths)
        return Encoding(ids, list(accumulate(lengths)), _Words(text, added, self._split))

    def _encode_words(self, text: str, ids: list[int], lengths: list[int]) -> None:
        """Appends the tokens of ``text`` (no added token in it) and their lengths."""
        found = self._bpe(text)
        ids.extend(found)
        lengths.extend(map(self._lengths.__getitem__, found))


def ascii_bpe_tokenizer(backend: Tokenizer) -> AsciiBpeTokenizer | None:
    """An :class:`AsciiBpeTokenizer` for ``backend`` when it has exactly the shape this module
    reproduces: an NFC normalizer or none; a pre-tokenizer made of one ``Split`` (a pattern of
    :data:`ASCII_PATTERNS`, ``Isolated``, not inverted) then ``ByteLevel`` without prefix space
    or regex; a BPE model without dropout, prefixes or suffixes whose merges make tokens of
    increasing id; added tokens that match as they are (no ``single_word``, ``lstrip``,
    ``rstrip`` or ``normalized``). None for any other."""
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
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    added = config.get("added_tokens") or []
    if any(a.get("single_word") or a.get("lstrip") or a.get("rstrip") or a.get("normalized") for a in added):
        return None
    if any(not a["content"] or not a["content"].isascii() for a in added):
        return None
    ranks = _mergeable_ranks(model)
    if ranks is None:
        return None
    return AsciiBpeTokenizer(pattern=pattern, added={a["content"]: a["id"] for a in added}, ranks=ranks)


def _mergeable_ranks(model: dict) -> dict[bytes, int] | None:
    """The vocabulary as ``tiktoken`` ranks (each token's bytes -> its id), or None when the
    merges do not make tokens of increasing id or a token is not made by a merge."""
    decode = _byte_level_decoder()
    vocab: dict[str, int] = model.get("vocab") or {}
    try:
        ranks = {bytes(decode[c] for c in token): rank for token, rank in vocab.items()}
    except KeyError:  # a character outside the byte-level alphabet
        return None
    if len(ranks) != len(vocab) or sorted(ranks.values()) != list(range(len(ranks))):
        return None
    last = -1
    merged = set()
    for merge in model.get("merges") or []:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        rank = vocab.get(left + right)
        if rank is None or rank <= last:
            return None
        last = rank
        merged.add(rank)
    singles = {rank for token, rank in ranks.items() if len(token) == 1}
    if len(singles) != 256 or len(singles) + len(merged) != len(ranks):
        return None
    return ranks


def _byte_level_decoder() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): the character that stands for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = [*printable, *(256 + n for n in range(len(others)))]
    return {chr(c): b for b, c in zip([*printable, *others], chars, strict=True)}
