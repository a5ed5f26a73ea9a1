"""A fleet of real ``vllm serve`` engines on this machine: each one's command line and
environment, started as a process group of its own, waited for until it answers, and stopped.

The engines are vLLM 0.32 built for CPUs, in a venv of their own (``var/vllm``, ``make
vllm-engines``), serving the random-weight Qwen3 of ``engines/prepare.py``. What each flag is
for, measured on this machine kind, is in README "Real vLLM engines". No Django import.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SEED = "vllm-none-hash"
"""The seed vLLM 0.32 derives its root block hash from when PYTHONHASHSEED is unset and the
hash is sha256_cbor (``vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED``)."""

BLOCK_SIZE = 32
"""vLLM's CPU attention needs a block size that is a multiple of 32 (16 fails at start-up:
``No common block size for 16``)."""


class EngineError(Exception):
    """An engine could not be started, or ended on its own."""


def engine_env_seed(hash_seed: str) -> str | None:
    """The PYTHONHASHSEED that makes vLLM key its blocks with ``hash_seed``: None (unset) for
    vLLM's default seed. Python itself takes PYTHONHASHSEED too, and takes nothing but an
    integer from 0 to 4294967295: any other seed cannot be given to an engine."""
    if hash_seed == DEFAULT_SEED:
        return None
    if hash_seed.isdigit() and int(hash_seed) <= 4_294_967_295:
        return hash_seed
    raise EngineError(
        f"vLLM engines can key their blocks with {DEFAULT_SEED!r} or an integer PYTHONHASHSEED "
        f"(0 to 4294967295), not with the hash seed {hash_seed!r}: change it in the admin"
    )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine: pod ``pod`` serving ``model_dir`` as ``model`` on ``host:port``, publishing
    its KV events to ``events_endpoint`` (connecting: one bound ingest for every engine) under
    the topic ``kv@<pod>@<model>``, and answering replays on ``replay_port``."""

    pod: str
    model: str
    model_dir: Path
    port: int
    replay_port: int
    events_endpoint: str
    kv_cache_bytes: int = 16 * 1024 * 1024
    block_size: int = BLOCK_SIZE
    max_model_len: int = 4096
    max_num_seqs: int = 8
    core: int | None = None
    hash_seed: str = DEFAULT_SEED
    host: str = "127.0.0.1"
    dev_mode: bool = False  # vLLM's development endpoints, POST /reset_prefix_cache among them

    @property
    def address(self) -> str:
        """As the registry takes it: ``host:port``."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def command(self, vllm: Path) -> list[str]:
        """``vllm serve`` with what this project needs of an engine: prefix caching keyed with
        sha256_cbor (as our keys are), KV events over ZeroMQ with a replay buffer, the cached
        tokens in each response's usage (``--enable-prompt-tokens-details``: what the end-to-end
        suite checks our predictions against), and a KV cache of ``kv_cache_bytes`` (small,
        so that it evicts). Eager mode: compiling takes 45 s more and its saved compile fails
        to reload on a restart."""
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": f"kv@{self.pod}@{self.model}",
        }
        return [
            str(vllm),
            "serve",
            str(self.model_dir),
            "--served-model-name",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            "bfloat16",
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--enable-prompt-tokens-details",
            "--compilation-config",
            '{"mode": 0}',
            "--kv-events-config",
            json.dumps(events, separators=(",", ":")),
            "--disable-uvicorn-access-log",
        ]

    def env(self, base: Mapping[str, str], *, var: Path) -> dict[str, str]:
        """The engine's environment: ``base`` without what would break or mislead it (an empty
        VLLM_CPU_KVCACHE_SPACE crashes its worker; a PYTHONHASHSEED other than the seed's), its
        caches and per-start files under ``var`` (not ~/.cache and /tmp), bound to one core."""
        env = {k: v for k, v in base.items() if k not in ("PYTHONHASHSEED", "VLLM_CPU_KVCACHE_SPACE")}
        seed = engine_env_seed(self.hash_seed)
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        tmp = var / "tmp" / self.pod
        tmp.mkdir(parents=True, exist_ok=True)
        env.update(
            VLLM_CACHE_ROOT=str(var / "cache"),
            TMPDIR=str(tmp),
            VLLM_CPU_OMP_THREADS_BIND=str(self.core) if self.core is not None else "auto",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env


class Engine:
    """A running ``vllm serve``: a process group of its own (its API server, engine core and
    worker), its output relayed line by line with the pod's name in front."""

    def __init__(self, spec: EngineSpec, *, vllm: Path, var: Path, out=None) -> None:
        self.spec = spec
        self.out = out or sys.stdout
        self.last_lines: deque[str] = deque(maxlen=40)
        self.proc = subprocess.Popen(
            spec.command(vllm),
            env=spec.env(os.environ, var=var),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self._relay = threading.Thread(target=self._relay_output, name=f"relay-{spec.pod}", daemon=True)
        self._relay.start()

    def _relay_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            if line:
                self.last_lines.append(line)
                self.out.write(f"[{self.spec.pod}] {line}\n")
                self.out.flush()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.spec.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, *, grace: float = 30.0) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # What the API server left behind (its engine core, its worker), if anything.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._relay.join(5)
        return self.proc.returncode


def start_engines(specs: Sequence[EngineSpec], *, vllm: Path, var: Path, timeout: float = 300.0, out=None):
    """Start every engine at once and wait until each answers ``/health``; an engine that ends
    first, or the ``timeout``, stops them all and raises ``EngineError`` with its last lines."""
    if not vllm.exists():
        raise EngineError(f"{vllm} is missing: `make vllm-engines` installs vLLM into var/vllm")
    engines: list[Engine] = []
    try:
        for spec in specs:
            engines.append(Engine(spec, vllm=vllm, var=var, out=out))
        deadline = time.monotonic() + timeout
        waiting = list(engines)
        while waiting:
            for engine in list(waiting):
                code = engine.proc.poll()
                if code is not None:
                    raise EngineError(
                        f"{engine.spec.pod} ended with exit code {code} while starting:\n"
                        + "\n".join(engine.last_lines)
                    )
                if engine.healthy():
                    waiting.remove(engine)
            if waiting and time.monotonic() > deadline:
                raise EngineError(
                    f"{', '.join(e.spec.pod for e in waiting)} not up after {timeout:.0f} s:\n"
                    + "\n".join(waiting[0].last_lines)
                )
            if waiting:
                time.sleep(0.5)
    except BaseException:
        for engine in engines:
            engine.stop(grace=10)
        raise
    return engines
