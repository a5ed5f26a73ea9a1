"""NVIDIA Dynamo's KV router in front of given pods, as child processes: the peer of
``bench/peers.py`` that needs more than a list of URLs (docs/peers-dynamo.md).

Dynamo 1.6 routes only to workers registered with its own runtime, so each pod gets a shim
(``bench/dynamo_worker.py``: a Dynamo worker that forwards the token ids it is sent to the pod's
``/v1/completions`` and hands the pod's ZeroMQ KV events to Dynamo). In front of them runs
Dynamo's frontend (``python -m dynamo.frontend --router-mode kv``): OpenAI HTTP, tokenizer,
KV router. No etcd and no NATS: discovery is a directory (``--discovery-backend file``),
requests go over Dynamo's TCP request plane, events over its ZeroMQ event plane, all on
loopback.

``make bench-dynamo`` installs Dynamo, pinned in ``bench/dynamo-requirements.txt``, into a venv of
its own (``var/dynamo``). The pods must bind their KV-event PUB sockets (vLLM's default,
``simulate --events-endpoint tcp://*:PORT``): each shim subscribes to its pod's.

    pods = fleet_pods(["http://127.0.0.1:8100", "http://127.0.0.1:8101"], "tcp://*:5600")
    with start_dynamo(pods, model="Qwen/Qwen3-0.6B", block_size=16) as dynamo:
        httpx.post(f"{dynamo.url}/v1/completions", json={...})

or by hand, in the foreground until Ctrl-C:

    .venv/bin/python bench/dynamo.py --pods http://127.0.0.1:8100 http://127.0.0.1:8101 \\
        --events tcp://*:5600 --block-size 16 [--port 8300]

No Django here: the benchmarks import it as they import the simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peers import PeerStartError  # noqa: E402
from ingest.replay import offset_endpoint  # noqa: E402
from tokenization.tokenizers import qwen_package_tokenizer_dir  # noqa: E402

__all__ = [
    "DYNAMO_VENV",
    "DynamoNotInstalled",
    "DynamoPod",
    "DynamoStartError",
    "RunningDynamo",
    "dynamo_installed",
    "fleet_pods",
    "start_dynamo",
]

DYNAMO_VENV = ROOT / "var" / "dynamo"
"""Where ``make bench-dynamo`` installs Dynamo; its ``.installed`` stamp says the install finished."""
WORKER = Path(__file__).resolve().parent / "dynamo_worker.py"

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
# The tokenizer files the frontend loads from the model directory, when the tokenizer has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


class DynamoNotInstalled(RuntimeError):
    """The Dynamo venv is missing or incomplete."""


class DynamoStartError(PeerStartError):
    """A Dynamo process exited, or the workers were not registered in time; the message has the
    logs' tails."""


@dataclass(frozen=True, slots=True)
class DynamoPod:
    """A pod as Dynamo's worker shim sees it: its base URL and its bound KV-event PUB endpoint
    (``""``: none, and the router sees no cache; ``topic``: a topic prefix to subscribe to)."""

    url: str
    events: str
    topic: str = ""


def fleet_pods(urls: list[str], events_endpoint: str) -> list[DynamoPod]:
    """The pods of a ``simulate`` fleet started with a binding ``--events-endpoint`` (``tcp://*:P``:
    pod ``i`` binds port ``P + i``), as the shims connect to them (on loopback)."""
    if not events_endpoint.startswith("tcp://*:"):
        raise ValueError(f"the pods must bind their PUB sockets (tcp://*:PORT), not {events_endpoint!r}")
    return [
        DynamoPod(url=url.rstrip("/"), events=offset_endpoint(events_endpoint, i).replace("*", "127.0.0.1"))
        for i, url in enumerate(urls)
    ]


def dynamo_installed(venv: Path = DYNAMO_VENV) -> bool:
    """Whether ``make bench-dynamo`` has installed Dynamo into ``venv``."""
    return (venv / ".installed").is_file() and (venv / "bin" / "python").is_file()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def eos_token_id(tokenizer_dir: Path) -> int | None:
    """The id of the tokenizer's ``eos_token`` (tokenizer_config.json), None when it names none."""
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    return next((token["id"] for token in added if token.get("content") == eos), None)


