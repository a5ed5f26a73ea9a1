"""Very large prompts are tokenized in a child process, so they cannot stall the web process.

``tokenizers`` releases the GIL while it encodes, but not while it frees an encoding: dropping
the ``Encoding`` of a 1 MB prompt (240k tokens, each with its string, offsets and ids) holds the
GIL for 15-40 ms in one Rust call, and every other request of the process waits that long. A
child process (spawned, at a lower CPU priority) encodes the prompt and answers with the token ids
packed as uint32, or only their count when there are more than the caller's limit, so neither
the encoding nor an oversized answer ever reaches the web process. Prompts this large skip the
prefix store (its bookkeeping is per token, in Python).
"""

from __future__ import annotations

import multiprocessing
import threading
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tokenization.prefix_store import TooManyTokens
from tokenization.priority import BACKGROUND_NICENESS

DEFAULT_MIN_CHARS = 256 * 1024
"""Prompts of at least this many characters are tokenized in the child process."""

_ANSWER_TIMEOUT_SECONDS = 60.0


class LargePromptTokenizer:
    """A child process (started on first use, replaced when it dies) that tokenizes prompts of at
    least ``min_chars`` characters with a ``tokenizer.json``. Thread-safe."""

    def __init__(self, *, min_chars: int = DEFAULT_MIN_CHARS, processes: int = 1) -> None:
        self.min_chars = min_chars
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def token_ids(self, tokenizer_file: str, prompt: str, *, max_tokens: int | None = None) -> list[int]:
        """The prompt's token ids (no special tokens added), as ``Tokenizer.encode`` gives them.
        Raises ``TooManyTokens`` when there are more than ``max_tokens``."""
        try:
            count, packed = self._submit(tokenizer_file, prompt, max_tokens)
        except BrokenProcessPool:  # the child died (e.g. out of memory): a new one, once
            self._discard()
            count, packed = self._submit(tokenizer_file, prompt, max_tokens)
        if packed is None:
            raise TooManyTokens(count, max_tokens or 0)
        ids = array("I")
        ids.frombytes(packed)
        return ids.tolist()

    def warm(self, tokenizer_files: list[str]) -> None:
        """Start the child and load these tokenizers in it now (starting a child stalls the
        calling process for a moment: at start-up, not under a request)."""
        for tokenizer_file in tokenizer_files:
            self._submit(tokenizer_file, "", None)

    def close(self) -> None:
        self._discard()

    def _submit(self, tokenizer_file: str, prompt: str, max_tokens: int | None) -> tuple[int, bytes | None]:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_child
                )
            pool = self._pool
        return pool.submit(_encode, tokenizer_file, prompt, max_tokens).result(_ANSWER_TIMEOUT_SECONDS)

    def _discard(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# --- in the child ---------------------------------------------------------------------------------

_tokenizers: dict = {}


def _start_child() -> None:
    import os
    import threading
    import time

    os.nice(BACKGROUND_NICENESS)
    parent = os.getppid()

    def exit_with_the_parent() -> None:
        # A pool worker waits on a queue whose writing end it holds itself: a parent that dies
        # without shutting the pool down (SIGKILL) would leave it waiting forever.
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_with_the_parent, name="parent-watch", daemon=True).start()


def _encode(tokenizer_file: str, prompt: str, max_tokens: int | None) -> tuple[int, bytes | None]:
    from tokenizers import Tokenizer

    tokenizer = _tokenizers.get(tokenizer_file)
    if tokenizer is None:
        tokenizer = _tokenizers[tokenizer_file] = Tokenizer.from_file(tokenizer_file)
    encoding = tokenizer.encode(prompt, add_special_tokens=False)
    count = len(encoding)
    if max_tokens is not None and count > max_tokens:
        return count, None
    return count, array("I", encoding.ids).tobytes()
