"""The Valkey Cluster index: its key layout and spread, round trips per node, phases that keep the
index consistent (under concurrent writers, a writer that dies mid-phase, readers), epoch
markers across masters, redirections, and agreement with the in-memory index. A failover under
load is ``test_cluster_failover``. The conformance suite runs against the same cluster."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.connection import AbstractConnection
from redis.crc import key_slot

from kvindex import IndexUnavailable, PodBlocks, StoredBlock, open_index
from kvindex import cluster as cluster_module
from kvindex.base import ClearPod, Progress, Remove, Store
from kvindex.cluster import RedisClusterIndex, slot_tag
from kvindex.redis import encode_name
from registry.runtime import index_url
from tests.kvindex import (
    MODEL,
    agrees_with_the_memory_index,
    assert_cluster_consistent,
    chain,
    hashes,
    keys,
    tag,
)
from tests.servers import ValkeyCluster, free_port

GPU = frozenset({"gpu"})
CPU = frozenset({"cpu"})


@pytest.fixture
def cluster(redis_cluster: ValkeyCluster, redis_cluster_url: str) -> ValkeyCluster:
    """The session's cluster, emptied for this test."""
    return redis_cluster


@pytest.fixture
def index(cluster: ValkeyCluster) -> Iterator[RedisClusterIndex]:
    idx = RedisClusterIndex.from_url(cluster.url)
    yield idx
    idx.close()