def model_dir(
    path: Path,
    *,
    tokenizer_dir: Path,
    context_length: int,
    architecture: str = "Qwen3ForCausalLM",
    model_type: str = "qwen3",
) -> Path:
    """A model directory for Dynamo's model card at ``path``: the tokenizer files (links) and a
    ``config.json`` with what the frontend requires of it (architecture and model type, which it
    only checks are there; context length; end-of-sequence token). No weights: the pods serve."""
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            (path / name).symlink_to(tokenizer_dir / name)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "max_position_embeddings": context_length,
        "eos_token_id": eos_token_id(tokenizer_dir),
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


@dataclass(eq=False)
class RunningDynamo:
    """A started Dynamo: where its frontend serves, its processes (the frontend first, then one
    shim per pod), their files in ``workdir`` (removed when it stops, unless ``keep_logs``) and
    their logs (in ``workdir`` too unless a log directory was given). A context manager: leaving
    it stops every process."""

    url: str
    pods: list[DynamoPod]
    workdir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    keep_logs: bool = False

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def __enter__(self) -> RunningDynamo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = STOP_TIMEOUT) -> list[int]:
        """SIGTERM to every process at once, SIGKILL to those still running after ``timeout``
        seconds; returns the exit statuses (frontend first)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not self.keep_logs:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return [process.returncode for process in self.processes]

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` of each process's log."""
        out = []
        for path in self.logs:
            try:
                text = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                text = "(no log)"
            out.append(f"--- {path.name}\n{text}")
        return "\n".join(out)

    def ready(self, client: httpx.Client, model: str) -> bool:
        """Whether the frontend serves ``model`` (``/v1/models``) and knows a generate endpoint for
        every pod (``/health``: the instances the router chooses from)."""
        try:
            models = client.get(f"{self.url}/v1/models")
            health = client.get(f"{self.url}/health")
            if models.status_code != 200 or health.status_code != 200:
                return False
            served = {m.get("id") for m in models.json().get("data", [])}
            instances = health.json().get("instances", [])
        except (httpx.HTTPError, ValueError):
            return False
        workers = sum(1 for i in instances if i.get("endpoint") == "generate")
        return model in served and workers >= len(self.pods)


def _spawn(argv: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )


