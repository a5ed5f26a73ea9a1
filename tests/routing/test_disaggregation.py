"""The two requests of prefill/decode disaggregation, as vLLM's NixlConnector proxies send them,
and which pods are on which side."""

from __future__ import annotations

import orjson

from routing.disaggregation import Sides, decode_body, prefill_body, sides, transfer_params, uncached_tokens

PODS = {"p-0": "10.0.0.1:8000", "d-0": "10.0.0.2:8000", "a-0": "10.0.0.3:8000"}


def test_prefill_pods_and_the_others_are_the_two_sides_when_both_are_live() -> None:
    assert sides(PODS, {"p-0": "prefill", "d-0": "decode"}) == Sides(
        prefill={"p-0": "10.0.0.1:8000"}, decode={"d-0": "10.0.0.2:8000", "a-0": "10.0.0.3:8000"}
    )
    assert sides(PODS, {"d-0": "decode"}) is None  # nothing prefills: every pod serves whole requests
    assert sides(PODS, dict.fromkeys(PODS, "prefill")) is None  # nothing decodes
    assert sides({}, {}) is None


def test_the_prefill_request_asks_for_one_token_and_a_remote_decode() -> None:
    client = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 300,
        "max_completion_tokens": 300,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
    }
    sent = orjson.loads(prefill_body(client))
    assert sent == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.5,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert client["max_tokens"] == 300  # the client's request is the decode step's: unchanged


def test_the_decode_request_is_the_clients_with_the_prefill_answers_parameters() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p-0", "remote_block_ids": [3, 4]}
    answer = orjson.dumps(
        {"choices": [{"text": "x", "finish_reason": "remote_decode"}], "kv_transfer_params": params}
    )
    assert transfer_params(answer) == params
    client = {"model": "m", "prompt": "hi", "stream": True, "kv_transfer_params": None}
    assert orjson.loads(decode_body(client, params)) == {**client, "kv_transfer_params": params}


def test_an_answer_without_a_remote_prefill_has_no_transfer_parameters() -> None:
    for answer in (
        b"not json",
        b"[]",
        b'{"choices": []}',
        b'{"kv_transfer_params": null}',
        b'{"kv_transfer_params": {"do_remote_prefill": false}}',
        b'{"kv_transfer_params": "yes"}',
    ):
        assert transfer_params(answer) is None, answer


def test_uncached_tokens_are_the_prompts_beyond_the_held_blocks() -> None:
    assert uncached_tokens(100, 0, 16) == 100
    assert uncached_tokens(100, 6, 16) == 4
    assert uncached_tokens(96, 6, 16) == 0
    assert uncached_tokens(10, 6, 16) == 0
