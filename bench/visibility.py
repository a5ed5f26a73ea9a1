"""Event-to-score latency with real processes: how long after an engine publishes a batch of
KV events the scoring API scores it, at a steady block rate, and what that load does to the
scoring API's own latency (issue 27, defect 5).

Real processes, as ``make run`` starts them: a Valkey server (``--aof``: with the append-only
file ``make run`` keeps), ``manage.py ingest --bind`` (its default workers and housekeeping)
and ``manage.py serve`` (the scoring API, ``--web-workers``). The pods are in the registry, with
the address of a small health and ``/metrics`` server (a child process of this script), as
``simulate --register`` leaves them.

This process plays ``--pods`` engines, each with a PUB socket of its own, publishing at
``--rate`` blocks/s in batches of ``--blocks-per-batch`` 16-token blocks, round robin over the
pods. Each pod's stream is a run of distinct prompts of ``--batches-per-prompt`` batches, each
batch continuing the previous one (its parent hash), as an engine announces a long prefill.

An observer process (so that its work does not delay the publisher) measures:

1. **visible in scores**: a ``--sample`` share of the batches; for each, from the moment it was
   published until a ``POST /api/v1/score/batch`` (up to 64 pending batches per call, back to
   back) scores the batch's pod with every block of its prompt up to that batch. The figure is an
   upper bound: a batch seen in a call counts from that call's answer. Beside it, the floor,
   **in the index**: until a lookup straight from Valkey finds the batch's last block for its pod.
2. **scoring latency**: ``--score-qps`` single ``POST /api/v1/score`` calls of recent prompts (a
   hit on one pod), paced, for ``--idle-seconds`` before the load (idle) and during it (loaded).

    .venv/bin/python bench/visibility.py [--rate 10000] [--seconds 60] [--pods 64] [--aof]
        [--repeats 1] [--out var/bench/visibility.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import zmq  # noqa: E402

from bench.faults import SEED, Valkey, free_port, project_env, wait_for  # noqa: E402
from bench.ingest import percentile, tree_cpu_seconds  # noqa: E402
from bench.machine import machine  # noqa: E402
from ingest.events import BlockStored, encode_batch, encode_message  # noqa: E402
from kvindex import open_index  # noqa: E402
from kvindex.keys import block_keys  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
BLOCK = 16
VOCAB = 151_000


# --- the pods' side --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch a pod publishes: its blocks continue its prompt's earlier batches."""

    pod: str
    seq: int
    event: BlockStored
    prompt: tuple[int, ...]  # the whole prompt, shared by its batches
    blocks_so_far: int  # of the prompt, this batch's included

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        """The prompt up to the end of this batch's blocks."""
        return self.prompt[: self.blocks_so_far * BLOCK]


def pod_stream(pod: str, batches: int, blocks_per_batch: int, batches_per_prompt: int, rng: random.Random):
    """``batches`` batches of ``pod``: distinct prompts, each announced in ``batches_per_prompt``."""
    stream = []
    for start in range(0, batches, batches_per_prompt):
        tokens = tuple(rng.randrange(VOCAB) for _ in range(batches_per_prompt * blocks_per_batch * BLOCK))
        parent = None
        for part in range(min(batches_per_prompt, batches - start)):
            first, last = part * blocks_per_batch, (part + 1) * blocks_per_batch
            hashes = tuple(rng.getrandbits(63) for _ in range(blocks_per_batch))
            event = BlockStored(
                hashes, parent, tokens[first * BLOCK : last * BLOCK], BLOCK, None, "gpu", None, None
            )
            stream.append(Batch(pod, len(stream), event, tokens, last))
            parent = hashes[-1]
    return stream


def serve_pods(ports: mp.Queue) -> None:
    """A process answering the prober's ``/health`` and the ``/metrics`` load reads for every pod
    (in a process of its own, so that the publisher's pacing never slows its answers)."""
    body = b'vllm:num_requests_running{model_name="%s"} 0.0\nvllm:num_requests_waiting{model_name="%s"} 0.0\n'
    metrics = body % (MODEL.encode(), MODEL.encode())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = b"ok" if self.path == "/health" else metrics
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer.request_queue_size = 256  # the prober reads every pod at once
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ports.put(server.server_address[1])
    server.serve_forever()


