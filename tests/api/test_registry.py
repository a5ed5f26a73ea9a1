"""The registry over HTTP, for staff: pods, model configs and the hash seed, with the same effects
on the index as the admin's edits, and visible to scoring within a config refresh."""

from __future__ import annotations

import time
from urllib.parse import quote

import pytest
import redis

from kvindex.keys import block_keys
from kvindex.shared_stats import publish_snapshot
from kvsite.drf import json_depth_exceeds
from registry.models import HashSeed, ModelConfig, Pod
from registry.runtime import CONFIG_REFRESH_SECONDS
from registry.selectors import load_service_config
from tests.api.conftest import MODEL, SEED, post
from tests.tokenization import train_tiny_tokenizer


def held_by(index, pod: str) -> int:
    return sum(row.total for row in index.pod_blocks() if row.pod == pod)


def scores(client, capture: dict) -> dict:
    response = post(client, "/api/v1/score", {"model": MODEL, "token_ids": capture["token_ids"]})
    assert response.status_code == 200
    return response.json()["scores"]


def eventually(condition, *, within: float) -> float:
    """Seconds until ``condition()`` held; fails after ``within`` seconds."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, f"not within {within}s"
        time.sleep(0.05)
    return time.monotonic() - started


# --- pods ---------------------------------------------------------------------------------------


def test_staff_create_read_update_and_delete_a_pod(staff, index):
    created = staff.post(
        "/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL, "address": "10.0.0.1:8000"}, format="json"
    )
    assert created.status_code == 201
    assert created.json()["enabled"] is True
    assert staff.get("/api/v1/pods/pod-a/").json()["address"] == "10.0.0.1:8000"

    patched = staff.patch("/api/v1/pods/pod-a/", {"labels": {"zone": "b"}}, format="json")
    assert patched.json()["labels"] == {"zone": "b"}
    replaced = staff.put("/api/v1/pods/pod-a/", {"pod_id": "pod-a", "model": "other/model"}, format="json")
    assert (replaced.json()["model"], replaced.json()["address"]) == ("other/model", "")

    assert staff.delete("/api/v1/pods/pod-a/").status_code == 204
    assert not Pod.objects.filter(pod_id="pod-a").exists()


def test_a_pods_replay_endpoint_is_set_through_the_api_and_reaches_ingests_config(staff, index):
    staff.post("/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL}, format="json")
    patched = staff.patch("/api/v1/pods/pod-a/", {"replay_endpoint": "tcp://10.0.0.1:5558"}, format="json")
    assert patched.status_code == 200
    assert patched.json()["replay_endpoint"] == "tcp://10.0.0.1:5558"
    assert patched.json()["health"] == "unknown"
    assert load_service_config().replay_endpoints == {"pod-a": "tcp://10.0.0.1:5558"}
    # health belongs to the prober: the API reads it, never writes it
    staff.patch("/api/v1/pods/pod-a/", {"health": "down"}, format="json")
    assert Pod.objects.get(pod_id="pod-a").health == "unknown"


def test_a_pod_id_is_unique_and_cannot_be_renamed(staff, index):
    staff.post("/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL}, format="json")

    duplicate = staff.post("/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL}, format="json")
    assert duplicate.status_code == 400
    assert "pod_id" in duplicate.json()["error"]["fields"]
    renamed = staff.patch("/api/v1/pods/pod-a/", {"pod_id": "pod-b"}, format="json")
    assert renamed.status_code == 400
    assert renamed.json()["error"]["fields"] == {"pod_id": ["cannot be changed"]}


def test_the_pod_list_shows_live_blocks_by_tier_and_ingest_streams(staff, engines, base_capture, redis_url):
    Pod.objects.create(pod_id="pod-a", model=MODEL)
    Pod.objects.create(pod_id="pod-quiet", model=MODEL)
    engines.cache_capture("pod-a", base_capture)
    engines.cache("pod-a", base_capture["token_ids"][:64], tier="cpu", rank=1)  # a data-parallel rank
    stream = {**engines.applier.stats.stream("pod-a", 0, MODEL).as_dict()}
    publish_snapshot(
        redis.Redis.from_url(redis_url),
        {"at": time.time(), "streams": [stream], "unattributed_errors": {}, "queue_full": {}},
        instance="ingest-1",
    )

    listed = {row["pod_id"]: row for row in staff.get("/api/v1/pods/").json()}
    assert listed["pod-a"]["blocks_by_tier"] == {"gpu": 25, "cpu": 4}
    assert listed["pod-quiet"]["blocks_by_tier"] == {}
    if engines.index.__class__.__name__ != "MemoryIndex":  # the stats live in Redis beside a shared index
        assert [s["blocks_stored"] for s in listed["pod-a"]["streams"]] == [25]
        assert listed["pod-quiet"]["streams"] == []


def test_disabling_a_pod_through_the_api_removes_its_blocks_and_its_scores(
    staff, client, engines, base_capture
):
    Pod.objects.create(pod_id="pod-b", model=MODEL)
    engines.cache_capture("pod-a", base_capture)
    engines.cache_capture("pod-b", base_capture)
    assert scores(client, base_capture) == {"pod-a": 25.0, "pod-b": 25.0}

    response = staff.patch("/api/v1/pods/pod-b/", {"enabled": False}, format="json")
    assert response.json()["blocks_by_tier"] == {}
    assert held_by(engines.index, "pod-b") == 0
    assert eventually(lambda: scores(client, base_capture) == {"pod-a": 25.0}, within=5) < 5


def test_deleting_a_pod_through_the_api_removes_its_blocks(staff, engines, base_capture):
    Pod.objects.create(pod_id="pod-a", model=MODEL)
    engines.cache_capture("pod-a", base_capture)

    assert staff.delete("/api/v1/pods/pod-a/").status_code == 204
    assert held_by(engines.index, "pod-a") == 0


# --- model configs ---------------------------------------------------------------------------------


def test_staff_create_read_update_and_delete_a_model_config(staff, index):
    created = staff.post("/api/v1/models/", {"name": MODEL, "block_size": 16}, format="json")
    assert created.status_code == 201
    assert created.json()["tier_weights"] == {"gpu": 1.0, "cpu": 0.8}
    assert staff.get("/api/v1/models/").json()[0]["name"] == MODEL
    assert staff.get(f"/api/v1/models/{MODEL}/").json()["block_size"] == 16

    patched = staff.patch(f"/api/v1/models/{MODEL}/", {"lora_adapters": ["Alice"]}, format="json")
    assert patched.json()["lora_adapters"] == ["Alice"]
    assert staff.delete(f"/api/v1/models/{MODEL}/").status_code == 204
    assert not ModelConfig.objects.exists()


def test_a_bad_model_config_is_a_400_naming_the_field(staff, index):
    response = staff.post("/api/v1/models/", {"name": MODEL, "tier_weights": {"gpu": -1}}, format="json")
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) == {"tier_weights"}
    response = staff.post("/api/v1/models/", {"name": MODEL, "block_size": 0}, format="json")
    assert set(response.json()["error"]["fields"]) == {"block_size"}


def test_lookahead_hashing_is_a_model_setting_of_0_to_64_tokens(staff, index):
    created = staff.post("/api/v1/models/", {"name": MODEL}, format="json")
    assert created.json()["hash_lookahead_tokens"] == 0
    patched = staff.patch(f"/api/v1/models/{MODEL}/", {"hash_lookahead_tokens": 2}, format="json")
    assert patched.status_code == 200
    assert patched.json()["hash_lookahead_tokens"] == 2
    assert load_service_config().model(MODEL).hash_lookahead_tokens == 2
    for wrong in (65, -1, "two"):
        refused = staff.patch(f"/api/v1/models/{MODEL}/", {"hash_lookahead_tokens": wrong}, format="json")
        assert refused.status_code == 400
        assert set(refused.json()["error"]["fields"]) == {"hash_lookahead_tokens"}
    assert ModelConfig.objects.get().hash_lookahead_tokens == 2


def test_a_hybrid_model_s_groups_set_through_the_api_score_with_vllm_s_hybrid_hit(
    staff, client, engines, base_capture
):
    """Full attention holds the capture; its 32-token sliding window kept only its last 2 blocks.
    A prompt that ends earlier needs the window's blocks before its end: once the model config
    describes the groups, it no longer scores (vLLM would recompute it)."""
    ids = base_capture["token_ids"]
    n = engines.cache("pod-a", ids, group_idx=0)
    engines.cache("pod-a", ids, group_idx=1)
    engines.evict("pod-a", block_keys(ids, seed=SEED, block_size=16)[: n - 2], group_idx=1)
    shorter = {"token_ids": [*ids[: 10 * 16], 7]}
    assert scores(client, shorter) == {"pod-a": 10.0}  # no groups configured: full attention alone

    groups = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 32}]
    created = staff.post("/api/v1/models/", {"name": MODEL, "kv_cache_groups": groups}, format="json")
    assert created.status_code == 201
    assert (created.json()["kv_cache_groups"], created.json()["learned_kv_cache_groups"]) == (groups, [])
    assert scores(client, shorter) == {}
    assert scores(client, base_capture) == {"pod-a": float(n)}
    metrics = client.get("/metrics").content.decode()
    assert f'kvcache_pod_blocks{{model="{MODEL}",pod="pod-a",tier="gpu"}} {n}.0' in metrics
    assert "pod-a#g1" not in metrics  # the window's blocks repeat full attention's


@pytest.mark.parametrize(
    ("groups", "says"),
    [
        ([{"kind": "sliding_window", "sliding_window": 32}], "group 0 must be full attention"),
        ([{"kind": "full_attention"}, {"kind": "sliding_window"}], "needs its sliding_window"),
        ("full_attention", "must be a list"),
    ],
)
def test_kv_cache_groups_the_scorer_cannot_follow_are_refused(staff, index, groups, says):
    refused = staff.post("/api/v1/models/", {"name": MODEL, "kv_cache_groups": groups}, format="json")
    assert refused.status_code == 400
    assert says in str(refused.json()["error"]["fields"]["kv_cache_groups"])
    learned = staff.post(
        "/api/v1/models/", {"name": MODEL, "learned_kv_cache_groups": [{"kind": "mamba"}]}, format="json"
    )
    assert learned.status_code == 201 and learned.json()["learned_kv_cache_groups"] == []  # read-only


def test_a_lookahead_changed_through_the_api_keys_requests_with_it(staff, client, engines, base_capture):
    """The pod's engine hashes with 2 lookahead tokens (its events send them): scoring finds its
    blocks once the model config says so, and its blocks stay indexed through the change."""
    ids = base_capture["token_ids"]
    n = (len(ids) - 2) // 16
    after = [ids[(i + 1) * 16 : (i + 1) * 16 + 2] for i in range(n)]
    engines.cache("pod-a", ids, extra_keys=[None] * n, lookahead_token_ids=after)
    assert scores(client, base_capture) == {}

    staff.post("/api/v1/models/", {"name": MODEL, "hash_lookahead_tokens": 2}, format="json")
    assert scores(client, base_capture) == {"pod-a": float(n)}


def test_tier_weights_changed_through_the_api_score_within_5_seconds(staff, client, engines, base_capture):
    engines.cache_capture("pod-cpu", base_capture, tier="cpu")
    assert scores(client, base_capture) == {"pod-cpu": pytest.approx(25 * 0.8)}

    staff.post("/api/v1/models/", {"name": MODEL, "tier_weights": {"cpu": 0.5}}, format="json")
    assert eventually(lambda: scores(client, base_capture) == {"pod-cpu": 12.5}, within=5) < 5


@pytest.mark.parametrize("index", ["memory"], indirect=True)  # waits for a refresh: one backend is enough
def test_a_change_made_by_another_process_is_picked_up_by_the_config_refresh(client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)
    assert scores(client, base_capture) == {"pod-a": 25.0}

    # Another process (an admin on another replica) disables the pod: nothing tells this one.
    Pod.objects.create(pod_id="pod-a", model=MODEL, enabled=False)
    took = eventually(lambda: scores(client, base_capture) == {}, within=5)
    assert took <= CONFIG_REFRESH_SECONDS + 0.5


def test_a_new_block_size_clears_the_models_blocks(staff, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)

    staff.post("/api/v1/models/", {"name": MODEL, "block_size": 32}, format="json")
    assert held_by(engines.index, "pod-a") == 0


# --- hash seed ---------------------------------------------------------------------------------


def test_changing_the_hash_seed_clears_the_index_and_rekeys_prompts(staff, client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)
    assert staff.get("/api/v1/hash-seed/").json()["value"] == "42"

    response = staff.put("/api/v1/hash-seed/", {"value": "7"}, format="json")
    assert response.status_code == 200
    assert response.json()["value"] == "7"
    assert held_by(engines.index, "pod-a") == 0

    # Blocks an engine hashes with the old seed no longer match: prompts are keyed with "7".
    engines.cache_capture("pod-a", base_capture)
    assert eventually(lambda: scores(client, base_capture) == {}, within=5) < 5


def test_setting_the_same_hash_seed_keeps_the_index(staff, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)

    assert staff.patch("/api/v1/hash-seed/", {"value": "42"}, format="json").status_code == 200
    assert held_by(engines.index, "pod-a") == 25


PROMPT = "A prompt long enough to make a block or two of tokens."  # 13 Qwen3 tokens, 40 tiny ones


def blocks_of_prompt(client, model: str) -> int:
    response = post(client, "/api/v1/score", {"model": model, "prompt": PROMPT})
    assert response.status_code == 200, response.content
    return response.json()["blocks"]


def test_a_new_tokenizer_source_takes_effect_within_5_seconds(staff, client, index, tmp_path):
    staff.post("/api/v1/models/", {"name": "qwen-small", "tokenizer_source": MODEL}, format="json")
    assert blocks_of_prompt(client, "qwen-small") == 0

    train_tiny_tokenizer(tmp_path)
    response = staff.patch("/api/v1/models/qwen-small/", {"tokenizer_source": str(tmp_path)}, format="json")
    assert response.status_code == 200, response.content
    assert eventually(lambda: blocks_of_prompt(client, "qwen-small") == 2, within=5) < 5


# --- request bodies: depth-limited JSON on every DRF endpoint ---------------------------------------

memory_index = pytest.mark.parametrize("index", ["memory"], indirect=True)  # parsing precedes the index


def nested(depth: int, *, kind: str = "array") -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


@memory_index
@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("depth", [65, 1025, 5_000, 100_000])
def test_json_nested_deeper_than_the_limit_is_a_400_at_once(staff, index, depth, kind):
    started = time.monotonic()
    response = staff.post("/api/v1/pods/", data=nested(depth, kind=kind), content_type="application/json")
    elapsed = time.monotonic() - started

    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == "invalid_json"
    assert "nested deeper than 64 levels" in response.json()["error"]["message"]
    assert elapsed < 0.5


@memory_index
@pytest.mark.parametrize(("method", "path"), [("post", "/api/v1/models/"), ("put", "/api/v1/hash-seed/")])
def test_deep_json_is_a_400_on_every_registry_endpoint(staff, index, method, path):
    response = getattr(staff, method)(path, data=nested(5_000), content_type="application/json")
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")


@memory_index
def test_json_nested_up_to_the_limit_is_parsed(staff, index, settings):
    settings.KVCACHE_MAX_JSON_DEPTH = 3
    body = '{"pod_id": "pod-a", "model": "m", "labels": {"zone": "b"}}'  # 2 deep
    assert staff.post("/api/v1/pods/", data=body, content_type="application/json").status_code == 201

    deeper = '{"pod_id": "pod-b", "model": "m", "labels": {"zone": {"rack": ["b"]}}}'  # 4 deep
    response = staff.post("/api/v1/pods/", data=deeper, content_type="application/json")
    assert "nested deeper than 3 levels" in response.json()["error"]["message"]


def test_json_depth_exceeds_counts_nested_arrays_and_objects():
    assert not json_depth_exceeds(b"[]", [], 1)
    assert json_depth_exceeds(b"[[]]", [[]], 1)
    assert not json_depth_exceeds(b'{"a": [1, {"b": 2}]}', {"a": [1, {"b": 2}]}, 3)
    assert json_depth_exceeds(b'{"a": [1, {"b": []}]}', {"a": [1, {"b": []}]}, 3)
    # Brackets inside strings are only counted by the shortcut, never as depth.
    assert not json_depth_exceeds(b'["[[[[{{{{"]', ["[[[[{{{{"], 1)
    deep: list = []
    for _ in range(100_000):  # walked without recursion
        deep = [deep]
    assert json_depth_exceeds(b"[" * 100_001, deep, 64)


# --- what the registry refuses: a 400 naming the field, nothing stored ------------------------------


def broken_tokenizer(tmp_path) -> str:
    (tmp_path / "tokenizer.json").write_text('{"this is": "not a tokenizer"}')
    return str(tmp_path)


@memory_index
@pytest.mark.parametrize(
    ("source", "answer"),
    [
        ("/models/qwen3", "/models/qwen3 has no tokenizer.json"),  # the README's example
        ("nobody/unknown-model", "hub: disabled"),  # an alias no source has (no network)
        (broken_tokenizer, "could not be loaded"),
    ],
)
def test_a_tokenizer_source_that_does_not_load_is_refused_and_scoring_goes_on(
    staff, client, index, tmp_path, source, answer
):
    source = source if isinstance(source, str) else source(tmp_path)
    staff.post("/api/v1/models/", {"name": "qwen-small", "tokenizer_source": MODEL}, format="json")

    response = staff.patch("/api/v1/models/qwen-small/", {"tokenizer_source": source}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert set(error["fields"]) == {"tokenizer_source"}
    assert answer in error["message"]
    assert "KVCACHE_TOKENIZERS_DIR" in error["message"]  # what to do instead
    assert ModelConfig.objects.get().tokenizer_source == MODEL
    assert blocks_of_prompt(client, "qwen-small") == 0  # still scored with Qwen3

    created = staff.post("/api/v1/models/", {"name": "other", "tokenizer_source": source}, format="json")
    assert set(created.json()["error"]["fields"]) == {"tokenizer_source"}
    assert not ModelConfig.objects.filter(name="other").exists()


@memory_index
@pytest.mark.parametrize(
    ("changes", "field", "hint"),
    [
        ({"block_size": 2**40}, "block_size", "between 1 and 4096 tokens"),
        ({"block_size": 0}, "block_size", "between 1 and 4096 tokens"),
        ({"chat_template": "{% if %}"}, "chat_template", "is not valid Jinja (line 1)"),
        ({"chat_template": "{{ messages | no_such_filter }}"}, "chat_template", "No filter named"),
    ],
)
def test_a_model_config_that_cannot_work_is_a_400_saying_what_to_fix(staff, index, changes, field, hint):
    created = staff.post("/api/v1/models/", {"name": MODEL, **changes}, format="json")
    assert created.status_code == 400
    assert set(created.json()["error"]["fields"]) == {field}
    assert hint in created.json()["error"]["fields"][field][0]
    assert not ModelConfig.objects.exists()

    staff.post("/api/v1/models/", {"name": MODEL}, format="json")
    patched = staff.patch(f"/api/v1/models/{MODEL}/", changes, format="json")
    assert set(patched.json()["error"]["fields"]) == {field}
    assert (ModelConfig.objects.get().block_size, ModelConfig.objects.get().chat_template) == (16, "")


@memory_index
def test_a_chat_template_that_compiles_is_accepted(staff, index):
    template = "{% for m in messages %}{% generation %}{{ m.content|tojson }}{% endgeneration %}{% endfor %}"
    response = staff.post("/api/v1/models/", {"name": MODEL, "chat_template": template}, format="json")
    assert response.status_code == 201, response.content


@memory_index
@pytest.mark.parametrize(
    ("body", "field", "hint"),
    [
        ({"pod_id": "a/b"}, "pod_id", "(not / # @ % or spaces)"),  # /api/v1/pods/a/b/ is no pod's URL
        ({"pod_id": "pod-a#dp1"}, "pod_id", "(not / # @ % or spaces)"),  # a data-parallel rank's name
        ({"pod_id": "pod@a"}, "pod_id", "(not / # @ % or spaces)"),  # a topic's pod ends at "@"
        ({"pod_id": "pod a"}, "pod_id", "(not / # @ % or spaces)"),
        ({"pod_id": ".."}, "pod_id", "must start with a letter, a digit or"),
        ({"labels": "x"}, "labels", 'must be an object of name -> string, e.g. {"zone": "b"}'),
        ({"labels": {"gpus": 8}}, "labels", "must be an object of name -> string"),
    ],
)
def test_a_pod_the_registry_cannot_serve_is_a_400_saying_what_to_fix(staff, index, body, field, hint):
    response = staff.post("/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL, **body}, format="json")
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) == {field}
    assert hint in response.json()["error"]["fields"][field][0]
    assert not Pod.objects.exists()


@memory_index
def test_labels_are_checked_on_every_write(staff, index):
    staff.post("/api/v1/pods/", {"pod_id": "pod-a", "model": MODEL, "labels": {"zone": "b"}}, format="json")
    response = staff.patch("/api/v1/pods/pod-a/", {"labels": ["zone", "b"]}, format="json")
    assert set(response.json()["error"]["fields"]) == {"labels"}
    assert Pod.objects.get().labels == {"zone": "b"}


@memory_index
@pytest.mark.parametrize("pod_id", ["vllm-0", "vllm_0.ns", "10.0.0.7:8000", "[fd00::7]:8000"])
def test_every_pod_id_the_registry_accepts_has_a_working_detail_url(staff, index, pod_id):
    assert staff.post("/api/v1/pods/", {"pod_id": pod_id, "model": MODEL}, format="json").status_code == 201
    url = f"/api/v1/pods/{quote(pod_id, safe=':')}/"  # IPv6 brackets as %5B %5D, as curl -g does not

    assert staff.get(url).json()["pod_id"] == pod_id
    assert staff.patch(url, {"enabled": False}, format="json").json()["enabled"] is False
    assert staff.delete(url).status_code == 204


# --- the README's registry examples, as written: safe against `make run` ----------------------------


@memory_index
def test_putting_back_the_seed_read_from_the_api_changes_nothing(staff, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)
    before = HashSeed.objects.get_or_create(pk=1)[0].updated_at

    current = staff.get("/api/v1/hash-seed/").json()  # {"value": ..., "updated_at": ...}
    response = staff.put("/api/v1/hash-seed/", current, format="json")
    assert response.status_code == 200
    assert response.json()["value"] == current["value"]
    assert held_by(engines.index, "pod-a") == 25
    assert HashSeed.objects.get().updated_at == before