@pytest.fixture(params=["fast", "compact"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def either(cluster: ValkeyCluster, layout: str) -> Iterator[RedisClusterIndex]:
    """An index in either layout."""
    idx = RedisClusterIndex.from_url(f"{cluster.url}?layout={layout}")
    yield idx
    idx.close()


def masters(cluster: ValkeyCluster) -> list[redis.Redis]:
    return [cluster.clients[p] for p in cluster.master_ports()]


def all_keys(cluster: ValkeyCluster) -> dict[bytes, int]:
    """Every key of the cluster -> the port of the master holding it."""
    return {
        name: port for port in cluster.master_ports() for name in cluster.clients[port].scan_iter(count=1000)
    }


def server_for(cluster: ValkeyCluster, name: str | bytes) -> redis.Redis:
    """A plain client on the master that holds key ``name``."""
    return cluster.clients[cluster.owner(key_slot(name.encode() if isinstance(name, str) else name))]


def lowest_slots(cluster: ValkeyCluster) -> dict[int, int]:
    """Each master's port -> the lowest slot it serves."""
    out: dict[int, int] = {}
    for first, _, master, *_ in cluster.clients[cluster.master_ports()[0]].execute_command(
        "CLUSTER", "SLOTS"
    ):
        port = int(master[1])
        out[port] = min(out.get(port, first), first)
    return out


def adopted(n: int, *, seed: int = 1) -> list[StoredBlock]:
    """``n`` blocks with well-spread keys (as real block keys are), adopted digests, and engine
    hashes of their own (another ``seed`` gives other keys and other hashes)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        key = rng.getrandbits(64)
        out.append(StoredBlock(key=key, engine_hash=rng.getrandbits(63), digest=key.to_bytes(8, "big")))
    return out


# -- configuration ---------------------------------------------------------------------------------


def test_the_backend_setting_names_a_cluster_by_its_seed_nodes(settings) -> None:
    settings.KVCACHE_INDEX_BACKEND = "redis-cluster://10.0.0.1:6379,10.0.0.2:6380"
    assert index_url() == "redis-cluster://10.0.0.1:6379,10.0.0.2:6380"

    index = open_index("redis-cluster://10.0.0.1:6379,[::1]:7000?socket_timeout=0.5&wait_replicas=0")
    assert [(n.host, n.port) for n in index._startup] == [("10.0.0.1", 6379), ("::1", 7000)]
    assert index._options["socket_timeout"] == 0.5 and index.wait_replicas == 0
    assert index.reads_async is True
    with pytest.raises(ValueError, match="host:port"):
        open_index("redis-cluster://10.0.0.1")
    with pytest.raises(ValueError, match="unknown"):
        open_index("redis-cluster://10.0.0.1:6379?db=3")


def test_an_unreachable_cluster_is_index_unavailable() -> None:
    index = open_index(f"redis-cluster://127.0.0.1:{free_port()}?socket_connect_timeout=0.5")

    with pytest.raises(IndexUnavailable):
        index.ping()
    with pytest.raises(IndexUnavailable):
        index.lookup(model=MODEL, keys=[1, 2])
    with pytest.raises(IndexUnavailable):
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=chain(1))
    with pytest.raises(IndexUnavailable):
        index.epochs([MODEL])


# -- layout ------------------------------------------------------------------------------------------


def test_keys_follow_the_documented_layout(index: RedisClusterIndex, cluster: ValkeyCluster) -> None:
    (a,) = chain(1)
    index.apply_updates(
        [
            Store("Qwen/Qwen3-0.6B", "10.0.0.1:8000", "gpu", [a]),
            Progress("Qwen/Qwen3-0.6B", "10.0.0.1:8000", 3),
        ]
    )

    m, p, k = "Qwen%2FQwen3-0.6B", "10.0.0.1%3A8000", tag(a.key)
    assert sorted(all_keys(cluster)) == sorted(
        name.encode()
        for name in (
            f"kv.3:{m}:b:{{{k}}}",
            f"kv.3:{{{m}@{p}}}:r",
            f"kv.3:{{{m}@{p}}}:n",
            f"kv.3:{{{m}@{p}}}:seq",
            f"kv.3:{{{m}}}:pods",
            "kv.3:models",
        )
    )  # no engine map: the engine hash is the key (an implied link)
    pod = server_for(cluster, f"{{{m}@{p}}}")
    block = server_for(cluster, f"{{{k}}}").get(f"kv.3:{m}:b:{{{k}}}")
    assert block == a.digest[:24] + f"{p}@gpu".encode()  # the digest's head, then the entries
    assert pod.smembers(f"kv.3:{{{m}@{p}}}:r") == {b"gpu " + a.key.to_bytes(8, "big")}
    assert pod.hgetall(f"kv.3:{{{m}@{p}}}:n") == {b"gpu": b"1"}
    assert pod.get(f"kv.3:{{{m}@{p}}}:seq") == b"3"
    assert server_for(cluster, f"{{{m}}}").smembers(f"kv.3:{{{m}}}:pods") == {p.encode()}

    index.store(model="Qwen/Qwen3-0.6B", pod="10.0.0.1:8000", tier="gpu", blocks=[a._replace(engine_hash=7)])
    word = a.key.to_bytes(8, "big")
    assert pod.hgetall(f"kv.3:{{{m}@{p}}}:e") == {(7).to_bytes(8, "big"): word}
    assert pod.hgetall(f"kv.3:{{{m}@{p}}}:k") == {word: word + (7).to_bytes(8, "big")}
    assert index.resolve(model="Qwen/Qwen3-0.6B", pod="10.0.0.1:8000", engine_hashes=[7, a.key, 8]) == [
        a.digest,
        a.digest,
        None,
    ]


def test_a_holders_keys_share_one_slot_while_its_blocks_spread(index: RedisClusterIndex, cluster) -> None:
    blocks = chain(40, engine_hash_offset=1000)  # hashes that differ from the keys: k is written
    index.apply_updates([Store(MODEL, "pod{1}", "gpu", blocks), Progress(MODEL, "pod{1}", 1)])
    index.store(model=MODEL, pod="pod{1}", tier="cpu", blocks=chain(5))

    names = list(all_keys(cluster))
    tag = encode_name(MODEL) + b"@" + encode_name("pod{1}")
    own = [n for n in names if n.startswith(b"kv.3:{" + tag + b"}")]
    assert len(own) == 5  # r, n, e, k, seq: nothing dirty, no lease once the calls returned
    assert len({key_slot(n) for n in own}) == 1
    blocks = [n for n in names if b":b:{" in n]
    assert len(blocks) == 40
    assert len({key_slot(n) for n in blocks}) >= 36  # one slot each but for collisions (40 of 16384)


def test_one_models_blocks_spread_over_every_master_within_15_percent(
    index: RedisClusterIndex, cluster: ValkeyCluster
) -> None:
    blocks = chain(3000)  # real block keys
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)

    per_master = {
        port: sum(1 for _ in cluster.clients[port].scan_iter(match=b"kv.3:*:b:{*", count=1000))
        for port in cluster.master_ports()
    }
    assert sum(per_master.values()) == 3000
    assert all(850 <= n <= 1150 for n in per_master.values()), per_master
    assert len(index.lookup(model=MODEL, keys=keys(blocks))) == 3000


# -- round trips --------------------------------------------------------------------------------------


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every pipeline written to a server and every reply read from one, as (what, port)."""
    events: list[tuple[str, int]] = []
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    def send_packed_command(self, command, check_health=True):
        events.append(("send", self.port))
        return send(self, command, check_health)

    def read_response(self, *args, **kwargs):
        events.append(("read", self.port))
        return read(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", send_packed_command)
    monkeypatch.setattr(AbstractConnection, "read_response", read_response)
    return events


def rounds(events: list[tuple[str, int]]) -> list[list[int]]:
    """The ports written to in each round: a round is the sends before the next reads."""
    out: list[list[int]] = []
    last = "read"
    for what, port in events:
        if what == "send":
            if last == "read":
                out.append([])
            out[-1].append(port)
        last = what
    return out


def test_a_lookup_is_one_script_call_per_master_written_to_all_before_any_is_read(
    index: RedisClusterIndex, cluster: ValkeyCluster, wire: list
) -> None:
    blocks = adopted(128)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    for server in masters(cluster):
        server.config_resetstat()
    wire.clear()

    assert index.lookup(model=MODEL, keys=keys(blocks), pods={"pod1"}) == [{"pod1": GPU}] * 128

    (only,) = rounds(wire)  # one round: a pipeline written to every master, then the replies read
    assert sorted(only) == sorted(cluster.master_ports())
    for server in masters(cluster):
        assert server.info("commandstats")["cmdstat_evalsha"]["calls"] == 1


def test_a_batch_of_writes_is_a_pod_round_a_block_round_and_a_finish_round(
    index: RedisClusterIndex, cluster: ValkeyCluster, wire: list
) -> None:
    blocks = adopted(300)
    for pod in ("pod1", "pod2", "pod3"):  # models and holders registered
        index.apply_updates([Store(MODEL, pod, "gpu", blocks[:1]), Progress(MODEL, pod, 0)])
    index.store(model=MODEL, pod="warm-up", tier="gpu", blocks=adopted(30, seed=9))  # scripts on every node
    wire.clear()

    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", blocks[:100]),
            Progress(MODEL, "pod1", 1),
            Store(MODEL, "pod2", "gpu", blocks[100:200]),
            Remove(MODEL, "pod1", "gpu", hashes(blocks[:10])),
            Progress(MODEL, "pod2", 1),
            Store(MODEL, "pod3", "cpu", blocks[200:]),
        ]
    )

    assert counts == [100, 0, 100, 10, 0, 100]
    assert len(rounds(wire)) == 3
    assert all(len(r) == len(set(r)) for r in rounds(wire))  # one pipeline per node and round
    assert index.progress(model=MODEL) == {(MODEL, "pod1"): 1, (MODEL, "pod2"): 1, (MODEL, "pod3"): 0}
    wire.clear()

    assert index.apply_updates([ClearPod(MODEL, "pod3"), Progress(MODEL, "pod3", 1)]) == [101, 0]
    assert len(rounds(wire)) == 4  # a clear ends its phase: the progress after it is a finish round
    assert index.progress(model=MODEL)[MODEL, "pod3"] == 1
    assert_cluster_consistent(masters(cluster))


# -- consistency -----------------------------------------------------------------------------------------


def test_agrees_with_the_memory_index_and_stays_consistent_on_a_random_workload(
    either: RedisClusterIndex, cluster: ValkeyCluster
) -> None:
    agrees_with_the_memory_index(
        either, steps=200, check=lambda: assert_cluster_consistent(masters(cluster)), check_every=20
    )


def test_agrees_with_the_memory_index_with_pods_of_hundreds_of_blocks(
    either: RedisClusterIndex, cluster: ValkeyCluster
) -> None:
    """Reverse sets large enough that the compact layout's buckets split and merge."""
    agrees_with_the_memory_index(
        either, steps=60, check=lambda: assert_cluster_consistent(masters(cluster)), check_every=15, scale=40
    )


@contextlib.contextmanager
def block_writes(cluster: ValkeyCluster) -> Iterator[list[tuple[float, str, str]]]:
    """(server time, block key's tag, SET or DEL) of every block write on any master while the
    block runs, from MONITOR (the masters share this machine's clock)."""
    writes: list[tuple[float, str, str]] = []
    ready = threading.Barrier(len(cluster.master_ports()) + 1)

    def watch(port: int) -> None:
        with cluster.clients[port].monitor() as monitor:
            ready.wait()
            for event in monitor.listen():
                command = event["command"]
                if command == "ECHO monitor-done":
                    return
                verb, _, rest = command.partition(" ")
                if verb in ("SET", "DEL") and ":b:{" in rest:
                    writes.append((event["time"], rest.split(":b:{")[1][:11], verb))

    watchers = [threading.Thread(target=watch, args=(port,)) for port in cluster.master_ports()]
    for w in watchers:
        w.start()
    ready.wait()
    try:
        yield writes
    finally:
        for port in cluster.master_ports():
            cluster.clients[port].echo("monitor-done")
        for w in watchers:
            w.join(10)
    writes.sort()


def test_blocks_land_parent_slices_first_and_leave_child_slices_first(cluster: ValkeyCluster) -> None:
    """Phases are applied in order: with slices of 4, no block of a slice is written before every
    block of the slices before it (a store in chain order: parents first; a remove in reverse
    chain order: children first), whatever master each block is on."""
    index = RedisClusterIndex.from_url(cluster.url, slice_blocks=4)
    blocks = chain(32)
    index.store(model=MODEL, pod="warm-up", tier="gpu", blocks=chain(1, first_token=9999))

    with block_writes(cluster) as writes:
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
        index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks)[::-1])

    stored = {key: at for at, key, verb in writes if verb == "SET"}
    removed = {key: at for at, key, verb in writes if verb == "DEL"}
    in_order = [tag(k) for k in keys(blocks)]
    assert stored.keys() == removed.keys() == set(in_order)
    for first in range(0, 28, 4):
        assert max(stored[k] for k in in_order[first : first + 4]) < min(
            stored[k] for k in in_order[first + 4 : first + 8]
        )
    children_first = in_order[::-1]
    for first in range(0, 28, 4):
        assert max(removed[k] for k in children_first[first : first + 4]) < min(
            removed[k] for k in children_first[first + 4 : first + 8]
        )
    index.close()


