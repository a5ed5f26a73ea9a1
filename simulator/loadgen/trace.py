"""Request traces replayed as a workload: Mooncake's format, and a minimal one of our own.

A trace is a JSON Lines file, one request per line, in arrival order or not (lines are sorted by
their timestamp, ties kept in file order):

- **Mooncake** (Moonshot AI's Kimi traces, FAST'25): ``{"timestamp": ms, "input_length": tokens,
  "output_length": tokens, "hash_ids": [...]}``. Each hash id stands for one block of
  ``block_size`` tokens (512 in Mooncake's traces) of the prompt; the same id in two requests is
  the same block, and ids form prefix chains, so shared leading ids are shared prefixes. The last
  block may be partial: ``input_length`` says how much of it there is.
- **Ours**, the same keys made optional: ``timestamp`` (ms since the trace's start, required);
  either ``prompt`` (the text, sent as it is) or ``input_length`` (tokens; with ``hash_ids``, the
  blocks they name, without them a prompt of its own that shares nothing); ``output_length``
  (optional: the run's ``max_tokens`` when absent). Other keys are ignored.

Each hash id becomes a deterministic chunk of text of about ``tokens_per_block`` tokens (the same
id, the same text, in every run), so requests that share leading ids share a prompt prefix.
``tokens_per_block`` below the trace's ``block_size`` scales every prompt down by the same factor,
to fit a trace made for a large fleet onto a small one; ``output_scale`` does the same to output
lengths. Sizes are approximate, as the generator's are (a word or a full stop counts one token).

Arrivals: at the trace's own pace (its timestamps), or rescaled to a mean rate, every gap
multiplied by the same factor, so bursts stay bursts. A window starts ``start`` seconds into the
trace (its own time); a run's request count or duration then says where it ends.

Ties can be spread (``spread_ties``): a trace whose clock is coarse (Mooncake's conversation trace
stamps every ~3 s, up to 23 requests with one timestamp) replays as bursts of requests sent at
the same instant, an artefact of its resolution rather than of its traffic. Spread, the ``k``
requests stamped ``t`` go at ``t, t + g/k, ..., t + (k-1)g/k``, ``g`` the gap to the next
distinct timestamp; the last ones, which have none, over the median gap between distinct
timestamps. No randomness: the same trace, the same times. A rescaled replay is rescaled after
spreading, so its mean rate is still the one asked for.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from simulator.loadgen.workload import words

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces."""

