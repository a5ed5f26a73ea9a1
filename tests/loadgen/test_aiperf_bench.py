"""``bench/aiperf.py``: the trace window it hands aiperf (scaled lengths, arrival times), the hub
cache that lets aiperf load our tokenizer offline, its reading of aiperf's export, and, when
``make bench-aiperf`` has installed aiperf, one short real run through the gateway on a trace the
test writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import aiperf, routing
from simulator.loadgen.trace import TraceSpec

needs_aiperf = pytest.mark.skipif(
    not aiperf.aiperf_installed(), reason="aiperf is not installed: run `make bench-aiperf`"
)


def line(timestamp: float, input_length: int, hash_ids: list[int], output_length: int = 64) -> dict:
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- the window ----------------------------------------------------------------------------


def test_input_lengths_scale_as_loadgens_and_keep_the_last_block_partial():
    # Mooncake's first request: 14 ids of 512 tokens, 6,758 tokens -> 211 of 14 x 16.
    assert aiperf.scaled_input_length(6758, 14, tokens_per_block=16, block_size=512) == 211
    # Whole blocks stay whole; a sliver of a last block still gets one token of its own.
    assert aiperf.scaled_input_length(1024, 2, tokens_per_block=16, block_size=512) == 32
    assert aiperf.scaled_input_length(513, 2, tokens_per_block=16, block_size=512) == 17
    # A line whose length and ids disagree is brought inside what aiperf accepts for its ids.
    assert aiperf.scaled_input_length(100, 3, tokens_per_block=16, block_size=512) == 33
    assert aiperf.scaled_input_length(5000, 1, tokens_per_block=16, block_size=512) == 16
    assert aiperf.scaled_input_length(40, 0, tokens_per_block=16, block_size=512) == 1


def test_the_window_is_loadgens_requests_at_loadgens_times(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            line(2000, 1100, [1, 2, 3], 500),
            line(0, 6758, list(range(14)), 3),
            line(1000, 600, [1, 2]),
            {"timestamp": 4000, "prompt": "a prompt of its own"},  # loadgen's own format
            line(8000, 512, [9]),
        ],
    )
    spec = TraceSpec(str(path), tokens_per_block=16, output_scale=0.2, max_output_tokens=64)
    lines = aiperf.replay_window(spec, requests=4, qps=0.5, max_tokens=7)
    # 4 gaps over 8 s (0.5 requests/s) at 0.5 requests/s: the trace's own times, the fifth not sent.
    assert lines == [
        {"timestamp": 0.0, "input_length": 211, "hash_ids": list(range(14)), "output_length": 1},
        {"timestamp": 1000.0, "input_length": 19, "hash_ids": [1, 2], "output_length": 13},
        {"timestamp": 2000.0, "input_length": 34, "hash_ids": [1, 2, 3], "output_length": 64},
        {"timestamp": 4000.0, "text_input": "a prompt of its own", "output_length": 7},
    ]
    # At 2 requests/s every gap of the whole window is a quarter, as loadgen's arrivals are.
    faster = aiperf.replay_window(spec, requests=3, qps=2.0)
    assert [x["timestamp"] for x in faster] == [0.0, 250.0, 500.0]
    later = aiperf.replay_window(TraceSpec(str(path), start=1.5), requests=10, qps=None)
    assert [x["timestamp"] for x in later] == [0.0, 2000.0, 6000.0]


def test_the_window_has_its_ties_spread_as_loadgen_spreads_them_when_told(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl", [line(0, 512, [1]), line(0, 512, [2]), line(0, 512, [3]), line(900, 512, [4])]
    )
    plain = aiperf.parse_args(["--trace", str(path), "--qps", "trace"])
    spread = aiperf.parse_args(["--trace", str(path), "--qps", "trace", "--spread-ties"])
    assert not plain.spec.spread_ties and spread.spec.spread_ties
    assert [x["timestamp"] for x in aiperf.replay_window(plain.spec, requests=4, qps=None)] == [0, 0, 0, 900]
    times = [x["timestamp"] for x in aiperf.replay_window(spread.spec, requests=4, qps=None)]
    assert times == [0.0, 300.0, 600.0, 900.0]


def test_an_id_that_is_whole_in_one_request_and_partial_in_another_is_refused_before_aiperf():
    shared = [line(0, 32, [1, 2]), line(10, 40, [1, 2, 3]), line(20, 20, [1, 4])]
    aiperf.check_block_sizes(shared, 16)  # 2 is whole in both; 3 and 4 are partial once each
    with pytest.raises(ValueError, match=r"hash id 2 is 16 tokens in one request and 4 in another"):
        aiperf.check_block_sizes([*shared, line(30, 20, [1, 2])], 16)


def test_the_window_is_described_by_its_blocks_and_reuse():
    records = [line(0, 100, [1, 2, 3]), line(1000, 100, [1, 2, 4]), line(3000, 10, [5])]
    described = aiperf.describe_window(records, fleet_blocks=10)
    assert described["requests"] == 3 and described["span_s"] == 3.0
    assert described["distinct_blocks"] == 5 and described["working_set_x_fleet_cache"] == 0.5
    assert described["ideal_reuse"] == round(2 / 7, 4)  # ids 1 and 2 again, of 7 blocks


# -- aiperf --------------------------------------------------------------------------------


def test_the_tokenizer_files_are_laid_out_as_a_hub_cache_aiperf_can_load_offline(tmp_path):
    files = tmp_path / "tokenizer_files"
    files.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (files / name).write_text("{}")
    hub = aiperf.hub_cache(files, "Qwen/Qwen3-0.6B", tmp_path / "hub")
    repo = hub / "models--Qwen--Qwen3-0.6B"
    assert (repo / "refs" / "main").read_text() == aiperf.SNAPSHOT
    snapshot = repo / "snapshots" / aiperf.SNAPSHOT
    assert sorted(p.name for p in snapshot.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert (snapshot / "tokenizer.json").resolve() == (files / "tokenizer.json").resolve()
    assert aiperf.hub_cache(files, "Qwen/Qwen3-0.6B", tmp_path / "hub") == hub  # again: no error
    env = aiperf.aiperf_env(hub)
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == str(hub)


def test_aiperf_is_asked_for_a_streamed_trace_replay_at_the_scaled_block_size(tmp_path):
    command = aiperf.aiperf_command(
        tmp_path / "venv", url="http://127.0.0.1:9", trace=tmp_path / "w.jsonl", artifacts=tmp_path / "a",
        tokens_per_block=16,
    )  # fmt: skip
    assert command[:2] == [str(tmp_path / "venv" / "bin" / "aiperf"), "profile"]
    flags = " ".join(command)
    for expected in (
        "--custom-dataset-type mooncake_trace",
        f"--input-file {tmp_path / 'w.jsonl'}",
        "--isl-block-size 16",
        "--endpoint-type chat --streaming",
        "--tokenizer Qwen/Qwen3-0.6B",  # the hub cache's name, not a path: see the module docstring
        "--extra-inputs ignore_eos:true",
        "--use-server-token-count",
        "--url http://127.0.0.1:9",
    ):
        assert expected in flags


EXPORT = {
    "aiperf_version": "0.13.0",
    "request_count": {"unit": "requests", "avg": 18.0},
    "error_request_count": {"unit": "requests", "avg": 2.0},
    "time_to_first_token": {"unit": "ms", "avg": 88.7, "p50": 69.49, "p90": 123.72, "p99": 287.23},
    "request_latency": {"unit": "ms", "avg": 291.4, "p50": 304.55, "p90": 411.45, "p99": 428.0},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 71.24},
    "request_throughput": {"unit": "requests/sec", "avg": 5.23},
    "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 97.75},
    "benchmark_duration": {"unit": "sec", "avg": 3.44},
    "replay_sched_lag_p90": {"unit": "ms", "avg": 7.7356},
    "error_summary": [
        {"error_details": {"type": "InvalidInferenceResultError", "message": "no content"}, "count": 2}
    ],
    "is_complete": True,
    "was_cancelled": False,
}
"""The shape of aiperf 0.13.0's ``profile_export_aiperf.json`` (the numbers of a real run, cut)."""


