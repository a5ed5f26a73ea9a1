"""KV events out of a simulated engine, over ZeroMQ exactly as vLLM's ``ZmqEventPublisher`` sends them.

* A PUB socket sends ``[topic, seq, payload]``: topic ``kv@<pod-id>@<model>``, seq 8 bytes
  big-endian from 0 and +1 per batch, payload an msgpack ``EventBatch`` (``ingest.events``) with
  the events in the array (vLLM <= 0.23) or map (>= 0.24) layout and the data-parallel rank.
* The PUB binds when the endpoint contains ``*`` or ``::`` or is ``ipc://`` / ``inproc://``, and
  connects otherwise (vLLM's heuristic, :func:`should_bind`).
* Optionally a ROUTER socket answers replay requests ``[b"", start_seq]`` from a DEALER with every
  buffered batch whose seq >= start, then an end marker (seq ``ff``*8, empty payload). Replies are
  ``[b"", topic, seq, payload]`` (vLLM >= 0.26, the default) or ``[b"", seq, payload]`` (older).
  The buffer keeps the last ``buffer_steps`` batches.
* Optionally CURVE (``curve``: the engine's key pair, ``ingest.curve``; vLLM has no such option):
  a PUB that connects is the CURVE client of ingest's bound SUB (whose public key is
  ``curve.server_key``); a PUB that binds, and the replay ROUTER, are CURVE servers with the
  engine's key pair. As a server it checks no client key (no ZAP handler): whoever has its public
  key may subscribe or ask for replays (ingest checks the publishers, not the other way round).

Publishing never blocks: PUB drops messages for subscribers past the high-water mark, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, Literal

import zmq
import zmq.asyncio

from ingest.curve import EventCurve
from ingest.events import Event, Layout, encode_batch, encode_message
from ingest.replay import offset_endpoint

__all__ = ["END_SEQ", "EventPublisher", "ReplayLayout", "offset_endpoint", "should_bind"]

log = logging.getLogger("simulator")

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
ReplayLayout = Literal["topic", "legacy"]
DEFAULT_HWM: Final = 100_000
DEFAULT_BUFFER_STEPS: Final = 10_000


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: a PUB binds a wildcard or local endpoint and connects to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """One engine's publisher. Call :meth:`publish` once per engine step with its events; run
    :meth:`serve_replay` as a task when there is a replay endpoint; :meth:`close` at the end."""

    def __init__(
        self,
        context: zmq.Context,
        *,
        endpoint: str,
        pod_id: str,
        model: str,
        data_parallel_rank: int = 0,
        layout: Layout = "map",
        replay_endpoint: str | None = None,
        replay_layout: ReplayLayout = "topic",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        clock: Callable[[], float] = time.time,
        curve: EventCurve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.pod_id = pod_id
        self.model = model
        self.data_parallel_rank = data_parallel_rank
        self.layout: Layout = layout
        self.replay_endpoint = replay_endpoint
        self.replay_layout: ReplayLayout = replay_layout
        self.next_seq = 0
        self.topic = encode_message(pod_id, model, 0, b"")[0]
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._clock = clock
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if should_bind(endpoint):
                _serve_curve(self._pub, curve)
                self._pub.bind(endpoint)
            else:
                if curve is not None:
                    curve.secure(self._pub, server=False)  # ValueError without ingest's public key
                self._pub.connect(endpoint)
        except BaseException:
            self._pub.close(0)
            raise
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = zmq.asyncio.Context.shadow(context).socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _serve_curve(self._replay, curve)
            self._replay.bind(replay_endpoint)

    @property
    def bound_endpoint(self) -> str:
        """The PUB's last bound or connected endpoint, with the real port when bound to port 0."""
        return self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()

    @property
    def replay_bound_endpoint(self) -> str | None:
        """The replay ROUTER's bound endpoint, with the real port when bound to port 0."""
        return None if self._replay is None else self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()

    def buffered(self) -> list[tuple[int, bytes]]:
        """The (seq, payload) pairs kept for replay, oldest first."""
        return list(self._buffer)

    def publish(self, events: Sequence[Event]) -> int:
        """Send one batch; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(
            events,
            ts=self._clock(),
            data_parallel_rank=self.data_parallel_rank,
            layout=self.layout,
            batch_layout="array",
        )
        self._buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        return seq

    def replay_replies(self, request: Sequence[bytes]) -> list[list[bytes]]:
        """The ROUTER replies to one request ``[identity, b"", start_seq]``: each buffered batch
        with seq >= start, then the end marker; ``[]`` for a malformed request."""
        if len(request) != 3 or len(request[2]) < 8:
            return []
        identity, start = request[0], int.from_bytes(request[2][:8], "big")
        head = [identity, b"", self.topic] if self.replay_layout == "topic" else [identity, b""]
        buffered = tuple(self._buffer)  # a snapshot: publish may run on another thread
        replies = [[*head, seq.to_bytes(8, "big"), payload] for seq, payload in buffered if seq >= start]
        replies.append([*head, END_SEQ, b""])
        return replies

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (returns at once without a replay endpoint)."""
        if self._replay is None:
            return
        while True:
            request = await self._replay.recv_multipart()
            replies = self.replay_replies(request)
            if not replies:
                log.warning("%s: ignored a malformed replay request of %d frames", self.pod_id, len(request))
            for reply in replies:
                await self._replay.send_multipart(reply)

    def close(self) -> None:
        self._pub.close()  # its CURVE handshake monitor, if any, ends with it
        if self._replay is not None:
            with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
                self._replay.close()


def _serve_curve(sock: zmq.Socket, curve: EventCurve | None) -> None:
    """Make ``sock`` a CURVE server with the engine's key pair (no client key is checked)."""
    if curve is not None:
        sock.curve_server = True
        sock.curve_publickey = curve.keys.public
        sock.curve_secretkey = curve.keys.secret