def test_readers_see_writes_half_applied_but_only_ever_a_leading_run(cluster: ValkeyCluster) -> None:
    """A reader may see a phase on one master and not yet on another (and reads each master at
    its own moment), but a lookup counts the leading run only: every result is a prefix of the
    chain, whole blocks held by the pod, never a block past one it did not see."""
    index = RedisClusterIndex.from_url(cluster.url, slice_blocks=4)
    blocks = chain(64)
    chain_keys = keys(blocks)
    lengths: set[int] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        try:
            while not stop.is_set():
                run = index.lookup(model=MODEL, keys=chain_keys)
                assert run == [{"pod1": GPU}] * len(run)
                lengths.add(len(run))
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for _ in range(6):
            index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
            assert len(index.lookup(model=MODEL, keys=chain_keys)) == 64
            index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks)[::-1])
            assert index.lookup(model=MODEL, keys=chain_keys) == []
    finally:
        stop.set()
        for r in readers:
            r.join()
        index.close()

    assert errors == []
    assert len(lengths - {0, 64}) > 0  # the readers did see writes half way
    assert_cluster_consistent(masters(cluster))


def test_a_concurrent_clear_and_store_of_one_pod_leave_no_orphan(cluster: ValkeyCluster, layout: str) -> None:
    """Ingest storing a pod while the web process clears it: the lease serialises their phases."""
    url = f"{cluster.url}?layout={layout}"
    ingest, web = RedisClusterIndex.from_url(url), RedisClusterIndex.from_url(url)
    blocks = adopted(600)
    errors: list[BaseException] = []

    def run(target) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    def store() -> None:
        for i in range(30):
            ingest.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks[(i * 50) % 400 :][:200])

    def clear() -> None:
        for _ in range(30):
            web.clear_pod(pod="pod1", model=MODEL)

    threads = [threading.Thread(target=run, args=(f,)) for f in (store, clear)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert_cluster_consistent(masters(cluster))
    web.clear_pod(pod="pod1", model=MODEL)
    assert web.pod_blocks() == []
    prefix = b"kv.3c" if layout == "compact" else b"kv.3"
    assert all_keys(cluster).keys() <= {prefix + b":models", prefix + b":{" + encode_name(MODEL) + b"}:pods"}
    ingest.close()
    web.close()


class Crash(IndexUnavailable):
    """The writer stopped between its pod round and its block round."""


def crash_before_the_block_round(index: RedisClusterIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    original = index._cross_slot

    def cross_slot(items, make_call, *, write, per_item=False):
        if write:
            raise Crash("the writer died")
        return original(items, make_call, write=write, per_item=per_item)

    monkeypatch.setattr(index, "_cross_slot", cross_slot)


def test_a_writer_that_stops_mid_phase_is_taken_over_by_the_next_and_leaves_no_orphan(
    cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    monkeypatch.setattr(cluster_module, "LEASE_SECONDS", 0.5)
    url = f"{cluster.url}?layout={layout}"
    dying, survivor = RedisClusterIndex.from_url(url), RedisClusterIndex.from_url(url)
    first, second = adopted(50, seed=1), adopted(50, seed=2)
    dying.store(model=MODEL, pod="pod1", tier="gpu", blocks=first)
    crash_before_the_block_round(dying, monkeypatch)

    with pytest.raises(Crash):
        dying.apply_updates(
            [Store(MODEL, "pod1", "gpu", second), Remove(MODEL, "pod1", "gpu", hashes(first[:10]))]
        )

    # The pod round ran (the reverse set, dirty set and lease say so), the block round did not.
    prefix = b"kv.3c" if layout == "compact" else b"kv.3"
    assert sorted(n for n in all_keys(cluster) if n.endswith((b"}:d", b"}:lease"))) == [
        prefix + b":{" + encode_name(MODEL) + b"@pod1}:" + kind for kind in (b"d", b"lease")
    ]
    assert len(survivor.lookup(model=MODEL, keys=keys(first))) == 50
    assert survivor.lookup(model=MODEL, keys=keys(second)) == []

    started = time.monotonic()
    survivor.store(model=MODEL, pod="pod1", tier="cpu", blocks=first[:1])  # waits out the lease

    assert 0.2 < time.monotonic() - started < 3
    assert_cluster_consistent(masters(cluster))
    assert survivor.lookup(model=MODEL, keys=keys(second)) == [{"pod1": GPU}] * 50
    assert survivor.lookup(model=MODEL, keys=keys(first)) == [{"pod1": CPU}]  # first[0] left the gpu
    assert survivor.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 90, "cpu": 1})]
    dying.close()
    survivor.close()


