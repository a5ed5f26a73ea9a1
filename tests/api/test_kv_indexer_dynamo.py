"""A client of Dynamo's indexer API against ours: NVIDIA Dynamo 1.6.1's own standalone indexer
(``python -m dynamo.indexer``, ``var/dynamo``), whose ``--peers`` recovery at start-up is the one
request it sends a peer: ``GET <peer>/dump``. Here it recovers from ``manage.py serve`` (with
``ingest`` fed engines' KV events, ``KVCACHE_DYNAMO_BLOCKS`` on), then answers ``/query`` as ours
does. The recorded answers ``test_kv_indexer`` holds ours to are checked against a live Dynamo
too. Skipped without ``var/dynamo`` (``make bench-dynamo``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
import zmq

from bench.dynamo import DYNAMO_VENV, dynamo_installed
from ingest.events import BlockStored
from kvindex.keys import block_extra_keys
from simulator.publisher import EventPublisher
from tests.api.test_kv_indexer import DYNAMO, REGISTER
from tests.dashboard.conftest import ROOT, Process
from tests.servers import free_port, service_env, wait_until

pytestmark = pytest.mark.skipif(
    not dynamo_installed(), reason="Dynamo is not installed: run `make bench-dynamo`"
)

MODEL = "Qwen/Qwen3-0.6B"
BLOCK = 16
A = list(range(1000, 1000 + 6 * BLOCK))  # a 6-block prompt
B = A[: 2 * BLOCK] + list(range(3000, 3000 + 2 * BLOCK))  # A's first 2 blocks, then its own
S = list(range(5000, 5000 + 5 * BLOCK))  # cached with a salt
L = list(range(7000, 7000 + 2 * BLOCK))  # cached through a LoRA adapter


class DynamoIndexer:
    """``python -m dynamo.indexer`` on a free port (one indexer thread), started with ``args``;
    ready when it answers ``/workers`` (after its recovery, when it has ``--peers``)."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"dynamo-{self.port}.log"
        command = [str(DYNAMO_VENV / "bin" / "python"), "-m", "dynamo.indexer"]
        self.process = Process(
            [*command, "--port", str(self.port), "--threads", "1", *args], dict(os.environ), self.log
        )
        self.process.start()
        wait_until(self._answers, timeout=60, what="Dynamo's indexer to answer")

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/workers", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        """Its log so far, without the terminal colours it writes even to a file."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture(params=[1, 2], ids=["ingest", "ingest --processes 2"])
def stack(tmp_path: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[dict]:
    """``manage.py serve`` and ``ingest`` (in one process, or two worker processes) on the test
    Redis, recording Dynamo blocks."""
    env = service_env(tmp_path, redis_url, HF_HUB_OFFLINE="1", KVCACHE_DYNAMO_BLOCKS="1")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    web_port, events_port = free_port(), free_port()
    web = Process(
        [sys.executable, "manage.py", "serve", "--port", str(web_port), "--workers", "1"],
        env,
        tmp_path / "web.log",
    )
    ingest = Process(
        [sys.executable, "manage.py", "ingest", "--bind", f"tcp://127.0.0.1:{events_port}",
         "--housekeeping-interval", "0.2", "--processes", str(request.param)],
        env,
        tmp_path / "ingest.log",
    )  # fmt: skip
    web.start()
    ingest.start()
    url = f"http://127.0.0.1:{web_port}"
    try:
        wait_until(lambda: _answers(f"{url}/healthz"), timeout=30, what="serve to answer")
        yield {"url": url, "events": f"tcp://127.0.0.1:{events_port}"}
    finally:
        ingest.stop()
        web.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stored(tokens: list[int], first: int, last: int, hashes: Sequence[int], **fields) -> BlockStored:
    """An engine's BlockStored of blocks ``first..last-1`` of ``tokens``; engine hash of block i:
    ``hashes[i]``, the parent's when the blocks do not start a prompt."""
    return BlockStored(
        block_hashes=tuple(hashes[first:last]),
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tuple(tokens[first * BLOCK : last * BLOCK]),
        block_size=BLOCK,
        lora_id=None,
        tier=fields.pop("tier", "gpu"),
        lora_name=fields.pop("lora_name", None),
        **fields,
    )


# Engine -> what it publishes, batch by batch: pod "7" (two data-parallel ranks), pod "8" (a tree:
# A's first 4 blocks, then B branching off after 2; a salted prompt in two batches), pod "9" (on CPU
# only) and "sim-0" (an id Dynamo cannot take: its worker ids are numbers).
SALTED = block_extra_keys(5, cache_salt="tenant-42")
ALICE = block_extra_keys(2, lora_name="Alice")
ENGINES = {
    ("7", 0): [
        [stored(A, 0, 2, range(100, 106))],
        [
            stored(A, 2, 6, range(100, 106)),
            stored(L, 0, 2, range(200, 202), lora_name="Alice", extra_keys=ALICE),
        ],
    ],
    ("7", 1): [[stored(A, 0, 3, range(300, 306))]],
    ("8", 0): [
        [stored(A, 0, 4, range(400, 406)), stored(B, 2, 4, [400, 401, 452, 453])],
        [stored(S, 0, 3, range(500, 505), extra_keys=SALTED[:3])],
        [stored(S, 3, 5, range(500, 505), extra_keys=SALTED[3:])],
    ],
    ("9", 0): [[stored(A, 0, 4, range(600, 606), tier="cpu")]],
    ("sim-0", 0): [[stored(A, 0, 6, range(700, 706))]],
}
# What each holds, in matched tokens per instance and rank, of each query.
HELD = {
    "A": {"7": {"0": 96, "1": 48}, "8": {"0": 64}, "9": {"0": 64}, "sim-0": {"0": 96}},
    "B": {"7": {"0": 32, "1": 32}, "8": {"0": 64}, "9": {"0": 32}, "sim-0": {"0": 32}},
    "S salted": {"8": {"0": 80}},
    "S": {},
    "L Alice": {"7": {"0": 32}},
    "L": {},
}
QUERIES = {
    "A": {"token_ids": [*A, 1, 2, 3]},
    "B": {"token_ids": B},
    "S salted": {"token_ids": S, "cache_salt": "tenant-42"},
    "S": {"token_ids": S},
    "L Alice": {"token_ids": L, "lora_name": "Alice"},
    "L": {"token_ids": L},
}


def publish(stack: dict) -> None:
    """Every engine's batches, again until ours answers what they hold (a PUB drops what it
    sends before ingest's subscription reaches it; stores are idempotent)."""
    context = zmq.Context()
    publishers = {
        engine: EventPublisher(
            context, endpoint=stack["events"], pod_id=engine[0], model=MODEL, data_parallel_rank=engine[1]
        )
        for engine in ENGINES
    }

    def landed() -> bool:
        for engine, batches in ENGINES.items():
            for batch in batches:
                publishers[engine].publish(batch)
        time.sleep(0.3)
        return all(query(stack["url"] + "/kv-indexer", name).get("scores") == HELD[name] for name in QUERIES)

    try:
        wait_until(landed, timeout=60, what="the engines' blocks in our index")
    finally:
        for publisher in publishers.values():
            publisher.close()
        context.term()


def query(base: str, name: str) -> dict:
    response = httpx.post(f"{base}/query", json={"model_name": MODEL, **QUERIES[name]}, timeout=10)
    return response.json() if response.status_code == 200 else {}


def test_a_dynamo_indexer_recovers_from_our_dump_and_answers_as_we_do(stack, tmp_path):
    publish(stack)
    ours = {name: query(stack["url"] + "/kv-indexer", name) for name in QUERIES}
    dump = httpx.get(stack["url"] + "/kv-indexer/dump", timeout=10).json()
    events = dump[f"{MODEL}:default"]["events"]

    dynamo = DynamoIndexer(tmp_path, "--peers", stack["url"] + "/kv-indexer")
    try:
        log = dynamo.output()
        assert f"fetching dump from peer url={stack['url']}/kv-indexer/dump" in log
        assert f"applied dump events from peer total_events={len(events)}" in log
        assert "recovery from peer succeeded" in log
        assert "WARN" not in log  # every event applied: parents first, a worker id Dynamo reads
        # Recovery brings blocks, not workers: Dynamo registers none and subscribes to nothing.
        assert httpx.get(dynamo.url + "/workers", timeout=5).json() == []
        theirs = {name: query(dynamo.url, name) for name in QUERIES}
    finally:
        dynamo.stop()

    for name in QUERIES:
        expected = {i: held for i, held in HELD[name].items() if i != "sim-0"}  # Dynamo's ids are numbers
        mine = {i: held for i, held in ours[name]["scores"].items() if i != "sim-0"}
        assert mine == expected, name
        mine_instances = {i: s for i, s in ours[name]["instances"].items() if i != "sim-0"}
        # Pod "9" holds its blocks on CPU: Dynamo's scores and dp count the GPU's (0), ours the
        # blocks whatever tier holds them; the tier summary is the same.
        gpu_only = {i: held for i, held in expected.items() if i != "9"}
        assert theirs[name]["scores"] == gpu_only, name
        if "9" in mine_instances:
            nine = mine_instances.pop("9")
            assert theirs[name]["instances"].pop("9") == {**nine, "dp": {"0": 0}}, name
        assert theirs[name]["instances"] == mine_instances, name
        assert theirs[name]["frequencies"] == []  # Dynamo 1.6.1's standalone indexer never fills it


# The requests behind test_kv_indexer's DYNAMO table, in its order: (name, method, path, body).
RECORDED = [
    ("query, no worker for the model", "POST", "/query", {"token_ids": [1, 2, 3], "model_name": "m"}),
    ("workers, none", "GET", "/workers", None),
    ("register", "POST", "/register", REGISTER),
    ("register again", "POST", "/register", REGISTER),
    ("register, another block size", "POST", "/register", {**REGISTER, "instance_id": 8, "block_size": 32}),
    ("register, a bad endpoint", "POST", "/register",
     {**REGISTER, "instance_id": 9, "endpoint": "not-an-endpoint"}),
    ("register, instance_id -1", "POST", "/register", {**REGISTER, "instance_id": -1}),
    ("query, nothing cached", "POST", "/query",
     {"token_ids": [1, 2, 3], "model_name": "m", "cache_salt": "s"}),
    ("query, token_ids [-1]", "POST", "/query", {"token_ids": [-1], "model_name": "m"}),
    ("query, no token_ids", "POST", "/query", {"model_name": "m"}),
    ("query, not JSON", "POST", "/query", b"not json"),
    ("query, no content type", "POST", "/query", b'{"token_ids": [1], "model_name": "m"}'),
    ("query, GET", "GET", "/query", None),
    ("query_by_hash, a cache_salt", "POST", "/query_by_hash",
     {"block_hashes": [1], "model_name": "m", "cache_salt": "s"}),
    ("dump, one empty model", "GET", "/dump", None),
    ("unregister", "POST", "/unregister", {"instance_id": 7, "model_name": "m"}),
    ("unregister, unknown", "POST", "/unregister", {"instance_id": 7, "model_name": "m"}),
    ("register", "POST", "/register", {**REGISTER, "instance_id": 12, "model_name": "m2", "endpoint": "tcp://127.0.0.1:19561"}),
    ("workers, one", "GET", "/workers", {"model_name": "m2"}),
]  # fmt: skip


def test_the_recorded_answers_are_dynamos(tmp_path):
    dynamo = DynamoIndexer(tmp_path)
    try:
        for name, method, path, body in RECORDED:
            if method == "GET":
                response = httpx.get(dynamo.url + path, params=body, timeout=10)
            elif isinstance(body, bytes):
                headers = {} if name == "query, no content type" else {"content-type": "application/json"}
                response = httpx.post(dynamo.url + path, content=body, headers=headers, timeout=10)
            else:
                response = httpx.post(dynamo.url + path, json=body, timeout=10)
            status, expected = DYNAMO[name]
            assert response.status_code == status, name
            if expected == "text":
                assert not response.headers.get("content-type", "").startswith("application/json"), name
            elif expected == "":
                assert response.content == b"", name
            else:
                assert response.json() == expected, name
    finally:
        dynamo.stop()
