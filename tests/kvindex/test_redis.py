"""The Redis/Valkey index: its key layout, Cluster readiness, atomicity, round trips, slices,
progress riding on the writes, failures, and agreement with the in-memory index on a random
workload."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from redis.connection import AbstractConnection
from redis.crc import key_slot

from kvindex import IndexUnavailable, MemoryIndex, PodBlocks, StoredBlock, open_index
from kvindex.base import ClearPod, Progress, Remove, Store
from kvindex.redis import _NO_PROGRESS, RedisIndex, decode_name, encode_name
from tests.kvindex import MODEL, agrees_with_the_memory_index, chain, hashes, keys
from tests.servers import RedisServer, free_port

A, B = chain(2)
GPU = frozenset({"gpu"})
CPU = frozenset({"cpu"})


@pytest.fixture
def server(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client on the test server, to look behind the index's back."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    idx = RedisIndex.from_url(redis_url, client_name="kv-index-under-test")
    yield idx
    idx.close()


@pytest.fixture(params=["fast", "compact"])
def either(request: pytest.FixtureRequest, redis_url: str) -> Iterator[RedisIndex]:
    """An index in each layout."""
    idx = RedisIndex.from_url(f"{redis_url}?layout={request.param}", client_name="kv-index-under-test")
    yield idx
    idx.close()


def hash_tag(key: bytes) -> bytes:
    """The part of a key Redis Cluster hashes: between the first ``{`` and the next ``}``."""
    start = key.index(b"{")
    return key[start + 1 : key.index(b"}", start + 1)]


def bucket_of(member: bytes, m: int, s: int) -> int:
    """The bucket of a compact reverse set's member in state ``(m, s)`` (linear hashing on its last
    three bytes), as the scripts place it."""
    x = int.from_bytes(member[-3:], "big")
    return x % m if x % m >= s else x % (2 * m)


def reverse_set(server: redis.Redis, name: bytes) -> set[bytes]:
    """The members of a reverse set: a SET's, or a compact layout's blob buckets', checked on the
    way (its state counts them, each sits once in the bucket the state names, no bucket is empty
    or beyond the last)."""
    if server.type(name) == b"set":
        return server.smembers(name)
    fields = server.hgetall(name)
    m, s, n = map(int, fields.pop(b"#").split(b" "))
    members = []
    for index, blob in fields.items():
        assert len(blob) > 0 and len(blob) % 8 == 0 and int(index) < m + s
        for at in range(0, len(blob), 8):
            members.append(blob[at : at + 8])
            assert bucket_of(members[-1], m, s) == int(index)
    assert 0 <= s < m and len(members) == len(set(members)) == n > 0
    return set(members)


def assert_consistent(server: redis.Redis) -> None:
    """The invariants of the module docstring, read straight from the server (either layout)."""
    blocks: set[tuple[bytes, bytes, bytes]] = set()  # (model tag, K, "P@T")
    reverse: set[tuple[bytes, bytes, bytes]] = set()
    listed: set[tuple[bytes, bytes]] = set()  # (model tag, "P@T") in the pods sets
    engine_maps: dict[tuple[bytes, bytes], dict[bytes, bytes]] = {}  # (model tag, P) -> map
    hashes_of: dict[tuple[bytes, bytes], dict[bytes, bytes]] = {}
    for name in server.scan_iter(match=b"kv.3*:{*"):
        tag = hash_tag(name)
        kind = name[name.index(b"{") + len(tag) + 2 :]  # after "kv.3:{" (or "kv.3c:{") tag "}"
        if kind[:1] == b"b" and len(kind) == 9:  # a block: "b" and its key, 8 bytes
            value = server.get(name)
            assert len(value) > 24  # the head of its digest, then its entries
            blocks |= {(tag, kind[1:], entry) for entry in value[24:].split(b" ")}
        elif kind == b":pods":
            listed |= {(tag, entry) for entry in server.smembers(name)}
        elif kind.startswith(b":p:"):
            pod, _, rest = kind[3:].partition(b":")
            if rest == b"e":
                engine_maps[tag, pod] = server.hgetall(name)
            elif rest == b"k":
                hashes_of[tag, pod] = server.hgetall(name)
            else:
                assert rest.startswith(b"t:")
                reverse |= {(tag, k, pod + b"@" + rest[2:]) for k in reverse_set(server, name)}
    assert blocks == reverse
    assert listed == {(tag, entry) for tag, _, entry in reverse}
    held = {(tag, entry.split(b"@")[0], k) for tag, k, entry in reverse}
    for (tag, pod), links in hashes_of.items():
        for key, words in links.items():
            hashes = [words[at : at + 8] for at in range(0, len(words), 8)]
            assert (tag, pod, key) in held and words != key and len(set(hashes)) == len(hashes)
            assert all(engine_maps[tag, pod][h] == key for h in hashes if h != key)
    for (tag, pod), engine in engine_maps.items():
        for h, key in engine.items():
            assert h != key and h in hashes_of[tag, pod][key]


# -- layout -------------------------------------------------------------------------------------


def test_keys_follow_the_documented_layout(index: RedisIndex, server: redis.Redis) -> None:
    index.store(model="Qwen/Qwen3-0.6B", pod="10.0.0.1:8000", tier="gpu", blocks=[A])

    m, p = "Qwen%2FQwen3-0.6B", "10.0.0.1%3A8000"
    key = A.key.to_bytes(8, "big")
    block = f"kv.3:{{{m}}}b".encode() + key
    assert sorted(server.scan_iter()) == sorted(
        [block]
        + [
            name.encode()
            for name in (
                f"kv.3:{{{m}}}:p:{p}:t:gpu",
                f"kv.3:{{{m}}}:pods",
                "kv.3:models",
            )
        ]
    )
    # The block: the head of its digest (the rest is its key), then its entries.
    assert server.get(block) == A.digest[:24] + f"{p}@gpu".encode()
    # The reverse set; A's engine hash is its key: an implied link, nothing stored.
    assert server.smembers(f"kv.3:{{{m}}}:p:{p}:t:gpu") == {key}
    assert server.smembers("kv.3:models") == {b"Qwen/Qwen3-0.6B"}


def test_a_differing_engine_hash_is_linked(index: RedisIndex, server: redis.Redis) -> None:
    (block,) = chain(1, engine_hash_offset=7)
    index.store(model="m", pod="p", tier="gpu", blocks=[block])

    seven, key = (7).to_bytes(8, "big"), block.key.to_bytes(8, "big")
    assert server.hgetall("kv.3:{m}:p:p:e") == {seven: key}
    assert server.hgetall("kv.3:{m}:p:p:k") == {key: seven}
    assert index.resolve(model="m", pod="p", engine_hashes=[7, block.key]) == [block.digest, None]
    index.remove(model="m", pod="p", tier="gpu", engine_hashes=[7])
    assert sorted(server.scan_iter()) == [b"kv.3:models"]


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "a}b{c", "{x}", "", "%"])
def test_every_key_of_a_model_is_in_one_cluster_slot(
    index: RedisIndex, server: redis.Redis, model: str
) -> None:
    index.store(model=model, pod="pod{1}", tier="gpu", blocks=[A, B])
    index.store(model=model, pod="pod:2", tier="cpu", blocks=[A])

    names = [name for name in server.scan_iter() if name != b"kv.3:models"]
    assert len(names) == 5  # 2 blocks, a reverse set per pod (aligned: implied links), the pods set
    assert {hash_tag(name) for name in names} == {encode_name(model)}
    assert len({key_slot(name) for name in names}) == 1


def test_progress_and_the_epoch_marker_follow_the_documented_layout(
    index: RedisIndex, server: redis.Redis
) -> None:
    index.apply_updates([Store("a}b", "pod:1", "gpu", [A]), Progress("a}b", "pod:1#dp1", 42)])
    index.set_epoch(model="a}b", value="token:ready")

    assert server.hgetall("kv.3:{a%7Db}:seq") == {b"pod%3A1%23dp1": b"42"}
    assert server.get("kv.3:{a%7Db}:epoch") == b"token:ready"
    names = [name for name in server.scan_iter() if name != b"kv.3:models"]
    assert len({key_slot(name) for name in names}) == 1


@pytest.mark.parametrize("name", ["", "%", "a@b", "a b", "{}", "ü/:"])
def test_encoded_names_carry_no_separator_and_decode_back(name: str) -> None:
    encoded = encode_name(name)

    assert encoded and not set(encoded.decode()) & set("@:{} /")
    assert decode_name(encoded) == name


def test_namespace_separates_two_indexes_on_one_server(redis_url: str) -> None:
    first, second = open_index(redis_url), open_index(redis_url, namespace="other")
    first.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])

    assert second.lookup(model=MODEL, keys=[A.key]) == []
    assert second.pod_blocks() == []
    with pytest.raises(ValueError):
        open_index(redis_url, namespace="a{b}")


# -- atomicity and round trips ---------------------------------------------------------------------


def test_readers_see_a_store_or_a_clear_whole_or_not_at_all(index: RedisIndex) -> None:
    blocks = chain(256)
    seen: set[int] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(len(index.lookup(model=MODEL, keys=keys(blocks))))

    readers = [threading.Thread(target=read) for _ in range(3)]
    for r in readers:
        r.start()
    try:
        for _ in range(15):
            index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
            index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks))
            index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
            index.clear_pod(pod="pod1", model=MODEL)
    finally:
        stop.set()
        for r in readers:
            r.join()

    assert seen <= {0, 256}
    assert seen == {0, 256}  # the readers did overlap the writes


def _commands_sent(server: redis.Redis, client_name: str) -> int:
    return sum(int(c["tot-cmds"]) for c in server.client_list() if c["name"] == client_name)


def test_a_lookup_is_one_command_and_one_round_trip(index: RedisIndex, server: redis.Redis) -> None:
    blocks = chain(512)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    index.lookup(model=MODEL, keys=keys(blocks))  # the connection is set up and reused from here
    before = _commands_sent(server, "kv-index-under-test")

    result = index.lookup(model=MODEL, keys=keys(blocks), pods={"pod1"})

    assert len(result) == 512
    assert _commands_sent(server, "kv-index-under-test") - before == 1


def test_scripts_are_loaded_again_after_a_script_flush(index: RedisIndex, server: redis.Redis) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    server.script_flush()

    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[B])

    assert index.lookup(model=MODEL, keys=[A.key, B.key]) == [{"pod1": GPU}] * 2


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write to a server socket from here on (a pipeline is one), as the bytes sent."""
    sent: list[bytes] = []
    original = AbstractConnection.send_packed_command

    def send_packed_command(self, command, check_health=True):
        sent.append(command if isinstance(command, bytes) else b"".join(command))
        return original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", send_packed_command)
    return sent


