"""Longest-prefix scoring: how much of a prompt's block chain each pod already holds.

Pods holding block 0 start active; walking the keys, the active set is intersected with each
block's holders, and every pod still active adds the weight of its best tier for that block.
The walk ends when no pod is active. Pods that miss block 0 are absent from the result. This is
the reference's algorithm (upstream-parity.md, read path 5), with configurable tier weights and
the matched block count and normalised score reported beside the raw score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvindex import HolderMap


@dataclass(frozen=True, slots=True)
class PodScore:
    """One pod's result. ``tier`` is the slowest tier the matched prefix is held on: the lowest
    weighted of the pod's best tiers over the matched blocks ("gpu" when all of it is on GPU)."""

    score: float
    matched_blocks: int
    normalized: float
    tier: str


def longest_prefix_scores(
    holders: Sequence[HolderMap], *, total_blocks: int, tier_weight: Callable[[str], float]
) -> dict[str, PodScore]:
    """Scores from ``holders`` (the index's answer for the prompt's keys, in order).

    ``total_blocks`` is the number of full blocks in the request (for ``normalized``).
    """
    if not holders or not holders[0]:
        return {}
    active = set(holders[0])
    score = dict.fromkeys(active, 0.0)
    matched = dict.fromkeys(active, 0)
    weakest: dict[str, tuple[float, str]] = {}
    best_of: dict[frozenset[str], tuple[float, str]] = {}  # a tier set's best (weight, tier)
    # The blocks of a shared prefix usually have the same holders: score each run of equal
    # holder maps once, times its length.
    for block, run in _runs(holders):
        active.intersection_update(block)
        if not active:
            break
        for pod in active:
            tiers = block[pod]
            best = best_of.get(tiers)
            if best is None:
                best = best_of[tiers] = max((tier_weight(t), t) for t in tiers)
            best_weight = best[0]
            score[pod] += best_weight * run
            matched[pod] += run
            if pod not in weakest or best_weight < weakest[pod][0]:
                weakest[pod] = best
    return {
        pod: PodScore(
            score=score[pod],
            matched_blocks=matched[pod],
            normalized=matched[pod] / total_blocks if total_blocks else 0.0,
            tier=weakest[pod][1],
        )
        for pod in sorted(score)
    }


def _runs(holders: Sequence[HolderMap]) -> list[tuple[HolderMap, int]]:
    """``holders`` as (holder map, how many consecutive blocks have it)."""
    runs: list[tuple[HolderMap, int]] = []
    prev: HolderMap | None = None
    count = 0
    for block in holders:
        if block is prev or block == prev:
            count += 1
            continue
        if prev is not None:
            runs.append((prev, count))
        prev, count = block, 1
    if prev is not None:
        runs.append((prev, count))
    return runs
