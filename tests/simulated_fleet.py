"""A simulated fleet as a real process for the tests of the serving commands' ``--index in-process``
mode: ``manage.py simulate`` whose pods bind their KV-event PUBs and replay ROUTERs (as vLLM's
do with a bind endpoint) and register themselves, event endpoints included, in a database of the
test's own; and the helpers the tests share (commands started as processes, their metrics)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.faults import free_port_range, project_env
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen3-0.6B"
NO_REDIS = "redis://127.0.0.1:1/0"
"""Nothing listens there: an in-process index needs no Valkey."""


class Process:
    """A ``manage.py`` command in its own session, its output in a file; stopped with SIGTERM."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        self._file = log.open("w")
        self.popen = subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then its exit code (SIGKILL after ``timeout``: then the test fails on it)."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._file.close()
        return self.popen.returncode


class SimulatedFleet:
    """``pods`` simulated pods of :data:`MODEL` (pod ``sim-i`` serves HTTP on ``base_port + i``),
    registered with their addresses, replay and event endpoints; ``env`` is the environment of
    the project's processes of the test (its database migrated, no Valkey)."""

    def __init__(self, tmp: Path, *, pods: int = 2, **env: str) -> None:
        self.tmp = tmp
        self.env = project_env(
            tmp,
            NO_REDIS,
            KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER="true",
            KVCACHE_SPECULATIVE_SECONDS="0",  # what the index says decides, not the router's memory
            **env,
        )
        self.base_port = free_port_range(pods)
        events, replay = free_port_range(pods), free_port_range(pods)
        self.urls = {f"sim-{i}": f"http://127.0.0.1:{self.base_port + i}" for i in range(pods)}
        self.process = Process(
            self.env, tmp / "simulate.log",
            "simulate", "--pods", str(pods), "--base-port", str(self.base_port),
            "--events-endpoint", f"tcp://*:{events}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}",
            "--register", "--kv-cache-size", "2048",
            "--prefill-overhead-ms", "1", "--prefill-time-per-token-ms", "0", "--inter-token-latency-ms", "1",
        )  # fmt: skip
        wait_until(
            lambda: "registered:" in self.process.output() or not self.process.alive(),
            timeout=60,
            what="the simulated pods registered",
        )
        assert self.process.alive(), self.process.output()

    def complete(self, url: str, prompt: str) -> httpx.Response:
        """A completion of ``prompt`` (one token) sent to ``url``: a pod, or a router."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=30)

    def stop(self) -> None:
        self.process.stop()


def prompt(name: str, words: int = 300) -> str:
    """A prompt of its own (~68 blocks of 16 tokens for 300 words)."""
    return " ".join(f"{name}{i}" for i in range(words))


def samples(metrics_text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named ``name`` of a Prometheus text exposition: sorted labels -> value."""
    found = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def per_pod(metrics_text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their ``pod`` label."""
    return {dict(labels)["pod"]: value for labels, value in samples(metrics_text, name).items()}


def eventually(condition: Callable[[], object], *, timeout: float = 10.0, what: str = "condition") -> object:
    """``wait_until`` polling every 0.1 s: each poll here scrapes a server's metrics."""

    def polled() -> object:
        value = condition()
        if not value:
            time.sleep(0.1)
        return value

    return wait_until(polled, timeout=timeout, what=what)
