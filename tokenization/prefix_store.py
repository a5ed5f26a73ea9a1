"""Prefix store: reuse the tokenization of a prompt prefix seen before (llm-d's ``prefixstore``).

Upstream's scheme, kept here:

* the prompt's UTF-8 bytes are cut into 256-byte chunks (a trailing partial chunk is never stored);
* chunk ``k`` is named by a chain hash ``h[k] = xxh64(h[k-1] as little-endian u64 || chunk bytes)``,
  so equal names mean equal prompt bytes up to the end of that chunk;
* each chunk holds the tokens whose end offset (in bytes) falls inside it;
* an LRU bounds the number of chunks (500000); when the cached chunks cover at least 80% of the
  prompt's bytes, their tokens are reused.

Where we differ, and why:

* **Keyed by tokenizer.** The chain starts from a seed derived from the tokenizer's identity
  (upstream starts every chain at 0 and mixes models), so two tokenizers never share chunks.
* **The tail is never dropped.** Upstream scores only the cached tokens. We keep the cached tokens
  up to a *safe cut* and tokenize the rest of the prompt, so the result is the full tokenization.
  The tokens of the last cached chunk near its end depend on text after it (which may differ
  in this prompt), so the cut is the start of a pre-token (a "word") that begins at least
  ``seam_chars`` characters before the cached text ends, with non-space text between the two:
  the pre-tokens before such a point do not depend on anything after the cached text.
* **Chunks must join up.** Chunks written by different prompts can split the text at their common
  boundary differently; a chunk is only used if its first token starts where the previous chunk's
  next token started, so such a seam ends the match instead of losing or duplicating a token.
* Prompts the store was used for write their new chunks back, so a conversation that keeps growing
  keeps hitting.
"""

from __future__ import annotations

import functools
import struct
import threading
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Protocol, TypeVar

import xxhash

from tokenization import ascii_bpe

DEFAULT_CAPACITY = 500_000
DEFAULT_CHUNK_BYTES = 256
DEFAULT_MIN_COVERAGE = 0.8

# A chunk is stored as one bytes object: this header, then its token ids as native uint32.
# own_start: character offset where the chunk's first token starts (or the token spanning it).
# next_start: where the token after the chunk's last token starts (_UNKNOWN: no such token).
# cut_tokens / cut_char: the safe cut inside this chunk: keep this many of its tokens and restart
#   tokenizing at this character offset (cut_tokens -1: no safe cut in this chunk).
_HEADER = struct.Struct("<IIiI")
_UNKNOWN = 0xFFFFFFFF
_TOKEN = "I"
assert array(_TOKEN).itemsize == 4

# Bytes that start a UTF-8 character (everything but 0b10xxxxxx continuation bytes).
_LEAD_BYTES = bytes(b for b in range(256) if not 0x80 <= b < 0xC0)
# How far back from a chunk's end to look for non-space text before giving up on a cut there.
_CUT_WINDOW_CHARS = 128


_Sized = TypeVar("_Sized", bound=Sized)


