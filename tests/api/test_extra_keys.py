"""What a request adds to its block keys besides its tokens, over HTTP on both index backends: a
``cache_salt``, multimodal features (``mm_features``) and the model's lookahead hashing.

Blocks reach the index as engines report them (BlockStored events through the EventApplier, with
``extra_keys`` and ``lookahead_token_ids`` as vLLM sends them; the salted ones from the real vLLM
0.33 capture), so a request scores a pod's blocks only when it says what the engine keyed them
with.
"""

from __future__ import annotations

import pytest
import yaml

from ingest.events import BlockStored, decode_message
from kvindex.keys import MultimodalFeature, block_extra_keys, block_keys
from registry import services
from registry.models import ModelConfig
from scoring.fastpath.schema import MAX_MM_FEATURES
from tests.api.conftest import BLOCK_SIZE, MODEL, SEED, Engines, post
from tests.api.test_scoring import rendered
from tests.ingest.captures import vllm_033_messages

SALT = "tenant-42"  # the capture's salt


def score(client, body: dict) -> dict:
    response = post(client, "/api/v1/score", {"model": MODEL, **body})
    assert response.status_code == 200, response.json()
    return response.json()


def scores(client, body: dict) -> dict[str, float]:
    return score(client, body)["scores"]


def salted(n: int, salt: str = SALT) -> list:
    """The extra keys of a salted request's first ``n`` blocks, as vLLM sends them."""
    return [(salt,)] + [None] * (n - 1)


# --- cache_salt: the real vLLM 0.33 capture ----------------------------------------------------------


@pytest.fixture
def captured(engines: Engines) -> dict[str, list[int]]:
    """pod-b's first batch of the capture, applied: two plain stores (4 and 5 blocks) and one of 4
    blocks under ``cache_salt="tenant-42"`` whose first 48 tokens are the second plain store's.
    Returns each store's token ids."""
    message = next(m for m in vllm_033_messages() if m.pod == "pod-b" and m.seq == 0)
    decoded = decode_message(message.frames)
    engines.applier.apply(pod=decoded.pod, model=decoded.model, seq=decoded.seq, batch=decoded.batch)
    plain_1, plain_2, salty = (list(e.token_ids) for e in decoded.batch.events if isinstance(e, BlockStored))
    assert decoded.model == MODEL
    return {"plain_1": plain_1, "plain_2": plain_2, "salted": salty}


def test_the_captured_salted_blocks_score_only_with_their_salt(client, captured):
    salty = captured["salted"]

    assert scores(client, {"token_ids": salty, "cache_salt": SALT}) == {"pod-b": 4.0}
    assert scores(client, {"token_ids": salty, "cache_salt": "tenant-7"}) == {}
    # Without the salt the prompt is keyed as a plain one: it finds only the 3 leading blocks it
    # shares with the plain store, never the salted blocks.
    assert scores(client, {"token_ids": salty}) == {"pod-b": 3.0}


def test_the_captured_plain_blocks_score_only_without_a_salt(client, captured):
    plain_1, plain_2 = captured["plain_1"], captured["plain_2"]

    assert scores(client, {"token_ids": plain_1}) == {"pod-b": 4.0}
    assert scores(client, {"token_ids": plain_1, "cache_salt": SALT}) == {}
    assert scores(client, {"token_ids": plain_1, "cache_salt": ""}) == {"pod-b": 4.0}  # "": no salt
    assert scores(client, {"token_ids": plain_2}) == {"pod-b": 5.0}
    # Salted, plain_2 finds the salted store's blocks instead: the 3 over the tokens they share.
    assert scores(client, {"token_ids": plain_2, "cache_salt": SALT}) == {"pod-b": 3.0}


def test_a_batch_keys_each_item_with_its_own_salt(client, captured):
    body = {
        "requests": [
            {"model": MODEL, "token_ids": captured["salted"], "cache_salt": SALT},
            {"model": MODEL, "token_ids": captured["plain_1"], "cache_salt": SALT},
            {"model": MODEL, "token_ids": captured["plain_1"]},
        ]
    }
    response = post(client, "/api/v1/score/batch", body)
    assert response.status_code == 200
    assert [r["scores"] for r in response.json()["results"]] == [{"pod-b": 4.0}, {}, {"pod-b": 4.0}]


# --- cache_salt on prompts and conversations --------------------------------------------------------


def test_a_salted_prompt_scores_the_pod_that_cached_it_salted_on_every_endpoint(
    client, engines, base_capture, tokens
):
    prompt = base_capture["prompt"]
    ids = tokens(prompt)
    engines.cache(
        "pod-salted", ids, block_hashes=block_keys(ids, seed=SEED, cache_salt=SALT), extra_keys=salted(25)
    )
    engines.cache("pod-plain", ids)

    def completions(body: dict) -> dict:
        response = post(client, "/score_completions", {"model": MODEL, "prompt": prompt, **body})
        assert response.status_code == 200, response.json()
        return response.json()

    assert completions({"cache_salt": SALT}) == {"pod-salted": 25.0}
    assert completions({}) == {"pod-plain": 25.0}
    assert completions({"cache_salt": "someone-else"}) == {}
    assert scores(client, {"prompt": prompt, "cache_salt": SALT}) == {"pod-salted": 25.0}
    assert scores(client, {"prompt": prompt, "cache_salt": SALT, "lora_name": "Alice"}) == {}