def test_apply_updates_is_one_round_trip(
    index: RedisIndex, server: redis.Redis, round_trips: list[bytes]
) -> None:
    # The connection is set up (and reused from here) and the scripts are loaded.
    index.remove(model=MODEL, pod="nobody", tier="gpu", engine_hashes=[1])
    server.config_resetstat()
    round_trips.clear()

    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", [A, B]),
            Store("other-model", "pod1", "gpu", [A]),
            Remove(MODEL, "pod1", "gpu", [A.engine_hash]),
            ClearPod("other-model", "pod1"),
        ]
    )

    assert counts == [2, 1, 1, 1]
    assert len(round_trips) == 1
    assert server.info("commandstats")["cmdstat_evalsha"]["calls"] == 4
    assert index.lookup(model=MODEL, keys=[A.key, B.key]) == []
    assert index.lookup(model=MODEL, keys=[B.key]) == [{"pod1": GPU}]
    assert server.smembers("kv.3:models") == {MODEL.encode(), b"other-model"}


def test_apply_updates_loads_the_scripts_again_after_a_script_flush(
    index: RedisIndex, server: redis.Redis, round_trips: list[bytes]
) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    server.script_flush()
    round_trips.clear()

    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "cpu", [A, B]),
            Remove(MODEL, "pod1", "gpu", [A.engine_hash]),
            Store(MODEL, "pod2", "gpu", [B]),
        ]
    )

    assert counts == [2, 1, 1]
    assert len(round_trips) == 3  # refused, scripts loaded, sent again
    assert index.apply_updates([Remove(MODEL, "pod1", "cpu", [A.engine_hash])]) == [1]
    assert len(round_trips) == 4
    assert index.lookup(model=MODEL, keys=[A.key, B.key]) == []
    assert index.lookup(model=MODEL, keys=[B.key]) == [{"pod1": CPU, "pod2": GPU}]
    assert_consistent(server)


