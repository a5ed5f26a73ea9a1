"""Every failure is an answer in one shape, ``{"error": {"code", "message"}}``, with the status
that says whose fault it is and a message that says what to fix."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest

from kvindex import open_index
from registry import runtime
from registry.models import ModelConfig
from tests.api.conftest import MODEL, post
from tests.servers import free_port


@pytest.fixture(autouse=True)
def index():
    """Errors do not depend on the backend: the in-memory one (the 503 test installs its own)."""
    runtime.set_index(open_index("memory://"))
    yield
    runtime.set_index(None)


def error_of(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


# --- 400: the body is wrong, and the answer names the field ------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "fields"),
    [
        ("/score_completions", {"model": MODEL}, {"prompt"}),  # upstream crashes on this one
        ("/score_completions", {"prompt": "text"}, {"model"}),
        ("/score_completions", {}, {"model", "prompt"}),
        ("/score_completions", {"model": MODEL, "prompt": ""}, {"prompt"}),
        ("/score_completions", {"model": MODEL, "prompt": 42}, {"prompt"}),
        ("/score_chat_completions", {"model": MODEL}, {"messages"}),
        ("/score_chat_completions", {"model": MODEL, "messages": []}, {"messages"}),
        ("/score_chat_completions", {"model": MODEL, "messages": [{"content": "no role"}]}, {"messages"}),
        (
            "/score_chat_completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
            {"messages"},
        ),
        ("/api/v1/score", {"model": MODEL}, {"non_field_errors"}),
        ("/api/v1/score", {"model": MODEL, "prompt": "a", "token_ids": [1]}, {"non_field_errors"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": []}, {"token_ids"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": [1, "2"]}, {"token_ids"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": [1, True]}, {"token_ids"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": [1, -5]}, {"token_ids"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": [2**64]}, {"token_ids"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": [1], "pods": []}, {"pods"}),
        ("/api/v1/score", {"model": MODEL, "token_ids": [1], "tools": [{}]}, {"tools"}),
        (
            "/api/v1/score",
            {"model": MODEL, "prompt": "a", "add_generation_prompt": True},
            {"add_generation_prompt"},
        ),
    ],
)
def test_an_invalid_body_is_a_400_naming_each_wrong_field(client, path, body, fields):
    error = error_of(post(client, path, body), 400, "invalid_request")
    assert set(error["fields"]) == fields
    for name in fields - {"non_field_errors"}:
        assert name in error["message"]


def test_a_bad_token_id_is_pointed_at(client):
    error = error_of(
        post(client, "/api/v1/score", {"model": MODEL, "token_ids": [1, 2, "x"]}), 400, "invalid_request"
    )
    assert "token_ids[2]" in error["message"]


def test_a_body_that_is_not_json_is_a_400(client):
    response = client.post("/score_completions", data=b'{"model": ', content_type="application/json")
    assert "not valid JSON" in error_of(response, 400, "invalid_json")["message"]


def test_a_body_sent_as_curl_sends_it_by_default_is_still_read_as_json(client):
    body = b'{"model": "Qwen/Qwen3-0.6B"}'
    response = client.post("/score_completions", data=body, content_type="application/x-www-form-urlencoded")
    assert set(error_of(response, 400, "invalid_request")["fields"]) == {"prompt"}


def test_a_conversation_the_template_refuses_is_a_400(client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": "{% if %}",
    }
    assert (
        "chat_template"
        in error_of(post(client, "/score_chat_completions", body), 400, "invalid_chat")["message"]
    )
    both = {**body, "chat_template": None, "add_generation_prompt": True, "continue_final_message": True}
    error_of(post(client, "/score_chat_completions", both), 400, "invalid_chat")


def test_a_wrong_method_is_a_405_in_our_shape(client):
    error_of(client.get("/score_completions"), 405, "method_not_allowed")


# --- 401: API keys ----------------------------------------------------------------------------


def test_without_api_keys_configured_scoring_is_open(client):
    assert post(client, "/api/v1/score", {"model": MODEL, "token_ids": [1] * 16}).status_code == 200


@pytest.mark.parametrize("path", ["/score_completions", "/score_chat_completions", "/api/v1/score"])
def test_with_api_keys_configured_scoring_needs_a_bearer_key(client, settings, path):
    settings.KVCACHE_API_KEYS = ["key-one", "key-two"]
    body = {"model": MODEL, "prompt": "hello", "messages": [{"role": "user", "content": "hi"}]}
    if path == "/api/v1/score":
        body = {"model": MODEL, "token_ids": [1] * 16}

    missing = post(client, path, body)
    assert "Authorization: Bearer" in error_of(missing, 401, "unauthenticated")["message"]
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    error_of(post(client, path, body, HTTP_AUTHORIZATION="Bearer wrong"), 401, "unauthenticated")
    error_of(post(client, path, body, HTTP_AUTHORIZATION="Basic a2V5LW9uZTo="), 401, "unauthenticated")
    assert post(client, path, body, HTTP_AUTHORIZATION="Bearer key-two").status_code == 200


# --- 403: the registry is for staff --------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/v1/pods/"),
        ("post", "/api/v1/pods/"),
        ("get", "/api/v1/models/"),
        ("get", "/api/v1/hash-seed/"),
        ("put", "/api/v1/hash-seed/"),
    ],
)
def test_registry_endpoints_are_401_anonymous_and_403_for_non_staff(client, django_user_model, method, path):
    send = getattr(client, method)
    error_of(send(path) if method == "get" else send(path, {}), 401, "unauthenticated")
    client.force_login(django_user_model.objects.create_user("viewer", password="pw"))
    error_of(send(path) if method == "get" else send(path, {}), 403, "forbidden")


def test_registry_endpoints_accept_http_basic_auth_of_staff(client, django_user_model):
    django_user_model.objects.create_user("ops", password="ops-pw", is_staff=True)
    client.credentials(HTTP_AUTHORIZATION="Basic b3BzOm9wcy1wdw==")  # ops:ops-pw
    assert client.get("/api/v1/pods/").status_code == 200


def test_api_keys_do_not_open_the_registry(client, settings):
    settings.KVCACHE_API_KEYS = ["key-one"]
    client.credentials(HTTP_AUTHORIZATION="Bearer key-one")
    error_of(client.get("/api/v1/pods/"), 401, "unauthenticated")


# --- 404: unknown model, at once ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/score_completions", {"prompt": "hello there"}),
        ("/score_chat_completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/api/v1/score", {"prompt": "hello there"}),
    ],
)
def test_an_unknown_model_is_a_404_in_under_a_second(client, path, body):
    started = time.monotonic()
    response = post(client, path, {"model": "nobody/unknown-model", **body})
    elapsed = time.monotonic() - started

    error = error_of(response, 404, "model_not_found")
    assert "nobody/unknown-model" in error["message"]
    assert elapsed < 1.0


def test_a_missing_registry_object_is_a_404(staff):
    error_of(staff.get("/api/v1/pods/no-such-pod/"), 404, "not_found")
    error_of(staff.get("/api/v1/models/no/such-model/"), 404, "not_found")


# --- 413: body size ---------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413(client, settings):
    settings.KVCACHE_MAX_BODY_BYTES = 1000
    small = {"model": MODEL, "token_ids": [1] * 16}
    assert post(client, "/api/v1/score", small).status_code == 200

    big = {"model": MODEL, "prompt": "x" * 1000}
    assert "1000 bytes" in error_of(post(client, "/score_completions", big), 413, "body_too_large")["message"]


# --- 422: a tokenizer that does not load -------------------------------------------------------------


def test_a_tokenizer_that_does_not_load_is_a_422(client, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"this is": "not a tokenizer"}')
    # The registry refuses such a source (tests/api/test_registry.py); a file that broke after it
    # was accepted, or a row written before that check, still reaches scoring.
    ModelConfig.objects.create(name="broken/model", tokenizer_source=str(broken))

    response = post(client, "/score_completions", {"model": "broken/model", "prompt": "hello"})
    assert str(broken) in error_of(response, 422, "tokenizer_load_failed")["message"]


# --- 503: the index is down --------------------------------------------------------------------------


def test_with_the_index_unreachable_scoring_is_a_503_and_not_ready(client, base_capture, caplog):
    port = free_port()  # nothing listens there
    runtime.set_index(open_index(f"redis://127.0.0.1:{port}/0?socket_connect_timeout=0.5"))
    try:
        body = {"model": MODEL, "prompt": base_capture["prompt"]}
        ids = {"model": MODEL, "token_ids": [1] * 32}
        answers = [
            error_of(post(client, "/score_completions", body), 503, "index_unavailable"),
            error_of(post(client, "/api/v1/score", ids), 503, "index_unavailable"),
        ]
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "not_ready"
        assert ready.json()["checks"] == {"index": "index unreachable", "database": "ok"}
    finally:
        runtime.set_index(None)
    # What is wrong, not where: the index's address is in the server's log only.
    for text in [*(answer["message"] for answer in answers), ready.content.decode()]:
        assert str(port) not in text and "127.0.0.1" not in text
    assert f"127.0.0.1:{port}" in caplog.text


@contextlib.contextmanager
def frozen_index(settings, **query: str) -> Iterator[None]:
    """A Redis index that accepts connections and never answers (a server stopped with SIGSTOP,
    a hung proxy), opened from the settings as a server process opens its index. Should a request
    still wait after 5 s, the listener closes (the request then fails, late) rather than hang."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:  # never accepts
        settings.REDIS_URL = f"redis://127.0.0.1:{listener.getsockname()[1]}/0?{urlencode(query)}"
        settings.KVCACHE_INDEX_BACKEND = "redis"
        runtime.set_index(None)
        guard = threading.Timer(5, listener.close)
        guard.start()
        try:
            yield
        finally:
            guard.cancel()
            runtime.get_index().close()
            runtime.set_index(None)


def seconds_to_a_503(client) -> float:
    started = time.monotonic()
    response = post(client, "/api/v1/score", {"model": MODEL, "token_ids": [1] * 32})
    error_of(response, 503, "index_unavailable")
    return time.monotonic() - started


def test_a_frozen_index_is_a_503_within_the_index_timeout(client, settings):
    assert settings.KVCACHE_INDEX_TIMEOUT <= 1
    with frozen_index(settings):
        assert seconds_to_a_503(client) < 2
    settings.KVCACHE_INDEX_TIMEOUT = 30  # a timeout in REDIS_URL wins over the setting
    with frozen_index(settings, socket_timeout="0.3", socket_connect_timeout="0.3"):
        assert seconds_to_a_503(client) < 2