MAX_LINE_BYTES = 1 << 20
"""A line longer than this is refused: no request of a real trace comes near it."""


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a trace: ``at`` seconds from the trace's start; ``prompt`` when the line gave
    the text, else ``input_tokens`` and the ``hash_ids`` of its blocks (maybe none);
    ``output_tokens`` None when the line did not say."""

    line: int
    at: float
    input_tokens: int
    output_tokens: int | None
    hash_ids: tuple[int, ...] = ()
    prompt: str | None = None


@dataclass(frozen=True)
class TraceSpec:
    """How to replay a trace file: ``block_size`` tokens per hash id in the file,
    ``tokens_per_block`` generated per id (default: as many as the file says), output lengths
    times ``output_scale`` (at least 1, at most ``max_output_tokens`` when given), the window
    starting ``start`` seconds into the trace; ``spread_ties`` spreads requests that share a
    timestamp over the gap to the next one (see :func:`arrivals`), off by default."""

    path: str
    block_size: int = MOONCAKE_BLOCK_SIZE
    tokens_per_block: int | None = None
    output_scale: float = 1.0
    max_output_tokens: int | None = None
    start: float = 0.0
    spread_ties: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or (self.tokens_per_block is not None and self.tokens_per_block < 1):
            raise ValueError("block sizes must be at least 1 token")
        if not self.output_scale > 0 or (self.max_output_tokens is not None and self.max_output_tokens < 1):
            raise ValueError("output_scale must be > 0 and max_output_tokens at least 1")
        if not self.start >= 0:
            raise ValueError("the window's start must be >= 0 seconds")

    @property
    def block_tokens(self) -> int:
        """Tokens generated per hash id."""
        return self.tokens_per_block or self.block_size

    @property
    def scale(self) -> float:
        """Generated tokens per token of the trace."""
        return self.block_tokens / self.block_size


def _field(record: dict, name: str, where: str, *, required: bool = True) -> int | None:
    value = record.get(name)
    if value is None:
        if required:
            raise TraceError(f"{where}: no {name!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a number >= 0, not {value!r}")
    return value


def parse_line(text: str, line: int, where: str = "trace") -> TraceRequest:
    """One line of a trace; TraceError says what is wrong with it."""
    at = f"{where}:{line}"
    try:
        record = json.loads(text)
    except ValueError as e:
        raise TraceError(f"{at}: not JSON ({e})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{at}: expected a JSON object")
    timestamp = _field(record, "timestamp", at)
    output = _field(record, "output_length", at, required=False)
    prompt, hash_ids = record.get("prompt"), record.get("hash_ids")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise TraceError(f"{at}: 'prompt' must be non-empty text")
        if hash_ids is not None or record.get("input_length") is not None:
            raise TraceError(f"{at}: give 'prompt', or 'input_length' (and 'hash_ids'), not both")
        return TraceRequest(line, timestamp / 1000, len(prompt.split()), _int(output), prompt=prompt)
    input_length = _field(record, "input_length", at)
    if hash_ids is None:
        hash_ids = []
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError(f"{at}: 'hash_ids' must be a list of integers >= 0")
    if input_length < 1:
        raise TraceError(f"{at}: 'input_length' must be at least 1 token")
    return TraceRequest(line, timestamp / 1000, int(input_length), _int(output), tuple(hash_ids))


def _int(value: int | float | None) -> int | None:
    return None if value is None else int(value)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of the file at ``path``, by arrival time (ties in file order); blank lines
    are skipped. TraceError for an unreadable file, a bad line or an empty trace."""
    where = str(path)
    requests = []
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(f"{where}:{number}: line longer than {MAX_LINE_BYTES} bytes")
                if raw.strip():
                    requests.append(parse_line(raw.decode("utf-8", errors="replace"), number, where))
    except OSError as e:
        raise TraceError(f"{where}: {e.strerror or e}") from None
    if not requests:
        raise TraceError(f"{where}: no requests")
    requests.sort(key=lambda r: r.at)
    return requests


def load_window(spec: TraceSpec) -> list[TraceRequest]:
    """The requests ``spec`` replays: its file's from its start on. The file is read once while
    it stays the same (same size and modification time), not once per run of a ladder."""
    try:
        stat = os.stat(spec.path)
    except OSError as e:
        raise TraceError(f"{spec.path}: {e.strerror or e}") from None
    return window(_load_cached(spec.path, stat.st_size, stat.st_mtime_ns), spec.start)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, size: int, mtime_ns: int) -> list[TraceRequest]:
    return load_trace(path)


def window(requests: list[TraceRequest], start: float) -> list[TraceRequest]:
    """The requests from ``start`` seconds into the trace on (TraceError if none)."""
    chosen = [r for r in requests if r.at >= start]
    if not chosen:
        raise TraceError(f"no request at or after {start:g} s: the trace ends at {requests[-1].at:g} s")
    return chosen


def own_rate(requests: list[TraceRequest], *, spread_ties: bool = False) -> float:
    """The trace's mean request rate (requests per second over its span; inf if it has none);
    with ``spread_ties``, over the span of its arrivals with their ties spread, which the last
    timestamp's ties lengthen by up to one median gap."""
    span = arrivals(requests, None, spread_ties=spread_ties)[-1]
    return math.inf if span <= 0 else (len(requests) - 1) / span