def test_progress_is_recorded_in_order_after_a_script_flush(
    index: RedisIndex, server: redis.Redis, round_trips: list[bytes]
) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    server.script_flush()
    round_trips.clear()

    counts = index.apply_updates(
        [
            Store(MODEL, "pod1", "cpu", [A, B]),
            Progress(MODEL, "pod1", 7),
            Progress(MODEL, "pod2", 1),  # on its own: a script too, refused and resent in order
            Remove(MODEL, "pod1", "gpu", [A.engine_hash]),
            Progress(MODEL, "pod1", 8),
        ]
    )

    assert counts == [2, 0, 0, 1, 0]
    assert len(round_trips) == 3  # refused, scripts loaded, sent again
    assert b"\r\nHSET\r\n" not in b"".join(round_trips)
    assert index.progress() == {(MODEL, "pod1"): 8, (MODEL, "pod2"): 1}
    assert index.lookup(model=MODEL, keys=[A.key, B.key]) == [{"pod1": CPU}] * 2


@pytest.fixture
def sliced(redis_url: str) -> Iterator[RedisIndex]:
    """An index that cuts every write into slices of at most 4 blocks, hashes or entries."""
    idx = RedisIndex.from_url(redis_url, slice_blocks=4, client_name="kv-index-under-test")
    yield idx
    idx.close()


