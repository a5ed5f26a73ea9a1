"""The KV-indexer API (``/kv-indexer/``), compatible with NVIDIA Dynamo's standalone indexer
(``python -m dynamo.indexer``, 1.6.1), through the whole ASGI application on each index backend.

``DYNAMO`` holds what Dynamo 1.6.1 answered to the same requests (run with ``var/dynamo/bin/python
-m dynamo.indexer --port P --threads 1``, recorded with curl): our statuses and JSON bodies must be
the same, except where the module ``scoring.kv_indexer`` documents otherwise (``DIVERGES``).
Blocks reach the index as engines report them (BlockStored events through the EventApplier).
"""

from __future__ import annotations

import base64

import pytest
from django.contrib.auth.models import User

from kvindex.dynamo import block_hash_seed, dynamo_block_hashes
from kvindex.keys import block_extra_keys, block_keys
from registry.models import ModelConfig, Pod
from registry.runtime import invalidate_service_config
from tests.api.conftest import BLOCK_SIZE, MODEL, SEED

# Dynamo 1.6.1's answers, (status, body); "text" where it answers in plain text (ours: JSON).
DYNAMO = {
    "query, no worker for the model": (404, {"error": "no indexer for model=m routing_group=default"}),
    "register": (201, {"status": "ok"}),
    "register again": (409, {"error": "instance 7 dp_rank 0 already registered"}),
    "register, another block size": (
        409,
        {"error": "block_size mismatch for model=m routing_group=default: existing=16, requested=32"},
    ),
    "register, a bad endpoint": (400, {"error": "invalid ZMQ endpoint `not-an-endpoint`: missing scheme"}),
    "register, instance_id -1": (422, "text"),
    "query, nothing cached": (200, {"scores": {}, "frequencies": [], "instances": {}}),
    "query, token_ids [-1]": (422, "text"),
    "query, no token_ids": (422, "text"),
    "query, not JSON": (400, "text"),
    "query, no content type": (415, "text"),
    "query, GET": (405, ""),
    "query_by_hash, a cache_salt": (
        400,
        {
            "error": "cache_salt is not accepted by /query_by_hash; block_hashes must already include the "
            "intended cache salt"
        },
    ),
    "unregister": (200, {"status": "ok"}),
    "unregister, unknown": (404, {"error": "instance 7 not found"}),
    "workers, none": (200, []),
    # One worker registered as {"instance_id": 12, "endpoint": "tcp://127.0.0.1:19561",
    # "model_name": "m2", "block_size": 16}:
    "workers, one": (
        200,
        [
            {
                "instance_id": 12,
                "source": "zmq",
                "status": "active",
                "model_name": "m2",
                "routing_group": "default",
                "block_size": 16,
                "endpoints": {"0": "tcp://127.0.0.1:19561"},
                "listeners": {"0": {"endpoint": "tcp://127.0.0.1:19561", "status": "active"}},
            }
        ],
    ),
    "dump, one empty model": (200, {"m:default": {"block_size": 16, "events": []}}),
}
DIVERGES = {
    "query_by_hash": "400: Dynamo's block hashes are not this index's keys (Dynamo: 200, its matches)",
    "dump": '"events" only with KVCACHE_DYNAMO_BLOCKS, of pods with a numeric id; "blocks" is ours',
}
REGISTER = {"instance_id": 7, "endpoint": "tcp://127.0.0.1:19555", "model_name": "m", "block_size": 16}


@pytest.fixture
def ops(db) -> str:
    """HTTP basic credentials of a staff user, as a Dynamo client's HTTP client sends them."""
    User.objects.create_user("ops", password="secret", is_staff=True)
    return "Basic " + base64.b64encode(b"ops:secret").decode()


def send(client, path: str, body: object, auth: str | None = None, **headers: str):
    if auth is not None:
        headers["HTTP_AUTHORIZATION"] = auth
    return client.post(path, body, **headers)


def answer(response) -> tuple[int, object]:
    return response.status_code, response.json()


def register(client, auth: str, **fields: object):
    return send(client, "/kv-indexer/register", {**REGISTER, **fields}, auth)


# --- the registry writes ------------------------------------------------------------------------------


