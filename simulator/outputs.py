"""What a simulated pod answers: output token ids decided before the request runs, and their text.

* ``echo``: the prompt's own tokens (completions) or the last message's (chat), cut at
  ``max_tokens`` ("length") or complete ("stop"); with ``ignore_eos`` the source repeats until
  exactly ``max_tokens`` tokens.
* ``random``: sentences from a fixed list, drawn by a generator seeded from the pod's seed, the
  prompt and the choice index (and the request's ``seed`` when given): the same seed and request
  give the same text on every pod and every run. The length is where an "end of sequence" is
  drawn (uniform in 1..127 tokens), cut at ``max_tokens`` ("length"); with ``ignore_eos`` exactly
  ``max_tokens`` tokens.

Outputs are also bounded by the model's context window (``limit``: max_model_len - prompt).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["SENTENCES", "Output", "echo_output", "random_output", "request_rng", "token_texts"]

SENTENCES: Final = (
    "The simulator answers without a model, so its words mean nothing.",
    "Every block of sixteen tokens gets a key from the hash of its parent.",
    "A request that shares a long prefix with an earlier one starts sooner.",
    "Routing to the pod that holds the prefix saves the prefill.",
    "Latency grows with the number of requests in the batch.",
    "Events leave the pod in batches, one per scheduling step.",
    "Nothing here is computed on a GPU.",
    "The cache forgets the least recently used chains first.",
    "Multi-turn conversations reuse the blocks of earlier turns.",
    "This sentence exists only to take up a few tokens.",
    "Queues are first in, first out.",
    "A block is stored once it is full, never before.",
)
MEAN_EOS_TOKENS: Final = 64  # lengths without ignore_eos are uniform in 1..2*64-1


@dataclass(frozen=True, slots=True)
class Output:
    """The tokens a request will produce (at least one) and why it stops there."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" or "length"


def request_rng(seed: int, prompt_ids: Sequence[int], index: int, request_seed: int | None) -> random.Random:
    """The generator for one choice of one request; independent of every other request."""
    digest = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()
    return random.Random(f"{seed}:{request_seed}:{index}:{digest}")


def echo_output(
    source_ids: Sequence[int],
    *,
    max_tokens: int | None,
    ignore_eos: bool,
    limit: int,
    fallback: Sequence[int],
) -> Output:
    """The source tokens again (``fallback`` when there are none)."""
    source = tuple(source_ids) or tuple(fallback)
    cap = limit if max_tokens is None else min(max_tokens, limit)
    cap = max(cap, 1)
    if ignore_eos and max_tokens is not None:
        repeats = -(-cap // len(source))
        return Output((source * repeats)[:cap], "length")
    if len(source) > cap:
        return Output(source[:cap], "length")
    return Output(source, "stop")


def random_output(
    encode: Callable[[str], Sequence[int]],
    rng: random.Random,
    *,
    max_tokens: int | None,
    ignore_eos: bool,
    limit: int,
) -> Output:
    """Sentences drawn by ``rng`` and tokenized with ``encode``, as long as described above."""
    cap = limit if max_tokens is None else min(max_tokens, limit)
    cap = max(cap, 1)
    if ignore_eos and max_tokens is not None:
        length, reason = cap, "length"
    else:
        eos_at = rng.randint(1, 2 * MEAN_EOS_TOKENS - 1)
        length, reason = (eos_at, "stop") if eos_at <= cap else (cap, "length")
    ids: list[int] = []
    text = ""
    while len(ids) < length:
        # Whole sentences, re-tokenized together, so the ids are what the text tokenizes to.
        text += (" " if text else "") + " ".join(rng.choice(SENTENCES) for _ in range(4))
        ids = list(encode(text))
    return Output(tuple(ids[:length]), reason)


def token_texts(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """The text each token adds when decoded in order (special tokens skipped). A token that ends
    inside a multi-byte character adds "" and the next one carries the character, so the pieces
    join to the decoded text."""
    stream = DecodeStream(skip_special_tokens=True)
    return [stream.step(tokenizer, token) or "" for token in token_ids]