def warm_up(index: RedisIndex, round_trips: list[bytes]) -> None:
    """Set up the connection that the index reuses from here on, load the scripts, and forget
    what that sent."""
    index.remove(model=MODEL, pod="nobody", tier="gpu", engine_hashes=[1])
    round_trips.clear()


def test_each_round_trip_carries_at_most_a_slice_of_work(
    sliced: RedisIndex, round_trips: list[bytes]
) -> None:
    blocks = chain(10)
    warm_up(sliced, round_trips)

    counts = sliced.apply_updates(
        [
            Store(MODEL, "pod1", "gpu", blocks[:1]),
            Store(MODEL, "pod2", "gpu", blocks[:2]),
            Remove(MODEL, "pod2", "gpu", hashes(blocks[:1])),  # 4 so far: one round trip
            Store(MODEL, "pod3", "gpu", blocks[:3]),
            Store(MODEL, "pod4", "gpu", blocks),  # slices of 4, 3, 3
        ]
    )

    assert counts == [1, 2, 1, 3, 10]
    assert [sent.count(b"EVALSHA") for sent in round_trips] == [3, 1, 1, 1, 1]
    assert sliced.pod_blocks() == [
        PodBlocks(MODEL, "pod1", {"gpu": 1}),
        PodBlocks(MODEL, "pod2", {"gpu": 1}),
        PodBlocks(MODEL, "pod3", {"gpu": 3}),
        PodBlocks(MODEL, "pod4", {"gpu": 10}),
    ]


def test_a_65536_block_store_is_sent_in_round_trips_of_one_slice(
    index: RedisIndex, round_trips: list[bytes]
) -> None:
    blocks = [StoredBlock(key=k, engine_hash=k, digest=k.to_bytes(8, "big")) for k in range(1, 65537)]
    warm_up(index, round_trips)

    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)

    assert len(round_trips) == 65536 // index.slice_blocks == 32
    assert all(sent.count(b"EVALSHA") == 1 for sent in round_trips)
    assert index.pod_blocks() == [PodBlocks(MODEL, "pod1", {"gpu": 65536})]


