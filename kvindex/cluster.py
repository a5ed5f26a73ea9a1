"""Valkey / Redis Cluster index: one model's blocks spread over every master, each pod's own
structures in one slot, written in phases that keep the index consistent between them.

Key layout (``kv`` is the ``namespace`` option, ``.3`` the version of the layout, as in
``redis``; ``M``, ``P``, ``T`` are the model, the holder (a pod or ``pod#dp<r>``) and the tier,
percent-encoded by ``encode_name``; ``K`` is a block key and ``h`` an engine hash, each as 8
bytes, and ``B`` is K as a hash tag: 11 base64url characters, ``_tags``; the hash tag is between
the braces)::

    kv.3:M:b:{B}      STRING D "P@T P@T ..."  block K: the head D of its digest (24 bytes, as in
                                              ``redis``), then its (pod, tier) entries
    kv.3:M:s:{B}      STRING "P=U P=U ..."    speculative entries (as in ``redis``), expiring
    kv.3:{M@P}:r      SET    "T K" ...        reverse index: every (tier, key) P holds
    kv.3:{M@P}:n      HASH   T -> count       entries of r per tier (only tiers with some)
    kv.3:{M@P}:e      HASH   h -> K           P's engine hashes that are not their key
    kv.3:{M@P}:k      HASH   K -> "hh..."     the engine hashes of P pointing at K, when not just
                                              K itself (implied links, as in ``redis``)
    kv.3:{M@P}:d      SET    "T K" ...        dirty: entries whose block may not match r yet
    kv.3:{M@P}:lease  STRING writer token     the writer in the middle of a phase (expires)
    kv.3:{M@P}:seq    STRING seq              progress: the last event seq applied for P
    kv.3:{M}:pods     SET    P ...            every holder written under M (a superset)
    kv.3:{M}:epoch    STRING "G marker"       the model's epoch marker, in generation G
    kv.3:M:epoch:{S}  STRING G                a witness of generation G on every master
    kv.3:models       SET    model names      models written through any client (a superset)

Against the layout before (``kv.2``: hex keys, a digest per engine hash in ``e``), a holder
whose engine hashes are its keys (an engine hashing as we do) has no engine map at all, and a
block's digest is stored once, in the block, not once per holder: 22% fewer bytes per entry for
a first holder, half for a further one (``docs/performance.md``). Older layouts (``kv.2:...``,
``kv:...``) are never read: ingest finds no witnessed epoch marker under ``kv.3`` and rebuilds
the index from the engines. Their keys waste memory until removed, on every master:
``redis-cli -p PORT --scan --pattern PATTERN | xargs -r -n 500 redis-cli -p PORT unlink`` for the
patterns ``'kv.2:*'``, ``'kv:{*'``, ``'kv:*:b:{*'``, ``'kv:*:epoch:{*'`` (``kv:*:s:{*`` expire),
then ``unlink kv:models`` where it lives (``kv:ingest:*``, ``kv:web:*``, ``kv:history:*``,
``kv:auth:*`` are not the index's; ``kv.3`` keys match none of these patterns).

Why this layout (against ``redis``'s, where every key of a model carries ``{M}``, so that a
whole model lives in one slot of one node):

* Spread: a block's slot is the CRC16 of its key's tag. Block keys are uniform 64-bit
  hashes, so one model's blocks spread evenly over every slot, so over every master in
  proportion to the slots it serves (``tests/kvindex/test_cluster.py`` measures +-15% for 3000).
* Together: everything of one holder under one model (reverse set, engine-hash maps, dirty set,
  lease, progress) carries the tag ``{M@P}`` (``@`` never occurs in an encoded name), so one
  script updates it atomically, as in ``redis``. Their names are fixed, so every script of a
  holder declares all the keys it may touch: a slot half way through a migration refuses it
  (TRYAGAIN) before it starts, never part way.
* Round trips: a lookup of N keys is one script call per master that serves some of them (its
  keys passed as arguments, read with one ``GET`` each: a script may touch keys of several slots
  of its own node, flag ``allow-cross-slot-keys``; a plain ``MGET`` may not). Every node's call is
  written before any reply is read, so the nodes work at once: one round trip, the slowest node's.
  A script reads all its keys before writing any, so a key its node does not serve (a moved
  slot) fails the call before it changed anything; the slot map is then read again and the call
  resent. Valkey / Redis 7 or later (``allow-cross-slot-keys``, ``SMISMEMBER``).

Writes: ``apply_updates`` cuts its updates into slices as ``redis`` does, and applies them in
*phases* of at most ``slice_blocks`` of work. A phase is three rounds, each one round trip per
node, all nodes at once:

1. Pod round: one script per holder in its slot applies the phase's stores, removes and clear
   slice of that holder to its own structures, adds every (T, K) it changed to the dirty set,
   and answers the whole dirty set with, for each entry, whether P now holds K on T. It takes the
   holder's lease first (or answers "busy", having done nothing, if another writer holds it).
2. Block round: one script per master sets the block entries of every dirty (T, K) to what the
   pod round answered (``P@T`` added where held, removed where not).
3. Finish round: one script per holder empties its dirty set, records the phase's last
   ``Progress`` of that holder, and lets the lease go.

Consistency, at every instant (so whatever a reader or a crash sees):

* Every entry ``P@T`` of block K has ``"T K"`` in P's reverse set ``r`` or in its dirty set
  ``d``; and every ``"T K"`` of ``r`` has the entry in its block, or is in ``d``. The dirty set
  is written in the same script as the reverse set, and emptied only after the block round
  wrote what it says: so once a call returns, no block has an entry without its reverse entry,
  nor the reverse. A
  writer that dies mid-phase leaves its dirty set (and its lease, which expires after
  ``LEASE_SECONDS``); the next writer of that holder takes it over and reconciles those entries
  in its own block round, so a crash leaves no orphan either.
* The engine-hash maps keep ``redis``'s invariants (an engine hash of P points at a key P holds
  on some tier; ``k`` with the implied links is the inverse of ``e``; "P holds K" is read from
  ``r``), and ``n`` counts ``r`` by tier: they live in the holder's slot and change only in its
  scripts. A block's digest head is written by the block round with its first entry (all zero
  where the writer does not know it: a dirty entry taken over from a writer that stopped), and
  a head all zero takes the first real one a later store brings.
* ``resolve`` is two rounds: the holder's script answers the key each engine hash points at,
  then those blocks' heads are read from their masters; a key whose block is not written yet
  (a phase under way) resolves to nothing, as an unknown hash does.
* Writers of one holder never interleave phases: the lease serialises them (ingest writes a pod
  from one thread, but the web process clears pods and models). A lease is held per thread of a
  client, so a writer retrying after an error takes its own phase over. Only a phase that
  outlives its lease (a node stalled for ``LEASE_SECONDS``) can be overtaken: its finish round
  then finds the lease gone and the call fails (``IndexUnavailable``, retried by ingest), but
  its block round may have raced the other writer's.
* Visibility: a reader may see a phase half applied (one master's block script before
  another's), never part of one master's script. Phases are applied in order, so blocks become
  visible slice by slice in chain order, parent slices first, and a remove or clear's entries
  go in the order of its slices. Within a phase, a child stored on one master may show before its
  parent on another, and a parent removed may go before its child: no score counts such a child,
  because scores count the leading run only (``KVIndex.lookup`` stops at the first key that a pod
  is not seen holding). A pod is credited block j only if the same lookup saw it hold blocks
  0..j, each on its master: a child seen without its parent ends that pod's run at the parent.
* Progress is written in the finish round, after the block round of the updates before it:
  never recorded for an update whose blocks are not all written (a crash replays from before it).
* Failover: every write round waits (``WAIT``) for one replica of each master it wrote to, when
  the master has one, before the next round starts: an acknowledged round survives the loss of
  a master, and a round not acknowledged fails the call (``IndexUnavailable``), which ingest
  retries with backoff; every write is idempotent, so a retried call converges to the same state.

Epoch markers: a model's data spans every master, so the marker does too. ``kv.3:{M}:epoch`` holds
``"G marker"``; each master holds a witness ``kv.3:M:epoch:{S}`` = G at its lowest slot S (``{S}``
is a short tag hashing to S). ``epochs`` answers the marker only when every master's witness
says G: a master that lost its data (restarted empty) lost its witness, so the model reads as
lost, as when the one server of ``redis`` loses it. ``set_epoch`` keeps G while the marker is
whole and starts a new generation otherwise; ``if_absent`` compares-and-sets the primary, then
writes the witnesses. Moving slots between masters can move a witness away from its master's
lowest slot: the model then reads as lost once, and ingest rebuilds it (safe, merely slow).
A master that lost its data may have held some holders' own structures, while their block
entries live on: ingest's rebuild replays every engine from seq 0, every store and remove, which
puts them right; but an engine whose replay no longer reaches back that far is cleared instead,
and a clear finds entries through the reverse set only, so those stay until stored and removed
again (finding them needs a sweep of the model's blocks on every master: not done).

Lookups on an event loop (``alookup``): to each master, a ``GET`` per key it serves, pipelined
on that loop's connection to the master (``kvindex.resp``, one per master per loop), every
master's pipeline written before any reply is awaited (``asyncio.gather``): one round trip, no
thread. Plain commands cost a master ~40% less CPU than the read script's ``redis.call`` per key
(``docs/performance.md``). A pipeline's commands are not atomic together: a lookup may see a
block script land between two of its ``GET``s, as it may see one master's before another's, and
the leading run keeps every such view safe (Visibility, above).
The slot map is redis-py's, as the sync path reads it. Whatever that path would have to repair
(a redirection, a key its master no longer serves, a master that lost the scripts, a connection
that failed) sends that call through ``lookup`` in the loop's thread pool instead, which reads the
slot map again, loads the scripts and resends; a master that does not answer within
``socket_timeout`` fails the call at once (``IndexUnavailable``). TLS nodes (``ssl``) are read
through ``lookup`` in the thread pool (``reads_async`` is False).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import secrets
import struct
import threading
import time
import weakref
from binascii import crc_hqx
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.cluster import ClusterNode, NodesManager, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)

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
    speculation_points,
)
from kvindex.keys import BlockKey, Digest
from kvindex.redis import (
    _LUA_BLOBS,
    _LUA_HELPERS,
    _LUA_LAYOUT,
    _NO_HEAD,
    DEFAULT_NAMESPACE,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_SLICE_BLOCKS,
    HEAD,
    LAYOUTS,
    _digest_head,
    _held_each,
    _held_run,
    _Script,
    _speculated_runs,
    _words,
    decode_name,
    encode_name,
)
from kvindex.resp import ReadConnection, ReplyError

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # redis-py packs in Python
    _hiredis_pack = None

LAYOUT = b".3"
"""Appended to the namespace in every key name: the version of this layout (``.3c`` for the
compact one, as in ``redis``). Keys of another layout are never read."""
COMPACT_LAYOUT = LAYOUT + b"c"
SLOTS = 16384
LEASE_SECONDS = 5.0
"""How long a writer that stopped mid-phase keeps its holders from other writers."""
REDIRECT_BUDGET_SECONDS = 1.0
"""How long a call keeps re-reading the slot map and resending after MOVED, ASK, TRYAGAIN,
CLUSTERDOWN or a key its node does not serve, before it gives up (``IndexUnavailable``)."""
DEFAULT_WAIT_TIMEOUT = 1.0
"""How long a write round waits for a replica to acknowledge it."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _unavailable_on_cluster_error(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Re-raise connection, time-out and topology errors as ``IndexUnavailable``."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException) as exc:
            raise IndexUnavailable(f"the Redis cluster index is unreachable: {exc}") from exc

    return wrapper