class Encoding(Protocol):
    """The part of ``tokenizers.Encoding`` the store reads (offsets in characters)."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]


class StoreTokenizer(Protocol):
    """What the store needs from a tokenizer (``tokenization.tokenizers.LoadedTokenizer`` is one)."""

    key: str  # identity of the tokenizer: chunks are never shared between two keys
    seam_chars: int  # how far before the end of cached text a cut must be (>= longest added token)
    supports_prefix_reuse: bool  # False when tokenizing a tail alone differs from in context

    def encode(self, text: str) -> Encoding: ...


@dataclass(frozen=True, slots=True)
class Tokenization:
    """A prompt's token ids (no special tokens added) and where they came from.

    ``reused_tokens`` of them came from the prefix store (``from_prefix_store`` is then true);
    the rest were tokenized now. ``elapsed`` is the time spent, in seconds.
    """

    token_ids: list[int]
    from_prefix_store: bool
    reused_tokens: int = 0
    elapsed: float = 0.0


class PrefixStore:
    """Thread-safe LRU of prompt chunks and their tokens, shared by all tokenizers.

    ``capacity`` counts chunks (0 disables the store); ``min_coverage`` is the fraction of the
    prompt's bytes the cached chunks must cover for them to be used.
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        min_coverage: float = DEFAULT_MIN_COVERAGE,
    ) -> None:
        if capacity < 0 or chunk_bytes <= 0 or not 0.0 <= min_coverage <= 1.0:
            raise ValueError("capacity >= 0, chunk_bytes > 0 and 0 <= min_coverage <= 1 are required")
        self.capacity = capacity
        self.chunk_bytes = chunk_bytes
        self.min_coverage = min_coverage
        self._chunks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._chunks)

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()

    def tokenize(
        self, tokenizer: StoreTokenizer, prompt: str, *, max_tokens: int | None = None
    ) -> Tokenization:
        """Tokenize ``prompt``, reusing cached chunks when they cover enough of it.

        Guarantees: the ids are those of ``tokenizer.encode(prompt)`` whenever the prompt's cached
        prefix was tokenized consistently with it (see the module docstring); the full prompt is
        always represented, never only its cached part. Raises ``ValueError`` for a prompt that is
        not valid Unicode (a lone surrogate, which JSON can carry), and ``TooManyTokens`` for one
        of more than ``max_tokens`` tokens (checked before the store does any work on it, so an
        oversized prompt costs the tokenizer's time only).
        """
        started = time.perf_counter()
        data = check_unicode(prompt)
        n_chunks = len(data) // self.chunk_bytes
        if self.capacity == 0 or n_chunks == 0 or not tokenizer.supports_prefix_reuse:
            ids = _within(tokenizer.encode(prompt), max_tokens).ids
            return Tokenization(ids, from_prefix_store=False, elapsed=time.perf_counter() - started)
        hashes = self._chain(_seed(tokenizer.key), data, n_chunks)
        matched = self._match(hashes)
        if len(matched) * self.chunk_bytes >= self.min_coverage * len(data):
            reused = self._reuse(tokenizer, prompt, data, hashes, matched)
            if reused is not None:
                ids, n_reused = reused
                _within(ids, max_tokens)
                elapsed = time.perf_counter() - started
                return Tokenization(ids, from_prefix_store=True, reused_tokens=n_reused, elapsed=elapsed)
        encoding = _within(tokenizer.encode(prompt), max_tokens)
        ids = encoding.ids
        entries = self._entries(
            prompt=prompt,
            ends_at=chunk_char_ends(prompt, data, self.chunk_bytes),
            first_chunk=0,
            carried=[],
            carried_start=0,
            carried_cut=None,
            base=0,
            encoding=encoding,
            seam_chars=tokenizer.seam_chars,
        )
        self._put(hashes, entries)
        return Tokenization(ids, from_prefix_store=False, elapsed=time.perf_counter() - started)

    def _chain(self, seed: int, data: bytes, n_chunks: int) -> list[int]:
        size = self.chunk_bytes
        hashes = []
        previous = seed
        for start in range(0, n_chunks * size, size):
            previous = xxhash.xxh64_intdigest(previous.to_bytes(8, "little") + data[start : start + size])
            hashes.append(previous)
        return hashes

    def _match(self, hashes: list[int]) -> list[bytes]:
        """The cached chunks that continue each other from the prompt's start, refreshed in the LRU."""
        matched = []
        expected_start = 0
        with self._lock:
            for chunk_hash in hashes:
                entry = self._chunks.get(chunk_hash)
                if entry is None:
                    break
                own_start, next_start, _, _ = _HEADER.unpack_from(entry)
                if own_start != expected_start:
                    break
                self._chunks.move_to_end(chunk_hash)
                matched.append(entry)
                expected_start = next_start
        return matched

    def _reuse(
        self, tokenizer: StoreTokenizer, prompt: str, data: bytes, hashes: list[int], matched: list[bytes]
    ) -> tuple[list[int], int] | None:
        """Cached tokens up to the last safe cut plus the rest tokenized now; None without a cut."""
        for last in range(len(matched) - 1, -1, -1):
            own_start, _, cut_tokens, cut_char = _HEADER.unpack_from(matched[last])
            if cut_tokens >= 0:
                break
        else:
            return None
        header = _HEADER.size
        carried = _tokens(matched[last][header : header + 4 * cut_tokens])
        kept = _tokens(b"".join(entry[header:] for entry in matched[:last]))
        kept.extend(carried)
        if not kept:
            return None  # the only cut is at the start of the text: nothing to reuse
        tail = tokenizer.encode(prompt[cut_char:])
        entries = self._entries(
            prompt=prompt,
            ends_at=chunk_char_ends(prompt, data, self.chunk_bytes),
            first_chunk=last,
            carried=carried,
            carried_start=own_start if cut_tokens else cut_char,
            carried_cut=(cut_tokens, cut_char),
            base=cut_char,
            encoding=tail,
            seam_chars=tokenizer.seam_chars,
        )
        self._put(hashes[last:], entries)
        n_reused = len(kept)
        kept.extend(tail.ids)
        return kept, n_reused

    def _entries(
        self,
        *,
        prompt: str,
        ends_at: list[int],
        first_chunk: int,
        carried: list[int],
        carried_start: int,
        carried_cut: tuple[int, int] | None,
        base: int,
        encoding: Encoding,
        seam_chars: int,
    ) -> list[bytes]:
        """Chunk entries from ``first_chunk`` on, for ``encoding`` of ``prompt[base:]``.

        ``carried`` are tokens of ``first_chunk`` that precede ``base`` (the cached part of a
        reused chunk), starting at ``carried_start``, with their safe cut ``carried_cut``.
        ``ends_at[k]`` is the number of characters that end within the first k+1 chunks.
        """
        ids = encoding.ids
        n_tokens = len(ids)
        starts, ends, last_word_start = _token_bounds(encoding)
        packed = array(_TOKEN, ids).tobytes()
        width = array(_TOKEN).itemsize
        entries = []
        lo = 0
        for k in range(first_chunk, len(ends_at)):
            chunk_end = ends_at[k]
            hi = bisect_right(ends, chunk_end - base, lo)
            previous = carried if k == first_chunk else []
            if previous:
                own_start = carried_start
            elif lo < n_tokens:
                own_start = base + starts[lo]
            else:
                own_start = _UNKNOWN
            next_start = base + starts[hi] if hi < n_tokens else _UNKNOWN
            cut_tokens, cut_char = -1, 0
            top = min(hi, n_tokens - 1)
            if lo <= top:
                # The cut: the last token of the chunk, or the one after it, that starts a word
                # at or before the latest cut; a word starts where a token does.
                latest = _latest_cut(prompt, chunk_end, seam_chars) - base
                word_start = last_word_start(starts[lo], min(latest, starts[top]))
                if word_start >= 0:
                    t = bisect_right(ends, word_start)
                    cut_tokens, cut_char = len(previous) + t - lo, base + word_start
            if cut_tokens < 0 and previous and carried_cut is not None:
                cut_tokens, cut_char = carried_cut
            header = _HEADER.pack(own_start, next_start, cut_tokens, cut_char)
            carried_bytes = array(_TOKEN, previous).tobytes() if previous else b""
            entries.append(header + carried_bytes + packed[width * lo : width * hi])
            lo = hi
        return entries

    def _put(self, hashes: Sequence[int], entries: list[bytes]) -> None:
        with self._lock:
            chunks = self._chunks
            for chunk_hash, entry in zip(hashes, entries, strict=True):
                chunks[chunk_hash] = entry
                chunks.move_to_end(chunk_hash)
            while len(chunks) > self.capacity:
                chunks.popitem(last=False)


