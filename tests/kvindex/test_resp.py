"""The Redis index's read connection for an event loop, and ``alookup`` on it, against real servers."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from kvindex import IndexUnavailable, StoredBlock, open_index
from kvindex.redis import RedisIndex
from kvindex.resp import ReadConnection, ReplyError, pack
from tests.kvindex import MODEL, chain, keys
from tests.servers import RedisServer, free_port, frozen_server, redis_server_binary, wait_until


def run(coroutine):
    return asyncio.run(coroutine)


def test_pack_writes_resp_bulk_strings() -> None:
    assert pack((b"MGET", b"a", b"")) == b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$0\r\n\r\n"


def test_concurrent_calls_share_one_connection_and_each_gets_its_own_reply(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.mset({f"k{i}": f"v{i}" for i in range(500)})
    connection = ReadConnection.from_url(redis_url, timeout=5, connect_timeout=5)
    connections_before = client.info("stats")["total_connections_received"]

    async def scenario() -> list[tuple[list[int], list]]:
        async def one(wanted: list[int]) -> tuple[list[int], list]:
            await asyncio.sleep(random.random() / 100)
            return wanted, await connection.execute(b"MGET", *(f"k{i}".encode() for i in wanted))

        asks = [random.sample(range(600), 20) for _ in range(200)]
        return await asyncio.gather(*(one(wanted) for wanted in asks))

    for wanted, values in run(scenario()):
        assert values == [f"v{i}".encode() if i < 500 else None for i in wanted]
    assert client.info("stats")["total_connections_received"] == connections_before + 1


def test_an_error_reply_is_raised_and_the_connection_goes_on(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).set("k", "v")
    connection = ReadConnection.from_url(redis_url, timeout=5, connect_timeout=5)

    async def scenario() -> bytes:
        with pytest.raises(ReplyError, match="unknown command"):
            await connection.execute(b"NO-SUCH-COMMAND")
        return await connection.execute(b"GET", b"k")

    assert run(scenario()) == b"v"


def test_pipelined_commands_answer_a_list_in_order_among_single_calls(redis_url: str) -> None:
    """``execute_many``: several commands in one write, their replies one list (an error reply in
    its place, not raised), interleaved with single calls on the same connection."""
    client = redis.Redis.from_url(redis_url)
    client.mset({f"k{i}": f"v{i}" for i in range(100)})
    connection = ReadConnection.from_url(redis_url, timeout=5, connect_timeout=5)

    async def many(wanted: list[int]) -> tuple[list[int], list]:
        await asyncio.sleep(random.random() / 100)
        commands = b"".join(pack((b"GET", f"k{i}".encode())) for i in wanted)
        return wanted, await connection.execute_many(commands, len(wanted))

    async def scenario() -> list:
        asks = [random.sample(range(120), random.randint(1, 30)) for _ in range(100)]
        singles = [connection.execute(b"GET", f"k{i}".encode()) for i in range(100)]
        answers = await asyncio.gather(*(many(wanted) for wanted in asks), *singles)
        errors = await connection.execute_many(pack((b"GET", b"k1")) + pack((b"NO-SUCH-COMMAND",)), 2)
        return [answers, errors, await connection.execute_many(b"", 0)]

    answers, errors, nothing = run(scenario())
    for wanted, values in answers[:100]:
        assert values == [f"v{i}".encode() if i < 100 else None for i in wanted]
    assert answers[100:] == [f"v{i}".encode() for i in range(100)]
    assert errors[0] == b"v1" and isinstance(errors[1], ReplyError)
    assert nothing == []


GUARDED = ("--appendonly", "no", "--requirepass", "s3cret")


@pytest.fixture
def guarded_server() -> Iterator[tuple[int, str]]:
    """A server that wants a user's password, with data in database 3."""
    port, password = free_port(), GUARDED[-1]
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *GUARDED],
        stdout=subprocess.DEVNULL,
    )
    admin = redis.Redis(port=port, password=password, db=3)
    wait_until(lambda: _pings(admin), what="the guarded server to start")
    admin.set("k", "in db 3")
    yield port, password
    proc.kill()
    proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def test_the_url_s_password_and_database_are_used(guarded_server: tuple[int, str]) -> None:
    port, password = guarded_server
    good = ReadConnection.from_url(f"redis://:{password}@127.0.0.1:{port}/3", timeout=5, connect_timeout=5)
    assert run(good.execute(b"GET", b"k")) == b"in db 3"
    wrong = ReadConnection.from_url(f"redis://:nope@127.0.0.1:{port}/3", timeout=5, connect_timeout=5)
    with pytest.raises(ConnectionError, match="refused AUTH"):
        run(wrong.execute(b"GET", b"k"))


def test_tls_urls_have_no_reader() -> None:
    assert ReadConnection.from_url("rediss://127.0.0.1:1/0", timeout=1, connect_timeout=1) is None


@pytest.fixture
def silent_server() -> Iterator[int]:
    """Accepts connections, reads what it is sent and never answers (a frozen server)."""
    with frozen_server() as port:
        yield port


def test_a_server_that_does_not_answer_fails_every_waiting_call_within_the_timeout(
    silent_server: int,
) -> None:
    connection = ReadConnection.from_url(
        f"redis://127.0.0.1:{silent_server}/0", timeout=0.3, connect_timeout=1
    )

    async def scenario() -> list[BaseException]:
        calls = [connection.execute(b"GET", b"k%d" % i) for i in range(5)]
        return await asyncio.gather(*calls, return_exceptions=True)

    started = time.monotonic()
    errors = run(scenario())
    assert time.monotonic() - started < 1.0
    assert all(isinstance(e, (TimeoutError, ConnectionError)) for e in errors)
    assert any(isinstance(e, TimeoutError) for e in errors)


