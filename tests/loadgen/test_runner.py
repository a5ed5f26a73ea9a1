"""The runner's pure parts: fleet and QPS options, seeded Poisson arrivals, config checks."""

from __future__ import annotations

import math
import statistics
from itertools import islice

import pytest

from simulator.loadgen.runner import LoadgenConfig, arrival_times, fleet_from_base, parse_pod, parse_qps


def test_fleet_from_a_base_url_counts_ports_up():
    assert fleet_from_base("http://127.0.0.1:8100/", 3) == {
        "sim-0": "http://127.0.0.1:8100",
        "sim-1": "http://127.0.0.1:8101",
        "sim-2": "http://127.0.0.1:8102",
    }
    assert fleet_from_base("http://[::1]:9000", 1) == {"sim-0": "http://[::1]:9000"}
    with pytest.raises(ValueError, match="scheme://host:port"):
        fleet_from_base("127.0.0.1", 2)
    with pytest.raises(ValueError, match="at least 1"):
        fleet_from_base("http://127.0.0.1:8100", 0)


def test_explicit_pods():
    assert parse_pod("sim-0=http://127.0.0.1:8100/") == ("sim-0", "http://127.0.0.1:8100")
    for bad in ("sim-0", "=http://x:1", "sim-0=localhost"):
        with pytest.raises(ValueError, match="POD=URL"):
            parse_pod(bad)


def test_qps_ladder():
    assert parse_qps("2,4, 8") == [2.0, 4.0, 8.0]
    assert parse_qps("0.5") == [0.5]
    assert parse_qps("inf") == [math.inf]
    for bad in ("", "fast", "2,0", "-1"):
        with pytest.raises(ValueError):
            parse_qps(bad)


def test_arrivals_are_a_seeded_poisson_process():
    times = list(islice(arrival_times(seed=4, qps=10.0), 5000))
    assert times == list(islice(arrival_times(seed=4, qps=10.0), 5000))
    assert times != list(islice(arrival_times(seed=5, qps=10.0), 5000))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.1)  # exponential: stdev = mean
    # The same draws at another rate: the schedule scales, so routers see the same traffic shape.
    doubled = list(islice(arrival_times(seed=4, qps=20.0), 5000))
    assert doubled == pytest.approx([t / 2 for t in times])


def test_infinite_qps_sends_everything_at_once():
    assert list(islice(arrival_times(seed=0, qps=math.inf), 3)) == [0.0, 0.0, 0.0]


def test_config_refuses_an_empty_fleet_and_hides_the_api_key():
    with pytest.raises(ValueError, match="no pods"):
        LoadgenConfig(pods={})
    config = LoadgenConfig(pods={"sim-0": "http://127.0.0.1:1"}, api_key="secret")
    assert config.endpoint("sim-0") == "http://127.0.0.1:1/v1/chat/completions"
    described = config.describe()
    assert described["api_key"] == "set" and "secret" not in str(described)
    assert described["workload"]["groups"] == 8