def check_unicode(prompt: str) -> bytes:
    """The prompt's UTF-8 bytes; ValueError for text that is not valid Unicode (a lone surrogate,
    which JSON can carry)."""
    try:
        return prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the prompt is not valid Unicode text: {error.reason} at {error.start}") from error


class TooManyTokens(ValueError):
    """A prompt longer than the caller's limit (the model's context length)."""

    def __init__(self, count: int, limit: int) -> None:
        self.count = count
        self.limit = limit
        super().__init__(f"the prompt has {count} tokens, more than the model's context length of {limit}")


def _within(tokens: _Sized, max_tokens: int | None) -> _Sized:
    if max_tokens is not None and len(tokens) > max_tokens:
        raise TooManyTokens(len(tokens), max_tokens)
    return tokens


@functools.lru_cache(maxsize=256)
def _seed(tokenizer_key: str) -> int:
    return xxhash.xxh64_intdigest(tokenizer_key.encode("utf-8"))


def _tokens(raw: bytes) -> list[int]:
    tokens = array(_TOKEN)
    tokens.frombytes(raw)
    return tokens.tolist()


def chunk_char_ends(prompt: str, data: bytes, chunk_bytes: int) -> list[int]:
    """For each full chunk k of ``data`` (``prompt`` in UTF-8), the number of characters whose
    bytes all lie before byte (k+1)*chunk_bytes; a character split by that boundary is not counted.

    A token whose end (in characters) is at most that number ends, in bytes, inside the first k+1
    chunks: upstream's assignment rule, computed without per-character Python work.
    """
    size = chunk_bytes
    n_chunks = len(data) // size
    if len(data) == len(prompt):  # ASCII: characters are bytes
        return [size * (k + 1) for k in range(n_chunks)]
    ends = []
    leading = 0
    for start in range(0, n_chunks * size, size):
        piece = data[start : start + size]
        leading += len(piece) - len(piece.translate(None, _LEAD_BYTES))
        end = start + size
        split_character = end < len(data) and 0x80 <= data[end] < 0xC0
        ends.append(leading - split_character)
    return ends


