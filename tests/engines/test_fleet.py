"""An engine's command line and environment (``engines/fleet.py``); the engines themselves run in
``tests/vllm/`` (real ``vllm serve`` processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.fleet import DEFAULT_SEED, EngineError, EngineSpec, engine_env_seed


def spec(**kwargs) -> EngineSpec:
    fields = {
        "pod": "vllm-0",
        "model": "qwen3-41m-random",
        "model_dir": Path("/models/q"),
        "port": 8300,
        "replay_port": 9300,
        "events_endpoint": "tcp://127.0.0.1:5557",
    }
    return EngineSpec(**{**fields, **kwargs})


def test_the_engine_publishes_under_our_topic_to_ingest_and_replays_on_its_own_port():
    command = spec().command(Path("/venv/bin/vllm"))
    events = json.loads(command[command.index("--kv-events-config") + 1])

    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://*:9300",
        "topic": "kv@vllm-0@qwen3-41m-random",
    }
    assert command[command.index("--block-size") + 1] == "32"
    assert command[command.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert "--enable-prompt-tokens-details" in command
    assert spec().address == "127.0.0.1:8300" and spec().replay_endpoint == "tcp://127.0.0.1:9300"


def test_vllms_default_seed_leaves_pythonhashseed_unset_and_an_integer_seed_sets_it(tmp_path):
    base = {"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "", "PATH": "/bin"}

    default = spec(core=1).env(base, var=tmp_path)
    assert "PYTHONHASHSEED" not in default and "VLLM_CPU_KVCACHE_SPACE" not in default  # empty: crashes
    assert default["VLLM_CPU_OMP_THREADS_BIND"] == "1" and default["PATH"] == "/bin"
    assert Path(default["TMPDIR"]).is_dir() and Path(default["TMPDIR"]).is_relative_to(tmp_path)
    assert spec(hash_seed="42").env(base, var=tmp_path)["PYTHONHASHSEED"] == "42"
    assert engine_env_seed(DEFAULT_SEED) is None


@pytest.mark.parametrize("seed", ["my-seed", "-1", "4294967296", ""])
def test_a_seed_python_cannot_take_as_pythonhashseed_is_refused(seed):
    with pytest.raises(EngineError, match="PYTHONHASHSEED"):
        engine_env_seed(seed)
