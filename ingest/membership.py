"""Ingest replicas: several ``ingest`` processes share the fleet's pods, each holding a share.

**Membership.** Each replica (``ingest --replica NAME``) heartbeats its name into one hash of the
index's Redis / Valkey, ``kv:ingest:{members}`` (name -> ``"<deadline ms> <token>"``), every
``HEARTBEAT_SECONDS``, with a deadline ``TTL_SECONDS`` ahead. One Lua script per heartbeat writes
the entry, drops the expired ones and returns the live names: one round trip on one key (so it
works on a cluster too), and every deadline is set and judged by the server's clock (``TIME``),
never by the replicas', which may disagree. The token is the process's: a second process under a
live name is refused (``ReplicaNameTaken``).

**Ownership.** The enabled pods that have a registry ``event_endpoint`` go to the live member
with the highest ``blake2b(member, pod)`` (rendezvous hashing): every replica computes the same
owner from the same members, a member that leaves moves only its own pods and one that joins
takes only its share. A replica *holds* what it owns (connects to it, indexes it):

* at once when nobody held it (a new pod, no other member) or when its previous owner is no
  longer a live member (its entry expired, or it left);
* ``HANDOVER_SECONDS`` later when a live member held it until now (this replica just joined):
  that member sees the newcomer on its next heartbeat and lets go first.

A replica that could not heartbeat for ``TTL_SECONDS - HEARTBEAT_SECONDS`` lets go of every pod
(its entry is about to expire and the others to take its pods); after a silence longer than the
TTL it comes back as a newcomer. So a replica that dies is replaced within ``TTL_SECONDS +
HEARTBEAT_SECONDS`` (6 s), and the pipeline catches the pods up from what the index recorded
(``IngestPipeline.hold``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

from ingest.ratelimit import RateLimitedLog
from kvindex.base import IndexUnavailable
from registry.config import ServiceConfig

log = logging.getLogger(__name__)
HEARTBEAT_LOG = RateLimitedLog(log)

HEARTBEAT_SECONDS = 1.0
"""How often a replica renews its membership (and looks at the members and the registry)."""
TTL_SECONDS = 5.0
"""How long a membership lasts unrenewed: a replica that stops is replaced within this plus one
heartbeat."""
HANDOVER_SECONDS = 2.0
"""How long a newcomer waits before taking a pod a live member holds (two heartbeats: time for
that member to see the newcomer and let go)."""
MEMBERS_KEY = "kv:ingest:{members}"
"""The hash of live members, in the index's Redis / Valkey (hash-tagged: one slot on a cluster)."""


def owner(pod: str, members: Collection[str]) -> str | None:
    """The member that owns ``pod`` (rendezvous hashing); None when there are no members."""
    return max(members, key=lambda member: (_weight(member, pod), member), default=None)


