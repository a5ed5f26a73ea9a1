"""Redis / Valkey index on one server: shared between processes and replicas, atomic. (For a
Valkey or Redis Cluster, ``cluster`` spreads each model over every master.)

Key layout (``kv`` is the ``namespace`` option, ``.2`` the version of the layout, ``LAYOUT``;
``M``, ``P``, ``T`` are the model, pod and tier percent-encoded by ``encode_name``; ``K`` is a
block key and ``h`` an engine hash, each as 16 lower-case hex digits)::

    kv.2:{M}:b:K      STRING "P@T P@T ..."         the (pod, tier) entries of one block key
    kv.2:{M}:p:P:t:T  SET    K ...                 reverse index: the keys pod P holds on tier T
    kv.2:{M}:p:P:e    HASH   h -> digest           P's engine hashes -> digest bytes
    kv.2:{M}:p:P:k    HASH   K -> "h h ..."        the engine hashes of P pointing at K, other
                                                   than K itself, so that they go when P stops
                                                   holding K (absent when there are none)
    kv.2:{M}:pods     SET    "P@T" ...             every (pod, tier) with a non-empty reverse set
    kv.2:{M}:seq      HASH   H -> seq              progress: the last event seq applied per holder
                                                   H (a pod or "pod#dp<r>", encoded), decimal
    kv.2:{M}:epoch    STRING opaque marker         set by ingest, removed only with the data
    kv.2:{M}:s:K      STRING "P=U P=U ..."         speculative entries at block key K: pod P
                                                   until U (Unix ms, the writer's clock); the
                                                   key expires with its last entry
    kv.2:models       SET    model names           models written through any client (a superset)

An engine hash equal to the key it points at (an aligned engine: every block) is linked to it
implicitly: ``k`` never lists it, and a key that P stops holding takes with it the words of its
``k`` field and, if ``e`` points that very hash at it, the key itself. So an aligned pod has no
``k`` at all, and an entry costs the block string, the reverse-set member and one ``e`` field.

The previous layout (``kv:{M}:...``, ``kv:models``: decimal engine hashes, every link written) is
never read: on a server that holds it, ingest finds no epoch marker under ``kv.2`` and rebuilds
the index from the engines (``scoring.epochs``). Its keys only waste memory until removed, e.g.
``redis-cli --scan --pattern 'kv:{*' | xargs -r -n 500 redis-cli unlink`` and ``redis-cli unlink
kv:models`` (``kv:ingest:*``, ``kv:web:*``, ``kv:history:*``, ``kv:auth:*`` are not the index's).

A block is a STRING of space-separated entries rather than a HASH so that a lookup is a single
``MGET`` of its keys: one command, one round trip, no per-key work on the server beyond a read.

Why it is safe:

* Encoding: ``encode_name`` percent-encodes everything but ``[A-Za-z0-9_.~-]``, so an encoded
  name never contains ``@``, ``:``, ``{``, ``}``, ``/`` or a space; "" encodes to ``%``, which no
  other name encodes to. Model ``a@b`` with pod ``c`` and model ``a`` with pod ``b@c`` therefore
  never share a key or an entry.
* One slot: every key of one model carries the hash tag ``{M}`` (never empty, never containing
  ``}``), so all of them would live in one slot of a cluster: the ``MGET`` and every script touch
  one slot. That keeps each slice one atomic script, but a cluster would hold a whole model on
  one node (and ``redis.Redis`` does not follow a cluster's redirections): ``cluster`` is the
  layout for a cluster, at the price of phases (its module docstring). Some
  scripts reach keys they find in the data (a block through the engine map, a reverse set
  through the pods set) or are given as arguments (the ``seq`` hash of a ``Progress``); those
  are not declared in ``KEYS`` but share the tag, which Redis and
  Valkey Cluster accept (services that insist on declared keys only are not supported).
  ``kv.2:models`` lives in another slot and is only written outside the scripts: one ``SADD`` the
  first time this client writes a model (or its progress). ``clear_model`` leaves it, as other
  clients may have cached the model as seen; enumerating a cleared model just finds nothing.
  ``clear_pod`` and ``clear_model`` leave ``seq`` and ``epoch`` too: progress records what was
  applied, and the epoch marker is there to go only when the server loses its data.
* Atomicity: a lookup is one ``MGET``; every write is cut into slices, each one Lua script call,
  so no reader sees half of a slice. A store or remove of at most ``slice_blocks`` blocks or
  engine hashes is one slice; a larger one is cut into near-equal slices of at most that many,
  and ``clear_pod`` (so ``clear_model``, pod by pod) removes at most that many entries per call,
  calling again until the pod is empty. Slices and updates are applied in order; a reader may
  see a prefix of them applied, and every invariant below holds between any two slices.
* Progress: the store, remove and clear_pod scripts take three trailing arguments (the ``seq``
  hash, the holder, the seq; all empty when none) and write it as their last command, so a
  ``Progress`` lands atomically with the last slice of the update it follows (a clear: with the
  call that empties the pod). One with nothing to ride on is its own tiny script rather than a
  plain ``HSET``, so that it is refused and resent in order with the calls before it.
* Scripts: they carry a ``#!lua`` shebang, so a server out of memory refuses them before they
  start rather than half way (a script that fails part way is never rolled back). They run by
  ``EVALSHA``; when the server has lost them (``SCRIPT FLUSH``, a restart) all of them are
  loaded again and the refused calls sent once more, in order.
* Reads on an event loop: ``alookup`` sends the same ``MGET`` on one pipelined connection per
  loop (``scoring.index.resp``), bounded by the client's ``socket_timeout``.
* Latency: Valkey runs one script, and one client's pipelined commands, back to back, so no
  other client (scoring's ``MGET``) is served while they run. ``apply_updates`` therefore sends
  at most ``slice_blocks`` of work per pipeline (round trip). At the default 2048, a call takes
  7-15 ms on the server (``bench/index_slices.py``); unsliced, a 65536-block store took ~250 ms
  in one call, a 65536-hash remove ~550 ms and the clear of a 100k-block pod ~575 ms.
* Consistency: the invariants of ``memory`` hold here too: ``P@T`` is an entry of ``b:K`` iff
  ``K`` is in ``p:P:t:T``; an engine hash of P points at a key P holds on some tier; ``p:P:k``
  with the implied links is exactly the inverse of ``p:P:e`` (so it has no field for a key P
  does not hold, and never lists a key's own hash).

Cost on the server: the store and remove scripts make a fixed number of variadic commands per
call, clear_pod per 1000 keys, not a few per block: reads with ``MGET`` / ``HMGET``, writes with
``MSET``, ``HSET``, ``SADD``, ``DEL``, ... (see ``_LUA_HELPERS``).

No TTLs and no per-key bound: an entry lives until it is removed, cleared, or its model cleared;
speculative entries are the exception, written by routers with an expiry of a few seconds (a
script per routed request that rewrites its ~1/8 of the request's keys, filtering the expired).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import struct
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar
from urllib.parse import quote, unquote

import redis
from redis.exceptions import NoScriptError

from scoring.index.base import (
    ClearPod,
    HolderMap,
    IndexUnavailable,
    IndexUpdate,
    LookupQuery,
    PodBlocks,
    Progress,
    Remove,
    Store,
    StoredBlock,
    Tier,
    slices,
    speculated_runs,
    speculation_points,
)
from scoring.index.resp import ReadConnection, ReplyError
from scoring.keys import BlockKey, Digest

DEFAULT_NAMESPACE = "kv"
LAYOUT = b".2"
"""Appended to the namespace in every key name: the version of the layout. Keys of another layout
(``kv:...``, the layout before engine hashes were hex and links implied) are never read."""
DEFAULT_SLICE_BLOCKS = 2048
DEFAULT_READ_TIMEOUT = 5.0
"""``alookup``'s time-outs when the URL and options set none (redis-py waits forever)."""
"""Blocks, engine hashes or cleared entries per script call and per pipeline: ~7 ms of server
time for a store, ~14 ms for a remove or a clear (``bench/index_slices.py``)."""

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

    block_prefix: bytes  # kv.2:{M}:b:
    pod_prefix: bytes  # kv.2:{M}:p:
    pods: bytes  # kv.2:{M}:pods
    seq: bytes  # kv.2:{M}:seq
    epoch: bytes  # kv.2:{M}:epoch
    speculative_prefix: bytes  # kv.2:{M}:s:

    def pod_keys(self, pod: bytes) -> tuple[bytes, bytes, bytes]:
        """The tier-set prefix, engine map and key -> engine hashes map of an encoded pod."""
        base = self.pod_prefix + pod
        return base + b":t:", base + b":e", base + b":k"


