"""Replay and resync on real sockets: the simulator's publisher (a PUB and a replay ROUTER, as
vLLM's) feeding a real pipeline, which asks it for what it missed.

A batch "lost on the way" is one the engine published into its replay buffer but that never
reached ingest (the engine's PUB past its high-water mark, ingest down, the network): the test
publishes it with the PUB socket held back, which is all such a loss looks like from ingest.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from redis.crc import key_slot

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from ingest.pipeline import IngestPipeline
from ingest.replay import ReplayClient, ReplayFailed, derived_replay_endpoint, fetch_replay
from kvindex import KVIndex, open_index
from kvindex.cluster import RedisClusterIndex
from kvindex.epochs import READY, parse_marker
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from simulator.publisher import EventPublisher
from tests.ingest.conftest import MODEL
from tests.kvindex import assert_cluster_consistent, tag
from tests.servers import wait_until

SEED = "42"
BLOCK = 4


def block(i: int, parent: int | None) -> tuple[BlockStored, int]:
    """A one-block store whose tokens (and engine hash) are derived from ``i``."""
    tokens = tuple(range(i * BLOCK, (i + 1) * BLOCK))
    return BlockStored(
        block_hashes=(1000 + i,), parent_block_hash=parent, token_ids=tokens, block_size=BLOCK
    ), 1000 + i


class Engine:
    """A simulated engine: the simulator's publisher (PUB + replay ROUTER) and what it holds."""

    def __init__(self, context: zmq.Context, ingest_endpoint: str, pod: str, *, buffer_steps: int = 1000):
        self.publisher = EventPublisher(
            context,
            endpoint=ingest_endpoint,
            pod_id=pod,
            model=MODEL,
            replay_endpoint="tcp://127.0.0.1:*",
            buffer_steps=buffer_steps,
        )
        self.pod = pod
        self.chain: list[int] = []  # engine hashes of the blocks held, in chain order
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self.publisher.serve_replay())
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)

    @property
    def replay_endpoint(self) -> str:
        return self.publisher.replay_bound_endpoint

    def store(self, *, lost: bool = False) -> int:
        """Store the next block of the chain; ``lost``: the batch never reaches ingest."""
        event, h = block(len(self.chain), self.chain[-1] if self.chain else None)
        self.chain.append(h)
        return self._publish([event], lost=lost)

    def evict_last(self, *, lost: bool = False) -> int:
        h = self.chain.pop()
        return self._publish([BlockRemoved(block_hashes=(h,))], lost=lost)

    def clear(self, *, lost: bool = False) -> int:
        self.chain = []
        return self._publish([AllBlocksCleared()], lost=lost)

    def _publish(self, events: list, *, lost: bool) -> int:
        if not lost:
            return self.publisher.publish(events)
        seq = self.publisher.next_seq  # what publish does, minus the send
        self.publisher.next_seq += 1
        self.publisher._buffer.append((seq, encode_batch(events, ts=time.time(), batch_layout="array")))
        return seq

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5)
        self.publisher.close()
        self._loop.close()


