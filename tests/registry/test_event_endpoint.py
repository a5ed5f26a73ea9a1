"""A pod's ``event_endpoint``: where its engine's KV-event PUB binds, for the ingest replica that
holds the pod to connect to. Validated wherever it is written (model, API, admin) and carried to
ingest in the registry snapshot."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from registry.models import Pod, validate_event_endpoint
from registry.selectors import load_service_config

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def api(db, settings) -> APIClient:
    settings.KVCACHE_API_KEYS = []
    client = APIClient()
    client.force_authenticate(User.objects.create(username="ops", is_staff=True))
    return client


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://10.0.0.7:5557",
        "tcp://vllm-0.vllm.default.svc:5557",
        "tcp://[fd00::7]:5557",
        "ipc:///run/kv.sock",
    ],
)
def test_an_endpoint_a_sub_socket_can_connect_to_is_valid(endpoint):
    validate_event_endpoint(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5557",  # where an engine binds, not where ingest connects
        "tcp://10.0.0.7",
        "tcp://10.0.0.7:0",
        "tcp://10.0.0.7:65536",
        "10.0.0.7:5557",
        "udp://10.0.0.7:5557",
        "inproc://kv",
        "ipc://",
        "ipc://with space",
    ],
)
def test_an_endpoint_ingest_cannot_connect_to_is_refused(endpoint):
    with pytest.raises(ValidationError, match="tcp://host:port"):
        validate_event_endpoint(endpoint)


def test_the_api_sets_a_pods_event_endpoint_and_ingest_reads_it_from_the_registry(api, index):
    created = api.post(
        "/api/v1/pods/",
        {"pod_id": "pod-a", "model": MODEL, "event_endpoint": "tcp://10.0.0.7:5557"},
        format="json",
    )
    assert created.status_code == 201, created.content
    assert created.json()["event_endpoint"] == "tcp://10.0.0.7:5557"
    api.post("/api/v1/pods/", {"pod_id": "pod-b", "model": MODEL}, format="json")
    assert load_service_config().event_endpoints == {"pod-a": "tcp://10.0.0.7:5557"}  # blank: none

    cleared = api.patch("/api/v1/pods/pod-a/", {"event_endpoint": ""}, format="json")
    assert cleared.json()["event_endpoint"] == ""
    assert load_service_config().event_endpoints == {}


def test_the_api_refuses_an_endpoint_ingest_cannot_connect_to(api, index):
    refused = api.post(
        "/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL, "event_endpoint": "tcp://*:5557"}, format="json"
    )
    assert refused.status_code == 400
    assert "event_endpoint" in refused.content.decode()
    assert not Pod.objects.exists()


def test_the_admin_form_edits_the_event_endpoint_and_refuses_a_bad_one(client, db, index):
    client.force_login(User.objects.create_superuser("boss", password="pw-for-tests-only"))
    form = {
        "pod_id": "vllm-0",
        "address": "",
        "model": MODEL,
        "role": "both",
        "labels": "{}",
        "enabled": "on",
    }

    refused = client.post("/admin/scoring/pod/add/", {**form, "event_endpoint": "tcp://10.0.0.7"})
    assert refused.status_code == 200
    assert "tcp://host:port" in refused.content.decode()
    assert (
        client.post("/admin/scoring/pod/add/", {**form, "event_endpoint": "tcp://10.0.0.7:5557"}).status_code
        == 302
    )
    assert Pod.objects.get().event_endpoint == "tcp://10.0.0.7:5557"
    assert client.get("/admin/scoring/pod/?q=10.0.0.7:5557").content.decode().count("vllm-0") >= 1
