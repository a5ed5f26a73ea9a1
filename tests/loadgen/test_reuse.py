"""The ``reuse~`` column (``prefix_reuse_est``) against a real simulated pod: the workload's own
prefix reuse bounds the hit rate of caches that start empty, and not of caches that do not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from simulator.loadgen.report import summarize
from simulator.loadgen.runner import LoadgenConfig, run_step
from simulator.loadgen.workload import WorkloadSpec
from tests.loadgen.target_servers import MODEL, SimulatedFleet, qwen_tokenizer

# Two groups of three sessions: the second and third session of a group reuse its system prompt.
SMALL = WorkloadSpec(groups=2, system_prompt_tokens=200, questions_per_group=3, seed=1)


@pytest.fixture(scope="module")
def one_pod() -> Iterator[SimulatedFleet]:
    """One pod with room for the whole workload: every router is a perfect router here."""
    fleet = SimulatedFleet(qwen_tokenizer(), pods=1)
    yield fleet
    fleet.stop()


def run(fleet: SimulatedFleet, *, reset: bool) -> dict:
    config = LoadgenConfig(
        pods=fleet.urls,
        model=MODEL,
        max_tokens=4,
        observe_scores=False,
        reset_prefix_cache=reset,
        settle=0.0,
        workload=SMALL,
    )
    return summarize(asyncio.run(run_step(config, router="round-robin", qps=100, requests=6)))


def test_reuse_bounds_the_hit_rate_of_caches_that_start_empty(one_pod):
    fresh = run(one_pod, reset=True)
    assert fresh["ok"] == 6 and fresh["notes"] == []
    # Perfect routing reaches the workload's reuse, up to the estimate's error (text for tokens).
    assert 0.3 < fresh["fleet_hit_rate"] <= fresh["prefix_reuse_est"] + 0.01
    assert fresh["fleet_hit_rate"] == pytest.approx(fresh["prefix_reuse_est"], abs=0.03)


def test_caches_that_held_the_prefixes_before_the_run_beat_it(one_pod):
    fresh = run(one_pod, reset=True)
    warm = run(one_pod, reset=False)  # the same requests again, into what the first run cached
    assert warm["prefix_reuse_est"] == fresh["prefix_reuse_est"]  # the workload's, not the fleet's
    assert warm["fleet_hit_rate"] > warm["prefix_reuse_est"] + 0.2
    assert warm["notes"] == ["prefix caches not reset: the hit rate counts what the pods held before the run"]