def test_a_writer_retrying_after_an_error_takes_its_own_phase_over_at_once(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = adopted(40)
    with monkeypatch.context() as patch:
        crash_before_the_block_round(index, patch)
        with pytest.raises(IndexUnavailable):
            index.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 4)])
    assert index.progress() == {}  # never before the blocks

    started = time.monotonic()
    assert index.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 4)]) == [40, 0]

    assert time.monotonic() - started < 0.5  # its own lease: no wait
    assert index.progress() == {(MODEL, "pod1"): 4}
    assert index.lookup(model=MODEL, keys=keys(blocks)) == [{"pod1": GPU}] * 40
    assert_cluster_consistent(masters(cluster))


# -- epoch markers ---------------------------------------------------------------------------------------


def test_the_epoch_marker_has_a_witness_on_every_master(
    index: RedisClusterIndex, cluster: ValkeyCluster
) -> None:
    assert index.set_epoch(model=MODEL, value="token ready", if_absent=True) is True

    where = all_keys(cluster)
    witnesses = {where[n]: key_slot(n) for n in where if b":epoch:{" in n}
    assert witnesses == lowest_slots(cluster)  # one per master, at its lowest slot
    assert {n for n in where if b":epoch:{" in n} == {
        b"kv.3:" + encode_name(MODEL) + b":epoch:{" + slot_tag(slot) + b"}" for slot in witnesses.values()
    }