_SLOT_MASK = SLOTS - 1


def _slot(tag: bytes) -> int:
    """The cluster slot of a key whose hash tag (or whole name, without braces) is ``tag``."""
    return crc_hqx(tag, 0) & _SLOT_MASK


def _pack(conn: Any, commands: list[tuple]) -> list[bytes]:
    """``commands`` in the wire protocol: by hiredis directly when redis-py uses it (redis-py's own
    packer looks at every argument in Python first: a third of a lookup's client time)."""
    if (
        _hiredis_pack is not None
        and type(getattr(conn, "_command_packer", None)).__name__ == "HiredisRespSerializer"
    ):
        return [b"".join(map(_hiredis_pack, commands))]
    return conn.pack_commands(commands)


def _tags(keys: Sequence[int]) -> list[bytes]:
    """Each block key as the hash tag of its block's name: its 8 bytes after a zero byte in
    base64url (12 characters), less the first character (always ``A``). 11 characters, none a
    brace, so the tag is exactly these. Packed and encoded in C (``struct.error`` outside
    0..2**64-1)."""
    if not keys:
        return []
    encoded = base64.urlsafe_b64encode(struct.pack(">" + "xQ" * len(keys), *keys))
    return [encoded[i : i + 11] for i in range(1, len(encoded), 12)]


def _tag_of_word(key: bytes) -> bytes:
    """``_tags`` of one key given as its 8 bytes (as the holder's structures hold it)."""
    return base64.urlsafe_b64encode(b"\0" + key)[1:]


@functools.lru_cache(maxsize=SLOTS)
def slot_tag(slot: int) -> bytes:
    """The first decimal number whose text hashes to ``slot``: a tag that puts a key there."""
    n = 0
    while _slot(b"%d" % n) != slot:
        n += 1
    return b"%d" % n


@dataclass(frozen=True, slots=True)
class _ModelKeys:
    """Key names and prefixes of one model (see the module docstring)."""

    block_prefix: bytes  # kv.3:M:b:{
    speculative_prefix: bytes  # kv.3:M:s:{
    witness_prefix: bytes  # kv.3:M:epoch:{
    pods: bytes  # kv.3:{M}:pods
    epoch: bytes  # kv.3:{M}:epoch
    model_slot: int


@functools.lru_cache(maxsize=1024)
def _model_keys(prefix: str, model: str) -> _ModelKeys:
    """``prefix``: the namespace with the layout's version."""
    ns, m = prefix.encode(), encode_name(model)
    return _ModelKeys(
        block_prefix=ns + b":" + m + b":b:{",
        speculative_prefix=ns + b":" + m + b":s:{",
        witness_prefix=ns + b":" + m + b":epoch:{",
        pods=ns + b":{" + m + b"}:pods",
        epoch=ns + b":{" + m + b"}:epoch",
        model_slot=_slot(m),
    )


@dataclass(frozen=True, slots=True)
class _PodKeys:
    """Key names of one holder under one model: all in the slot of the tag ``{M@P}``."""

    lease: bytes
    reverse: bytes
    tier_counts: bytes
    engine: bytes
    hashes_of: bytes
    dirty: bytes
    seq: bytes
    pod: bytes  # P, encoded
    slot: int

    @property
    def applied(self) -> tuple[bytes, ...]:
        """The keys ``_POD_APPLY`` declares, in its order."""
        return (self.lease, self.reverse, self.tier_counts, self.engine, self.hashes_of, self.dirty)


@functools.lru_cache(maxsize=65536)
def _pod_keys(prefix: str, model: str, pod: str) -> _PodKeys:
    p = encode_name(pod)
    tag = encode_name(model) + b"@" + p
    prefix = prefix.encode() + b":{" + tag + b"}:"
    return _PodKeys(
        lease=prefix + b"lease",
        reverse=prefix + b"r",
        tier_counts=prefix + b"n",
        engine=prefix + b"e",
        hashes_of=prefix + b"k",
        dirty=prefix + b"d",
        seq=prefix + b"seq",
        pod=p,
        slot=_slot(tag),
    )


# -- scripts ---------------------------------------------------------------------------------------

# Lua of a holder's own structures, beside ``redis``'s helpers and its layout's link helpers
# (``links_*``: a holder's engine map and key -> hashes map hold only the links that are not
# implied, as there). Whether P holds a key is read from its reverse set, not from the blocks.
_LUA_POD_KEYS = """
local lease, reverse, tier_counts = KEYS[1], KEYS[2], KEYS[3]
local engine, hashes_of, dirty = KEYS[4], KEYS[5], KEYS[6]

-- The entries "T K" of keys on tier (the reverse set's members, the dirty set's).
local function entries(tier, keys)
  local out = {}
  for i, key in ipairs(keys) do out[i] = tier .. ' ' .. key end
  return out
end

-- redis.call(command, key, list...) in chunks, the integer replies summed.
local function sum_many(command, key, list)
  local total = 0
  for from = 1, #list, 1000 do
    total = total + redis.call(command, key, unpack(list, from, math.min(from + 999, #list)))
  end
  return total
end
"""

