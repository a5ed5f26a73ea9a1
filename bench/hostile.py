"""Hostile KV-event input against a real ``manage.py ingest`` (and ``serve``): what it costs now.

Each case is one of the measurements that opened issue 9, repeated on the bounded ingest:

* ``pod_flood``: 30,000 distinct pod names in one burst. Recorded: ingest's memory growth, the
  registry rows created, the size of the stats ingest writes to Valkey each second, and the size
  and time of the web process's ``/metrics``.
* ``victim_delay``: one engine sends the largest input the limits let through (a 2 MiB message;
  a 16,384-block store; a 65,536-hash remove; 4,096 ``AllBlocksCleared``), then a small batch of
  another engine on the same shard worker follows. Recorded: how long after sending the victim's
  batch is visible in the index, against the same batch sent alone (the floor, same run).
* ``fuzz`` (issue 27): ``--fuzz-messages`` mutated messages (``tests/security/hostile_events.py``)
  into an ingest with the default limits, in chunks of 1,000 that it keeps up with (a valid pod's
  batch after each, awaited), so that what is measured is what ingest keeps, not a backlog.
  Recorded every 50,000: ingest's RSS (growth after 5,000 of warm-up), the registry's rows, the
  messages per second; at the end, whether the valid pod's blocks all score. The growth moves by
  5-10 MB from one run to the next (``docs/performance.md``): ``--fuzz-runs 3`` runs it on three
  fresh ingest processes and reports each mark's median.

    .venv/bin/python bench/hostile.py [--cases victim,flood,fuzz] [--rounds 5] [--fuzz-runs 1]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import zmq  # noqa: E402

from bench.faults import SEED, Valkey, free_port, project_env, wait_for  # noqa: E402
from bench.machine import machine  # noqa: E402
from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch, encode_message  # noqa: E402
from kvindex import open_index  # noqa: E402
from kvindex.keys import chain_digests, key_of, root_digest  # noqa: E402
from kvindex.shared_stats import STATS_KEY  # noqa: E402
from tests.security.hostile_events import EventFuzzer  # noqa: E402

MODEL = "bench/hostile"
BLOCK = 16


class Ingest:
    """``manage.py ingest`` with one worker (every pod on the same shard) over its own Valkey
    and database; ``serve`` on demand."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvhostile-"))
        self.valkey = Valkey()
        self.env = project_env(self.tmp, self.valkey.url, KVCACHE_POD_DOWN_SECONDS="0")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "ingest",
                "--bind",
                f"tcp://127.0.0.1:{self.port}",
                "--workers",
                "1",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.index = open_index(self.valkey.url)
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.connect(f"tcp://127.0.0.1:{self.port}")
        self.seqs: dict[str, int] = {}

        # ZeroMQ drops what a PUB sends before the subscription is through: send until it lands.
        def heard() -> bool:
            self.send("warm", [])
            return (MODEL, "warm") in self.index.progress(model=MODEL)

        wait_for(heard, timeout=60, what="ingest", every=0.05)

    def send(self, pod: str, events: list, **kwargs: object) -> int:
        seq = self.seqs.get(pod, -1) + 1
        self.seqs[pod] = seq
        payload = kwargs.pop("payload", None) or encode_batch(events, ts=time.time(), layout="map")
        self.pub.send_multipart(encode_message(pod, MODEL, seq, payload))
        return seq + 1  # truthy

    def applied(self, pod: str) -> bool:
        return self.index.progress(model=MODEL).get((MODEL, pod)) == self.seqs[pod]

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.pub.close()
        self.context.term()
        self.index.close()
        self.valkey.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def stores(count: int, *, start_token: int = 0) -> BlockStored:
    tokens = [(start_token + i) % 150_000 for i in range(count * BLOCK)]
    keys = [key_of(d) for d in chain_digests(tokens, block_size=BLOCK, parent=root_digest(SEED))]
    return BlockStored(
        block_hashes=tuple(keys), parent_block_hash=None, token_ids=tuple(tokens), block_size=BLOCK
    )


