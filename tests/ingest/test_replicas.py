"""Ingest replicas on real parts: engines as the simulator's publishers (a bound PUB and a replay
ROUTER, as vLLM's with a bind endpoint), a real Valkey holding the index and the membership, and
real pipelines that connect to the pods they hold. A replica "killed" stops heartbeating and
receiving without leaving: what a crash looks like to the others.

The replicas here heartbeat every 0.2 s with a 1 s TTL so that the tests stay fast; the defaults
(1 s, 5 s) give the same steps five times slower (``test_the_default_timings_take_over_within_10_s``).
"""

from __future__ import annotations

import functools
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import zmq
from django.core.management import CommandError, call_command

from ingest.events import encode_batch, encode_message
from ingest.membership import (
    HANDOVER_SECONDS,
    HEARTBEAT_SECONDS,
    MEMBERS_KEY,
    TTL_SECONDS,
    Holding,
    RedisMembership,
    Replica,
    ReplicaNameTaken,
    open_membership,
    owner,
)
from ingest.pipeline import IngestPipeline
from ingest.replay import ReplayClient
from kvindex import IndexUnavailable, KVIndex, open_index
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from tests.events import stored_event
from tests.ingest.conftest import MODEL
from tests.ingest.test_replay import BLOCK, SEED, Engine, block
from tests.servers import free_port, service_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
PODS = [f"pod-{i}" for i in range(8)]
FAST = {"heartbeat_seconds": 0.2, "ttl_seconds": 1.0, "handover_seconds": 0.4}
FLEET = {**FAST, "ttl_seconds": 2.0}
"""A fleet's replicas (real threads): a TTL long enough that a heartbeat thread stalled by the
loaded machine (two replicas, their worker processes, the engines and Valkey on 2 cores) is not
taken for a replica whose membership lapsed, which rightly lets its pods go for a hand-over and
takes them back: one ownership change more than the test counts (seen once in CI)."""


class Fleet:
    """Engines that bind their PUB and replay ROUTER, registered with their event endpoints."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.context = zmq.Context()
        self.engines = {pod: Engine(self.context, "tcp://127.0.0.1:*", pod) for pod in PODS}
        self.index = open_index(redis_url)
        self.replicas: list[ReplicaNode] = []

    def config(self) -> ServiceConfig:
        return ServiceConfig(
            seed=SEED,
            default_block_size=BLOCK,
            pods=dict.fromkeys(self.engines, MODEL),
            replay_endpoints={pod: e.replay_endpoint for pod, e in self.engines.items()},
            event_endpoints={pod: e.publisher.bound_endpoint for pod, e in self.engines.items()},
        )

    def replica(self, name: str, *, processes: int = 1) -> ReplicaNode:
        node = ReplicaNode(self, name, processes=processes)
        self.replicas.append(node)
        return node

    def store_everywhere(self, n: int = 1) -> None:
        for engine in self.engines.values():
            for _ in range(n):
                engine.store()

    def applied(self, pods: list[str] | None = None) -> bool:
        """Whether the index has applied every batch of ``pods`` (all) and holds their chains."""
        progress = self.index.progress(model=MODEL)
        for pod in pods or PODS:
            engine = self.engines[pod]
            if progress.get((MODEL, pod)) != engine.publisher.next_seq - 1 or self.held(pod) != len(
                engine.chain
            ):
                return False
        return True

    def held(self, pod: str) -> int:
        """How many leading blocks of the pod's chain the index says it holds."""
        tokens = [t for i in range(len(self.engines[pod].chain) + 4) for t in block(i, None)[0].token_ids]
        keys = block_keys(tokens, seed=SEED, block_size=BLOCK)
        return len(self.index.lookup(model=MODEL, keys=keys, pods=[pod]))

    def close(self) -> None:
        for node in self.replicas:
            node.stop()
        for engine in self.engines.values():
            engine.close()
        self.index.close()
        self.context.destroy(linger=0)


