"""The real ``make run`` on ports that are all non-default (issue 12's example): the demo fleet's
KV events reach ingest and the index, and Ctrl-C (SIGINT to make's process group) stops the
stack in order, ingest draining and exiting 0 before Valkey stops, the supervisor exiting 0.

It runs in the working tree (``var/`` as it is), with a registry database of its own: the
simulated pods register as ``sim-0``, ``sim-1`` with their addresses, which in a shared
``var/db.sqlite3`` would re-address the pods of a stack already running on the default ports."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
SIM_PODS = 2
# The defaults of `make run` (and other stacks on this machine): none of these may be used.
DEFAULT_PORTS = {8000, 8200, 6390, 5557, *range(8100, 8121), *range(9100, 9121)}


def free_ports(count: int, *, taken: set[int]) -> int:
    """The first of ``count`` consecutive loopback ports that are free now, none in ``taken``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        run = range(first, first + count)
        if not taken.intersection(run) and all(_bindable(port) for port in run):
            taken.update(run)
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def scrape(web_port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_make_run_on_non_default_ports_indexes_the_fleet_and_stops_in_order_on_ctrl_c(tmp_path):
    taken = set(DEFAULT_PORTS)
    web, gateway, redis_port, ingest = (free_ports(1, taken=taken) for _ in range(4))
    sim_base, sim_replay = free_ports(SIM_PODS, taken=taken), free_ports(SIM_PODS, taken=taken)
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    env.pop("REDIS_URL", None)  # make run starts its own Valkey only without one
    log_path = tmp_path / "make.log"
    make_args = [
        "make",
        "run",
        f"WEB_PORT={web}",
        f"GATEWAY_PORT={gateway}",
        f"REDIS_PORT={redis_port}",
        f"INGEST_ENDPOINT=tcp://*:{ingest}",
        f"SIM_BASE_PORT={sim_base}",
        f"SIM_REPLAY_PORT={sim_replay}",
        f"SIM_PODS={SIM_PODS}",
        "WEB_WORKERS=2",
    ]
    with log_path.open("w") as log:
        make = subprocess.Popen(
            make_args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output() -> str:
        return log_path.read_text()

    try:
        wait_until(lambda: "loadgen started" in output() or make.poll() is not None, timeout=60, what="start")
        assert make.poll() is None, output()

        def indexed() -> bool:
            """Blocks in the index and blocks stored by ingest (the gateway's speculative entries
            alone would not do)."""
            metrics = scrape(web)
            return (
                metric_sum(metrics, "kvcache_pod_blocks") > 0
                and metric_sum(metrics, "kvcache_index_admissions_total") > 0
            )

        wait_until(
            indexed,
            timeout=60,
            what=f"blocks from the simulated pods' events indexed (web on {web}, ingest on {ingest})",
        )

        os.killpg(make.pid, signal.SIGINT)  # what Ctrl-C in its terminal does
        make.wait(20)

        out = output()
        lines = out.splitlines()

        def line_of(text: str) -> int:
            found = [i for i, line in enumerate(lines) if text in line]
            assert found, f"no line with {text!r} in:\n{out}"
            return found[0]

        assert (
            line_of("ingest: stopped") < line_of("ingest stopped (exit code 0)") < line_of("stopping redis")
        )
        assert line_of("stopping redis") < line_of("redis stopped (exit code 0)")
        assert line_of("SIGINT: stopping loadgen > sim > web gateway > ingest > redis") < line_of(
            "stopping ingest"
        )
        assert lines[line_of("all processes stopped")].endswith("all processes stopped; exit status 0")
        assert "not essential" not in out  # nothing ended before Ctrl-C
        stopped = dict(re.findall(r"\| (\w+) stopped \((.+)\)$", out, re.MULTILINE))
        assert set(stopped) == {"loadgen", "sim", "web", "gateway", "ingest", "redis"}, out
        assert set(stopped.values()) == {"exit code 0"}, stopped  # every process exits 0
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        for pid in re.findall(r"started \(pid (\d+)\)", output()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)
        # This run's files in the shared var/: its Valkey's AOF and its web workers' metrics.
        for aof in (ROOT / "var" / "appendonly").glob(f"index-{redis_port}.aof*"):
            aof.unlink()
        shutil.rmtree(ROOT / "var" / f"metrics-{web}", ignore_errors=True)