@pytest.mark.parametrize("lost", ["the primary marker's master", "another master"])
def test_a_master_that_lost_its_data_makes_the_model_read_as_lost(
    index: RedisClusterIndex, cluster: ValkeyCluster, lost: str
) -> None:
    index.set_epoch(model=MODEL, value="token ready", if_absent=True)
    index.set_epoch(model="other", value="other ready", if_absent=True)
    primary = cluster.owner(key_slot(b"kv.3:{" + encode_name(MODEL) + b"}:epoch"))
    victim = (
        primary if lost.startswith("the primary") else next(p for p in cluster.master_ports() if p != primary)
    )

    cluster.clients[victim].flushall()  # a master restarted empty

    assert index.epochs([MODEL, "other"]) == [None, None]
    assert index.set_epoch(model=MODEL, value="new resyncing", if_absent=True) is True
    assert index.set_epoch(model=MODEL, value="newer resyncing", if_absent=True) is False
    assert index.epochs([MODEL]) == ["new resyncing"]
    assert index.set_epoch(model=MODEL, value="new ready") is True
    assert index.epochs([MODEL]) == ["new ready"]


# -- redirections and lost scripts ---------------------------------------------------------------------------


def test_moved_slots_are_followed_for_reads_and_writes(
    index: RedisClusterIndex, cluster: ValkeyCluster
) -> None:
    blocks = adopted(30)
    index.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 1)])
    pod_slot = key_slot(b"{" + encode_name(MODEL) + b"@pod1}")
    block_slot = key_slot(f"{{{tag(blocks[0].key)}}}".encode())
    for slot in (pod_slot, block_slot):
        cluster.migrate_slot(slot, next(p for p in cluster.master_ports() if p != cluster.owner(slot)))
    assert index._primary(pod_slot).port != cluster.owner(pod_slot)  # the client's map is stale

    assert index.lookup(model=MODEL, keys=keys(blocks)) == [{"pod1": GPU}] * 30
    assert index.apply_updates(
        [Remove(MODEL, "pod1", "gpu", hashes(blocks[:1])), Progress(MODEL, "pod1", 2)]
    ) == [
        1,
        0,
    ]
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=blocks)

    assert index.lookup(model=MODEL, keys=keys(blocks)) == [{"pod1": CPU}] + [{"pod1": GPU | CPU}] * 29
    assert index.progress() == {(MODEL, "pod1"): 2}
    assert_cluster_consistent(masters(cluster))