class Fixture:
    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.context = zmq.Context()
        self.endpoints: dict[str, str] = {}
        self.engines: list[Engine] = []
        self.pipeline: IngestPipeline | None = None
        self.port: str | None = None
        self.warmed: dict[str, tuple[int, int, int]] = {}  # pod -> its recovery counts after warm-up

    def config(self) -> ServiceConfig:
        return ServiceConfig(
            seed=SEED,
            default_block_size=BLOCK,
            pods={e.pod: MODEL for e in self.engines},
            replay_endpoints=dict(self.endpoints),
        )

    pipeline_options: dict = {}

    def start_ingest(self, *, timeout: float = 1.0, workers: int = 2) -> IngestPipeline:
        deadline = time.monotonic() + 5
        while True:
            try:
                self.pipeline = IngestPipeline(
                    index=self.index,
                    config=self.config,
                    bind=[f"tcp://127.0.0.1:{self.port or '*'}"],
                    workers=workers,
                    context=self.context,
                    replay=ReplayClient(config=self.config, context=self.context, timeout=timeout),
                    epoch_check_seconds=0.1,
                    **self.pipeline_options,
                )
                break
            except zmq.ZMQError as error:  # ZeroMQ lets the last pipeline's port go in the background
                if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.pipeline.start()
        self.port = self.pipeline.bound[0].rpartition(":")[2]
        return self.pipeline

    def stop_ingest(self) -> None:
        assert self.pipeline is not None
        self.pipeline.stop(drain_timeout=5)
        self.pipeline = None

    def engine(self, pod: str, *, replay: bool = True, buffer_steps: int = 1000) -> Engine:
        assert self.pipeline is not None
        engine = Engine(self.context, self.pipeline.bound[0], pod, buffer_steps=buffer_steps)
        self.engines.append(engine)
        if replay:
            self.endpoints[pod] = engine.replay_endpoint
        # ZeroMQ drops what a PUB sends before its subscription arrives: the first store is
        # published until it lands (re-sending a store is harmless; the seqs it used are in
        # the engine's buffer, so nothing reads as lost).
        first, h = block(0, None)
        engine.chain.append(h)
        deadline = time.monotonic() + 5
        while not self.stream(pod):
            assert time.monotonic() < deadline, f"{pod} never reached ingest"
            engine.publisher.publish([first])
            time.sleep(0.01)
        self.sync(engine)
        self.warmed[pod] = self.recoveries(pod, since_warm_up=False)
        return engine

    def recoveries(self, pod: str, *, since_warm_up: bool = True) -> tuple[int, int, int]:
        """The pod's (seq gaps, missed batches, replayed batches) in this pipeline, since its warm-up
        by default: a warm-up store sent before the subscription arrived is lost and replayed too."""
        stream = self.stream(pod)
        counts = (stream.seq_gaps, stream.missed_batches, stream.replayed_batches)
        base = self.warmed.get(pod, (0, 0, 0)) if since_warm_up else (0, 0, 0)
        return tuple(n - b for n, b in zip(counts, base, strict=True))  # type: ignore[return-value]

    def stream(self, pod: str):
        assert self.pipeline is not None
        return next((s for s in self.pipeline.stats.streams() if s.pod == pod and s.batches), None)

    def sync(self, engine: Engine) -> None:
        """Wait until ingest has applied everything the engine published (incl. replays)."""
        last = engine.publisher.next_seq - 1
        assert self.pipeline is not None

        def applied() -> bool:
            return self.index.progress(model=MODEL).get((MODEL, engine.pod)) == last

        wait_until(applied, timeout=10, what=f"{engine.pod} applied through seq {last}")
        self.pipeline.pool.join_idle(5)

    def held(self, engine: Engine) -> int:
        """How many leading blocks of the engine's chain the index says it holds."""
        keys = block_keys(
            [t for i in range(len(engine.chain) + 8) for t in block(i, None)[0].token_ids],
            seed=SEED,
            block_size=BLOCK,
        )
        return len(self.index.lookup(model=MODEL, keys=keys, pods=[engine.pod]))

    def close(self) -> None:
        if self.pipeline is not None:
            self.stop_ingest()
        for engine in self.engines:
            engine.close()
        self.context.destroy(linger=0)  # a failed test must not leave term() waiting


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def fx(request) -> Iterator[Fixture]:
    if request.param == "memory":
        url = "memory://"
    else:
        url = request.getfixturevalue(
            "redis_cluster_url" if request.param == "redis-cluster" else "redis_url"
        )
    index = open_index(url)
    fixture = Fixture(index)
    fixture.start_ingest()
    yield fixture
    fixture.close()
    index.close()


# --- the replay client ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["topic", "legacy"])
def test_fetch_replay_reads_both_vllm_layouts_from_a_seq(layout: str) -> None:
    context = zmq.Context()
    publisher = EventPublisher(
        context,
        endpoint="tcp://127.0.0.1:*",
        pod_id="p",
        model=MODEL,
        replay_endpoint="tcp://127.0.0.1:*",
        replay_layout=layout,
    )
    try:
        seqs = [publisher.publish([block(i, None)[0]]) for i in range(5)]
        loop = asyncio.new_event_loop()
        server = threading.Thread(target=lambda: loop.run_until_complete(_serve_once(publisher)), daemon=True)
        server.start()
        batches = fetch_replay(context, publisher.replay_bound_endpoint, 2, timeout=5)
        server.join(5)
        assert [seq for seq, _ in batches] == seqs[2:]
        assert batches == [b for b in publisher.buffered() if b[0] >= 2]
    finally:
        publisher.close()
        context.term()


async def _serve_once(publisher: EventPublisher) -> None:
    request = await publisher._replay.recv_multipart()
    for reply in publisher.replay_replies(request):
        await publisher._replay.send_multipart(reply)


def test_a_replay_endpoint_that_never_answers_fails_within_the_timeout() -> None:
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        started = time.monotonic()
        with pytest.raises(ReplayFailed) as failed:
            fetch_replay(context, silent.getsockopt_string(zmq.LAST_ENDPOINT), 0, timeout=0.3)
        assert failed.value.reason == "timeout"
        assert time.monotonic() - started < 1.0
    finally:
        silent.close()
        context.term()


