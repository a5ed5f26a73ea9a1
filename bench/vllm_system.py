"""Real vLLM engines behind the real stack, for the end-to-end suite (``tests/vllm/``) and the
routing benchmark on real engines: a Valkey index, ``manage.py ingest``, ``serve`` and
``gateway`` as child processes over a database of their own, and ``vllm serve`` engines
(``engines/fleet.py``: vLLM 0.32 on the CPU from ``var/vllm``, the random-weight Qwen3 of
``var/vllm-model``; ``make vllm-engines`` installs both) publishing their KV events to that
ingest and registered with their replay endpoints. Any part can be stopped and started again.

``Answer`` is one request through the gateway, with what the gateway predicted
(``x-kvcache-matched-blocks``) and what the engine served from its prefix cache
(``usage.prompt_tokens_details.cached_tokens``); ``settle`` waits until the index holds what
the engine cached for a request, so that the next prediction is made on it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.envoy_front import EnvoyFront  # noqa: E402
from bench.faults import Valkey, free_port, free_port_range, project_env, wait_for  # noqa: E402
from engines.fleet import BLOCK_SIZE, Engine, EngineSpec, start_engines  # noqa: E402
from kvindex import open_index  # noqa: E402
from kvindex.shared_stats import read_snapshots  # noqa: E402

MODEL = "qwen3-41m-random"
SEED = "42"  # project_env's: an integer, so the engines take it as PYTHONHASHSEED
VLLM = ROOT / "var" / "vllm" / "bin" / "vllm"
MODEL_DIR = ROOT / "var" / "vllm-model"


@dataclass(frozen=True, slots=True)
class Answer:
    """One request through the gateway."""

    status: int
    pod: str | None
    matched_blocks: int | None  # the gateway's prediction for that pod
    prompt_tokens: int
    cached_tokens: int | None  # what the engine served from its prefix cache
    body: dict

    @property
    def expected_cached_tokens(self) -> int:
        """What the prediction says the engine serves from its cache: the matched blocks, but
        never the prompt's last token (vLLM computes at least one token, so a hit is capped at
        ``prompt_tokens - 1``, in whole blocks)."""
        assert self.matched_blocks is not None
        return min(self.matched_blocks, (self.prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE


class VllmSystem:
    """See the module docstring. ``kv_cache_mib`` per engine: 16 MiB is 256 blocks of 32 tokens."""

    def __init__(
        self,
        *,
        engines: int = 2,
        kv_cache_mib: int = 16,
        tmp: Path | None = None,
        pod_down_seconds: float = 3.0,
        serving: bool = True,
        dev_mode: bool = False,
        bind_events: bool = False,
        **settings: str,
    ) -> None:
        """``serving``: the web server and a gateway too (without: ``start_gateway`` starts
        gateways); ``dev_mode``: the engines answer ``POST /reset_prefix_cache``;
        ``bind_events``: each engine binds its KV-event PUB socket (vLLM's default;
        ``events_endpoint``, engine ``i`` on its port + i) and ingest connects to each, so that
        other subscribers (Dynamo's router) can connect too; otherwise the engines connect to
        ingest's one bound socket."""
        if not VLLM.exists() or not (MODEL_DIR / "config.json").exists():
            raise RuntimeError(
                "no vLLM engine here: `make vllm-engines` installs var/vllm and var/vllm-model"
            )
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="kvvllm-"))
        self._own_tmp = tmp is None
        self.valkey = Valkey()
        self.env = project_env(
            self.tmp,
            self.valkey.url,
            KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER="true",
            KVCACHE_POD_DOWN_SECONDS=str(pod_down_seconds),
            KVCACHE_REPLAY_TIMEOUT_SECONDS="5",
            **settings,
        )
        self.index = open_index(self.valkey.url, socket_timeout=5)
        self.web_port, self.gateway_port = free_port(), free_port()
        if bind_events:
            events_port = free_port_range(engines)
            self.events_endpoint = f"tcp://*:{events_port}"
            endpoints = [f"tcp://*:{events_port + i}" for i in range(engines)]
            self._ingest_sockets = [
                arg for i in range(engines) for arg in ("--connect", f"tcp://127.0.0.1:{events_port + i}")
            ]
        else:
            self.events_endpoint = f"tcp://127.0.0.1:{free_port()}"
            endpoints = [self.events_endpoint] * engines
            self._ingest_sockets = ["--bind", self.events_endpoint]
        cores = sorted(os.sched_getaffinity(0))
        self.specs = {
            f"vllm-{i}": EngineSpec(
                pod=f"vllm-{i}",
                model=MODEL,
                model_dir=MODEL_DIR,
                port=free_port(),
                replay_port=free_port(),
                events_endpoint=endpoints[i],
                kv_cache_bytes=kv_cache_mib * 1024 * 1024,
                core=cores[i % len(cores)],
                hash_seed=SEED,
                dev_mode=dev_mode,
            )
            for i in range(engines)
        }
        self.gateways: list[subprocess.Popen] = []
        self.fronts: list[EnvoyFront] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.engines: dict[str, Engine] = {}
        self._logs = self.tmp / "logs"
        self._logs.mkdir(exist_ok=True)
        try:
            self.register_model()  # first: its config is there when ingest starts
            self.start("ingest")
            if serving:
                self.start("web")
                self.start("gateway")
            self._engine_log = (self._logs / "engines.log").open("a")
            for engine in start_engines(
                list(self.specs.values()), vllm=VLLM, var=self.tmp, out=self._engine_log
            ):
                self.engines[engine.spec.pod] = engine
            # The engines once they answer (as manage.py vllm_fleet does): probed before, they
            # would be marked down while starting, and the first requests refused.
            self.register_engines()
            self.client = httpx.Client(timeout=120)
            if serving:
                wait_for(self._serving, timeout=60, what="the web server and the gateway", every=0.2)
                wait_for(self._routes, timeout=30, what="the gateway to route to the engines", every=0.2)
        except BaseException:
            self.close()
            raise

    # --- processes ---------------------------------------------------------------------------

    def register_model(self) -> None:
        """The served model's config (``engines.registration``)."""
        self.shell(
            "from engines.registration import register_model; "
            f"register_model(model={MODEL!r}, model_dir={str(MODEL_DIR)!r}, block_size={BLOCK_SIZE}, "
            "max_model_len=4096)"
        )

    def register_engines(self) -> None:
        """Every engine, with its address and replay endpoint (``registry.services``)."""
        rows = [(s.pod, MODEL, s.address, s.replay_endpoint) for s in self.specs.values()]
        self.shell(f"from registry.services import register_pods; register_pods({rows!r})")

    def shell(self, code: str) -> None:
        self.manage("shell", "-c", code)

    def manage(self, *args: str) -> None:
        subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, check=True)

    def start(self, name: str) -> None:
        """Start ``ingest``, ``web`` or ``gateway``."""
        command = {
            "ingest": [
                "ingest",
                *self._ingest_sockets,
                "--housekeeping-interval",
                "0.5",
            ],
            "web": ["serve", "--host", "127.0.0.1", "--port", str(self.web_port), "--workers", "1"],
            "gateway": ["gateway", "--host", "127.0.0.1", "--port", str(self.gateway_port), "--workers", "1"],
        }[name]
        self.procs[name] = subprocess.Popen(
            [sys.executable, "manage.py", *command],
            cwd=ROOT,
            env=self.env,
            stdout=(self._logs / f"{name}.log").open("ab"),
            stderr=subprocess.STDOUT,
        )

    def kill(self, name: str) -> None:
        """``kill -9`` of ``ingest``, ``web`` or ``gateway``."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_engine(self, pod: str, *, kill: bool = False) -> None:
        """Stop an engine (SIGTERM; ``kill``: SIGKILL of its whole process group)."""
        engine = self.engines.pop(pod)
        if kill:
            os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.stop(grace=30)

    def start_engine(self, pod: str) -> None:
        """Start a stopped engine again, on its ports: its cache starts empty, its seqs from 0."""
        [engine] = start_engines([self.specs[pod]], vllm=VLLM, var=self.tmp, out=self._engine_log)
        self.engines[pod] = engine

    def start_gateway(self, policy: str, *, index: str = "shared") -> str:
        """One more gateway (one worker) routing with ``policy``; its base URL once it serves
        the model (``bench/routing.py``'s fleet interface, as ``bench.gateway.Stack``'s).
        ``index="in-process"``: the gateway keeps its own index and connects to each engine's
        KV-event PUB itself (``bind_events``), as ingest does."""
        port = free_port()
        sockets = []
        if index == "in-process":
            if "--connect" not in self._ingest_sockets:
                raise ValueError("an in-process gateway subscribes to the engines: bind_events=True")
            sockets = [a.replace("--connect", "--ingest-connect") for a in self._ingest_sockets]
        self.gateways.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "gateway", "--host", "127.0.0.1", "--port", str(port),
                 "--workers", "1", "--policy", policy, "--index", index, *sockets],
                cwd=ROOT,
                env=self.env,
                stdout=(self._logs / f"gateway-{policy}.log").open("ab"),
                stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def serves() -> bool:
            try:
                return MODEL in self.client.get(f"{url}/v1/models", timeout=2).text
            except httpx.HTTPError:
                return False

        wait_for(serves, timeout=60, what="the gateway", every=0.1)
        return url

    def start_envoy(self, policy: str) -> str:
        """Envoy + the Endpoint Picker with ``policy`` (``bench.envoy_front``), as ``start_gateway``."""
        front = EnvoyFront(self.env, policy, self._logs, model=MODEL)
        self.fronts.append(front)
        return front.url

    def stop_gateways(self) -> None:
        for front in self.fronts:
            front.stop()
        self.fronts.clear()
        _terminate(self.gateways)
        self.gateways.clear()

    @property
    def pod_urls(self) -> dict[str, str]:
        return {pod: spec.url for pod, spec in self.specs.items()}

    def _serving(self) -> bool:
        try:
            ready = self.client.get(f"{self.web_url}/readyz", timeout=2).status_code == 200
            return ready and self.client.get(f"{self.gateway_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _routes(self) -> bool:
        """A request under one block (no KV event) goes through the gateway to an engine."""
        try:
            return self.ask({"prompt": "hello"}).status == 200
        except httpx.HTTPError:
            return False

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def close(self) -> None:
        self.stop_gateways()
        for engine in self.engines.values():
            engine.stop(grace=10)
        self.engines.clear()
        _terminate(list(self.procs.values()))
        self.procs.clear()
        if hasattr(self, "client"):
            self.client.close()
        self.index.close()
        self.valkey.stop()
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- requests ----------------------------------------------------------------------------

    def ask(self, body: dict, *, chat: bool = False, url: str | None = None) -> Answer:
        """One request through the gateway, or the front at ``url`` (``stream`` in ``body``: read
        as server-sent events, usage from the last chunk)."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        front = url or self.gateway_url
        body = {"model": MODEL, "max_tokens": 1, **body}
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            with self.client.stream("POST", f"{front}{path}", json=body) as response:
                chunks = [
                    json.loads(line[len("data: ") :])
                    for line in response.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
                headers, status = response.headers, response.status_code
            answer = next((c for c in reversed(chunks) if c.get("usage")), {"chunks": chunks})
        else:
            response = self.client.post(f"{front}{path}", json=body)
            headers, status, answer = response.headers, response.status_code, response.json()
        usage = answer.get("usage") or {}
        matched = headers.get("x-kvcache-matched-blocks")
        return Answer(
            status=status,
            pod=headers.get("x-kvcache-pod"),
            matched_blocks=int(matched) if matched is not None else None,
            prompt_tokens=usage.get("prompt_tokens", 0),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            body=answer,
        )

    def engine_tokens(self, pod: str, body: dict, *, chat: bool = False) -> list[int]:
        """The tokens ``pod`` makes of a request (its own ``/tokenize``, its chat template)."""
        request = {"model": MODEL, **{k: v for k, v in body.items() if k in ("prompt", "messages")}}
        if chat:
            request["add_generation_prompt"] = True
        response = self.client.post(f"{self.engines[pod].spec.url}/tokenize", json=request)
        response.raise_for_status()
        return response.json()["tokens"]

    def indexed_blocks(self, pod: str, tokens: list[int], *, cache_salt: str | None = None) -> int:
        """The leading blocks of ``tokens`` the index says ``pod`` holds (the scoring API)."""
        body = {"model": MODEL, "token_ids": tokens, "pods": [pod]}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = self.client.post(f"{self.web_url}/api/v1/score", json=body)
        response.raise_for_status()
        return response.json()["pods"].get(pod, {}).get("matched_blocks", 0)

    def blocks_held(self, pod: str) -> int:
        """Every block the index says ``pod`` holds (read from the index itself)."""
        return sum(row.total for row in self.index.pod_blocks(model=MODEL) if row.pod == pod)

    def settle(self, answer: Answer, body: dict, *, chat: bool = False, timeout: float = 20.0) -> None:
        """Wait until the index holds the blocks the engine cached for ``answer``'s prompt: every
        full block of it (what the engine just computed is still in its cache, which holds
        more blocks than any prompt of the suite)."""
        assert answer.pod is not None, answer
        tokens = self.engine_tokens(answer.pod, body, chat=chat)
        full = len(tokens) // BLOCK_SIZE
        salt = body.get("cache_salt")
        wait_for(
            lambda: self.indexed_blocks(answer.pod, tokens, cache_salt=salt) == full,
            timeout=timeout,
            what=f"{full} blocks of {answer.pod} in the index",
            every=0.02,
        )

    def pod_health(self, pod: str) -> str:
        """The registry's health of ``pod`` (the liveness prober's verdict): up, down or unknown."""
        with sqlite3.connect(self.tmp / "db.sqlite3") as db:  # the pods API wants an admin's login
            [health] = db.execute("select health from scoring_pod where pod_id = ?", (pod,)).fetchone()
        return health

    def stats(self) -> list[dict]:
        """Ingest's streams, as it publishes them (``kvindex.shared_stats``)."""
        client = redis.Redis.from_url(self.valkey.url)
        try:
            return [stream for snapshot in read_snapshots(client) for stream in snapshot["streams"]]
        finally:
            client.close()


def _terminate(procs: list[subprocess.Popen], *, grace: float = 20.0) -> None:
    """SIGTERM to all, then wait for each; SIGKILL to one not gone after ``grace`` seconds."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    """Start the system and keep it up until Ctrl-C (for trying things by hand)."""
    system = VllmSystem()
    print(f"gateway {system.gateway_url}  web {system.web_url}  logs {system.tmp / 'logs'}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        system.close()


if __name__ == "__main__":
    main()
