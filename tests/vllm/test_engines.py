"""Through the gateway to real vLLM engines, per request: what we predicted (the matched blocks
of ``x-kvcache-matched-blocks``, times the block size) is what the engine served from its prefix
cache (``usage.prompt_tokens_details.cached_tokens``), but for vLLM's cap of a hit at the
prompt's length - 1 (``Answer.expected_cached_tokens``)."""

from __future__ import annotations

import random

import pytest

from bench.faults import WORDS, wait_for
from bench.vllm_system import BLOCK_SIZE, Answer, VllmSystem

pytestmark = pytest.mark.slow


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))


def exact(system: VllmSystem, body: dict, *, chat: bool = False) -> Answer:
    """One request, checked; then the index is given the time to take in what it cached."""
    answer = system.ask(body, chat=chat)
    assert answer.status == 200, answer.body
    assert answer.cached_tokens == answer.expected_cached_tokens, answer
    system.settle(answer, body, chat=chat)
    return answer


def test_completions_of_shared_prefixes_are_predicted_exactly(system: VllmSystem):
    rng = random.Random(1)
    systems = [words(rng, rng.randrange(150, 400)) for _ in range(3)]
    answers = [
        exact(system, {"prompt": f"{rng.choice(systems)}\nQ: {words(rng, rng.randrange(3, 40))}"})
        for _ in range(12)
    ]

    assert sum(a.cached_tokens for a in answers) > 0  # the shared prefixes were hits
    assert {a.pod for a in answers} <= set(system.engines)


def test_a_repeated_prefix_goes_to_the_engine_that_holds_it(system: VllmSystem):
    rng = random.Random(2)
    prefix = words(rng, 500)
    first = exact(system, {"prompt": f"{prefix}\nQ: first"})
    prefix_blocks = first.prompt_tokens // BLOCK_SIZE - 1
    for i in range(5):
        again = exact(system, {"prompt": f"{prefix}\nQ: question {i} {words(rng, 5)}"})
        assert again.pod == first.pod
        assert again.matched_blocks >= prefix_blocks, again


def test_chat_through_the_models_own_template_is_predicted_exactly(system: VllmSystem):
    rng = random.Random(3)
    system_prompt = words(rng, 300)
    answers = []
    for _ in range(4):
        messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": words(rng, rng.randrange(5, 30))},
        ]
        answers.append(exact(system, {"messages": messages}, chat=True))

    assert all(a.matched_blocks > 0 for a in answers[1:]), answers


def test_streamed_answers_are_predicted_exactly(system: VllmSystem):
    rng = random.Random(4)
    prompt = words(rng, 400)
    cold = exact(system, {"prompt": prompt, "stream": True, "max_tokens": 4})
    warm = exact(system, {"prompt": prompt, "stream": True, "max_tokens": 4})

    assert cold.cached_tokens == 0 and warm.cached_tokens > 0
    messages = [{"role": "user", "content": prompt + " and more"}]
    exact(system, {"messages": messages, "stream": True}, chat=True)
    exact(system, {"messages": messages, "stream": True}, chat=True)


def test_a_cache_salt_keeps_tenants_apart_as_in_vllm(system: VllmSystem):
    rng = random.Random(5)
    prompt = words(rng, 400)
    salted = exact(system, {"prompt": prompt, "cache_salt": "tenant-a"})
    again = exact(system, {"prompt": prompt, "cache_salt": "tenant-a"})
    other = exact(system, {"prompt": prompt, "cache_salt": "tenant-b"})
    plain = exact(system, {"prompt": prompt})

    assert salted.matched_blocks == 0 and again.matched_blocks > 0
    assert other.matched_blocks == 0 and other.cached_tokens == 0
    assert plain.matched_blocks == 0 and plain.cached_tokens == 0


def test_real_engines_hashes_equal_our_keys(system: VllmSystem):
    """Hash alignment 100% for both engines, as the dashboard shows it (ingest's stats, published
    every housekeeping round: waited for)."""
    rng = random.Random(6)
    for _ in range(4):
        exact(system, {"prompt": words(rng, 200)})

    def streams() -> dict[str, dict]:
        return {s["pod"]: s for s in system.stats() if s["pod"] in system.engines}

    wait_for(
        lambda: (
            set(streams()) == set(system.engines) and all(s["aligned_blocks"] for s in streams().values())
        ),
        timeout=10,
        what="both engines' aligned blocks in ingest's stats",
    )
    for stream in streams().values():
        assert stream["misaligned_blocks"] == 0 and stream["hash_alignment"] == 1.0, stream