def test_malformed_and_oversized_replays_fail_by_reason() -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def answer(replies: list[list[bytes]]) -> threading.Thread:
        def run() -> None:
            identity = router.recv_multipart()[0]
            for reply in replies:
                router.send_multipart([identity, *reply])

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
    try:
        for replies, reason, kwargs in [
            ([[b"", b"\x00\x01", b"x"]], "malformed", {}),  # a short seq
            (
                [[b"", (5).to_bytes(8, "big"), b"x"], [b"", (4).to_bytes(8, "big"), b"x"], end],
                "malformed",
                {},
            ),
            (
                [[b"", (i).to_bytes(8, "big"), b"x" * 10] for i in range(3)] + [end],
                "too_large",
                {"max_batches": 2},
            ),
            ([[b"", (0).to_bytes(8, "big"), b"x" * 100], end], "too_large", {"max_bytes": 50}),
        ]:
            thread = answer(replies)
            with pytest.raises(ReplayFailed) as failed:
                fetch_replay(context, endpoint, 0, timeout=2, **kwargs)
            assert failed.value.reason == reason
            thread.join(2)
    finally:
        router.close()
        context.term()


def test_replay_endpoints_come_from_the_registry_or_a_port_offset() -> None:
    config = ServiceConfig(
        pod_addresses={"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"},
        replay_endpoints={"a": "tcp://10.0.0.1:5600"},
    )
    client = ReplayClient(config=lambda: config, port_offset=1000)
    assert client.endpoint("a") == "tcp://10.0.0.1:5600"
    assert client.endpoint("a", 2) == "tcp://10.0.0.1:5602"  # data-parallel rank 2
    assert client.endpoint("b") == "tcp://10.0.0.2:9000"
    assert client.endpoint("10.0.0.3:8100") is None  # a host:port pod id names no endpoint
    assert client.endpoint("c") is None
    assert ReplayClient(config=lambda: config).endpoint("b") is None  # no offset: no convention
    assert derived_replay_endpoint("[::1]:8000", 5) == "tcp://[::1]:8005"
    assert derived_replay_endpoint("no-port", 5) is None
    assert derived_replay_endpoint("h:65535", 5) is None


# --- gaps, restarts, catch-ups --------------------------------------------------------------------


def test_missed_batches_are_replayed_in_order_before_the_next_live_one(fx: Fixture) -> None:
    engine = fx.engine("pod-a")
    for _ in range(3):
        engine.store(lost=True)
    engine.evict_last(lost=True)  # a block stored and evicted while ingest was not looking
    engine.store()
    fx.sync(engine)

    assert fx.held(engine) == len(engine.chain) == 4
    assert fx.recoveries("pod-a") == (1, 4, 4)
    stream = fx.stream("pod-a")
    assert (stream.lost_state_clears, stream.resyncing) == (0, False)


def test_a_gap_the_buffer_no_longer_covers_clears_the_pod_until_it_stores_again(fx: Fixture) -> None:
    engine = fx.engine("pod-a", buffer_steps=3)
    for _ in range(5):
        engine.store(lost=True)  # the buffer keeps the last 3 batches only
    engine.evict_last()
    fx.sync(engine)

    stream = fx.stream("pod-a")
    assert stream.replay_failures == {"overrun": 1}
    assert stream.lost_state_clears == 1
    # Cleared, then the buffered stores (blocks 3..4, whose parents are gone) and the live
    # eviction applied: nothing stale is left, and the chain from block 0 is not claimed.
    assert fx.held(engine) == 0
    assert stream.resyncing
    engine.clear()
    engine.store()
    fx.sync(engine)
    assert fx.held(engine) == 1
    assert not fx.stream("pod-a").resyncing


@pytest.mark.parametrize("why", ["no_endpoint", "timeout"])
def test_a_gap_that_cannot_be_replayed_clears_the_pod(fx: Fixture, why: str) -> None:
    engine = fx.engine("pod-a", replay=why != "no_endpoint")
    engine.store()
    fx.sync(engine)
    assert fx.held(engine) == 2
    # Without a replay endpoint, the warm-up's first publish may already have been lost (ZeroMQ
    # drops what a PUB sends before its subscription arrives) and counted: count from here.
    failures, clears = fx.stream("pod-a").replay_failures[why], fx.stream("pod-a").lost_state_clears
    if why == "timeout":
        silent = fx.context.socket(zmq.ROUTER)
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind("tcp://127.0.0.1:*")
        fx.endpoints["pod-a"] = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    engine.evict_last(lost=True)  # ingest never learns that block 1 went
    engine.store()  # block 1 again: the live batch after the gap
    fx.sync(engine)

    stream = fx.stream("pod-a")
    assert stream.replay_failures == {why: failures + 1}
    assert stream.lost_state_clears == clears + 1
    assert fx.held(engine) == 0  # block 0's store was lost with the clear: missing, not stale
    if why == "timeout":
        silent.close()


