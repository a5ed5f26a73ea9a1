"""A pod's ``role`` under prefill/decode disaggregation: set through the API, the admin and a
fleet's registration (``simulate --register``), carried to the routers in the registry snapshot."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from registry.models import Pod
from registry.selectors import load_service_config
from registry.services import register_pods

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def api(db, settings) -> APIClient:
    settings.KVCACHE_API_KEYS = []
    client = APIClient()
    client.force_authenticate(User.objects.create(username="ops", is_staff=True))
    return client


def test_the_api_sets_a_pods_role_and_the_routers_read_it_from_the_registry(api, index):
    created = api.post("/api/v1/pods/", {"pod_id": "p-0", "model": MODEL, "role": "prefill"}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["role"] == "prefill"
    api.post("/api/v1/pods/", {"pod_id": "d-0", "model": MODEL, "role": "decode"}, format="json")
    api.post("/api/v1/pods/", {"pod_id": "a-0", "model": MODEL}, format="json")
    assert load_service_config().pod_roles == {"p-0": "prefill", "d-0": "decode"}  # both: not named

    api.patch("/api/v1/pods/p-0/", {"role": "both"}, format="json")
    assert load_service_config().pod_roles == {"d-0": "decode"}
    assert api.get("/api/v1/pods/d-0/").json()["role"] == "decode"


def test_an_unknown_role_is_a_400_naming_the_field(api, index):
    refused = api.post("/api/v1/pods/", {"pod_id": "p-0", "model": MODEL, "role": "encode"}, format="json")
    assert refused.status_code == 400
    assert "role" in refused.json()["error"]["fields"]
    assert not Pod.objects.exists()


def test_a_fleets_registration_sets_and_resets_its_pods_roles(db):
    rows = [(pod, MODEL, f"127.0.0.1:{8000 + i}", "") for i, pod in enumerate(("p-0", "d-0"))]
    register_pods(rows, roles={"p-0": "prefill", "d-0": "decode"})
    assert load_service_config().pod_roles == {"p-0": "prefill", "d-0": "decode"}
    register_pods(rows)  # the same pods started again without roles: whole requests
    assert load_service_config().pod_roles == {}


def test_the_admin_sets_a_pods_role(db, client):
    client.force_login(User.objects.create(username="admin", is_staff=True, is_superuser=True))
    pod = Pod.objects.create(pod_id="d-0", model=MODEL)
    changed = client.post(
        f"/admin/scoring/pod/{pod.pk}/change/",
        {"pod_id": "d-0", "address": "", "model": MODEL, "role": "decode", "labels": "{}", "enabled": "on"},
    )
    assert changed.status_code == 302
    assert load_service_config().pod_roles == {"d-0": "decode"}
    assert "decode" in client.get("/admin/scoring/pod/").content.decode()