def test_a_progress_after_a_store_in_slices_rides_on_its_last_slice(
    sliced: RedisIndex, server: redis.Redis, round_trips: list[bytes]
) -> None:
    blocks = chain(10)
    seq_hash = f"kv.3:{{{encode_name(MODEL).decode()}}}:seq".encode()
    warm_up(sliced, round_trips)

    assert sliced.apply_updates([Store(MODEL, "pod1", "gpu", blocks), Progress(MODEL, "pod1", 5)]) == [10, 0]

    assert [sent.count(b"EVALSHA") for sent in round_trips] == [1, 1, 1]  # 4, 3, 3 blocks
    assert [seq_hash in sent for sent in round_trips] == [False, False, True]
    assert b"\r\nHSET\r\n" not in b"".join(round_trips)  # no write of its own
    assert sliced.progress() == {(MODEL, "pod1"): 5}
    assert sliced.lookup(model=MODEL, keys=keys(blocks)) == [{"pod1": GPU}] * 10
    assert_consistent(server)


def test_a_progress_after_a_clear_is_written_by_the_call_that_empties_the_pod(
    sliced: RedisIndex, server: redis.Redis
) -> None:
    blocks = chain(10)
    sliced.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    server.config_resetstat()

    assert sliced.apply_updates([ClearPod(MODEL, "pod1"), Progress(MODEL, "pod1", 9)]) == [10, 0]

    stats = server.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 3  # 4 + 4 + 2 entries
    assert sliced.progress() == {(MODEL, "pod1"): 9}
    assert sliced.pod_blocks() == []

    # Call by call: only the one that empties the pod records it.
    sliced.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    progress = (f"kv.3:{{{encode_name(MODEL).decode()}}}:seq".encode(), b"pod1", 12)
    for n, left in ((4, 1), (4, 1), (2, 0)):
        assert sliced.progress() == {(MODEL, "pod1"): 9}
        assert sliced._run(*sliced._clear_pod_call(MODEL, "pod1", 4, progress)) == [n, left]
    assert sliced.progress() == {(MODEL, "pod1"): 12}


def test_every_invariant_holds_between_the_calls_of_a_clear(sliced: RedisIndex, server: redis.Redis) -> None:
    blocks = chain(10, engine_hash_offset=500)
    sliced.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    sliced.store(model=MODEL, pod="pod1", tier="cpu", blocks=blocks[3:9])
    sliced.store(model=MODEL, pod="pod2", tier="gpu", blocks=blocks[:5])
    removed, more, calls = 0, True, 0

    while more:
        count, more = sliced._run(*sliced._clear_pod_call(MODEL, "pod1", 3, _NO_PROGRESS))
        removed, calls = removed + count, calls + 1
        assert_consistent(server)

    assert (removed, calls) == (16, 6)
    assert sliced.pod_blocks() == [PodBlocks(MODEL, "pod2", {"gpu": 5})]
    assert sliced.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks)) == [None] * 10


@pytest.mark.parametrize("layout", ["kv", "kv.2"])
def test_keys_of_the_previous_layouts_are_never_read(
    index: RedisIndex, server: redis.Redis, layout: str
) -> None:
    m = encode_name(MODEL).decode()
    server.set(f"{layout}:{{{m}}}:b:{A.key:016x}", b"pod1@gpu")
    server.sadd(f"{layout}:{{{m}}}:p:pod1:t:gpu", f"{A.key:016x}")
    server.hset(f"{layout}:{{{m}}}:p:pod1:e", str(A.engine_hash), A.digest)
    server.hset(f"{layout}:{{{m}}}:seq", "pod1", 7)
    server.set(f"{layout}:{{{m}}}:epoch", b"token ready")
    server.sadd(f"{layout}:models", MODEL)

    assert index.lookup(model=MODEL, keys=[A.key]) == []
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=[A.engine_hash]) == [None]
    assert index.epochs([MODEL]) == [None]  # so ingest rebuilds the index from the engines
    assert index.progress() == {} and index.pod_blocks() == []


