"""This process's handles on the shared state: the registry snapshot, the index, the tokenizer
registry and the template sandbox. One of each per process, built from the settings on first
use; tests replace them.

They live with the registry, below scoring, because the registry's own writes need them (a
disabled pod's blocks leave the index, a model's tokenizer source is loaded before it is saved),
and the tokenizer registry follows the model configs. The core (read path, fast path, ingest
pipeline, gateway) takes these as arguments; only the Django shells (views, commands,
``kvsite.asgi``, ``gateway.asgi``, ``scoring.wiring``) reach for them here.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings

from kvindex import KVIndex, open_index
from kvindex.dynamo import DynamoBlockStore, MemoryDynamoBlockStore, RedisDynamoBlockStore
from kvindex.epochs import EpochWatch
from registry.config import ServiceConfig
from registry.selectors import load_service_config
from registry.snapshot import ConfigSource
from tokenization.large_prompts import LargePromptTokenizer
from tokenization.prefix_store import PrefixStore
from tokenization.template_sandbox import TemplateSandbox
from tokenization.tokenizers import TokenizerError, TokenizerRegistry

CONFIG_REFRESH_SECONDS = 2.0
"""How stale a process's view of the registry may be (the promise is: live within 5 s)."""

# Async loads run in the thread Django runs sync code in (thread_sensitive): under a test's
# async_to_sync that is the test's own thread, which sees the test's transaction.
config_source = ConfigSource(
    load_service_config,
    load_async=sync_to_async(load_service_config, thread_sensitive=True),
    max_age=CONFIG_REFRESH_SECONDS,
)


def service_config() -> ServiceConfig:
    """The registry snapshot of this process, at most ``CONFIG_REFRESH_SECONDS`` old."""
    return config_source.get()


def invalidate_service_config() -> None:
    """After a registry write: this process's next request reads the registry again."""
    config_source.invalidate()


_index: KVIndex | None = None
_index_lock = threading.Lock()
_own_index = False


def index_url() -> str:
    """The index this process opens: ``redis`` -> ``REDIS_URL``; ``memory`` or a
    ``memory://?max_keys=..&max_bytes=2GiB`` URL -> an in-process index with those bounds;
    ``redis-cluster://host:port[,host:port...]`` -> a Valkey / Redis Cluster, those its seed
    nodes (the channel layer stays on ``REDIS_URL``)."""
    backend = settings.KVCACHE_INDEX_BACKEND
    if backend == "memory":
        return "memory://"
    if backend.startswith(("memory://", "redis-cluster://")):
        return backend
    if backend == "redis":
        return settings.REDIS_URL
    raise ValueError(
        "KVCACHE_INDEX_BACKEND must be 'redis', 'memory' or a memory:// URL (or a redis-cluster:// URL "
        f"of seed nodes), not {backend!r}"
    )


def index_options() -> dict[str, str]:
    """The index's own options beside its URL: a Redis index's (one server or a cluster)
    ``KVCACHE_INDEX_LAYOUT`` (``fast`` or ``compact``); the in-process index has one layout
    (``ValueError`` for another)."""
    layout = settings.KVCACHE_INDEX_LAYOUT
    if not index_url().startswith("memory://"):
        return {"layout": layout}
    if layout != "fast":
        raise ValueError(f"KVCACHE_INDEX_LAYOUT={layout!r} is for a Redis index (redis, redis-cluster://)")
    return {}


def index_is_shared() -> bool:
    """Whether this process's index lives in Redis (one server or a cluster), shared by every
    process: then the processes also share their stats and traffic through ``REDIS_URL``. Not
    when the process keeps an index of its own (``use_own_index``)."""
    return not _own_index and not index_url().startswith("memory://")


def connect_index(*, timeout: float) -> KVIndex:
    """A new handle on the index ``index_url`` names. A Redis index gives up on connecting or on a
    reply after ``timeout`` seconds (``IndexUnavailable``), unless its URL (``REDIS_URL``, or the
    ``redis-cluster://`` URL) sets ``socket_timeout`` or ``socket_connect_timeout`` itself: the
    URL wins."""
    url, options = index_url(), index_options()
    if url.startswith("memory://"):
        return open_index(url)
    return open_index(url, socket_timeout=timeout, socket_connect_timeout=timeout, **options)


def get_index() -> KVIndex:
    """This process's index (one per process; backends are thread-safe), connected on first use
    with ``KVCACHE_INDEX_TIMEOUT`` (``ingest`` installs one with its own, longer, timeout)."""
    global _index
    if _index is None:
        with _index_lock:
            if _index is None:
                _index = connect_index(timeout=settings.KVCACHE_INDEX_TIMEOUT)
    return _index


