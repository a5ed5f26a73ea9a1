"""``bench/routing.py``: its report (quantiles, target checks, table, plot) on known numbers, and
one short real run: Valkey, ingest, simulated pods, the gateway and a peer router as processes."""

from __future__ import annotations

import json
import math

import pytest

from bench import routing
from bench.dynamo import dynamo_installed
from bench.peers import peers_installed


def run(workload: str, router: str, qps: float, p90: float | None, tps: float = 100.0) -> dict:
    return {
        "workload": workload,
        "router": router,
        "qps": qps,
        "ok": 10,
        "failed": 0,
        "ttft_s": {"p50": p90 and p90 / 2, "p90": p90, "p99": p90 and 2 * p90},
        "e2e_s": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
        "output_tokens_per_s": tps,
        "fleet_hit_rate": 0.5,
        "overhead_p50_ms": None if ":" in router else 1.5,
    }


def test_verdicts_call_close_results_a_tie():
    assert routing.verdict(1.0, 1.2, lower_is_better=True) == "met"
    assert routing.verdict(1.02, 1.0, lower_is_better=True) == "tie"
    assert routing.verdict(1.2, 1.0, lower_is_better=True) == "missed"
    assert routing.verdict(99.0, 100.0, lower_is_better=False) == "tie"
    assert routing.verdict(90.0, 100.0, lower_is_better=False) == "missed"
    assert routing.verdict(1.0, math.inf, lower_is_better=True) == "met"


def test_targets_are_checked_at_the_highest_qps_kv_load_keeps_under_two_seconds():
    runs = [
        run("capacity", "kv-load", 4, 0.5),
        run("capacity", "kv-load", 8, 1.5, tps=300),
        run("capacity", "kv-load", 12, 6.0, tps=350),
        run("capacity", "random", 8, 20.0),
        run("capacity", "smg:cache_aware", 8, 6.0, tps=250),
        run("capacity", "vllm-router:cache_aware", 8, 3.0, tps=310),
        run("capacity", "vllm-router:cache_aware", 12, 5.0, tps=400),
        run("hot", "kv-load", 8, None),
        run("hot", "vllm-router:round_robin", 8, 9.0),
    ]
    lines = routing.check_targets(runs)
    assert lines[0].startswith("capacity @ 8 qps (highest")
    assert "random 20.000 s = 13.3x (target >= 10x: met)" in lines[0]
    # The best cache_aware peer is the one with the lower p90 (vllm-router: 3.0 s = 2x).
    assert "best cache_aware vllm-router:cache_aware 3.000 s = 2.0x (target >= 3x: missed)" in lines[0]
    assert (
        "capacity @ 8 qps: TTFT p90 kv-load 1.500 s, best peer vllm-router:cache_aware 3.000 s (met)"
        in lines[1]
    )
    assert "tok/s 300.0, best peer vllm-router:cache_aware 310.0 (missed)" in lines[1]
    assert "(missed); tok/s 350.0, best peer vllm-router:cache_aware 400.0 (missed)" in lines[2]
    # A workload where kv-load answered no streamed first token at all: its p90 is infinite.
    assert (
        "hot @ 8 qps: TTFT p90 kv-load inf s, best peer vllm-router:round_robin 9.000 s (missed)" in lines[3]
    )
    alone = routing.check_targets([run("restart", "kv-load", 4, 1.5)])
    assert alone == [
        "restart @ 4 qps (highest with kv-load TTFT p90 < 2 s): kv-load 1.500 s; random not run at 4 qps"
    ]
    never = routing.check_targets([run("restart", "kv-load", 4, 2.5)])
    assert never == ["restart: kv-load never keeps TTFT p90 under 2 s"]


