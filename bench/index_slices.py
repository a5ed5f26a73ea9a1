"""How long one large index write keeps a concurrent reader waiting, per backend.

Three writes an engine can legally cause, each timed while a reader loops ``lookup`` of a
128-block prompt held by another pod:

* ``store``  - one ``BlockStored`` of 65536 blocks (the most an event may carry);
* ``remove`` - one ``BlockRemoved`` of those 65536 engine hashes;
* ``clear``  - ``clear_pod`` of a pod holding 100,000 blocks (``AllBlocksCleared``).

For each, the table gives the wall time of the write, how many slices it was applied in and the
longest of them (Redis: the server-side time of each ``EVALSHA``, from ``SLOWLOG``; memory: how
long each hold of the index lock lasted), and the longest any reader ``lookup`` took while the
write ran, next to a reader's median ``lookup`` with no write going on. The Redis reader runs in
its own process (as scoring does), so only the server (and, on a small machine, the CPU) makes
it wait; the memory reader is a thread of the writing process (as with the memory index), so it
also waits for the GIL, and for CPython's collections of the oldest generation (the tens of ms a
memory store's longest slice may show besides its median). Every figure is the median over
``--repeats`` runs.

    .venv/bin/python bench/index_slices.py [--backends memory,redis] [--repeats 5]
        [--slice-blocks N] [--out FILE]

``--slice-blocks`` overrides both backends' default; a number above every write's size (e.g.
1000000) shows the writes unsliced.

Redis: a throwaway Valkey server started as the tests start one (``tests/servers.py``), unless
``--redis-url`` names one (it is flushed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from kvindex import KVIndex, StoredBlock, open_index  # noqa: E402
from kvindex.keys import chain_digests, key_of, root_digest  # noqa: E402

MODEL = "bench/model"
STORE_BLOCKS = 65_536
CLEAR_BLOCKS = 100_000
PROBE_BLOCKS = 128
FILL_CHUNK = 4096  # the clear's pod is filled by stores of this size (not timed)


def stored_chain(n: int, *, first_token: int = 0) -> list[StoredBlock]:
    """``n`` chained blocks with real 32-byte digests, engine hash = block key."""
    digests = chain_digests(range(first_token, first_token + 16 * n), parent=root_digest("42"))
    return [StoredBlock(key=key_of(d), engine_hash=key_of(d), digest=d) for d in digests]


def adopted(n: int) -> list[StoredBlock]:
    """``n`` adopted blocks (digest = the key's 8 bytes): cheap to make in bulk."""
    return [StoredBlock(key=k, engine_hash=k, digest=k.to_bytes(8, "big")) for k in range(1, n + 1)]


class TimedLock:
    """The memory index's lock, recording how long each hold by the ``writer`` thread lasted."""

    def __init__(self, writer: int) -> None:
        self._lock = threading.Lock()
        self._writer = writer
        self._taken_at = 0.0
        self.holds: list[float] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self._lock.acquire(blocking, timeout)
        if taken:
            self._taken_at = time.perf_counter()
        return taken

    def release(self) -> None:
        if threading.get_ident() == self._writer:
            self.holds.append(time.perf_counter() - self._taken_at)
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_loop(index: KVIndex, keys: list[int], stop: threading.Event, samples: list) -> None:
    """``lookup`` until ``stop``, appending ``(started, seconds)`` per call (monotonic clock)."""
    while not stop.is_set():
        started = time.monotonic()
        index.lookup(model=MODEL, keys=keys)
        samples.append((started, time.monotonic() - started))


def redis_reader(url: str, keys: list[int], conn) -> None:
    """A reader process: loop lookups until told to stop, then send back the samples."""
    index = open_index(url)
    stop, samples = threading.Event(), []
    thread = threading.Thread(target=read_loop, args=(index, keys, stop, samples))
    thread.start()
    conn.send("reading")
    conn.recv()
    stop.set()
    thread.join()
    conn.send(samples)
    index.close()


def longest_wait(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest lookup that overlapped ``[start, end]``."""
    return max((d for s, d in samples if s < end and s + d > start), default=0.0)


class Workload:
    """The blocks of one run: the reader's prompt, the big store, the pod to clear."""

    def __init__(self) -> None:
        self.probe = stored_chain(PROBE_BLOCKS, first_token=10**7)
        self.big = stored_chain(STORE_BLOCKS)
        self.full = adopted(CLEAR_BLOCKS)


def run_once(backend: str, url: str, options: dict, work: Workload) -> tuple[dict[str, dict], float, int]:
    """One run of the three writes under a reader: per write its figures, then the reader's
    median idle lookup (s) and the index's ``slice_blocks``."""
    import redis

    index = open_index(url, **options)
    client = redis.Redis.from_url(url) if backend == "redis" else None
    if client is not None:
        client.flushall()
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 100_000)
    else:
        lock = index._lock = TimedLock(threading.get_ident())  # type: ignore[attr-defined]
    index.store(model=MODEL, pod="probe", tier="gpu", blocks=work.probe)
    keys = [b.key for b in work.probe]

    samples: list[tuple[float, float]] = []
    if client is not None:
        parent, child_conn = mp.Pipe()
        reader = mp.get_context("spawn").Process(target=redis_reader, args=(url, keys, child_conn))
        reader.start()
        parent.recv()
    else:
        stop = threading.Event()
        reader = threading.Thread(target=read_loop, args=(index, keys, stop, samples))
        reader.start()
    time.sleep(0.3)  # the reader's idle lookups

    def timed(write: Callable[[], object]) -> tuple[float, float, list[float]]:
        """``write``'s start and end (monotonic) and the duration of each of its slices."""
        if client is not None:
            client.slowlog_reset()
        else:
            lock.holds.clear()
        start = time.monotonic()
        write()
        end = time.monotonic()
        if client is not None:
            entries = client.slowlog_get(100_000)
            calls = [e["duration"] / 1e6 for e in entries if e["command"].upper().startswith(b"EVALSHA")]
        else:
            calls = list(lock.holds)
        time.sleep(0.1)  # let the reader finish the lookup it is in
        return start, end, calls

    big_hashes = [b.engine_hash for b in work.big]
    windows = {
        "store": timed(lambda: index.store(model=MODEL, pod="big", tier="gpu", blocks=work.big)),
        "remove": timed(lambda: index.remove(model=MODEL, pod="big", tier="gpu", engine_hashes=big_hashes)),
    }
    for i in range(0, CLEAR_BLOCKS, FILL_CHUNK):
        index.store(model=MODEL, pod="full", tier="gpu", blocks=work.full[i : i + FILL_CHUNK])
    time.sleep(0.1)
    windows["clear"] = timed(lambda: index.clear_pod(pod="full", model=MODEL))

    if client is not None:
        parent.send("stop")
        samples = parent.recv()
        reader.join(30)
        client.config_set("slowlog-log-slower-than", 10_000)
        client.close()
    else:
        stop.set()
        reader.join()
    slice_blocks = index.slice_blocks  # type: ignore[attr-defined]
    index.close()

    first_write = min(start for start, _, _ in windows.values())
    idle = statistics.median(d for s, d in samples if s + d < first_write)
    results = {
        name: {
            "write_ms": (end - start) * 1e3,
            "slices": len(calls),
            "longest_slice_ms": max(calls, default=0.0) * 1e3,
            "median_slice_ms": statistics.median(calls) * 1e3 if calls else 0.0,
            "reader_max_wait_ms": longest_wait(samples, start, end) * 1e3,
        }
        for name, (start, end, calls) in windows.items()
    }
    return results, idle, slice_blocks


def run_backend(backend: str, url: str, repeats: int, options: dict) -> list[dict]:
    """``repeats`` runs; a row per write with the median of each figure."""
    work = Workload()
    runs: dict[str, list[dict]] = {"store": [], "remove": [], "clear": []}
    idle: list[float] = []
    for _ in range(repeats):
        results, idle_s, slice_blocks = run_once(backend, url, options, work)
        idle.append(idle_s)
        for name, figures in results.items():
            runs[name].append(figures)

    rows = []
    for name, per_run in runs.items():
        row = {"backend": backend, "write": name, "slice_blocks": slice_blocks}
        for field in per_run[0]:
            row[field] = statistics.median(r[field] for r in per_run)
        row["reader_idle_ms"] = statistics.median(idle) * 1e3
        row["runs"] = per_run
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'backend':<8} {'slice':>6} {'write':<7} {'write ms':>9} {'slices':>7} "
        f"{'longest slice ms':>17} {'median slice ms':>16} {'reader max wait ms':>19} {'reader idle ms':>15}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['backend']:<8} {r['slice_blocks']:>6} {r['write']:<7} {r['write_ms']:>9.1f} "
            f"{r['slices']:>7.0f} {r['longest_slice_ms']:>17.1f} {r['median_slice_ms']:>16.1f} "
            f"{r['reader_max_wait_ms']:>19.1f} {r['reader_idle_ms']:>15.2f}"
        )
    print(
        f"\n(store: {STORE_BLOCKS} blocks; remove: those {STORE_BLOCKS} engine hashes; clear: a pod "
        f"of {CLEAR_BLOCKS} blocks. Slice: the index's slice_blocks; slices: Redis EVALSHA calls, "
        f"memory lock holds. The reader "
        f"looks up {PROBE_BLOCKS} blocks.)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="memory,redis")
    parser.add_argument("--repeats", type=int, default=5, help="runs; every figure is their median")
    parser.add_argument("--slice-blocks", type=int, default=None, help="default: the backend's")
    parser.add_argument("--redis-url", default=None, help="default: start a throwaway Valkey server")
    parser.add_argument("--out", type=Path, default=REPO / "var" / "bench" / "index_slices.json")
    args = parser.parse_args(argv)

    server = None
    rows: list[dict] = []
    try:
        for backend in args.backends.split(","):
            url = "memory://"
            if backend == "redis":
                if args.redis_url is None:
                    from tests.servers import RedisServer

                    server = RedisServer()
                url = args.redis_url or server.url
            options = {} if args.slice_blocks is None else {"slice_blocks": args.slice_blocks}
            rows += run_backend(backend, url, args.repeats, options)
    finally:
        if server is not None:
            server.stop()
    info = {
        "benchmark": "index write slices",
        "machine": machine(),
        "params": {
            "repeats": args.repeats,
            "store_blocks": STORE_BLOCKS,
            "clear_blocks": CLEAR_BLOCKS,
            "probe_blocks": PROBE_BLOCKS,
            "slice_blocks": args.slice_blocks,
        },
        "results": rows,
    }
    print(f"machine: {info['machine']['cpu']}, {info['machine']['cores']} cores")
    print(f"median of {args.repeats} runs\n")
    print_table(rows)
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
