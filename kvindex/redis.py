"""Redis / Valkey index on one server: shared between processes and replicas, atomic. (For a
Valkey or Redis Cluster, ``cluster`` spreads each model over every master.)

Key layout (``kv`` is the ``namespace`` option, ``.3`` the version of the layout, ``LAYOUT``,
``.3c`` in the compact layout below; ``M``, ``P``, ``T`` are the model, pod and tier
percent-encoded by ``encode_name``; ``K`` is a block key and ``h`` an engine hash, each as 8
bytes, big-endian)::

    kv.3:{M}bK        STRING D "P@T P@T ..."   block K: the head D of its digest (24 bytes: the
                                               digest but its last 8, which are K; all zero when
                                               the digest is K itself), then its (pod, tier)
                                               entries
    kv.3:{M}:p:P:t:T  SET    K ...             reverse index: the keys pod P holds on tier T
    kv.3:{M}:p:P:e    HASH   h -> K            P's engine hashes that are not their key (absent
                                               when there are none)
    kv.3:{M}:p:P:k    HASH   K -> "hh..."      the engine hashes of P pointing at K, 8 bytes
                                               each, when they are not K alone (absent when
                                               every link of P is implied)
    kv.3:{M}:pods     SET    "P@T" ...         every (pod, tier) with a non-empty reverse set
    kv.3:{M}:seq      HASH   H -> seq          progress: the last event seq applied per holder
                                               H (a pod or "pod#dp<r>", encoded), decimal
    kv.3:{M}:epoch    STRING opaque marker     set by ingest, removed only with the data
    kv.3:{M}:s:K      STRING "P=U P=U ..."     speculative entries at block key K: pod P until
                                               U (Unix ms, the writer's clock); the key expires
                                               with its last entry
    kv.3:models       SET    model names       models written through any client (a superset)

Implied links: an engine hash equal to the key it points at (an aligned engine: every block) is
written nowhere. The hashes of P pointing at a key K that P holds are ``k[K]``'s words when it
has a field, else K itself; an engine hash h points at ``e[h]`` when it has a field, else at h
when P holds h and h is among the hashes pointing at h. So an aligned pod has no ``e`` and no
``k``, and its entry costs the block's entry and a reverse-set member. When P stops holding K,
every hash pointing at K goes (their ``e`` fields, K's ``k`` field).

Digests: a digest is a property of the block (its key is the digest's last 8 bytes), so it is
kept once, in the block, for every holder: ``resolve`` answers it for the engine hash of any
holder that points at the block. A block adopted by engine hash (its digest the key itself) gets
a chain's digest when a holder stores one; never the other way round.

Two layouts (the URL's ``layout``): ``fast``, the default, keeps a reverse set as a Valkey SET
(38 bytes a member), and ``compact`` keeps it in one HASH of byte strings, ``"#" -> "m s n"``
and ``i -> "KK..."``: bucket i holds its members' 8-byte keys, one after the other (8 bytes a
member and a share of its bucket's field). Member x (its last three bytes) is in bucket ``x mod
m``, or ``x mod 2m`` when that is below ``s`` (the buckets already split: linear hashing); ``n``
counts the members. After a write, buckets split (``s`` into ``s`` and ``s + m``) while there
are more than 32 members a bucket on average, and the last bucket merges back into the one it
was split from while there are fewer than 8; a clear takes members from the last bucket. A
script reads the state and the buckets it touches (one ``HGET``, one ``HMGET``) and writes the
changed ones back (one ``HSET``): a few commands whatever the pod's size, every bucket a field
of a key the script names. The compact layout takes ~28 bytes fewer per first holder and ~30
per further one, for 2-3 times the server's CPU per stored block (``docs/performance.md``): the
buckets go through Lua as strings. The layouts' keys differ (``kv.3`` / ``kv.3c``), so switching
reads as a lost index, which ingest rebuilds.

Block names carry the key as 8 bytes and no separator (``b`` right after the tag), 10 bytes
shorter than in hex: at 16-byte allocation steps, 8 bytes saved per block on average.
``redis-cli`` shows them escaped.

The previous layouts (``kv:{M}:...``, ``kv:models``; ``kv.2:{M}:...``, ``kv.2:models``) are never
read: on a server that holds one, ingest finds no epoch marker under ``kv.3`` and rebuilds the
index from the engines (``kvindex.epochs``). Their keys only waste memory until removed, e.g.
``redis-cli --scan --pattern 'kv.2:{*' | xargs -r -n 500 redis-cli unlink`` and ``redis-cli unlink
kv.2:models`` (the same with ``kv:{*`` and ``kv:models`` for the first; ``kv:ingest:*``,
``kv:web:*``, ``kv:history:*``, ``kv:auth:*`` are not the index's).

A block is a STRING (its digest's head, then space-separated entries) rather than a HASH so that
a lookup is a single ``MGET`` of its keys: one command, one round trip, no per-key work on the
server beyond a read.

Why it is safe:

* Encoding: ``encode_name`` percent-encodes everything but ``[A-Za-z0-9_.~-]``, so an encoded
  name never contains ``@``, ``:``, ``{``, ``}``, ``/`` or a space; "" encodes to ``%``, which no
  other name encodes to. Model ``a@b`` with pod ``c`` and model ``a`` with pod ``b@c`` therefore
  never share a key or an entry. A block's name has ``b`` after the tag, every other name ``:``.
* One slot: every key of one model carries the hash tag ``{M}`` (never empty, never containing
  ``}``; a block's key bytes come after it, so a ``}`` among them is harmless), so all of them
  would live in one slot of a cluster: the ``MGET`` and every script touch one slot. That keeps
  each slice one atomic script, but a cluster would hold a whole model on one node (and
  ``redis.Redis`` does not follow a cluster's redirections): ``cluster`` is the layout for a
  cluster, at the price of phases (its module docstring). Some scripts reach keys they find in the
  data (a block through the engine map, a reverse set through the pods set) or are given as
  arguments (the ``seq`` hash of a ``Progress``); those are not declared in ``KEYS`` but share the
  tag, which Redis and Valkey Cluster accept (services that insist on declared keys only are not
  supported). ``kv.3:models`` lives in another slot and is only written outside the scripts: one
  ``SADD`` the first time this client writes a model (or its progress). ``clear_model`` leaves it,
  as other clients may have cached the model as seen; enumerating a cleared model just finds
  nothing. ``clear_pod`` and ``clear_model`` leave ``seq`` and ``epoch`` too: progress records
  what was applied, and the epoch marker is there to go only when the server loses its data.
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
  loop (``kvindex.resp``), bounded by the client's ``socket_timeout``.
* Latency: Valkey runs one script, and one client's pipelined commands, back to back, so no
  other client (scoring's ``MGET``) is served while they run. ``apply_updates`` therefore sends
  at most ``slice_blocks`` of work per pipeline (round trip). At the default 2048, a call takes
  7-15 ms on the server (``bench/index_slices.py``); unsliced, a 65536-block store took ~250 ms
  in one call, a 65536-hash remove ~550 ms and the clear of a 100k-block pod ~575 ms.
* Consistency: the invariants of ``memory`` hold here too: ``P@T`` is an entry of block ``K`` iff
  ``K`` is in ``p:P:t:T``; an engine hash of P points at a key P holds on some tier; ``p:P:k``
  with the implied links is exactly the inverse of ``p:P:e`` (so it has no field for a key P
  does not hold, and never lists just the key itself).

Cost on the server: the store and remove scripts make a fixed number of variadic commands per
call, clear_pod per 1000 keys, not a few per block: reads with ``MGET`` / ``HMGET``, writes with
``MSET``, ``HSET``, ``SADD``, ``DEL``, ... (see ``_LUA_HELPERS`` and ``_LUA_LAYOUT``); a store of
aligned blocks into a pod whose links are all implied touches no engine map at all.

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
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.exceptions import NoScriptError

from kvindex.base import (
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
from kvindex.keys import BlockKey, Digest
from kvindex.resp import ReadConnection, ReplyError

DEFAULT_NAMESPACE = "kv"
LAYOUT = b".3"
"""Appended to the namespace in every key name: the version of the layout (``.3c`` for the
compact one). Keys of another layout (``kv:...`` and ``kv.2:...``, the layouts before, or the
other of the two) are never read."""
COMPACT_LAYOUT = LAYOUT + b"c"
LAYOUTS = {"fast": False, "compact": True}
"""The values of the URL's ``layout`` option: whether reverse sets are kept in blob buckets."""
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

    block_prefix: bytes  # kv.3:{M}b
    pod_prefix: bytes  # kv.3:{M}:p:
    pods: bytes  # kv.3:{M}:pods
    seq: bytes  # kv.3:{M}:seq
    epoch: bytes  # kv.3:{M}:epoch
    speculative_prefix: bytes  # kv.3:{M}:s:

    def pod_keys(self, pod: bytes) -> tuple[bytes, bytes, bytes]:
        """The tier-set prefix, engine map and key -> engine hashes map (their states: the buckets
        are at ``name:i``) of an encoded pod."""
        base = self.pod_prefix + pod
        return base + b":t:", base + b":e", base + b":k"