def test_goodput_search_climbs_the_ladder_then_halves_the_gap():
    made = []

    def probe(qps: float) -> dict:
        made.append(qps)
        return run("conversation", "kv-load", qps, 1.0 if qps <= 5.3 else 3.0)

    runs = routing.search_goodput(probe, [2, 4, 8, 12], resolution=0.5)
    assert made == [2, 4, 8, 6, 5, 5.5]  # 12 is never run: 8 failed
    assert routing.goodput(runs, "conversation", "kv-load")[:1] == (5,)
    # Nothing passes: the search goes below the ladder; everything passes: goodput is at least its top.
    made.clear()
    routing.search_goodput(lambda q: probe(q + 10), [2, 4], resolution=0.5)
    assert made == [12, 11.0, 10.5]  # probe adds 10: the rates asked were 2, 1, 0.5
    assert routing.goodput([run("hot", "kv", 4, 1.0)], "hot", "kv") == (4, run("hot", "kv", 4, 1.0), False)


def test_a_failed_request_or_a_slower_lower_rate_caps_goodput():
    failed = run("hot", "kv", 8, 1.0)
    failed["failed"] = 1
    runs = [run("hot", "kv", 4, 1.0), failed, run("hot", "kv", 12, 1.0)]
    assert routing.goodput(runs, "hot", "kv")[0] == 4  # 12 passed, but 8 did not
    assert routing.goodput([run("hot", "kv", 4, 2.5)], "hot", "kv")[:2] == (0.0, None)


def test_goodput_leads_the_report_with_the_targets_of_issue_23():
    runs = [
        run("conversation", "kv-load", 4, 0.2, tps=400),
        run("conversation", "kv-load", 8, 0.5, tps=700),
        run("conversation", "kv-load", 10, 3.0),
        run("conversation", "smg:cache_aware", 4, 1.5, tps=380),
        run("conversation", "smg:cache_aware", 5, 3.0),
        run("conversation", "random", 4, 2.5),
        run("hot", "kv-load", 4, 0.2),
        run("hot", "smg:cache_aware", 4, 0.3),
    ]
    lines = routing.goodput_lines(runs)
    assert "| conversation | kv-load | 8 | 700.0 | 0.500 | 0.200 |" in lines
    assert "| conversation | smg:cache_aware | 4 | 380.0 | 1.500 | 1.500 |" in lines
    assert "| conversation | random | 0 | - | - | 2.500 |" in lines
    assert "| hot | kv-load | >= 4 | 100.0 | 0.200 | 0.200 |" in lines
    assert (
        "conversation: goodput kv-load 8 qps, best peer smg:cache_aware 4 qps = 2.00x (target >= 2x: met); "
        "at 4 qps TTFT p90 kv-load 0.200 s, smg:cache_aware 1.500 s (target <= 1/5: met)"
    ) in lines
    assert any(
        line.startswith("hot: goodput kv-load 4 qps") and "(target >= 1x: met)" in line for line in lines
    )

    made = []
    routing.at_best_peer(runs, "conversation", ["kv-load", "random", "kv"], lambda r, q: made.append((r, q)))
    assert made == [("kv", 4)]  # kv-load and random were run at 4 qps already


def test_trace_workloads_with_their_ties_spread_are_runs_of_their_own():
    conversation = routing.WORKLOADS["conversation"]
    spread = conversation.ties_spread()
    assert (spread.name, spread.trace.spread_ties, conversation.trace.spread_ties) == (
        "conversation-spread",
        True,
        False,
    )
    assert spread.trace.path == conversation.trace.path and spread.requests == conversation.requests
    # Kept apart from the trace's own arrivals in a report, with the same target as theirs.
    runs = [run(w, r, 4, 0.2) for w in ("conversation", "conversation-spread") for r in ("kv-load", "smg:x")]
    runs.append(run("conversation-spread", "kv-load", 8, 0.5))
    assert len(routing.merged([{"runs": runs}])) == 5
    assert any(
        line.startswith("conversation-spread: goodput kv-load 8 qps") and "(target >= 2x: met)" in line
        for line in routing.goodput_lines(runs)
    )
    assert routing.parse_args(["--spread-ties"]).spread_ties and not routing.parse_args([]).spread_ties
    with pytest.raises(SystemExit, match="--spread-ties spreads a trace's ties: choose a trace workload"):
        routing.run(routing.parse_args(["--workloads", "hot", "--routers", "kv-load", "--spread-ties"]))


