"""The latency model: TTFT from uncached tokens, the load multiplier, jitter that never truncates."""

from __future__ import annotations

import pytest

from simulator.config import ConfigError, LatencyConfig
from simulator.latency import (
    Jitter,
    inter_token_latency,
    kv_transfer_time,
    load_multiplier,
    time_to_first_token,
)


def test_ttft_counts_only_uncached_prompt_tokens() -> None:
    config = LatencyConfig(prefill_overhead_ms=5, prefill_time_per_token_ms=0.5, load_factor=1)
    cold = time_to_first_token(config, prompt_tokens=1000, cached_tokens=0, running=1, max_num_seqs=8)
    warm = time_to_first_token(config, prompt_tokens=1000, cached_tokens=992, running=1, max_num_seqs=8)
    assert cold == pytest.approx(0.005 + 1000 * 0.0005)
    assert warm == pytest.approx(0.005 + 8 * 0.0005)


@pytest.mark.parametrize(
    ("running", "expected"),
    [(0, 1.0), (1, 1.0), (2, 1.0 + 2.0 * 1 / 4), (3, 2.0), (5, 3.0), (9, 3.0)],
)
def test_load_multiplier_grows_linearly_to_the_load_factor(running: int, expected: float) -> None:
    assert load_multiplier(3.0, running=running, max_num_seqs=5) == pytest.approx(expected)


def test_load_multiplier_is_one_with_a_single_slot() -> None:
    assert load_multiplier(10.0, running=1, max_num_seqs=1) == 1.0


def test_ttft_and_itl_are_multiplied_by_the_load() -> None:
    config = LatencyConfig(
        prefill_overhead_ms=10, prefill_time_per_token_ms=1, inter_token_latency_ms=4, load_factor=2
    )
    ttft = time_to_first_token(config, prompt_tokens=10, cached_tokens=0, running=3, max_num_seqs=3)
    assert ttft == pytest.approx(2 * (0.010 + 10 * 0.001))
    assert inter_token_latency(config, running=2, max_num_seqs=3) == pytest.approx(1.5 * 0.004)


def test_a_kv_transfer_costs_its_latency_and_its_tokens_whatever_the_load() -> None:
    config = LatencyConfig(
        kv_cache_transfer_latency_ms=3, kv_cache_transfer_time_per_token_ms=0.05, load_factor=4
    )
    assert kv_transfer_time(config, transferred_tokens=1000) == pytest.approx(0.003 + 1000 * 0.00005)
    assert kv_transfer_time(config, transferred_tokens=0) == pytest.approx(0.003)


def test_sub_millisecond_latencies_are_kept_exactly() -> None:
    config = LatencyConfig(
        prefill_overhead_ms=0, prefill_time_per_token_ms=0.0004, inter_token_latency_ms=0.3
    )
    assert time_to_first_token(config, prompt_tokens=100, cached_tokens=0, running=1, max_num_seqs=4) == (
        pytest.approx(0.00004)
    )
    assert inter_token_latency(config, running=1, max_num_seqs=4) == pytest.approx(0.0003)


def test_jitter_keeps_sub_millisecond_values_positive_and_within_three_sigma() -> None:
    jitter = Jitter(seed=1)
    values = [jitter.apply(0.0002, 0.3) for _ in range(2000)]
    assert min(values) >= 0.0002 * 0.1 > 0
    assert max(values) <= 0.0002 * 1.9
    assert len(set(values)) > 1000  # really random, not rounded to a few values
    assert sum(values) / len(values) == pytest.approx(0.0002, rel=0.05)


def test_jitter_is_seeded() -> None:
    a, b, c = Jitter(seed=7), Jitter(seed=7), Jitter(seed=8)
    first = [a.apply(0.01, 0.1) for _ in range(5)]
    assert first == [b.apply(0.01, 0.1) for _ in range(5)]
    assert first != [c.apply(0.01, 0.1) for _ in range(5)]


def test_no_jitter_leaves_values_unchanged() -> None:
    assert Jitter(seed=0).apply(0.0123, 0.0) == 0.0123


@pytest.mark.parametrize(
    "fields",
    [
        {"jitter": 0.5},
        {"load_factor": 0.5},
        {"inter_token_latency_ms": -1},
        {"prefill_overhead_ms": "5"},
        {"kv_cache_transfer_latency_ms": -0.1},
        {"kv_cache_transfer_time_per_token_ms": None},
    ],
)
def test_invalid_latency_settings_are_refused(fields: dict) -> None:
    with pytest.raises(ConfigError):
        LatencyConfig(**fields)


def test_each_prompt_being_computed_slows_a_decode_step_by_the_interference() -> None:
    config = LatencyConfig(inter_token_latency_ms=4, prefill_interference=0.25)
    assert inter_token_latency(config, running=3, max_num_seqs=4) == pytest.approx(0.004)
    assert inter_token_latency(config, running=3, max_num_seqs=4, prefilling=2) == pytest.approx(0.004 * 1.5)
