"""``--target``: one workload through a router in front of the fleet, here a real simulated fleet
behind a tiny proxy that says which pod served each request (``x-kvcache-pod``)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from django.core.management import CommandError, call_command

from simulator.loadgen.client import ServedBy
from simulator.loadgen.report import (
    RequestRecord,
    StepResult,
    pod_lines,
    predicted_cached_tokens,
    summarize,
)
from simulator.loadgen.runner import LoadgenConfig, parse_target, run_ladder, run_step
from simulator.loadgen.workload import WorkloadSpec
from tests.loadgen.conftest import API_KEY
from tests.loadgen.fake_fleet import Served
from tests.loadgen.target_servers import (
    BLOCK_SIZE,
    MODEL,
    ProxyBehaviour,
    SimulatedFleet,
    proxy_app,
    qwen_tokenizer,
)

# Two groups of three sessions: the second and third session of a group hit its system prompt.
SMALL = WorkloadSpec(groups=2, system_prompt_tokens=200, questions_per_group=3, seed=1)
Q, H = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[SimulatedFleet]:
    fleet = SimulatedFleet(qwen_tokenizer(), pods=2)
    yield fleet
    fleet.stop()


ProxyFactory = Callable[..., tuple[ProxyBehaviour, str]]


@pytest.fixture
def proxy(sim_fleet: SimulatedFleet) -> Iterator[ProxyFactory]:
    """``proxy(pod="sim-0", ...)`` -> (its behaviour, its URL): forwards to sim-0 of the fleet."""
    servers: list[Served] = []

    def start(**behaviour: object) -> tuple[ProxyBehaviour, str]:
        proxy = ProxyBehaviour(**{"upstream": sim_fleet.urls["sim-0"], "pod": "sim-0", **behaviour})
        servers.append(Served(proxy_app(proxy)))
        return proxy, servers[-1].url

    yield start
    for server in servers:
        server.stop()


def target_config(target: str, **overrides: object) -> LoadgenConfig:
    values = {
        "target": target,
        "model": MODEL,
        "max_tokens": 4,
        "observe_scores": False,  # no scoring service in these tests
        "reset_prefix_cache": True,  # the module's fleet: each run starts from empty caches
        "settle": 0.0,
        "workload": SMALL,
        "block_size": BLOCK_SIZE,
    }
    return LoadgenConfig(**{**values, **overrides})


def growth(step: StepResult, pod: str, sample: str) -> float:
    return step.metrics_after[pod][sample] - step.metrics_before[pod][sample]


# --- through a target ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_request_goes_through_the_target_and_the_header_names_the_pod(sim_fleet, proxy, chat, stream):
    proxied, url = proxy()
    config = target_config(url, pods=sim_fleet.urls, chat=chat, stream=stream)
    step = asyncio.run(run_step(config, qps=100, requests=6))
    summary = summarize(step)

    path = "/v1/chat/completions" if chat else "/v1/completions"
    assert proxied.forwarded == [(path, stream)] * 6
    assert summary["ok"] == 6 and summary["failed"] == 0, summary["errors"]
    assert summary["router"] == f"target:{url}" and summary["target"] == url
    assert summary["pod_source"] == "header"
    assert summary["pod_requests"] == {"sim-0": 6} and summary["pod_unknown_requests"] == 0
    # Streamed: TTFT measured; one JSON answer: no first token to time, so unknown.
    assert (summary["ttft_s"]["p50"] is not None) == stream
    assert summary["e2e_s"]["p50"] > 0 and summary["output_tokens"] == 6 * 4
    # The pods' /metrics still count through the target: sim-0 got every prompt token, sim-1 none.
    prompt_tokens = sum(r.prompt_tokens for r in step.records)
    cached_tokens = sum(r.cached_tokens for r in step.records)
    assert growth(step, "sim-0", Q) == prompt_tokens and growth(step, "sim-1", Q) == 0
    assert summary["metrics_pods"] == 2
    assert summary["fleet_prefix_queries"] == prompt_tokens
    assert summary["fleet_prefix_hits"] == cached_tokens > 0  # shared system prompts hit
    assert summary["fleet_hit_rate"] == pytest.approx(cached_tokens / prompt_tokens)
    assert summary["predicted_requests"] == 0 and summary["predicted_cached_tokens"] is None
    assert summary["notes"] == []


def test_without_the_header_or_the_pods_what_cannot_be_known_is_unknown(proxy):
    proxied, url = proxy(pod=None)
    config = target_config(url, label="peer")
    step = asyncio.run(run_step(config, qps=100, requests=4))
    summary = summarize(step)

    assert len(proxied.forwarded) == 4 and summary["ok"] == 4
    assert summary["router"] == "peer" and summary["target"] == url
    assert summary["pod_requests"] == {} and summary["pod_unknown_requests"] == 4
    assert all(r.pod is None for r in step.records)
    assert summary["fleet_hit_rate"] is None and summary["metrics_pods"] == 0
    assert summary["fleet_prefix_hits"] is None and summary["fleet_prefix_queries"] is None
    assert summary["usage_hit_rate"] is not None  # the responses' usage is still read
    assert summary["notes"] == ["no pods given: prefix caches not reset, fleet hit rate unknown"]
    assert pod_lines(summary) == ["pods: unknown 4"]


def test_predicted_cached_tokens_against_what_the_pods_report(sim_fleet, proxy):
    _, exact = proxy(predict=True)
    _, off_by_one = proxy(predict=True, predict_error=1)
    runs = {}
    for name, url in (("exact", exact), ("off", off_by_one)):
        config = target_config(url, pods=sim_fleet.urls, label=name)
        runs[name] = summarize(asyncio.run(run_step(config, qps=100, requests=6)))

    good, bad = runs["exact"], runs["off"]
    assert good["predicted_requests"] == 6
    assert good["predicted_cached_tokens"] == good["reported_cached_tokens"] > 0
    assert good["predicted_exact_share"] == 1.0
    assert bad["predicted_requests"] == 6
    assert bad["predicted_cached_tokens"] > bad["reported_cached_tokens"]
    assert bad["predicted_exact_share"] < 1.0
    lines = pod_lines(good)
    assert lines[0] == "pods: sim-0 6"
    assert lines[1].startswith(f"cached tokens: {good['predicted_cached_tokens']:,} predicted, ")
    assert lines[1].endswith("(100.0% of 6 requests exact)")


def test_best_pick_is_judged_against_the_pod_the_target_named(sim_fleet, proxy, fake_fleet):
    _, url = proxy()  # names sim-0; the scoring API says sim-1 holds more (5 vs 2)
    config = target_config(
        url, pods=sim_fleet.urls, observe_scores=True, score_url=fake_fleet.score_url, api_key=API_KEY
    )
    summary = summarize(asyncio.run(run_step(config, qps=100, requests=4)))
    assert summary["score_calls"] == 4 and summary["score_failures"] == 0
    assert summary["best_score_share"] == 0.0 and summary["best_score_requests"] == 4
    assert all(q["pods"] == ["sim-0", "sim-1"] for q in fake_fleet.scoring.received)

    config = target_config(url, pods=sim_fleet.urls, observe_scores=True, score_url=fake_fleet.score_url)
    summary = summarize(asyncio.run(run_step(config, qps=100, requests=2)))
    assert summary["ok"] == 2 and summary["score_failures"] == 2 and summary["best_score_share"] is None
    assert summary["notes"] == ["last score error: HTTP 401: this endpoint needs an API key"]


def test_target_errors_are_failed_requests_with_the_pod_still_named(sim_fleet, proxy):
    _, url = proxy()
    config = target_config(url, pods=sim_fleet.urls, model="no-such-model")
    summary = summarize(asyncio.run(run_step(config, qps=100, requests=2)))
    assert summary["ok"] == 0 and summary["failed"] == 2
    assert summary["pod_requests"] == {"sim-0": 2}
    assert list(summary["errors"]) and all(e.startswith("HTTP 404") for e in summary["errors"])


def test_a_ladder_through_a_target_runs_once_per_qps_and_takes_no_routers(proxy):
    _, url = proxy()
    config = target_config(url, label="gateway")
    steps = asyncio.run(run_ladder(config, qps=[50.0, 100.0], requests=2))
    assert [(s.router, s.qps, len(s.records)) for s in steps] == [("gateway", 50.0, 2), ("gateway", 100.0, 2)]
    with pytest.raises(ValueError, match="a target routes by itself"):
        asyncio.run(run_ladder(config, routers=["kv"], qps=[1.0], requests=1))
    with pytest.raises(ValueError, match="not both"):
        asyncio.run(run_step(config, router="kv", qps=1.0, requests=1))


# --- the command ---------------------------------------------------------------------------------


def run_command(*args: str) -> str:
    out = io.StringIO()
    call_command("loadgen", *args, stdout=out)
    return out.getvalue()


def test_command_with_a_target_and_a_label(sim_fleet, proxy, tmp_path):
    proxied, url = proxy()
    pods = [arg for name, pod_url in sim_fleet.urls.items() for arg in ("--pod", f"{name}={pod_url}")]
    out = run_command(
        "--target", f"{url}/", "--label", "our-gateway", *pods, "--completions",
        "--qps", "100", "--requests", "4", "--groups", "2", "--system-prompt-tokens", "100",
        "--questions-per-group", "2", "--model", MODEL, "--max-tokens", "4", "--settle", "0",
        "--no-observe-scores", "--no-progress", "--json-out", str(tmp_path / "out.json"),
    )  # fmt: skip
    lines = out.splitlines()
    assert lines[2].split()[:4] == ["our-gateway", "100", "4", "0"]
    assert "our-gateway @ 100 qps: pods: sim-0 4" in lines
    assert proxied.forwarded == [("/v1/completions", True)] * 4
    document = json.loads((tmp_path / "out.json").read_text())
    run = document["runs"][0]
    assert (run["router"], run["target"], run["pod_source"]) == ("our-gateway", url, "header")
    assert run["pod_requests"] == {"sim-0": 4} and run["metrics_pods"] == 2
    params = document["params"]
    assert params["routers"] == ["our-gateway"]
    assert (params["target"], params["label"], params["stream"]) == (url, "our-gateway", True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--target", "http://127.0.0.1:1", "--router", "kv"), "--target sends every request to URL"),
        (("--pod", "sim-0=http://127.0.0.1:1", "--label", "x"), "--label names the runs of a --target"),
        (("--target", "http://127.0.0.1:1/v1"), "without /v1"),
        (("--target", "127.0.0.1:8200"), "expected an http"),
        ((), "or --target URL"),
    ],
)
def test_command_refuses_a_target_with_a_router_and_says_what_to_fix(args, message):
    with pytest.raises(CommandError, match=message):
        run_command(*args)


# --- the pure parts ------------------------------------------------------------------------------


def test_parse_target_keeps_a_base_url():
    assert parse_target(" http://127.0.0.1:8200/ ") == "http://127.0.0.1:8200"
    assert parse_target("https://gw.example/kv") == "https://gw.example/kv"
    for bad in ("127.0.0.1:8200", "ftp://x", "http://x/v1", "http://x/v1/completions", "http://x?a=1"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_a_target_config_needs_no_pods_and_names_its_runs():
    config = LoadgenConfig(target="http://127.0.0.1:8200/", chat=False)
    assert config.target == "http://127.0.0.1:8200"
    assert config.endpoint() == "http://127.0.0.1:8200/v1/completions"
    assert config.target_name == "target:http://127.0.0.1:8200"
    assert LoadgenConfig(target="http://g:1", label="gw").target_name == "gw"
    assert LoadgenConfig(pods={"sim-0": "http://p:1"}).target_name is None
    with pytest.raises(ValueError, match="label"):
        LoadgenConfig(pods={"sim-0": "http://p:1"}, label="gw")
    with pytest.raises(ValueError, match="label"):
        LoadgenConfig(target="http://g:1", label=" ")
    described = LoadgenConfig(target="http://g:1", label="gw").describe()
    assert (described["target"], described["label"], described["pods"]) == ("http://g:1", "gw", {})


def test_served_by_reads_the_routers_headers():
    headers = httpx.Headers({"X-KVCache-Pod": "sim-2", "x-kvcache-matched-blocks": "7"})
    assert ServedBy.from_headers(headers) == ServedBy(pod="sim-2", matched_blocks=7)
    assert ServedBy.from_headers(httpx.Headers()) == ServedBy()
    garbled = httpx.Headers({"x-kvcache-pod": " ", "x-kvcache-matched-blocks": "-1"})
    assert ServedBy.from_headers(garbled) == ServedBy()
    # A peer router passes the simulated pod's own header through; ours wins when both are there.
    assert ServedBy.from_headers(httpx.Headers({"X-Simulated-Pod": "sim-4"})) == ServedBy(pod="sim-4")
    both = httpx.Headers({"x-kvcache-pod": "sim-1", "x-simulated-pod": "sim-4"})
    assert ServedBy.from_headers(both).pod == "sim-1"


def test_predicted_cached_tokens_follow_vllm():
    assert predicted_cached_tokens(matched_blocks=3, block_size=16, prompt_tokens=100) == 48
    assert predicted_cached_tokens(matched_blocks=0, block_size=16, prompt_tokens=100) == 0
    # vLLM computes at least one prompt token: a fully cached 64-token prompt reports 48.
    assert predicted_cached_tokens(matched_blocks=4, block_size=16, prompt_tokens=64) == 48
    assert predicted_cached_tokens(matched_blocks=9, block_size=16, prompt_tokens=70) == 64
    assert predicted_cached_tokens(matched_blocks=1, block_size=16, prompt_tokens=1) == 0


def test_a_router_run_summary_keeps_its_shape():
    record = RequestRecord(
        seq=0, session="s", turn=0, pod="sim-0", ok=True, error=None, ttft=0.1, e2e=0.2,
        output_tokens=4, prompt_tokens=10, cached_tokens=0, route_s=0.0, best_score=None,
        sent_at=0.0, done_at=0.2,
    )  # fmt: skip
    step = StepResult(router="kv", qps=1.0, records=[record], metrics_before={}, metrics_after={})
    summary = summarize(step)
    assert summary["target"] is None and summary["pod_source"] == "router"
    assert summary["pod_requests"] == {"sim-0": 1} and summary["pod_unknown_requests"] == 0
    assert pod_lines(summary) == []


def test_replicas_of_a_target_take_requests_in_turn():
    config = LoadgenConfig(target="http://g:1", replicas=("http://g:2/",), chat=False)
    assert config.replicas == ("http://g:2",)
    assert [config.endpoint(seq=i) for i in range(3)] == [
        "http://g:1/v1/completions",
        "http://g:2/v1/completions",
        "http://g:1/v1/completions",
    ]
    with pytest.raises(ValueError, match="replicas"):
        LoadgenConfig(pods={"sim-0": "http://p:1"}, replicas=("http://g:2",))
    with pytest.raises(ValueError):
        LoadgenConfig(target="http://g:1", replicas=("http://g:2/v1",))


def test_the_target_gets_the_api_key(proxy):
    """Our gateway takes the scoring API's keys: with one, loadgen sends it to the target too."""
    behaviour, url = proxy()
    asyncio.run(
        run_step(
            target_config(url, api_key=API_KEY, workload=WorkloadSpec(groups=1, questions_per_group=1)),
            qps=50,
        )
    )
    assert behaviour.authorization and set(behaviour.authorization) == {f"Bearer {API_KEY}"}