@functools.lru_cache(maxsize=1024)
def _model_keys(namespace: bytes, model: str) -> _ModelKeys:
    """``namespace``: with the layout's version."""
    tagged = namespace + b":{" + encode_name(model) + b"}:"
    return _ModelKeys(
        block_prefix=tagged[:-1] + b"b",
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


# Lua helpers shared with ``cluster``. Block entries are words separated by single spaces
# (encoded names never contain one). Keys and engine hashes are strings (8 bytes here, hex in the
# cluster's layout): Lua numbers cannot hold 64 bits, so "h is K" is a string comparison.
#
# The store and remove scripts make a fixed number of commands per call (clear_pod: per 1000
# keys), not several per block: they read what the call touches with one variadic command per
# kind of key (MGET, HMGET), replay the call's blocks or hashes in order on Lua tables, and write
# back what changed with one variadic command per kind of change (MSET, DEL, HSET, HDEL, SADD,
# SREM).
_LUA_HELPERS = """
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
-- Write back what changed: now[f] (false: f goes) where it differs from was[f]; f a field of hash
-- key, or (key nil) a key of its own.
local function write_fields(key, now, was)
  local set, gone = {}, {}
  for f, value in pairs(now) do
    if value ~= was[f] then
      if value then
        set[#set + 1] = f
        set[#set + 1] = value
      else
        gone[#gone + 1] = f
      end
    end
  end
  if key then
    call_many('HSET', key, set)
    call_many('HDEL', key, gone)
  else
    call_many('MSET', nil, set)
    call_many('DEL', nil, gone)
  end
end
-- Write back the blocks whose value changed: names[i] was before[i] (false: absent) and is now
-- after[names[i]] (false: no entry left, the block goes).
local function save_blocks(names, before, after)
  local was = {}
  for i, name in ipairs(names) do was[name] = before[i] end
  write_fields(nil, after, was)
end
-- The last three arguments of a write script: the seq hash, the encoded holder and the seq of the
-- Progress that this call ends (all '' when none). Written as the call's last command, so
-- atomically with it; not while the call leaves work to a next call of the same update.
local function record_progress(finished)
  local seq = ARGV[#ARGV]
  if finished and seq ~= '' then redis.call('HSET', ARGV[#ARGV - 2], ARGV[#ARGV - 1], seq) end
end
"""

# Lua for one server's layout (module docstring): blocks carry the head of their digest; a pod's
# engine map and key -> hashes map hold only what is not implied (an engine hash equal to the key
# it points at).
_LUA_LAYOUT = """
local HEAD, NO_HEAD = 24, string.rep(string.char(0), 24)
-- The entries of a block's value (after the digest head).
local function entries_of(value) return string.sub(value, HEAD + 1) end
-- A block's value (false: none yet) with entry added and its digest's head kept, or head where
-- that was all zero (a key adopted by engine hash, then stored with a chain's digest).
local function with_entry(value, head, entry)
  if not value then return head .. entry end
  local rest = entries_of(value)
  if not has_word(rest, entry) then rest = rest .. ' ' .. entry end
  if string.sub(value, 1, HEAD) == NO_HEAD then value = head end
  return string.sub(value, 1, HEAD) .. rest
end

-- Where the 8-byte word w is in the concatenated words of list (nil: it is not).
local function find_word8(list, w)
  for at = 1, #list, 8 do
    if string.sub(list, at, at + 7) == w then return at end
  end
  return nil
end
-- list without the word w ('' when nothing is left).
local function without8(list, w)
  local at = find_word8(list, w)
  if not at then return list end
  return string.sub(list, 1, at - 1) .. string.sub(list, at + 8)
end

-- A pod's links between engine hashes and keys, read into tables: E[h] the key an explicit
-- engine hash points at (false: none), L[x] the hashes pointing at key x when not implied (false:
-- implied, "x itself" if the pod holds x), held[x] whether the pod holds x on some tier. Each is
-- read for the words asked with links_read; links_write writes back what changed.
local function links_new(engine, hashes_of)
  return {engine = engine, hashes_of = hashes_of, E = {}, L = {}, E0 = {}, L0 = {}, held = {}}
end
-- The words of list not read into t yet, each marked read (false until its value lands).
local function unread(t, list)
  local want = {}
  for _, w in ipairs(list) do
    if t[w] == nil then
      t[w] = false
      want[#want + 1] = w
    end
  end
  return want
end
local function links_read(lk, hashes, keys)
  local e_want, l_want = unread(lk.E, hashes), unread(lk.L, keys)
  local got = call_many('HMGET', lk.engine, e_want)
  for j, h in ipairs(e_want) do lk.E[h], lk.E0[h] = got[j] or false, got[j] or false end
  got = call_many('HMGET', lk.hashes_of, l_want)
  for j, x in ipairs(l_want) do lk.L[x], lk.L0[x] = got[j] or false, got[j] or false end
end
-- The key engine hash h points at (nil: none); E, L and held of h read.
local function links_target(lk, h)
  if lk.E[h] then return lk.E[h] end
  if lk.held[h] and (not lk.L[h] or find_word8(lk.L[h], h)) then return h end
  return nil
end
-- The hashes pointing at key x, concatenated; L and held of x read.
local function links_of(lk, x)
  if lk.L[x] then return lk.L[x] end
  if lk.held[x] then return x end
  return ''
end
-- L[x] = list, implied when it is x alone.
local function links_set(lk, x, list)
  if list == x then list = false end
  lk.L[x] = list
end
-- Point h at key (held by the pod; was_held: before this block), first unlinking it from its
-- old key; L of both read.
local function links_point(lk, h, key, was_held)
  local old = links_target(lk, h)
  if old == key then return end
  if old then
    if old ~= h then lk.E[h] = false end
    links_set(lk, old, without8(links_of(lk, old), h))
  end
  if h ~= key then lk.E[h] = key end
  local list = lk.L[key] or (was_held and key or '')
  if not find_word8(list, h) then list = list .. h end
  links_set(lk, key, list)
end
-- The pod stops holding key x: every hash pointing at it goes; returns them.
local function links_forget(lk, x)
  local list = links_of(lk, x)
  for at = 1, #list, 8 do
    local h = string.sub(list, at, at + 7)
    if h ~= x then lk.E[h] = false end
  end
  lk.L[x], lk.held[x] = false, false
  return list
end
local function links_write(lk)
  write_fields(lk.engine, lk.E, lk.E0)
  write_fields(lk.hashes_of, lk.L, lk.L0)
end
-- The keys that hashes (E read for them) may point at, each once, in order: the explicit link,
-- else the hash itself (an implied link, if the pod holds it).
local function links_candidates(lk, hashes)
  local cands, seen = {}, {}
  for _, h in ipairs(hashes) do
    local x = lk.E[h] or h
    if not seen[x] then
      seen[x] = true
      cands[#cands + 1] = x
    end
  end
  return cands
end
-- The pod stops holding key x in a remove: its hashes go (links_forget) and are marked in
-- unknown, so that a later hash of the same call among them removes nothing.
local function links_drop(lk, x, unknown)
  local list = links_forget(lk, x)
  for at = 1, #list, 8 do unknown[string.sub(list, at, at + 7)] = true end
end
"""

# A pod's reverse set on a tier, in one of two layouts (``RedisIndex``'s ``compact``): a SET of
# its keys, or the keys in blob buckets (module docstring). Both give the scripts the same calls.
_LUA_REVERSE_SET = """
local function rev_open(key) return {key = key} end
local function rev_add(r, list, first, last) call_range('SADD', r.key, list, first, last) end
local function rev_remove(r, list) call_many('SREM', r.key, list) end
local function rev_pop(r, count) return redis.call('SPOP', r.key, count) end
local function rev_save(r) end
local function rev_empty(r) return redis.call('EXISTS', r.key) == 0 end
local function rev_count(key) return redis.call('SCARD', key) end
"""
_LUA_BLOBS = (
    """
local BLOB_FILL, BLOB_LOW = 32, 8
"""
    + """
-- A set of 8-byte keys in blob buckets: fields of a hash, each name after prefix ('' when the
-- set has the hash to itself): '#' is the state "m s n", i is bucket i, its members concatenated.
-- Member x is in bucket x mod m, or x mod 2m when that is below s (x: its last three bytes).
-- Buckets are read as needed and written back by blob_save.
local function blob_open(key, prefix)
  local state = redis.call('HGET', key, prefix .. '#')
  local b = {key = key, prefix = prefix, m = 1, s = 0, n = 0, was = state or false, blobs = {}, dirty = {}}
  if state then
    local m, s, n = string.match(state, '^(%d+) (%d+) (%d+)$')
    b.m, b.s, b.n = tonumber(m), tonumber(s), tonumber(n)
  end
  return b
end
local function blob_index(b, x)
  local p, q, r = string.byte(x, -3, -1)
  local v = (p * 256 + q) * 256 + r
  local i = v % b.m
  if i < b.s then i = v % (2 * b.m) end
  return i
end
-- Read the buckets not read yet among those of list[first..last] (one HMGET), or of bucket i.
local function blob_load(b, list, first, last)
  local want, seen = {}, {}
  for j = first, last do
    local i = blob_index(b, list[j])
    if b.blobs[i] == nil and not seen[i] then
      seen[i] = true
      want[#want + 1] = i
    end
  end
  if #want == 0 then return end
  local fields = {}
  for j, i in ipairs(want) do fields[j] = b.prefix .. i end
  local got = call_many('HMGET', b.key, fields)
  for j, i in ipairs(want) do b.blobs[i] = got[j] or '' end
end
local function blob_bucket(b, i)
  if b.blobs[i] == nil then b.blobs[i] = redis.call('HGET', b.key, b.prefix .. i) or '' end
  return b.blobs[i]
end
-- Where member x is in blob (nil: it is not).
local function blob_find(blob, x)
  local from = 1
  while true do
    local at = string.find(blob, x, from, true)
    if not at or at % 8 == 1 then return at end
    from = at + 1
  end
end
-- Add (remove) member x, its bucket read; whether it was added (removed).
local function blob_add(b, x)
  local i = blob_index(b, x)
  local blob = b.blobs[i]
  if blob_find(blob, x) then return false end
  b.blobs[i], b.dirty[i], b.n = blob .. x, true, b.n + 1
  return true
end
local function blob_remove(b, x)
  local i = blob_index(b, x)
  local blob = b.blobs[i]
  local at = blob_find(blob, x)
  if not at then return false end
  b.blobs[i], b.dirty[i], b.n = string.sub(blob, 1, at - 1) .. string.sub(blob, at + 8), true, b.n - 1
  return true
end
-- One more bucket: bucket s splits into s and s + m.
local function blob_split(b)
  local s, m = b.s, b.m
  local keep, move, blob = {}, {}, blob_bucket(b, s)
  for at = 1, #blob, 8 do
    local x = string.sub(blob, at, at + 7)
    local p, q, r = string.byte(x, -3, -1)
    if ((p * 256 + q) * 256 + r) % (2 * m) == s then keep[#keep + 1] = x else move[#move + 1] = x end
  end
  b.blobs[s], b.blobs[s + m] = table.concat(keep), table.concat(move)
  b.dirty[s], b.dirty[s + m] = true, true
  b.s = s + 1
  if b.s == m then b.m, b.s = 2 * m, 0 end
end
-- One bucket fewer: the last goes back into the bucket it was split from.
local function blob_shrink(b)
  if b.s == 0 then b.m, b.s = b.m / 2, b.m / 2 end
  b.s = b.s - 1
  local last, into = b.s + b.m, b.s
  b.blobs[into] = blob_bucket(b, into) .. blob_bucket(b, last)
  b.blobs[last] = ''
  b.dirty[into], b.dirty[last] = true, true
end
-- Take up to count members, from the last buckets (a bucket emptied goes).
local function blob_pop(b, count)
  local out = {}
  while #out < count and b.n > 0 do
    local last = b.m + b.s - 1
    local blob = blob_bucket(b, last)
    local take = math.min(count - #out, #blob / 8)
    for at = #blob - 8 * take + 1, #blob, 8 do out[#out + 1] = string.sub(blob, at, at + 7) end
    b.blobs[last], b.dirty[last], b.n = string.sub(blob, 1, #blob - 8 * take), true, b.n - take
    if #b.blobs[last] == 0 then  -- the emptied last bucket goes: nothing to move back
      if last == 0 then break end
      if b.s == 0 then b.m, b.s = b.m / 2, b.m / 2 end
      b.s = b.s - 1
    end
  end
  return out
end
-- Keep BLOB_LOW .. BLOB_FILL members a bucket on average (splitting, merging), then write the
-- buckets that changed and the state; an empty set goes whole (with the hash if it is its own).
local function blob_save(b)
  local p, set, gone = b.prefix, {}, {}
  if b.n <= 0 then
    if b.was and p == '' then
      redis.call('DEL', b.key)
    elseif b.was then
      gone[1] = p .. '#'
      for i = 0, b.m + b.s - 1 do gone[#gone + 1] = p .. i end
      for i in pairs(b.dirty) do
        if i >= b.m + b.s then gone[#gone + 1] = p .. i end
      end
      call_many('HDEL', b.key, gone)
    end
    return
  end
  while b.n > BLOB_FILL * (b.m + b.s) do blob_split(b) end
  while b.m + b.s > 1 and b.n < BLOB_LOW * (b.m + b.s) do blob_shrink(b) end
  local state = b.m .. ' ' .. b.s .. ' ' .. b.n
  if state ~= b.was then set[1], set[2] = p .. '#', state end
  for i in pairs(b.dirty) do
    if i >= b.m + b.s or b.blobs[i] == '' then
      gone[#gone + 1] = p .. i
    else
      set[#set + 1] = p .. i
      set[#set + 1] = b.blobs[i]
    end
  end
  call_many('HSET', b.key, set)
  call_many('HDEL', b.key, gone)
end
"""
)
_LUA_REVERSE_BUCKETS = (
    _LUA_BLOBS
    + """
local function rev_open(key) return blob_open(key, '') end
local rev_pop, rev_save = blob_pop, blob_save
local function rev_add(r, list, first, last)
  blob_load(r, list, first, last)
  for i = first, last do blob_add(r, list[i]) end
end
local function rev_remove(r, list)
  blob_load(r, list, 1, #list)
  for _, x in ipairs(list) do blob_remove(r, x) end
end
local function rev_empty(r) return r.n <= 0 end
local function rev_count(key)
  local state = redis.call('HGET', key, '#')
  return state and tonumber(string.match(state, '(%d+)$')) or 0
end
"""
)

# KEYS: tier set, engine map, key -> hashes map, pods set, then the n blocks.
# ARGV: field "P@T", pod field prefix "P@", then the n block keys K and the n engine hashes h (8
# bytes each) and the n digest heads, in block order, then the progress triple (see
# record_progress).
# Commands: MGET, MSET, SADD x2, EXISTS; only when the pod has links that are not implied (an
# engine hash that is not its key), or this call makes some: HMGET x2 (and MGET of the blocks of
# hashes not in the call), HSET and HDEL of what changed.
_STORE_BODY = """
local function run()
  local tier_set, engine, hashes_of, pods = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local field, pod_prefix = ARGV[1], ARGV[2]
  local n = #KEYS - 4
  local K, H, D = 2, 2 + n, 2 + 2 * n  -- block i: K ARGV[K + i], hash ARGV[H + i], head ARGV[D + i]

  -- The blocks: the entry added where it lacks, the head of the digest kept (one of a chain's
  -- digest replaces the key's, all zero, when the key was adopted by engine hash).
  local names, before = {}, call_range('MGET', nil, KEYS, 5, 4 + n)
  local after, held_before, aligned = {}, {}, true
  for i = 1, n do
    local name, key, head = KEYS[4 + i], ARGV[K + i], ARGV[D + i]
    names[i] = name
    local cur = after[name]
    if cur == nil then
      cur = before[i] or false
      held_before[key] = cur and has_prefix(entries_of(cur), pod_prefix) or false
    end
    after[name] = with_entry(cur, head, field)
    if ARGV[H + i] ~= key then aligned = false end
  end
  save_blocks(names, before, after)
  local reverse = rev_open(tier_set)
  rev_add(reverse, ARGV, K + 1, K + n)
  rev_save(reverse)
  redis.call('SADD', pods, field)
  if aligned and redis.call('EXISTS', engine, hashes_of) == 0 then return n end  -- every link implied

  -- Replay the links in order on tables: each hash points at its block from now on.
  local lk = links_new(engine, hashes_of)
  local hashes, words, others = {}, {}, {}
  for i = 1, n do
    hashes[i] = ARGV[H + i]
    words[#words + 1] = ARGV[K + i]
    words[#words + 1] = ARGV[H + i]
  end
  links_read(lk, hashes, {})
  for _, h in ipairs(hashes) do
    if lk.E[h] then words[#words + 1] = lk.E[h] end
  end
  links_read(lk, {}, words)
  for _, x in ipairs(words) do
    if held_before[x] == nil and lk.held[x] == nil then
      lk.held[x] = false
      others[#others + 1] = x
    end
  end
  if #others > 0 then
    local other_names = {}
    for j, x in ipairs(others) do other_names[j] = string.sub(KEYS[5], 1, -9) .. x end
    local values = call_many('MGET', nil, other_names)
    for j, x in ipairs(others) do
      lk.held[x] = values[j] and has_prefix(entries_of(values[j]), pod_prefix) or false
    end
  end
  for x, was in pairs(held_before) do lk.held[x] = was end
  for i = 1, n do
    local key = ARGV[K + i]
    local was_held = lk.held[key]
    lk.held[key] = true
    links_point(lk, ARGV[H + i], key, was_held)
  end
  links_write(lk)
  return n
end

local stored = run()
record_progress(true)
return stored
"""

# KEYS: engine map, key -> hashes map, tier set, pods set.
# ARGV: field "P@T", block prefix, pod field prefix "P@", then the engine hashes (8 bytes each),
# then the progress triple (see record_progress).
# Commands: HMGET x2, MGET of the blocks the hashes may point at, then when one is held: MSET /
# DEL of the blocks, SREM, HSET / HDEL of what changed, EXISTS (+ SREM of the pods set when the
# tier set empties).
_REMOVE_BODY = """
local function run()
  local pods = KEYS[4]
  local field, block_prefix, pod_prefix = ARGV[1], ARGV[2], ARGV[3]
  local last = #ARGV - 3  -- the last engine hash

  -- The key each hash points at: its explicit link, else itself (implied, when the pod holds it).
  local lk = links_new(KEYS[1], KEYS[2])
  local hashes = {}
  for i = 4, last do hashes[#hashes + 1] = ARGV[i] end
  links_read(lk, hashes, {})
  local cands = links_candidates(lk, hashes)
  local names = {}
  for j, x in ipairs(cands) do names[j] = block_prefix .. x end
  local before = call_many('MGET', nil, names)
  local after = {}
  for j, x in ipairs(cands) do
    after[names[j]] = before[j]
    lk.held[x] = before[j] and has_prefix(entries_of(before[j]), pod_prefix) or false
  end
  links_read(lk, {}, cands)
  local key_at = {}
  for i, h in ipairs(hashes) do key_at[i] = links_target(lk, h) or false end

  -- Replay the hashes in order: drop the entry from its block; when the pod then holds the block
  -- on no tier, every engine hash pointing at it goes (later hashes among them are unknown).
  local removed, dropped, unknown = 0, {}, {}
  for i, h in ipairs(hashes) do
    local key = key_at[i]
    if key and not unknown[h] then
      local name = block_prefix .. key
      local cur = after[name]
      local rest = cur and entries_of(cur)
      if rest and has_word(rest, field) then
        rest = without(rest, field)
        after[name] = rest and (string.sub(cur, 1, HEAD) .. rest)
        removed = removed + 1
        dropped[#dropped + 1] = key
        if not (rest and has_prefix(rest, pod_prefix)) then links_drop(lk, key, unknown) end
      end
    end
  end
  if removed == 0 then return 0 end
  save_blocks(names, before, after)
  local reverse = rev_open(KEYS[3])
  rev_remove(reverse, dropped)
  rev_save(reverse)
  links_write(lk)
  if rev_empty(reverse) then redis.call('SREM', pods, field) end
  return removed
end

local removed = run()
record_progress(true)
return removed
"""

# KEYS: pods set, engine map, key -> hashes map.
# ARGV: pod field prefix "P@", block prefix, tier-set prefix "kv.3:{M}:p:P:t:", the most entries
# to remove (>= 1), then the progress triple (see record_progress), recorded by the call that
# finishes the clear. Returns {entries removed, 1 if the pod has entries left else 0}.
# Commands per 1000 entries: SPOP, MGET, MSET / DEL of the blocks, HMGET + HDEL x2 for the keys
# the pod then holds on no tier; per tier: EXISTS, SREM.
_CLEAR_POD_BODY = """
local pods = KEYS[1]
local pod_prefix, block_prefix, tier_prefix, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local lk = links_new(KEYS[2], KEYS[3])

-- Drop the entry field from the blocks of keys (just popped from its tier set); as in a remove,
-- the engine hashes of a key go when the pod no longer holds it on any tier. So every invariant
-- holds between two calls.
local function drop(field, keys)
  local names, after, orphans = {}, {}, {}
  for i, key in ipairs(keys) do names[i] = block_prefix .. key end
  local before = redis.call('MGET', unpack(names))
  for i, name in ipairs(names) do
    local rest = before[i] and without(entries_of(before[i]), field)
    after[name] = rest and (string.sub(before[i], 1, HEAD) .. rest)
    if not (rest and has_prefix(rest, pod_prefix)) then orphans[#orphans + 1] = keys[i] end
  end
  save_blocks(names, before, after)
  if #orphans == 0 then return end
  links_read(lk, {}, orphans)
  for _, key in ipairs(orphans) do
    lk.held[key] = true  -- until forgotten: its implied link goes with it
    links_forget(lk, key)
  end
end

-- Returns the entries removed and whether the pod has entries left.
local function run()
  local removed = 0
  for _, field in ipairs(redis.call('SMEMBERS', pods)) do
    if string.sub(field, 1, #pod_prefix) == pod_prefix then
      if removed == limit then return removed, true end
      local reverse = rev_open(tier_prefix .. string.sub(field, #pod_prefix + 1))
      local keys
      repeat
        keys = rev_pop(reverse, math.min(1000, limit - removed))
        if #keys > 0 then drop(field, keys) end
        removed = removed + #keys
      until #keys == 0 or removed == limit
      rev_save(reverse)
      if not rev_empty(reverse) then return removed, true end
      redis.call('SREM', pods, field)
    end
  end
  return removed, false
end

local removed, more = run()
links_write(lk)
if not more then redis.call('DEL', KEYS[2], KEYS[3]) end
record_progress(not more)
return {removed, more and 1 or 0}
"""

# KEYS: engine map, key -> hashes map. ARGV: block prefix, pod field prefix "P@", then engine
# hashes (8 bytes each). Returns, per hash, the digest of the block it points at (its head and
# key; the key alone when the head is all zero), or nil.
_RESOLVE_BODY = """
local block_prefix, pod_prefix = ARGV[1], ARGV[2]
local lk = links_new(KEYS[1], KEYS[2])
local hashes = {}
for i = 3, #ARGV do hashes[#hashes + 1] = ARGV[i] end
if #hashes == 0 then return {} end
links_read(lk, hashes, {})
local cands, names = {}, {}
for i, h in ipairs(hashes) do
  cands[i] = lk.E[h] or h
  names[i] = block_prefix .. cands[i]
end
local values = call_many('MGET', nil, names)
for i, x in ipairs(cands) do
  lk.held[x] = values[i] and has_prefix(entries_of(values[i]), pod_prefix) or false
end
links_read(lk, {}, cands)
local out = {}
for i, h in ipairs(hashes) do
  local key = links_target(lk, h)
  if key and lk.held[key] then
    local head = string.sub(values[i], 1, HEAD)
    out[i] = head == NO_HEAD and key or (head .. key)
  else
    out[i] = false
  end
end
return out
"""

# KEYS: seq hash. ARGV: encoded holder, seq. A Progress with no write to go with: a script rather
# than a plain HSET, so that when the server has lost the scripts it is refused (and sent again)
# with the calls before it, and never lands before them.
_PROGRESS = _Script("""#!lua
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 0
""")

# KEYS: pods set. ARGV: pod prefix "kv.3:{M}:p:". Returns a flat list: "P@T", count, ...
_POD_BLOCKS_BODY = """
local out = {}
for _, field in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local at = string.find(field, '@', 1, true)
  local tier_set = ARGV[1] .. string.sub(field, 1, at - 1) .. ':t:' .. string.sub(field, at + 1)
  out[#out + 1] = field
  out[#out + 1] = rev_count(tier_set)
end
return out
"""

# KEYS: the speculative keys kv.3:{M}:s:K of one request. ARGV: encoded pod P, now and until (Unix
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


@dataclass(frozen=True, slots=True)
class _Scripts:
    """The scripts of one layout (``RedisIndex``'s ``compact``)."""

    store: _Script
    remove: _Script
    clear_pod: _Script
    resolve: _Script
    pod_blocks: _Script
    progress: _Script = _PROGRESS
    speculate: _Script = _SPECULATE

    def __iter__(self) -> Iterator[_Script]:
        return iter(
            (
                self.store,
                self.remove,
                self.clear_pod,
                self.resolve,
                self.pod_blocks,
                self.progress,
                self.speculate,
            )
        )


def _scripts(reverse: str) -> _Scripts:
    """The scripts, with the reverse-set calls of one layout."""
    writes = "#!lua\n" + _LUA_HELPERS + _LUA_LAYOUT + reverse
    reads = "#!lua flags=no-writes\n" + _LUA_HELPERS + _LUA_LAYOUT + reverse
    return _Scripts(
        store=_Script(writes + _STORE_BODY),
        remove=_Script(writes + _REMOVE_BODY),
        clear_pod=_Script(writes + _CLEAR_POD_BODY),
        resolve=_Script(reads + _RESOLVE_BODY),
        pod_blocks=_Script(reads + _POD_BLOCKS_BODY),
    )


_FAST_SCRIPTS = _scripts(_LUA_REVERSE_SET)
_COMPACT_SCRIPTS = _scripts(_LUA_REVERSE_BUCKETS)


def _raise_if_error(reply: Any) -> Any:
    """``reply``, unless it is an error of a pipeline run with ``raise_on_error=False``."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def _held_run(
    values: Sequence[bytes | None], wanted: Collection[str] | None, head: int = 0
) -> list[HolderMap]:
    """The holders of the longest held run in an ``MGET``'s answer, restricted to ``wanted``; each
    value's entries start after ``head`` bytes.

    Each distinct list of entries is parsed (and filtered) once: the blocks of a shared prefix are
    held by the same entries, so most keys cost a dict look-up, and share one map."""
    parsed: dict[bytes, HolderMap] = {}
    out: list[HolderMap] = []
    for value in values:
        if value is None:
            break
        if head:
            value = value[head:]
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


def _held_each(values: Sequence[bytes | None], head: int = 0) -> list[HolderMap]:
    """The holders of every block in an ``MGET``'s answer, ``{}`` where none (each distinct list
    of entries, after ``head`` bytes, parsed once, as ``_held_run`` does)."""
    parsed: dict[bytes, HolderMap] = {}
    out: list[HolderMap] = []
    for value in values:
        if value is None:
            out.append({})
            continue
        if head:
            value = value[head:]
        holders = parsed.get(value)
        if holders is None:
            holders = parsed[value] = _parse_holders(value)
        out.append(holders)
    return out


_PACK_WORD = struct.Struct(">Q").pack


def _speculated_runs(points: list[int], values: Sequence[bytes | None]) -> dict[str, int]:
    """``speculated_runs`` of the ``MGET`` of the speculation points: each value the entries
    ``pod=until_ms`` of one point, separated by spaces; entries past their time do not count."""
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


def _arg(value: bytes | int) -> bytes:
    """A script argument as RESP sends it (redis-py writes an int in decimal, so does this)."""
    return value if isinstance(value, bytes) else b"%d" % value


def _words(values: Sequence[int]) -> list[bytes]:
    """Each block key or engine hash as 8 bytes, big-endian: how names and the per-holder
    structures hold them (``struct.error`` outside 0..2**64-1)."""
    return list(map(_PACK_WORD, values))


HEAD = 24
"""Bytes of a block's value before its entries: the head of its digest (module docstring)."""
_NO_HEAD = bytes(HEAD)
"""The head of a block whose digest is its key (adopted by engine hash: no chain goes on from it)."""


