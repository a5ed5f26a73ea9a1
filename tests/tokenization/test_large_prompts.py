"""Very large prompts are tokenized in a child process: the same ids as in this process, their
count when over the limit, and nothing of them left in this process's prefix store."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenization.large_prompts import LargePromptTokenizer
from tokenization.prefix_store import PrefixStore, TooManyTokens
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def large() -> Iterator[LargePromptTokenizer]:
    tokenizer = LargePromptTokenizer(min_chars=4000)
    yield tokenizer
    tokenizer.close()


@pytest.fixture
def registry(large: LargePromptTokenizer) -> TokenizerRegistry:
    return TokenizerRegistry(prefix_store=PrefixStore(), large_prompts=large)


def test_a_large_prompt_gets_the_same_ids_from_the_child_process(registry, base_capture):
    prompt = base_capture["prompt"] * 3  # ~6,200 characters
    direct = registry.get(MODEL).encode(prompt).ids
    tokenized = registry.tokenize(MODEL, prompt)
    assert tokenized.token_ids == direct
    assert not tokenized.from_prefix_store
    assert len(registry.prefix_store) == 0  # large prompts skip the store


def test_over_the_limit_only_the_count_comes_back(registry, base_capture):
    prompt = base_capture["prompt"] * 3
    count = len(registry.get(MODEL).encode(prompt).ids)
    with pytest.raises(TooManyTokens) as refused:
        registry.tokenize(MODEL, prompt, max_tokens=100)
    assert (refused.value.count, refused.value.limit) == (count, 100)


def test_short_prompts_still_go_through_the_prefix_store(registry, base_capture):
    registry.tokenize(MODEL, base_capture["prompt"])
    assert len(registry.prefix_store) > 0


def test_text_that_is_not_unicode_is_refused_before_the_child_sees_it(registry):
    with pytest.raises(ValueError, match="not valid Unicode"):
        registry.tokenize(MODEL, "x" * 5000 + "\ud800")


def test_the_child_exits_when_its_parent_is_killed():
    script = (
        "import os, signal\n"
        "from tokenization.large_prompts import LargePromptTokenizer\n"
        "from tokenization.tokenizers import TokenizerRegistry\n"
        "large = LargePromptTokenizer(min_chars=10)\n"
        "TokenizerRegistry(large_prompts=large).tokenize('Qwen/Qwen3-0.6B', 'hello there ' * 10)\n"
        "print(*large._pool._processes, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit\n"
    )
    run = [sys.executable, "-c", script]
    out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    children = [int(pid) for pid in out.stdout.split()]
    assert children, out.stderr
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)
