"""``manage.py simulate``: options to fleet config, and the real process end to end."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvindex.keys import block_keys
from registry.config import ModelSettings, ServiceConfig
from simulator.config import ConfigError
from simulator.management.commands.simulate import Command, fleet_config
from tests.simulator.conftest import MODEL, Collector, wait_until
from tests.simulator.test_fleet import consecutive_free_ports

ROOT = Path(__file__).resolve().parents[2]


def options(*argv: str) -> dict:
    return vars(Command().create_parser("manage.py", "simulate").parse_args(list(argv)))


def test_defaults_come_from_the_registry() -> None:
    registry = ServiceConfig(seed="7", models={MODEL: ModelSettings(name=MODEL, block_size=32)})
    config = fleet_config(options(), registry=registry)
    assert config.pod.engine.hash_seed == "7"
    assert config.pod.engine.block_size == 32
    assert (config.pods, config.base_port, config.pod_id_style) == (1, 8000, "sim")
    assert config.publish.endpoint == "tcp://127.0.0.1:5557"
    assert (config.publish.layout, config.publish.replay_layout) == ("map", "topic")


def test_every_option_reaches_the_fleet_config() -> None:
    argv = [
        "--pods", "3", "--base-port", "9100", "--model", "Qwen/Qwen3-8B", "--pod-id-style", "hostport",
        "--events-endpoint", "tcp://*:6000", "--event-layout", "array", "--replay-endpoint", "tcp://*:6100",
        "--replay-layout", "legacy", "--block-size", "64", "--kv-cache-size", "500", "--hash-seed", "",
        "--max-num-seqs", "4", "--max-waiting", "8", "--max-model-len", "4096", "--dp", "2",
        "--output-mode", "random", "--seed", "5", "--prefill-overhead-ms", "3", "--prefill-time-per-token-ms",
        "0.05", "--inter-token-latency-ms", "7", "--load-factor", "2.5", "--jitter", "0.1",
        "--failure-rate", "12.5", "--failure-types", "rate_limit,server_error",
        "--lora", "Alice=/a", "--lora", "Bob", "--role", "decode",
        "--kv-cache-transfer-latency-ms", "2.5", "--kv-cache-transfer-time-per-token-ms", "0.01",
        "--prefill-interference", "0.5",
    ]  # fmt: skip
    config = fleet_config(options(*argv), registry=ServiceConfig(seed="7"))
    pod = config.pod
    assert (config.pods, config.base_port, config.pod_id_style) == (3, 9100, "hostport")
    assert config.publish.endpoint == "tcp://*:6000" and config.publish.layout == "array"
    assert (config.publish.replay_endpoint, config.publish.replay_layout) == ("tcp://*:6100", "legacy")
    assert pod.model == "Qwen/Qwen3-8B"
    assert (pod.engine.block_size, pod.engine.kv_cache_size, pod.engine.hash_seed) == (64, 500, "")
    assert (pod.engine.max_num_seqs, pod.engine.max_waiting, pod.engine.max_model_len) == (4, 8, 4096)
    assert (pod.data_parallel_size, pod.output_mode, pod.seed) == (2, "random", 5)
    assert (pod.latency.prefill_overhead_ms, pod.latency.prefill_time_per_token_ms) == (3, 0.05)
    assert (pod.latency.inter_token_latency_ms, pod.latency.load_factor, pod.latency.jitter) == (7, 2.5, 0.1)
    assert (pod.failures.rate, pod.failures.types) == (12.5, ("rate_limit", "server_error"))
    assert [(a.name, a.path, a.lora_id) for a in pod.lora_adapters] == [("Alice", "/a", 1), ("Bob", "Bob", 2)]
    assert (pod.latency.kv_cache_transfer_latency_ms, pod.latency.kv_cache_transfer_time_per_token_ms) == (
        2.5,
        0.01,
    )
    assert pod.latency.prefill_interference == 0.5
    assert pod.role == "decode"
    assert [config.role_of(i) for i in range(3)] == ["decode"] * 3


def test_prefill_pods_make_a_pd_fleet_of_the_first_pods_and_the_rest() -> None:
    config = fleet_config(options("--pods", "3", "--prefill-pods", "1"), registry=ServiceConfig())
    assert [config.role_of(i) for i in range(3)] == ["prefill", "decode", "decode"]
    assert [fleet_config(options(), registry=ServiceConfig()).role_of(0)] == ["both"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pods", "2", "--prefill-pods", "3"], "--prefill-pods 3 is more than --pods (2)"),
        (["--pods", "2", "--prefill-pods", "1", "--role", "prefill"], "drop --role"),
        (["--prefill-pods", "-1"], "prefill_pods must be 0 to pods"),
        (["--kv-cache-transfer-latency-ms", "-1"], "kv_cache_transfer_latency_ms must be a number >= 0"),
    ],
)
def test_pd_options_that_do_not_fit_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        fleet_config(options(*argv), registry=ServiceConfig())


def test_events_can_be_disabled() -> None:
    assert (
        fleet_config(options("--events-endpoint", "none"), registry=ServiceConfig()).publish.endpoint is None
    )


@pytest.mark.parametrize("argv", [["--jitter", "0.9"], ["--failure-types", "meteor"], ["--pods", "0"]])
def test_invalid_options_are_refused(argv: list[str]) -> None:
    with pytest.raises((ConfigError, ValueError)):
        fleet_config(options(*argv), registry=ServiceConfig())


def test_the_command_runs_a_fleet_until_sigterm(tmp_path: Path, collector: Collector) -> None:
    base = consecutive_free_ports(2)
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",  # not migrated: settings' defaults
        "KVCACHE_VAR_DIR": str(tmp_path),
        "KVCACHE_HASH_SEED": "42",
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
    }
    proc = subprocess.Popen(
        [
            sys.executable, "manage.py", "simulate",
            "--pods", "2", "--base-port", str(base), "--events-endpoint", collector.endpoint,
            "--prefill-overhead-ms", "0", "--inter-token-latency-ms", "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:

        def up() -> bool:
            try:
                return all(
                    httpx.get(f"http://127.0.0.1:{base + i}/health").status_code == 200 for i in range(2)
                )
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                return False

        wait_until(up, timeout=30, what="both pods serving")
        collector.wait_peers(2)
        prompt = list(range(40))
        r = httpx.post(
            f"http://127.0.0.1:{base + 1}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        )
        assert r.status_code == 200
        wait_until(lambda: collector.messages, what="a batch")
        (message,) = collector.messages
        assert message.pod == "sim-1"
        assert message.batch.events[0].block_hashes == tuple(block_keys(prompt, seed="42"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, output
    assert f"sim-0  http://127.0.0.1:{base}" in output
    assert "hash seed '42'" in output


def test_a_pd_fleet_announces_and_registers_its_roles(tmp_path: Path) -> None:
    base = consecutive_free_ports(3)
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "KVCACHE_VAR_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    proc = subprocess.Popen(
        [
            sys.executable, "manage.py", "simulate", "--pods", "3", "--prefill-pods", "1",
            "--base-port", str(base), "--events-endpoint", "none", "--register",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip

    def registered() -> dict[str, str]:
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.closing(sqlite3.connect(tmp_path / "db.sqlite3")) as db:
            return dict(db.execute("SELECT pod_id, role FROM scoring_pod"))

    try:
        wait_until(lambda: len(registered()) == 3, timeout=30, what="the pods registered")
        assert registered() == {"sim-0": "prefill", "sim-1": "decode", "sim-2": "decode"}
        modes = [
            httpx.get(f"http://127.0.0.1:{base + i}/server_info").json()["disaggregation_mode"]
            for i in range(3)
        ]
        assert modes == ["prefill", "decode", "decode"]
        assert httpx.get(f"http://127.0.0.1:{base}/admin/config").json()["role"] == "prefill"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, output
    assert f"sim-0  http://127.0.0.1:{base}  prefill" in output
    assert "registered: addresses, roles, replay endpoints are in the pod registry" in output
