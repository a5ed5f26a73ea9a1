"""The gateways' view: a gateway's real ``/metrics`` text read as counters, histogram quantiles,
recent numbers from the scrapes of a window, and a gateway that cannot be read shown as such;
the selector that scrapes them over real HTTP."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from dashboard import selectors
from dashboard.gateways import Buckets, GatewayScrape, gateway_row, gateway_traffic, parse_gateway_metrics
from tests.dashboard.conftest import fresh_gateway_metrics, unreachable_url

URL = "http://gateway.test:8200"


def route_some(metrics) -> None:
    """What a kv-load gateway counts for 12 requests: 10 answered by two pods (5 of them prefix
    hits, one client gone), 2 that no pod answered after 4 retries; the index failing twice."""
    metrics.REQUESTS.labels("kv-load", "sim-0", "ok").inc(6)
    metrics.REQUESTS.labels("kv-load", "sim-1", "ok").inc(3)
    metrics.REQUESTS.labels("kv-load", "sim-1", "client_gone").inc(1)
    metrics.REQUESTS.labels("kv-load", "", "upstream_error").inc(2)
    metrics.RETRIES.labels("kv-load", "connect").inc(3)
    metrics.RETRIES.labels("kv-load", "status").inc(1)
    metrics.HITS.labels("kv-load").inc(5)
    metrics.SCORE_FAILURES.labels("index_unavailable").inc(2)
    for seconds in [0.03] * 6 + [0.3] * 4:
        metrics.TTFT.labels("kv-load").observe(seconds)
    for _ in range(10):
        metrics.OVERHEAD.labels("kv-load").observe(0.0015)


def scrape(metrics: ModuleType, at: float) -> GatewayScrape:
    """What the dashboard reads at ``at`` from a gateway counting on ``metrics``."""
    text = metrics.exposition()[0].decode()
    return GatewayScrape(url=URL, at=at, counters=parse_gateway_metrics(text))


@pytest.fixture
def gateway() -> ModuleType:
    """A gateway's metrics, counting from zero; their text is read directly (no server here)."""
    return fresh_gateway_metrics()


def test_a_gateway_s_metrics_text_reads_as_its_counters(gateway):
    route_some(gateway)
    counters = scrape(gateway, 0.0).counters
    assert counters.policies == ("kv-load",)
    assert counters.routed == {
        ("sim-0", "ok"): 6,
        ("sim-1", "ok"): 3,
        ("sim-1", "client_gone"): 1,
        ("", "upstream_error"): 2,
    }
    assert (counters.requests, counters.answered) == (12, 10)
    assert counters.retries == {"connect": 3, "status": 1}
    assert counters.prefix_hits == 5
    assert counters.score_failures == {"index_unavailable": 2}
    assert counters.ttft.bounds[-1] == math.inf
    assert counters.ttft.count == 10
    assert counters.overhead.count == 10


def test_quantiles_are_interpolated_within_their_bucket_as_prometheus_does():
    # 6 observations in (0.025, 0.05], 4 in (0.25, 0.5]
    ttft = Buckets((0.025, 0.05, 0.25, 0.5, math.inf), (0, 6, 6, 10, 10))
    assert ttft.quantile(0.5) == pytest.approx(0.025 + 0.025 * 5 / 6)
    assert ttft.quantile(0.9) == pytest.approx(0.25 + 0.25 * 3 / 4)
    first_bucket = Buckets((0.1, math.inf), (4, 4))
    assert first_bucket.quantile(0.5) == pytest.approx(0.05)  # the first bucket starts at 0
    beyond = Buckets((0.1, 1.0, math.inf), (0, 1, 4))
    assert beyond.quantile(0.9) == 1.0  # in the +Inf bucket: the largest finite bound
    assert Buckets().quantile(0.5) is None
    assert Buckets((0.1, math.inf), (0, 0)).quantile(0.5) is None


def test_buckets_since_an_earlier_scrape_hold_the_observations_made_in_between():
    before = Buckets((0.1, math.inf), (2, 3))
    now = Buckets((0.1, math.inf), (5, 9))
    assert now.since(before) == Buckets((0.1, math.inf), (3, 6))
    assert now.since(Buckets()) == now  # nothing observed before
    restarted = Buckets((0.1, math.inf), (1, 1))
    assert restarted.since(now) == restarted  # fewer than before: a new gateway process