def test_register_and_unregister_answer_as_dynamo(client, index, ops):
    assert answer(register(client, ops)) == DYNAMO["register"]
    assert answer(register(client, ops)) == DYNAMO["register again"]
    assert (
        answer(register(client, ops, instance_id=8, block_size=32)) == DYNAMO["register, another block size"]
    )
    pod = Pod.objects.get(pod_id="7")
    assert (pod.model, pod.event_endpoint, pod.registered) == ("m", "tcp://127.0.0.1:19555", True)
    assert ModelConfig.objects.get(name="m").block_size == 16

    unregister = {"instance_id": 7, "model_name": "m"}
    assert answer(send(client, "/kv-indexer/unregister", unregister, ops)) == DYNAMO["unregister"]
    assert answer(send(client, "/kv-indexer/unregister", unregister, ops)) == DYNAMO["unregister, unknown"]
    assert not Pod.objects.filter(pod_id="7").exists()


def test_register_gives_a_pod_registered_otherwise_its_event_endpoint(client, index, ops):
    Pod.objects.create(pod_id="sim-0", model=MODEL, address="127.0.0.1:8100", registered=True)
    response = register(client, ops, instance_id="sim-0", model_name=MODEL, endpoint="tcp://127.0.0.1:5600")
    assert answer(response) == DYNAMO["register"]
    pod = Pod.objects.get(pod_id="sim-0")
    assert (pod.event_endpoint, pod.address) == ("tcp://127.0.0.1:5600", "127.0.0.1:8100")


def test_a_rank_registers_on_its_pods_endpoint_only(client, index, ops):
    assert register(client, ops).status_code == 201
    assert answer(register(client, ops, dp_rank=1)) == DYNAMO["register"]
    status, body = answer(register(client, ops, dp_rank=1, endpoint="tcp://127.0.0.1:19556"))
    assert status == 409 and "one KV-event endpoint per instance" in body["error"]


def test_registry_writes_refuse_bad_input_as_dynamo(client, index, ops):
    status, body = answer(register(client, ops, endpoint="not-an-endpoint"))
    assert status == DYNAMO["register, a bad endpoint"][0]
    assert body["error"].startswith("endpoint: must be where the engine's KV-event PUB binds")
    assert register(client, ops, instance_id=-1).status_code == DYNAMO["register, instance_id -1"][0]
    status, body = answer(register(client, ops, instance_id="a/b"))
    assert status == 400 and body["error"].startswith("instance_id: may contain only")
    status, body = answer(register(client, ops, routing_group="acme"))
    assert status == 400 and "routing_group" in body["error"]
    response = send(client, "/kv-indexer/register", REGISTER, ops, content_type="text/plain")
    assert response.status_code == 415
    assert send(client, "/kv-indexer/register", b"{", ops).status_code == 400
    assert not Pod.objects.exists() and not ModelConfig.objects.exists()


def test_registry_writes_need_a_staff_user(client, index, db):
    assert register(client, None).status_code == 401
    assert register(client, "Basic " + base64.b64encode(b"ops:wrong").decode()).status_code == 401
    User.objects.create_user("viewer", password="secret")
    viewer = "Basic " + base64.b64encode(b"viewer:secret").decode()
    assert register(client, viewer).status_code == 403
    assert (
        send(client, "/kv-indexer/unregister", {"instance_id": 7, "model_name": "m"}, viewer).status_code
        == 403
    )
    assert not Pod.objects.exists()


# --- the reads ----------------------------------------------------------------------------------------


def test_workers_and_an_empty_query_answer_as_dynamo(client, index, ops):
    assert answer(client.get("/kv-indexer/workers")) == DYNAMO["workers, none"]
    query = {"token_ids": [1, 2, 3], "model_name": "m"}
    assert answer(send(client, "/kv-indexer/query", query)) == DYNAMO["query, no worker for the model"]
    register(client, ops, instance_id=12, model_name="m2", endpoint="tcp://127.0.0.1:19561")
    assert answer(client.get("/kv-indexer/workers")) == DYNAMO["workers, one"]
    assert answer(client.get("/kv-indexer/workers", {"model_name": "m"})) == DYNAMO["workers, none"]
    query = {
        "token_ids": [1, 2, 3],
        "model_name": "m2",
        "tenant_id": "acme",
        "lora_name": "x",
        "cache_salt": "s",
    }
    assert answer(send(client, "/kv-indexer/query", query)) == DYNAMO["query, nothing cached"]