def test_aiperfs_export_is_read_in_seconds_with_its_failures_by_type():
    summary = aiperf.parse_export(EXPORT)
    assert (summary["ok"], summary["failed"]) == (18, 2)
    assert summary["errors"] == {"InvalidInferenceResultError": 2}
    assert summary["ttft_s"] == {"p50": 0.0695, "p90": 0.1237, "p99": 0.2872}
    assert summary["e2e_s"]["p90"] == 0.4114
    assert summary["output_tokens_per_s"] == 71.24 and summary["usage_cached_prompt_share"] == 0.9775
    assert summary["schedule_lag_p90_ms"] == 7.74 and summary["complete"]
    empty = aiperf.parse_export({"request_count": {"avg": 0.0}})  # nothing answered: no percentiles
    assert empty["ttft_s"] == {"p50": None, "p90": None, "p99": None} and empty["errors"] == {}


def test_the_table_has_a_row_per_client_and_router_with_its_errors():
    summary = {
        "client": "aiperf",
        "router": "kv-load",
        **aiperf.parse_export(EXPORT),
        "fleet_hit_rate": 0.5,
        "overhead_p50_ms": 4.2,
    }
    table = aiperf.markdown_table([summary])
    assert "| aiperf | kv-load | 18 / 2 (InvalidInferenceResultError 2) | 0.070 | 0.124 | 0.287 |" in table
    assert table.endswith("| 71.2 | 50.0% | 4.20 | 7.7 |")
    assert "hit 50.0%" in aiperf.row(summary) and "lag p90 7.7 ms" in aiperf.row(summary)