# A holder's reverse set, in one of two layouts (``RedisClusterIndex``'s ``compact``): a SET of
# "T K", or per tier T the keys in blob buckets of one hash (fields "T:#" and "T:i", as
# ``redis``'s buckets). Both give the scripts the same calls: rev_has(tier, keys) -> {key ->
# true} for those held on tier, rev_add (-> how many were new) and rev_remove of keys on a tier,
# rev_pop(count) -> up to count entries "T K" taken out, and rev_save (after the calls that
# change it, before the reverse set's existence is read).
_LUA_CLUSTER_REVERSE_SET = """
local function rev_has(tier, keys)
  local out = {}
  if #keys == 0 then return out end
  local member = call_many('SMISMEMBER', reverse, entries(tier, keys))
  for i, key in ipairs(keys) do
    if member[i] == 1 then out[key] = true end
  end
  return out
end
local function rev_add(tier, keys) return sum_many('SADD', reverse, entries(tier, keys)) end
local function rev_remove(tier, keys) call_many('SREM', reverse, entries(tier, keys)) end
local function rev_pop(count) return redis.call('SPOP', reverse, count) end
local function rev_save() end
"""
_LUA_CLUSTER_REVERSE_BUCKETS = (
    _LUA_BLOBS
    + """
local opened = {}  -- tier -> its buckets, as read and changed by this call
local function rev_tier(tier)
  local b = opened[tier]
  if not b then
    b = blob_open(reverse, tier .. ':')
    opened[tier] = b
  end
  return b
end
local function rev_has(tier, keys)
  local b, out = rev_tier(tier), {}
  if #keys == 0 then return out end
  blob_load(b, keys, 1, #keys)
  for _, key in ipairs(keys) do
    if blob_find(b.blobs[blob_index(b, key)], key) then out[key] = true end
  end
  return out
end
local function rev_add(tier, keys)
  local b, added = rev_tier(tier), 0
  blob_load(b, keys, 1, #keys)
  for _, key in ipairs(keys) do
    if blob_add(b, key) then added = added + 1 end
  end
  return added
end
local function rev_remove(tier, keys)
  local b = rev_tier(tier)
  blob_load(b, keys, 1, #keys)
  for _, key in ipairs(keys) do blob_remove(b, key) end
end
local function rev_pop(count)
  local out = {}
  for _, tier in ipairs(redis.call('HKEYS', tier_counts)) do
    if #out >= count then break end
    for _, key in ipairs(blob_pop(rev_tier(tier), count - #out)) do out[#out + 1] = tier .. ' ' .. key end
  end
  return out
end
local function rev_save()
  for _, b in pairs(opened) do blob_save(b) end
  opened = {}
end
"""
)

_LUA_POD_HELD = """
-- keys -> true for the keys P holds on some tier other than except (nil: any tier).
local function held_on(keys, except)
  local out = {}
  if #keys == 0 then return out end
  for _, tier in ipairs(redis.call('HKEYS', tier_counts)) do
    if tier ~= except then
      for key in pairs(rev_has(tier, keys)) do out[key] = true end
    end
  end
  return out
end

-- lk.held[x] for the words of list not known yet: whether P holds x on some tier now.
local function read_held(lk, list)
  local want = {}
  for _, x in ipairs(list) do
    if lk.held[x] == nil then
      lk.held[x] = false
      want[#want + 1] = x
    end
  end
  local held = held_on(want, nil)
  for _, x in ipairs(want) do lk.held[x] = held[x] or false end
end
"""

# KEYS: the holder's lease, reverse set, tier counts, engine map, key -> hashes map, dirty set
# (every key a script of a holder touches is declared, so that a slot half way through a
# migration is refused with TRYAGAIN before the script starts, never part way).
# ARGV: writer token, lease milliseconds, then the ops, each one of
#   S, tier, n, n block keys, n engine hashes (8 bytes each)
#   R, tier, n, n engine hashes
#   C, the most entries to clear (>= 1)
# Returns {0} if another writer holds the lease (nothing done); else {1, {count per op}, 1 if a
# final C left entries else 0, {dirty "T K" that P holds}, {dirty "T K" it does not}}. Holds the
# lease when something is dirty, else lets it go.
_POD_APPLY_BODY = """
local token, ttl = ARGV[1], ARGV[2]
local holder = redis.call('GET', lease)
if holder and holder ~= token then return {0} end

local function count(tier, delta)
  if delta ~= 0 and redis.call('HINCRBY', tier_counts, tier, delta) <= 0 then
    redis.call('HDEL', tier_counts, tier)
  end
end

-- A store slice: its entries join the reverse set and the dirty set; the engine hashes are
-- pointed at their keys as redis's store script points them.
local function store(at)
  local tier, n = ARGV[at + 1], tonumber(ARGV[at + 2])
  local K, H = at + 2, at + 2 + n
  local keys, hashes, aligned = {}, {}, true
  for i = 1, n do
    keys[i], hashes[i] = ARGV[K + i], ARGV[H + i]
    if hashes[i] ~= keys[i] then aligned = false end
  end
  local linked = not aligned or redis.call('EXISTS', engine, hashes_of) > 0
  local lk, words = links_new(engine, hashes_of), {}
  if linked then  -- what the links are and which words P holds, before this store
    links_read(lk, hashes, {})
    for i = 1, n do
      words[#words + 1] = keys[i]
      words[#words + 1] = hashes[i]
      if lk.E[hashes[i]] then words[#words + 1] = lk.E[hashes[i]] end
    end
    links_read(lk, {}, words)
    read_held(lk, words)
  end
  count(tier, rev_add(tier, keys))
  rev_save()
  call_many('SADD', dirty, entries(tier, keys))
  if not linked then return n, at + 2 + 2 * n end  -- every link implied
  for i = 1, n do
    local was_held = lk.held[keys[i]]
    lk.held[keys[i]] = true
    links_point(lk, hashes[i], keys[i], was_held)
  end
  links_write(lk)
  return n, at + 2 + 2 * n
end

-- A remove: as redis's remove script, on the reverse set.
local function remove(at)
  local tier, n = ARGV[at + 1], tonumber(ARGV[at + 2])
  local first, last = at + 3, at + 2 + n
  local lk, hashes = links_new(engine, hashes_of), {}
  for i = first, last do hashes[#hashes + 1] = ARGV[i] end
  links_read(lk, hashes, {})
  local cands = links_candidates(lk, hashes)
  local here, elsewhere = rev_has(tier, cands), held_on(cands, tier)
  for _, x in ipairs(cands) do
    here[x] = here[x] or false
    lk.held[x] = here[x] or elsewhere[x] or false
  end
  links_read(lk, {}, cands)
  local key_at = {}
  for i, h in ipairs(hashes) do key_at[i] = links_target(lk, h) or false end

  -- Replay the hashes in order: the entry leaves; when P then holds the key on no tier, every
  -- engine hash pointing at it goes (later hashes among them are unknown).
  local removed, dropped, unknown = 0, {}, {}
  for i, h in ipairs(hashes) do
    local key = key_at[i]
    if key and not unknown[h] and here[key] then
      here[key] = false
      removed = removed + 1
      dropped[#dropped + 1] = key
      if not elsewhere[key] then links_drop(lk, key, unknown) end
    end
  end
  if removed == 0 then return 0, last end
  rev_remove(tier, dropped)
  rev_save()
  count(tier, -removed)
  call_many('SADD', dirty, entries(tier, dropped))
  links_write(lk)
  return removed, last
end

-- A clear slice: at most limit entries leave the reverse set; a key's engine hashes go when P
-- then holds it on no tier; the maps go with the last entry.
local function clear(at)
  local limit, removed, lk = tonumber(ARGV[at + 1]), 0, links_new(engine, hashes_of)
  while removed < limit do
    local popped = rev_pop(math.min(1000, limit - removed))
    if #popped == 0 then break end
    call_many('SADD', dirty, popped)
    local keys, seen, by_tier = {}, {}, {}
    for _, entry in ipairs(popped) do
      local tier, key = string.sub(entry, 1, -10), string.sub(entry, -8)
      by_tier[tier] = (by_tier[tier] or 0) + 1
      if not seen[key] then
        seen[key] = true
        keys[#keys + 1] = key
      end
    end
    for tier, n in pairs(by_tier) do count(tier, -n) end
    local held, orphans = held_on(keys, nil), {}
    for _, key in ipairs(keys) do
      if not held[key] then orphans[#orphans + 1] = key end
    end
    links_read(lk, {}, orphans)
    for _, key in ipairs(orphans) do
      lk.held[key] = true  -- until forgotten: its implied link goes with it
      links_forget(lk, key)
    end
    removed = removed + #popped
  end
  rev_save()
  links_write(lk)
  if redis.call('EXISTS', reverse) == 1 then return removed, true, at + 1 end
  redis.call('DEL', engine, hashes_of, tier_counts)
  return removed, false, at + 1
end

local counts, more, at = {}, 0, 3
while at <= #ARGV do
  local kind, n, left = ARGV[at], 0, false
  if kind == 'S' then
    n, at = store(at)
  elseif kind == 'R' then
    n, at = remove(at)
  else
    n, left, at = clear(at)
  end
  counts[#counts + 1] = n
  more = left and 1 or 0
  at = at + 1
end

-- Everything dirty (this phase's, and any left by a writer that stopped mid-phase), by whether P
-- now holds it: what the block round writes.
local pending = redis.call('SMEMBERS', dirty)
local held, gone = {}, {}
if #pending == 0 then
  if holder then redis.call('DEL', lease) end
  return {1, counts, more, held, gone}
end
local by_tier = {}
for _, entry in ipairs(pending) do
  local tier = string.sub(entry, 1, -10)
  by_tier[tier] = by_tier[tier] or {}
  table.insert(by_tier[tier], string.sub(entry, -8))
end
for tier, keys in pairs(by_tier) do
  local here = rev_has(tier, keys)
  for _, key in ipairs(keys) do
    if here[key] then held[#held + 1] = tier .. ' ' .. key else gone[#gone + 1] = tier .. ' ' .. key end
  end
end
redis.call('SET', lease, token, 'PX', ttl)
return {1, counts, more, held, gone}
"""