def test_query_answers_matched_tokens_per_instance_and_rank(client, index, engines, ops):
    Pod.objects.create(pod_id="7", model=MODEL, registered=True)
    Pod.objects.create(pod_id="sim-0", model=MODEL, registered=True)
    invalidate_service_config()
    tokens = list(range(1000, 1000 + 4 * BLOCK_SIZE))
    engines.cache("7", tokens)
    engines.cache("7", tokens[: 2 * BLOCK_SIZE], rank=1)
    engines.cache("sim-0", tokens[: 3 * BLOCK_SIZE], tier="cpu")
    status, body = answer(send(client, "/kv-indexer/query", {"token_ids": [*tokens, 5], "model_name": MODEL}))
    assert status == 200
    assert body == {
        "scores": {"7": {"0": 64, "1": 32}, "sim-0": {"0": 48}},
        "frequencies": [3, 3, 2, 1],
        "instances": {
            "7": {"longest_matched": 64, "gpu": 64, "dp": {"0": 64, "1": 32}, "cpu": 64, "disk": 64},
            "sim-0": {"longest_matched": 48, "gpu": 0, "dp": {"0": 48}, "cpu": 48, "disk": 48},
        },
    }
    salted = {"token_ids": tokens, "model_name": MODEL, "cache_salt": "tenant-42"}
    assert answer(send(client, "/kv-indexer/query", salted)) == DYNAMO["query, nothing cached"]
    lora = {"token_ids": tokens, "model_name": MODEL, "lora_name": "Alice"}
    assert answer(send(client, "/kv-indexer/query", lora)) == DYNAMO["query, nothing cached"]


def test_query_refuses_bad_input_as_dynamo(client, index, ops):
    register(client, ops)
    for name, body in (
        ("query, token_ids [-1]", {"token_ids": [-1], "model_name": "m"}),
        ("query, no token_ids", {"model_name": "m"}),
    ):
        status, error = answer(send(client, "/kv-indexer/query", body))
        assert status == DYNAMO[name][0] and error["error"].startswith("token_ids")
    assert send(client, "/kv-indexer/query", b"not json").status_code == DYNAMO["query, not JSON"][0]
    response = send(
        client, "/kv-indexer/query", {"token_ids": [1], "model_name": "m"}, content_type="text/plain"
    )
    assert response.status_code == DYNAMO["query, no content type"][0]
    assert client.get("/kv-indexer/query").status_code == DYNAMO["query, GET"][0]
    too_long = {"token_ids": [1] * 50_000, "model_name": "m"}
    ModelConfig.objects.filter(name="m").update(max_model_len=1024)
    invalidate_service_config()
    status, error = answer(send(client, "/kv-indexer/query", too_long))
    assert status == 400 and error["error"].startswith("token_ids")


def test_query_by_hash_is_refused_after_dynamos_own_checks(client, index, ops):
    by_hash = {"block_hashes": [1, -2], "model_name": "m"}
    assert answer(send(client, "/kv-indexer/query_by_hash", by_hash))[0] == 404
    register(client, ops)
    salted = {**by_hash, "cache_salt": "s"}
    assert answer(send(client, "/kv-indexer/query_by_hash", salted)) == DYNAMO["query_by_hash, a cache_salt"]
    status, body = answer(send(client, "/kv-indexer/query_by_hash", by_hash))
    assert status == 400 and "send the token_ids to /kv-indexer/query" in body["error"]