# --- the observer ----------------------------------------------------------------------------


def observe(
    url: str, redis_url: str, samples: mp.Queue, commands: mp.Queue, results: mp.Queue, score_qps: float
) -> None:
    """The observer process (see the module doc): visibility polls and the paced score load."""
    pending: list[tuple[str, list[int], int, float, int]] = []
    index_pending: queue.SimpleQueue = queue.SimpleQueue()
    in_index: list[tuple[float, float]] = []
    visible: list[float] = []
    polls: list[float] = []
    score_times: dict[str, list[float]] = {"idle": [], "loaded": []}
    phase = ["idle"]
    recent: list[list[int]] = []  # prompts published lately
    stop = threading.Event()
    lock = threading.Lock()
    last_scores: dict[int, float] = {}

    def score_load() -> None:
        client = httpx.Client(base_url=url, timeout=10)
        rng = random.Random(3)
        start, n = time.perf_counter(), 0
        while not stop.is_set():
            n += 1
            due = start + n / score_qps
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            with lock:
                if not recent:
                    continue
                tokens = rng.choice(recent)
            began = time.perf_counter()
            response = client.post("/api/v1/score", json={"model": MODEL, "token_ids": tokens})
            elapsed = time.perf_counter() - began
            if response.status_code == 200 and phase[0] in score_times:
                score_times[phase[0]].append(elapsed)
        client.close()

    def index_poll() -> None:
        """The floor: when the batch's last block is in the index for its pod (no web between)."""
        index = open_index(redis_url)
        waiting: list[tuple[str, int, float]] = []
        while not stop.is_set():
            while True:
                try:
                    waiting.append(index_pending.get_nowait())
                except queue.Empty:
                    break
            if not waiting:
                time.sleep(0.001)
                continue
            batch, waiting = waiting[:64], waiting[64:]
            found = index.lookup_many(model=MODEL, queries=[([key], [pod]) for pod, key, _ in batch])
            now = time.time()
            for item, hits in zip(batch, found, strict=True):
                if hits:
                    in_index.append((item[2], now - item[2]))
                else:
                    waiting.append(item)
        index.close()

    loader = threading.Thread(target=score_load, daemon=True)
    indexer = threading.Thread(target=index_poll, daemon=True)
    indexer.start()
    client = httpx.Client(base_url=url, timeout=10)
    results.put("ready")
    loader_started = False
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command == "stop":
            break
        if command is not None:
            phase[0] = command
            if not loader_started and score_qps > 0:
                loader.start()
                loader_started = True
        while True:
            try:
                sample = samples.get_nowait()
            except queue.Empty:
                break
            pending.append(sample)
            if sample[2]:  # a batch of the load (the idle phase's prompts are old)
                index_pending.put((sample[0], sample[4], sample[3]))
            with lock:
                recent.append(sample[1])
                del recent[:-512]
        if not pending:
            time.sleep(0.001)
            continue
        batch, pending = pending[:64], pending[64:]  # the oldest first; the rest, in turn
        body = {
            "requests": [{"model": MODEL, "token_ids": tokens, "pods": [pod]} for pod, tokens, *_ in batch]
        }
        began = time.perf_counter()
        answers = client.post("/api/v1/score/batch", json=body).json()["results"]
        polls.append(time.perf_counter() - began)
        now = time.time()
        for item, answer in zip(batch, answers, strict=True):
            pod, _, blocks, sent, _ = item
            scored = answer.get("scores", {}).get(pod, 0)
            if scored >= blocks:
                if blocks:  # not a prompt of the idle phase, there for the score load only
                    visible.append((sent, now - sent))
            else:
                pending.append(item)
                last_scores[id(item)] = scored
    stop.set()
    loader.join(5)
    indexer.join(5)
    client.close()
    unseen = [
        (pod, blocks, last_scores.get(id(item), 0), round(time.time() - sent, 1))
        for item in pending
        for pod, _, blocks, sent, _ in [item]
    ]
    results.put(
        {"visible": visible, "in_index": in_index, "unseen": unseen, "polls": polls, "score": score_times}
    )