class ReplicaNode:
    """One ingest replica: a pipeline in replica mode, its membership, its own index handle."""

    def __init__(self, fleet: Fleet, name: str, *, processes: int = 1, **timings: float) -> None:
        self.index = open_index(fleet.redis_url)
        self.pipeline = IngestPipeline(
            index=self.index,
            config=fleet.config,
            workers=2,
            processes=processes,
            index_factory=functools.partial(open_index, fleet.redis_url) if processes > 1 else None,
            context=fleet.context,
            replay=ReplayClient(config=fleet.config, context=fleet.context, timeout=1.0),
            epoch_check_seconds=None,
            replica=True,
        )
        self.store = RedisMembership(redis.Redis.from_url(fleet.redis_url))
        self.replica = Replica(
            name=name,
            store=self.store,
            config=fleet.config,
            on_change=lambda h: self.pipeline.hold(h.held, foreign=h.foreign),
            **(timings or FLEET),
        )
        self.replica.join()
        self.pipeline.start()
        self.replica.start()
        self.running = True

    @property
    def held(self) -> set[str]:
        return set(self.replica.holding.held)

    def streams(self) -> set[str]:
        """Pods this replica received a live batch from."""
        return {s.pod for s in self.pipeline.stats.streams() if s.batches}

    def kill(self) -> None:
        """Stop heartbeating and receiving, without leaving: a crash, as the others see it."""
        self.replica.stop(leave=False)
        self.pipeline.stop(drain_timeout=5)
        self.running = False

    def stop(self) -> None:
        if self.running:
            self.pipeline.stop(drain_timeout=5)
            self.replica.stop(leave=True)
            self.running = False
        self.store.close()
        self.index.close()


@pytest.fixture
def fleet(redis_url: str) -> Iterator[Fleet]:
    f = Fleet(redis_url)
    yield f
    f.close()


def shared_out(*nodes: ReplicaNode) -> bool:
    """Every pod held by exactly one of ``nodes``, each of which holds some."""
    held = [node.held for node in nodes]
    return all(held) and sum(len(h) for h in held) == len(PODS) and set().union(*held) == set(PODS)


# --- ownership -------------------------------------------------------------------------------------


def test_rendezvous_moves_only_the_pods_of_a_member_that_leaves_or_to_one_that_joins():
    pods = [f"pod-{i}" for i in range(200)]
    before = {pod: owner(pod, ["r1", "r2", "r3"]) for pod in pods}
    left = {pod: owner(pod, ["r1", "r3"]) for pod in pods}
    assert {pod for pod in pods if left[pod] != before[pod]} == {p for p in pods if before[p] == "r2"}
    joined = {pod: owner(pod, ["r1", "r2", "r3", "r4"]) for pod in pods}
    assert {joined[pod] for pod in pods if joined[pod] != before[pod]} == {"r4"}
    assert 30 < sum(1 for pod in pods if joined[pod] == "r4") < 70  # about a quarter
    assert owner("pod-0", []) is None


def test_the_default_timings_take_over_within_10_s():
    # A dead member's entry lasts at most the TTL from its last heartbeat; a survivor sees it
    # gone on its next heartbeat and takes the pods at once (their owner is no longer live).
    assert TTL_SECONDS + HEARTBEAT_SECONDS <= 6.0 < 10.0
    assert HANDOVER_SECONDS >= 2 * HEARTBEAT_SECONDS  # a live holder lets go first


# --- membership in the index's Valkey ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
def test_members_heartbeat_expire_and_leave_by_the_servers_clock(request, backend):
    url = request.getfixturevalue("redis_cluster_url" if backend == "redis-cluster" else "redis_url")
    store = open_membership(url)
    try:
        assert store.heartbeat("r1", token="t1", ttl=5) == ["r1"]
        assert store.heartbeat("r2", token="t2", ttl=0.3) == ["r1", "r2"]
        assert store.members() == ["r1", "r2"]
        wait_until(lambda: store.members() == ["r1"], timeout=3, what="r2's membership to expire")
        store.leave("r1", token="not-r1's")  # only its own process ends a membership
        assert store.members() == ["r1"]
        store.leave("r1", token="t1")
        assert store.members() == []
    finally:
        store.close()