def test_report_of_saved_results_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    saved = tmp_path / "a.json"
    saved.write_text(json.dumps({"runs": [run("hot", "kv-load", 4, 0.4), run("hot", "random", 4, 4.0)]}))
    peer = run("chat", "vllm-router:cache_aware", 4, 0.5)
    more = tmp_path / "b.json"
    again = run("hot", "random", 4, 4.0)  # measured again: replaces the first file's run
    again["ok"] = 11
    more.write_text(json.dumps({"runs": [run("chat", "kv-load", 4, 0.3), peer, again]}))
    runs = routing.main(["--report", str(saved), str(more), "--plot", str(tmp_path / "routing.png")])
    assert [(r["workload"], r["router"]) for r in runs] == [
        ("hot", "kv-load"),
        ("hot", "random"),
        ("chat", "kv-load"),
        ("chat", "vllm-router:cache_aware"),
    ]
    printed = capsys.readouterr().out
    assert (
        "| hot | random | 4 | 11 / 0 | 2.000 | 4.000 | 8.000 | - | - | 2.000 | 100.0 | 50.0% | 1.50 |"
        in printed
    )
    assert (
        "| chat | kv-load | 4 | 10 / 0 | 0.150 | 0.300 | 0.600 | - | - | 2.000 | 100.0 | 50.0% | 1.50 |"
        in printed
    )
    assert (
        "| chat | vllm-router:cache_aware | 4 | 10 / 0 | 0.250 | 0.500 | 1.000 | - | - | 2.000 | 100.0 "
        "| 50.0% | - |" in printed
    )
    assert (
        "chat @ 4 qps: TTFT p90 kv-load 0.300 s, best peer vllm-router:cache_aware 0.500 s (met)" in printed
    )
    assert (tmp_path / "routing.png").read_bytes().startswith(b"\x89PNG")


def test_every_run_starts_from_empty_caches():
    args = routing.parse_args(["--max-tokens", "4"])
    pods = {"sim-0": "http://127.0.0.1:8100", "sim-1": "http://127.0.0.1:8101"}
    urls = ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    config = routing.loadgen_config(pods, urls, "kv-load", routing.WORKLOADS["replicas"], args)
    assert config.reset_prefix_cache and config.settle > 0
    assert (config.target, config.replicas, config.label) == (urls[0], (urls[1],), "kv-load")
    assert config.pods == pods and config.max_tokens == 4


def test_a_short_real_run_routes_through_the_gateway_and_a_peer(tmp_path, capsys):
    routers = "kv-load" + (",smg:cache_aware" if peers_installed() else "")
    out = tmp_path / "routing.json"
    runs = routing.main(
        ["--workloads", "replicas,restart", "--routers", routers, "--qps", "4", "--duration", "2",
         "--pods", "2", "--max-tokens", "4", "--out", str(out), "--no-plot"]
    )  # fmt: skip
    names = [r.strip() for r in routers.split(",")]
    assert [(r["workload"], r["router"]) for r in runs] == [
        (w, r) for w in ("replicas", "restart") for r in names
    ]
    for summary in runs:
        assert summary["failed"] == 0 and summary["ok"] == summary["requests"] > 0
        assert summary["ttft_s"]["p90"] > 0 and summary["fleet_hit_rate"] is not None
        # Every request was served by one of the two pods, named in the response.
        assert set(summary["pod_requests"]) <= {"sim-0", "sim-1"} and summary["pod_unknown_requests"] == 0
        if summary["router"] == "kv-load":
            assert 0 < summary["overhead_p50_ms"] < 1000
        else:
            assert summary["overhead_p50_ms"] is None
    saved = json.loads(out.read_text())
    assert saved["fleet"]["pods"] == 2 and len(saved["runs"]) == len(runs)
    assert saved["workloads"]["replicas"]["replicas"] == 2