def set_index(index: KVIndex | None) -> None:
    """Replace this process's index (tests, and ``ingest`` sharing its in-memory index)."""
    global _index, _epoch_watch, _own_index
    with _index_lock:
        _index = index
        _epoch_watch = EpochWatch()
        _own_index = False


def use_own_index(index: KVIndex) -> None:
    """This process keeps an index of its own, ``index``, which it fills itself (``--index
    in-process``: ``ingest.in_process``): it replaces the settings' index, and ``index_is_shared``
    says False from now on (nothing of this process's is shared through Redis)."""
    global _own_index
    set_index(index)
    with _index_lock:
        _own_index = True


_epoch_watch = EpochWatch()

_dynamo_blocks: DynamoBlockStore | None = None
_dynamo_blocks_lock = threading.Lock()


def dynamo_blocks_factory(*, timeout: float) -> Callable[[], DynamoBlockStore | None] | None:
    """How a process opens the store of the blocks ingest records as Dynamo's indexer knows them
    (``kvindex.dynamo``; ``None`` unless ``KVCACHE_DYNAMO_BLOCKS`` is on): beside a Redis index
    (one server or a cluster), on ``REDIS_URL``, connecting and replying within ``timeout``
    seconds, as a picklable call (``ingest --processes N``); beside the in-process index, this
    process's own store."""
    if not settings.KVCACHE_DYNAMO_BLOCKS:
        return None
    if not index_is_shared():
        return get_dynamo_blocks
    return functools.partial(
        RedisDynamoBlockStore.from_url,
        settings.REDIS_URL,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )


def get_dynamo_blocks() -> DynamoBlockStore | None:
    """This process's store of Dynamo block records (``dynamo_blocks_factory``, replying within
    ``KVCACHE_INDEX_TIMEOUT``), opened on first use; ``None`` when ``KVCACHE_DYNAMO_BLOCKS`` is off."""
    global _dynamo_blocks
    if not settings.KVCACHE_DYNAMO_BLOCKS:
        return None
    if _dynamo_blocks is None:
        with _dynamo_blocks_lock:
            if _dynamo_blocks is None:
                if index_is_shared():
                    timeout = settings.KVCACHE_INDEX_TIMEOUT
                    _dynamo_blocks = RedisDynamoBlockStore.from_url(
                        settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=timeout
                    )
                else:
                    _dynamo_blocks = MemoryDynamoBlockStore()
    return _dynamo_blocks


def set_dynamo_blocks(store: DynamoBlockStore | None) -> None:
    """Replace this process's store of Dynamo block records (tests; ``None``: open one on next use)."""
    global _dynamo_blocks
    with _dynamo_blocks_lock:
        _dynamo_blocks = store


def resyncing_models() -> list[str]:
    """The registered models whose index data is being rebuilt after a loss (one round trip;
    ``IndexUnavailable`` when the index does not answer)."""
    return _epoch_watch.resyncing(get_index(), sorted(service_config().pod_models))


_tokenizers: TokenizerRegistry | None = None
_tokenizers_lock = threading.Lock()
_tokenizers_checked: ServiceConfig | None = None  # the registry snapshot last compared against
_tokenizer_sources: dict[str, str] | None = None  # model -> tokenizer source the registry was built for


def get_tokenizers(config: ServiceConfig | None = None) -> TokenizerRegistry:
    """This process's tokenizer registry (one per process: loaded tokenizers and the prefix store
    are shared by every request), configured from ``KVCACHE_TOKENIZERS_DIR``,
    ``KVCACHE_ALLOW_HUB`` and ``KVCACHE_PREFIX_STORE_CAPACITY``.

    A model's tokenizer source comes from its model config. The registry keeps a model's
    tokenizer once loaded, so when any model's source changes it is rebuilt, within a config
    refresh: every tokenizer loads again on next use; the prefix store is kept (its chunks are
    keyed by tokenizer file, so none can be reused for the wrong tokenizer). ``config`` is the
    snapshot the caller scores with (default: this process's)."""
    global _tokenizers, _tokenizers_checked, _tokenizer_sources
    config = config if config is not None else service_config()
    registry = _tokenizers
    if registry is not None and config is _tokenizers_checked:
        return registry  # the common case: nothing changed since the last request
    with _tokenizers_lock:
        sources = {name: m.tokenizer_source for name, m in config.models.items() if m.tokenizer_source}
        if _tokenizers is None:
            _tokenizers = build_tokenizers()
        elif _tokenizer_sources is not None and sources != _tokenizer_sources:
            _tokenizers = build_tokenizers(prefix_store=_tokenizers.prefix_store)
        _tokenizer_sources, _tokenizers_checked = sources, config
        return _tokenizers


