"""Scoring over HTTP, on both index backends, following upstream's end-to-end suite.

Blocks are cached the way engines report them (BlockStored events through the EventApplier,
the real captures with the hashes vLLM reported), then prompts, conversations and token ids are
scored through ``/score_completions``, ``/score_chat_completions`` and ``/api/v1/score``.
"""

from __future__ import annotations

import pytest

from registry import services
from registry.models import ModelConfig, Pod
from tests.api.conftest import BLOCK_SIZE, MODEL, post
from tokenization.chat_templates import render_chat

UNRELATED = "The quick brown fox jumps over the lazy dog while the cat watches from the windowsill. " * 8


def score(client, body: dict) -> dict:
    response = post(client, "/api/v1/score", {"model": MODEL, **body})
    assert response.status_code == 200, response.json()
    return response.json()


def completions(client, prompt: str) -> dict:
    response = post(client, "/score_completions", {"model": MODEL, "prompt": prompt})
    assert response.status_code == 200, response.json()
    return response.json()


def chat_completions(client, messages: list[dict], **options) -> dict:
    response = post(client, "/score_chat_completions", {"model": MODEL, "messages": messages, **options})
    assert response.status_code == 200, response.json()
    return response.json()


def word_prefix(tokenizers, text: str, min_tokens: int) -> tuple[str, int]:
    """A prefix of ``text`` ending before a word, at least ``min_tokens`` tokens long, that
    tokenizes exactly as the full text's first tokens; with its token count."""
    tokenizer = tokenizers.get(MODEL)
    full = tokenizer.encode(text)
    for k in range(min_tokens, len(full.ids)):
        start = full.offsets[k][0]
        if text[start] == " " and tokenizer.encode(text[:start]).ids == full.ids[:k]:
            return text[:start], k
    raise AssertionError("no word boundary found")


def conversation(turns: int) -> list[dict]:
    """``turns`` messages alternating user and assistant, each a different sentence."""
    roles = ("user", "assistant")
    return [
        {"role": roles[i % 2], "content": f"Message {i}: tell me about the number {i * 7} and its factors."}
        for i in range(turns)
    ]


def rendered(tokenizers, messages: list[dict], **options) -> str:
    """The prompt an engine would cache for ``messages`` (the model's own template)."""
    return render_chat(messages, templates=tokenizers.get(MODEL).chat_templates, **options).text


# --- hits and misses ------------------------------------------------------------------------


def test_the_pod_holding_the_captured_blocks_scores_25_on_every_endpoint(
    client, engines, base_capture, tokens
):
    engines.cache_capture("pod-a", base_capture)
    prompt = base_capture["prompt"]
    assert tokens(prompt)[:400] == base_capture["token_ids"]  # 402 tokens: 25 full blocks

    assert completions(client, prompt) == {"pod-a": 25.0}
    assert score(client, {"prompt": prompt}) == {
        "model": MODEL,
        "blocks": 25,
        "scores": {"pod-a": 25.0},
        "pods": {
            "pod-a": {"score": 25.0, "matched_blocks": 25, "normalized": 1.0, "tier": "gpu", "address": None}
        },
    }
    assert score(client, {"token_ids": base_capture["token_ids"]})["scores"] == {"pod-a": 25.0}


def test_a_prompt_no_pod_holds_scores_nothing(client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)

    assert completions(client, UNRELATED) == {}
    assert score(client, {"prompt": UNRELATED})["scores"] == {}
    assert score(client, {"prompt": UNRELATED})["pods"] == {}


def test_a_prompt_shorter_than_one_block_scores_an_empty_object_not_null(client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)

    assert completions(client, "Anarchism is") == {}
    result = score(client, {"prompt": "Anarchism is"})
    assert (result["blocks"], result["scores"]) == (0, {})