def test_a_salted_conversation_scores_the_pod_that_cached_it_salted(client, engines, tokenizers, tokens):
    messages = [{"role": "user", "content": "Tell me about salt in every kitchen of the world. " * 20}]
    ids = tokens(rendered(tokenizers, messages))
    n = len(ids) // BLOCK_SIZE
    engines.cache(
        "pod-salted", ids, block_hashes=block_keys(ids, seed=SEED, cache_salt=SALT), extra_keys=salted(n)
    )
    engines.cache("pod-plain", ids)

    response = post(
        client, "/score_chat_completions", {"model": MODEL, "messages": messages, "cache_salt": SALT}
    )
    assert response.status_code == 200
    assert response.json()["podScores"] == {"pod-salted": float(n)}
    body = {"messages": messages, "add_generation_prompt": False}
    assert scores(client, {**body, "cache_salt": SALT}) == {"pod-salted": float(n)}
    assert scores(client, body) == {"pod-plain": float(n)}


# --- multimodal features ----------------------------------------------------------------------------

IMAGE = MultimodalFeature("image-sha-1", offset=20, length=40)  # placeholder tokens 20..59: blocks 1-3
IMAGE_JSON = {"identifier": "image-sha-1", "offset": 20, "length": 40}
IMAGE_EXTRA_KEYS = [  # as vLLM sends them: (identifier, image start - block start)
    None,
    (("image-sha-1", 4),),
    (("image-sha-1", -12),),
    (("image-sha-1", -28),),
    *[None] * 21,
]


def test_mm_features_key_the_blocks_as_the_events_of_the_image_blocks_do(client, engines, base_capture):
    ids = base_capture["token_ids"]  # 400 tokens: 25 blocks
    assert block_extra_keys(25, block_size=BLOCK_SIZE, mm_features=[IMAGE]) == IMAGE_EXTRA_KEYS
    keys = block_keys(ids, seed=SEED, mm_features=[IMAGE])
    engines.cache("pod-image", ids, block_hashes=keys, extra_keys=IMAGE_EXTRA_KEYS)
    assert len(engines.index.lookup(model=MODEL, keys=keys, pods=["pod-image"])) == 25  # block_keys' keys
    engines.cache_capture("pod-text", base_capture)

    assert scores(client, {"token_ids": ids, "mm_features": [IMAGE_JSON]}) == {
        "pod-image": 25.0,
        "pod-text": 1.0,  # the block before the image
    }
    assert scores(client, {"token_ids": ids}) == {"pod-image": 1.0, "pod-text": 25.0}
    other_image = {**IMAGE_JSON, "identifier": "image-sha-2"}
    assert scores(client, {"token_ids": ids, "mm_features": [other_image]}) == {
        "pod-image": 1.0,
        "pod-text": 1.0,
    }


def test_mm_features_are_positions_in_the_prompts_tokens(client, engines, base_capture, tokens):
    prompt = base_capture["prompt"]
    ids = tokens(prompt)  # the capture's 400 token ids, then 2 more
    engines.cache(
        "pod-image",
        ids,
        block_hashes=block_keys(ids, seed=SEED, mm_features=[IMAGE]),
        extra_keys=IMAGE_EXTRA_KEYS,
    )

    response = post(
        client, "/score_completions", {"model": MODEL, "prompt": prompt, "mm_features": [IMAGE_JSON]}
    )
    assert response.json() == {"pod-image": 25.0}
    both = {"prompt": prompt, "mm_features": [IMAGE_JSON], "cache_salt": SALT}
    assert scores(client, both) == {}  # salted: block 0 differs, and every block after it


# --- lookahead hashing ------------------------------------------------------------------------------


def test_lookahead_blocks_score_with_the_models_lookahead_setting(client, engines, base_capture):
    """A pod whose engine hashes with ``num_hash_lookahead_tokens=2`` sends, per block, the 2 tokens
    after it; requests hit those blocks once the model config says so, and only when their own
    next 2 tokens match."""
    ids = base_capture["token_ids"]
    n = (len(ids) - 2) // BLOCK_SIZE  # 24: block 24 has no 2 tokens after it
    after = [ids[(i + 1) * BLOCK_SIZE : (i + 1) * BLOCK_SIZE + 2] for i in range(n)]
    keys = block_keys(ids, seed=SEED, lookahead_tokens=2)
    assert len(keys) == n
    engines.cache("pod-spec", ids, block_hashes=keys, extra_keys=[None] * n, lookahead_token_ids=after)

    assert scores(client, {"token_ids": ids}) == {}  # keyed without lookahead: other keys
    services.save_model_config(ModelConfig(name=MODEL, hash_lookahead_tokens=2))
    result = score(client, {"token_ids": ids})
    assert (result["blocks"], result["scores"]) == (n, {"pod-spec": float(n)})
    changed = [*ids[:161], ids[161] + 1, *ids[162:]]  # token 161 follows block 9 (tokens 144..159)
    assert scores(client, {"token_ids": changed}) == {"pod-spec": 9.0}