def pod_flood(ingest: Ingest, pods: int) -> dict:
    rss_before = ingest.rss_mb()
    payload = encode_batch([stores(1)], ts=time.time(), layout="map")
    started = time.monotonic()
    for i in range(pods):
        ingest.send(f"flood-{i}", [], payload=payload)
    sent_seconds = time.monotonic() - started
    time.sleep(5)  # housekeeping registers pods and publishes stats once a second
    with sqlite3.connect(ingest.tmp / "db.sqlite3") as db:
        rows = db.execute("select count(*) from scoring_pod").fetchone()[0]
    stats = redis.Redis.from_url(ingest.valkey.url).hvals(STATS_KEY)
    web_port = free_port()
    web = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(web_port), "--workers", "1"],
        cwd=ROOT,
        env=ingest.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{web_port}"

        def up() -> bool:
            try:
                return urllib.request.urlopen(f"{url}/healthz", timeout=1).status == 200
            except OSError:
                return False

        wait_for(up, timeout=60, what="the web server", every=0.1)
        times, size = [], 0
        for _ in range(3):
            t = time.perf_counter()
            size = len(urllib.request.urlopen(f"{url}/metrics", timeout=60).read())
            times.append(time.perf_counter() - t)
    finally:
        web.send_signal(signal.SIGTERM)
        web.wait(20)
    return {
        "pods_sent": pods,
        "send_seconds": round(sent_seconds, 3),
        "ingest_rss_growth_mb": round(ingest.rss_mb() - rss_before, 1),
        "registry_rows": rows,
        "stats_json_bytes": sum(len(v) for v in stats),
        "metrics_bytes": size,
        "metrics_seconds_median": round(statistics.median(times), 3),
    }


def within_bytes(limit: int) -> list[BlockStored]:
    """4,096 store events (the most a batch may carry), as many blocks each as fit ``limit``."""
    per_event = 64
    while True:
        events = [stores(per_event, start_token=7 * i) for i in range(4096)]
        if len(encode_batch(events, ts=0.0, layout="map")) <= limit:
            return events
        per_event -= 2


# (name, the events, whether the limits let it through: then the victim waits behind it)
HOSTILE = [
    ("2 MiB message of 4,096 stores (at the limits)", lambda: within_bytes(2 * 2**20), True),
    ("65,536-block store, 4.9 MB (over the limits: skipped)", lambda: [stores(65_536)], False),
    ("16,384-block store", lambda: [stores(16_384)], True),
    ("65,536-hash remove", lambda: [BlockRemoved(block_hashes=tuple(range(1, 65_537)))], True),
    ("4,096 AllBlocksCleared", lambda: [AllBlocksCleared()] * 4096, True),
    ("10^6 AllBlocksCleared, 18 MB (over the limits: skipped)", lambda: [AllBlocksCleared()] * 10**6, False),
]


def victim_delay(ingest: Ingest, rounds: int) -> dict:
    """Milliseconds from sending the victim's one-block batch until the index shows it applied:
    alone (the floor), and right after each hostile input."""
    victim = [stores(1, start_token=99)]

    def visible_after(hostile: bytes | None, applied: bool) -> float:
        if hostile is not None:
            ingest.send("hostile", [], payload=hostile)
        started = time.monotonic()
        ingest.send("victim", victim)
        wait_for(lambda: ingest.applied("victim"), timeout=120, what="the victim's batch", every=0.001)
        elapsed = (time.monotonic() - started) * 1000
        if hostile is not None and applied:
            wait_for(lambda: ingest.applied("hostile"), timeout=120, what="the hostile batch", every=0.01)
        return elapsed

    ingest.send("hostile", [])
    out = {}
    floor = [visible_after(None, True) for _ in range(rounds)]
    out["alone (floor)"] = {"median_ms": round(statistics.median(floor), 1), "max_ms": round(max(floor), 1)}
    for name, make, applied in HOSTILE:
        payload = encode_batch(make(), ts=time.time(), layout="map")
        delays = [visible_after(payload, applied) for _ in range(rounds)]
        out[name] = {
            "message_bytes": len(payload),
            "median_ms": round(statistics.median(delays), 1),
            "max_ms": round(max(delays), 1),
            "ratio_to_floor": round(statistics.median(delays) / statistics.median(floor), 1),
        }
        print(name, out[name], flush=True)
    return out