@functools.lru_cache(maxsize=1024)
def _model_keys(namespace: str, model: str) -> _ModelKeys:
    tagged = namespace.encode() + LAYOUT + b":{" + encode_name(model) + b"}:"
    return _ModelKeys(
        block_prefix=tagged + b"b:",
        pod_prefix=tagged + b"p:",
        pods=tagged + b"pods",
        seq=tagged + b"seq",
        epoch=tagged + b"epoch",
        speculative_prefix=tagged + b"s:",
    )


def _unavailable_on_connection_error(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Re-raise connection and timeout errors as ``IndexUnavailable``."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc

    return wrapper


class _Script:
    """A Lua script and the SHA1 that ``EVALSHA`` runs it by."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


_Call = tuple[_Script, list[bytes], list[bytes | int]]
"""A script with its keys and arguments: one ``EVALSHA``."""

_ProgressArgs = tuple[bytes, bytes, bytes | int]
"""The last three arguments of a write script: seq hash, encoded holder, seq (see ``_LUA_HELPERS``)."""
_NO_PROGRESS: _ProgressArgs = (b"", b"", b"")


# Shared Lua helpers. Block values and key -> engine hashes values are lists of words separated
# by single spaces (encoded names and hex hashes never contain one). A block key K is the hex of
# the last 8 bytes of a digest; an engine hash is hex too (Lua numbers cannot hold 64 bits), so
# "h is K" is a string comparison.
#
# The store and remove scripts make a fixed number of commands per call (clear_pod: per 1000
# keys), not several per block: they read what the call touches with one variadic command per
# kind of key (MGET, HMGET), replay the call's blocks or hashes in order on Lua tables, and write
# back what changed with one variadic command per kind of change (MSET, DEL, HSET, HDEL, SADD,
# SREM).
_LUA_HELPERS = """
-- The hex of the last 8 bytes of digest, as two 32-bit halves (Lua numbers are doubles).
local function hex_key(digest)
  local a, b, c, d, e, f, g, h = string.byte(digest, -8, -1)
  return string.format('%08x%08x', ((a * 256 + b) * 256 + c) * 256 + d, ((e * 256 + f) * 256 + g) * 256 + h)
end
-- Where word is, as a whole word, in list (nil: it is not); allocates no string.
local function find_word(list, word)
  local from, last = 1, #list
  while true do
    local s, e = string.find(list, word, from, true)
    if not s then return nil end
    if (s == 1 or string.byte(list, s - 1) == 32) and (e == last or string.byte(list, e + 1) == 32) then
      return s, e
    end
    from = s + 1
  end
end
local function has_word(list, word)
  return find_word(list, word) ~= nil
end
-- Whether a word of list starts with prefix.
local function has_prefix(list, prefix)
  local from = 1
  while true do
    local s = string.find(list, prefix, from, true)
    if not s then return false end
    if s == 1 or string.byte(list, s - 1) == 32 then return true end
    from = s + 1
  end
end
-- list without word (the lists never repeat a word); false when nothing is left.
local function without(list, word)
  local s, e = find_word(list, word)
  if not s then return list end
  if s == 1 then
    if e == #list then return false end
    return string.sub(list, e + 2)
  end
  return string.sub(list, 1, s - 2) .. string.sub(list, e + 1)
end
-- redis.call(command, [key,] list[first], ..., list[last]) in chunks of at most 1000 values
-- (unpack cannot spread more than a few thousand; 1000 is even, so pairs stay whole), the
-- replies concatenated.
local function call_range(command, key, list, first, last)
  if last < first then return {} end
  if last - first < 1000 then
    if key then return redis.call(command, key, unpack(list, first, last)) end
    return redis.call(command, unpack(list, first, last))
  end
  local out = {}
  for from = first, last, 1000 do
    local reply = call_range(command, key, list, from, math.min(from + 999, last))
    if type(reply) == 'table' then
      for i = 1, #reply do out[#out + 1] = reply[i] end
    end
  end
  return out
end
local function call_many(command, key, list)
  return call_range(command, key, list, 1, #list)
end
-- Write back the blocks whose value changed: names[i] was before[i] (false: absent) and is now
-- after[names[i]] (false: no entry left, the block goes).
local function save_blocks(names, before, after)
  local set, gone = {}, {}
  for i, name in ipairs(names) do
    local value = after[name]
    if value ~= before[i] then
      if value then
        set[#set + 1] = name
        set[#set + 1] = value
      else
        gone[#gone + 1] = name
      end
    end
  end
  call_many('MSET', nil, set)
  call_many('DEL', nil, gone)
end
-- The engine hashes that go with keys the pod holds on no tier any more: the words of their
-- key -> hashes entries (linked[i] for keys[i], false: none), and each key that is itself an
-- engine hash pointing at it (an implied link, never written in the key -> hashes map).
local function hashes_of_keys(engine, keys, linked)
  local gone = {}
  if #keys == 0 then return gone end
  for i = 1, #keys do
    if linked[i] then
      for h in string.gmatch(linked[i], '%S+') do gone[#gone + 1] = h end
    end
  end
  local own = call_many('HMGET', engine, keys)
  for i, key in ipairs(keys) do
    if own[i] and hex_key(own[i]) == key then gone[#gone + 1] = key end
  end
  return gone
end
-- The last three arguments of a write script: the seq hash, the encoded holder and the seq of the
-- Progress that this call ends (all '' when none). Written as the call's last command, so
-- atomically with it; not while the call leaves work to a next call of the same update.
local function record_progress(finished)
  local seq = ARGV[#ARGV]
  if finished and seq ~= '' then redis.call('HSET', ARGV[#ARGV - 2], ARGV[#ARGV - 1], seq) end
end
"""

# KEYS: tier set, engine map, key -> hashes map, pods set, then the n blocks.
# ARGV: field "P@T", pod field prefix "P@", "1" if no block key and no engine hash appears twice
# in the call (else "0"), then the n block keys K, the n engine hashes h (both hex) and the n
# digests, in block order, then the progress triple (see record_progress).
# Commands: MGET, HMGET, MSET, SADD x2, HSET x2 (one when every h is its K); one more HMGET (and
# an HDEL) in the rare cases that a hash is re-pointed, a held block gets a new hash, or a key or
# hash repeats in the call.
_STORE = _Script(
    "#!lua\n"
    + _LUA_HELPERS
    + """
local function run()
  local tier_set, engine, hashes_of, pods = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local field, pod_prefix, distinct = ARGV[1], ARGV[2], ARGV[3] == '1'
  local n = #KEYS - 4
  local K, H, D = 3, 3 + n, 3 + 2 * n  -- block i: K ARGV[K + i], hash ARGV[H + i], digest ARGV[D + i]

  -- Read the blocks and the engine hashes, then in one pass over the blocks: add the entry to every
  -- block that lacks it (a block named twice gets the same value twice), and point each engine
  -- hash at its digest, linking (K, hash) in the key -> hashes map. The common case needs no more
  -- than that pass: every hash the call changes is new to the pod and names a block the pod held
  -- on no tier (so, by the invariant, one that no hash of the pod links to), and no key or hash
  -- repeats: each change is one field in each map. Otherwise the engine hashes take the general
  -- path below.
  local before = call_range('MGET', nil, KEYS, 5, 4 + n)
  local old = call_range('HMGET', engine, ARGV, H + 1, H + n)
  local set, s = {}, 0
  local fields, links, f, l = {}, {}, 0, 0
  local simple = distinct
  for i = 1, n do
    local cur = before[i]
    if not cur then
      set[s + 1], set[s + 2], s = KEYS[4 + i], field, s + 2
    elseif not has_word(cur, field) then
      set[s + 1], set[s + 2], s = KEYS[4 + i], cur .. ' ' .. field, s + 2
    end
    if simple then
      local digest, was = ARGV[D + i], old[i]
      if was ~= digest then
        if was or (cur and has_prefix(cur, pod_prefix)) then
          simple = false
        else
          local h, key = ARGV[H + i], ARGV[K + i]
          fields[f + 1], fields[f + 2], f = h, digest, f + 2
          if h ~= key then links[l + 1], links[l + 2], l = key, h, l + 2 end
        end
      end
    end
  end
  call_range('MSET', nil, set, 1, s)
  call_range('SADD', tier_set, ARGV, K + 1, K + n)
  redis.call('SADD', pods, field)
  if simple then
    call_range('HSET', engine, fields, 1, f)
    call_range('HSET', hashes_of, links, 1, l)
    return n
  end

  -- The general path: replay the hashes in order; a change links (K, hash) and, when the hash
  -- pointed at another block, first unlinks (old K, hash); a link of a key to itself is implied,
  -- never written. Then read the links of every key touched, replay the moves on them and write
  -- back what changed.
  local now, moves, move_key, move_hash, move_link = {}, 0, {}, {}, {}
  fields, links, f = {}, {}, 0
  for i = 1, n do
    local h, digest = ARGV[H + i], ARGV[D + i]
    local cur = now[h]
    if cur == nil then cur = old[i] end
    if cur ~= digest then
      local was_key = cur and hex_key(cur)
      if was_key and was_key ~= h then
        moves = moves + 1
        move_key[moves], move_hash[moves], move_link[moves] = was_key, h, false
      end
      now[h] = digest
      fields[f + 1], fields[f + 2], f = h, digest, f + 2
      if ARGV[K + i] ~= h then
        moves = moves + 1
        move_key[moves], move_hash[moves], move_link[moves] = ARGV[K + i], h, true
      end
    end
  end
  if f == 0 then return n end
  call_range('HSET', engine, fields, 1, f)  -- a hash named twice: the last (newest) digest wins
  if moves == 0 then return n end

  local keys, linked = {}, {}
  for m = 1, moves do
    local key = move_key[m]
    if linked[key] == nil then
      keys[#keys + 1] = key
      linked[key] = false
    end
  end
  local was = call_many('HMGET', hashes_of, keys)
  for j, key in ipairs(keys) do linked[key] = was[j] end
  for m = 1, moves do
    local key, h = move_key[m], move_hash[m]
    local cur = linked[key]
    if move_link[m] then
      if not cur then
        linked[key] = h
      elseif not has_word(cur, h) then
        linked[key] = cur .. ' ' .. h
      end
    elseif cur then
      linked[key] = without(cur, h)
    end
  end
  local gone = {}
  for j, key in ipairs(keys) do
    local value = linked[key]
    if value ~= was[j] then
      if value then
        links[#links + 1] = key
        links[#links + 1] = value
      else
        gone[#gone + 1] = key
      end
    end
  end
  call_many('HSET', hashes_of, links)
  call_many('HDEL', hashes_of, gone)
  return n
end

local stored = run()
record_progress(true)
return stored
"""
)

# KEYS: engine map, key -> hashes map, pods set, tier set.
# ARGV: field "P@T", block prefix, pod field prefix "P@", then the engine hashes, then the
# progress triple (see record_progress).
# Commands: HMGET, and when a hash is known MGET + HMGET, then MSET / DEL of the blocks, SREM,
# HMGET (the implied links of the keys the pod no longer holds) + HDEL x2, EXISTS (+ SREM) for
# what changed.
_REMOVE = _Script(
    "#!lua\n"
    + _LUA_HELPERS
    + """
local function run()
  local engine, hashes_of, pods, tier_set = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local field, block_prefix, pod_prefix = ARGV[1], ARGV[2], ARGV[3]
  local last = #ARGV - 3  -- the last engine hash

  -- The blocks (and their key -> hashes entries) the known hashes point at, each read once.
  local digests = call_range('HMGET', engine, ARGV, 4, last)
  local key_at, keys, names = {}, {}, {}
  for i, digest in ipairs(digests) do
    if digest then
      local key = hex_key(digest)
      key_at[i] = key
      if names[key] == nil then
        keys[#keys + 1] = key
        names[key] = block_prefix .. key
      end
    else
      key_at[i] = false
    end
  end
  if #keys == 0 then return 0 end
  local block_names = {}
  for i, key in ipairs(keys) do block_names[i] = names[key] end
  local before = call_many('MGET', nil, block_names)
  local was = call_many('HMGET', hashes_of, keys)
  local after, linked = {}, {}
  for i, key in ipairs(keys) do
    after[block_names[i]] = before[i]
    linked[key] = was[i]
  end

  -- Replay the hashes in order: drop the entry from its block; when the pod then holds the block
  -- on no tier, every engine hash pointing at it goes (later hashes among them are unknown).
  local removed, dropped, forgotten, forgotten_links, unknown = 0, {}, {}, {}, {}
  for i = 1, last - 3 do
    local h, key = ARGV[3 + i], key_at[i]
    if key and not unknown[h] then
      local name = names[key]
      local cur = after[name]
      if cur and has_word(cur, field) then
        local rest = without(cur, field)
        after[name] = rest
        removed = removed + 1
        dropped[#dropped + 1] = key
        local hs = linked[key]
        if hs ~= nil and not (rest and has_prefix(rest, pod_prefix)) then
          if hs then
            for w in string.gmatch(hs, '%S+') do unknown[w] = true end
          end
          forgotten[#forgotten + 1] = key
          forgotten_links[#forgotten] = hs
          linked[key] = nil
        end
      end
    end
  end
  if removed == 0 then return 0 end
  save_blocks(block_names, before, after)
  call_many('SREM', tier_set, dropped)
  call_many('HDEL', engine, hashes_of_keys(engine, forgotten, forgotten_links))
  call_many('HDEL', hashes_of, forgotten)
  if redis.call('EXISTS', tier_set) == 0 then redis.call('SREM', pods, field) end
  return removed
end

local removed = run()
record_progress(true)
return removed
"""
)

# KEYS: pods set, engine map, key -> hashes map.
# ARGV: pod field prefix "P@", block prefix, tier-set prefix "kv.2:{M}:p:P:t:", the most entries
# to remove (>= 1), then the progress triple (see record_progress), recorded by the call that
# finishes the clear. Returns {entries removed, 1 if the pod has entries left else 0}.
# Commands per 1000 entries: SPOP, MGET, MSET / DEL of the blocks, HMGET x2 + HDEL x2 for the
# keys the pod then holds on no tier; per tier: EXISTS, SREM.
_CLEAR_POD = _Script(
    "#!lua\n"
    + _LUA_HELPERS
    + """
local pods, engine, hashes_of = KEYS[1], KEYS[2], KEYS[3]
local pod_prefix, block_prefix, tier_prefix, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])

-- Drop the entry field from the blocks of keys (just popped from its tier set); as in a remove,
-- the engine hashes of a key go when the pod no longer holds it on any tier. So every invariant
-- holds between two calls.
local function drop(field, keys)
  local block_names, after, orphans = {}, {}, {}
  for i, key in ipairs(keys) do block_names[i] = block_prefix .. key end
  local before = redis.call('MGET', unpack(block_names))
  for i, name in ipairs(block_names) do
    local rest = before[i] and without(before[i], field)
    after[name] = rest
    if not (rest and has_prefix(rest, pod_prefix)) then orphans[#orphans + 1] = keys[i] end
  end
  save_blocks(block_names, before, after)
  if #orphans == 0 then return end
  local linked = redis.call('HMGET', hashes_of, unpack(orphans))
  call_many('HDEL', engine, hashes_of_keys(engine, orphans, linked))
  redis.call('HDEL', hashes_of, unpack(orphans))
end

-- Returns the entries removed and whether the pod has entries left.
local function run()
  local removed = 0
  for _, field in ipairs(redis.call('SMEMBERS', pods)) do
    if string.sub(field, 1, #pod_prefix) == pod_prefix then
      if removed == limit then return removed, true end
      local tier_set = tier_prefix .. string.sub(field, #pod_prefix + 1)
      local keys
      repeat
        keys = redis.call('SPOP', tier_set, math.min(1000, limit - removed))
        if #keys > 0 then drop(field, keys) end
        removed = removed + #keys
      until #keys == 0 or removed == limit
      if redis.call('EXISTS', tier_set) == 1 then return removed, true end
      redis.call('SREM', pods, field)
    end
  end
  redis.call('DEL', engine, hashes_of)
  return removed, false
end

local removed, more = run()
record_progress(not more)
return {removed, more and 1 or 0}
"""
)

# KEYS: seq hash. ARGV: encoded holder, seq. A Progress with no write to go with: a script rather
# than a plain HSET, so that when the server has lost the scripts it is refused (and sent again)
# with the calls before it, and never lands before them.
_PROGRESS = _Script("""#!lua
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 0
""")

# KEYS: pods set. ARGV: pod prefix "kv.2:{M}:p:". Returns a flat list: "P@T", count, ...
_POD_BLOCKS = _Script("""#!lua flags=no-writes
local out = {}
for _, field in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local at = string.find(field, '@', 1, true)
  local tier_set = ARGV[1] .. string.sub(field, 1, at - 1) .. ':t:' .. string.sub(field, at + 1)
  out[#out + 1] = field
  out[#out + 1] = redis.call('SCARD', tier_set)
end
return out
""")

# KEYS: the speculative keys kv.2:{M}:s:K of one request. ARGV: encoded pod P, now and until (Unix
# ms, integers). Each key keeps its unexpired entries of other pods, gets "P=until", and expires
# with the last of its entries.
_SPECULATE = _Script("""#!lua
local pod, now, mine = ARGV[1], tonumber(ARGV[2]), ARGV[1] .. '=' .. ARGV[3]
for _, key in ipairs(KEYS) do
  local entries, last, value = {mine}, tonumber(ARGV[3]), redis.call('GET', key)
  if value then
    for entry in string.gmatch(value, '%S+') do
      local at = string.find(entry, '=', 1, true)
      local until_ms = tonumber(string.sub(entry, at + 1))
      if string.sub(entry, 1, at - 1) ~= pod and until_ms > now then
        entries[#entries + 1] = entry
        if until_ms > last then last = until_ms end
      end
    end
  end
  redis.call('SET', key, table.concat(entries, ' '), 'PX', math.max(1, last - now))
end
return #KEYS
""")

_SCRIPTS = (_STORE, _REMOVE, _CLEAR_POD, _PROGRESS, _POD_BLOCKS, _SPECULATE)


def _raise_if_error(reply: Any) -> Any:
    """``reply``, unless it is an error of a pipeline run with ``raise_on_error=False``."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def _held_run(values: Sequence[bytes | None], wanted: Collection[str] | None) -> list[HolderMap]:
    """The holders of the longest held run in an ``MGET``'s answer, restricted to ``wanted``.

    Each distinct block value is parsed (and filtered) once: the blocks of a shared prefix are
    held by the same entries, so most keys cost a dict look-up, and share one map."""
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
        out.append(holders)  # the same map for every block with the same holders (read-only)
    return out


def _held_each(values: Sequence[bytes | None]) -> list[HolderMap]:
    """The holders of every block in an ``MGET``'s answer, ``{}`` where none (each distinct value
    parsed once, as ``_held_run`` does)."""
    parsed: dict[bytes, HolderMap] = {}
    out: list[HolderMap] = []
    for value in values:
        if value is None:
            out.append({})
            continue
        holders = parsed.get(value)
        if holders is None:
            holders = parsed[value] = _parse_holders(value)
        out.append(holders)
    return out


def _hex_keys(values: Sequence[int]) -> list[bytes]:
    """Each block key or engine hash as 16 lower-case hex digits, done in C (``struct.error``
    outside 0..2**64-1)."""
    if not values:
        return []
    return struct.pack(f">{len(values)}Q", *values).hex(" ", 8).encode().split(b" ")


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


class _Pipelines:
    """The calls of one ``apply_updates``, sent in order, in pipelines of at most ``slice_blocks``
    of work (blocks, engine hashes, or the most entries a clear may remove): Valkey runs a
    client's pipelined commands back to back, so other clients only get in between round trips.
    Adds each call's count to ``counts`` at its update's position."""

    def __init__(self, index: RedisIndex, counts: list[int], new_models: list[str]) -> None:
        self._index = index
        self._counts = counts
        self._new_models = new_models  # sent with the first pipeline
        self._calls: list[tuple[int, _Call]] = []  # (position in updates, call)
        self._work = 0

    def room(self) -> int:
        """The work that still fits in the pending pipeline."""
        return self._index.slice_blocks - self._work

    def add(self, position: int, call: _Call, work: int) -> None:
        """Queue ``call`` for the update at ``position``, first sending what is pending if the
        call does not fit."""
        if self._work and self._work + work > self._index.slice_blocks:
            self.flush()
        self._calls.append((position, call))
        self._work += work

    def flush(self) -> bool:
        """Send what is pending in one round trip (and, when the server had lost the scripts,
        two more). Returns whether the last call was a ``clear_pod`` that left entries."""
        calls, self._calls, self._work = self._calls, [], 0
        index, models = self._index, self._new_models
        if not calls and not models:
            return False
        pipe = index._client.pipeline(transaction=False)
        if models:
            pipe.sadd(index._models_key, *(m.encode() for m in models))
        for _, (script, keys, args) in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        if models:
            _raise_if_error(replies[0])
            index._models_seen.update(models)
            self._new_models = []
            replies = replies[1:]

        refused = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if refused:
            index._load_scripts()
            pipe = index._client.pipeline(transaction=False)
            for n in refused:
                script, keys, args = calls[n][1]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            for n, reply in zip(refused, pipe.execute(raise_on_error=False), strict=True):
                replies[n] = reply
        more = False
        for (position, (script, _, _)), reply in zip(calls, replies, strict=True):
            _raise_if_error(reply)
            if script is _CLEAR_POD:
                self._counts[position] += int(reply[0])
                more = bool(reply[1])
            else:
                self._counts[position] += int(reply)
                more = False
        return more


class RedisIndex:
    """A ``KVIndex`` in a Redis or Valkey server (layout and guarantees: module docstring).

    Thread-safe: redis-py's connection pool hands each concurrent call its own connection.
    Connection and timeout errors surface as ``IndexUnavailable``.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        slice_blocks: int = DEFAULT_SLICE_BLOCKS,
    ) -> None:
        if not namespace or any(c in namespace for c in "{} ") or not namespace.isprintable():
            raise ValueError("namespace must be non-empty, printable, and free of '{', '}' and spaces")
        if slice_blocks < 1:
            raise ValueError("slice_blocks must be at least 1")
        self.slice_blocks = slice_blocks
        self._client = client
        self._namespace = namespace
        self._models_key = namespace.encode() + LAYOUT + b":models"
        self._models_seen: set[str] = set()  # set.add is atomic: no lock needed
        self._read_url: str | None = None  # set by from_url: what alookup connects to
        self._read_timeouts = (1.0, 1.0)
        self._readers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ReadConnection] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        slice_blocks: int = DEFAULT_SLICE_BLOCKS,
        **options: Any,
    ) -> RedisIndex:
        """Connect to ``redis://``, ``rediss://`` or ``unix://`` ``url``; ``options`` go to
        ``redis.Redis.from_url`` (e.g. ``max_connections``, ``socket_timeout``).

        Defaults: ``socket_connect_timeout`` 5 s, ``health_check_interval`` 30 s. Responses stay
        bytes (``decode_responses`` cannot be turned on: digests are binary)."""
        if options.pop("decode_responses", False):
            raise ValueError("the Redis index needs decode_responses=False")
        options.setdefault("socket_connect_timeout", 5)
        options.setdefault("health_check_interval", 30)
        client = redis.Redis.from_url(url, decode_responses=False, **options)
        index = cls(client, namespace=namespace, slice_blocks=slice_blocks)
        kwargs = client.connection_pool.connection_kwargs  # the URL's query wins, as in redis-py
        index._read_url = url
        index._read_timeouts = (
            kwargs.get("socket_timeout") or DEFAULT_READ_TIMEOUT,
            kwargs.get("socket_connect_timeout") or DEFAULT_READ_TIMEOUT,
        )
        return index

    # -- writes ---------------------------------------------------------------------------------

    def store(self, *, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        if blocks:
            self.apply_updates([Store(model, pod, tier, blocks)])

    def remove(self, *, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        return self.apply_updates([Remove(model, pod, tier, engine_hashes)])[0]

    @_unavailable_on_connection_error
    def clear_pod(self, *, pod: str, model: str | None = None) -> int:
        """Remove every entry of ``pod``; returns the number of ``(key, tier)`` entries. With
        ``model=None`` it walks every model in ``kv.2:models``."""
        models = self._models() if model is None else [model]
        return sum(self.apply_updates([ClearPod(m, pod) for m in models]))

    @_unavailable_on_connection_error
    def clear_pod_slice(self, *, pod: str, model: str, limit: int) -> tuple[int, bool]:
        """One call of the ``clear_pod`` script (see ``KVIndex``)."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        removed, more = self._run(*self._clear_pod_call(model, pod, limit, _NO_PROGRESS))
        return int(removed), not more

    @_unavailable_on_connection_error
    def apply_updates(self, updates: Sequence[IndexUpdate]) -> list[int]:
        """Apply ``updates`` in order (see ``KVIndex``) with the scripts of the module
        docstring, in non-transactional pipelines of at most ``slice_blocks`` blocks, engine
        hashes or cleared entries of work each (one pipeline for a batch of small updates): a
        store or remove of more is cut into slices, one script call each, and a ``clear_pod``
        ends its pipeline, then runs again, one call per round trip, until the pod is empty.
        Another client may see a prefix of the calls applied. A ``Progress`` rides as the last
        arguments of the (last) call of the update before it, or else is a call of its own.
        Empty stores and removes are not sent; models this client has not written yet are added
        to ``kv.2:models`` in the first pipeline. ``TypeError`` for anything that is not an
        ``IndexUpdate``, before anything is sent.

        When the server has lost the scripts (``SCRIPT FLUSH``, a restart), all of them are
        loaded and the calls it refused are sent again, in order: two more round trips. Only
        if another client reloaded the scripts while a pipeline ran (the server refusing a call
        and running a later one) can a call run before one that precedes it."""
        new_models: set[str] = set()
        for update in updates:
            if not isinstance(update, (Store, Remove, ClearPod, Progress)):
                raise TypeError(f"not an index update: {update!r}")
            if (isinstance(update, Progress) or (isinstance(update, Store) and update.blocks)) and (
                update.model not in self._models_seen
            ):
                new_models.add(update.model)
        counts = [0] * len(updates)
        pipelines = _Pipelines(self, counts, sorted(new_models))
        size = self.slice_blocks
        attached = False  # is updates[i] a Progress sent with the update before it?
        for i, update in enumerate(updates):
            if isinstance(update, Progress):
                if not attached:
                    mk = _model_keys(self._namespace, update.model)
                    pipelines.add(i, (_PROGRESS, [mk.seq], [encode_name(update.pod), update.seq]), 0)
                attached = False
                continue
            follower = updates[i + 1] if i + 1 < len(updates) else None
            progress = _NO_PROGRESS
            if isinstance(follower, Progress) and follower.model == update.model:
                mk = _model_keys(self._namespace, update.model)
                progress = (mk.seq, encode_name(follower.pod), follower.seq)
            if isinstance(update, (Store, Remove)):
                store = isinstance(update, Store)
                items = update.blocks if store else update.engine_hashes
                make_call = self._store_call if store else self._remove_call
                parts = slices(items, size) if items else []  # an empty one is not sent
                attached = bool(parts) and progress is not _NO_PROGRESS
                for n, part in enumerate(parts, start=1):
                    last = progress if n == len(parts) else _NO_PROGRESS
                    pipelines.add(i, make_call(update.model, update.pod, update.tier, part, last), len(part))
            else:
                attached = progress is not _NO_PROGRESS
                limit = pipelines.room()
                if limit < 1:
                    pipelines.flush()
                    limit = size
                pipelines.add(i, self._clear_pod_call(update.model, update.pod, limit, progress), limit)
                more = pipelines.flush()
                while more:
                    call = self._clear_pod_call(update.model, update.pod, size, progress)
                    removed, more = self._run(*call)
                    counts[i] += int(removed)
        pipelines.flush()
        return counts

    @_unavailable_on_connection_error
    def clear_model(self, *, model: str) -> int:
        """Remove everything under ``model``: ``clear_pod`` of every pod it lists; returns the
        number of ``(key, pod, tier)`` entries."""
        fields = self._client.smembers(_model_keys(self._namespace, model).pods)
        pods = sorted({decode_name(field.partition(b"@")[0]) for field in fields})
        return sum(self.apply_updates([ClearPod(model, pod) for pod in pods]))

    @_unavailable_on_connection_error
    def set_epoch(self, *, model: str, value: str, if_absent: bool = False) -> bool:
        """``SET`` (``NX`` with ``if_absent``) of the model's ``epoch`` string."""
        epoch = _model_keys(self._namespace, model).epoch
        return bool(self._client.set(epoch, value.encode(), nx=if_absent))

    # -- reads ----------------------------------------------------------------------------------

    @_unavailable_on_connection_error
    def resolve(self, *, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        if not engine_hashes:
            return []
        _, engine, _ = _model_keys(self._namespace, model).pod_keys(encode_name(pod))
        return self._client.hmget(engine, _hex_keys(engine_hashes))

    @_unavailable_on_connection_error
    def lookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """Holders of the longest held run of ``keys``: one ``MGET`` (see ``KVIndex``)."""
        if not keys:
            return []
        wanted = pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
        if wanted is not None and not wanted:
            return []
        names = _block_names(_model_keys(self._namespace, model).block_prefix, keys)
        return _held_run(self._client.mget(names), wanted)

    @property
    def reads_async(self) -> bool:
        """``alookup`` reads on the event loop (else it is ``lookup`` in a thread)."""
        return self._read_url is not None and self._read_url.startswith(("redis://", "unix://"))

    async def alookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """``lookup`` for an event loop: the same ``MGET`` on this loop's pipelined connection
        (``scoring.index.resp``), no thread; its errors and time-outs as ``IndexUnavailable``.
        Without such a connection (``rediss://``, or an index not made by ``from_url``) it runs
        ``lookup`` in the loop's default thread pool."""
        if not keys:
            return []
        wanted = pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
        if wanted is not None and not wanted:
            return []
        reader = self._reader()
        if reader is None:
            return await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.lookup, model=model, keys=keys, pods=wanted)
            )
        names = _block_names(_model_keys(self._namespace, model).block_prefix, keys)
        try:
            values = await reader.execute(b"MGET", *names)
        except (OSError, ConnectionError, TimeoutError, ReplyError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc
        return _held_run(values, wanted)

    def _reader(self) -> ReadConnection | None:
        if not self.reads_async:
            return None
        loop = asyncio.get_running_loop()
        reader = self._readers.get(loop)
        if reader is None:
            timeout, connect_timeout = self._read_timeouts
            reader = ReadConnection.from_url(self._read_url, timeout=timeout, connect_timeout=connect_timeout)
            self._readers[loop] = reader
        return reader

    @_unavailable_on_connection_error
    def lookup_many(self, *, model: str, queries: Sequence[LookupQuery]) -> list[list[HolderMap]]:
        """One ``MGET`` per query that can match, pipelined: one round trip for all of them."""
        prefix = _model_keys(self._namespace, model).block_prefix
        wanted = [
            pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
            for _, pods in queries
        ]
        asked = [i for i, (keys, _) in enumerate(queries) if keys and (wanted[i] is None or wanted[i])]
        out: list[list[HolderMap]] = [[] for _ in queries]
        if not asked:
            return out
        pipe = self._client.pipeline(transaction=False)
        for i in asked:
            pipe.mget(_block_names(prefix, queries[i][0]))
        for i, values in zip(asked, pipe.execute(), strict=True):
            out[i] = _held_run(values, wanted[i])
        return out

    @_unavailable_on_connection_error
    def holders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """Holders of every key (``{}`` where none): one ``MGET``."""
        if not keys:
            return []
        names = _block_names(_model_keys(self._namespace, model).block_prefix, keys)
        return _held_each(self._client.mget(names))

    async def aholders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """``holders`` for an event loop, as ``alookup`` reads."""
        if not keys:
            return []
        reader = self._reader()
        if reader is None:
            return await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.holders, model=model, keys=keys)
            )
        names = _block_names(_model_keys(self._namespace, model).block_prefix, keys)
        try:
            values = await reader.execute(b"MGET", *names)
        except (OSError, ConnectionError, TimeoutError, ReplyError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc
        return _held_each(values)

    @_unavailable_on_connection_error
    def speculate(self, *, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """One script call: the request's speculation points get ``pod``'s entry."""
        points = speculation_points(len(keys))
        if not points or seconds <= 0:
            return
        prefix = _model_keys(self._namespace, model).speculative_prefix
        names = _block_names(prefix, [keys[point] for point in points])
        now = int(time.time() * 1000)
        self._run(_SPECULATE, names, [encode_name(pod), now, now + max(1, int(seconds * 1000))])

    @_unavailable_on_connection_error
    def speculated(self, *, model: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        """One ``MGET`` of the speculation points of ``keys``."""
        points = speculation_points(len(keys))
        if not points:
            return {}
        prefix = _model_keys(self._namespace, model).speculative_prefix
        values = self._client.mget(_block_names(prefix, [keys[point] for point in points]))
        now = int(time.time() * 1000)
        holders: list[list[str]] = []
        for value in values:
            if value is None:
                break  # a run ends at the first point nobody holds
            held = []
            for entry in value.split():
                pod, _, until = entry.partition(b"=")
                if int(until) > now:
                    held.append(decode_name(pod))
            holders.append(held)
        return speculated_runs(points[: len(holders)], holders)

    @_unavailable_on_connection_error
    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        """Live block counts per (model, pod) with at least one block, sorted."""
        out: list[PodBlocks] = []
        for m in sorted(self._models()) if model is None else [model]:
            mk = _model_keys(self._namespace, m)
            flat = self._run(_POD_BLOCKS, [mk.pods], [mk.pod_prefix])
            by_pod: dict[str, dict[Tier, int]] = {}
            for i in range(0, len(flat), 2):
                count = int(flat[i + 1])
                if count:
                    pod, _, tier = flat[i].partition(b"@")
                    by_pod.setdefault(decode_name(pod), {})[decode_name(tier)] = count
            out += (PodBlocks(model=m, pod=pod, blocks_by_tier=by_pod[pod]) for pod in sorted(by_pod))
        return out

    @_unavailable_on_connection_error
    def progress(self, *, model: str | None = None) -> dict[tuple[str, str], int]:
        """``HGETALL`` of the ``seq`` hash of each model (every model in ``kv.2:models`` when
        ``None``), pipelined: one round trip."""
        models = sorted(self._models()) if model is None else [model]
        pipe = self._client.pipeline(transaction=False)
        for m in models:
            pipe.hgetall(_model_keys(self._namespace, m).seq)
        return {
            (m, decode_name(holder)): int(seq)
            for m, recorded in zip(models, pipe.execute(), strict=True)
            for holder, seq in recorded.items()
        }

    @_unavailable_on_connection_error
    def epochs(self, models: Sequence[str]) -> list[str | None]:
        """One ``GET`` per model, pipelined (their keys are in different slots): one round trip."""
        if not models:
            return []
        pipe = self._client.pipeline(transaction=False)
        for m in models:
            pipe.get(_model_keys(self._namespace, m).epoch)
        return [None if value is None else value.decode() for value in pipe.execute()]

    def ping(self) -> None:
        """Raise ``IndexUnavailable`` unless the server answers."""
        try:
            self._client.ping()
        except redis.RedisError as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc

    def close(self) -> None:
        self._client.close()
        for reader in list(self._readers.values()):
            reader.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _store_call(
        self, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock], progress: _ProgressArgs
    ) -> _Call:
        """The script, keys and arguments of a store of non-empty ``blocks``, ending with
        ``progress``."""
        mk = _model_keys(self._namespace, model)
        p, t = encode_name(pod), encode_name(tier)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        keys = [tier_prefix + t, engine, hashes_of, mk.pods]
        hex_keys = _hex_keys([b.key for b in blocks])
        block_prefix = mk.block_prefix
        keys += [block_prefix + k for k in hex_keys]
        engine_hashes = _hex_keys([b.engine_hash for b in blocks])
        distinct = len(set(hex_keys)) == len(set(engine_hashes)) == len(blocks)
        args: list[bytes | int] = [p + b"@" + t, p + b"@", b"1" if distinct else b"0", *hex_keys]
        args += engine_hashes
        args += [b.digest for b in blocks]
        args += progress
        return _STORE, keys, args

    def _remove_call(
        self, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int], progress: _ProgressArgs
    ) -> _Call:
        """The script, keys and arguments of a remove of non-empty ``engine_hashes``, ending with
        ``progress``."""
        mk = _model_keys(self._namespace, model)
        p, t = encode_name(pod), encode_name(tier)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        keys = [engine, hashes_of, mk.pods, tier_prefix + t]
        args = [p + b"@" + t, mk.block_prefix, p + b"@", *_hex_keys(engine_hashes), *progress]
        return _REMOVE, keys, args

    def _clear_pod_call(self, model: str, pod: str, limit: int, progress: _ProgressArgs) -> _Call:
        """The script, keys and arguments of one call of a ``clear_pod`` under one model that
        removes at most ``limit`` entries, with ``progress`` recorded when it finishes the pod."""
        mk = _model_keys(self._namespace, model)
        p = encode_name(pod)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        args = [p + b"@", mk.block_prefix, tier_prefix, limit, *progress]
        return _CLEAR_POD, [mk.pods, engine, hashes_of], args

    def _run(self, script: _Script, keys: Sequence[bytes], args: Sequence[bytes | int]) -> Any:
        """Run ``script`` with ``EVALSHA``; if the server does not know it, load every script and
        run it once more."""
        try:
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._load_scripts()
            return self._client.evalsha(script.sha, len(keys), *keys, *args)

    def _load_scripts(self) -> None:
        """``SCRIPT LOAD`` every script, in one round trip: loading them all at once (rather than
        the one found missing) keeps a batch of ``apply_updates`` from finding some there and
        some not."""
        pipe = self._client.pipeline(transaction=False)
        for script in _SCRIPTS:
            pipe.script_load(script.source)
        pipe.execute()

    def _models(self) -> list[str]:
        return [m.decode() for m in self._client.smembers(self._models_key)]