def start_dynamo(
    pods: list[DynamoPod],
    *,
    model: str,
    block_size: int,
    kv_blocks: int | None = None,
    context_length: int = 32_768,
    tokenizer_dir: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    router_args: tuple[str, ...] = (),
    venv: Path = DYNAMO_VENV,
    log_dir: Path | None = None,
    keep_logs: bool = False,
    ready_timeout: float = READY_TIMEOUT,
) -> RunningDynamo:
    """Start Dynamo's frontend with its KV router (``router_args``: more frontend flags, e.g.
    ``--router-temperature``) on ``host:port`` (0: a free port) and a shim per pod serving
    ``model`` (``block_size`` and ``kv_blocks``: the pods'; ``tokenizer_dir``: the model's
    tokenizer files, by default the Qwen3 tokenizer our packages ship; ``log_dir``: where the
    processes' logs go, ``frontend.log`` and ``worker-<i>.log``, kept). Returns once the frontend
    serves the model with every pod's worker registered. Raises :class:`DynamoNotInstalled`
    without the venv, ``ValueError`` without pods, :class:`DynamoStartError` (a
    :class:`bench.peers.PeerStartError`) when a process exits or the workers are not registered
    within ``ready_timeout`` seconds (all are stopped then, their logs kept)."""
    if not pods:
        raise ValueError("give at least one pod")
    if not dynamo_installed(venv):
        raise DynamoNotInstalled(f"Dynamo is not installed in {venv}: run `make bench-dynamo`")
    tokenizer_dir = tokenizer_dir or qwen_package_tokenizer_dir()
    if tokenizer_dir is None:
        raise ValueError("no tokenizer directory: pass tokenizer_dir")
    workdir = Path(tempfile.mkdtemp(prefix="dynamo-"))
    model_path = model_dir(workdir / "model", tokenizer_dir=tokenizer_dir, context_length=context_length)
    port = port or _free_port(host)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    # Discovery in a directory of its own; every socket advertised, and all but the event plane's
    # PUBs (no setting) bound, on loopback: Dynamo otherwise picks the machine's address. The model
    # card cache (~/.cache/dynamo) under workdir; the pods reached directly.
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), host, "127.0.0.1", "localhost"]))
    env = {
        **os.environ,
        "DYN_FILE_KV": str(workdir / "discovery"),
        "DYN_TCP_RPC_HOST": host,
        "DYN_TCP_RESPONSE_STREAM_HOST": host,
        "DYN_EVENT_PLANE_HOST": host,
        "DYN_SYSTEM_HOST": host,
        "DYN_SELF_HOST_METADATA": "0",
        # A worker waits 5 s before it drains, by default; the benchmark stops it when idle.
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        "HOME": str(workdir),
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }
    python = str(venv / "bin" / "python")
    planes = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq")
    frontend = [
        python,
        "-m",
        "dynamo.frontend",
        "--http-host",
        host,
        "--http-port",
        str(port),
        "--namespace",
        namespace,
        "--router-mode",
        "kv",
        *planes,
        *router_args,
    ]
    url_host = f"[{host}]" if ":" in host else host
    running = RunningDynamo(url=f"http://{url_host}:{port}", pods=pods, workdir=workdir, keep_logs=keep_logs)
    try:
        logs = log_dir or workdir
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / "frontend.log"
        running.logs.append(log)
        running.processes.append(_spawn(frontend, env=env, cwd=workdir, log=log))
        for i, pod in enumerate(pods):
            shim = [
                python,
                "-P",  # bench/ first on sys.path would make bench/dynamo.py the `dynamo` package
                str(WORKER),
                "--pod-url",
                pod.url,
                "--events",
                pod.events,
                "--topic",
                pod.topic,
                "--model-dir",
                str(model_path),
                "--served-model-name",
                model,
                "--block-size",
                str(block_size),
                "--context-length",
                str(context_length),
                "--namespace",
                namespace,
                *(("--kv-blocks", str(kv_blocks)) if kv_blocks else ()),
            ]
            log = logs / f"worker-{i}.log"
            running.logs.append(log)
            running.processes.append(_spawn(shim, env=env, cwd=workdir, log=log))
        _wait_ready(running, model, ready_timeout)
    except BaseException:
        running.keep_logs = True  # the caller reads log_tail() in the error; the files stay
        running.stop()
        raise
    return running


def _wait_ready(running: RunningDynamo, model: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while not running.ready(client, model):
            dead = [p for p in running.processes if p.poll() is not None]
            if dead:
                raise DynamoStartError(
                    f"dynamo: {dead[0].args[2]} exited with status {dead[0].returncode} before serving "
                    f"(logs in {running.logs[0].parent}):\n{running.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise DynamoStartError(
                    f"dynamo did not register {len(running.pods)} workers within {timeout:g} s "
                    f"(logs in {running.logs[0].parent}):\n{running.log_tail()}"
                )
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run Dynamo's KV router in front of pods until Ctrl-C.")
    parser.add_argument("--pods", nargs="+", required=True, help="pod base URLs")
    parser.add_argument("--events", required=True, help="the fleet's binding events endpoint, tcp://*:PORT")
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args(argv)
    try:
        dynamo = start_dynamo(
            fleet_pods(args.pods, args.events),
            model=args.model,
            block_size=args.block_size,
            kv_blocks=args.kv_blocks,
            host=args.host,
            port=args.port,
            keep_logs=True,
        )
    except (DynamoNotInstalled, PeerStartError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    print(f"dynamo (kv) at {dynamo.url}, {len(args.pods)} workers, logs in {dynamo.logs[0].parent}")
    # SIGTERM as Ctrl-C: the processes are stopped on the way out either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with dynamo, contextlib.suppress(KeyboardInterrupt):
        dynamo.processes[0].wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