def test_a_row_has_totals_and_no_recent_numbers_from_a_single_scrape(gateway):
    route_some(gateway)
    row = gateway_row([scrape(gateway, 100.0)])
    assert (row["url"], row["reachable"], row["error"], row["policy"]) == (URL, True, None, "kv-load")
    assert row["requests"] == 12
    assert row["outcomes"] == {"client_gone": 1, "ok": 9, "upstream_error": 2}
    assert (row["retries"], row["retries_by_reason"]) == (4, {"connect": 3, "status": 1})
    assert row["hit_rate_overall"] == 0.5  # 5 hits of the 10 requests a pod answered
    assert (row["score_failures"], row["score_failures_by_reason"]) == (2, {"index_unavailable": 2})
    assert row["ttft_p50_overall"] == pytest.approx(0.025 + 0.025 * 5 / 6)
    assert row["ttft_p90_overall"] == pytest.approx(0.4375)
    assert row["overhead_p50_overall"] == pytest.approx(0.0015)
    recent = ("window_seconds", "requests_per_s", "retries_per_s", "hit_rate", "ttft_p50", "ttft_p90")
    assert {k: row[k] for k in (*recent, "overhead_p50")} == dict.fromkeys((*recent, "overhead_p50"))
    no_prefill = {"prefills": None, "prefills_per_s": None, "prefills_not_ok": None}
    assert row["pods"] == [
        {"pod": "sim-0", "requests": 6, "not_ok": 0, "share": 0.6, "requests_per_s": None, **no_prefill},
        {"pod": "sim-1", "requests": 4, "not_ok": 1, "share": 0.4, "requests_per_s": None, **no_prefill},
    ]
    assert row["pd"] is None  # its P/D decisions are exposed at 0: no P/D, nothing to show


def serve_disaggregated(metrics) -> None:
    """What a gateway counts for 11 requests of a P/D model: 8 prefilled on sim-0 (6) or sim-1
    (2) then decoded on sim-2 or sim-3; one below the threshold (whole on sim-3); one whose
    prefill pod sim-1 could not be reached, served whole by sim-2; one that sim-0 refused (a
    prompt too long: its answer the client's)."""
    metrics.REQUESTS.labels("kv-load", "sim-2", "ok").inc(5)
    metrics.REQUESTS.labels("kv-load", "sim-3", "ok").inc(5)
    metrics.REQUESTS.labels("kv-load", "sim-0", "prefill_refused").inc(1)
    metrics.ROUTING.pd_requests.labels("disaggregated").inc(8)
    metrics.ROUTING.pd_requests.labels("short_prompt").inc(1)
    metrics.ROUTING.pd_requests.labels("fallback").inc(1)
    metrics.ROUTING.pd_fallbacks.labels("connect").inc(1)
    metrics.PD_PREFILLS.labels("sim-0", "ok").inc(6)
    metrics.PD_PREFILLS.labels("sim-0", "refused").inc(1)
    metrics.PD_PREFILLS.labels("sim-1", "ok").inc(2)
    metrics.PD_PREFILLS.labels("sim-1", "connect").inc(1)
    for _ in range(8):
        metrics.PD_STEP.labels("prefill").observe(0.3)
        metrics.PD_STEP.labels("transfer").observe(0.02)


def test_a_gateway_s_pd_metrics_text_reads_as_its_counters(gateway):
    serve_disaggregated(gateway)
    counters = scrape(gateway, 0.0).counters
    assert counters.pd_decisions == {"disaggregated": 8, "short_prompt": 1, "fallback": 1}
    assert counters.pd_fallbacks["connect"] == 1
    assert sum(counters.pd_fallbacks.values()) == 1  # every reason exposed, the others at 0
    assert counters.pd_prefills == {
        ("sim-0", "ok"): 6,
        ("sim-0", "refused"): 1,
        ("sim-1", "ok"): 2,
        ("sim-1", "connect"): 1,
    }
    assert (counters.prefill_step.count, counters.transfer_step.count) == (8, 8)


