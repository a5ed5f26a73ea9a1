"""Batch scoring, and the pod addresses a scheduler needs to reach the pod it picks."""

from __future__ import annotations

import pytest

from registry import runtime
from registry.models import Pod
from registry.services import save_pod
from scoring.fastpath.schema import MAX_BATCH
from tests.api.conftest import MODEL, post


class CountingIndex:
    """The real index, counting the round trips the read path asks it for."""

    def __init__(self, index) -> None:
        self.index = index
        self.round_trips: list[str] = []

    def lookup(self, **kwargs):
        self.round_trips.append(kwargs["model"])
        return self.index.lookup(**kwargs)

    def lookup_many(self, **kwargs):
        self.round_trips.append(kwargs["model"])
        return self.index.lookup_many(**kwargs)

    def __getattr__(self, name):
        return getattr(self.index, name)


def test_a_batch_is_answered_in_order_with_one_round_trip_per_model(client, engines, index, base_capture):
    engines.cache("pod-a", base_capture["token_ids"], block_hashes=base_capture["block_hashes"])
    counting = CountingIndex(index)
    runtime.set_index(counting)
    requests = [
        {"model": MODEL, "prompt": base_capture["prompt"]},
        {"model": MODEL, "token_ids": base_capture["token_ids"][:160]},
        {"model": "other/model", "token_ids": [1] * 64},
        {"model": MODEL, "token_ids": []},  # invalid: its own 400, in its place
        {"model": "nobody/unknown", "prompt": "hi"},  # 404, in its place
        {"model": MODEL, "token_ids": base_capture["token_ids"], "pods": ["pod-b"]},
    ]
    response = post(client, "/api/v1/score/batch", {"requests": requests})
    assert response.status_code == 200, response.content
    results = response.json()["results"]
    assert [r["status"] for r in results] == [200, 200, 200, 400, 404, 200]
    assert results[0]["scores"] == {"pod-a": 25.0}
    assert results[1]["scores"] == {"pod-a": 10.0}
    assert results[2]["scores"] == {}
    assert results[3]["error"]["fields"].keys() == {"token_ids"}
    assert results[4]["error"]["code"] == "model_not_found"
    assert results[5]["scores"] == {}
    assert sorted(counting.round_trips) == sorted([MODEL, "other/model"])


@pytest.mark.parametrize("size", [0, MAX_BATCH + 1])
def test_a_batch_must_hold_1_to_64_requests(client, size):
    response = post(client, "/api/v1/score/batch", {"requests": [{"model": MODEL, "token_ids": [1]}] * size})
    assert response.status_code == 400
    assert "requests" in response.json()["error"]["fields"]


def test_scores_give_each_pods_registry_address(client, engines, base_capture):
    save_pod(Pod(pod_id="pod-a", model=MODEL, address="10.0.0.7:8000"))
    engines.cache("pod-a", base_capture["token_ids"], block_hashes=base_capture["block_hashes"])
    engines.cache("pod-b", base_capture["token_ids"][:64])
    body = post(client, "/api/v1/score", {"model": MODEL, "prompt": base_capture["prompt"]}).json()
    assert body["pods"]["pod-a"]["address"] == "10.0.0.7:8000"
    assert body["pods"]["pod-b"]["address"] is None
    batch = post(
        client, "/api/v1/score/batch", {"requests": [{"model": MODEL, "prompt": base_capture["prompt"]}]}
    )
    assert batch.json()["results"][0]["pods"]["pod-a"]["address"] == "10.0.0.7:8000"