def test_a_flushall_loses_the_epoch_markers_and_progress(index: RedisIndex, server: redis.Redis) -> None:
    index.set_epoch(model=MODEL, value="token")
    index.apply_updates([Progress(MODEL, "pod1", 3)])
    server.flushall()

    assert index.epochs([MODEL]) == [None]
    assert index.progress() == {}
    assert index.set_epoch(model=MODEL, value="new", if_absent=True) is True


def _inner_commands(server: redis.Redis) -> int:
    """Commands run since the last CONFIG RESETSTAT, other than the scripts themselves."""
    stats = server.info("commandstats")
    return sum(
        s["calls"]
        for name, s in stats.items()
        if name.split("_", 1)[1] not in ("evalsha", "config|resetstat")
    )


@pytest.mark.parametrize("size", [16, 64])
def test_a_store_or_remove_makes_the_same_few_commands_whatever_its_size(
    index: RedisIndex, server: redis.Redis, size: int
) -> None:
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])  # kv.3:models written, scripts loaded
    blocks = chain(size, first_token=5000)

    server.config_resetstat()
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    store_commands = _inner_commands(server)

    server.config_resetstat()
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
    store_again_commands = _inner_commands(server)

    server.config_resetstat()
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks)) == size
    remove_commands = _inner_commands(server)

    # A store: MGET, MSET, SADD (the reverse set, the pods set), EXISTS (aligned blocks, no links
    # stored: every link implied, nothing to write); stored again, nothing changes. A remove:
    # HMGET (engine map), MGET, HMGET (key -> hashes), DEL, SREM, EXISTS.
    assert (store_commands, store_again_commands, remove_commands) == (5, 4, 6)


# -- failures ---------------------------------------------------------------------------------------


def test_an_unreachable_server_is_index_unavailable() -> None:
    index = open_index(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)

    with pytest.raises(IndexUnavailable):
        index.ping()
    with pytest.raises(IndexUnavailable):
        index.lookup(model=MODEL, keys=[A.key])
    with pytest.raises(IndexUnavailable):
        index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[A])
    with pytest.raises(IndexUnavailable):
        index.pod_blocks()


def test_apply_updates_on_an_unreachable_server_is_index_unavailable() -> None:
    index = open_index(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)

    with pytest.raises(IndexUnavailable):
        index.apply_updates([Store(MODEL, "pod1", "gpu", [A]), Remove(MODEL, "pod1", "gpu", [A.engine_hash])])
    with pytest.raises(IndexUnavailable):
        index.apply_updates([ClearPod(MODEL, "pod1")])


def test_apply_updates_after_the_server_went_down_is_index_unavailable() -> None:
    own = RedisServer()
    try:
        index = open_index(own.url, socket_connect_timeout=0.5)
        assert index.apply_updates([Store(MODEL, "pod1", "gpu", [A])]) == [1]
    finally:
        own.stop()

    with pytest.raises(IndexUnavailable):
        index.apply_updates([Store(MODEL, "pod1", "gpu", [B])])


def test_responses_must_stay_bytes(redis_url: str) -> None:
    with pytest.raises(ValueError):
        open_index(redis_url, decode_responses=True)


# -- agreement with the in-memory index -------------------------------------------------------------


def test_agrees_with_the_memory_index_on_a_random_workload(either: RedisIndex, server: redis.Redis) -> None:
    agrees_with_the_memory_index(
        either,
        steps=300,
        check=lambda: assert_consistent(server),
        check_every=10,
        filter_by_pod=True,
    )


def test_agrees_with_the_memory_index_with_pods_of_many_blocks(
    either: RedisIndex, server: redis.Redis
) -> None:
    agrees_with_the_memory_index(
        either, steps=120, check=lambda: assert_consistent(server), check_every=10, scale=40
    )


