"""``manage.py loadgen`` end to end against the fake fleet."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command

from tests.loadgen.conftest import API_KEY


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
