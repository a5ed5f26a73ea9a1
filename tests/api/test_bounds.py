"""Every hostile input gets a clear 4xx within a bound, and leaves nothing behind: names are
length-checked before any cache, tokenizer or index sees them, JSON depth is limited, prompts
longer than the model's context are refused, request templates run under a budget."""

from __future__ import annotations

import time

import pytest

from kvindex import open_index
from registry import runtime
from registry.models import ModelConfig
from registry.services import save_model_config
from scoring.fastpath import metrics
from tests.api.conftest import MODEL, post


@pytest.fixture(autouse=True)
def index():
    runtime.set_index(open_index("memory://"))
    yield
    runtime.set_index(None)


def answered(client, path: str, body: object, status: int, code: str, *, within: float = 2.0) -> dict:
    started = time.monotonic()
    response = post(client, path, body) if not isinstance(body, bytes) else client.post(path, body)
    elapsed = time.monotonic() - started
    assert response.status_code == status, response.content[:500]
    error = response.json()["error"]
    assert error["code"] == code
    assert elapsed < within, f"answered in {elapsed:.2f}s"
    return error


# --- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "{" * 200_000, "token_ids": [1] * 8000}, "model"),
        ({"model": MODEL, "token_ids": [1] * 16, "lora_name": "L" * 1_000_000}, "lora_name"),
        ({"model": MODEL, "token_ids": [1] * 16, "pods": ["p" * 300]}, "pods"),
    ],
)
def test_names_over_256_characters_are_refused_before_anything_is_looked_up(client, body, field):
    error = answered(client, "/api/v1/score", body, 400, "invalid_request", within=1.0)
    assert field in error["fields"]
    assert "256" in error["message"]


def test_unknown_models_leave_no_cache_entry_behind(client, tokenizers):
    cached = tokenizers.cached_models()
    stored = len(tokenizers.prefix_store)
    for i in range(50):
        answered(
            client,
            "/score_completions",
            {"model": f"nobody/model-{i}", "prompt": "hi"},
            404,
            "model_not_found",
        )
    assert tokenizers.cached_models() == cached
    assert len(tokenizers.prefix_store) == stored


def test_model_labels_in_metrics_stay_bounded(monkeypatch):
    monkeypatch.setattr(metrics, "_model_labels", set())  # this process's labels stay as they were
    labels = {metrics.model_label(f"Qwen/Qwen3-fake-{i}") for i in range(metrics.MAX_MODEL_LABELS * 3)}
    assert len(labels) == metrics.MAX_MODEL_LABELS + 1
    assert metrics.OTHER_MODELS in labels
    assert metrics.model_label("Qwen/Qwen3-fake-0") == "Qwen/Qwen3-fake-0"  # a labelled model keeps its label


# --- JSON ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 1025, 5000, 100_000])
def test_deeply_nested_json_is_a_400_not_a_500(client, depth):
    body = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    error = answered(client, "/api/v1/score", body, 400, "invalid_json")
    assert "nested deeper than 64" in error["message"]


def test_token_ids_nested_1000_deep_are_a_400(client):
    body = b'{"model": "m", "token_ids": [1, ' + b"[" * 1000 + b"]" * 1000 + b"]}"
    answered(client, "/api/v1/score", body, 400, "invalid_json")


def test_brackets_inside_strings_do_not_count_as_depth(client):
    prompt = "[[[[{{{{" * 100
    response = post(client, "/api/v1/score", {"model": MODEL, "prompt": prompt})
    assert response.status_code == 200, response.content


# --- context length -----------------------------------------------------------------------------


def test_a_prompt_longer_than_the_model_config_context_is_a_400_naming_the_limit(client):
    save_model_config(ModelConfig(name=MODEL, max_model_len=100))
    error = answered(
        client, "/score_completions", {"model": MODEL, "prompt": "word " * 500}, 400, "invalid_request"
    )
    assert "100" in error["message"] and "context length" in error["message"]
    error = answered(
        client, "/api/v1/score", {"model": MODEL, "token_ids": [1] * 101}, 400, "invalid_request"
    )
    assert "context length of 100" in error["message"]
    assert post(client, "/api/v1/score", {"model": MODEL, "token_ids": [1] * 100}).status_code == 200


def test_without_a_model_config_the_tokenizer_configs_model_max_length_holds(client, tokenizers):
    limit = tokenizers.get(MODEL).model_max_length
    assert limit == 131072  # Qwen3's tokenizer_config.json
    error = answered(
        client, "/api/v1/score", {"model": MODEL, "token_ids": [1] * (limit + 1)}, 400, "invalid_request"
    )
    assert str(limit) in error["message"]


def test_a_1_mb_prompt_is_refused_quickly(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 24_000  # ~1.1 MB, ~240k tokens
    error = answered(
        client, "/score_completions", {"model": MODEL, "prompt": prompt}, 400, "invalid_request", within=5
    )
    assert "131072" in error["message"]


# --- request templates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "status", "code"),
    [
        ("{{ (9**(9**8)) % 2 }}", 422, "template_budget_exceeded"),
        ("{{ 'a'*10**9 }}", 422, "template_budget_exceeded"),
        ("{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}", 422, None),
        ("{{ 1/0 }}", 400, "invalid_chat"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", 400, None),
        ("{{ range(10**6)|length }}", 400, None),
    ],
)
def test_a_hostile_request_template_is_a_4xx_within_a_bound(client, template, status, code):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    started = time.monotonic()
    response = post(client, "/score_chat_completions", body)
    assert time.monotonic() - started < 3.0
    assert 400 <= response.status_code < 500, response.content
    if code is not None:
        assert response.status_code == status
        assert response.json()["error"]["code"] == code


def test_request_templates_can_be_refused_altogether(client, settings):
    settings.KVCACHE_REQUEST_TEMPLATES = False
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}
    error = answered(client, "/score_chat_completions", body, 400, "request_template_refused")
    assert "KVCACHE_REQUEST_TEMPLATES" in error["message"]
    del body["chat_template"]
    assert post(client, "/score_chat_completions", body).status_code == 200  # the model's own still renders