def test_a_gateway_serving_pd_shows_its_decisions_and_the_steps_times(gateway):
    serve_disaggregated(gateway)
    first = gateway_row([scrape(gateway, 100.0)])
    assert first["pd"] == {
        "decisions": {"disaggregated": 8, "fallback": 1, "short_prompt": 1},
        "decisions_per_s": {"disaggregated": None, "fallback": None, "short_prompt": None},
        "fallbacks_by_reason": {"connect": 1},  # the reasons that happened
        "prefill_p50": None,  # no window yet
        "prefill_p50_overall": pytest.approx(0.375),  # all 8 in (0.25, 0.5]
        "transfer_p50": None,
        "transfer_p50_overall": pytest.approx(0.0175),  # all 8 in (0.01, 0.025]
    }

    earlier = scrape(gateway, 100.0)
    gateway.ROUTING.pd_requests.labels("disaggregated").inc(10)
    gateway.ROUTING.pd_requests.labels("fallback").inc(2)
    gateway.ROUTING.pd_fallbacks.labels("timeout").inc(2)
    for _ in range(10):
        gateway.PD_STEP.labels("prefill").observe(0.03)
        gateway.PD_STEP.labels("transfer").observe(0.3)
    pd = gateway_row([earlier, scrape(gateway, 110.0)])["pd"]
    assert pd["decisions"] == {"disaggregated": 18, "fallback": 3, "short_prompt": 1}
    assert pd["decisions_per_s"] == {
        "disaggregated": pytest.approx(1.0),  # 10 in 10 s
        "fallback": pytest.approx(0.2),
        "short_prompt": 0.0,
    }
    assert pd["fallbacks_by_reason"] == {"connect": 1, "timeout": 2}
    # the window's 10 steps alone, all in (0.025, 0.05] and (0.25, 0.5]; since start, 18 each
    assert (pd["prefill_p50"], pd["transfer_p50"]) == (pytest.approx(0.0375), pytest.approx(0.375))
    assert pd["prefill_p50_overall"] == pytest.approx(0.025 + 0.025 * 9 / 10)
    assert pd["transfer_p50_overall"] == pytest.approx(0.25 + 0.25 * 1 / 10)


def test_each_pod_shows_the_requests_it_answered_beside_the_prefill_steps_it_was_sent(gateway):
    serve_disaggregated(gateway)
    earlier = scrape(gateway, 100.0)
    gateway.PD_PREFILLS.labels("sim-0", "ok").inc(20)
    gateway.REQUESTS.labels("kv-load", "sim-2", "ok").inc(20)
    row = gateway_row([earlier, scrape(gateway, 110.0)])
    pods = {
        p["pod"]: (p["requests"], p["not_ok"], p["requests_per_s"], p["prefills"], p["prefills_per_s"])
        for p in row["pods"]
    }
    assert list(pods) == ["sim-0", "sim-1", "sim-2", "sim-3"]  # by name, whatever their role
    assert pods == {
        "sim-0": (1, 1, 0.0, 27, pytest.approx(2.0)),  # prefills; the request it refused
        "sim-1": (0, 0, 0.0, 3, 0.0),
        "sim-2": (25, 0, pytest.approx(2.0), None, None),  # decodes: sent no prefill step
        "sim-3": (5, 0, 0.0, None, None),
    }
    not_ok = {p["pod"]: p["prefills_not_ok"] for p in row["pods"]}
    assert not_ok == {"sim-0": {"refused": 1}, "sim-1": {"connect": 1}, "sim-2": None, "sim-3": None}


def test_prefill_steps_alone_are_pd_too(gateway):
    # every P/D request so far refused by its prefill pod: no decision counted, yet P/D served
    gateway.PD_PREFILLS.labels("sim-0", "refused").inc(2)
    gateway.REQUESTS.labels("kv-load", "sim-0", "prefill_refused").inc(2)
    pd = gateway_row([scrape(gateway, 100.0)])["pd"]
    assert pd is not None
    assert set(pd["decisions"].values()) == {0}
    assert pd["prefill_p50_overall"] is None  # no prefill step ended ok


