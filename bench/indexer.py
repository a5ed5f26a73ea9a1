"""Our index against NVIDIA Dynamo's standalone KV indexer (issue 26): each system alone, fed the
same pre-encoded KV-event streams over ZeroMQ from the same publishers, then asked the same
queries.

Systems (``--systems``):

* ``dynamo``: ``python -m dynamo.indexer --threads T`` (``make bench-dynamo``: ``var/dynamo``),
  its workers the publishers' endpoints; queries ``POST /query {"token_ids", "model_name"}``.
* ``valkey``: a Valkey server, ``manage.py ingest --connect <each endpoint> --processes P`` and
  ``manage.py serve --workers 1`` for the queries (``POST /api/v1/score`` with ``token_ids``);
* ``in-process``: ``manage.py serve --workers 1 --index in-process --ingest-connect <each
  endpoint>``: one process that subscribes, keeps the index (the compiled maps) and answers, as
  Dynamo's does; no Valkey.

The streams: ``--pods`` publishers (PUB sockets this process binds), each one chain of
``blocks / pods`` blocks of 16 tokens in 16-block ``BlockStored`` events as vLLM 0.33 publishes
them (``bench/ingest.py``'s ``make_stream``: token ids with them, hashes as the engines' are),
every frame encoded before the clock starts; then each chain's tail half removed
(``BlockRemoved``).

Measured per system:

1. **ingest**: blocks/s from the first frame sent to the last block applied (Dynamo: a query for
   each pod's whole chain matching all of it; ours: every pod's last seq in the index), the CPU
   seconds per million blocks of all the system's processes (``/proc``, Valkey's included) over
   that span, and bytes per (block, pod) entry, read ``SETTLE_SECONDS`` later (Dynamo and ours
   in-process: the RSS growth; ours with Valkey: Valkey's ``used_memory`` growth plus ingest's RSS
   growth);
2. **agreement**: ``--samples`` queries (a random pod's chain prefix of random length, then
   tokens of no chain), each system's matched tokens per pod against what the pod holds, after
   the stores and again after the removals;
3. **queries**: ``--query-tokens``-token queries (the same construction: distinct, partial hits)
   by ``wrk``, cycling through ``--queries`` distinct bodies for ``--seconds`` each: over one
   connection (p50, p99: a light client; a Python client added ~0.5 ms to every query, Dynamo's
   too), then over 16 (queries/s, p99, the system's CPU per query).

The in-process system's ingest is seen done by its own counters on ``/metrics`` (blocks stored,
then removed), Dynamo's by a query of each pod's whole chain, Valkey's by every pod's last seq.

    .venv/bin/python bench/indexer.py [--systems dynamo,valkey,in-process] [--pods 32] [--blocks 81920,327680]
        [--dynamo-threads 1,2] [--processes 1] [--samples 100] [--out var/bench/indexer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402
import zmq  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.dynamo import DYNAMO_VENV, dynamo_installed  # noqa: E402
from bench.faults import Valkey, free_port, free_port_range, project_env, wait_for  # noqa: E402
from bench.ingest import BLOCK, MODEL, make_stream  # noqa: E402
from bench.machine import machine  # noqa: E402
from ingest.events import BlockRemoved, BlockStored, encode_batch, encode_message  # noqa: E402
from kvindex import open_index  # noqa: E402

BLOCKS_PER_EVENT = 16
SETTLE_SECONDS = 12.0
"""Between the end of the stores and the memory reading: a process that hands freed memory back
(ours: ``malloc_trim`` every 10 s, after the burst of 32 streams sent at once) shows what it keeps."""
WRK_SCRIPT = """
-- Cycles through the bodies of {bodies}, one JSON body per line: distinct queries.
local bodies = {{}}
for line in io.lines("{bodies}") do bodies[#bodies + 1] = line end
local n = 0
request = function()
  n = n % #bodies + 1
  return wrk.format("POST", "{path}", {{["Content-Type"] = "application/json"}}, bodies[n])
end
"""


@dataclass
class Workload:
    """Per pod its chain (token ids; batches of one 16-block ``BlockStored``) and, after them, the
    removal of its tail half (batches of 16 ``BlockRemoved`` of one hash each, as vLLM sends them)."""

    pods: list[str]
    tokens: dict[str, list[int]]
    stores: dict[str, list[list[BlockStored]]]
    removals: dict[str, list[list[BlockRemoved]]]

    @property
    def blocks(self) -> int:
        return sum(len(tokens) // BLOCK for tokens in self.tokens.values())

    @classmethod
    def make(cls, pods: int, blocks: int) -> Workload:
        per_pod = blocks // pods
        streams = make_stream(pods, per_pod // BLOCKS_PER_EVENT, BLOCKS_PER_EVENT)
        made = cls([], {}, {}, {})
        for stream in streams:
            pod = stream[0][0]
            made.pods.append(pod)
            made.stores[pod] = [[event] for _, event in stream]
            made.tokens[pod] = [t for _, event in stream for t in event.token_ids]
            hashes = [h for _, event in stream for h in event.block_hashes]
            tail = hashes[len(hashes) // 2 :]
            made.removals[pod] = [
                [BlockRemoved(block_hashes=(h,)) for h in tail[i : i + BLOCKS_PER_EVENT]]
                for i in range(0, len(tail), BLOCKS_PER_EVENT)
            ]
        return made

    def held_tokens(self, pod: str, removed: bool) -> int:
        """How many leading tokens of its chain ``pod`` holds (its whole chain, or half)."""
        blocks = len(self.tokens[pod]) // BLOCK
        return (blocks // 2 if removed else blocks) * BLOCK

    def query(self, rng: random.Random, length: int) -> tuple[str, list[int], int]:
        """(pod, tokens, its prefix length): a random pod's chain prefix of a random number of
        whole blocks (at most ``length``), then tokens of no chain up to ``length``."""
        pod = rng.choice(self.pods)
        prefix = rng.randrange(0, length // BLOCK + 1) * BLOCK
        tail = [200_000 + rng.randrange(50_000) for _ in range(length - prefix)]
        return pod, self.tokens[pod][:prefix] + tail, prefix


class Publishers:
    """One bound PUB socket per pod, every frame encoded before anything is sent."""

    def __init__(self, workload: Workload) -> None:
        self.context = zmq.Context()
        base = free_port_range(len(workload.pods))
        self.endpoints = [f"tcp://127.0.0.1:{base + i}" for i in range(len(workload.pods))]
        self.sockets = []
        for endpoint in self.endpoints:
            socket = self.context.socket(zmq.PUB)
            socket.setsockopt(zmq.SNDHWM, 0)  # nothing dropped: the whole stream queues
            socket.bind(endpoint)
            self.sockets.append(socket)
        self.seq = dict.fromkeys(workload.pods, 0)
        self.workload = workload

    def frames(self, batches: dict[str, list[list]]) -> list[tuple[int, list[bytes]]]:
        """Every pod's batches as the frames its PUB sends (topic, seq, payload), pods interleaved
        as engines' streams arrive."""
        per_pod = []
        for i, pod in enumerate(self.workload.pods):
            frames = []
            for batch in batches[pod]:
                frames.append(
                    (i, encode_message(pod, MODEL, self.seq[pod], encode_batch(batch, ts=time.time())))
                )
                self.seq[pod] += 1
            per_pod.append(frames)
        return [frame for round_ in zip(*per_pod, strict=True) for frame in round_]

    def send(self, frames: list[tuple[int, list[bytes]]]) -> None:
        for i, parts in frames:
            self.sockets[i].send_multipart(parts)

    def close(self) -> None:
        for socket in self.sockets:
            socket.close(linger=0)
        self.context.term()


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class System:
    """A running index: its processes, where it answers queries, how it reads a score."""

    name: str
    pids: list[int]
    """The processes that ingest (CPU per million blocks)."""
    query_pids: list[int]
    """The processes that answer queries (CPU per query)."""
    query_url: str

    def body(self, tokens: list[int]) -> dict: ...

    def matched(self, answer: dict, pod: str) -> int: ...

    def applied(self, publishers: Publishers, workload: Workload, removed: bool) -> bool: ...

    def memory(self) -> int: ...

    def stop(self) -> None: ...


class Dynamo(System):
    def __init__(self, endpoints: list[str], pods: list[str], threads: int, log: Path) -> None:
        self.name = f"dynamo (--threads {threads})"
        self.port = free_port()
        self.query_url = f"http://127.0.0.1:{self.port}/query"
        self.ids = {pod: str(i) for i, pod in enumerate(pods)}
        workers = ",".join(f"{i}={endpoint}" for i, endpoint in enumerate(endpoints))
        self.proc = subprocess.Popen(
            [str(DYNAMO_VENV / "bin" / "python"), "-m", "dynamo.indexer", "--port", str(self.port),
             "--threads", str(threads), "--block-size", str(BLOCK), "--model-name", MODEL,
             "--workers", workers],
            stdout=log.open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.pids = self.query_pids = [self.proc.pid]
        wait_for(self._listening, timeout=60, what="Dynamo's indexer", every=0.1)
        self.rss = rss_bytes(self.proc.pid)
        self._checked: dict[str, tuple[int, bool]] = {}

    def _listening(self) -> bool:
        try:
            workers = httpx.get(f"http://127.0.0.1:{self.port}/workers", timeout=1).json()
        except httpx.HTTPError:
            return False
        return len(workers) == len(self.ids) and all(w.get("status") == "active" for w in workers)

    def body(self, tokens: list[int]) -> dict:
        return {"token_ids": tokens, "model_name": MODEL}

    def matched(self, answer: dict, pod: str) -> int:
        return int(answer.get("scores", {}).get(self.ids[pod], {}).get("0", 0))

    def applied(self, publishers: Publishers, workload: Workload, removed: bool) -> bool:
        """Every pod's chain answered as it should be held now (checked pod by pod, once each)."""
        for pod in workload.pods:
            wanted = workload.held_tokens(pod, removed)
            if self._checked.get(pod) == (wanted, removed):
                continue
            answer = httpx.post(self.query_url, json=self.body(workload.tokens[pod]), timeout=30).json()
            if self.matched(answer, pod) != wanted:
                return False
            self._checked[pod] = (wanted, removed)
        return True

    def memory(self) -> int:
        return rss_bytes(self.proc.pid) - self.rss

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Ours(System):
    def __init__(self, endpoints: list[str], processes: int, tmp: Path) -> None:
        self.name = f"ours, Valkey (ingest --processes {processes})"
        self.valkey = Valkey()  # started
        self.env = project_env(tmp, self.valkey.url)
        web_port = free_port()
        self.query_url = f"http://127.0.0.1:{web_port}/api/v1/score"
        sockets = [arg for endpoint in endpoints for arg in ("--connect", endpoint)]
        log = (tmp / "ours.log").open("ab")
        self.ingest = subprocess.Popen(
            [sys.executable, "manage.py", "ingest", *sockets, "--processes", str(processes)],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.web = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(web_port),
             "--workers", "1"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(
            lambda: _answers(f"http://127.0.0.1:{web_port}/healthz"), timeout=60, what="the web", every=0.1
        )
        self.client = redis.Redis.from_url(self.valkey.url)
        self.index = open_index(self.valkey.url)
        self.valkey_pid = int(self.client.info("server")["process_id"])
        self.pids = [self.valkey_pid, *_tree(self.ingest.pid)]
        self.query_pids = [self.valkey_pid, *_tree(self.web.pid)]
        self.used = int(self.client.info("memory")["used_memory"])
        self.rss = sum(rss_bytes(pid) for pid in _tree(self.ingest.pid))
        time.sleep(2.0)  # the SUB sockets' subscriptions through (ZeroMQ drops what comes before)

    def body(self, tokens: list[int]) -> dict:
        return {"model": MODEL, "token_ids": tokens}

    def matched(self, answer: dict, pod: str) -> int:
        return int(answer.get("pods", {}).get(pod, {}).get("matched_blocks", 0)) * BLOCK

    def applied(self, publishers: Publishers, workload: Workload, removed: bool) -> bool:
        progress = self.index.progress(model=MODEL)
        return all(progress.get((MODEL, pod)) == publishers.seq[pod] - 1 for pod in workload.pods)

    def memory(self) -> int:
        used = int(self.client.info("memory")["used_memory"]) - self.used
        return used + sum(rss_bytes(pid) for pid in _tree(self.ingest.pid)) - self.rss

    def stop(self) -> None:
        for proc in (self.web, self.ingest):
            proc.send_signal(signal.SIGTERM)
        for proc in (self.web, self.ingest):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.index.close()
        self.valkey.stop()


class InProcess(System):
    """``manage.py serve --index in-process``: one process subscribes to the publishers, keeps the
    index in its memory (the compiled maps) and answers the queries; no Valkey."""

    def __init__(self, endpoints: list[str], tmp: Path, workers: int) -> None:
        self.name = f"ours, in-process (serve --index in-process --ingest-workers {workers})"
        self.env = project_env(tmp, "redis://127.0.0.1:1/0", KVCACHE_INDEX_BACKEND="memory")
        port = free_port()
        self.query_url = f"http://127.0.0.1:{port}/api/v1/score"
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        sockets = [arg for endpoint in endpoints for arg in ("--ingest-connect", endpoint)]
        self.web = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--index", "in-process", "--ingest-workers", str(workers), *sockets],
            cwd=ROOT, env=self.env, stdout=(tmp / "ours.log").open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="the web", every=0.1)
        self.pids = self.query_pids = _tree(self.web.pid)
        self.rss = sum(rss_bytes(pid) for pid in self.pids)
        time.sleep(2.0)  # the SUB sockets' subscriptions through (ZeroMQ drops what comes before)

    body = Ours.body
    matched = Ours.matched

    def applied(self, publishers: Publishers, workload: Workload, removed: bool) -> bool:
        """Every block stored (then every block removed) counted by the ingest's own counters on
        ``/metrics``, which it counts once written: cheaper to ask than a query of each pod's whole
        chain, which would load the process measured (agreement is checked after)."""
        stored = sum(workload.held_tokens(pod, False) for pod in workload.pods) // BLOCK
        held = sum(workload.held_tokens(pod, removed) for pod in workload.pods) // BLOCK
        text = httpx.get(self.metrics_url, timeout=30).text
        totals = {"kvcache_index_admissions_total": 0.0, "kvcache_index_evictions_total": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return (
            totals["kvcache_index_admissions_total"] >= stored
            and totals["kvcache_index_evictions_total"] >= stored - held
        )

    def memory(self) -> int:
        return sum(rss_bytes(pid) for pid in self.pids) - self.rss

    def stop(self) -> None:
        self.web.send_signal(signal.SIGTERM)
        try:
            self.web.wait(20)
        except subprocess.TimeoutExpired:
            self.web.kill()


def _tree(pid: int) -> list[int]:
    """``pid`` and its children (worker processes), as they are now."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(p) for p in children.read_text().split()] if children.exists() else []
    return [pid, *kids]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def feed(
    system: System,
    publishers: Publishers,
    workload: Workload,
    batches: dict,
    timeout: float,
    *,
    removed: bool,
) -> dict:
    """Sends ``batches`` and waits until the system applied them: blocks/s, CPU s per M blocks."""
    frames = publishers.frames(batches)
    blocks = sum(len(e.block_hashes) for per_pod in batches.values() for batch in per_pod for e in batch)
    cpu = cpu_seconds(system.pids)
    started = time.perf_counter()
    publishers.send(frames)
    wait_for(
        lambda: system.applied(publishers, workload, removed),
        timeout=timeout,
        what=f"{system.name} to apply",
        every=0.05,
    )
    seconds = time.perf_counter() - started
    used = cpu_seconds(system.pids) - cpu
    return {
        "blocks": blocks,
        "seconds": round(seconds, 3),
        "blocks_per_s": round(blocks / seconds),
        "cpu_s_per_m_blocks": round(used / blocks * 1e6, 2),
    }


def agreement(system: System, workload: Workload, samples: int, removed: bool, length: int) -> dict:
    """Sampled queries: the system's matched tokens for the pod of each against what it holds."""
    rng = random.Random(f"agreement/{removed}")
    agree = 0
    with httpx.Client(timeout=30) as client:
        for _ in range(samples):
            pod, tokens, prefix = workload.query(rng, length)
            answer = client.post(system.query_url, json=system.body(tokens)).json()
            if system.matched(answer, pod) == min(prefix, workload.held_tokens(pod, removed)):
                agree += 1
    return {"agree": agree, "samples": samples}


def latency(system: System, workload: Workload, queries: int, length: int, seconds: int, work: Path) -> dict:
    """One connection (``wrk -c1``, a light client: a Python client adds ~0.5 ms a query)."""
    measured = _wrk(system, workload, "latency", queries, length, seconds, work, connections=1)
    return {"c1_p50_ms": measured["p50_ms"], "c1_p99_ms": measured["p99_ms"]}


def throughput(
    system: System, workload: Workload, queries: int, length: int, seconds: int, work: Path
) -> dict:
    measured = _wrk(system, workload, "throughput", queries, length, seconds, work, connections=16)
    return {
        "c16_queries_per_s": measured["rate"],
        "c16_p99": f"{measured['p99_ms']}ms",
        "c16_non_2xx": measured["non_2xx"],
        "query_cpu_ms": measured["cpu_ms"],
    }


def _wrk(
    system: System,
    workload: Workload,
    seed: str,
    queries: int,
    length: int,
    seconds: int,
    work: Path,
    *,
    connections: int,
) -> dict:
    """``wrk`` over ``connections`` for ``seconds``, cycling through ``queries`` distinct bodies:
    queries/s, p50 and p99 (ms), non-2xx answers and the system's CPU per query (ms)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: make bench-deps")
    rng = random.Random(seed)
    data = work / f"bodies-{seed}.jsonl"
    data.write_text(
        "\n".join(json.dumps(system.body(workload.query(rng, length)[1])) for _ in range(queries)) + "\n"
    )
    script = work / f"query-{seed}.lua"
    path = "/" + system.query_url.split("/", 3)[3]
    script.write_text(WRK_SCRIPT.format(bodies=data, path=path))
    warm = [wrk, "-t1", f"-c{connections}", "-d1s", "-s", str(script), system.query_url]
    subprocess.run(warm, capture_output=True, timeout=60, check=True)
    cpu = cpu_seconds(system.query_pids)
    argv = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), system.query_url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    lines = out.splitlines()
    rate = float(next(line for line in lines if line.startswith("Requests/sec")).split()[1])
    done = int(next(line for line in lines if "requests in" in line).split()[0])
    non_2xx = next((int(line.split()[-1]) for line in lines if "Non-2xx" in line), 0)
    return {
        "rate": rate,
        "p50_ms": _ms(next(line.split()[1] for line in lines if line.strip().startswith("50%"))),
        "p99_ms": _ms(next(line.split()[1] for line in lines if line.strip().startswith("99%"))),
        "non_2xx": non_2xx,
        "cpu_ms": round((cpu_seconds(system.query_pids) - cpu) / max(done, 1) * 1000, 3),
    }


def _ms(text: str) -> float:
    """A wrk duration (``310.00us``, ``1.20ms``, ``2.00s``) in milliseconds."""
    for unit, scale in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if text.endswith(unit):
            return round(float(text[: -len(unit)]) * scale, 3)
    raise ValueError(f"not a wrk duration: {text!r}")


def run(make: Callable[[Publishers], System], workload: Workload, args, work: Path) -> dict:
    publishers = Publishers(workload)
    system = make(publishers)
    try:
        time.sleep(1.0)
        stored = feed(system, publishers, workload, workload.stores, args.timeout, removed=False)
        entries = workload.blocks
        time.sleep(SETTLE_SECONDS)
        result = {
            "system": system.name,
            "pods": len(workload.pods),
            **{f"ingest_{k}": v for k, v in stored.items()},
            "bytes_per_entry": round(system.memory() / entries),
            "agreement_stored": agreement(system, workload, args.samples, False, args.query_tokens),
            **latency(system, workload, args.queries, args.query_tokens, args.seconds, work),
            **throughput(system, workload, args.queries, args.query_tokens, args.seconds, work),
        }
        removed = feed(system, publishers, workload, workload.removals, args.timeout, removed=True)
        result["removal_blocks_per_s"] = removed["blocks_per_s"]
        result["agreement_removed"] = agreement(system, workload, args.samples, True, args.query_tokens)
        return result
    finally:
        system.stop()
        publishers.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default="dynamo,valkey,in-process")
    parser.add_argument("--pods", type=int, default=32)
    parser.add_argument("--blocks", default="81920,327680")
    parser.add_argument("--dynamo-threads", default="1,2")
    parser.add_argument("--processes", default="1", help="ours: ingest --processes, each a run")
    parser.add_argument(
        "--ingest-workers", default="1", help="ours in-process: serve --ingest-workers, each a run"
    )
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--query-tokens", type=int, default=2048)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "indexer.json")
    args = parser.parse_args(argv)
    report: dict = {"machine": machine(), "results": []}
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "dynamo" in systems and not dynamo_installed():
        print("Dynamo is not installed (make bench-dynamo): running without it", file=sys.stderr)
        systems.remove("dynamo")
    work = Path(tempfile.mkdtemp(prefix="kvindexer-"))
    try:
        for blocks in (int(b) for b in args.blocks.split(",")):
            workload = Workload.make(args.pods, blocks)
            makers: list[Callable[[Publishers], System]] = []
            if "dynamo" in systems:
                for threads in (int(t) for t in args.dynamo_threads.split(",")):
                    makers.append(
                        lambda p, t=threads, w=workload: Dynamo(p.endpoints, w.pods, t, work / "dynamo.log")
                    )
            if "valkey" in systems:
                for processes in (int(n) for n in args.processes.split(",")):
                    makers.append(
                        lambda p, n=processes: Ours(p.endpoints, n, Path(tempfile.mkdtemp(dir=work)))
                    )
            if "in-process" in systems:
                for threads in (int(n) for n in args.ingest_workers.split(",")):
                    makers.append(
                        lambda p, t=threads: InProcess(p.endpoints, Path(tempfile.mkdtemp(dir=work)), t)
                    )
            for make in makers:
                result = {"blocks": blocks, **run(make, workload, args, work)}
                report["results"].append(result)
                print(json.dumps(result), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