# KEYS: as _POD_APPLY's. ARGV: engine hashes (8 bytes each). Returns, per hash, the key (8
# bytes) of the block it points at, or nil: the first of resolve's two rounds (the digest's head
# is in the block, on its own master).
_RESOLVE_BODY = """
local lk, hashes = links_new(engine, hashes_of), {}
for i = 1, #ARGV do hashes[i] = ARGV[i] end
links_read(lk, hashes, {})
local cands = {}
for i, h in ipairs(hashes) do cands[i] = lk.E[h] or h end
links_read(lk, {}, cands)
read_held(lk, cands)
local out = {}
for i, h in ipairs(hashes) do out[i] = links_target(lk, h) or false end
return out
"""


@dataclass(frozen=True, slots=True)
class _HolderScripts:
    """The holder scripts of one layout (``RedisClusterIndex``'s ``compact``)."""

    apply: _Script
    resolve: _Script


def _holder_scripts(reverse: str) -> _HolderScripts:
    """The holder scripts, with the reverse-set calls of one layout."""
    lua = _LUA_HELPERS + _LUA_LAYOUT + _LUA_POD_KEYS + reverse + _LUA_POD_HELD
    return _HolderScripts(
        apply=_Script("#!lua\n" + lua + _POD_APPLY_BODY),
        resolve=_Script("#!lua flags=no-writes\n" + lua + _RESOLVE_BODY),
    )


_FAST_SCRIPTS = _holder_scripts(_LUA_CLUSTER_REVERSE_SET)
_COMPACT_SCRIPTS = _holder_scripts(_LUA_CLUSTER_REVERSE_BUCKETS)

# KEYS: the lease, the dirty set, the seq. ARGV: writer token ('' when this call holds no lease:
# progress only), seq ('' for none). Returns 0 if the lease was lost to another writer (nothing
# done).
_FINISH = _Script("""#!lua
local lease, dirty, seq_key, token, seq = KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]
if token ~= '' then
  if redis.call('GET', lease) ~= token then return 0 end
  redis.call('DEL', dirty, lease)
end
if seq ~= '' then redis.call('SET', seq_key, seq) end
return 1
""")

# No KEYS (the blocks are of many slots of this node). ARGV: groups of: field "P@T", the number
# a to add, the number d to remove, the a block names to add the field to, their a digest heads
# (all zero where unknown), the d block names to remove it from. A block is its digest's head,
# then its entries, as in ``redis``; a head all zero takes the first one given that is not.
# Reads every block before writing any, so a block this node does not serve fails the call
# before it changed anything. Returns how many blocks changed.
_BLOCKS = _Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + _LUA_HELPERS
    + _LUA_LAYOUT
    + """
-- The block names of group at: its adds, then its removes (the heads skipped).
local function names_of(at, adds, drops)
  local out = {}
  for i = at + 3, at + 2 + adds do out[#out + 1] = ARGV[i] end
  for i = at + 3 + 2 * adds, at + 2 + 2 * adds + drops do out[#out + 1] = ARGV[i] end
  return out
end
local names, seen, at = {}, {}, 1
while at <= #ARGV do
  local adds, drops = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  for _, name in ipairs(names_of(at, adds, drops)) do
    if not seen[name] then
      seen[name] = true
      names[#names + 1] = name
    end
  end
  at = at + 3 + 2 * adds + drops
end
local before, after = {}, {}
for i, name in ipairs(names) do
  before[i] = redis.call('GET', name) or false
  after[name] = before[i]
end
at = 1
while at <= #ARGV do
  local entry, adds, drops = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  for i = at + 3, at + 2 + adds do
    after[ARGV[i]] = with_entry(after[ARGV[i]], ARGV[i + adds], entry)
  end
  for i = at + 3 + 2 * adds, at + 2 + 2 * adds + drops do
    local cur = after[ARGV[i]]
    if cur then
      local rest = without(entries_of(cur), entry)
      after[ARGV[i]] = rest and (string.sub(cur, 1, HEAD) .. rest)
    end
  end
  at = at + 3 + 2 * adds + drops
end
local changed = 0
for i, name in ipairs(names) do
  local value = after[name]
  if value ~= before[i] then
    if value then redis.call('SET', name, value) else redis.call('DEL', name) end
    changed = changed + 1
  end
end
return changed
"""
)

# No KEYS. ARGV: names of keys of this node. Returns their values (nil where absent).
_READ = _Script("""#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
for i = 1, #ARGV do out[i] = redis.call('GET', ARGV[i]) end
return out
""")

# No KEYS. ARGV: encoded pod P, now and until (Unix ms), then speculative keys of this node.
# As redis's speculate script; every key is read before any is written.
_SPECULATE = _Script("""#!lua flags=allow-cross-slot-keys
local pod, now, mine = ARGV[1], tonumber(ARGV[2]), ARGV[1] .. '=' .. ARGV[3]
local values = {}
for i = 4, #ARGV do values[i] = redis.call('GET', ARGV[i]) end
for i = 4, #ARGV do
  local entries, last, value = {mine}, tonumber(ARGV[3]), values[i]
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
  redis.call('SET', ARGV[i], table.concat(entries, ' '), 'PX', math.max(1, last - now))
end
return #ARGV - 3
""")

# KEYS: the epoch marker. ARGV: its value as read ('' for none), the new value. Compare and set.
_EPOCH_CLAIM = _Script("""#!lua
local cur = redis.call('GET', KEYS[1])
if (cur or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
""")

_SHARED_SCRIPTS = (_FINISH, _BLOCKS, _READ, _SPECULATE, _EPOCH_CLAIM)


# -- rounds ------------------------------------------------------------------------------------------


_TRANSIENT_SCRIPT_ERRORS = ("non local key", "cluster is down")
"""What a script's error says when its node does not serve a key, or the cluster is failing over."""


def _is_redirect(reply: Any) -> bool:
    """A reply that says: ask another node, or this one again later."""
    return isinstance(reply, (AskError, TryAgainError, ClusterDownError, ReadOnlyError)) or (
        isinstance(reply, redis.ResponseError) and any(s in str(reply) for s in _TRANSIENT_SCRIPT_ERRORS)
    )


def _failed(reply: Any) -> bool:
    return isinstance(reply, (redis.ConnectionError, redis.TimeoutError))