def test_a_second_process_under_a_live_name_is_refused(redis_url):
    store = open_membership(redis_url)
    try:
        store.heartbeat("r1", token="first", ttl=5)
        with pytest.raises(ReplicaNameTaken):
            store.heartbeat("r1", token="second", ttl=5)
        store.leave("r1", token="first")
        assert store.heartbeat("r1", token="second", ttl=5) == ["r1"]  # free again
        assert redis.Redis.from_url(redis_url).pttl(MEMBERS_KEY) > 0  # the key goes with its members
    finally:
        store.close()


def test_a_replica_that_cannot_heartbeat_lets_go_of_its_pods_before_its_membership_lapses(redis_url):
    """Its entry is about to expire: the others take its pods, so it stops indexing them first."""
    now = [0.0]
    changes: list[Holding] = []
    config = ServiceConfig(event_endpoints={"pod-a": "tcp://127.0.0.1:1"})
    store = open_membership(redis_url)
    replica = Replica(
        name="r1", store=store, config=lambda: config, on_change=changes.append, clock=lambda: now[0], **FAST
    )
    gone = open_membership(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    try:
        assert set(replica.join().held) == {"pod-a"}
        replica.store = gone
        now[0] = 0.5
        with pytest.raises(IndexUnavailable):
            replica.tick()
        assert set(replica.holding.held) == {"pod-a"}  # within the TTL minus a heartbeat: kept
        now[0] = 0.9
        with pytest.raises(IndexUnavailable):
            replica.tick()
        assert replica.holding == Holding((), {}, frozenset({"pod-a"}))
        assert changes[-1] == replica.holding
        replica.store = store  # back: it rejoins as a newcomer, and nobody else holds pod-a
        now[0] = 2.5
        assert set(replica.tick().held) == {"pod-a"}
    finally:
        store.close()
        gone.close()


# --- replicas sharing a fleet -------------------------------------------------------------------------


def test_two_replicas_share_the_pods_each_once_and_index_all_of_them(fleet):
    a, b = fleet.replica("r1"), fleet.replica("r2")
    wait_until(lambda: shared_out(a, b), timeout=5, what="the pods shared out")
    assert (a.held, b.held) == ({p for p in PODS if owner(p, ["r1", "r2"]) == "r1"}, set(PODS) - a.held)
    endpoints = {fleet.engines[p].publisher.bound_endpoint for p in a.held}
    wait_until(lambda: a.pipeline.receiver.connected == endpoints, timeout=1, what="r1's connections")

    fleet.store_everywhere(3)
    wait_until(fleet.applied, timeout=10, what="every pod's blocks in the index")
    assert a.streams() <= a.held and b.streams() <= b.held  # nobody indexed another's pod
    assert a.streams() | b.streams() == set(PODS)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_killed_replicas_pods_are_taken_over_and_what_they_sent_meanwhile_is_replayed(fleet, processes):
    """Also with each replica's workers in 2 processes (``ingest --replica R --processes 2``): the
    worker process of a taken pod is told where the index says it stands."""
    a, b = fleet.replica("r1", processes=processes), fleet.replica("r2", processes=processes)
    wait_until(lambda: shared_out(a, b), timeout=5, what="the pods shared out")
    fleet.store_everywhere(2)
    wait_until(fleet.applied, timeout=10, what="every pod's blocks in the index")

    orphans = sorted(b.held)
    killed_at = time.monotonic()
    b.kill()
    fleet.store_everywhere(2)  # b's pods publish to nobody for a while
    for pod in orphans:
        fleet.engines[pod].evict_last()
    wait_until(lambda: a.held == set(PODS), timeout=10, what="r1 to take r2's pods")
    wait_until(lambda: fleet.applied(orphans), timeout=10, what="what r2's pods sent meanwhile")
    took = time.monotonic() - killed_at
    assert took < 10
    print(f"takeover (TTL {FLEET['ttl_seconds']}s, heartbeat {FLEET['heartbeat_seconds']}s): {took:.2f}s")

    fleet.store_everywhere(1)  # and live again, through r1's new connections
    wait_until(fleet.applied, timeout=10, what="every pod's later blocks")
    assert set(PODS) - set(orphans) <= a.streams()
    assert a.pipeline.receiver.connected == {e.publisher.bound_endpoint for e in fleet.engines.values()}
    assert a.replica.changes == 3  # all, its share, all


def test_a_replica_that_joins_takes_its_share_and_no_event_is_lost_in_the_hand_over(fleet):
    a, b = fleet.replica("r1"), fleet.replica("r2")
    wait_until(lambda: shared_out(a, b), timeout=5, what="the pods shared out")
    fleet.store_everywhere(1)
    wait_until(fleet.applied, timeout=10, what="every pod's blocks in the index")

    c = fleet.replica("r6")
    deadline = time.monotonic() + 10
    while not shared_out(a, b, c):  # the engines go on storing all through the hand-over
        assert time.monotonic() < deadline, "r6 never got its share"
        fleet.store_everywhere(1)
        time.sleep(0.05)
    assert c.held == {p for p in PODS if owner(p, ["r1", "r2", "r6"]) == "r6"}
    assert a.pipeline.receiver.connected.isdisjoint(c.pipeline.receiver.connected)
    fleet.store_everywhere(1)
    wait_until(fleet.applied, timeout=10, what="every batch of the hand-over in the index")


def test_a_replica_that_leaves_hands_its_pods_over_at_the_next_heartbeat(fleet):
    a, b = fleet.replica("r1"), fleet.replica("r2")
    wait_until(lambda: shared_out(a, b), timeout=5, what="the pods shared out")
    left_at = time.monotonic()
    b.stop()  # drains, then leaves: no TTL to wait for
    wait_until(lambda: a.held == set(PODS), timeout=5, what="r1 to take r2's pods")
    assert time.monotonic() - left_at < FLEET["ttl_seconds"]
    fleet.store_everywhere(1)
    wait_until(fleet.applied, timeout=10, what="every pod's blocks in the index")


def test_registry_changes_add_and_drop_connections_without_a_restart(fleet):
    a = fleet.replica("r1")
    wait_until(lambda: a.held == set(PODS), timeout=5, what="r1 to hold every pod")
    moved = fleet.engines.pop("pod-7")  # unregistered: its connection goes, its messages too
    wait_until(
        lambda: moved.publisher.bound_endpoint not in a.pipeline.receiver.connected,
        timeout=5,
        what="pod-7's connection dropped",
    )
    assert a.held == set(PODS) - {"pod-7"}
    fleet.engines["pod-7"] = moved  # registered again: connected, caught up from the index
    moved.store()
    wait_until(lambda: fleet.applied(["pod-7"]), timeout=10, what="pod-7's blocks after it came back")


# --- the command ----------------------------------------------------------------------------------------


def test_replica_mode_refuses_an_in_memory_index(settings):
    settings.KVCACHE_INDEX_BACKEND = "memory"
    with pytest.raises(CommandError, match="--replica needs an index the replicas share"):
        call_command("ingest", replica="r1")


def test_the_command_as_a_replica_indexes_its_pods_and_leaves_on_sigterm(tmp_path, redis_url, base_capture):
    env = service_env(tmp_path, redis_url)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    with sqlite3.connect(tmp_path / "db.sqlite3") as db:
        db.execute(
            "insert into scoring_pod (pod_id, address, replay_endpoint, event_endpoint, model, labels,"
            " enabled, health, registered, learned_kv_cache_groups)"
            " values ('pod-a', '', '', ?, ?, '{}', 1, 'unknown', 1, '[]')",
            (f"tcp://127.0.0.1:{port}", MODEL),
        )
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "ingest", "--replica", "r1", "--workers", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    index: KVIndex = open_index(redis_url)
    members = open_membership(redis_url)
    batch = encode_batch([stored_event(base_capture)], ts=time.time(), layout="map")
    seq = 0

    def landed() -> bool:
        nonlocal seq  # re-sent until the replica's subscription is there (stores are idempotent)
        publisher.send_multipart(encode_message("pod-a", MODEL, seq, batch))
        seq += 1
        time.sleep(0.05)
        return len(index.lookup(model=MODEL, keys=base_capture["block_hashes"])) == 25

    try:
        wait_until(landed, timeout=30, what="pod-a's blocks, received over the replica's connection")
        assert members.members() == ["r1"]
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, output
        assert "replica r1 of 1" in output and "ingest: stopped" in output
        assert members.members() == []  # it left: the others need not wait for the TTL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        publisher.close(0)
        context.term()
        members.close()
        index.close()