def test_a_failed_replay_leaves_nothing_for_the_collector(fx: Fixture) -> None:
    """A replay that fails is counted, and its exception dies with the recovery: kept with its
    traceback, it made a cycle (exception, traceback, the recovery's frame, the exception) that
    only the collector could free, and the pipeline freezes what survives a collection, so under
    fuzzed gaps ingest kept ~1.3 kB per failed replay for good (8 MB in 40,000 messages)."""
    fx.stop_ingest()
    fx.pipeline_options = {"gc_freeze_seconds": None}  # no collection but the test's
    fx.start_ingest()
    engine = fx.engine("pod-a", replay=False)
    engine.store()
    fx.sync(engine)
    collecting = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        failures = fx.stream("pod-a").replay_failures["no_endpoint"]
        engine.evict_last(lost=True)
        engine.store()  # a gap, and no endpoint to replay it from
        fx.sync(engine)
        assert fx.stream("pod-a").replay_failures["no_endpoint"] == failures + 1
        kept = [o for o in gc.get_objects() if isinstance(o, ReplayFailed) and o.__traceback__ is not None]
        assert kept == []
    finally:
        if collecting:
            gc.enable()


def test_an_engine_restart_clears_what_it_held_before(fx: Fixture) -> None:
    engine = fx.engine("pod-a")
    engine.store()
    fx.sync(engine)
    assert fx.held(engine) == 2
    engine.publisher.next_seq = 0  # a new engine process: seqs from 0, an empty cache
    engine.publisher._buffer.clear()
    engine.chain = []
    engine.store()
    fx.sync(engine)

    assert fx.stream("pod-a").restarts == 1
    assert fx.held(engine) == 1


def test_a_pod_back_after_an_unseen_restart_has_its_old_blocks_cleared_before_it_sends(fx: Fixture) -> None:
    """A restart shows in an engine's seqs only once it sends again: until then its old blocks
    were scored (a real vLLM engine killed and restarted, tests/vllm/). When the prober sees the
    pod answer again, ingest asks its replay from the last seq applied: a new engine's buffer
    does not hold that batch."""
    engine = fx.engine("pod-a")
    engine.store()
    fx.sync(engine)
    assert fx.held(engine) == 2
    engine.publisher.next_seq = 0  # a new engine process, not heard from yet: seqs from 0, empty cache
    engine.publisher._buffer.clear()
    engine.chain = []

    fx.pipeline.pod_returned("pod-a")
    wait_until(lambda: fx.held(engine) == 0, timeout=10, what="pod-a's old blocks cleared")
    assert fx.stream("pod-a").restarts == 1
    engine.store()  # its first batch, seq 0, is applied as the first of an engine
    fx.sync(engine)
    assert fx.held(engine) == 1 and fx.recoveries("pod-a")[0] == 0  # no gap: seq 0 was expected


def test_a_pod_back_without_a_restart_keeps_its_blocks_and_gets_what_it_sent_meanwhile(fx: Fixture) -> None:
    engine = fx.engine("pod-a")
    engine.store()
    fx.sync(engine)
    engine.store(lost=True)  # sent while the pod was unreachable
    engine.store(lost=True)

    fx.pipeline.pod_returned("pod-a")
    fx.sync(engine)
    stream = fx.stream("pod-a")
    assert fx.held(engine) == 4
    assert (stream.restarts, stream.lost_state_clears, fx.recoveries("pod-a")[2]) == (0, 0, 2)


def test_a_pod_back_that_cannot_replay_is_taken_for_restarted(fx: Fixture) -> None:
    """Without a replay nothing proves it is the same engine: cleared (the index may miss blocks,
    never score stale ones)."""
    engine = fx.engine("pod-a", replay=False)
    engine.store()
    fx.sync(engine)

    fx.pipeline.pod_returned("pod-a")
    wait_until(lambda: fx.held(engine) == 0, timeout=10, what="pod-a cleared")
    assert fx.stream("pod-a").restarts == 1


