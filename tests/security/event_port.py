"""A real ``manage.py ingest`` (and, on demand, ``manage.py gateway``) over a test Valkey and a
SQLite registry of their own, and a publisher on its event port: what an outsider who can reach
that port, or an engine of the fleet, sends."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import zmq

from ingest.events import BlockStored, encode_batch, encode_message
from kvindex import open_index
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from scoring.read_path import score_token_ids
from tests.servers import free_port, service_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"  # service_env's KVCACHE_HASH_SEED
BLOCK = 16


def prompt(n_blocks: int, first: int) -> tuple[int, ...]:
    """Token ids of ``n_blocks`` full blocks, from ``first`` on (a range no other prompt uses)."""
    return tuple(range(first, first + n_blocks * BLOCK))


class Stack:
    """Ingest on a free port, with ``env`` on top of the test service environment."""

    def __init__(self, tmp_path: Path, redis_url: str, **env: str) -> None:
        self.tmp_path = tmp_path
        self.redis_url = redis_url
        self.env = service_env(tmp_path, redis_url, KVCACHE_POD_DOWN_SECONDS="0", **env)
        self.db = tmp_path / "db.sqlite3"
        self.manage("migrate", "-v", "0")
        self.register("subscribed", "")  # the pod that shows the subscription is through (registered:
        # admitted whatever the test's admission settings)
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.log = (tmp_path / "ingest.log").open("w")
        self.ingest = subprocess.Popen(
            [
                sys.executable, "manage.py", "ingest",
                "--bind", self.endpoint,
                "--workers", "2",
                "--housekeeping-interval", "0.2",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.index = open_index(redis_url)
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(self.endpoint)
        self.seqs: dict[str, int] = {}
        self.gateway: subprocess.Popen | None = None
        self._await_subscription()

    def manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def shell(self, code: str) -> str:
        """What ``code`` prints, run by ``manage.py shell`` (Django set up, the registry's database)."""
        return self.manage("shell", "-v", "0", "-c", code)

    def register(self, pod: str, address: str, model: str = MODEL) -> None:
        """What ``simulate --register`` or an operator does: the pod, where it serves."""
        pods = [(pod, model, address, "")]
        code = f"from registry.services import register_pods; register_pods({pods!r})"
        self.shell(code)

    def send(self, pod: str, events: list, *, model: str = MODEL, **batch: object) -> None:
        seq = self.seqs.get(pod, -1) + 1
        self.seqs[pod] = seq
        payload = encode_batch(events, ts=time.time(), **batch)
        self.pub.send_multipart(encode_message(pod, model, seq, payload))

    def store(self, pod: str, tokens: tuple[int, ...], *, model: str = MODEL, **fields: object) -> None:
        """``pod`` cached the blocks of ``tokens`` (engine hashes made up, as an engine's are)."""
        n = len(tokens) // BLOCK
        hashes = tuple(random.getrandbits(63) for _ in range(n))
        self.send(
            pod, [BlockStored(hashes, None, tokens, BLOCK, None, "gpu", None, None, **fields)], model=model
        )

    def _await_subscription(self) -> None:
        # A PUB drops what it sends until the subscription is through: send until one lands.
        tokens = prompt(1, 900_000)

        def landed() -> bool:
            self.store("subscribed", tokens)
            time.sleep(0.05)
            return bool(self.index.lookup(model=MODEL, keys=block_keys(tokens, seed=SEED)))

        wait_until(landed, timeout=60, what="ingest to subscribe")

    def store_until_scored(self, pod: str, tokens: tuple[int, ...], **fields: object) -> None:
        """``store`` again every 0.2 s until ``pod`` scores every block of ``tokens`` (as an engine
        keeps publishing; ingest sees a registry change within its config refresh, 2 s)."""

        def scored() -> bool:
            self.store(pod, tokens, **fields)
            time.sleep(0.2)
            return self.scores(tokens).get(pod) == len(tokens) // BLOCK

        wait_until(scored, timeout=60, what=f"{pod} scored")

    def scores(self, tokens: tuple[int, ...], config: ServiceConfig | None = None) -> dict[str, int]:
        """Matched blocks per pod, as the read path scores ``tokens`` (the registry's defaults)."""
        config = config or ServiceConfig(seed=SEED, default_block_size=BLOCK)
        result = score_token_ids(index=self.index, config=config, model=MODEL, token_ids=tokens)
        return {pod: s.matched_blocks for pod, s in result.scores.items()}

    def registry_scores(self, tokens: tuple[int, ...]) -> dict[str, int]:
        """Matched blocks per pod as the web process scores ``tokens``: the read path over the
        registry's snapshot (model configs, each pod's learned KV-cache groups), in a process of
        its own."""
        code = (
            "import json; from kvindex import open_index; "
            "from registry.selectors import load_service_config; "
            "from scoring.read_path import score_token_ids; "
            f"r = score_token_ids(index=open_index({self.redis_url!r}), config=load_service_config(), "
            f"model={MODEL!r}, token_ids={list(tokens)!r}); "
            "print(json.dumps({p: s.matched_blocks for p, s in r.scores.items()}))"
        )
        return json.loads(self.shell(code))

    def pods(self) -> dict[str, tuple[str, bool]]:
        """The registry's pods: pod -> (address, registered)."""
        with sqlite3.connect(self.db) as db:
            rows = db.execute("SELECT pod_id, address, registered FROM scoring_pod").fetchall()
        return {pod: (address, bool(registered)) for pod, address, registered in rows}

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.ingest.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024

    def start_gateway(self, **env: str) -> str:
        port = free_port()
        self.gateway = subprocess.Popen(
            [sys.executable, "manage.py", "gateway", "--port", str(port), "--workers", "1"],
            cwd=ROOT,
            env={**self.env, **env},
            stdout=(self.tmp_path / "gateway.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{url}/health"), timeout=60, what="the gateway")
        return url

    def alive(self) -> bool:
        return self.ingest.poll() is None

    def close(self) -> None:
        self.pub.close(0)
        self.context.term()
        for proc in (self.gateway, self.ingest):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.log.close()

    def ingest_log(self) -> str:
        return (self.tmp_path / "ingest.log").read_text()


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False
