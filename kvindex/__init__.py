"""The KV-block index: which pod holds which block key, on which tier. The state every other
box shares: ``ingest`` writes it, ``scoring``, the gateway and the dashboard read it.

* ``keys``: block keys and the chain (vLLM's block-hash scheme), the one name of a block;
* the index: one interface (``KVIndex`` in ``base``), one module per backend: ``memory``
  (in-process, bounded LRU), ``redis`` (one Redis / Valkey server, shared between processes and
  replicas), ``cluster`` (a Valkey / Redis Cluster: one model spread over every master), and
  ``resp``, the asyncio reader the Redis backends answer lookups with. All pass
  ``tests/kvindex``; ``open_index`` (here) picks the backend from a URL;
* ``epochs``: the markers that tell readers a model's index data is lost or being rebuilt;
* ``kv_cache_groups``: a hybrid model's KV-cache groups and vLLM's prefix-hit rule over them;
* ``shared_stats``: the ingest processes' counters and the fleet's history, as the other processes
  read them from Redis;
* ``native``: the compiled hot path (Cython and C++, built by ``make install``): the key chain
  and the in-memory index's maps, used by ``keys`` and ``memory`` when it is built, the pure-Python
  versions otherwise (the same tests run against both).

May import: nothing of this project's. No Django, no tokenizers (``make lint``'s contracts).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvindex.base import HolderMap, IndexUnavailable, KVIndex, PodBlocks, StoredBlock
from kvindex.memory import MemoryIndex, parse_size

__all__ = [
    "HolderMap",
    "IndexUnavailable",
    "KVIndex",
    "MemoryIndex",
    "PodBlocks",
    "StoredBlock",
    "open_index",
    "parse_size",
]

_MEMORY_OPTIONS = ("max_keys", "pod_cache_size", "max_bytes", "slice_blocks")
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def open_index(url: str, **options: Any) -> KVIndex:
    """The index a URL names.

    * ``memory://`` -> ``MemoryIndex``; query parameters ``max_keys``, ``pod_cache_size`` and
      ``slice_blocks`` (integers) and ``max_bytes`` (a size for ``parse_size``: ``2GiB``,
      ``42MB``, ``1000000``), e.g. ``memory://?max_keys=1000000&pod_cache_size=10`` or
      ``memory://?max_bytes=2GiB``. Keyword ``options`` override the query.
    * ``redis://``, ``rediss://``, ``unix://`` -> ``RedisIndex.from_url(url, **options)``
      (``namespace`` and ``slice_blocks`` are the index's own options); redis-py reads
      connection settings from the URL's query (e.g. ``?socket_timeout=1``).
    * ``redis-cluster://host:port[,host:port...]`` -> ``RedisClusterIndex.from_url(url, **options)``:
      seed nodes of a cluster (the same index options; ``socket_timeout``,
      ``socket_connect_timeout``, ``wait_replicas`` and ``wait_timeout`` in the query).

    Raises ``ValueError`` for another scheme or an unknown or malformed memory option.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        params: dict[str, Any] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in _MEMORY_OPTIONS:
                raise ValueError(f"unknown memory index option {name!r}; known: {', '.join(_MEMORY_OPTIONS)}")
            if name == "max_bytes":
                try:
                    params[name] = parse_size(value)
                except ValueError as error:
                    raise ValueError(f"memory index option max_bytes: {error}") from None
                continue
            try:
                params[name] = int(value.replace("_", ""))
            except ValueError:
                raise ValueError(f"memory index option {name} must be an integer, not {value!r}") from None
        params.update(options)
        return MemoryIndex(**params)
    if scheme in _REDIS_SCHEMES:
        from kvindex.redis import RedisIndex  # redis-py only when a Redis index is used

        return RedisIndex.from_url(url, **options)
    if scheme == "redis-cluster":
        from kvindex.cluster import RedisClusterIndex

        return RedisClusterIndex.from_url(url, **options)
    raise ValueError(
        f"unsupported index URL {url!r}: use memory://, redis://, rediss://, unix:// or redis-cluster://"
    )
