"""The publisher on real ZeroMQ sockets: framing, both layouts, seq from 0, endpoints, replay."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, parse_topic
from simulator.publisher import END_SEQ, EventPublisher, offset_endpoint, should_bind
from tests.simulator.conftest import MODEL, Collector, wait_until

STORED = BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4)
REMOVED = BlockRemoved(block_hashes=(11,))


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv.sock", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://manager.svc:5557", False),
    ],
)
def test_bind_or_connect_follows_vllm(endpoint: str, binds: bool) -> None:
    assert should_bind(endpoint) is binds


def test_offsets_move_tcp_ports_and_suffix_local_endpoints() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


@pytest.mark.parametrize("layout", ["array", "map"])
def test_batches_go_out_as_vllm_frames_in_either_layout(
    zmq_context: zmq.Context, collector: Collector, layout: str
) -> None:
    publisher = EventPublisher(
        zmq_context,
        endpoint=collector.endpoint,
        pod_id="sim-3",
        model=MODEL,
        layout=layout,
        data_parallel_rank=0,
    )
    try:
        collector.wait_peers(1)
        assert publisher.publish([STORED, REMOVED]) == 0
        assert publisher.publish([AllBlocksCleared()]) == 1
        wait_until(lambda: len(collector.messages) == 2, what="two batches")
    finally:
        publisher.close()
    first, second = collector.messages
    assert parse_topic(collector.topics[0]) == ("sim-3", MODEL)
    assert (first.pod, first.model, first.seq, second.seq) == ("sim-3", MODEL, 0, 1)
    assert first.batch.events == (STORED, REMOVED)
    assert first.batch.data_parallel_rank == 0
    assert first.batch.errors == ()
    assert second.batch.events == (AllBlocksCleared(),)


@pytest.mark.parametrize(("layout", "kind"), [("array", list), ("map", dict)])
def test_the_event_layout_is_the_one_asked_for(zmq_context: zmq.Context, layout: str, kind: type) -> None:
    publisher = EventPublisher(
        zmq_context, endpoint="inproc://layout-" + layout, pod_id="p", model=MODEL, layout=layout
    )
    try:
        publisher.publish([STORED])
        ((seq, payload),) = publisher.buffered()
    finally:
        publisher.close()
    assert seq == 0
    raw = msgpack.unpackb(payload)
    assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
    assert isinstance(raw[1][0], kind)
    assert decode_batch(payload).events == (STORED,)


def test_a_bound_publisher_serves_a_connecting_subscriber(zmq_context: zmq.Context) -> None:
    sub = zmq_context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"kv@")
    publisher = EventPublisher(zmq_context, endpoint="tcp://*:0", pod_id="p", model=MODEL)
    try:
        port = publisher.bound_endpoint.rsplit(":", 1)[1]
        sub.connect(f"tcp://127.0.0.1:{port}")

        def received() -> bool:
            publisher.publish([REMOVED])
            return bool(sub.poll(20))

        wait_until(received, what="a batch from the bound PUB")
        topic, seq, payload = sub.recv_multipart()
    finally:
        publisher.close()
        sub.close()
    assert topic == f"kv@p@{MODEL}".encode()
    assert len(seq) == 8
    assert decode_batch(payload).events == (REMOVED,)


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask a replay ROUTER from a real DEALER socket; every reply up to the end marker."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            replies.append(frames)
            if END_SEQ in frames:
                return replies
    finally:
        dealer.close()
        context.term()


@pytest.mark.parametrize("layout", ["topic", "legacy"])
def test_replay_over_a_dealer_returns_buffered_batches_from_a_seq(
    zmq_context: zmq.Context, layout: str
) -> None:
    async def main() -> list[list[bytes]]:
        publisher = EventPublisher(
            zmq_context,
            endpoint="inproc://replay-pub-" + layout,
            pod_id="sim-0",
            model=MODEL,
            replay_endpoint="tcp://127.0.0.1:0",
            replay_layout=layout,
            buffer_steps=3,
        )
        task = asyncio.create_task(publisher.serve_replay())
        try:
            for _ in range(5):  # seq 0..4; the buffer keeps 2, 3, 4
                publisher.publish([REMOVED])
            assert [seq for seq, _ in publisher.buffered()] == [2, 3, 4]
            return await replay(publisher.replay_bound_endpoint, start=3)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            publisher.close()

    replies = asyncio.run(main())
    topic = f"kv@sim-0@{MODEL}".encode()
    head = [b"", topic] if layout == "topic" else [b""]
    assert [r[: len(head)] for r in replies] == [head] * 3
    seqs = [int.from_bytes(r[len(head)], "big") for r in replies[:-1]]
    assert seqs == [3, 4]
    assert all(decode_batch(r[-1]).events == (REMOVED,) for r in replies[:-1])
    assert replies[-1][len(head) :] == [END_SEQ, b""]


def test_a_malformed_replay_request_gets_no_reply(zmq_context: zmq.Context) -> None:
    publisher = EventPublisher(zmq_context, endpoint="inproc://malformed", pod_id="p", model=MODEL)
    try:
        assert publisher.replay_replies([b"id", b""]) == []
        assert publisher.replay_replies([b"id", b"", b"\x00"]) == []
        assert publisher.replay_replies([b"id", b"", bytes(8)])[-1][-2:] == [END_SEQ, b""]
    finally:
        publisher.close()