def test_recent_numbers_grow_from_the_oldest_answered_scrape_of_the_window(gateway):
    route_some(gateway)
    first = scrape(gateway, 100.0)
    missed = GatewayScrape(url=URL, at=105.0, counters=None, error="ReadTimeout")
    gateway.REQUESTS.labels("kv-load", "sim-0", "ok").inc(10)
    gateway.HITS.labels("kv-load").inc(10)
    gateway.RETRIES.labels("kv-load", "connect").inc(1)
    for _ in range(10):
        gateway.TTFT.labels("kv-load").observe(0.3)
    row = gateway_row([first, missed, scrape(gateway, 110.0)])
    assert row["window_seconds"] == 10.0
    assert row["requests_per_s"] == pytest.approx(1.0)
    assert row["retries_per_s"] == pytest.approx(0.1)
    assert row["hit_rate"] == 1.0
    assert row["hit_rate_overall"] == 0.75  # 15 of 20
    assert row["ttft_p50"] == pytest.approx(0.375)  # the window's 10, all in (0.25, 0.5]
    assert row["ttft_p90"] == pytest.approx(0.475)
    assert row["ttft_p50_overall"] == pytest.approx(0.25 + 0.25 * 4 / 14)
    assert row["overhead_p50"] is None  # no request was overhead-timed in the window
    assert [(p["pod"], p["requests"], p["requests_per_s"]) for p in row["pods"]] == [
        ("sim-0", 16, pytest.approx(1.0)),
        ("sim-1", 4, 0.0),
    ]


def test_a_restarted_gateway_counts_from_zero(gateway):
    route_some(gateway)
    serve_disaggregated(gateway)
    before = scrape(gateway, 100.0)
    restarted = fresh_gateway_metrics()
    restarted.REQUESTS.labels("kv-load", "sim-0", "ok").inc(2)
    restarted.ROUTING.pd_requests.labels("disaggregated").inc(2)
    restarted.PD_PREFILLS.labels("sim-9", "ok").inc(2)
    row = gateway_row([before, scrape(restarted, 102.0)])
    assert row["requests"] == 2
    assert row["requests_per_s"] == pytest.approx(1.0)  # not negative
    assert row["pd"]["decisions_per_s"]["disaggregated"] == pytest.approx(1.0)
    assert [(p["pod"], p["prefills_per_s"]) for p in row["pods"]][-1] == ("sim-9", pytest.approx(1.0))


def test_an_unreachable_gateway_shows_no_numbers_rather_than_zeros(gateway):
    route_some(gateway)
    down = GatewayScrape(url=URL, at=110.0, counters=None, error="ConnectError: refused")
    row = gateway_row([scrape(gateway, 100.0), down])
    assert (row["reachable"], row["error"], row["pods"]) == (False, "ConnectError: refused", [])
    numbers = {k: v for k, v in row.items() if k not in ("url", "reachable", "error", "pods")}
    assert numbers and set(numbers.values()) == {None}


def test_a_gateway_that_routed_nothing_yet_knows_no_policy(gateway):
    row = gateway_row([scrape(gateway, 100.0)])
    assert (row["reachable"], row["policy"], row["requests"], row["retries"]) == (True, None, 0, 0)
    assert (row["hit_rate_overall"], row["ttft_p50_overall"], row["pods"]) == (None, None, [])


def test_the_gateways_traffic_sums_those_that_answered(gateway):
    route_some(gateway)
    down = GatewayScrape(url="http://other", at=100.0, counters=None, error="refused")
    traffic = gateway_traffic([scrape(gateway, 100.0), down])
    assert (traffic.requests, traffic.hits) == (12, 5)
    assert gateway_traffic([down]) is None
    assert gateway_traffic([]) is None


def test_scrapes_say_why_a_gateway_could_not_be_read(gateway_metrics, settings):
    route_some(gateway_metrics.metrics)
    refused = unreachable_url()
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url, refused, f"{gateway_metrics.url}/not-here"]
    answered, down, wrong = selectors.scrape_gateways()
    assert (answered.url, answered.error, answered.counters.requests) == (gateway_metrics.url, None, 12)
    assert (down.url, down.counters) == (refused, None)
    assert down.error.startswith("ConnectError")
    assert (wrong.counters, wrong.error) == (None, "/metrics answered HTTP 404")
    with pytest.raises(ValueError):
        parse_gateway_metrics("<html>not metrics</html>")