def test_a_write_to_a_slot_half_migrated_is_refused_whole_then_goes_through(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_module, "REDIRECT_BUDGET_SECONDS", 0.3)
    blocks = adopted(20)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    pod_slot = key_slot(b"{" + encode_name(MODEL) + b"@pod1}")
    target = next(p for p in cluster.master_ports() if p != cluster.owner(pod_slot))
    cluster.migrate_slot(pod_slot, target, finish=False)  # some of pod1's keys moved, not all

    with pytest.raises(IndexUnavailable):  # TRYAGAIN until the budget ran out: nothing applied
        index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks[:5]))
    cluster.finish_migration(pod_slot, target)

    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks[:5])) == 5
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 15})]
    assert_cluster_consistent(masters(cluster))


def test_ask_redirections_are_followed_while_a_slot_is_migrating(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = adopted(20)
    index.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 7)])
    pod_slot = key_slot(b"{" + encode_name(MODEL) + b"@pod1}")
    target = next(p for p in cluster.master_ports() if p != cluster.owner(pod_slot))
    cluster.migrate_slot(pod_slot, target, finish=False, leave=0)  # every key moved, slot still migrating

    # One-key reads are sent where the source says (ASK), with ASKING first.
    assert index.progress() == {(MODEL, "pod1"): 7}
    # A read of several of the holder's keys (resolve's script) is refused (TRYAGAIN: the target
    # cannot tell a key not there from one not moved yet), as a write is, until the slot settles.
    monkeypatch.setattr(cluster_module, "REDIRECT_BUDGET_SECONDS", 0.3)
    with pytest.raises(IndexUnavailable):
        index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks[:2]))
    cluster.finish_migration(pod_slot, target)
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks[:2])) == [
        b.digest for b in blocks[:2]
    ]
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks[:5])) == 5
    assert_cluster_consistent(masters(cluster))


def test_scripts_lost_by_the_masters_are_loaded_again(
    index: RedisClusterIndex, cluster: ValkeyCluster
) -> None:
    blocks = adopted(20)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks[:10])
    for server in masters(cluster):
        server.script_flush()

    index.apply_updates([Store(MODEL, "pod1", "gpu", blocks[10:]), Progress(MODEL, "pod1", 1)])

    assert index.lookup(model=MODEL, keys=keys(blocks)) == [{"pod1": GPU}] * 20
    assert index.progress() == {(MODEL, "pod1"): 1}
    assert_cluster_consistent(masters(cluster))