def test_prefix_reduction_scores_the_blocks_of_the_shorter_prompt(client, engines, base_capture, tokenizers):
    engines.cache_capture("pod-a", base_capture)
    prefix, n_tokens = word_prefix(tokenizers, base_capture["prompt"], 200)

    assert completions(client, prefix) == {"pod-a": float(n_tokens // BLOCK_SIZE)}
    result = score(client, {"prompt": prefix})
    assert result["blocks"] == n_tokens // BLOCK_SIZE
    assert result["pods"]["pod-a"]["normalized"] == 1.0


def test_prefix_expansion_scores_only_the_cached_leading_blocks(client, engines, base_capture):
    ids, hashes = base_capture["token_ids"], base_capture["block_hashes"]
    engines.cache("pod-a", ids[: 10 * BLOCK_SIZE], block_hashes=hashes[:10])
    longer = base_capture["prompt"] + " " + UNRELATED

    assert completions(client, base_capture["prompt"]) == {"pod-a": 10.0}
    assert completions(client, longer) == {"pod-a": 10.0}
    result = score(client, {"prompt": base_capture["prompt"]})
    assert result["pods"]["pod-a"] == {
        "score": 10.0,
        "matched_blocks": 10,
        "normalized": 0.4,
        "tier": "gpu",
        "address": None,
    }


def test_a_4500_token_prompt_is_scored_block_by_block(client, engines, base_capture, tokens):
    prompt = " ".join(f"Part {i}. {base_capture['prompt']}" for i in range(11))
    ids = tokens(prompt)
    assert 4400 <= len(ids) <= 4700
    blocks = engines.cache("pod-a", ids)
    engines.cache("pod-b", ids[: 100 * BLOCK_SIZE])

    assert completions(client, prompt) == {"pod-a": float(blocks), "pod-b": 100.0}
    assert score(client, {"token_ids": ids})["blocks"] == blocks


# --- chat -----------------------------------------------------------------------------------


@pytest.mark.parametrize("turns", [1, 12, 3, 100], ids=["short", "long", "multi-turn", "100-turns"])
def test_a_cached_conversation_scores_all_its_blocks(client, engines, tokenizers, tokens, turns):
    messages = conversation(turns)
    if turns == 12:  # long: a few big messages
        messages = [{**m, "content": m["content"] * 40} for m in messages]
    text = rendered(tokenizers, messages)
    blocks = engines.cache("pod-a", tokens(text))
    assert blocks >= 1

    answer = chat_completions(client, messages)
    assert answer == {"podScores": {"pod-a": float(blocks)}, "templated_messages": text}


def test_api_v1_score_renders_messages_with_the_generation_prompt_by_default(
    client, engines, tokenizers, tokens
):
    messages = conversation(30)
    with_prompt = rendered(tokenizers, messages, add_generation_prompt=True)
    blocks = engines.cache("pod-a", tokens(with_prompt))
    assert len(tokens(with_prompt)) // BLOCK_SIZE == blocks

    result = score(client, {"messages": messages})
    assert result["blocks"] == blocks
    assert result["scores"] == {"pod-a": float(blocks)}
    explicit = score(client, {"messages": messages, "add_generation_prompt": False})
    assert explicit["blocks"] == len(tokens(rendered(tokenizers, messages))) // BLOCK_SIZE


def test_content_given_as_text_parts_scores_like_plain_content(client, engines, tokenizers, tokens):
    plain = conversation(6)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in plain]
    engines.cache("pod-a", tokens(rendered(tokenizers, plain)))

    assert chat_completions(client, parts) == chat_completions(client, plain)


def test_chat_template_kwargs_are_merged_and_the_caller_wins(client, tokenizers):
    messages = [{"role": "user", "content": "Hello"}]

    answer = chat_completions(
        client,
        messages,
        add_generation_prompt=True,
        chat_template_kwargs={"enable_thinking": False, "eos_token": "<EOS>"},
        chat_template="{{ messages[0].content }}|{{ eos_token }}|{{ enable_thinking }}",
    )
    assert answer["templated_messages"] == "Hello|<EOS>|False"
    default = chat_completions(client, messages, add_generation_prompt=True, chat_template_kwargs={})
    assert default["templated_messages"] == rendered(tokenizers, messages, add_generation_prompt=True)
    thinking_off = chat_completions(
        client, messages, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False}
    )
    assert thinking_off["templated_messages"].endswith("<think>\n\n</think>\n\n")


def test_the_request_template_wins_over_the_model_config_template_over_the_tokenizers(client):
    messages = [{"role": "user", "content": "Hi"}]
    services.save_model_config(ModelConfig(name=MODEL, chat_template="config:{{ messages[0].content }}"))

    assert chat_completions(client, messages)["templated_messages"] == "config:Hi"
    request_template = "request:{{ messages[0].content }}"
    answer = chat_completions(client, messages, chat_template=request_template)
    assert answer["templated_messages"] == "request:Hi"


# --- LoRA, pods, tiers, model settings --------------------------------------------------------


def test_lora_blocks_match_only_when_the_request_names_the_adapter(
    client, engines, base_capture, lora_capture
):
    engines.cache_capture("pod-lora", lora_capture)
    engines.cache_capture("pod-base", base_capture)
    prompt = lora_capture["prompt"]

    assert score(client, {"prompt": prompt, "lora_name": "Alice"})["scores"] == {"pod-lora": 25.0}
    assert score(client, {"token_ids": lora_capture["token_ids"], "lora_name": "Alice"})["scores"] == {
        "pod-lora": 25.0
    }
    assert score(client, {"prompt": prompt})["scores"] == {"pod-base": 25.0}
    assert score(client, {"prompt": prompt, "lora_name": "Bob"})["scores"] == {}