def _weight(member: str, pod: str) -> int:
    digest = hashlib.blake2b(f"{member}\0{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class ReplicaNameTaken(Exception):
    """Another live process heartbeats under this replica name."""


class MembershipStore(Protocol):
    """Where the replicas' memberships live. Errors reaching it are ``IndexUnavailable``."""

    def heartbeat(self, name: str, *, token: str, ttl: float) -> list[str]:
        """Renew ``name`` (held by ``token``) for ``ttl`` seconds; the live members, ``name``
        included. Raises ``ReplicaNameTaken`` when another token holds ``name``."""
        ...

    def members(self) -> list[str]:
        """The live members."""
        ...

    def leave(self, name: str, *, token: str) -> None:
        """End ``name``'s membership now (when ``token`` holds it)."""
        ...


# KEYS: the members hash. ARGV: name ("" to only read), token, ttl (ms). Returns {1, live names...},
# or {0, name} when another token holds the name. Expired entries are dropped; the key expires
# with its last member.
_HEARTBEAT = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local name, token, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local live, last = {1}, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local deadline, holder = string.match(all[i + 1], '^(%d+) (.*)$')
  deadline = tonumber(deadline) or 0
  if deadline <= now then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] == name and holder ~= token then
    return {0, name}
  else
    if all[i] ~= name then live[#live + 1] = all[i] end
    if deadline > last then last = deadline end
  end
end
if name ~= '' then
  redis.call('HSET', KEYS[1], name, (now + ttl) .. ' ' .. token)
  live[#live + 1] = name
  if now + ttl > last then last = now + ttl end
end
if last > 0 then redis.call('PEXPIREAT', KEYS[1], last) end
return live
"""

# KEYS: the members hash. ARGV: name, token. Removes the entry when the token holds it.
_LEAVE = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value and string.sub(value, -string.len(ARGV[2]) - 1) == ' ' .. ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


class RedisMembership:
    """Membership in a Redis / Valkey server or cluster (module docstring); thread-safe."""

    def __init__(self, client: redis.Redis | RedisCluster, *, key: str = MEMBERS_KEY) -> None:
        self.client = client
        self.key = key
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._leave = client.register_script(_LEAVE)

    def heartbeat(self, name: str, *, token: str, ttl: float) -> list[str]:
        if not name:
            raise ValueError("a replica needs a name")
        return self._call(name, token, ttl)

    def members(self) -> list[str]:
        return self._call("", "", 0.0)

    def leave(self, name: str, *, token: str) -> None:
        with self._unavailable():
            self._leave(keys=[self.key], args=[name, token])

    def close(self) -> None:
        self.client.close()

    def _call(self, name: str, token: str, ttl: float) -> list[str]:
        with self._unavailable():
            reply = self._heartbeat(keys=[self.key], args=[name, token, max(1, round(ttl * 1000))])
        if reply[0] == 0:
            raise ReplicaNameTaken(f"replica name {name!r} is held by another live ingest process")
        return sorted(member.decode() for member in reply[1:])

    @contextlib.contextmanager
    def _unavailable(self) -> Iterator[None]:
        try:
            yield
        except (redis.RedisError, RedisClusterException) as e:
            raise IndexUnavailable(f"the index's Redis (replica membership) is unreachable: {e}") from e


class SoloMembership:
    """A membership of one, in this process: its replica is always the only live member, so it
    holds every enabled pod with an event endpoint, and follows the registry as replicas do.
    What a process that keeps an index of its own runs (``--index in-process``): each such
    process subscribes to every pod itself, and none shares anything with another."""

    def __init__(self) -> None:
        self._member: str | None = None

    def heartbeat(self, name: str, *, token: str, ttl: float) -> list[str]:
        if not name:
            raise ValueError("a replica needs a name")
        self._member = name
        return [name]

    def members(self) -> list[str]:
        return [self._member] if self._member is not None else []

    def leave(self, name: str, *, token: str) -> None:
        if name == self._member:
            self._member = None


def open_membership(url: str, *, timeout: float = 2.0) -> RedisMembership:
    """Membership in the Redis the index URL names (``kvindex.open_index``'s URLs):
    ``redis://``, ``rediss://``, ``unix://`` or ``redis-cluster://host:port[,host:port...]``.
    Replies wait at most ``timeout`` seconds (unless the URL says otherwise). An in-process
    (``memory://``) index cannot be shared: ``ValueError``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return RedisMembership(client)
    if scheme == "redis-cluster":
        userinfo, _, hosts = parts.netloc.rpartition("@")
        options: dict = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        for name, value in parse_qsl(parts.query):
            if name in ("socket_timeout", "socket_connect_timeout"):
                options[name] = float(value)
        if userinfo:
            user, _, password = userinfo.partition(":")
            options.update(username=unquote(user) or None, password=unquote(password) or None)
        nodes = []
        for seed in hosts.split(","):
            host, _, port = seed.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a seed node must be host:port, not {seed!r} in {url!r}")
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        return RedisMembership(RedisCluster(startup_nodes=nodes, require_full_coverage=False, **options))
    raise ValueError(
        f"ingest replicas share their membership through a Redis / Valkey index, not {scheme}:// "
        "(an in-process index cannot be shared: run one ingest, or use KVCACHE_INDEX_BACKEND=redis "
        "or a redis-cluster:// URL)"
    )


@dataclass(frozen=True, slots=True)
class Holding:
    """What one replica holds: ``held`` pods (-> their event endpoints), the ``foreign`` ones
    (pods with an event endpoint that another replica holds or is handing over: their messages
    are not this replica's to index) and the live ``members`` it saw."""

    members: tuple[str, ...] = ()
    held: Mapping[str, str] = field(default_factory=dict)
    foreign: frozenset[str] = frozenset()


class Replica:
    """Keeps this replica's membership alive and hands its ``Holding`` to ``on_change``
    whenever membership or the registry changes it (module docstring): on ``join`` (the first
    heartbeat, before the pipeline starts), then once per heartbeat from ``start`` to ``stop``.
    ``on_change`` runs on the heartbeat thread."""

    def __init__(
        self,
        *,
        name: str,
        store: MembershipStore,
        config: Callable[[], ServiceConfig],
        on_change: Callable[[Holding], None],
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        ttl_seconds: float = TTL_SECONDS,
        handover_seconds: float = HANDOVER_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not name or not name.isprintable() or " " in name:
            raise ValueError(f"a replica name must be printable, without spaces, not {name!r}")
        if ttl_seconds < 2 * heartbeat_seconds:
            raise ValueError("the membership TTL must last at least two heartbeats")
        self.name = name
        self.store = store
        self.config = config
        self.on_change = on_change
        self.heartbeat_seconds = heartbeat_seconds
        self.ttl_seconds = ttl_seconds
        self.handover_seconds = handover_seconds
        self.token = secrets.token_hex(8)
        self.holding = Holding()
        self.changes = 0  # times the held pods changed
        self._clock = clock
        self._view: tuple[str, ...] | None = None  # members at the last heartbeat (None: not in)
        self._last_ok = float("-inf")
        self._due: dict[str, float] = {}  # pod -> when a newcomer takes it from a live member
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self) -> Holding:
        """The first heartbeat: raises ``ReplicaNameTaken`` or ``IndexUnavailable``."""
        return self.tick()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ingest-replica", daemon=True)
        self._thread.start()

    def stop(self, *, leave: bool = True) -> None:
        """Stop heartbeating; ``leave``: end the membership now, so that the others take its
        pods on their next heartbeat (else they do once it expires)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.heartbeat_seconds + 10)
        if leave:
            try:
                self.store.leave(self.name, token=self.token)
            except IndexUnavailable as e:
                log.warning("replica %s could not leave (its membership expires instead): %s", self.name, e)

    def tick(self) -> Holding:
        """One heartbeat, and the holding it leads to (handed to ``on_change`` if it changed).
        Raises what the heartbeat raised, after letting go of the pods if it must."""
        with self._lock:
            now = self._clock()
            try:
                members = tuple(self.store.heartbeat(self.name, token=self.token, ttl=self.ttl_seconds))
            except ReplicaNameTaken:
                self._let_go()
                raise
            except IndexUnavailable:
                if now - self._last_ok >= self.ttl_seconds - self.heartbeat_seconds:
                    self._let_go()
                raise
            rejoined = self._view is None or now - self._last_ok > self.ttl_seconds
            before, was_held = (None, {}) if rejoined else (self._view, self.holding.held)
            self._last_ok, self._view = now, members
            ring = self._ring()
            others = [m for m in members if m != self.name]
            held, due = {}, {}
            for pod, endpoint in ring.items():
                if owner(pod, members) != self.name:
                    continue
                if pod not in was_held:
                    due_at = self._due.get(pod)  # already waiting for a live holder to let go
                    if due_at is None:
                        previous = owner(pod, before if before is not None else others)
                        if previous not in (None, self.name) and previous in members:  # a live holder
                            due_at = now + self.handover_seconds
                    if due_at is not None and now < due_at:
                        due[pod] = due_at
                        continue
                held[pod] = endpoint
            self._due = due
            self._publish(Holding(members, held, frozenset(ring).difference(held)))
            return self.holding

    def _ring(self) -> dict[str, str]:
        """The pods shared out: enabled, with an event endpoint."""
        config = self.config()
        return {pod: e for pod, e in config.event_endpoints.items() if pod not in config.disabled_pods}

    def _let_go(self) -> None:
        """Hold nothing: this replica's membership has lapsed (or its name is taken), so the
        other replicas take (or have taken) its pods."""
        self._view, self._due = None, {}
        if self.holding.held:
            log.warning(
                "replica %s lets go of its %d pods: its membership lapsed", self.name, len(self.holding.held)
            )
        self._publish(Holding((), {}, frozenset(self._ring())))

    def _publish(self, holding: Holding) -> None:
        old, self.holding = self.holding, holding
        if dict(holding.held) != dict(old.held):
            self.changes += 1
            took = sorted(set(holding.held) - set(old.held))
            released = sorted(set(old.held) - set(holding.held))
            log.info(
                "replica %s holds %d of %d pods; %d live members (%s)%s%s",
                self.name,
                len(holding.held),
                len(holding.held) + len(holding.foreign),
                len(holding.members),
                ", ".join(holding.members),
                f"; took {', '.join(took)}" if took else "",
                f"; let go of {', '.join(released)}" if released else "",
            )
        elif holding.members != old.members:
            log.info(
                "replica %s: %d live members (%s)",
                self.name,
                len(holding.members),
                ", ".join(holding.members),
            )
        if dict(holding.held) != dict(old.held) or holding.foreign != old.foreign:
            self.on_change(holding)

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self.tick()
            except ReplicaNameTaken as e:
                HEARTBEAT_LOG.warning("taken", "replica %s holds no pods: %s", self.name, e)
            except IndexUnavailable as e:
                HEARTBEAT_LOG.warning("unavailable", "replica %s could not heartbeat: %s", self.name, e)
            except Exception:
                log.exception("replica %s: the heartbeat failed", self.name)


class ReplicaCollector(Collector):
    """A replica's membership for prometheus_client: live members, pods held, ownership changes
    and messages ignored because another replica holds their pod (``foreign_messages``)."""

    def __init__(self, replica: Replica, *, foreign_messages: Callable[[], int] = lambda: 0) -> None:
        self.replica = replica
        self.foreign_messages = foreign_messages

    def collect(self) -> Iterator:
        holding, name = self.replica.holding, self.replica.name
        for metric, help_text, value in (
            ("kvcache_ingest_replica_members", "Live ingest replicas this one sees.", len(holding.members)),
            (
                "kvcache_ingest_replica_pods",
                "Pods this ingest replica holds (connects to, indexes).",
                len(holding.held),
            ),
            (
                "kvcache_ingest_replica_foreign_pods",
                "Pods with an event endpoint that other ingest replicas hold.",
                len(holding.foreign),
            ),
        ):
            gauge = GaugeMetricFamily(metric, help_text, labels=["replica"])
            gauge.add_metric([name], value)
            yield gauge
        changes = CounterMetricFamily(
            "kvcache_ingest_replica_ownership_changes",
            "Times the pods this replica holds changed.",
            labels=["replica"],
        )
        changes.add_metric([name], self.replica.changes)
        yield changes
        foreign = CounterMetricFamily(
            "kvcache_ingest_replica_foreign_messages",
            "Messages ignored because another replica holds their pod (a hand-over's overlap).",
            labels=["replica"],
        )
        foreign.add_metric([name], self.foreign_messages())
        yield foreign
