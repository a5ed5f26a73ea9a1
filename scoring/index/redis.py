"""Redis / Valkey index: shared between processes and replicas, atomic, Cluster-ready.

Key layout (``kv`` is the ``namespace`` option; ``M``, ``P``, ``T`` are the model, pod and tier
percent-encoded by ``encode_name``; ``K`` is a block key as 16 lower-case hex digits)::

    kv:{M}:b:K        STRING "P@T P@T ..."         the (pod, tier) entries of one block key
    kv:{M}:p:P:t:T    SET    K ...                 reverse index: the keys pod P holds on tier T
    kv:{M}:p:P:e      HASH   engine hash -> digest engine hash (decimal) -> digest bytes
    kv:{M}:p:P:k      HASH   K -> "h h ..."        the engine hashes of P pointing at K, so that
                                                   they go when P stops holding K
    kv:{M}:pods       SET    "P@T" ...             every (pod, tier) with a non-empty reverse set
    kv:models         SET    model names           models written through any client (a superset)

A block is a STRING of space-separated entries rather than a HASH so that a lookup is a single
``MGET`` of its keys: one command, one round trip, no per-key work on the server beyond a read.

Why it is safe:

* Encoding: ``encode_name`` percent-encodes everything but ``[A-Za-z0-9_.~-]``, so an encoded
  name never contains ``@``, ``:``, ``{``, ``}``, ``/`` or a space; "" encodes to ``%``, which no
  other name encodes to. Model ``a@b`` with pod ``c`` and model ``a`` with pod ``b@c`` therefore
  never share a key or an entry.
* Cluster: every key of one model carries the hash tag ``{M}`` (never empty, never containing
  ``}``), so all of them live in one slot: the ``MGET`` and every script touch one slot. Some
  scripts reach keys they find in the data (a block through the engine map, a reverse set
  through the pods set); those are not declared in ``KEYS`` but share the tag, which Redis and
  Valkey Cluster accept (services that insist on declared keys only are not supported).
  ``kv:models`` lives in another slot and is only written outside the scripts: one ``SADD`` the
  first time this client writes a model. ``clear_model`` leaves it, as other clients may have
  cached the model as seen; enumerating a cleared model just finds nothing.
* Atomicity: store, remove, clear_pod and clear_model are each one Lua script and a lookup is
  one ``MGET``, so no reader sees half of a write. The scripts carry a ``#!lua`` shebang, so a
  server out of memory refuses them before they start rather than half way (a script that fails
  part way is never rolled back).
* Consistency: the invariants of ``memory`` hold here too: ``P@T`` is an entry of ``b:K`` iff
  ``K`` is in ``p:P:t:T``; an engine hash of P points at a key P holds on some tier.

No TTLs and no per-key bound: an entry lives until it is removed, cleared, or its model cleared.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar
from urllib.parse import quote, unquote

import redis
from redis.commands.core import Script

from scoring.index.base import HolderMap, IndexUnavailable, PodBlocks, StoredBlock, Tier
from scoring.keys import BlockKey, Digest

DEFAULT_NAMESPACE = "kv"

_P = ParamSpec("_P")
_R = TypeVar("_R")


@functools.lru_cache(maxsize=4096)
def encode_name(name: str) -> bytes:
    """A model, pod or tier as it appears in keys and fields: percent-encoded, never empty."""
    return quote(name, safe="").encode("ascii") if name else b"%"


@functools.lru_cache(maxsize=4096)
def decode_name(encoded: bytes) -> str:
    """The inverse of ``encode_name``."""
    return unquote(encoded.decode("ascii")) if encoded != b"%" else ""


@dataclass(frozen=True, slots=True)
class _ModelKeys:
    """Key names and prefixes of one model (see the module docstring)."""

    block_prefix: bytes  # kv:{M}:b:
    pod_prefix: bytes  # kv:{M}:p:
    pods: bytes  # kv:{M}:pods

    def pod_keys(self, pod: bytes) -> tuple[bytes, bytes, bytes]:
        """The tier-set prefix, engine map and key -> engine hashes map of an encoded pod."""
        base = self.pod_prefix + pod
        return base + b":t:", base + b":e", base + b":k"


@functools.lru_cache(maxsize=1024)
def _model_keys(namespace: str, model: str) -> _ModelKeys:
    tagged = namespace.encode() + b":{" + encode_name(model) + b"}:"
    return _ModelKeys(block_prefix=tagged + b"b:", pod_prefix=tagged + b"p:", pods=tagged + b"pods")


def _unavailable_on_connection_error(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Re-raise connection and timeout errors as ``IndexUnavailable``."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc

    return wrapper


# Shared Lua helpers. Block values and key -> engine hashes values are lists of words separated
# by single spaces (encoded names and decimal hashes never contain one). A block key K is the hex
# of the last 8 bytes of a digest. Engine hashes stay strings: Lua numbers cannot hold 64 bits.
_LUA_HELPERS = """
local function hex_key(digest)
  return string.format('%02x%02x%02x%02x%02x%02x%02x%02x', string.byte(digest, -8, -1))