def fuzz(ingest: Ingest, messages: int, *, chunk: int = 1000) -> dict:
    """See the module docstring: what ingest keeps while mutated messages come in."""
    frames = EventFuzzer(seed=27).messages()
    marks, before, started = [], 0.0, time.monotonic()
    chunks = messages // chunk + 5
    for n in range(chunks):
        if n == 5:
            before, started = ingest.rss_mb(), time.monotonic()
        for _ in range(chunk):
            ingest.pub.send_multipart(next(frames))
        ingest.send("valid", [stores(1, start_token=50_000 + 16 * n)])
        wait_for(lambda: ingest.applied("valid"), timeout=300, what="the valid pod's batch", every=0.01)
        done = (n - 4) * chunk
        if n >= 5 and done % 50_000 == 0:
            with sqlite3.connect(ingest.tmp / "db.sqlite3") as db:
                rows = db.execute("select count(*) from scoring_pod").fetchone()[0]
            marks.append(
                {
                    "messages": done,
                    "rss_mb": round(ingest.rss_mb(), 1),
                    "rss_growth_mb": round(ingest.rss_mb() - before, 1),
                    "registry_rows": rows,
                    "messages_per_s": round(done / (time.monotonic() - started)),
                }
            )
            print(marks[-1], flush=True)
    held = 0
    for n in range(chunks):
        tokens = [(50_000 + 16 * n + i) % 150_000 for i in range(BLOCK)]
        [digest] = chain_digests(tokens, block_size=BLOCK, parent=root_digest(SEED))
        held += len(ingest.index.lookup(model=MODEL, keys=[key_of(digest)], pods=["valid"]))
    return {
        "messages": messages,
        "rss_before_mb": round(before, 1),
        "marks": marks,
        "valid_blocks_held": f"{held}/{chunks}",
    }


def fuzz_medians(runs: list[dict]) -> list[dict]:
    """Per mark (every 50,000 messages), the median of each figure over ``runs``."""
    return [
        {
            "messages": marks[0]["messages"],
            **{
                figure: statistics.median(mark[figure] for mark in marks)
                for figure in ("rss_growth_mb", "registry_rows", "messages_per_s")
            },
            "rss_growth_mb_runs": [mark["rss_growth_mb"] for mark in marks],
        }
        for marks in zip(*(run["marks"] for run in runs), strict=True)
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pods", type=int, default=30_000, help="Distinct pod names in the flood.")
    parser.add_argument("--cases", default="victim,flood,fuzz", help="Which of: victim, flood, fuzz.")
    parser.add_argument("--fuzz-messages", type=int, default=200_000)
    parser.add_argument("--fuzz-runs", type=int, default=1, help="fresh ingest processes; medians")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "hostile.json")
    args = parser.parse_args(argv)
    cases = set(args.cases.split(","))
    report: dict = {"machine": machine(rounds=args.rounds)}
    if cases & {"victim", "flood"}:
        ingest = Ingest()
        try:
            if "victim" in cases:
                report["victim_delay"] = victim_delay(ingest, args.rounds)
                print(json.dumps(report["victim_delay"], indent=2), flush=True)
            if "flood" in cases:
                report["pod_flood"] = pod_flood(ingest, args.pods)
                print(json.dumps(report["pod_flood"], indent=2), flush=True)
        finally:
            ingest.close()
    if "fuzz" in cases:
        runs = []
        for _ in range(args.fuzz_runs):
            ingest = Ingest()  # of its own: what it keeps is what the fuzz left
            try:
                runs.append(fuzz(ingest, args.fuzz_messages))
                print(json.dumps(runs[-1], indent=2), flush=True)
            finally:
                ingest.close()
        report["fuzz"] = runs[0] if len(runs) == 1 else {"runs": runs, "medians": fuzz_medians(runs)}
        if len(runs) > 1:
            print(json.dumps(report["fuzz"]["medians"], indent=2), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
