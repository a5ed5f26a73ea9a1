"""A fake fleet for the HTTP-level loadgen tests: two pods and a scoring API, real servers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.loadgen.fake_fleet import PodBehaviour, ScoringBehaviour, Served, pod_app, scoring_app

API_KEY = "test-key"


@dataclass
class FakeFleet:
    pods: dict[str, PodBehaviour]
    urls: dict[str, str]
    scoring: ScoringBehaviour
    score_url: str


@pytest.fixture
def fake_fleet() -> Iterator[FakeFleet]:
    """sim-0 and sim-1 (sim-1 holds the prompt: score 5 vs 2), scoring behind ``API_KEY``."""
    pods = {name: PodBehaviour(name) for name in ("sim-0", "sim-1")}
    scoring = ScoringBehaviour(scores={"sim-0": 2.0, "sim-1": 5.0}, api_key=API_KEY)
    servers = {name: Served(pod_app(pod)) for name, pod in pods.items()}
    score_server = Served(scoring_app(scoring))
    try:
        yield FakeFleet(
            pods=pods,
            urls={name: server.url for name, server in servers.items()},
            scoring=scoring,
            score_url=f"{score_server.url}/api/v1/score",
        )
    finally:
        for server in [*servers.values(), score_server]:
            server.stop()
