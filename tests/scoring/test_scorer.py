"""The scorer, on the reference's worked examples and the edges around them."""

from __future__ import annotations

import pytest

from registry.config import ModelSettings
from scoring.scorer import longest_prefix_scores

GPU, CPU = frozenset({"gpu"}), frozenset({"cpu"})
HALF_CPU = ModelSettings(name="m", tier_weights={"gpu": 1.0, "cpu": 0.5}).tier_weight


def scores(holders, total=None, weight=HALF_CPU):
    result = longest_prefix_scores(holders, total_blocks=total or len(holders), tier_weight=weight)
    return {pod: s.score for pod, s in result.items()}


def test_reference_example_prefix_ends_where_the_pod_stops_holding():
    # A, A, A(gpu+cpu), B, B, A -> {A: 3.0}
    holders = [{"A": GPU}, {"A": GPU}, {"A": GPU | CPU}, {"B": GPU}, {"B": GPU}, {"A": GPU}]
    assert scores(holders) == {"A": 3.0}


def test_reference_example_block_only_on_cpu_counts_its_weight():
    holders = [{"A": GPU}, {"A": GPU}, {"A": CPU}, {"B": GPU}, {"B": GPU}, {"A": GPU}]
    assert scores(holders) == {"A": 2.5}


def test_pods_missing_block_zero_are_absent():
    assert scores([{"A": GPU}, {"A": GPU, "B": GPU}]) == {"A": 2.0}


def test_no_holders_no_scores():
    assert scores([]) == {}
    assert scores([{}, {"A": GPU}]) == {}


def test_each_pod_keeps_its_own_prefix_length():
    holders = [{"A": GPU, "B": GPU}, {"A": GPU, "B": GPU}, {"A": GPU}, {"A": GPU}]
    result = longest_prefix_scores(holders, total_blocks=8, tier_weight=HALF_CPU)
    assert {p: (s.score, s.matched_blocks, s.normalized) for p, s in result.items()} == {
        "A": (4.0, 4, 0.5),
        "B": (2.0, 2, 0.25),
    }


def test_unknown_tiers_default_below_gpu():
    weight = ModelSettings(name="m").tier_weight
    result = longest_prefix_scores([{"A": frozenset({"fs"})}], total_blocks=1, tier_weight=weight)
    assert result["A"].score == pytest.approx(0.5)


def test_tier_reports_the_slowest_tier_of_the_matched_prefix():
    holders = [{"A": GPU, "B": GPU}, {"A": GPU | CPU, "B": CPU}]
    result = longest_prefix_scores(holders, total_blocks=2, tier_weight=HALF_CPU)
    assert (result["A"].tier, result["B"].tier) == ("gpu", "cpu")