# --- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(11)
    batches_per_pod = int(args.rate * args.seconds / args.blocks_per_batch / args.pods) + 1
    pods = [f"pod-{p:03d}" for p in range(args.pods)]
    streams = [
        pod_stream(pod, batches_per_pod, args.blocks_per_batch, args.batches_per_prompt, rng) for pod in pods
    ]
    order = [stream[b] for b in range(batches_per_pod) for stream in streams]
    budget = min(len(order), int(args.rate * args.seconds / args.blocks_per_batch))

    tmp = Path(tempfile.mkdtemp(prefix="kvvis-"))
    valkey = Valkey(aof=args.aof)
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    pod_server = ctx.Process(target=serve_pods, args=(ports,), daemon=True)
    pod_server.start()
    env = project_env(tmp, valkey.url)
    address = f"127.0.0.1:{ports.get(timeout=30)}"
    rows = [(pod, MODEL, address, "") for pod in pods]
    register = f"from registry.services import register_pods; register_pods({rows!r})"
    subprocess.run([sys.executable, "manage.py", "shell", "-c", register], cwd=ROOT, env=env, check=True)
    ingest_port, web_port = free_port(), free_port()
    procs = {
        "ingest": subprocess.Popen(
            [sys.executable, "manage.py", "ingest", "--bind", f"tcp://127.0.0.1:{ingest_port}"],
            cwd=ROOT, env=env, stdout=(tmp / "ingest.log").open("w"), stderr=subprocess.STDOUT,
        ),
        "web": subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(web_port),
             "--workers", str(args.web_workers)],
            cwd=ROOT, env=env, stdout=(tmp / "web.log").open("w"), stderr=subprocess.STDOUT,
        ),
    }  # fmt: skip
    url = f"http://127.0.0.1:{web_port}"
    context = zmq.Context()
    sockets = {}
    samples, commands, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    observer = ctx.Process(
        target=observe, args=(url, valkey.url, samples, commands, results, args.score_qps), daemon=True
    )
    try:
        wait_for(lambda: _answers(f"{url}/healthz"), timeout=60, what="the scoring API")
        for pod in pods:
            sock = context.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{ingest_port}")
            sockets[pod] = sock
        warm_seqs = _await_subscriptions(sockets, url)
        frames = [
            encode_message(b.pod, MODEL, warm_seqs[b.pod] + 1 + b.seq, encode_batch([b.event], ts=0.0))
            for b in order[:budget]
        ]  # encoded beforehand, so that the publisher only sends (the ts is not used here)
        observer.start()
        results.get(timeout=60)
        # Idle: the score load alone, over prompts the warm-up stored.
        for warm in order[: args.pods]:
            samples.put((warm.pod, list(warm.prompt_tokens), 0, time.time(), 0))
        commands.put("idle")
        time.sleep(args.idle_seconds)
        commands.put("loaded")
        every = max(1, round(1 / args.sample)) if args.sample > 0 else 0
        last_keys = {  # of the watched batches: the block the index must hold for the batch's pod
            i: block_keys(order[i].prompt_tokens, seed=SEED, block_size=BLOCK)[-1]
            for i in range(0, budget, every or budget + 1)
        }
        cpu_before = {name: tree_cpu_seconds(proc.pid)[1] for name, proc in procs.items()}
        interval = args.blocks_per_batch / args.rate
        start = time.perf_counter()
        late = 0.0
        for i, (batch, frame) in enumerate(zip(order, frames, strict=False)):
            due = start + i * interval
            while (now := time.perf_counter()) < due:
                time.sleep(min(0.0005, due - now))
            late = max(late, now - due)
            sockets[batch.pod].send_multipart(frame)
            if every and i % every == 0:
                samples.put(
                    (batch.pod, list(batch.prompt_tokens), batch.blocks_so_far, time.time(), last_keys[i])
                )
        sent_seconds = time.perf_counter() - start
        cpu = {name: tree_cpu_seconds(proc.pid)[1] - cpu_before[name] for name, proc in procs.items()}
        time.sleep(args.drain_seconds)
        commands.put("stop")
        observed = results.get(timeout=120)
    finally:
        observer.join(10)
        if observer.is_alive():
            observer.kill()
        for sock in sockets.values():
            sock.close(0)
        context.term()
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        pod_server.kill()
        valkey.stop()
        if args.keep:
            print(f"logs: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    timeline = _timeline(observed["visible"])
    visible = [latency for _, latency in observed["visible"]]
    score = observed["score"]
    return {
        "batches": budget,
        "blocks_per_s": round(budget * args.blocks_per_batch / sent_seconds),
        "publisher_late_max_ms": round(1000 * late, 1),
        "sampled": len(visible) + len(observed["unseen"]),
        "unseen": len(observed["unseen"]),
        "unseen_examples": observed["unseen"][:10],
        "visible_ms": _summary(visible),
        "in_index_ms": _summary([latency for _, latency in observed["in_index"]]),
        "poll_ms": _summary(observed["polls"]),
        "score_idle_ms": _summary(score["idle"]),
        "score_loaded_ms": _summary(score["loaded"]),
        "timeline": timeline,
        "cpu_percent": {name: round(100 * seconds / sent_seconds, 1) for name, seconds in cpu.items()},
    }


def _timeline(visible: list[tuple[float, float]]) -> list[tuple[int, float, float]]:
    """Per second of publishing: (second, p50 ms, max ms) of the batches published in it."""
    if not visible:
        return []
    first = min(sent for sent, _ in visible)
    seconds: dict[int, list[float]] = {}
    for sent, latency in visible:
        seconds.setdefault(int(sent - first), []).append(latency)
    return [
        (second, round(1000 * percentile(values, 0.5), 1), round(1000 * max(values), 1))
        for second, values in sorted(seconds.items())
    ]


def _summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(1000 * percentile(values, 0.5), 2),
        "p99": round(1000 * percentile(values, 0.99), 2),
        "max": round(1000 * max(values), 2),
    }


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _await_subscriptions(sockets: dict[str, zmq.Socket], url: str) -> dict[str, int]:
    """A PUB drops what it sends until its subscription is through: each pod announces one
    block of a prompt of its own until the scoring API scores it. Returns each pod's last seq."""
    warm = {}
    for n, pod in enumerate(sockets):
        tokens = tuple(range(1_000_000 + n * BLOCK, 1_000_000 + (n + 1) * BLOCK))
        warm[pod] = tokens
    seq = {pod: -1 for pod in sockets}
    waiting = set(sockets)

    def through() -> bool:
        for pod in waiting:
            seq[pod] += 1
            event = BlockStored((random.getrandbits(63),), None, warm[pod], BLOCK, None, "gpu", None, None)
            sockets[pod].send_multipart(
                encode_message(pod, MODEL, seq[pod], encode_batch([event], ts=time.time()))
            )
        time.sleep(0.2)
        body = {
            "requests": [{"model": MODEL, "token_ids": list(warm[pod]), "pods": [pod]} for pod in waiting]
        }
        answers = httpx.post(f"{url}/api/v1/score/batch", json=body, timeout=10).json()["results"]
        for pod, answer in zip(list(waiting), answers, strict=True):
            if answer.get("scores", {}).get(pod, 0) >= 1:
                waiting.discard(pod)
        return not waiting

    wait_for(through, timeout=120, what="every pod's subscription", every=0)
    return seq


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10_000, help="blocks/s published (default 10,000)")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--blocks-per-batch", type=int, default=16)
    parser.add_argument("--batches-per-prompt", type=int, default=4)
    parser.add_argument("--sample", type=float, default=0.25, help="share of the batches watched")
    parser.add_argument("--score-qps", type=float, default=50)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--drain-seconds", type=float, default=3)
    parser.add_argument("--web-workers", type=int, default=os.cpu_count() or 2, help="as make run")
    parser.add_argument("--aof", action="store_true", help="Valkey with an append-only file, as make run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the processes' logs and database")
    parser.add_argument("--out", default=str(ROOT / "var" / "bench" / "visibility.json"))
    args = parser.parse_args(argv)
    runs = []
    for n in range(args.repeats):
        result = run(args)
        runs.append(result)
        print(f"run {n + 1}: {json.dumps(result)}", flush=True)
    report = {"args": vars(args), "runs": runs, "machine": machine()}
    if len(runs) > 1:
        report["medians"] = {
            f"{figure}.{q}": statistics.median(r[figure].get(q, 0) for r in runs)
            for figure in ("visible_ms", "in_index_ms", "score_idle_ms", "score_loaded_ms")
            for q in ("p50", "p99", "max")
        }
        print(f"medians of {len(runs)} runs: {json.dumps(report['medians'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")
    return report


if __name__ == "__main__":
    main()