def test_a_connection_the_server_closes_fails_its_calls_and_the_next_call_reconnects() -> None:
    server = RedisServer()
    try:
        redis.Redis.from_url(server.url).set("k", "v")
        connection = ReadConnection.from_url(server.url, timeout=5, connect_timeout=1)

        async def scenario() -> list:
            first = await connection.execute(b"GET", b"k")
            redis.Redis.from_url(server.url).client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.1)  # the close reaches the connection
            return [first, await connection.execute(b"GET", b"k")]

        assert run(scenario()) == [b"v", b"v"]
    finally:
        server.stop()


def test_a_refused_connection_is_an_error_at_once() -> None:
    connection = ReadConnection.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=5, connect_timeout=5)
    started = time.monotonic()
    with pytest.raises(OSError):
        run(connection.execute(b"GET", b"k"))
    assert time.monotonic() - started < 1


# -- RedisIndex.alookup ------------------------------------------------------------------------


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    idx = open_index(redis_url)
    yield idx
    idx.close()


def test_alookup_reads_on_the_loop_and_answers_as_lookup_does(index: RedisIndex) -> None:
    blocks = chain(40)
    for n, pod in enumerate(("pod1", "pod2", "pod3")):
        index.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks[: 10 * (n + 2)])
    index.store(model=MODEL, pod="pod1", tier="cpu", blocks=blocks[:5])
    assert index.reads_async

    async def scenario(pods) -> list:
        return await index.alookup(model=MODEL, keys=keys(blocks), pods=pods)

    for pods in (None, {"pod1"}, ["pod2", "pod3"], set(), {"nobody"}):
        assert run(scenario(pods)) == index.lookup(model=MODEL, keys=keys(blocks), pods=pods)
    assert run(index.alookup(model=MODEL, keys=[])) == []


def test_aholders_reads_on_the_loop_and_answers_as_holders_does(index: RedisIndex) -> None:
    blocks = chain(12)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=blocks[:4] + blocks[8:])
    index.store(model=MODEL, pod="pod2", tier="cpu", blocks=blocks[6:])
    want = index.holders(model=MODEL, keys=keys(blocks))
    assert {} in want and want[-1] == {"pod1": {"gpu"}, "pod2": {"cpu"}}
    assert run(index.aholders(model=MODEL, keys=keys(blocks))) == want
    assert run(index.aholders(model=MODEL, keys=[])) == []


def test_aspeculated_reads_on_the_loop_and_answers_as_speculated_does(index: RedisIndex) -> None:
    long = keys(chain(20))  # speculation points 7, 15 and 19
    index.speculate(model=MODEL, pod="pod1", keys=long, seconds=30)
    index.speculate(model=MODEL, pod="pod 2@x", keys=long[:16], seconds=30)

    async def both() -> list:  # on one connection, pipelined: one round trip
        return await asyncio.gather(
            index.alookup(model=MODEL, keys=long), index.aspeculated(model=MODEL, keys=long)
        )

    assert run(both()) == [[], {"pod1": 20, "pod 2@x": 16}]
    for asked in (long, long[:18], long[:7], [], keys(chain(20, first_token=1))):
        assert run(index.aspeculated(model=MODEL, keys=asked)) == index.speculated(model=MODEL, keys=asked)


def test_aspeculate_writes_on_the_loop_what_speculate_writes_even_after_a_script_flush(
    index: RedisIndex, redis_url: str
) -> None:
    long = keys(chain(20))
    run(index.aspeculate(model=MODEL, pod="pod1", keys=long, seconds=30))
    assert index.speculated(model=MODEL, keys=long) == {"pod1": 20}
    redis.Redis.from_url(redis_url).script_flush()  # NOSCRIPT: the script is loaded again
    run(index.aspeculate(model=MODEL, pod="pod 2@x", keys=long[:16], seconds=30))
    assert index.speculated(model=MODEL, keys=long) == {"pod1": 20, "pod 2@x": 16}
    run(index.aspeculate(model=MODEL, pod="pod3", keys=long[:5], seconds=30))  # no point: nothing
    assert index.speculated(model=MODEL, keys=long) == {"pod1": 20, "pod 2@x": 16}


def test_alookup_on_a_server_that_is_gone_is_index_unavailable() -> None:
    server = RedisServer()
    index = open_index(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    block = StoredBlock(key=1, engine_hash=2, digest=b"\x00" * 8)
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=[block])

    async def scenario() -> list:
        return await index.alookup(model=MODEL, keys=[1])

    try:
        assert run(scenario()) == [{"pod1": frozenset({"gpu"})}]
        server.stop()
        started = time.monotonic()
        with pytest.raises(IndexUnavailable):
            run(scenario())
        assert time.monotonic() - started < 1.5
    finally:
        server.stop()
        index.close()


def test_alookup_of_a_frozen_server_ends_within_its_socket_timeout(silent_server: int) -> None:
    index = open_index(f"redis://127.0.0.1:{silent_server}/0", socket_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(IndexUnavailable, match="did not answer"):
        run(index.alookup(model=MODEL, keys=[1, 2, 3]))
    assert time.monotonic() - started < 1.0
    index.close()


def test_an_index_on_tls_reads_through_redis_py_in_a_thread(redis_url: str) -> None:
    index = RedisIndex(redis.Redis.from_url(redis_url))  # not from_url: no read connection
    index.store(model=MODEL, pod="pod1", tier="gpu", blocks=chain(2))
    assert not index.reads_async
    assert run(index.alookup(model=MODEL, keys=keys(chain(2)))) == [{"pod1": frozenset({"gpu"})}] * 2
