"""``manage.py serve --index in-process`` as a real process, with no Valkey and no ``manage.py
ingest``: the web server keeps its own index, subscribes to the KV events of two simulated pods
(their PUBs bound and registered) itself, and its scoring and KV-indexer APIs answer from it, as
Dynamo's standalone indexer does."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from django.core.management import CommandError, call_command

from tests.ports import free_port
from tests.simulated_fleet import MODEL, Process, SimulatedFleet, eventually, per_pod, prompt
from tokenization.tokenizers import TokenizerRegistry

pytestmark = pytest.mark.slow

TEXT = prompt("served", words=200)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[SimulatedFleet, str]]:
    tmp = tmp_path_factory.mktemp("serve-in-process")
    fleet = SimulatedFleet(tmp)
    port = free_port()
    web = Process(fleet.env, tmp / "serve.log", "serve", "--port", str(port), "--index", "in-process")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert web.alive(), web.output()
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        eventually(ready, timeout=60, what="serve --index in-process")
        yield fleet, url
    finally:
        code = web.stop()
        fleet.stop()
    assert code == 0, web.output()  # SIGTERM drains the ingest and exits 0


def test_the_scoring_and_kv_indexer_apis_answer_from_the_servers_own_index(served) -> None:
    fleet, url = served
    answer = fleet.complete(fleet.urls["sim-0"], TEXT)
    assert answer.status_code == 200, answer.text
    ids = list(TokenizerRegistry().tokenize(MODEL, TEXT).token_ids)
    blocks = len(ids) // 16

    def scored() -> dict:
        response = httpx.post(f"{url}/api/v1/score", json={"model": MODEL, "token_ids": ids}, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()["pods"]

    pods = eventually(lambda: scored().get("sim-0"), timeout=20, what="sim-0's blocks in the index")
    assert pods["matched_blocks"] == blocks
    assert "sim-1" not in scored()

    query = httpx.post(f"{url}/kv-indexer/query", json={"token_ids": ids, "model_name": MODEL}, timeout=10)
    assert query.status_code == 200, query.text
    assert query.json()["scores"] == {"sim-0": {"0": blocks * 16}}

    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert per_pod(metrics, "kvcache_index_admissions_total")["sim-0"] >= blocks


def test_serve_refuses_ingest_options_without_the_in_process_index() -> None:
    with pytest.raises(CommandError, match="go with --index in-process"):
        call_command("serve", "--ingest-connect", "tcp://127.0.0.1:1")