def test_after_an_ingest_restart_what_was_sent_meanwhile_is_replayed(fx: Fixture) -> None:
    a, b = fx.engine("pod-a"), fx.engine("pod-b")
    a.store()
    fx.sync(a)
    fx.stop_ingest()
    for _ in range(3):
        a.store()  # nobody listens: the PUB drops them
    a.evict_last()
    b.store()  # b goes idle after this: only the catch-up can bring it in

    fx.start_ingest()
    fx.sync(a)
    fx.sync(b)
    assert (fx.held(a), fx.held(b)) == (len(a.chain), len(b.chain)) == (4, 2)
    assert fx.stream("pod-a").replayed_batches == 4
    a.store()  # live again, right after the replayed seqs
    fx.sync(a)
    assert fx.held(a) == 5
    assert fx.stream("pod-a").seq_gaps == 0


def test_an_engine_that_does_not_answer_its_replay_does_not_hold_up_the_others(fx: Fixture) -> None:
    a = fx.engine("pod-a")
    silent = fx.context.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        fx.endpoints["gone"] = silent.getsockopt_string(zmq.LAST_ENDPOINT)  # registered, never answers
        fx.engines.append(type("Registered", (), {"pod": "gone", "close": lambda self: None})())
        fx.stop_ingest()
        fx.start_ingest(timeout=3.0, workers=1)  # the start-up catch-up waits 3 s for "gone"...
        started = time.monotonic()
        a.store()
        fx.sync(a)  # ... on a reader thread: pod-a's worker goes on
        assert time.monotonic() - started < 1.5
        wait_until(
            lambda: fx.pipeline.stats.stream("gone", 0, MODEL).replay_failures["timeout"] >= 1,
            timeout=10,
            what="the replay of gone to time out",
        )
    finally:
        silent.close()


def test_an_index_that_lost_its_data_is_marked_and_rebuilt_from_the_engines(fx: Fixture) -> None:
    if not hasattr(fx.index, "_client"):
        pytest.skip("an in-process index is only lost with its process")
    a, b = fx.engine("pod-a"), fx.engine("pod-b", replay=False)
    for _ in range(3):
        a.store()
    b.store()
    fx.sync(a)
    fx.sync(b)
    marked = wait_until(lambda: parse_marker(fx.index.epochs([MODEL])[0]), timeout=5, what="a marker")
    token = marked[0]

    fx.index._client.flushall()  # the server restarted empty, or a failover to an empty replica
    wait_until(lambda: fx.held(a) == 4, timeout=5, what="pod-a rebuilt from its replay buffer")

    marker = parse_marker(fx.index.epochs([MODEL])[0])
    assert marker is not None and marker[0] != token
    wait_until(lambda: parse_marker(fx.index.epochs([MODEL])[0])[1] == READY, timeout=5, what="ready")
    assert fx.pipeline.stats.index_losses == 1
    assert fx.held(b) == 0  # no replay: cleared and marked until it stores again
    assert fx.stream("pod-b").resyncing
    assert fx.stream("pod-b").replay_failures == {"no_endpoint": 1}


@pytest.mark.parametrize("fx", ["redis-cluster"], indirect=True)
def test_a_cluster_master_that_lost_its_data_gets_the_model_rebuilt(fx: Fixture) -> None:
    """One master restarted empty, the others kept theirs: the model's epoch witness on it went
    with its data, so the model reads as lost and is rebuilt from the engines' replays."""
    assert isinstance(fx.index, RedisClusterIndex)
    a = fx.engine("pod-a")
    for _ in range(7):
        a.store()
    fx.sync(a)
    token = wait_until(lambda: parse_marker(fx.index.epochs([MODEL])[0]), timeout=5, what="a marker")[0]
    first_key = block_keys(block(0, None)[0].token_ids, seed=SEED, block_size=BLOCK)[0]
    victim = fx.index._primary(key_slot(f"{{{tag(first_key)}}}".encode()))  # the master holding block 0

    victim.redis_connection.flushall()
    assert fx.held(a) == 0

    wait_until(lambda: fx.held(a) == 8, timeout=5, what="pod-a rebuilt from its replay buffer")
    wait_until(lambda: parse_marker(fx.index.epochs([MODEL])[0])[1] == READY, timeout=5, what="ready")
    assert parse_marker(fx.index.epochs([MODEL])[0])[0] != token
    assert fx.pipeline.stats.index_losses == 1
    fx.pipeline.pool.join_idle(5)
    assert_cluster_consistent([node.redis_connection for node in fx.index._map().primaries])


def test_the_conformance_suite_waits_out_ingest_s_second_catch_up() -> None:
    from conformance.ours import INGEST_SECOND_CATCH_UP_SECONDS
    from ingest.pipeline import SUBSCRIBED_SECONDS

    assert INGEST_SECOND_CATCH_UP_SECONDS == SUBSCRIBED_SECONDS