end
local function has_word(list, word)
  return string.find(' ' .. list .. ' ', ' ' .. word .. ' ', 1, true) ~= nil
end
local function has_prefix(list, prefix)
  return string.find(' ' .. list, ' ' .. prefix, 1, true) ~= nil
end
local function without(list, word)
  local kept = {}
  for w in string.gmatch(list, '%S+') do
    if w ~= word then kept[#kept + 1] = w end
  end
  if #kept == 0 then return nil end
  return table.concat(kept, ' ')
end
local function link(hashes_of, key, engine_hash)
  local cur = redis.call('HGET', hashes_of, key)
  if not cur then
    redis.call('HSET', hashes_of, key, engine_hash)
  elseif not has_word(cur, engine_hash) then
    redis.call('HSET', hashes_of, key, cur .. ' ' .. engine_hash)
  end
end
local function unlink(hashes_of, key, engine_hash)
  local cur = redis.call('HGET', hashes_of, key)
  if not cur then return end
  local rest = without(cur, engine_hash)
  if rest then redis.call('HSET', hashes_of, key, rest) else redis.call('HDEL', hashes_of, key) end
end
local function forget(engine, hashes_of, key)
  local cur = redis.call('HGET', hashes_of, key)
  if not cur then return end
  for h in string.gmatch(cur, '%S+') do redis.call('HDEL', engine, h) end
  redis.call('HDEL', hashes_of, key)
end
-- Take field out of a block; returns the fields left (nil: the block is gone) and whether
-- field was there at all.
local function drop_field(block, field)
  local cur = redis.call('GET', block)
  if not cur or not has_word(cur, field) then return cur, false end
  local rest = without(cur, field)
  if rest then redis.call('SET', block, rest) else redis.call('DEL', block) end
  return rest, true
end
"""

# KEYS: tier set, engine map, key -> hashes map, pods set, then one block per stored block.
# ARGV: field "P@T", then (K, engine hash, digest) per block.
_STORE = (
    "#!lua\n"
    + _LUA_HELPERS
    + """
local tier_set, engine, hashes_of, pods = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local field = ARGV[1]
for i = 5, #KEYS do
  local a = (i - 5) * 3 + 2
  local key, engine_hash, digest = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local cur = redis.call('GET', KEYS[i])
  if not cur then
    redis.call('SET', KEYS[i], field)
  elseif not has_word(cur, field) then
    redis.call('SET', KEYS[i], cur .. ' ' .. field)
  end
  redis.call('SADD', tier_set, key)
  local old = redis.call('HGET', engine, engine_hash)
  if old ~= digest then
    if old then unlink(hashes_of, hex_key(old), engine_hash) end
    redis.call('HSET', engine, engine_hash, digest)
    link(hashes_of, key, engine_hash)
  end
end
redis.call('SADD', pods, field)
return #KEYS - 4
"""
)

# KEYS: engine map, key -> hashes map, pods set, tier set.
# ARGV: field "P@T", block prefix, pod field prefix "P@", then the engine hashes.
_REMOVE = (
    "#!lua\n"
    + _LUA_HELPERS
    + """
local engine, hashes_of, pods, tier_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local field, block_prefix, pod_prefix = ARGV[1], ARGV[2], ARGV[3]
local removed = 0
for i = 4, #ARGV do
  local digest = redis.call('HGET', engine, ARGV[i])
  if digest then
    local key = hex_key(digest)
    local rest, dropped = drop_field(block_prefix .. key, field)
    if dropped then
      removed = removed + 1
      redis.call('SREM', tier_set, key)
      if not (rest and has_prefix(rest, pod_prefix)) then forget(engine, hashes_of, key) end
    end
  end
end
if redis.call('EXISTS', tier_set) == 0 then redis.call('SREM', pods, field) end
return removed
"""
)

# KEYS: pods set, engine map, key -> hashes map.
# ARGV: pod field prefix "P@", block prefix, tier-set prefix "kv:{M}:p:P:t:".
_CLEAR_POD = (
    "#!lua\n"
    + _LUA_HELPERS
    + """
local pods, engine, hashes_of = KEYS[1], KEYS[2], KEYS[3]
local pod_prefix, block_prefix, tier_prefix = ARGV[1], ARGV[2], ARGV[3]
local removed = 0
for _, field in ipairs(redis.call('SMEMBERS', pods)) do
  if string.sub(field, 1, #pod_prefix) == pod_prefix then
    local tier_set = tier_prefix .. string.sub(field, #pod_prefix + 1)
    repeat
      local keys = redis.call('SPOP', tier_set, 1000)
      for _, key in ipairs(keys) do drop_field(block_prefix .. key, field) end
      removed = removed + #keys
    until #keys == 0
    redis.call('SREM', pods, field)
  end
end
redis.call('DEL', engine, hashes_of)
return removed
"""
)

# KEYS: pods set. ARGV: block prefix, pod prefix "kv:{M}:p:".
_CLEAR_MODEL = """#!lua
local pods = KEYS[1]
local block_prefix, pod_prefix = ARGV[1], ARGV[2]
local removed = 0
for _, field in ipairs(redis.call('SMEMBERS', pods)) do
  local at = string.find(field, '@', 1, true)
  local pod = pod_prefix .. string.sub(field, 1, at - 1)
  local tier_set = pod .. ':t:' .. string.sub(field, at + 1)
  repeat
    local keys = redis.call('SPOP', tier_set, 1000)
    if #keys > 0 then
      for i = 1, #keys do keys[i] = block_prefix .. keys[i] end
      redis.call('DEL', unpack(keys))
    end
    removed = removed + #keys
  until #keys == 0
  redis.call('DEL', pod .. ':e', pod .. ':k')
end
redis.call('DEL', pods)
return removed
"""

# KEYS: pods set. ARGV: pod prefix "kv:{M}:p:". Returns a flat list: "P@T", count, ...
_POD_BLOCKS = """#!lua flags=no-writes
local out = {}
for _, field in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local at = string.find(field, '@', 1, true)
  local tier_set = ARGV[1] .. string.sub(field, 1, at - 1) .. ':t:' .. string.sub(field, at + 1)
  out[#out + 1] = field
  out[#out + 1] = redis.call('SCARD', tier_set)
end
return out
"""


def _block_names(block_prefix: bytes, keys: Sequence[BlockKey]) -> list[bytes]:
    """``block_prefix + K`` for every key, K in hex. Done in C (pack, hex with a space every 8
    bytes, one replace, one split) as it is most of a lookup's Python time; ``struct.error``
    for a key outside 0..2**64-1. The prefix must not contain a space (the namespace cannot)."""
    spaced = struct.pack(f">{len(keys)}Q", *keys).hex(" ", 8).encode()
    return (block_prefix + spaced.replace(b" ", b" " + block_prefix)).split(b" ")


def _parse_holders(joined: bytes) -> HolderMap:
    """``b"pod1@gpu pod1@cpu pod2@gpu"`` -> ``{"pod1": {"gpu", "cpu"}, "pod2": {"gpu"}}``, names
    decoded."""
    holders: dict[str, frozenset[Tier]] = {}
    for field in joined.split(b" "):
        pod, _, tier = field.partition(b"@")
        name = decode_name(pod)
        tiers = holders.get(name)
        holders[name] = frozenset((decode_name(tier),)) if tiers is None else tiers | {decode_name(tier)}
    return holders


class RedisIndex:
    """A ``KVIndex`` in a Redis or Valkey server (layout and guarantees: module docstring).

    Thread-safe: redis-py's connection pool hands each concurrent call its own connection.
    Connection and timeout errors surface as ``IndexUnavailable``.
    """

    def __init__(self, client: redis.Redis, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        if not namespace or any(c in namespace for c in "{} ") or not namespace.isprintable():
            raise ValueError("namespace must be non-empty, printable, and free of '{', '}' and spaces")
        self._client = client
        self._namespace = namespace
        self._models_key = namespace.encode() + b":models"
        self._models_seen: set[str] = set()  # set.add is atomic: no lock needed
        self._store = client.register_script(_STORE)
        self._remove = client.register_script(_REMOVE)
        self._clear_pod = client.register_script(_CLEAR_POD)
        self._clear_model = client.register_script(_CLEAR_MODEL)
        self._pod_blocks = client.register_script(_POD_BLOCKS)

    @classmethod
    def from_url(cls, url: str, *, namespace: str = DEFAULT_NAMESPACE, **options: Any) -> RedisIndex:
        """Connect to ``redis://``, ``rediss://`` or ``unix://`` ``url``; ``options`` go to
        ``redis.Redis.from_url`` (e.g. ``max_connections``, ``socket_timeout``).

        Defaults: ``socket_connect_timeout`` 5 s, ``health_check_interval`` 30 s. Responses stay
        bytes (``decode_responses`` cannot be turned on: digests are binary)."""
        if options.pop("decode_responses", False):
            raise ValueError("the Redis index needs decode_responses=False")
        options.setdefault("socket_connect_timeout", 5)
        options.setdefault("health_check_interval", 30)
        return cls(redis.Redis.from_url(url, decode_responses=False, **options), namespace=namespace)

    # -- writes ---------------------------------------------------------------------------------

    @_unavailable_on_connection_error
    def store(self, *, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        if not blocks:
            return
        mk = _model_keys(self._namespace, model)
        p, t = encode_name(pod), encode_name(tier)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        keys = [tier_prefix + t, engine, hashes_of, mk.pods]
        args: list[bytes | int] = [p + b"@" + t]
        block_prefix = mk.block_prefix
        for b in blocks:
            hex_key = b"%016x" % b.key
            keys.append(block_prefix + hex_key)
            args += (hex_key, b.engine_hash, b.digest)
        self._note_model(model)
        self._run(self._store, keys, args)

    @_unavailable_on_connection_error
    def remove(self, *, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        if not engine_hashes:
            return 0
        mk = _model_keys(self._namespace, model)
        p, t = encode_name(pod), encode_name(tier)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        keys = [engine, hashes_of, mk.pods, tier_prefix + t]
        args = [p + b"@" + t, mk.block_prefix, p + b"@", *engine_hashes]
        return int(self._run(self._remove, keys, args))

    @_unavailable_on_connection_error
    def clear_pod(self, *, pod: str, model: str | None = None) -> int:
        """Remove every entry of ``pod``; returns the number of ``(key, tier)`` entries. With
        ``model=None`` it walks every model in ``kv:models`` (one atomic script per model)."""
        p = encode_name(pod)
        removed = 0
        for m in self._models() if model is None else [model]:
            mk = _model_keys(self._namespace, m)
            tier_prefix, engine, hashes_of = mk.pod_keys(p)
            keys = [mk.pods, engine, hashes_of]
            removed += int(self._run(self._clear_pod, keys, [p + b"@", mk.block_prefix, tier_prefix]))
        return removed

    @_unavailable_on_connection_error
    def clear_model(self, *, model: str) -> int:
        """Remove everything under ``model``; returns the number of ``(key, pod, tier)`` entries."""
        mk = _model_keys(self._namespace, model)
        return int(self._run(self._clear_model, [mk.pods], [mk.block_prefix, mk.pod_prefix]))

    # -- reads ----------------------------------------------------------------------------------

    @_unavailable_on_connection_error
    def resolve(self, *, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        if not engine_hashes:
            return []
        _, engine, _ = _model_keys(self._namespace, model).pod_keys(encode_name(pod))
        return self._client.hmget(engine, list(engine_hashes))

    @_unavailable_on_connection_error
    def lookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """Holders of the longest held run of ``keys``: one ``MGET`` (see ``KVIndex``).

        Each distinct block value is parsed (and filtered) once: the blocks of a shared prefix
        are held by the same entries, so most keys cost a dict look-up and a copy."""
        if not keys:
            return []
        wanted = pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
        if wanted is not None and not wanted:
            return []
        names = _block_names(_model_keys(self._namespace, model).block_prefix, keys)
        values = self._client.mget(names)
        parsed: dict[bytes, HolderMap] = {}
        out: list[HolderMap] = []
        for value in values:
            if value is None:
                break
            holders = parsed.get(value)
            if holders is None:
                holders = _parse_holders(value)
                if wanted is not None:
                    holders = {pod: tiers for pod, tiers in holders.items() if pod in wanted}
                parsed[value] = holders
            if not holders:
                break
            out.append(holders.copy())
        return out

    @_unavailable_on_connection_error
    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        """Live block counts per (model, pod) with at least one block, sorted."""
        out: list[PodBlocks] = []
        for m in sorted(self._models()) if model is None else [model]:
            mk = _model_keys(self._namespace, m)
            flat = self._run(self._pod_blocks, [mk.pods], [mk.pod_prefix])
            by_pod: dict[str, dict[Tier, int]] = {}
            for i in range(0, len(flat), 2):
                count = int(flat[i + 1])
                if count:
                    pod, _, tier = flat[i].partition(b"@")
                    by_pod.setdefault(decode_name(pod), {})[decode_name(tier)] = count
            out += (PodBlocks(model=m, pod=pod, blocks_by_tier=by_pod[pod]) for pod in sorted(by_pod))
        return out

    def ping(self) -> None:
        """Raise ``IndexUnavailable`` unless the server answers."""
        try:
            self._client.ping()
        except redis.RedisError as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc

    def close(self) -> None:
        self._client.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _run(self, script: Script, keys: Sequence[bytes], args: Sequence[bytes | int]) -> Any:
        """Run ``script`` with EVALSHA (loading it first if the server does not know it)."""
        return script(keys=keys, args=args, client=self._client)

    def _note_model(self, model: str) -> None:
        """Add ``model`` to ``kv:models`` the first time this client writes it."""
        if model in self._models_seen:
            return
        self._client.sadd(self._models_key, model.encode())
        self._models_seen.add(model)

    def _models(self) -> list[str]:
        return [m.decode() for m in self._client.smembers(self._models_key)]
