"""The cluster index's lookups on an event loop (``RedisClusterIndex.alookup``), against the real
3-master cluster: the same answers as ``lookup``, one pipeline of ``GET``s per master per call on
one connection per master per loop, and the sync path taking over a call when a connection breaks
or a slot moved."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from kvindex import IndexUnavailable, StoredBlock
from kvindex.cluster import RedisClusterIndex
from kvindex.resp import ReadConnection
from tests.kvindex import MODEL, chain, keys, tag
from tests.servers import ValkeyCluster

GPU = frozenset({"gpu"})
PODS = ("pod1", "pod2", "pod3")


@pytest.fixture
def cluster(redis_cluster: ValkeyCluster, redis_cluster_url: str) -> ValkeyCluster:
    """The session's cluster, emptied for this test."""
    return redis_cluster


@pytest.fixture
def index(cluster: ValkeyCluster) -> Iterator[RedisClusterIndex]:
    idx = RedisClusterIndex.from_url(cluster.url + "?socket_timeout=2")
    yield idx
    idx.close()


def masters(cluster: ValkeyCluster) -> list[redis.Redis]:
    return [cluster.clients[p] for p in cluster.master_ports()]


def staircase(index: RedisClusterIndex, blocks: list[StoredBlock]) -> None:
    """pod1 holds all of ``blocks``, pod2 the first two thirds (also on cpu), pod3 the first third."""
    n = len(blocks)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    index.store(model=MODEL, pod="pod2", tier="gpu", blocks=blocks[: 2 * n // 3])
    index.store(model=MODEL, pod="pod2", tier="cpu", blocks=blocks[: n // 3])
    index.store(model=MODEL, pod="pod3", tier="gpu", blocks=blocks[: n // 3])


def queries(blocks: list[StoredBlock], count: int, *, seed: int = 3) -> list[tuple[list[int], object]]:
    """Random (keys, pods) lookups: prefixes of the chain, some with a foreign key inside or a
    foreign head, restricted to random pods (as a set, a list, or an empty list) or not."""
    rng = random.Random(seed)
    out: list[tuple[list[int], object]] = []
    for _ in range(count):
        ks = keys(blocks[: rng.randint(1, len(blocks))])
        if rng.random() < 0.2:
            ks[rng.randrange(len(ks))] = rng.getrandbits(64)
        pods: object = None
        roll = rng.random()
        if roll < 0.3:
            pods = set(rng.sample(PODS, rng.randint(1, 3)))
        elif roll < 0.4:
            pods = [*rng.sample(PODS, 2), "gone"]
        elif roll < 0.45:
            pods = []
        out.append((ks, pods))
    return out


def calls(cluster: ValkeyCluster, command: str) -> dict[int, int]:
    """Per master, how many times it ran ``command`` (``INFO commandstats``)."""
    return {
        port: cluster.clients[port].info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)
        for port in cluster.master_ports()
    }


def no_thread(index: RedisClusterIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``lookup`` (the thread-pool path) fail loudly: only the loop may answer."""

    def refuse(**kwargs):
        raise AssertionError("alookup fell back to lookup")

    monkeypatch.setattr(index, "lookup", refuse)


def count_fallbacks(index: RedisClusterIndex, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an item each time ``alookup`` falls back on the sync ``lookup`` (which
    still answers)."""
    fallbacks: list[int] = []
    lookup = index.lookup

    def counted(**kwargs):
        fallbacks.append(1)
        return lookup(**kwargs)

    monkeypatch.setattr(index, "lookup", counted)
    return fallbacks


def warm(index: RedisClusterIndex, blocks: list[StoredBlock]) -> None:
    """One sync lookup: the slot map read and the read script loaded on every master."""
    index.lookup(model=MODEL, keys=keys(blocks))


def test_reads_on_the_loop_unless_the_nodes_speak_tls() -> None:
    assert RedisClusterIndex.from_url("redis-cluster://127.0.0.1:7000").reads_async is True
    assert RedisClusterIndex([("127.0.0.1", 7000)], ssl=True).reads_async is False


def test_alookup_answers_as_lookup_does_for_many_queries(
    index: RedisClusterIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = chain(150)
    staircase(index, blocks)
    asked = queries(blocks, 300)
    expected = [index.lookup(model=MODEL, keys=ks, pods=pods) for ks, pods in asked]
    assert any(len(e) == 150 for e in expected) and any(len(e) == 0 for e in expected)
    no_thread(index, monkeypatch)

    async def scenario() -> list:
        assert await index.alookup(model=MODEL, keys=[]) == []
        return [await index.alookup(model=MODEL, keys=ks, pods=pods) for ks, pods in asked]

    assert asyncio.run(scenario()) == expected


def test_a_lookup_is_a_get_per_key_pipelined_to_each_master_and_no_script(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = chain(128)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    warm(index, blocks)
    no_thread(index, monkeypatch)
    before = {command: calls(cluster, command) for command in ("get", "evalsha")}
    sent = []
    execute_many = ReadConnection.execute_many

    async def recorded(self, commands: bytes, count: int) -> list:
        sent.append(count)
        return await execute_many(self, commands, count)

    monkeypatch.setattr(ReadConnection, "execute_many", recorded)

    assert asyncio.run(index.alookup(model=MODEL, keys=keys(blocks))) == [{"pod1": GPU}] * 128

    gets, scripts = (
        {port: now - before[command][port] for port, now in calls(cluster, command).items()}
        for command in ("get", "evalsha")
    )
    assert sum(gets.values()) == 128 and all(gets.values())  # every master serves some keys
    assert sorted(sent) == sorted(gets.values())  # one pipeline per master
    assert set(scripts.values()) == {0}


def test_concurrent_calls_share_one_connection_per_master_and_each_gets_its_own_answer(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = chain(90)
    staircase(index, blocks)
    asked = queries(blocks, 200, seed=11)
    expected = [index.lookup(model=MODEL, keys=ks, pods=pods) for ks, pods in asked]
    no_thread(index, monkeypatch)
    connections = {
        port: cluster.clients[port].info("stats")["total_connections_received"]
        for port in cluster.master_ports()
    }

    async def scenario() -> list:
        async def one(ks: list[int], pods: object) -> list:
            await asyncio.sleep(random.random() / 100)
            return await index.alookup(model=MODEL, keys=ks, pods=pods)

        return await asyncio.gather(*(one(ks, pods) for ks, pods in asked))

    assert asyncio.run(scenario()) == expected
    for port, before in connections.items():  # one new connection per master: this loop's
        assert cluster.clients[port].info("stats")["total_connections_received"] == before + 1


def test_a_killed_connection_is_answered_by_the_sync_path_then_reconnects(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = chain(60)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    warm(index, blocks)
    fallbacks = count_fallbacks(index, monkeypatch)
    want = [{"pod1": GPU}] * 60

    async def scenario() -> None:
        assert await index.alookup(model=MODEL, keys=keys(blocks)) == want
        assert fallbacks == []
        for server in masters(cluster):  # every client connection dropped, ours among them
            server.client_kill_filter(_type="normal", skipme=True)
        await asyncio.sleep(0.05)
        assert await index.alookup(model=MODEL, keys=keys(blocks)) == want
        # Killed in flight: the call is answered through lookup, and the loop reconnects.
        calls = [index.alookup(model=MODEL, keys=keys(blocks)) for _ in range(20)]
        kill = asyncio.get_running_loop().run_in_executor(
            None, lambda: [s.client_kill_filter(_type="normal", skipme=True) for s in masters(cluster)]
        )
        assert await asyncio.gather(*calls) == [want] * 20
        await kill
        await asyncio.sleep(0.05)
        fallbacks.clear()
        assert await index.alookup(model=MODEL, keys=keys(blocks)) == want
        assert await index.alookup(model=MODEL, keys=keys(blocks)) == want
        assert fallbacks == []

    asyncio.run(scenario())


def test_a_moved_slot_goes_through_the_sync_path_once_then_the_new_owner_is_read_on_the_loop(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = chain(40)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    warm(index, blocks)
    slot = key_slot(f"{{{tag(blocks[0].key)}}}".encode())
    cluster.migrate_slot(slot, next(p for p in cluster.master_ports() if p != cluster.owner(slot)))
    fallbacks = count_fallbacks(index, monkeypatch)

    async def scenario() -> list:
        return [await index.alookup(model=MODEL, keys=keys(blocks)) for _ in range(3)]

    assert asyncio.run(scenario()) == [[{"pod1": GPU}] * 40] * 3
    assert fallbacks == [1]  # the first call refreshed the slot map; the others read on the loop


def test_masters_that_lost_the_scripts_are_still_read_on_the_loop(
    index: RedisClusterIndex, cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = chain(30)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    warm(index, blocks)
    for server in masters(cluster):
        server.script_flush()
    no_thread(index, monkeypatch)

    assert asyncio.run(index.alookup(model=MODEL, keys=keys(blocks))) == [{"pod1": GPU}] * 30


def test_a_master_that_does_not_answer_fails_the_call_within_its_socket_timeout(
    cluster: ValkeyCluster,
) -> None:
    index = RedisClusterIndex.from_url(cluster.url + "?socket_timeout=0.3")
    try:
        blocks = chain(30)
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
        warm(index, blocks)
        paused = cluster.clients[cluster.master_ports()[0]]

        async def scenario() -> float:
            assert await index.alookup(model=MODEL, keys=keys(blocks)) == [{"pod1": GPU}] * 30
            paused.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            started = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await index.alookup(model=MODEL, keys=keys(blocks))
            return time.monotonic() - started

        assert asyncio.run(scenario()) < 1.0
        paused.execute_command("CLIENT", "UNPAUSE")
        assert asyncio.run(index.alookup(model=MODEL, keys=keys(blocks))) == [{"pod1": GPU}] * 30
    finally:
        index.close()
