"""What the liveness prober's verdicts do over HTTP: a down pod (and its data-parallel ranks)
leaves the fast path's scores and comes back; the registry API and ``/metrics`` tell pods apart
as active, idle, stale, down and disabled."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from registry.liveness import HealthChange
from registry.models import Pod
from registry.services import set_pod_health
from tests.api.conftest import MODEL, post
from tests.api.test_service import metrics_text, sample


def scores(client, capture: dict) -> dict:
    response = post(client, "/api/v1/score", {"model": MODEL, "token_ids": capture["token_ids"]})
    assert response.status_code == 200
    return response.json()["scores"]


def test_a_down_pod_and_its_ranks_leave_scores_until_it_is_up_again(client, engines, base_capture):
    Pod.objects.create(pod_id="pod-a", model=MODEL)
    Pod.objects.create(pod_id="pod-b", model=MODEL)
    engines.cache_capture("pod-a", base_capture)
    engines.cache("pod-b", base_capture["token_ids"], rank=1)  # held by pod-b#dp1 only
    assert set(scores(client, base_capture)) == {"pod-a", "pod-b#dp1"}

    set_pod_health([HealthChange("pod-b", "down", time.time())])
    assert scores(client, base_capture) == {"pod-a": 25.0}
    body = {"model": MODEL, "token_ids": base_capture["token_ids"], "pods": ["pod-b", "pod-b#dp1"]}
    assert post(client, "/api/v1/score", body).json()["scores"] == {}

    set_pod_health([HealthChange("pod-b", "up", time.time())])
    assert set(scores(client, base_capture)) == {"pod-a", "pod-b#dp1"}
    assert engines.index.pod_blocks()  # down never touched the index


def test_the_registry_api_and_metrics_tell_pod_states_apart(staff, index, settings):
    settings.DASHBOARD_STALE_SECONDS = 60
    now = datetime.now(UTC)
    long_ago = now - timedelta(minutes=10)
    for pod_id, last_seen, health, enabled in [
        ("active", now, "unknown", True),
        ("idle", long_ago, "up", True),
        ("stale", long_ago, "unknown", True),
        ("never-seen", None, "unknown", True),
        ("down", now, "down", True),
        ("disabled", now, "up", False),
    ]:
        Pod.objects.create(pod_id=pod_id, model=MODEL, last_seen=last_seen, health=health, enabled=enabled)

    listed = {row["pod_id"]: row for row in staff.get("/api/v1/pods/").json()}
    assert {pod: row["state"] for pod, row in listed.items()} == {
        "active": "active",
        "idle": "idle",
        "stale": "stale",
        "never-seen": "stale",
        "down": "down",
        "disabled": "disabled",
    }
    assert listed["down"]["health"] == "down"
    assert "health_changed_at" in listed["down"]
    assert staff.get("/api/v1/pods/idle/").json()["state"] == "idle"

    text = metrics_text(staff)
    counts = {state: sample(text, "kvcache_pods", state=state) for state in ("active", "idle", "stale")}
    assert counts == {"active": 1.0, "idle": 1.0, "stale": 2.0}
    assert (sample(text, "kvcache_pods", state="down"), sample(text, "kvcache_pods", state="disabled")) == (
        1.0,
        1.0,
    )
    assert sample(text, "kvcache_registry_up") == 1.0


def test_health_is_not_writable_through_the_api(staff, index):
    Pod.objects.create(pod_id="pod-a", model=MODEL)
    response = staff.patch("/api/v1/pods/pod-a/", {"health": "down", "labels": {"a": "b"}}, format="json")
    assert response.status_code == 200
    assert (response.json()["health"], response.json()["labels"]) == ("unknown", {"a": "b"})
    assert Pod.objects.get(pod_id="pod-a").health == "unknown"
