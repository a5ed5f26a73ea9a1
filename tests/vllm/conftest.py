"""Real vLLM engines behind the real stack (``bench/vllm_system.py``), started once for the
tests of this package: ``make e2e-vllm`` runs them alone, ``make test`` with the rest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.vllm_system import VllmSystem


@pytest.fixture(scope="package")
def system(tmp_path_factory) -> Iterator[VllmSystem]:
    running = VllmSystem(engines=2, tmp=tmp_path_factory.mktemp("vllm"))
    yield running
    running.close()
