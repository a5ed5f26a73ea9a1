"""Fixtures of the conformance suite. Every test runs twice, once per way engines get their hash seed:
``PYTHONHASHSEED`` unset (vLLM then roots its sha256 chains in ``"vllm-none-hash"``) and set to
``"42"``; each way has its own stack of our processes, whose registry seed is set to match."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

from conformance.engines import TextPrompts
from conformance.fleet import Deployment, Fleet
from conformance.ours import OurStack, tokenizer_files
from conformance.spec import MODELS

ENGINE_HASH_SEEDS = [None, "42"]
"""The engines' PYTHONHASHSEED: unset, or explicit."""


@pytest.fixture(
    scope="session",
    params=ENGINE_HASH_SEEDS,
    ids=lambda seed: "PYTHONHASHSEED-unset" if seed is None else f"PYTHONHASHSEED={seed}",
)
def engine_hash_seed(request: pytest.FixtureRequest) -> str | None:
    return request.param


@pytest.fixture(scope="session")
def deployment(
    engine_hash_seed: str | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """Our processes, their registry seed equal to what vLLM roots its chains in, and the pods'
    publishers."""
    seed = DEFAULT_NONE_HASH_SEED if engine_hash_seed is None else engine_hash_seed
    ours = OurStack(tmp_path_factory.mktemp("ours"), seed=seed, models=MODELS.values())
    deployed = Deployment(ours, MODELS.values())
    try:
        deployed.start()
        yield deployed
    finally:
        deployed.stop()


@pytest.fixture
def fleet(
    request: pytest.FixtureRequest,
    deployment: Deployment,
    engine_hash_seed: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Fleet]]:
    """``fleet(scenario, num_blocks=...)``: the scenario's three vLLM pods (KV-cache managers of
    ``num_blocks`` blocks), their hash seed from this test's ``PYTHONHASHSEED``."""
    if engine_hash_seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", engine_hash_seed)
    fleets: list[Fleet] = []

    def make(scenario: str, *, num_blocks: int = 256) -> Fleet:
        made = Fleet(deployment, MODELS[scenario], num_blocks=num_blocks)
        fleets.append(made)
        assert made[0].hash_seed == deployment.ours.seed, "vLLM and our registry start from one seed"
        return made

    yield make
    for made in fleets:
        request.node.user_properties.append(
            ("conformance", f"{len(made.comparisons) - len(made.differences())}/{len(made.comparisons)}")
        )


@pytest.fixture(scope="session")
def qwen3() -> TextPrompts:
    """Text prompts tokenized by vLLM's own tokenizer from the Qwen3 files our registry resolves."""
    return TextPrompts(tokenizer_files())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Per test, how many (request, pod) checks agreed with vLLM (recorded at its teardown)."""
    reports = [report for category in terminalreporter.stats.values() for report in category]
    outcomes = {r.nodeid: r.outcome for r in reports if getattr(r, "when", None) == "call"}
    rows = [
        (r.nodeid.rpartition("::")[2], value, outcomes.get(r.nodeid, "error"))
        for r in reports
        if getattr(r, "when", None) == "teardown"
        for name, value in r.user_properties
        if name == "conformance"
    ]
    if rows:
        terminalreporter.section("agreement with vLLM 0.33 (equal / checked, per request and pod)")
        for test, agreed, outcome in sorted(rows):
            terminalreporter.write_line(f"{test:<52} {agreed:>7}  {outcome}")