def test_the_pods_filter_restricts_the_answer(client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)
    engines.cache_capture("pod-b", base_capture)
    body = {"token_ids": base_capture["token_ids"]}

    assert score(client, body)["scores"] == {"pod-a": 25.0, "pod-b": 25.0}
    assert score(client, {**body, "pods": ["pod-b"]})["scores"] == {"pod-b": 25.0}
    assert score(client, {**body, "pods": ["pod-z"]})["scores"] == {}


def test_a_disabled_pod_never_appears_even_while_its_blocks_are_still_indexed(client, engines, base_capture):
    services.save_pod(Pod(pod_id="pod-b", model=MODEL, enabled=False))
    # Blocks written after the disable (an ingest that has not refreshed its config yet),
    # including those of a data-parallel rank of the pod.
    engines.cache_capture("pod-a", base_capture)
    engines.cache_capture("pod-b", base_capture)
    engines.cache("pod-b", base_capture["token_ids"], block_hashes=base_capture["block_hashes"], rank=1)
    body = {"token_ids": base_capture["token_ids"]}

    assert score(client, body)["scores"] == {"pod-a": 25.0}
    assert score(client, {**body, "pods": ["pod-b"]})["scores"] == {}
    assert score(client, {**body, "pods": ["pod-b#dp1"]})["scores"] == {}
    assert completions(client, base_capture["prompt"]) == {"pod-a": 25.0}


def test_tier_weights_come_from_the_model_config(client, engines, base_capture):
    engines.cache_capture("pod-cpu", base_capture, tier="cpu")
    body = {"token_ids": base_capture["token_ids"]}

    default = score(client, body)["pods"]["pod-cpu"]
    assert default["score"] == pytest.approx(25 * 0.8)
    assert default["tier"] == "cpu"
    services.save_model_config(ModelConfig(name=MODEL, tier_weights={"gpu": 1.0, "cpu": 0.5}))
    assert score(client, body)["scores"] == {"pod-cpu": 12.5}


def test_the_block_size_comes_from_the_model_config(client, engines, base_capture):
    services.save_model_config(ModelConfig(name=MODEL, block_size=32))

    assert score(client, {"token_ids": base_capture["token_ids"]})["blocks"] == 400 // 32


def test_the_tokenizer_source_comes_from_the_model_config(client, engines, base_capture):
    """A served name that is not a hub id scores with the tokenizer its config names."""
    services.save_model_config(ModelConfig(name="qwen-small", tokenizer_source=MODEL))
    engines.cache("pod-a", base_capture["token_ids"], model="qwen-small")

    response = post(client, "/score_completions", {"model": "qwen-small", "prompt": base_capture["prompt"]})
    assert response.status_code == 200
    assert response.json() == {"pod-a": 25.0}


def test_token_ids_need_no_tokenizer(client, engines, base_capture):
    engines.cache("pod-a", base_capture["token_ids"], model="no-tokenizer/anywhere")
    body = {"model": "no-tokenizer/anywhere", "token_ids": base_capture["token_ids"]}

    response = post(client, "/api/v1/score", body)
    assert response.status_code == 200
    assert response.json()["scores"] == {"pod-a": 25.0}


# --- what the response says about itself ------------------------------------------------------


def test_every_scoring_response_carries_the_core_timing_breakdown(client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)

    response = post(client, "/score_completions", {"model": MODEL, "prompt": base_capture["prompt"]})
    steps = dict(part.split(";")[:2] for part in response.headers["Server-Timing"].split(", "))
    assert list(steps) == ["render", "tokenize", "keys", "lookup", "score", "core"]
    durations = {name: float(value.removeprefix("dur=")) for name, value in steps.items()}
    assert durations["core"] == pytest.approx(sum(v for k, v in durations.items() if k != "core"), abs=0.01)
    assert durations["tokenize"] > 0


def test_a_repeated_prompt_is_tokenized_from_the_prefix_store(client, engines, base_capture):
    prompt = " ".join(f"Part {i}. {base_capture['prompt']}" for i in range(4)) + " (variant A)"
    completions(client, prompt)  # first time: tokenized in full, chunks stored

    response = post(client, "/score_completions", {"model": MODEL, "prompt": prompt[:-3] + "B)"})
    assert 'desc="prefix store hit"' in response.headers["Server-Timing"]