def test_dump_lists_each_models_blocks_per_instance_rank_and_tier(client, index, engines, ops):
    register(client, ops)
    status, body = answer(client.get("/kv-indexer/dump"))
    assert status == 200 and body == {
        "m:default": {**DYNAMO["dump, one empty model"][1]["m:default"], "blocks": {}}
    }
    Pod.objects.create(pod_id="7b", model=MODEL, registered=True)
    invalidate_service_config()
    engines.cache("7b", list(range(3 * BLOCK_SIZE)))
    engines.cache("7b", list(range(BLOCK_SIZE)), rank=2, tier="cpu")
    blocks = client.get("/kv-indexer/dump").json()[f"{MODEL}:default"]["blocks"]
    assert blocks == {"7b": {"0": {"gpu": 3}, "2": {"cpu": 1}}}


def test_dump_lists_recorded_blocks_as_dynamos_stored_events(client, index, engines, dynamo_blocks):
    for pod in ("7", "8", "9", "sim-0"):
        Pod.objects.create(pod_id=pod, model=MODEL, registered=True, enabled=pod != "9")
    invalidate_service_config()
    tokens = list(range(1000, 1000 + 4 * BLOCK_SIZE))
    engines.cache("7", tokens)
    engines.cache("7", tokens[: 2 * BLOCK_SIZE], rank=1)
    engines.cache("8", tokens[: 3 * BLOCK_SIZE], tier="cpu")
    salted = list(range(7000, 7000 + 2 * BLOCK_SIZE))
    engines.cache("8", salted, extra_keys=block_extra_keys(2, cache_salt="tenant-42"))
    engines.cache("9", tokens)  # disabled: out of scores, out of the events
    engines.cache("sim-0", tokens)  # Dynamo's worker_id is a number: not this pod

    def stored(worker, rank, tier, keys, hashes):
        """Dynamo's dump entry of one chain (``event_id`` aside: it numbers the events in order)."""
        blocks = [
            {"block_hash": k, "tokens_hash": h, "mm_extra_info": None}
            for k, h in zip(keys, hashes, strict=True)
        ]
        return {
            "worker_id": worker,
            "storage_tier": tier,
            "residency_domain": "worker",
            "event": {
                "event_id": None,
                "data": {"stored": {"parent_hash": None, "start_position": None, "blocks": blocks}},
                "dp_rank": rank,
            },
        }

    keys = block_keys(tokens, seed=SEED)
    hashes = dynamo_block_hashes(tokens, block_size=BLOCK_SIZE)
    salted_keys = block_keys(salted, seed=SEED, cache_salt="tenant-42")
    salted_hashes = dynamo_block_hashes(
        salted, block_size=BLOCK_SIZE, seed=block_hash_seed(cache_salt="tenant-42")
    )
    dump = client.get("/kv-indexer/dump").json()[f"{MODEL}:default"]
    by_worker = sorted(
        dump["events"], key=lambda e: (e["worker_id"], e["event"]["dp_rank"], e["storage_tier"])
    )
    assert [e["event"]["event_id"] for e in dump["events"]] == [0, 1, 2, 3]
    for event in by_worker:
        event["event"]["event_id"] = None
    assert by_worker == [
        stored(7, 0, "device", keys, hashes),
        stored(7, 1, "device", keys[:2], hashes[:2]),
        stored(8, 0, "device", salted_keys, salted_hashes),
        stored(8, 0, "host_pinned", keys[:3], hashes[:3]),
    ]
    assert dump["blocks"]["sim-0"] == {"0": {"gpu": 4}}


def test_the_reads_need_an_api_key_when_keys_are_set(client, index, settings):
    settings.KVCACHE_API_KEYS = ["k1"]
    query = {"token_ids": [1], "model_name": "m"}
    assert send(client, "/kv-indexer/query", query).status_code == 401
    assert client.get("/kv-indexer/workers").status_code == 401
    assert client.get("/kv-indexer/dump").status_code == 401
    assert client.get("/kv-indexer/workers", HTTP_AUTHORIZATION="Bearer k1").status_code == 200
    assert send(client, "/kv-indexer/query", query, HTTP_AUTHORIZATION="Bearer k1").status_code == 404


def test_the_openapi_schema_documents_the_kv_indexer_api(client, index, ops):
    paths = client.get("/api/schema/", {"format": "json"}, HTTP_AUTHORIZATION=ops).json()["paths"]
    for path in ("register", "unregister", "workers", "query", "query_by_hash", "dump"):
        assert f"/kv-indexer/{path}" in paths