def test_a_trace_workload_is_replayed_whole_and_its_goodput_searched(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 100 * i, "input_length": 1024, "output_length": 40, "hash_ids": [0, i + 1]}
        for i in range(6)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setattr(routing, "TRACES", tmp_path)  # where trace workloads find their files
    tiny = routing.trace_workload(
        "tiny",
        "5 requests sharing a first block",
        trace.name,
        requests=5,
        tokens_per_block=32,
        output_scale=0.1,
    )
    monkeypatch.setitem(routing.WORKLOADS, "tiny", tiny)
    assert routing.WORKLOADS["tiny"].working_set_tokens() == 6 * 32  # block 0 and 5 others, 32 tokens each
    out = tmp_path / "routing.json"
    runs = routing.main(
        ["--workloads", "tiny", "--routers", "kv-load", "--goodput", "--qps", "20", "--pods", "2",
         "--out", str(out), "--no-plot"]
    )  # fmt: skip
    (summary,) = runs  # every request within 2 s at 20 qps: nothing more to search
    assert summary["requests"] == summary["ok"] == 5 and summary["qps"] == 20
    assert "| tiny | kv-load | >= 20 |" in capsys.readouterr().out
    # The shared first block is reused (prefix reuse of the workload itself).
    assert summary["prefix_reuse_est"] > 0


def test_a_gateway_router_names_its_policy_and_its_index():
    assert routing.gateway_of("kv-load") == ("kv-load", "shared")
    assert routing.gateway_of("kv-load@in-process") == ("kv-load", "in-process")
    assert routing.gateway_of("nope@in-process") is None
    assert routing.gateway_of("smg:cache_aware") is None
    with pytest.raises(SystemExit, match="unknown router 'nope@in-process'"):
        routing.run(routing.parse_args(["--workloads", "hot", "--routers", "nope@in-process"]))


def test_the_gateway_with_its_own_index_runs_in_front_of_the_same_pods(tmp_path):
    """``<policy>@in-process``: the same benchmark with the gateway subscribing to the pods' KV
    events itself (``--index in-process``), for its replicas too."""
    runs = routing.main(
        ["--workloads", "replicas", "--routers", "kv-load@in-process", "--qps", "4", "--duration", "2",
         "--pods", "2", "--max-tokens", "4", "--out", str(tmp_path / "routing.json"), "--no-plot"]
    )  # fmt: skip
    (summary,) = runs
    assert summary["router"] == "kv-load@in-process"
    assert summary["failed"] == 0 and summary["ok"] == summary["requests"] > 0
    assert set(summary["pod_requests"]) <= {"sim-0", "sim-1"}
    assert 0 < summary["overhead_p50_ms"] < 1000  # our gateway: its own time is read


@pytest.mark.skipif(not dynamo_installed(), reason="Dynamo is not installed: make bench-dynamo")
def test_dynamos_router_runs_in_front_of_the_same_pods_on_their_own_events(tmp_path):
    (summary,) = routing.main(
        ["--workloads", "hot", "--routers", "dynamo:kv", "--qps", "4", "--duration", "3", "--pods", "2",
         "--max-tokens", "4", "--out", str(tmp_path / "routing.json"), "--no-plot"]
    )  # fmt: skip
    assert (
        summary["router"] == "dynamo:kv"
        and summary["failed"] == 0
        and summary["ok"] == summary["requests"] > 0
    )
    # The pods were scraped (their hit rate is known); that Dynamo routes on their events is
    # tests/simulator/test_dynamo.py's to show.
    assert summary["fleet_hit_rate"] is not None
    assert summary["overhead_p50_ms"] is None  # not our gateway