@dataclass(slots=True)
class _Lane:
    """The ops of one (model, holder) in one phase."""

    model: str
    pod: str
    keys: _PodKeys
    args: list[bytes | int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the update of each op
    progress: int | None = None
    heads: dict[bytes, bytes] = field(default_factory=dict)  # key -> its digest's head, of the stores


@dataclass(frozen=True, slots=True)
class _SlotMap:
    """A snapshot of redis-py's slot map, as tables: which primary serves each slot."""

    source: object  # the slots_cache it was made from
    primaries: list[ClusterNode]
    owner: list[int]  # per slot: its primary's index in primaries (-1: no node serves it)
    replicas: dict[str, int]  # primary name -> how many replicas the map lists
    witness_slots: list[int]  # the lowest slot of each primary, sorted

    @classmethod
    def of(cls, cache: dict[int, list[ClusterNode]]) -> _SlotMap:
        primaries: list[ClusterNode] = []
        index: dict[str, int] = {}
        owner = [-1] * SLOTS
        replicas: dict[str, int] = {}
        lowest: list[int] = []
        for slot in range(SLOTS):
            nodes = cache.get(slot)
            if not nodes:
                continue
            n = index.get(nodes[0].name)
            if n is None:
                n = index[nodes[0].name] = len(primaries)
                primaries.append(nodes[0])
                replicas[nodes[0].name] = len(nodes) - 1
                lowest.append(slot)
            owner[slot] = n
        return cls(cache, primaries, owner, replicas, sorted(lowest))


@dataclass(slots=True)
class _LoopReaders:
    """One event loop's read connections: one per primary, by node name, and those of the slot
    map last used, in its primaries' order."""

    by_name: dict[str, ReadConnection] = field(default_factory=dict)
    slot_map: _SlotMap | None = None
    primaries: list[ReadConnection] = field(default_factory=list)


class RedisClusterIndex:
    """A ``KVIndex`` in a Valkey or Redis Cluster (layout and guarantees: module docstring).

    Thread-safe. Connects on first use; connection, time-out and topology errors surface as
    ``IndexUnavailable``.
    """

    def __init__(
        self,
        startup_nodes: Sequence[tuple[str, int]],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        slice_blocks: int = DEFAULT_SLICE_BLOCKS,
        wait_replicas: int = 1,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        compact: bool = False,
        **client_options: Any,
    ) -> None:
        if not namespace or any(c in namespace for c in "{} ") or not namespace.isprintable():
            raise ValueError("namespace must be non-empty, printable, and free of '{', '}' and spaces")
        if slice_blocks < 1:
            raise ValueError("slice_blocks must be at least 1")
        if not startup_nodes:
            raise ValueError("a cluster index needs at least one seed node")
        if client_options.pop("decode_responses", False):
            raise ValueError("the Redis index needs decode_responses=False")
        self.slice_blocks = slice_blocks
        self.wait_replicas = wait_replicas
        # A WAIT must return before the socket gives up on its reply.
        socket_timeout = client_options.get("socket_timeout")
        self._wait_ms = int(1000 * min(wait_timeout, socket_timeout / 2 if socket_timeout else wait_timeout))
        self._startup = [ClusterNode(host, port) for host, port in startup_nodes]
        self._options = {"socket_connect_timeout": 5, "health_check_interval": 30, **client_options}
        self._prefix = namespace + (COMPACT_LAYOUT if compact else LAYOUT).decode()
        self._models_key = self._prefix.encode() + b":models"
        self._scripts = _COMPACT_SCRIPTS if compact else _FAST_SCRIPTS
        self._all_scripts = (self._scripts.apply, self._scripts.resolve, *_SHARED_SCRIPTS)
        self._models_seen: set[str] = set()
        self._pods_seen: set[tuple[str, str]] = set()
        self._client: RedisCluster | None = None
        self._client_lock = threading.Lock()
        self._writer = secrets.token_hex(6)  # + the thread: a lease is held per writing thread
        self._slot_map: _SlotMap | None = None
        self._readers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopReaders] = (
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
    ) -> RedisClusterIndex:
        """``redis-cluster://[user:password@]host:port[,host:port...][?option=value...]``: seed
        nodes (any of them reachable is enough). Query options: ``socket_timeout``,
        ``socket_connect_timeout`` and ``wait_timeout`` (seconds), ``wait_replicas`` (0: do not
        wait for replicas), ``layout`` (``fast``, the default, or ``compact``: reverse sets in
        blob buckets, as in ``redis``); keyword ``options`` go to ``redis.cluster.RedisCluster``
        (but for ``layout``) and lose to the query, as in redis-py."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "redis-cluster":
            raise ValueError(f"not a redis-cluster:// URL: {url!r}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        nodes = []
        for seed in hosts.split(","):
            host, _, port = seed.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a seed node must be host:port, not {seed!r} in {url!r}")
            nodes.append((host.strip("[]"), int(port)))
        if userinfo:
            user, _, password = userinfo.partition(":")
            options.setdefault("username", unquote(user) or None)
            options.setdefault("password", unquote(password) or None)
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name in ("socket_timeout", "socket_connect_timeout", "wait_timeout"):
                options[name] = float(value)
            elif name == "wait_replicas":
                options[name] = int(value)
            elif name == "layout":
                options[name] = value
            else:
                raise ValueError(f"unknown redis-cluster index option {name!r}")
        layout = options.pop("layout", None) or "fast"
        if layout not in LAYOUTS:
            raise ValueError(f"unknown index layout {layout!r}; known: {', '.join(LAYOUTS)}")
        return cls(nodes, namespace=namespace, slice_blocks=slice_blocks, compact=LAYOUTS[layout], **options)

    # -- writes ---------------------------------------------------------------------------------

    def store(self, *, model: str, pod: str, tier: Tier, blocks: Sequence[StoredBlock]) -> None:
        if blocks:
            self.apply_updates([Store(model, pod, tier, blocks)])

    def remove(self, *, model: str, pod: str, tier: Tier, engine_hashes: Sequence[int]) -> int:
        return self.apply_updates([Remove(model, pod, tier, engine_hashes)])[0]

    @_unavailable_on_cluster_error
    def clear_pod(self, *, pod: str, model: str | None = None) -> int:
        """Remove every entry of ``pod``; with ``model=None`` under every model in ``kv.3:models``."""
        models = self._models() if model is None else [model]
        return sum(self.apply_updates([ClearPod(m, pod) for m in models]))

    @_unavailable_on_cluster_error
    def clear_pod_slice(self, *, pod: str, model: str, limit: int) -> tuple[int, bool]:
        """One phase with one clear slice (see ``KVIndex``)."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        counts = [0]
        lane = _Lane(model, pod, _pod_keys(self._prefix, model, pod), [b"C", limit], [0])
        more = self._run_phase({(model, pod): lane}, counts)
        return counts[0], not more

    @_unavailable_on_cluster_error
    def apply_updates(self, updates: Sequence[IndexUpdate]) -> list[int]:
        """Apply ``updates`` in order (see ``KVIndex``), in phases of at most ``slice_blocks`` of
        work (module docstring): a store or remove of more is cut into slices as ``redis`` cuts
        it, a clear slice ends its phase and the clear goes on in the next phases until the pod
        is empty. A ``Progress`` is written by the finish round of the phase that holds it, after
        the blocks of every update before it; only the last of a holder's in a phase is written.
        ``TypeError`` for anything that is not an ``IndexUpdate``, before anything is sent."""
        for update in updates:
            if not isinstance(update, (Store, Remove, ClearPod, Progress)):
                raise TypeError(f"not an index update: {update!r}")
        counts = [0] * len(updates)
        self._register(updates)
        size = self.slice_blocks
        lanes: dict[tuple[str, str], _Lane] = {}
        work = 0
        for i, update in enumerate(updates):
            key = (update.model, update.pod)
            if isinstance(update, Progress):
                self._lane(lanes, update).progress = update.seq
                continue
            if isinstance(update, ClearPod):
                if size - work < 1:
                    self._run_phase(lanes, counts)
                    lanes, work = {}, 0
                lane = self._lane(lanes, update)
                lane.args += [b"C", size - work]
                lane.positions.append(i)
                while self._run_phase(lanes, counts):
                    lane = _Lane(update.model, update.pod, lanes[key].keys, [b"C", size], [i])
                    lanes = {key: lane}
                lanes, work = {}, 0
                continue
            store = isinstance(update, Store)
            items = update.blocks if store else update.engine_hashes
            for part in slices(items, size) if items else []:
                if work and work + len(part) > size:
                    self._run_phase(lanes, counts)
                    lanes, work = {}, 0
                lane = self._lane(lanes, update)
                lane.args += (
                    self._store_args(lane, update.tier, part)
                    if store
                    else self._remove_args(update.tier, part)
                )
                lane.positions.append(i)
                work += len(part)
        self._run_phase(lanes, counts)
        return counts

    @_unavailable_on_cluster_error
    def clear_model(self, *, model: str) -> int:
        """``clear_pod`` of every holder listed under ``model``; returns the entries removed."""
        pods = self._round(
            [(_model_keys(self._prefix, model).model_slot, ("SMEMBERS", self._pods_key(model)))]
        )
        holders = sorted(decode_name(p) for p in pods[0])
        return sum(self.apply_updates([ClearPod(model, pod) for pod in holders]))

    @_unavailable_on_cluster_error
    def set_epoch(self, *, model: str, value: str, if_absent: bool = False) -> bool:
        """Write the marker (module docstring): keep its generation while every witness has it,
        else start a new one; with ``if_absent`` only when the marker reads as absent, by a
        compare-and-set of ``kv.3:{M}:epoch``, then the witnesses."""
        mk = _model_keys(self._prefix, model)
        [(raw, whole)] = self._read_epochs([model])
        if if_absent and whole:
            return False
        generation = raw.partition(b" ")[0] if whole and raw else secrets.token_hex(8).encode()
        new = generation + b" " + value.encode()
        if if_absent:
            claim = ("EVALSHA", _EPOCH_CLAIM.sha, 1, mk.epoch, raw or b"", new)
            if not self._round([(mk.model_slot, claim)])[0]:
                return False  # another writer claimed it first
        else:
            self._round([(mk.model_slot, ("SET", mk.epoch, new))])
        if not whole:
            witnesses = [
                (s, ("SET", mk.witness_prefix + slot_tag(s) + b"}", generation))
                for s in self._witness_slots()
            ]
            self._round(witnesses)
        return True

    # -- reads ----------------------------------------------------------------------------------

    @_unavailable_on_cluster_error
    def resolve(self, *, model: str, pod: str, engine_hashes: Sequence[int]) -> list[Digest | None]:
        if not engine_hashes:
            return []
        pk = _pod_keys(self._prefix, model, pod)
        call = ("EVALSHA", self._scripts.resolve.sha, len(pk.applied), *pk.applied, *_words(engine_hashes))
        targets = self._round([(pk.slot, call)])[0]
        found = [key for key in targets if key]
        if not found:
            return [None] * len(targets)
        prefix = _model_keys(self._prefix, model).block_prefix
        values = iter(self._read_tagged(prefix, [int.from_bytes(key, "big") for key in found]))
        out: list[Digest | None] = []
        for key in targets:
            value = next(values) if key else None
            if value is None:  # no such key, or its block not written yet (a phase under way)
                out.append(None)
            else:
                out.append(key if value[:HEAD] == _NO_HEAD else value[:HEAD] + key)
        return out

    @_unavailable_on_cluster_error
    def lookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """Holders of the longest held run of ``keys``: one script call per master that serves
        some of them, all at once (see ``KVIndex``)."""
        if not keys:
            return []
        wanted = pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
        if wanted is not None and not wanted:
            return []
        prefix = _model_keys(self._prefix, model).block_prefix
        return _held_run(self._read_tagged(prefix, keys), wanted, HEAD)

    @property
    def reads_async(self) -> bool:
        """``alookup`` reads on the event loop: every node is plain TCP (no ``ssl``)."""
        return not self._options.get("ssl")

    async def alookup(
        self, *, model: str, keys: Sequence[BlockKey], pods: Collection[str] | None = None
    ) -> list[HolderMap]:
        """``lookup`` for an event loop, with the same answer: one read script per master on this
        loop's connection to it, all masters at once, no thread (module docstring). A call the
        sync path must repair (redirection, lost scripts, a failed connection), and any call
        before the slot map was first read or with ``ssl``, is ``lookup`` in the loop's default
        thread pool; a master silent for ``socket_timeout`` is ``IndexUnavailable``."""
        if not keys:
            return []
        wanted = pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
        if wanted is not None and not wanted:
            return []
        if self.reads_async and self._client is not None:
            values = await self._aread_tagged(_model_keys(self._prefix, model).block_prefix, keys)
            if values is not None:
                return _held_run(values, wanted, HEAD)
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.lookup, model=model, keys=keys, pods=wanted)
        )

    @_unavailable_on_cluster_error
    def lookup_many(self, *, model: str, queries: Sequence[LookupQuery]) -> list[list[HolderMap]]:
        """Every query's keys read in one round: one script call per master, all at once."""
        prefix = _model_keys(self._prefix, model).block_prefix
        wanted = [
            pods if pods is None or isinstance(pods, (set, frozenset)) else frozenset(pods)
            for _, pods in queries
        ]
        asked = [i for i, (keys, _) in enumerate(queries) if keys and (wanted[i] is None or wanted[i])]
        out: list[list[HolderMap]] = [[] for _ in queries]
        if not asked:
            return out
        values = self._read_tagged(prefix, [k for i in asked for k in queries[i][0]])
        start = 0
        for i in asked:
            end = start + len(queries[i][0])
            out[i] = _held_run(values[start:end], wanted[i], HEAD)
            start = end
        return out

    @_unavailable_on_cluster_error
    def holders(self, *, model: str, keys: Sequence[BlockKey]) -> list[HolderMap]:
        """Holders of every key (``{}`` where none): one script call per master, all at once."""
        if not keys:
            return []
        return _held_each(self._read_tagged(_model_keys(self._prefix, model).block_prefix, keys), HEAD)

    @_unavailable_on_cluster_error
    def speculate(self, *, model: str, pod: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """One script call per master that serves some of the request's speculation points."""
        points = speculation_points(len(keys))
        if not points or seconds <= 0:
            return
        prefix = _model_keys(self._prefix, model).speculative_prefix
        tags = _tags([keys[point] for point in points])
        now = int(time.time() * 1000)
        head = [encode_name(pod), now, now + max(1, int(seconds * 1000))]
        self._cross_slot(
            [(crc_hqx(t, 0) & _SLOT_MASK, prefix + t + b"}") for t in tags],
            lambda names: ("EVALSHA", _SPECULATE.sha, 0, *head, *names),
            write=False,
        )

    @_unavailable_on_cluster_error
    def speculated(self, *, model: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        points = speculation_points(len(keys))
        if not points:
            return {}
        prefix = _model_keys(self._prefix, model).speculative_prefix
        values = self._read_tagged(prefix, [keys[point] for point in points])
        return _speculated_runs(points, values)

    @_unavailable_on_cluster_error
    def pod_blocks(self, *, model: str | None = None) -> list[PodBlocks]:
        """Live block counts per (model, holder) with at least one block, sorted: the holders
        listed under each model, then one script per holder, each round all nodes at once."""
        models = sorted(self._models()) if model is None else [model]
        holders = self._holders(models)
        counted = self._round(
            [
                (pk.slot, ("HGETALL", pk.tier_counts))
                for pk in (_pod_keys(self._prefix, m, p) for m, p in holders)
            ]
        )
        out: list[PodBlocks] = []
        for (m, pod), reply in zip(holders, counted, strict=True):
            pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
            tiers = {decode_name(tier): int(n) for tier, n in pairs if int(n) > 0}  # RESP3: a map
            if tiers:
                out.append(PodBlocks(model=m, pod=pod, blocks_by_tier=tiers))
        return sorted(out, key=lambda p: (p.model, p.pod))

    @_unavailable_on_cluster_error
    def progress(self, *, model: str | None = None) -> dict[tuple[str, str], int]:
        """The ``seq`` of every holder listed under ``model`` (every model in ``kv.3:models``)."""
        models = sorted(self._models()) if model is None else [model]
        holders = self._holders(models)
        seqs = self._round(
            [(pk.slot, ("GET", pk.seq)) for pk in (_pod_keys(self._prefix, m, p) for m, p in holders)]
        )
        return {holder: int(seq) for holder, seq in zip(holders, seqs, strict=True) if seq is not None}

    @_unavailable_on_cluster_error
    def epochs(self, models: Sequence[str]) -> list[str | None]:
        """Each model's marker, ``None`` unless every master's witness holds its generation:
        one round, all nodes at once."""
        return [
            value.partition(b" ")[2].decode() if whole else None for value, whole in self._read_epochs(models)
        ]

    def ping(self) -> None:
        """Raise ``IndexUnavailable`` unless every master answers."""
        try:
            self._round([(s, ("PING",)) for s in self._witness_slots()])
        except (redis.RedisError, RedisClusterException) as exc:
            raise IndexUnavailable(f"the Redis cluster index is unreachable: {exc}") from exc

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
            self._client = None
        for readers in list(self._readers.values()):
            for reader in readers.by_name.values():
                reader.close()

    # -- plumbing: the layout ---------------------------------------------------------------------

    def _pods_key(self, model: str) -> bytes:
        return _model_keys(self._prefix, model).pods

    def _lane(self, lanes: dict[tuple[str, str], _Lane], update: IndexUpdate) -> _Lane:
        lane = lanes.get((update.model, update.pod))
        if lane is None:
            keys = _pod_keys(self._prefix, update.model, update.pod)
            lane = lanes[update.model, update.pod] = _Lane(update.model, update.pod, keys)
        return lane

    @staticmethod
    def _store_args(lane: _Lane, tier: Tier, blocks: Sequence[StoredBlock]) -> list[bytes | int]:
        """A store op's arguments; the heads of its digests are kept for the block round."""
        keys = _words([b.key for b in blocks])
        heads = lane.heads
        for key, block in zip(keys, blocks, strict=True):
            head = _digest_head(block.digest)
            if head != _NO_HEAD or key not in heads:
                heads[key] = head
        return [b"S", encode_name(tier), len(blocks), *keys, *_words([b.engine_hash for b in blocks])]

    @staticmethod
    def _remove_args(tier: Tier, engine_hashes: Sequence[int]) -> list[bytes | int]:
        return [b"R", encode_name(tier), len(engine_hashes), *_words(engine_hashes)]

    def _register(self, updates: Sequence[IndexUpdate]) -> None:
        """Add the models and holders this client writes for the first time to ``kv.3:models`` and
        ``kv.3:{M}:pods`` (what ``pod_blocks``, ``progress`` and ``clear_model`` enumerate), before
        anything of theirs is written."""
        models: set[str] = set()
        pods: set[tuple[str, str]] = set()
        for u in updates:
            if isinstance(u, Progress) or (isinstance(u, Store) and u.blocks):
                if u.model not in self._models_seen:
                    models.add(u.model)
                if (u.model, u.pod) not in self._pods_seen:
                    pods.add((u.model, u.pod))
        if not models and not pods:
            return
        commands: list[tuple[int, tuple]] = []
        if models:
            commands.append((_slot(self._models_key), ("SADD", self._models_key, *sorted(models))))
        by_model: dict[str, list[bytes]] = {}
        for m, p in sorted(pods):
            by_model.setdefault(m, []).append(encode_name(p))
        for m, encoded in by_model.items():
            commands.append((_model_keys(self._prefix, m).model_slot, ("SADD", self._pods_key(m), *encoded)))
        self._round(commands, write=True)
        self._models_seen |= models
        self._pods_seen |= pods

    def _models(self) -> list[str]:
        members = self._round([(_slot(self._models_key), ("SMEMBERS", self._models_key))])[0]
        return [m.decode() for m in members]

    def _holders(self, models: Sequence[str]) -> list[tuple[str, str]]:
        """(model, holder) of every holder listed under ``models``, sorted."""
        if not models:
            return []
        listed = self._round(
            [(_model_keys(self._prefix, m).model_slot, ("SMEMBERS", self._pods_key(m))) for m in models]
        )
        return sorted((m, decode_name(p)) for m, pods in zip(models, listed, strict=True) for p in pods)

    def _read_tagged(self, prefix: bytes, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The values of ``prefix + K + "}"`` for every key, in order: one read per master."""
        tags = _tags(keys)
        return self._cross_slot(
            [(crc_hqx(t, 0) & _SLOT_MASK, prefix + t + b"}") for t in tags],
            lambda names: ("EVALSHA", _READ.sha, 0, *names),
            write=False,
            per_item=True,
        )

    async def _aread_tagged(self, prefix: bytes, keys: Sequence[BlockKey]) -> list[bytes | None] | None:
        """``_read_tagged`` on this loop's read connections: to each master, a pipeline of one
        ``GET`` per key it serves (plain commands cost a master ~40% less than the read script's
        ``redis.call`` per key), every master's sent before any reply is awaited; ``None`` when a
        master's answer needs the sync path (a redirection, any other error reply, a connection
        that failed, a slot no master serves)."""
        tags = _tags(keys)
        slot_map = self._map()
        owner = slot_map.owner
        groups: list[list[int]] = [[] for _ in slot_map.primaries]
        for i, t in enumerate(tags):
            n = owner[crc_hqx(t, 0) & _SLOT_MASK]
            if n < 0:
                return None
            groups[n].append(i)
        readers = self._loop_readers(slot_map)
        asked = [(n, idx) for n, idx in enumerate(groups) if idx]
        get = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s" % (len(prefix) + 12, prefix)  # then the tag, "}"
        replies = await asyncio.gather(
            *(
                readers[n].execute_many(b"".join([get + tags[i] + b"}\r\n" for i in idx]), len(idx))
                for n, idx in asked
            ),
            return_exceptions=True,
        )
        values: list[bytes | None] = [None] * len(tags)
        for (_, idx), reply in zip(asked, replies, strict=True):
            if isinstance(reply, TimeoutError):  # (an OSError too) a master that does not answer
                raise IndexUnavailable(f"the Redis cluster index is unreachable: {reply}") from reply
            if isinstance(reply, OSError):
                return None
            if isinstance(reply, BaseException):
                raise reply
            for i, value in zip(idx, reply, strict=True):
                if isinstance(value, ReplyError):
                    return None
                values[i] = value
        return values

    def _loop_readers(self, slot_map: _SlotMap) -> list[ReadConnection]:
        """This loop's read connection to each primary of ``slot_map``, in its order. Those to
        nodes that are no longer primaries are closed when the slot map changes."""
        loop = asyncio.get_running_loop()
        readers = self._readers.get(loop)
        if readers is None:
            readers = self._readers[loop] = _LoopReaders()
        if readers.slot_map is slot_map:
            return readers.primaries
        names = {node.name for node in slot_map.primaries}
        for name in [name for name in readers.by_name if name not in names]:
            readers.by_name.pop(name).close()
        options = self._options
        for node in slot_map.primaries:
            if node.name not in readers.by_name:
                readers.by_name[node.name] = ReadConnection(
                    host=node.host,
                    port=node.port,
                    username=options.get("username"),
                    password=options.get("password"),
                    timeout=options.get("socket_timeout") or DEFAULT_READ_TIMEOUT,
                    connect_timeout=options.get("socket_connect_timeout") or DEFAULT_READ_TIMEOUT,
                )
        readers.primaries = [readers.by_name[node.name] for node in slot_map.primaries]
        readers.slot_map = slot_map
        return readers.primaries

    def _read_epochs(self, models: Sequence[str]) -> list[tuple[bytes | None, bool]]:
        """Per model: the raw ``kv.3:{M}:epoch`` value, and whether every witness holds its
        generation."""
        if not models:
            return []
        slots = self._witness_slots()
        commands: list[tuple[int, tuple]] = []
        for m in models:
            mk = _model_keys(self._prefix, m)
            commands.append((mk.model_slot, ("GET", mk.epoch)))
            commands += [(s, ("GET", mk.witness_prefix + slot_tag(s) + b"}")) for s in slots]
        replies = self._round(commands)
        out = []
        step = 1 + len(slots)
        for n in range(len(models)):
            raw, witnesses = replies[n * step], replies[n * step + 1 : (n + 1) * step]
            generation = raw.partition(b" ")[0] if raw else None
            out.append((raw, generation is not None and all(w == generation for w in witnesses)))
        return out

    def _witness_slots(self) -> list[int]:
        """The lowest slot of each master in the slot map, sorted."""
        return self._map().witness_slots

    def _map(self) -> _SlotMap:
        """The slot map as tables, made again when redis-py's changes."""
        cache = self._nodes().slots_cache
        slot_map = self._slot_map
        if slot_map is None or slot_map.source is not cache:
            slot_map = self._slot_map = _SlotMap.of(cache)
        return slot_map

    # -- plumbing: phases -------------------------------------------------------------------------

    def _run_phase(self, lanes: dict[tuple[str, str], _Lane], counts: list[int]) -> bool:
        """Run one phase of ``lanes`` (pod round, block round, finish round), adding each op's
        count at its update's position; returns whether a clear slice left entries. Lanes whose
        lease another writer holds are run again, alone, until it lets go or expires."""
        if not lanes:
            return False
        token = b"%s:%d" % (self._writer.encode(), threading.get_ident())
        deadline = time.monotonic() + LEASE_SECONDS + REDIRECT_BUDGET_SECONDS
        pause = 0.005
        more = False
        pending = list(lanes.values())
        while pending:
            working = [lane for lane in pending if lane.args]
            replies = self._round(
                [
                    (
                        lane.keys.slot,
                        (
                            "EVALSHA",
                            self._scripts.apply.sha,
                            len(lane.keys.applied),
                            *lane.keys.applied,
                            token,
                            int(LEASE_SECONDS * 1000),
                            *lane.args,
                        ),
                    )
                    for lane in working
                ],
                write=True,
            )
            busy, blocks, finish = [], [], []
            for lane, reply in zip(working, replies, strict=True):
                if not reply[0]:
                    busy.append(lane)
                    continue
                for position, count in zip(lane.positions, reply[1], strict=True):
                    counts[position] += int(count)
                more = more or bool(reply[2])
                blocks += self._block_ops(lane, reply[3], reply[4])
                if reply[3] or reply[4]:
                    finish.append((lane, token))
                elif lane.progress is not None:
                    finish.append((lane, b""))
            finish += [(lane, b"") for lane in pending if not lane.args and lane.progress is not None]
            if blocks:
                self._cross_slot(blocks, self._blocks_call, write=True)
            if finish:
                done = self._round(
                    [
                        (
                            lane.keys.slot,
                            (
                                "EVALSHA",
                                _FINISH.sha,
                                3,
                                lane.keys.lease,
                                lane.keys.dirty,
                                lane.keys.seq,
                                own,
                                b"" if lane.progress is None else lane.progress,
                            ),
                        )
                        for lane, own in finish
                    ],
                    write=True,
                )
                if not all(done):
                    raise IndexUnavailable("another writer took over a pod's lease mid-phase; retry")
            pending = busy
            if pending:
                if time.monotonic() > deadline:
                    raise IndexUnavailable("another writer holds a pod of this update for too long")
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        return more

    def _block_ops(self, lane: _Lane, held: Iterable[bytes], gone: Iterable[bytes]) -> list[tuple[int, Any]]:
        """The block round's ops for a lane's dirty entries "T K" (K: 8 bytes): (slot, (entry,
        block name, its digest's head to add it with, or ``None`` to remove it))."""
        prefix = _model_keys(self._prefix, lane.model).block_prefix
        pod, heads = lane.keys.pod, lane.heads
        ops = []
        for entries, add in ((held, True), (gone, False)):
            for entry in entries:
                tier, key = entry[:-9], entry[-8:]
                tag = _tag_of_word(key)
                head = heads.get(key, _NO_HEAD) if add else None
                ops.append((_slot(tag), (pod + b"@" + tier, prefix + tag + b"}", head)))
        return ops

    @staticmethod
    def _blocks_call(ops: Sequence[tuple[bytes, bytes, bytes | None]]) -> tuple:
        """One ``_BLOCKS`` call for ``ops`` (entry, block name, head or ``None``), grouped by entry."""
        groups: dict[bytes, tuple[list[bytes], list[bytes], list[bytes]]] = {}
        for entry, name, head in ops:
            adds, heads, drops = groups.setdefault(entry, ([], [], []))
            if head is None:
                drops.append(name)
            else:
                adds.append(name)
                heads.append(head)
        args: list[bytes | int] = []
        for entry, (adds, heads, drops) in groups.items():
            args += [entry, len(adds), len(drops), *adds, *heads, *drops]
        return ("EVALSHA", _BLOCKS.sha, 0, *args)

    # -- plumbing: rounds -------------------------------------------------------------------------

    def _nodes(self) -> NodesManager:
        """redis-py's view of the cluster (slot map, a connection pool per node), made on first
        use."""
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = RedisCluster(
                        startup_nodes=self._startup,
                        decode_responses=False,
                        require_full_coverage=False,
                        **self._options,
                    )
                client = self._client
        return client.nodes_manager

    def _primary(self, slot: int) -> ClusterNode:
        slot_map = self._map()
        n = slot_map.owner[slot]
        if n < 0:
            raise IndexUnavailable(f"no node of the cluster serves slot {slot}")
        return slot_map.primaries[n]

    def _refresh(self) -> None:
        """Read the slot map again (after a redirection or a node that did not answer)."""
        with contextlib.suppress(redis.RedisError, RedisClusterException):
            self._nodes().initialize()  # else the call raises IndexUnavailable for what did not answer

    def _round(self, commands: Sequence[tuple[int, tuple]], *, write: bool = False) -> list[Any]:
        """Send each ``(slot, args)`` to the primary serving ``slot``: one pipeline per node,
        every node's written before any is read. Returns the replies in order. Follows MOVED,
        ASK, TRYAGAIN and CLUSTERDOWN (the slot map read again, then resent) for up to
        ``REDIRECT_BUDGET_SECONDS``; a node that does not answer raises ``IndexUnavailable``
        (the slot map is read again first, and the commands resent once if their slots moved
        to other nodes). Other error replies are raised. ``write``: wait for a replica."""
        replies: list[Any] = [None] * len(commands)
        todo = list(range(len(commands)))
        asking: dict[int, ClusterNode] = {}
        deadline = time.monotonic() + REDIRECT_BUDGET_SECONDS
        resent_after_failure = False
        while todo:
            batches: dict[ClusterNode, list[int]] = {}
            flags: dict[ClusterNode, list[bool]] = {}
            for i in todo:
                target = asking.pop(i, None)
                node = target or self._primary(commands[i][0])
                batches.setdefault(node, []).append(i)
                flags.setdefault(node, []).append(target is not None)
            sent = self._exchange(
                {node: [commands[i][1] for i in idx] for node, idx in batches.items()},
                write=write,
                asking=flags,
            )
            todo, failure, redirected = [], None, False
            for node, idx in batches.items():
                for i, reply in zip(idx, sent[node], strict=True):
                    replies[i] = reply
                    if _failed(reply):
                        failure = reply
                        todo.append(i)
                    elif isinstance(reply, AskError) and not isinstance(reply, redis.exceptions.MovedError):
                        asking[i] = self._nodes().get_node(host=reply.host, port=reply.port) or self._primary(
                            reply.slot_id
                        )
                        todo.append(i)
                    elif _is_redirect(reply):
                        redirected = True
                        todo.append(i)
            if not todo:
                break
            if failure is not None:
                before = {i: self._primary(commands[i][0]).name for i in todo}
                self._refresh()
                moved = any(self._primary(commands[i][0]).name != name for i, name in before.items())
                if resent_after_failure or not moved:
                    raise IndexUnavailable(f"the Redis cluster index is unreachable: {failure}")
                resent_after_failure = True
                continue
            if time.monotonic() > deadline:
                raise IndexUnavailable(f"the Redis cluster kept redirecting: {replies[todo[0]]}")
            if redirected:
                self._refresh()
                time.sleep(0.01)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _cross_slot(
        self,
        items: Sequence[tuple[int, Any]],
        make_call: Callable[[list[Any]], tuple],
        *,
        write: bool,
        per_item: bool = False,
    ) -> list[Any]:
        """One script call per primary for the ``(slot, item)`` it serves, ``make_call`` of its
        items, all nodes at once. A node's call that finds a key it does not serve changed
        nothing (the scripts read first): the slot map is read again and its items sent again,
        for up to ``REDIRECT_BUDGET_SECONDS``. With ``per_item`` each call answers a list with
        one value per item, and the values are returned in the items' order."""
        out: list[Any] = [None] * len(items)
        todo = list(range(len(items)))
        deadline = time.monotonic() + REDIRECT_BUDGET_SECONDS
        resent_after_failure = False
        while todo:
            slot_map = self._map()
            owner = slot_map.owner
            groups: list[list[int]] = [[] for _ in slot_map.primaries]
            for i in todo:
                n = owner[items[i][0]]
                if n < 0:
                    raise IndexUnavailable(f"no node of the cluster serves slot {items[i][0]}")
                groups[n].append(i)
            batches = {slot_map.primaries[n]: idx for n, idx in enumerate(groups) if idx}
            sent = self._exchange(
                {node: [make_call([items[i][1] for i in idx])] for node, idx in batches.items()}, write=write
            )
            todo, failure = [], None
            for node, idx in batches.items():
                reply = sent[node][0]
                if _failed(reply):
                    failure = reply
                    todo += idx
                elif _is_redirect(reply):
                    todo += idx
                elif isinstance(reply, Exception):
                    raise reply
                elif per_item:
                    for i, value in zip(idx, reply, strict=True):
                        out[i] = value
            if not todo:
                break
            before = {i: self._primary(items[i][0]).name for i in todo}
            self._refresh()
            if failure is not None:
                if resent_after_failure or all(
                    self._primary(items[i][0]).name == n for i, n in before.items()
                ):
                    raise IndexUnavailable(f"the Redis cluster index is unreachable: {failure}")
                resent_after_failure = True
            elif time.monotonic() > deadline:
                raise IndexUnavailable("the Redis cluster kept redirecting a multi-slot call")
            else:
                time.sleep(0.01)
        return out

    def _exchange(
        self,
        batches: dict[ClusterNode, list[tuple]],
        *,
        write: bool,
        asking: dict[ClusterNode, list[bool]] | None = None,
    ) -> dict[ClusterNode, list[Any]]:
        """One round trip per node: every node's pipeline written before any reply is read.
        Replies in order per node, an error reply or the node's connection error in place. A
        node that had lost the scripts (``SCRIPT FLUSH``, a failover to a replica, a restart)
        gets them all and its refused calls once more. ``write``: each pipeline ends with a
        ``WAIT`` for one replica where the node has one; fewer acknowledgements than that fail
        the node's commands (``redis.TimeoutError``)."""
        replies = self._pipelines(batches, write=write, asking=asking)
        refused = {
            node: [n for n, reply in enumerate(node_replies) if isinstance(reply, NoScriptError)]
            for node, node_replies in replies.items()
        }
        refused = {node: ns for node, ns in refused.items() if ns}
        if refused:
            loads = [("SCRIPT", "LOAD", s.source) for s in self._all_scripts]
            self._pipelines({node: loads for node in refused}, write=False)
            again = self._pipelines(
                {node: [batches[node][n] for n in ns] for node, ns in refused.items()}, write=write
            )
            for node, ns in refused.items():
                for n, reply in zip(ns, again[node], strict=True):
                    replies[node][n] = reply
        return replies

    def _pipelines(
        self,
        batches: dict[ClusterNode, list[tuple]],
        *,
        write: bool,
        asking: dict[ClusterNode, list[bool]] | None = None,
    ) -> dict[ClusterNode, list[Any]]:
        held = []
        out: dict[ClusterNode, list[Any]] = {}
        try:
            for node, commands in batches.items():
                flags = (asking or {}).get(node) or [False] * len(commands)
                wire: list[tuple] = []
                for command, ask in zip(commands, flags, strict=True):
                    if ask:
                        wire.append(("ASKING",))
                    wire.append(command)
                replicas = self._replicas(node) if write else 0
                if replicas:
                    wire.append(("WAIT", replicas, self._wait_ms))
                try:
                    pool = node.redis_connection.connection_pool
                    conn = pool.get_connection()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    out[node] = [exc] * len(commands)
                    continue
                held.append((node, pool, conn, commands, flags, wire, replicas))
                try:
                    conn.send_packed_command(_pack(conn, wire))
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    conn.disconnect()
                    out[node] = [exc] * len(commands)
            for node, _, conn, commands, flags, wire, replicas in held:
                if node in out:
                    continue
                got: list[Any] = []
                try:
                    for _ in wire:
                        try:
                            got.append(conn.read_response())
                        except redis.ResponseError as exc:
                            got.append(exc)
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    conn.disconnect()
                    out[node] = [exc] * len(commands)
                    continue
                if replicas:
                    acknowledged = got.pop()
                    if not isinstance(acknowledged, int) or acknowledged < replicas:
                        out[node] = [
                            redis.TimeoutError(f"{node.name}: no replica acknowledged the write")
                        ] * len(commands)
                        continue
                replies = []
                at = 0
                for ask in flags:
                    at += 1 if ask else 0  # the reply to ASKING
                    replies.append(got[at])
                    at += 1
                out[node] = replies
        finally:
            for _, pool, conn, *_ in held:
                pool.release(conn)
        return out

    def _replicas(self, node: ClusterNode) -> int:
        """How many replicas a write to ``node`` waits for: one if the slot map lists one."""
        if self.wait_replicas < 1:
            return 0
        return min(self.wait_replicas, self._map().replicas.get(node.name, 0))
