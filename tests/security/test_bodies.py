"""A body that is not UTF-8 is a 400 that says so, on every endpoint that takes a body (issue 27,
defect 10): the scoring endpoints (it was a 500 ``internal_error`` with a ``UnicodeDecodeError``
traceback on each), a batch's item, the registry API and the gateway; and the servers answer the
next valid request."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.security.web_stack import MODEL, Stack, running_stack

NOT_UTF8 = b'{"model": "\xff\xfe"}'  # the body
SCORING = ("/score_completions", "/score_chat_completions", "/api/v1/score", "/api/v1/score/batch")
REGISTRY = (
    ("POST", "/api/v1/pods/"),
    ("PATCH", "/api/v1/pods/pod-a/"),
    ("POST", "/api/v1/models/"),
    ("PATCH", f"/api/v1/models/{MODEL}/"),
    ("PUT", "/api/v1/hash-seed/"),
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server) -> Iterator[Stack]:
    redis_server.flush()
    with running_stack(tmp_path_factory.mktemp("bodies"), redis_server.url) as running:
        yield running


def not_utf8_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_json", error
    assert "not UTF-8" in error["message"], error
    return error


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(NOT_UTF8, id="issue"),
        pytest.param(b'{"model": "m", "prompt": "caf\xe9"}', id="latin-1"),
        pytest.param(
            b'{"model": "m", "token_ids": [1], "cache_salt": "\xed\xa0\x80"}', id="encoded-surrogate"
        ),
        pytest.param(b'{"requests": [], "x": "\xc3"}', id="truncated-sequence"),
        pytest.param(b"\xfe\xff\x00{", id="utf-16-bom"),
        pytest.param(
            json.dumps({"model": MODEL, "token_ids": [1]}).encode("utf-16"), id="valid-json-in-utf-16"
        ),
    ],
)
@pytest.mark.parametrize("path", SCORING)
def test_scoring_answers_a_body_that_is_not_utf8_400(stack: Stack, path: str, body: bytes) -> None:
    answer = stack.request("POST", path, body)
    assert answer.status == 400, answer
    not_utf8_error(answer.body)


def test_a_batch_item_that_is_not_utf8_is_its_own_400(stack: Stack) -> None:
    body = b'{"requests": [{"model": "\xff", "token_ids": [1]}, {"model": "m", "token_ids": [1]}]}'
    answer = stack.request("POST", "/api/v1/score/batch", body)
    assert answer.status == 200, answer
    first, second = json.loads(answer.body)["results"]
    assert first["status"] == 400 and "not UTF-8" in not_utf8_error(json.dumps(first).encode())["message"]
    assert second["status"] == 200


@pytest.mark.parametrize(("method", "path"), REGISTRY)
def test_the_registry_api_answers_a_body_that_is_not_utf8_400(stack: Stack, method: str, path: str) -> None:
    for body in (NOT_UTF8, json.dumps({"value": "7", "enabled": False}).encode("utf-16")):
        answer = stack.request(method, path, body, staff=True)
        assert answer.status == 400, answer
        not_utf8_error(answer.body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_gateway_answers_a_body_that_is_not_utf8_400(stack: Stack, path: str) -> None:
    for body in (NOT_UTF8, f'{{"model": "{MODEL}", "prompt": "caf'.encode() + b'\xe9"}'):
        answer = stack.request("POST", path, body, gateway=True)
        assert answer.status == 400, answer
        assert json.loads(answer.body)["error"]["type"] == "invalid_request_error"
    assert not stack.pod.received  # refused before any pod saw it


def test_the_servers_answer_valid_requests_and_logged_no_traceback(stack: Stack) -> None:
    for path in SCORING:
        stack.request("POST", path, NOT_UTF8)
    score = stack.request("POST", "/api/v1/score", json.dumps({"model": MODEL, "prompt": "hello"}).encode())
    assert score.status == 200, score
    routed = stack.request(
        "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hello"}).encode(), gateway=True
    )
    assert routed.status == 200, routed
    for log in (stack.web.log, stack.gateway.log):
        text = log.read_text()
        assert "Traceback" not in text and "internal_error" not in text, text[-3000:]