def test_the_real_engine_fleet_has_workloads_and_a_ladder_of_its_own():
    args = routing.parse_args(["--fleet", "vllm"])

    assert args.workloads.split(",") == list(routing.VLLM_WORKLOADS)
    assert list(routing.VLLM_WORKLOADS) == ["vllm-capacity", "vllm-hot", "vllm-conversation"]
    assert (args.qps, args.max_tokens) == ("1,2", 16)
    assert args.out.name == "routing-vllm.json" and args.plot.name == "routing-vllm.png"  # not the sim's
    capacity = routing.VLLM_WORKLOADS["vllm-capacity"]
    assert 2.0 < capacity.working_set_tokens() / (2 * 256 * 32) < 2.5  # overflows the 2 engines' caches
    sim = routing.parse_args([])
    assert (sim.qps, sim.max_tokens, sim.out.name) == ("4,8,12", 64, "routing.json")


def test_a_pd_fleet_serves_in_two_steps_and_its_runs_are_named_apart(tmp_path, capsys):
    """``--fleet pd``: a prefill pod and a decode pod; the gateway serves every request in two
    steps (the decode pod answers, the prefill pod computed the prompt); the report names the
    runs ``<router>@pd``, apart from the aggregated fleet's."""
    out = tmp_path / "routing-pd.json"
    routers = "kv-load" + (",smg:cache_aware,vllm-router:round_robin" if peers_installed() else "")
    runs = routing.main(
        ["--fleet", "pd", "--prefill-pods", "1", "--workloads", "capacity", "--routers", routers,
         "--qps", "4", "--duration", "2", "--pods", "2", "--max-tokens", "4", "--out", str(out), "--no-plot"]
    )  # fmt: skip
    assert [r["router"] for r in runs] == [f"{r}@pd" for r in routers.split(",")]
    for summary in runs:  # the peers in their P/D modes too
        assert summary["failed"] == 0 and summary["ok"] == summary["requests"] > 0
        assert summary["pod_requests"].keys() == {"sim-1"}  # the decode pod answers every request
        assert summary["itl_s"]["p50"] > 0
    saved = json.loads(out.read_text())
    assert saved["fleet"]["prefill_pods"] == 1 and saved["runs"][0]["router"] == "kv-load"
    aggregated = {**saved, "fleet": {"pods": 2}, "runs": [{**saved["runs"][0], "qps": 4}]}
    assert {r["router"] for r in routing.merged([aggregated, saved])} >= {"kv-load", "kv-load@pd"}


class FakeStack:
    pod_urls = {"sim-0": "http://p:0", "sim-1": "http://d:1", "sim-2": "http://d:2"}

    def stop_gateways(self) -> None:
        pass


class FakePeer:
    url = "http://peer"

    def stop(self) -> None:
        pass


def test_in_front_of_a_p_d_fleet_a_peer_runs_in_its_p_d_mode(tmp_path, monkeypatch):
    """With the pods' roles, a peer gets the prefill pods on one side and every other pod on the
    other (as the gateway splits them); without, every pod as a worker."""
    started = []
    monkeypatch.setattr(
        routing, "start_pd_peer", lambda name, **kw: started.append(("pd", name, kw)) or FakePeer()
    )
    monkeypatch.setattr(
        routing, "start_peer", lambda name, **kw: started.append(("whole", name, kw)) or FakePeer()
    )

    with routing.Routers(FakeStack(), tmp_path, roles={"sim-0": "prefill"}).running(
        "smg:prefix_hash", 1
    ) as urls:
        assert urls == ["http://peer"]
    with routing.Routers(FakeStack(), tmp_path).running("vllm-router:cache_aware", 1):
        pass

    (mode, name, kw), (whole, other, whole_kw) = started
    assert (mode, name, kw["policy"]) == ("pd", "smg", "prefix_hash")
    assert (kw["prefill"], kw["decode"]) == (["http://p:0"], ["http://d:1", "http://d:2"])
    assert (whole, other, whole_kw["workers"]) == ("whole", "vllm-router", list(FakeStack.pod_urls.values()))