def test_under_eviction_from_a_small_cache_predictions_stay_exact(system: VllmSystem):
    """256 blocks per engine; ~700 blocks of distinct prompts evict (one ``BlockRemoved`` per
    hash, before the stores of the same step): what was evicted is neither predicted nor served."""
    rng = random.Random(7)
    removed_before = sum(s["blocks_removed"] for s in system.stats() if s["pod"] in system.engines)
    prompts = [words(rng, 700) for _ in range(14)]
    for prompt in prompts:
        exact(system, {"prompt": prompt})
    revisits = [exact(system, {"prompt": prompt}) for prompt in prompts[:6]]

    wait_for(
        lambda: (
            sum(s["blocks_removed"] for s in system.stats() if s["pod"] in system.engines) > removed_before
        ),
        timeout=10,
        what="evictions in ingest's stats",
    )
    assert any(a.cached_tokens < a.prompt_tokens - BLOCK_SIZE for a in revisits), (
        revisits
    )  # some were evicted


def test_a_dead_engine_is_routed_around(system: VllmSystem):
    rng = random.Random(8)
    prompt = words(rng, 600)
    first = exact(system, {"prompt": prompt})
    dead = first.pod
    alive = next(pod for pod in system.engines if pod != dead)

    system.stop_engine(dead, kill=True)  # SIGKILL: no goodbye
    try:
        during = [system.ask({"prompt": f"{prompt} {i}"}) for i in range(3)]  # retried on the live one
        assert [(a.status, a.pod) for a in during] == [(200, alive)] * 3, during
        wait_for(lambda: system.pod_health(dead) == "down", timeout=30, what=f"{dead} marked down")
        after = [exact(system, {"prompt": f"{prompt} after {i}"}) for i in range(3)]
        assert {a.pod for a in after} == {alive}
    finally:
        system.start_engine(dead)
        wait_for(lambda: system.pod_health(dead) == "up", timeout=30, what=f"{dead} up again")


def test_an_engine_restarted_has_nothing_stale_scored(system: VllmSystem):
    """Killed and started again on its ports (an empty cache, seqs from 0), between two probes
    of its health or not: its old blocks leave the index before it sends anything, so the first
    request it gets is predicted as what it holds."""
    rng = random.Random(10)
    prompt = words(rng, 600)
    first = exact(system, {"prompt": prompt})
    pod = first.pod

    system.stop_engine(pod, kill=True)
    wait_for(lambda: system.pod_health(pod) == "down", timeout=30, what=f"{pod} marked down")
    system.start_engine(pod)
    wait_for(lambda: system.pod_health(pod) == "up", timeout=30, what=f"{pod} up again")
    wait_for(lambda: system.blocks_held(pod) == 0, timeout=10, what=f"{pod}'s old blocks out of the index")
    assert next(s for s in system.stats() if s["pod"] == pod)["restarts"] >= 1
    again = exact(system, {"prompt": prompt})  # wherever it goes: predicted as it is served
    assert again.cached_tokens == again.expected_cached_tokens


def test_after_ingest_is_killed_and_restarted_the_index_equals_the_engines_caches(system: VllmSystem):
    """What the engines cached while ingest was down comes back by replay from their buffers."""
    rng = random.Random(9)
    system.kill("ingest")
    missed = [{"prompt": words(rng, 400)} for _ in range(4)]
    served = [system.ask(body) for body in missed]
    assert all(a.status == 200 for a in served), served
    system.start("ingest")
    for answer, body in zip(served, missed, strict=True):
        system.settle(answer, body, timeout=60)  # replayed: every block is in the index again
    for answer, body in zip(served, missed, strict=True):
        again = exact(system, body)
        assert again.pod == answer.pod and again.matched_blocks == answer.prompt_tokens // BLOCK_SIZE, again


def test_through_envoy_and_the_picker_a_repeated_prefix_reaches_the_engine_that_holds_it(system: VllmSystem):
    url = system.start_envoy("kv-load")  # a real Envoy, routed by manage.py epp over ext_proc
    try:
        rng = random.Random(12)
        prefix = words(rng, 500)
        body = {"prompt": f"{prefix}\nQ: first"}
        first = system.ask(body, url=url)
        assert first.status == 200, first.body
        assert first.pod in system.engines
        system.settle(first, body)
        for i in range(3):
            again = system.ask({"prompt": f"{prefix}\nQ: question {i} {words(rng, 5)}"}, url=url)
            assert again.pod == first.pod
            assert again.cached_tokens >= (first.prompt_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE, again
            assert again.matched_blocks is None  # the picker tells no client what is cached
    finally:
        system.stop_gateways()