@pytest.mark.parametrize("offset", [None, 10**6], ids=["aligned", "misaligned"])
def test_an_aligned_pod_writes_no_links_and_a_misaligned_one_writes_them_all(
    index: RedisIndex, server: redis.Redis, offset: int | None
) -> None:
    blocks = chain(3000, engine_hash_offset=offset)
    index.store(model="m", pod="pod1", tier="gpu", blocks=blocks)  # in two slices
    index.store(model="m", pod="pod1", tier="cpu", blocks=blocks[:500])

    assert_consistent(server)
    links = server.hlen("kv.3:{m}:p:pod1:e"), server.hlen("kv.3:{m}:p:pod1:k")
    assert links == ((0, 0) if offset is None else (3000, 3000))
    assert index.resolve(model="m", pod="pod1", engine_hashes=hashes(blocks)) == [b.digest for b in blocks]
    both = frozenset({"gpu", "cpu"})
    assert index.lookup(model="m", keys=keys(blocks)) == [{"pod1": both}] * 500 + [{"pod1": GPU}] * 2500

    assert index.remove(model="m", pod="pod1", tier="gpu", engine_hashes=hashes(blocks[100:])) == 2900
    assert_consistent(server)
    assert index.pod_blocks() == [PodBlocks("m", "pod1", {"gpu": 100, "cpu": 500})]
    resolved = index.resolve(model="m", pod="pod1", engine_hashes=hashes(blocks))
    assert resolved == [b.digest for b in blocks[:500]] + [None] * 2500
    assert server.hlen("kv.3:{m}:p:pod1:e") == (0 if offset is None else 500)

    assert index.clear_pod(pod="pod1") == 600
    assert list(server.scan_iter()) == [b"kv.3:models"]


def test_the_compact_layout_keeps_reverse_sets_in_blob_buckets_that_split_and_merge(
    redis_url: str, server: redis.Redis
) -> None:
    index = RedisIndex.from_url(redis_url, layout="compact")
    blocks = chain(3000)
    index.store(model="m", pod="pod1", tier="gpu", blocks=blocks)  # in two slices
    index.store(model="m", pod="pod1", tier="cpu", blocks=blocks[:500])

    assert_consistent(server)
    assert sorted(n for n in server.scan_iter() if b"}b" not in n) == [
        b"kv.3c:models",
        b"kv.3c:{m}:p:pod1:t:cpu",
        b"kv.3c:{m}:p:pod1:t:gpu",
        b"kv.3c:{m}:pods",
    ]
    gpu = server.hgetall("kv.3c:{m}:p:pod1:t:gpu")
    m, s, n = map(int, gpu[b"#"].split())
    assert (n, m + s) == (3000, -(-3000 // 32)) and len(gpu) == m + s + 1  # split at 32 a bucket
    assert reverse_set(server, b"kv.3c:{m}:p:pod1:t:gpu") == {b.key.to_bytes(8, "big") for b in blocks}
    both = frozenset({"gpu", "cpu"})
    assert index.lookup(model="m", keys=keys(blocks)) == [{"pod1": both}] * 500 + [{"pod1": GPU}] * 2500

    assert index.remove(model="m", pod="pod1", tier="gpu", engine_hashes=hashes(blocks[100:])) == 2900
    assert_consistent(server)
    m, s, n = map(int, server.hget("kv.3c:{m}:p:pod1:t:gpu", "#").split())
    assert n == 100 and m + s <= 100 // 8  # merged back: 8 a bucket at least
    assert index.pod_blocks() == [PodBlocks("m", "pod1", {"gpu": 100, "cpu": 500})]

    assert index.clear_pod(pod="pod1") == 600
    assert list(server.scan_iter()) == [b"kv.3c:models"]
    index.close()


def test_the_two_layouts_never_read_each_other(redis_url: str) -> None:
    fast = RedisIndex.from_url(redis_url)
    compact = RedisIndex.from_url(redis_url + "?layout=compact")
    fast.store(model="m", pod="pod1", tier="gpu", blocks=[A, B])
    fast.set_epoch(model="m", value="token")

    assert compact.lookup(model="m", keys=[A.key]) == [] and compact.epochs(["m"]) == [None]
    assert fast.lookup(model="m", keys=[A.key, B.key]) == [{"pod1": GPU}] * 2
    with pytest.raises(ValueError, match="unknown index layout 'tiny'"):
        RedisIndex.from_url(redis_url + "?layout=tiny")


def test_a_store_naming_a_block_or_engine_hash_twice_agrees_with_the_memory_index(
    index: RedisIndex, server: redis.Redis
) -> None:
    oracle = MemoryIndex()
    first, second = chain(2, engine_hash_offset=500)
    other = chain(1, first_token=300, engine_hash_offset=500)[0]  # hash 500 again, another block
    again = StoredBlock(key=first.key, engine_hash=900, digest=first.digest)  # first, a second hash
    calls = [
        ("pod1", [first, first, second]),
        ("pod1", [first, other, first, again]),
        ("pod1", [second, again, other, second]),
        ("pod1", [other, other]),
        ("pod2", [first, other]),  # new to the pod: hash 500 first names first, then other
        ("pod3", [first, again]),  # new to the pod: two hashes for one block
    ]
    for pod, blocks in calls:
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks)
        oracle.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks)

        for block in (first, second, other):
            assert index.lookup(model=MODEL, keys=[block.key]) == oracle.lookup(model=MODEL, keys=[block.key])
        assert index.resolve(model=MODEL, pod=pod, engine_hashes=[500, 501, 900]) == oracle.resolve(
            model=MODEL, pod=pod, engine_hashes=[500, 501, 900]
        )
        assert_consistent(server)
    assert index.remove(
        model=MODEL, pod="pod1", tier="gpu", engine_hashes=[900, 500, 501, 900]
    ) == oracle.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=[900, 500, 501, 900])
    assert index.pod_blocks() == oracle.pod_blocks()
    assert_consistent(server)