# --- what is refused: a 400 naming the field ----------------------------------------------------------

BAD = [
    ({"cache_salt": 42}, "cache_salt"),
    ({"cache_salt": "s" * 257}, "cache_salt"),
    ({"cache_salt": "\ud800"}, "cache_salt"),
    ({"mm_features": "image"}, "mm_features"),
    ({"mm_features": {"identifier": "i", "offset": 0, "length": 1}}, "mm_features"),
    ({"mm_features": [IMAGE_JSON] * (MAX_MM_FEATURES + 1)}, "mm_features"),
    ({"mm_features": ["image"]}, "mm_features"),
    ({"mm_features": [{"offset": 0, "length": 1}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "identifier": ""}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "identifier": "i" * 257}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "identifier": 7}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "identifier": "\udc00"}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "offset": -1}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "offset": "20"}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "offset": 2.5}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "length": 0}]}, "mm_features"),
    ({"mm_features": [{**IMAGE_JSON, "length": True}]}, "mm_features"),
    ({"mm_features": [IMAGE_JSON, {**IMAGE_JSON, "offset": 1000}]}, "mm_features"),  # past the last token
    ({"mm_features": [{**IMAGE_JSON, "offset": 2**70}]}, "mm_features"),
]
IDS = ["salt-int", "salt-long", "salt-surrogate", "mm-str", "mm-object", "mm-too-many", "item-str"]
IDS += ["no-identifier", "identifier-empty", "identifier-long", "identifier-int", "identifier-surrogate"]
IDS += [
    "offset-negative",
    "offset-str",
    "offset-float",
    "length-0",
    "length-bool",
    "past-the-end",
    "offset-huge",
]


def request_of(endpoint: str, capture: dict) -> tuple[str, dict]:
    """A valid request to ``endpoint`` (about 400 tokens): its path and body."""
    if endpoint == "score-ids":
        return "/api/v1/score", {"model": MODEL, "token_ids": capture["token_ids"]}
    if endpoint == "score-prompt":
        return "/api/v1/score", {"model": MODEL, "prompt": capture["prompt"]}
    if endpoint == "completions":
        return "/score_completions", {"model": MODEL, "prompt": capture["prompt"]}
    return "/score_chat_completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 400}]}


@pytest.mark.parametrize(("extra", "field"), BAD, ids=IDS)
@pytest.mark.parametrize("endpoint", ["score-ids", "score-prompt", "completions", "chat"])
@pytest.mark.parametrize("index", ["memory"], indirect=True)  # refused before the index: one backend
def test_a_bad_salt_or_media_input_is_a_400_naming_the_field(
    client, index, base_capture, endpoint, extra, field
):
    path, body = request_of(endpoint, base_capture)
    response = post(client, path, {**body, **extra})
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert set(error["fields"]) == {field}
    assert field in error["message"]


@pytest.mark.parametrize("index", ["memory"], indirect=True)
def test_a_bad_item_of_a_batch_is_its_own_400(client, index, base_capture):
    body = {
        "requests": [
            {"model": MODEL, "token_ids": base_capture["token_ids"], "cache_salt": SALT},
            {"model": MODEL, "token_ids": [1] * 16, "mm_features": [IMAGE_JSON]},  # 16 tokens: past the end
            {"model": MODEL, "token_ids": [1] * 16, "mm_features": [{**IMAGE_JSON, "length": 0}]},
        ]
    }
    results = post(client, "/api/v1/score/batch", body).json()["results"]
    assert [r["status"] for r in results] == [200, 400, 400]
    assert "16 tokens" in results[1]["error"]["fields"]["mm_features"][0]
    assert "mm_features[0].length" in results[2]["error"]["fields"]["mm_features"][0]


@pytest.mark.parametrize("index", ["memory"], indirect=True)
def test_the_openapi_schema_documents_the_salt_and_the_media_of_every_scoring_body(client, index):
    schemas = yaml.safe_load(client.get("/api/schema/").content)["components"]["schemas"]
    for body in ("ScoreRequest", "ScoreCompletionsRequest", "ScoreChatCompletionsRequest"):
        properties = schemas[body]["properties"]
        assert {"cache_salt", "mm_features"} <= set(properties), body
        assert properties["cache_salt"]["anyOf"][0]["maxLength"] == 256
    feature = schemas["MultimodalFeature"]
    assert set(feature["required"]) == {"identifier", "offset", "length"}
    assert feature["properties"]["offset"]["minimum"] == 0
    assert feature["properties"]["length"]["minimum"] == 1
