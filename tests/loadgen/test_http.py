"""The load generator against real HTTP servers (uvicorn on loopback): streaming, timing,
scores, /metrics deltas, failures, multi-turn history."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from simulator.loadgen.client import fetch_scores, stream_completion
from simulator.loadgen.report import summarize
from simulator.loadgen.routers import ScoreUnavailable
from simulator.loadgen.runner import LoadgenConfig, run_step
from simulator.loadgen.workload import WorkloadSpec
from tests.loadgen.conftest import API_KEY

SMALL = WorkloadSpec(groups=2, system_prompt_tokens=200, questions_per_group=3, seed=1)


def config_for(fleet, **overrides) -> LoadgenConfig:
    values = {
        "pods": fleet.urls,
        "model": "m",
        "max_tokens": 4,
        "score_url": fleet.score_url,
        "api_key": API_KEY,
        "settle": 0.0,
        "workload": SMALL,
        "seed": 3,
    }
    return LoadgenConfig(**{**values, **overrides})


def test_stream_completion_measures_ttft_and_e2e(fake_fleet):
    pod = fake_fleet.pods["sim-0"]
    pod.first_token_delay, pod.token_delay = 0.2, 0.05
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await stream_completion(client, f"{fake_fleet.urls['sim-0']}/v1/chat/completions", body)

    completion = asyncio.run(go())
    assert completion.ok, completion.error
    assert completion.text == "Hello world ✓"
    # The role chunk comes at once; TTFT waits for the first text chunk.
    assert 0.2 <= completion.ttft < 0.6
    # Three more tokens, 50 ms apart, each received a little late or early (a CI run saw 149.6 ms).
    assert completion.e2e >= completion.ttft + 3 * 0.05 - 0.01
    assert completion.e2e < completion.ttft + 0.6
    assert (completion.output_tokens, completion.prompt_tokens, completion.cached_tokens) == (4, 40, 30)


def test_kv_run_routes_to_the_best_pod_and_reports_hit_rate_from_metrics_deltas(fake_fleet):
    config = config_for(fake_fleet, reset_prefix_cache=True)
    step = asyncio.run(run_step(config, router="kv", qps=50, requests=6))
    summary = summarize(step)

    assert summary["ok"] == 6 and summary["failed"] == 0
    assert summary["pod_requests"] == {"sim-1": 6}
    assert summary["best_score_share"] == 1.0 and summary["best_score_requests"] == 6
    # Counters started at 1000/5000; each request adds 30 hits / 40 queries on sim-1 only.
    assert summary["fleet_prefix_hits"] == 6 * 30 and summary["fleet_prefix_queries"] == 6 * 40
    assert summary["fleet_hit_rate"] == pytest.approx(0.75)
    assert summary["metrics_pods"] == 2
    assert summary["usage_hit_rate"] == pytest.approx(0.75)
    assert 0.1 <= summary["ttft_s"]["p50"] < 0.5
    assert summary["e2e_s"]["p50"] >= summary["ttft_s"]["p50"] + 3 * 0.01
    assert summary["output_tokens"] == 6 * 4 and summary["output_tokens_per_s"] > 0
    # Every request was scored once, with the API key, the chat messages and our pods.
    assert summary["score_calls"] == 6 and summary["score_fallbacks"] == 0
    sent = fake_fleet.scoring.received
    assert len(sent) == 6
    assert all(q["model"] == "m" and q["pods"] == ["sim-0", "sim-1"] and "messages" in q for q in sent)
    assert fake_fleet.pods["sim-1"].received[0]["messages"] == sent[0]["messages"]
    assert all(pod.resets == 1 for pod in fake_fleet.pods.values())
    assert summary["notes"] == []


def test_prefix_caches_are_kept_unless_a_reset_is_asked_for(fake_fleet):
    step = asyncio.run(run_step(config_for(fake_fleet), router="kv", qps=50, requests=2))
    assert all(pod.resets == 0 for pod in fake_fleet.pods.values())
    assert summarize(step)["notes"] == [
        "prefix caches not reset: the hit rate counts what the pods held before the run"
    ]


def test_other_routers_are_judged_against_the_scores_too(fake_fleet):
    step = asyncio.run(run_step(config_for(fake_fleet), router="round-robin", qps=50, requests=6))
    summary = summarize(step)
    assert summary["pod_requests"] == {"sim-0": 3, "sim-1": 3}
    assert summary["best_score_share"] == 0.5
    assert summary["fleet_hit_rate"] == pytest.approx(0.75)  # both pods add 30/40 per request


def test_score_failures_fall_back_to_least_loaded_and_are_counted(fake_fleet):
    config = config_for(fake_fleet, api_key="wrong", chat=False)
    step = asyncio.run(run_step(config, router="kv", qps=50, requests=4))
    summary = summarize(step)
    assert summary["ok"] == 4
    assert summary["score_fallbacks"] == 4 and summary["score_failures"] == 4
    assert summary["best_score_share"] is None
    assert any("HTTP 401: this endpoint needs an API key" in note for note in summary["notes"])
    # Completions mode: a prompt, not messages, went to the pods.
    bodies = [b for pod in fake_fleet.pods.values() for b in pod.received]
    assert len(bodies) == 4 and all("prompt" in b and "messages" not in b for b in bodies)


def test_pod_errors_are_failed_requests_with_the_openai_message(fake_fleet):
    fake_fleet.pods["sim-1"].fail_status = 429
    step = asyncio.run(run_step(config_for(fake_fleet), router="kv", qps=50, requests=3))
    summary = summarize(step)
    assert summary["ok"] == 0 and summary["failed"] == 3
    assert summary["errors"] == {"HTTP 429: Too many requests, slow down.": 3}
    assert summary["ttft_s"]["p50"] is None and summary["fleet_hit_rate"] is None


def test_fetch_scores_reads_the_score_answer(fake_fleet):
    async def go(key):
        async with httpx.AsyncClient(trust_env=False) as client:
            return await fetch_scores(
                client, fake_fleet.score_url, {"model": "m", "prompt": "x"}, api_key=key
            )

    scores = asyncio.run(go(API_KEY))
    assert scores.blocks == 10 and scores.by_pod == {"sim-0": 2.0, "sim-1": 5.0}
    with pytest.raises(ScoreUnavailable, match="401"):
        asyncio.run(go(None))


def test_multi_turn_sends_the_previous_answer_back(fake_fleet):
    spec = WorkloadSpec(groups=1, system_prompt_tokens=50, questions_per_group=2, turns=3, seed=2)
    config = config_for(fake_fleet, workload=spec)
    step = asyncio.run(run_step(config, router="kv", qps=100, requests=6))
    assert all(r.ok for r in step.records)
    bodies = fake_fleet.pods["sim-1"].received
    by_length = sorted(bodies, key=lambda b: len(b["messages"]))
    assert [len(b["messages"]) for b in by_length] == [2, 2, 4, 4, 6, 6]
    for body in by_length[2:]:
        assert body["messages"][2] == {"role": "assistant", "content": "Hello world ✓"}
    # Each turn extends an earlier one of its session: its messages minus the last exchange.
    for body in by_length[2:]:
        assert any(body["messages"][:-2] == earlier["messages"] for earlier in bodies)
    summary = summarize(step)
    assert summary["prefix_reuse_est"] > 0.5