def test_the_window_is_a_routing_trace_workload_unless_told_otherwise(tmp_path):
    args = aiperf.parse_args([])
    assert args.qps == 8.0 and args.requests == 600 and args.spec == routing.WORKLOADS["conversation"].trace
    assert aiperf.parse_qps("trace") is None and aiperf.parse_args(["--qps", "trace"]).qps is None
    mine = aiperf.parse_args(
        ["--workload", "synthetic", "--trace", str(tmp_path / "t.jsonl"), "--start", "9"]
    )
    assert (mine.spec.path, mine.spec.start) == (str(tmp_path / "t.jsonl"), 9.0)
    assert mine.spec.output_scale == routing.WORKLOADS["synthetic"].trace.output_scale


# -- a real run ----------------------------------------------------------------------------


@needs_aiperf
@pytest.mark.slow
def test_aiperf_replays_a_small_trace_through_the_gateway_offline(tmp_path, capsys):
    # 12 requests (aiperf decodes 10 or more in worker processes, which force offline mode):
    # 3 conversations of 4 turns, each turn one more full block of the conversation, then a last,
    # partial block of its own (as in Mooncake's traces: aiperf wants one size per id).
    records = []
    for turn in range(4):
        for conversation in range(3):
            ids = [100 * conversation + block for block in range(turn + 1)] + [
                1000 + 10 * turn + conversation
            ]
            records.append(line(1000 * turn + 10 * conversation, 512 * len(ids) - 100, ids, 32))
    trace = write_trace(tmp_path / "small.jsonl", records)
    out = tmp_path / "aiperf.json"
    document = aiperf.main(
        ["--trace", str(trace), "--requests", "12", "--qps", "6", "--routers", "kv-load", "--pods", "2",
         "--out", str(out), "--keep-window", str(tmp_path)]
    )  # fmt: skip
    ours, theirs = document["runs"]
    assert (ours["client"], theirs["client"]) == ("aiperf", "loadgen")
    assert ours["router"] == "kv-load" and ours["complete"]
    for summary in (ours, theirs):
        assert (summary["ok"], summary["failed"]) == (12, 0), summary["errors"]
        assert summary["ttft_s"]["p90"] > 0 and summary["output_tokens_per_s"] > 0
        # Later turns re-send earlier turns' blocks: the pods served some of them from their caches.
        assert summary["fleet_hit_rate"] > 0 and summary["usage_cached_prompt_share"] > 0
        assert 0 < summary["overhead_p50_ms"] < 1000
    assert json.loads(out.read_text())["runs"][0]["ok"] == 12
    kept = [json.loads(x) for x in (tmp_path / "aiperf-window.jsonl").read_text().splitlines()]
    assert [x["input_length"] for x in kept[:3]] == [29, 29, 29]  # 2 ids: 924 tokens / 32
    assert [x["output_length"] for x in kept[:3]] == [6, 6, 6]  # 32 x the workload's 0.2
    printed = capsys.readouterr().out
    assert "| aiperf | kv-load | 12 / 0 |" in printed and "| loadgen | kv-load | 12 / 0 |" in printed