def arrivals(requests: list[TraceRequest], qps: float | None, *, spread_ties: bool = False) -> list[float]:
    """When each request is sent, seconds from the first: the trace's own gaps (``qps`` None),
    or every gap scaled by the same factor so that the mean rate is ``qps`` (inf: all at once).
    With ``spread_ties``, requests sharing a timestamp are first spread over the gap to the next
    one (:func:`_spread_ties`); the rescaling then keeps the mean rate at ``qps`` all the same."""
    first = requests[0].at
    offsets = [r.at - first for r in requests]
    if spread_ties:
        offsets = _spread_ties(offsets)
    if qps is None:
        return offsets
    if math.isinf(qps):
        return [0.0] * len(offsets)
    if offsets[-1] <= 0:  # every request at the same instant: nothing to stretch
        return offsets
    rate = (len(offsets) - 1) / offsets[-1]  # over these offsets' span, as own_rate
    return [offset * rate / qps for offset in offsets]


def _spread_ties(offsets: list[float]) -> list[float]:
    """``offsets`` (ascending) with each run of ``k`` equal ones, ``t``, spread evenly over the
    gap ``g`` to the next distinct one: ``t, t + g/k, ..., t + (k-1)g/k``. The last run has no
    next one: its gap is the median gap between distinct offsets (the trace's usual tick, which
    long idle gaps do not inflate as they would a mean). When all are equal there is no gap to
    spread over: they stay together. Still ascending, and no request moves past the next
    distinct offset, so the order of the requests is kept."""
    groups = [(at, len(list(tied))) for at, tied in itertools.groupby(offsets)]
    gaps = [later - at for (at, _), (later, _) in itertools.pairwise(groups)]
    gaps.append(statistics.median(gaps) if gaps else 0.0)
    return [at + gap * i / count for (at, count), gap in zip(groups, gaps, strict=True) for i in range(count)]


class PromptBuilder:
    """Texts for a trace's requests: hash id -> its chunk (cached), a request -> its prompt."""

    def __init__(self, spec: TraceSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self._chunks: dict[int, str] = {}

    def chunk(self, hash_id: int) -> str:
        text = self._chunks.get(hash_id)
        if text is None:
            rng = random.Random(f"{self.seed}/trace/block/{hash_id}")
            text = self._chunks[hash_id] = f"{words(rng, self.spec.block_tokens)} "
        return text

    def prompt(self, request: TraceRequest) -> str:
        """The request's prompt: its own text, or the chunks of its hash ids (the last one cut to
        the share of a block the request has), then, past its ids, text of its own."""
        if request.prompt is not None:
            return request.prompt
        spec = self.spec
        tokens = max(1, round(request.input_tokens * spec.scale))
        parts: list[str] = []
        for hash_id in request.hash_ids:
            if tokens <= 0:
                break
            chunk = self.chunk(hash_id)
            if tokens < spec.block_tokens:
                chunk = _first_tokens(chunk, tokens)
            parts.append(chunk)
            tokens -= spec.block_tokens
        if tokens > 0:  # no ids (or too few): text no other request has
            rng = random.Random(f"{self.seed}/trace/line/{request.line}")
            parts.append(f"Request {request.line}. {words(rng, max(2, tokens - 3))}")  # 3 for the lead
        return "".join(parts)

    def output_tokens(self, request: TraceRequest, default: int) -> int:
        """The request's output length, scaled and capped; ``default`` when the line has none."""
        if request.output_tokens is None:
            return default
        tokens = max(1, round(request.output_tokens * self.spec.output_scale))
        cap = self.spec.max_output_tokens
        return tokens if cap is None else min(tokens, cap)


def _first_tokens(text: str, tokens: int) -> str:
    """About the first ``tokens`` tokens of a chunk (words and full stops count one each)."""
    kept: list[str] = []
    count = 0
    for word in text.split():
        count += 1 + word.endswith(".")
        kept.append(word)
        if count >= tokens:
            break
    return " ".join(kept) + " "


def block_reuse(requests: list[TraceRequest]) -> float | None:
    """The trace's own ideal prefix reuse: the share of hash-id blocks that are a prefix of a
    request before them (one unbounded cache, empty at the start); None without hash ids."""
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        total += len(request.hash_ids)
        key, reusing = 0, True
        for hash_id in request.hash_ids:
            key = hash((key, hash_id))  # covers the whole prefix up to this block
            if reusing and key in seen:
                hits += 1
            else:
                reusing = False
                seen.add(key)
    return None if total == 0 else hits / total