def _digest_head(digest: Digest) -> bytes:
    """What a block's value starts with: its chain digest without the last 8 bytes (the block key,
    in its name), or ``_NO_HEAD`` for a digest that is the key itself."""
    if len(digest) == 32:
        return digest[:24]
    if len(digest) == 8:
        return _NO_HEAD
    raise ValueError(f"a digest has 32 or 8 bytes, not {len(digest)}")


def _block_names(block_prefix: bytes, keys: Sequence[BlockKey]) -> list[bytes]:
    """``block_prefix + K`` for every key, K as 8 bytes (big-endian): mapped in C, as it is most
    of a lookup's Python time; ``struct.error`` for a key outside 0..2**64-1."""
    return list(map(block_prefix.__add__, map(_PACK_WORD, keys)))


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
            if script is index._scripts.clear_pod:
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
        compact: bool = False,
    ) -> None:
        if not namespace or any(c in namespace for c in "{} ") or not namespace.isprintable():
            raise ValueError("namespace must be non-empty, printable, and free of '{', '}' and spaces")
        if slice_blocks < 1:
            raise ValueError("slice_blocks must be at least 1")
        self.slice_blocks = slice_blocks
        self._client = client
        self._prefix = namespace.encode() + (COMPACT_LAYOUT if compact else LAYOUT)
        self._models_key = self._prefix + b":models"
        self._scripts = _COMPACT_SCRIPTS if compact else _FAST_SCRIPTS
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
        ``redis.Redis.from_url`` (e.g. ``max_connections``, ``socket_timeout``), but for the
        index's ``layout`` (in the URL's query too): ``fast`` (the default) or ``compact``
        (module docstring).

        Defaults: ``socket_connect_timeout`` 5 s, ``health_check_interval`` 30 s. Responses stay
        bytes (``decode_responses`` cannot be turned on: digests are binary)."""
        if options.pop("decode_responses", False):
            raise ValueError("the Redis index needs decode_responses=False")
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        layout = options.pop("layout", None) or dict(query).get("layout", "fast")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown index layout {layout!r}; known: {', '.join(LAYOUTS)}")
        url = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k != "layout"])))
        options.setdefault("socket_connect_timeout", 5)
        options.setdefault("health_check_interval", 30)
        client = redis.Redis.from_url(url, decode_responses=False, **options)
        index = cls(client, namespace=namespace, slice_blocks=slice_blocks, compact=LAYOUTS[layout])
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
        ``model=None`` it walks every model in ``kv.3:models``."""
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
        to ``kv.3:models`` in the first pipeline. ``TypeError`` for anything that is not an
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
                    mk = _model_keys(self._prefix, update.model)
                    progress_call = (self._scripts.progress, [mk.seq], [encode_name(update.pod), update.seq])
                    pipelines.add(i, progress_call, 0)
                attached = False
                continue
            follower = updates[i + 1] if i + 1 < len(updates) else None
            progress = _NO_PROGRESS
            if isinstance(follower, Progress) and follower.model == update.model:
                mk = _model_keys(self._prefix, update.model)
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
        fields = self._client.smembers(_model_keys(self._prefix, model).pods)
        pods = sorted({decode_name(field.partition(b"@")[0]) for field in fields})
        return sum(self.apply_updates([ClearPod(model, pod) for pod in pods]))

    @_unavailable_on_connection_error
    def set_epoch(self, *, model: str, value: str, if_absent: bool = False) -> bool:
        """``SET`` (``NX`` with ``if_absent``) of the model's ``epoch`` string."""
        epoch = _model_keys(self._prefix, model).epoch
        return bool(self._client.set(epoch, value.encode(), nx=if_absent))

    # -- reads ----------------------------------------------------------------------------------

    @_unavailable_on_connection_error
    def resolve(self, *, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        if not engine_hashes:
            return []
        mk = _model_keys(self._prefix, model)
        p = encode_name(pod)
        _, engine, hashes_of = mk.pod_keys(p)
        args = [mk.block_prefix, p + b"@", *_words(engine_hashes)]
        return self._run(self._scripts.resolve, [engine, hashes_of], args)

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
        names = _block_names(_model_keys(self._prefix, model).block_prefix, keys)
        return _held_run(self._client.mget(names), wanted, HEAD)

    @property
    def reads_async(self) -> bool:
        """``alookup`` reads on the event loop (else it is ``lookup`` in a thread)."""
        return self._read_url is not None and self._read_url.startswith(("redis://", "unix://"))

    async def alookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """``lookup`` for an event loop: the same ``MGET`` on this loop's pipelined connection
        (``kvindex.resp``), no thread; its errors and time-outs as ``IndexUnavailable``.
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
        names = _block_names(_model_keys(self._prefix, model).block_prefix, keys)
        try:
            values = await reader.execute(b"MGET", *names)
        except (OSError, ConnectionError, TimeoutError, ReplyError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc
        return _held_run(values, wanted, HEAD)

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
        prefix = _model_keys(self._prefix, model).block_prefix
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
            out[i] = _held_run(values, wanted[i], HEAD)
        return out

    @_unavailable_on_connection_error
    def holders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """Holders of every key (``{}`` where none): one ``MGET``."""
        if not keys:
            return []
        names = _block_names(_model_keys(self._prefix, model).block_prefix, keys)
        return _held_each(self._client.mget(names), HEAD)

    async def aholders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """``holders`` for an event loop, as ``alookup`` reads."""
        if not keys:
            return []
        reader = self._reader()
        if reader is None:
            return await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.holders, model=model, keys=keys)
            )
        names = _block_names(_model_keys(self._prefix, model).block_prefix, keys)
        try:
            values = await reader.execute(b"MGET", *names)
        except (OSError, ConnectionError, TimeoutError, ReplyError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc
        return _held_each(values, HEAD)

    @_unavailable_on_connection_error
    def speculate(self, *, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """One script call: the request's speculation points get ``pod``'s entry."""
        call = self._speculate_call(model, pod, keys, seconds)
        if call is not None:
            self._run(*call)

    async def aspeculate(self, *, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """``speculate`` for an event loop: the same script call on this loop's pipelined
        connection (``alookup``'s), no thread; if the server lacks the script, ``speculate`` in the
        loop's default thread pool loads it. Errors and time-outs as ``IndexUnavailable``."""
        call = self._speculate_call(model, pod, keys, seconds)
        if call is None:
            return
        reader = self._reader()
        if reader is not None:
            script, names, args = call
            try:
                await reader.execute(
                    b"EVALSHA", script.sha.encode(), b"%d" % len(names), *names, *map(_arg, args)
                )
                return
            except ReplyError as exc:
                if not str(exc).startswith("NOSCRIPT"):
                    raise IndexUnavailable(f"the Redis index refused a speculative entry: {exc}") from exc
            except (OSError, ConnectionError, TimeoutError) as exc:
                raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.speculate, model=model, pod=pod, keys=keys, seconds=seconds)
        )

    def _speculate_call(self, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> _Call | None:
        points = speculation_points(len(keys))
        if not points or seconds <= 0:
            return None
        prefix = _model_keys(self._prefix, model).speculative_prefix
        names = _block_names(prefix, [keys[point] for point in points])
        now = int(time.time() * 1000)
        return self._scripts.speculate, names, [encode_name(pod), now, now + max(1, int(seconds * 1000))]

    @_unavailable_on_connection_error
    def speculated(self, *, model: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        """One ``MGET`` of the speculation points of ``keys``."""
        points = speculation_points(len(keys))
        if not points:
            return {}
        prefix = _model_keys(self._prefix, model).speculative_prefix
        values = self._client.mget(_block_names(prefix, [keys[point] for point in points]))
        return _speculated_runs(points, values)

    async def aspeculated(self, *, model: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        """``speculated`` for an event loop, as ``alookup`` reads (the same ``MGET``, on this loop's
        pipelined connection: read together with ``alookup``, one round trip for both)."""
        points = speculation_points(len(keys))
        if not points:
            return {}
        reader = self._reader()
        if reader is None:
            return await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.speculated, model=model, keys=keys)
            )
        prefix = _model_keys(self._prefix, model).speculative_prefix
        try:
            values = await reader.execute(b"MGET", *_block_names(prefix, [keys[point] for point in points]))
        except (OSError, ConnectionError, TimeoutError, ReplyError) as exc:
            raise IndexUnavailable(f"the Redis index is unreachable: {exc}") from exc
        return _speculated_runs(points, values)

    @_unavailable_on_connection_error
    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        """Live block counts per (model, pod) with at least one block, sorted."""
        out: list[PodBlocks] = []
        for m in sorted(self._models()) if model is None else [model]:
            mk = _model_keys(self._prefix, m)
            flat = self._run(self._scripts.pod_blocks, [mk.pods], [mk.pod_prefix])
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
        """``HGETALL`` of the ``seq`` hash of each model (every model in ``kv.3:models`` when
        ``None``), pipelined: one round trip."""
        models = sorted(self._models()) if model is None else [model]
        pipe = self._client.pipeline(transaction=False)
        for m in models:
            pipe.hgetall(_model_keys(self._prefix, m).seq)
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
            pipe.get(_model_keys(self._prefix, m).epoch)
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
        mk = _model_keys(self._prefix, model)
        p, t = encode_name(pod), encode_name(tier)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        keys = [tier_prefix + t, engine, hashes_of, mk.pods]
        keys += _block_names(mk.block_prefix, [b.key for b in blocks])
        args: list[bytes | int] = [p + b"@" + t, p + b"@", *_words([b.key for b in blocks])]
        args += _words([b.engine_hash for b in blocks])
        args += [_digest_head(b.digest) for b in blocks]
        args += progress
        return self._scripts.store, keys, args

    def _remove_call(
        self, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int], progress: _ProgressArgs
    ) -> _Call:
        """The script, keys and arguments of a remove of non-empty ``engine_hashes``, ending with
        ``progress``."""
        mk = _model_keys(self._prefix, model)
        p, t = encode_name(pod), encode_name(tier)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        keys = [engine, hashes_of, tier_prefix + t, mk.pods]
        args = [p + b"@" + t, mk.block_prefix, p + b"@", *_words(engine_hashes), *progress]
        return self._scripts.remove, keys, args

    def _clear_pod_call(self, model: str, pod: str, limit: int, progress: _ProgressArgs) -> _Call:
        """The script, keys and arguments of one call of a ``clear_pod`` under one model that
        removes at most ``limit`` entries, with ``progress`` recorded when it finishes the pod."""
        mk = _model_keys(self._prefix, model)
        p = encode_name(pod)
        tier_prefix, engine, hashes_of = mk.pod_keys(p)
        args = [p + b"@", mk.block_prefix, tier_prefix, limit, *progress]
        return self._scripts.clear_pod, [mk.pods, engine, hashes_of], args

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
        for script in self._scripts:
            pipe.script_load(script.source)
        pipe.execute()

    def _models(self) -> list[str]:
        return [m.decode() for m in self._client.smembers(self._models_key)]
