"""SSE decoding of realistic vLLM streams, cut into pieces anywhere."""

from __future__ import annotations

import json

import pytest

from simulator.loadgen.client import SSEDecoder, chunk_text, error_detail, error_message, parse_metrics

BASE = '"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1732200000,"model":"Qwen/Qwen3-0.6B"'
# What vLLM sends for a chat completion with stream_options.include_usage, byte for byte.
CHAT_STREAM = (
    f'data: {{{BASE},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
    '"logprobs":null,"finish_reason":null}]}\n\n'
    f'data: {{{BASE},"choices":[{{"index":0,"delta":{{"content":"Bonjour"}},"logprobs":null,'
    '"finish_reason":null}]}\n\n'
    f'data: {{{BASE},"choices":[{{"index":0,"delta":{{"content":" été 東京"}},"logprobs":null,'
    '"finish_reason":null}]}\n\n'
    f'data: {{{BASE},"choices":[{{"index":0,"delta":{{"content":" 🙂"}},"logprobs":null,'
    '"finish_reason":"length","stop_reason":null}]}\n\n'
    f'data: {{{BASE},"choices":[],"usage":{{"prompt_tokens":2048,"total_tokens":2051,'
    '"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":2032}}}\n\n'
    "data: [DONE]\n\n"
).encode()


def decode_in_pieces(stream: bytes, size: int) -> list[str]:
    decoder = SSEDecoder()
    events = []
    for i in range(0, len(stream), size):
        events.extend(decoder.feed(stream[i : i + size]))
    return events + decoder.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100_000])
def test_a_vllm_chat_stream_decodes_the_same_however_it_is_cut(size):
    events = decode_in_pieces(CHAT_STREAM, size)
    assert len(events) == 6 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [chunk_text(c) for c in chunks] == ["", "Bonjour", " été 東京", " 🙂", ""]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2032


def test_crlf_and_cr_line_endings_even_split_between_cr_and_lf():
    stream = CHAT_STREAM.replace(b"\n", b"\r\n")
    for size in (1, 5, 31):
        assert decode_in_pieces(stream, size) == decode_in_pieces(CHAT_STREAM, 1000)
    assert decode_in_pieces(CHAT_STREAM.replace(b"\n", b"\r"), 3) == decode_in_pieces(CHAT_STREAM, 1000)


def test_comments_other_fields_and_multiline_data():
    stream = (
        b": keep-alive\n\nevent: message\nid: 7\ndata: first\ndata:second\n\nretry: 10\n\ndata: [DONE]\n\n"
    )
    assert decode_in_pieces(stream, 4) == ["first\nsecond", "[DONE]"]


def test_an_event_without_its_blank_line_comes_out_on_close():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.close() == ["[DONE]"]
    assert decoder.close() == []


def test_completions_chunks_carry_text():
    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": " hi", "finish_reason": None}]}
    assert chunk_text(chunk) == " hi"
    assert chunk_text({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {}}) == ""


def test_error_bodies_give_their_message():
    openai = b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","code":404}}'
    assert error_message(404, openai) == "HTTP 404: The model `x` does not exist."
    assert error_detail(b'{"object":"error","message":"too long","type":"BadRequestError"}') == "too long"
    assert error_detail(b'{"detail":"needs an API key"}') == "needs an API key"
    assert error_message(502, b"Bad Gateway") == "HTTP 502: Bad Gateway"
    assert error_message(500, b"") == "HTTP 500"


def test_metrics_are_summed_over_labels():
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100.0\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="1"} 20.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3.0\n'
    )
    metrics = parse_metrics(text)
    assert metrics["vllm:prefix_cache_queries_total"] == 120.0
    assert metrics["vllm:num_requests_running"] == 3.0