def _token_bounds(encoding: Encoding) -> tuple[Sequence[int], Sequence[int], Callable[[int, int], int]]:
    """Each token's first character and past-the-end character, and a function that gives the
    last character in ``low..high`` where a word starts (-1: none): ``tokenization.ascii_bpe``'s
    own, or made from the offsets and word ids of ``tokenizers``' encoding (a token that starts
    a word starts it)."""
    if isinstance(encoding, ascii_bpe.Encoding):
        return encoding.starts, encoding.ends, encoding.last_word_start
    offsets, words = encoding.offsets, encoding.word_ids
    word_starts = [
        offsets[t][0] for t, word in enumerate(words) if word is not None and (t == 0 or word != words[t - 1])
    ]

    def last_word_start(low: int, high: int) -> int:
        w = bisect_right(word_starts, high) - 1
        return word_starts[w] if w >= 0 and word_starts[w] >= low else -1

    return [start for start, _ in offsets], [end for _, end in offsets], last_word_start


def _latest_cut(prompt: str, chunk_end: int, seam_chars: int) -> int:
    """The last character offset a safe cut may have for a chunk ending at ``chunk_end``:
    ``seam_chars`` before the end, and with a non-space character at or after it that is not the
    chunk's last character (a pre-token's extent can depend on the whitespace run after it)."""
    window_start = max(0, chunk_end - 1 - _CUT_WINDOW_CHARS)
    text = prompt[window_start : chunk_end - 1].rstrip()
    if not text:
        return -1
    return min(chunk_end - seam_chars, window_start + len(text) - 1)