def test_stores_and_removes_larger_than_a_lua_unpack_agree_with_the_memory_index(
    index: RedisIndex, server: redis.Redis
) -> None:
    # Adopted blocks (digest = the key's 8 bytes): cheap to make in bulk. 5000 blocks are 15000
    # script arguments, more than Lua can unpack at once: the scripts work in chunks.
    blocks = [StoredBlock(key=k, engine_hash=10**12 + k, digest=k.to_bytes(8, "big")) for k in range(1, 5001)]
    oracle = MemoryIndex()
    for idx in (index, oracle):
        idx.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks)
        idx.store(model=MODEL, pod="pod2", tier="gpu", blocks=blocks[1000:])
        idx.store(model=MODEL, pod="pod1", tier="cpu", blocks=blocks[::2])

    assert index.lookup(model=MODEL, keys=keys(blocks)) == oracle.lookup(model=MODEL, keys=keys(blocks))
    assert index.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks[:4000])) == 4000
    oracle.remove(model=MODEL, pod="pod1", tier="gpu", engine_hashes=hashes(blocks[:4000]))
    assert index.resolve(model=MODEL, pod="pod1", engine_hashes=hashes(blocks)) == oracle.resolve(
        model=MODEL, pod="pod1", engine_hashes=hashes(blocks)
    )
    assert index.pod_blocks() == oracle.pod_blocks()
    assert_consistent(server)
    assert index.clear_pod(pod="pod1", model=MODEL) == oracle.clear_pod(pod="pod1", model=MODEL) == 3500
    assert index.lookup(model=MODEL, keys=keys(blocks[1000:])) == [{"pod2": GPU}] * 4000
    assert_consistent(server)


def test_speculative_entries_follow_the_documented_layout_and_expire_on_the_server(
    index: RedisIndex, server: redis.Redis
) -> None:
    blocks = chain(8)
    index.speculate(model="a}b", pod="pod:1", keys=keys(blocks), seconds=5)
    index.speculate(model="a}b", pod="pod2", keys=keys(blocks), seconds=2)

    name = b"kv.3:{a%7Db}:s:" + blocks[7].key.to_bytes(8, "big")
    assert [name] == [n for n in server.scan_iter() if n != b"kv.3:models"]
    entries = dict(e.split(b"=") for e in server.get(name).split())
    assert set(entries) == {b"pod%3A1", b"pod2"}
    assert int(entries[b"pod%3A1"]) - int(entries[b"pod2"]) == pytest.approx(3000, abs=500)
    assert 4000 < server.pttl(name) <= 5000  # the key goes with its last entry
