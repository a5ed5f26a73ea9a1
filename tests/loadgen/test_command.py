"""``manage.py loadgen`` end to end against the fake fleet."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from simulator.loadgen.report import LEGEND
from simulator.loadgen.runner import default_score_url
from simulator.loadgen.trace import PromptBuilder, TraceSpec, load_trace
from simulator.management.commands.loadgen import Command
from tests.loadgen.conftest import API_KEY
from tests.servers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]

SMALL_RUN = (
    "--qps", "40", "--requests", "2", "--groups", "2", "--system-prompt-tokens", "100",
    "--questions-per-group", "2", "--model", "m", "--max-tokens", "4", "--settle", "0", "--no-progress",
)  # fmt: skip


def run_command(*args: str) -> str:
    out = io.StringIO()
    call_command("loadgen", *args, stdout=out)
    return out.getvalue()


def test_command_runs_a_router_ladder_and_writes_json(fake_fleet, tmp_path):
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    out = run_command(
        *pods,
        "--score-url", fake_fleet.score_url, "--api-key", API_KEY,
        "--router", "kv,round-robin", "--qps", "40,80", "--requests", "4",
        "--groups", "2", "--system-prompt-tokens", "100", "--questions-per-group", "2",
        "--model", "m", "--max-tokens", "4", "--settle", "0", "--no-progress",
        "--json-out", str(tmp_path / "out.json"),
    )  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("router") and "TTFT p50" in lines[0]
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("kv", "40", "4", "0"),
        ("kv", "80", "4", "0"),
        ("round-robin", "40", "4", "0"),
        ("round-robin", "80", "4", "0"),
    ]
    document = json.loads((tmp_path / "out.json").read_text())
    assert [run["router"] for run in document["runs"]] == ["kv", "kv", "round-robin", "round-robin"]
    assert document["runs"][0]["best_score_share"] == 1.0
    assert document["runs"][0]["fleet_hit_rate"] == pytest.approx(0.75)
    assert document["params"]["api_key"] == "set" and document["params"]["qps"] == [40.0, 80.0]
    assert document["params"]["workload"]["groups"] == 2


def test_prefix_caches_are_reset_only_when_asked(fake_fleet):
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    scoring = ("--score-url", fake_fleet.score_url, "--api-key", API_KEY)
    out = run_command(*pods, *scoring, *SMALL_RUN)
    assert [pod.resets for pod in fake_fleet.pods.values()] == [0, 0]
    assert (
        "kv @ 40 qps: prefix caches not reset: the hit rate counts what the pods held before the run" in out
    )

    out = run_command(*pods, *scoring, *SMALL_RUN, "--qps", "40,80", "--reset-prefix-cache")
    assert [pod.resets for pod in fake_fleet.pods.values()] == [2, 2]  # once before each run
    assert "not reset" not in out
    with pytest.raises(CommandError, match="not allowed with argument"):
        run_command(*pods, *SMALL_RUN, "--reset-prefix-cache", "--keep-cache")


def test_the_table_has_a_legend_that_explains_reuse(fake_fleet, tmp_path):
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    out = run_command(
        *pods, "--score-url", fake_fleet.score_url, "--api-key", API_KEY, *SMALL_RUN,
        "--json-out", str(tmp_path / "out.json"),
    )  # fmt: skip
    lines = out.splitlines()
    assert "reuse~" in lines[0].split() and "oracle~" not in lines[0]
    assert lines[3 : 3 + len(LEGEND)] == list(LEGEND)  # under the one row
    assert any(line.startswith("reuse~ ") and "unbounded cache" in line for line in LEGEND)
    run = json.loads((tmp_path / "out.json").read_text())["runs"][0]
    assert 0 <= run["prefix_reuse_est"] <= 1 and "oracle_hit_rate_est" not in run


def test_the_score_url_defaults_to_the_web_port_of_make_run(fake_fleet, monkeypatch, tmp_path):
    assert default_score_url({}) == "http://127.0.0.1:8000/api/v1/score"
    assert default_score_url({"WEB_PORT": " 8123 "}) == "http://127.0.0.1:8123/api/v1/score"
    # The fake scoring API stands in for the web server make run starts on $WEB_PORT.
    port = fake_fleet.score_url.removeprefix("http://127.0.0.1:").removesuffix("/api/v1/score")
    monkeypatch.setenv("WEB_PORT", port)
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    run_command(*pods, "--api-key", API_KEY, *SMALL_RUN, "--json-out", str(tmp_path / "out.json"))
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["params"]["score_url"] == fake_fleet.score_url
    assert len(fake_fleet.scoring.received) == 2 and document["runs"][0]["score_failures"] == 0

    monkeypatch.setenv("WEB_PORT", "web")
    with pytest.raises(CommandError, match=r"WEB_PORT='web' is not a port: .* or give --score-url"):
        run_command(*pods, *SMALL_RUN)


def test_the_demo_load_of_make_run_resets_its_fleet_and_scores_on_the_web_port(monkeypatch):
    procfile = Path(__file__).resolve().parents[2] / "Procfile"
    line = next(line for line in procfile.read_text().splitlines() if line.startswith("loadgen:"))
    monkeypatch.setenv("WEB_PORT", "8123")  # what the Makefile exports, among the others
    for name in ("SIM_BASE_PORT", "SIM_PODS", "LOAD_QPS"):
        monkeypatch.setenv(name, "4")
    monkeypatch.setenv("FRONT_URL", "http://127.0.0.1:4")
    monkeypatch.setenv("FRONT_LABEL", "gateway")
    args = [os.path.expandvars(arg) for arg in shlex.split(line.partition("manage.py loadgen")[2])]
    options = Command().create_parser("manage.py", "loadgen").parse_args(args)
    assert options.reset_prefix_cache
    assert options.score_url == "http://127.0.0.1:8123/api/v1/score"


def test_the_demo_load_of_the_vllm_fleet_goes_through_the_gateway_with_its_block_size(monkeypatch):
    procfile = Path(__file__).resolve().parents[2] / "Procfile"
    line = next(line for line in procfile.read_text().splitlines() if line.startswith("vllmload:"))
    pods = "--pod vllm-0=http://127.0.0.1:8400 --pod vllm-1=http://127.0.0.1:8401"  # as the Makefile says
    monkeypatch.setenv("VLLM_PODS_ARGS", pods)
    monkeypatch.setenv("VLLM_MODEL", "qwen3-41m-random")
    monkeypatch.setenv("FRONT_URL", "http://127.0.0.1:4")  # the gateway's, or Envoy's with FRONT=envoy
    monkeypatch.setenv("FRONT_LABEL", "gateway")
    monkeypatch.setenv("LOAD_QPS", "4")
    args = [
        arg
        for part in shlex.split(line.partition("manage.py loadgen")[2])
        for arg in shlex.split(os.path.expandvars(part))
    ]
    options = Command().create_parser("manage.py", "loadgen").parse_args(args)
    assert options.pod == ["vllm-0=http://127.0.0.1:8400", "vllm-1=http://127.0.0.1:8401"]
    assert options.target == "http://127.0.0.1:4"
    assert options.block_size == 32
    assert not options.reset_prefix_cache  # vLLM resets its prefix cache in its dev mode only


def test_a_trace_is_replayed_at_its_own_pace_or_rescaled(fake_fleet, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 300, "hash_ids": [0, 1]},
        {"timestamp": 100, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 200, "input_length": 512, "output_length": 5, "hash_ids": [3]},
        {"timestamp": 400, "input_length": 700},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    replay = (
        "--trace",
        str(trace),
        "--tokens-per-block",
        "16",
        "--output-scale",
        "0.1",
        "--max-tokens",
        "20",
    )
    common = ("--score-url", fake_fleet.score_url, "--api-key", API_KEY, "--model", "m", "--no-progress")
    out = run_command(
        *pods, *common, *replay, "--router", "round-robin", "--json-out", str(tmp_path / "own.json")
    )

    received = [body for pod in fake_fleet.pods.values() for body in pod.received]
    assert len(received) == 4
    assert sorted(body["max_tokens"] for body in received) == [1, 10, 20, 20]  # 300, 100, 5 x 0.1, cap 20
    builder = PromptBuilder(TraceSpec(str(trace), tokens_per_block=16))
    expected = {builder.prompt(request) for request in load_trace(trace)}
    assert {body["messages"][0]["content"] for body in received} == expected
    run = json.loads((tmp_path / "own.json").read_text())["runs"][0]
    assert run["qps"] == pytest.approx(7.5)  # 3 gaps over 0.4 s: the trace's own rate
    assert run["ok"] == 4 and run["prefix_reuse_est"] > 0
    assert "trace " in out and "replayed at its own pace" in out

    # Rescaled to 30 qps (4x): the last request goes at 0.1 s instead of 0.4 s; a window skips the first.
    for pod in fake_fleet.pods.values():
        pod.received.clear()
    run_command(
        *pods,
        *common,
        *replay,
        "--qps",
        "30",
        "--trace-start",
        "0.05",
        "--json-out",
        str(tmp_path / "fast.json"),
    )
    run = json.loads((tmp_path / "fast.json").read_text())["runs"][0]
    assert run["requests"] == 3 and run["qps"] == 30
    assert sum(len(pod.received) for pod in fake_fleet.pods.values()) == 3


def test_a_trace_replayed_with_its_ties_spread_sends_them_one_after_another(fake_fleet, tmp_path):
    trace = tmp_path / "trace.jsonl"
    stamps = [0, 400, 400, 400, 400]  # the last 4 over the only gap, 0.4 s: at 0.4, 0.5, 0.6, 0.7 s
    trace.write_text("".join(json.dumps({"timestamp": ms, "input_length": 100}) + "\n" for ms in stamps))
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    out = run_command(
        *pods, "--score-url", fake_fleet.score_url, "--api-key", API_KEY, "--model", "m", "--no-progress",
        "--router", "round-robin", "--trace", str(trace), "--spread-ties",
        "--json-out", str(tmp_path / "out.json"),
    )  # fmt: skip
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["params"]["trace"]["spread_ties"] is True
    (run,) = document["runs"]
    assert run["ok"] == 5 and run["qps"] == pytest.approx(4 / 0.7)  # its own pace, spread: 4 gaps, 0.7 s
    assert run["duration_s"] >= 0.7  # sent at 0.4 s together, they would be done ~0.15 s later
    assert "own rate 5.71 qps, replayed at its own pace, ties spread over the gap to the next" in out


def test_a_bad_trace_is_refused_before_anything_is_sent(fake_fleet, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10}\n{"timestamp": 1}\n')
    pods = [arg for name, url in fake_fleet.urls.items() for arg in ("--pod", f"{name}={url}")]
    with pytest.raises(CommandError, match=r"trace.jsonl:2: no 'input_length'"):
        run_command(*pods, "--trace", str(trace), "--no-progress")
    assert not any(pod.received for pod in fake_fleet.pods.values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no pods"),
        (("--pods-url", "http://127.0.0.1:8100"), "--pods-url needs --pods"),
        (("--pods", "2"), "--pods needs --pods-url"),
        (("--pod", "sim-0=http://127.0.0.1:1", "--router", "fastest"), "unknown router 'fastest'"),
        (("--pod", "sim-0=http://127.0.0.1:1", "--qps", "0"), "every QPS must be > 0"),
        (("--pod", "sim-0=http://127.0.0.1:1", "--groups", "0"), "groups must be at least 1"),
        (("--pod", "sim-0=http://127.0.0.1:1", "--qps", "inf", "--duration", "5"), "give --requests"),
        (("--pod", "sim-0=http://127.0.0.1:1", "--pod", "sim-0=http://127.0.0.1:2"), "given twice"),
    ],
)
def test_command_says_what_to_fix(args, message):
    with pytest.raises(CommandError, match=message):
        run_command(*args)


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_asked_to_stop_mid_run_it_says_so_and_exits_0(stop: int) -> None:
    """``make run`` stops the demo load with SIGTERM (Ctrl-C in a terminal is SIGINT): a clean end."""
    argv = [sys.executable, "manage.py", "loadgen", "--target", f"http://127.0.0.1:{free_port()}"]
    argv += ["--model", "m", "--qps", "2", "--duration", "600", "--no-progress"]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _catches(process.pid, signal.SIGTERM), timeout=60, what="loadgen's handlers")
        process.send_signal(stop)
        _, err = process.communicate(timeout=15)
    finally:
        process.kill()
    assert process.returncode == 0
    assert f"loadgen: {signal.Signals(stop).name}: stopped before the end of the run" in err
