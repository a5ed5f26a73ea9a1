"""Faults with real processes: ``manage.py ingest`` and a Valkey server are child processes,
killed with SIGKILL under load; simulated pods serve replay. Afterwards the index must hold
exactly what the pods' caches hold: no stale block, no missing one (``bench/faults.py`` runs the
same system to time it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.faults import FaultSystem, wait_for
from kvindex.epochs import READY, parse_marker

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> Iterator[FaultSystem]:
    fault_system = FaultSystem(pods=3, tmp=tmp_path_factory.mktemp("faults"))
    yield fault_system
    fault_system.close()


def indexed_blocks(system: FaultSystem) -> int:
    return sum(row.total for row in system.index.pod_blocks(model=MODEL))


@pytest.mark.slow
def test_after_ingest_is_killed_mid_burst_the_index_equals_the_caches(system: FaultSystem) -> None:
    system.start_load(qps=30)
    wait_for(lambda: system.requests > 30, timeout=30, what="load")
    result = system.ingest_killed(down=1.5)

    assert (result["stale"], result["missing"]) == (0, 0), result
    assert result["exact_after_restart_seconds"] < 5, result
    assert indexed_blocks(system) > 0


@pytest.mark.slow
def test_a_valkey_restarted_empty_is_noticed_and_rebuilt(system: FaultSystem) -> None:
    before = parse_marker(system.index.epochs([MODEL])[0])
    assert before is not None and before[1] == READY
    system.start_load(qps=30)
    wait_for(lambda: system.requests > 30, timeout=30, what="load")
    result = system.index_lost()

    assert (result["stale"], result["missing"]) == (0, 0), result
    assert result["exact_after_restart_seconds"] < 5, result
    after = parse_marker(system.index.epochs([MODEL])[0])
    assert after is not None and after[0] != before[0] and after[1] == READY
