"""Report math: percentiles, hit rates from metric deltas, the prefix-reuse estimate, the table, JSON."""

from __future__ import annotations

import json
import math

import pytest

from simulator.loadgen.report import (
    PrefixReuse,
    RequestRecord,
    StepResult,
    fleet_hit_rate,
    percentile,
    percentiles,
    render_table,
    results_document,
    summarize,
    write_json,
)

Q, H = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


def record(
    seq, *, pod="sim-0", ok=True, ttft=0.1, e2e=1.0, out=10, best=None, sent=0.0, done=1.0, error=None
):
    return RequestRecord(
        seq=seq, session=f"s{seq}", turn=0, pod=pod, ok=ok, error=error, ttft=ttft, e2e=e2e,
        output_tokens=out, prompt_tokens=100, cached_tokens=60, route_s=0.002, best_score=best,
        sent_at=sent, done_at=done,
    )  # fmt: skip


def test_percentile_interpolates_linearly_like_numpy():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(list(reversed(values)), 50) == pytest.approx(5.5)  # order does not matter
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert percentiles([1.0, 2.0], (50,)) == {"p50": 1.5}
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_fleet_hit_rate_is_the_ratio_of_counter_growth_over_pods_that_answered():
    before = {"a": {Q: 1000.0, H: 500.0}, "b": {Q: 0.0, H: 0.0}, "c": None, "d": {Q: 5.0, H: 5.0}}
    after = {"a": {Q: 1400.0, H: 800.0}, "b": {Q: 100.0, H: 20.0}, "c": {Q: 9e9, H: 9e9}, "d": None}
    rate, hits, queries, counted = fleet_hit_rate(before, after)
    assert (hits, queries, counted) == (320.0, 500.0, 2)
    assert rate == pytest.approx(0.64)
    assert fleet_hit_rate({"a": {Q: 1.0, H: 1.0}}, {"a": {Q: 1.0, H: 1.0}})[0] is None


def test_reuse_counts_the_longest_prefix_seen_before_including_answers():
    reuse = PrefixReuse(chunk=1)  # character by character
    system = "S" * 100
    assert reuse.observe(system + "Q1", " A1") == 0
    assert reuse.observe(system + "Q2", " A2") == 101  # shares the system prompt and "Q"
    assert reuse.observe(system + "Q1 A1 Q3", "") == 105  # the first prompt and its answer
    assert reuse.observe("other", "") == 0
    assert reuse.hit_chars == 206
    assert reuse.total_chars == 102 + 102 + 108 + 5
    assert reuse.rate == pytest.approx(206 / 317)
    assert PrefixReuse().rate is None


def test_reuse_counts_whole_chunks_only_like_kv_blocks():
    reuse = PrefixReuse(chunk=10)
    reuse.observe("a" * 25, "")
    assert reuse.observe("a" * 25 + "b", "") == 20  # two whole chunks; the partial third never counts
    assert reuse.observe("a" * 19, "") == 10
    assert reuse.observe("b" + "a" * 30, "") == 0  # a prefix, not any substring


def test_summary_of_a_run():
    records = [
        record(0, ttft=0.1, e2e=1.0, best=True, sent=0.0, done=1.0),
        record(1, pod="sim-1", ttft=0.3, e2e=2.0, best=False, sent=0.5, done=2.5),
        record(2, ok=False, ttft=None, e2e=0.1, out=0, error="HTTP 429: slow down", sent=1.0, done=1.1),
        record(3, ttft=0.2, e2e=1.5, best=None, sent=1.5, done=4.0),
    ]
    step = StepResult(
        router="kv", qps=4.0, records=records,
        metrics_before={"sim-0": {Q: 0.0, H: 0.0}, "sim-1": {Q: 0.0, H: 0.0}},
        metrics_after={"sim-0": {Q: 300.0, H: 150.0}, "sim-1": {Q: 100.0, H: 50.0}},
        score_calls=4, score_failures=1, fallbacks=1, reuse_hit_chars=50, reuse_total_chars=200,
    )  # fmt: skip
    s = summarize(step)
    assert (s["requests"], s["ok"], s["failed"]) == (4, 3, 1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["e2e_s"]["p90"] == pytest.approx(1.9)
    assert s["itl_s"]["p50"] == pytest.approx((1.5 - 0.2) / 9)  # of 0.9 / 9, 1.7 / 9 and 1.3 / 9
    assert s["duration_s"] == 4.0 and s["output_tokens"] == 30
    assert s["output_tokens_per_s"] == pytest.approx(7.5)
    assert s["fleet_hit_rate"] == pytest.approx(0.5)
    assert s["usage_hit_rate"] == pytest.approx(0.6)
    assert s["prefix_reuse_est"] == pytest.approx(0.25)
    assert s["best_score_share"] == 0.5 and s["best_score_requests"] == 2
    assert (s["score_calls"], s["score_failures"], s["score_fallbacks"]) == (4, 1, 1)
    assert s["pod_requests"] == {"sim-0": 3, "sim-1": 1}
    assert s["errors"] == {"HTTP 429: slow down": 1}
    assert s["route_ms"]["p50"] == pytest.approx(2.0)


def test_summary_of_an_empty_run_has_no_numbers():
    s = summarize(StepResult(router="random", qps=1.0, records=[], metrics_before={}, metrics_after={}))
    assert s["requests"] == 0 and s["ttft_s"]["p90"] is None and s["output_tokens_per_s"] is None
    assert s["fleet_hit_rate"] is None and s["best_score_share"] is None


def test_table_has_a_row_per_run_and_dashes_for_unknowns():
    rows = [
        summarize(StepResult(router="kv", qps=2.0, records=[record(0, best=True)], metrics_before={},
                             metrics_after={}, reuse_hit_chars=9, reuse_total_chars=10)),
        summarize(StepResult(router="random", qps=math.inf, records=[], metrics_before={}, metrics_after={})),
    ]  # fmt: skip
    table = render_table(rows).splitlines()
    assert len(table) == 4
    assert table[0].split()[:6] == ["router", "qps", "ok", "fail", "TTFT", "p50"]
    assert set(table[1]) == {"-"}
    kv_row, random_row = table[2].split(), table[3].split()
    assert kv_row[:5] == ["kv", "2", "1", "0", "0.100"]
    assert "90.0%" in kv_row and "100.0%" in kv_row  # prefix reuse, best pick
    assert random_row[:2] == ["random", "inf"] and random_row.count("-") >= 8
    assert len({len(line) for line in table}) == 1  # aligned columns


def test_json_results_are_strict_json(tmp_path):
    summary = summarize(StepResult(router="kv", qps=math.inf, records=[record(0)], metrics_before={},
                                   metrics_after={}))  # fmt: skip
    path = write_json(tmp_path / "sub" / "r.json", results_document([summary], {"qps": [math.inf, 2.0]}))
    document = json.loads(path.read_text())
    assert document["params"] == {"qps": ["inf", 2.0]}
    assert document["runs"][0]["qps"] == "inf" and document["runs"][0]["ok"] == 1
    assert {"host", "cores", "python", "date"} <= set(document["machine"])