def build_tokenizers(*, prefix_store: PrefixStore | None = None) -> TokenizerRegistry:
    """A new tokenizer registry configured from the settings (``get_tokenizers`` keeps one),
    with ``prefix_store`` or a new one."""
    directory = settings.KVCACHE_TOKENIZERS_DIR
    if prefix_store is None:
        prefix_store = PrefixStore(capacity=settings.KVCACHE_PREFIX_STORE_CAPACITY)
    return TokenizerRegistry(
        tokenizers_dir=Path(directory) if directory else None,
        model_sources=lambda model: _latest_config().model(model).tokenizer_source or None,
        allow_hub=settings.KVCACHE_ALLOW_HUB,
        prefix_store=prefix_store,
        large_prompts=_large_prompts(),
    )


async def warm_up() -> None:
    """A server process's start: the registry snapshot and its models' tokenizers loaded (so no
    first request waits for either), then everything loaded so far, which lives as long as the
    process, frozen out of the collector's sight (a full collection then walks only what
    requests allocate, not Django's whole heap)."""
    try:
        config = await config_source.aget()
    except Exception as error:  # no database yet: the first request loads it
        logging.getLogger(__name__).warning("registry snapshot not loaded at start-up: %s", error)
    else:
        await asyncio.get_running_loop().run_in_executor(None, warm_tokenizers, config)
    gc.collect()
    gc.freeze()


def warm_tokenizers(config: ServiceConfig) -> list[str]:
    """Load the tokenizer of every model the registry knows (model configs and pods' models), here
    and in the large-prompt child process; returns the models that have one. A model without one
    is skipped (it is answered 404)."""
    registry = get_tokenizers(config)
    warmed, files = [], set()
    for model in sorted(set(config.models) | set(config.pod_models)):
        try:
            files.add(str(registry.get(model).path))
        except TokenizerError:
            continue
        warmed.append(model)
    if registry.large_prompts is not None:
        registry.large_prompts.warm(sorted(files))
    return warmed


def _latest_config() -> ServiceConfig:
    # A tokenizer loads in a worker thread while its request holds a fresh snapshot: read that,
    # not the database (which another thread's transaction may not show yet).
    return config_source.current() or service_config()


_large_prompt_tokenizer: LargePromptTokenizer | None = None


def _large_prompts() -> LargePromptTokenizer | None:
    """The child process for prompts of ``KVCACHE_LARGE_PROMPT_CHARS`` or more (none when 0): one
    per process, kept when the tokenizer registry is rebuilt."""
    global _large_prompt_tokenizer
    min_chars = settings.KVCACHE_LARGE_PROMPT_CHARS
    if min_chars <= 0:
        return None
    if _large_prompt_tokenizer is None:
        _large_prompt_tokenizer = LargePromptTokenizer(min_chars=min_chars)
    _large_prompt_tokenizer.min_chars = min_chars
    return _large_prompt_tokenizer


def close_large_prompts() -> None:
    if _large_prompt_tokenizer is not None:
        _large_prompt_tokenizer.close()


def set_tokenizers(registry: TokenizerRegistry | None) -> None:
    """Replace this process's tokenizer registry (tests; ``None`` builds a new one on next use).
    The registry given is taken as built for the model configs as they are now."""
    global _tokenizers, _tokenizers_checked, _tokenizer_sources
    with _tokenizers_lock:
        _tokenizers, _tokenizers_checked, _tokenizer_sources = registry, None, None


_sandbox: TemplateSandbox | None = None
_sandbox_lock = threading.Lock()


def get_sandbox() -> TemplateSandbox:
    """This process's sandbox for request-supplied chat templates (its worker processes start on
    first use), with the budgets from ``KVCACHE_TEMPLATE_*``."""
    global _sandbox
    if _sandbox is None:
        with _sandbox_lock:
            if _sandbox is None:
                _sandbox = TemplateSandbox(
                    processes=settings.KVCACHE_TEMPLATE_PROCESSES,
                    cpu_seconds=settings.KVCACHE_TEMPLATE_CPU_MS / 1000,
                    max_output_chars=settings.KVCACHE_TEMPLATE_MAX_OUTPUT_CHARS,
                )
    return _sandbox


def close_sandbox() -> None:
    global _sandbox
    with _sandbox_lock:
        if _sandbox is not None:
            _sandbox.close()
        _sandbox = None
