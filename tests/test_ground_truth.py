"""The whole system against ground truth: simulated vLLM pods publish real KV events over ZeroMQ
to the ingest pipeline; for every request, the score this service predicts for the pod it is
sent to must equal (in blocks) the ``cached_tokens`` that pod then reports. Caches are small so
that evictions (BlockRemoved) happen all the time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from ingest.stats import StreamStats
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from scoring.scorer import longest_prefix_scores
from simulator.config import EngineConfig, LatencyConfig, PodConfig
from simulator.fleet import Fleet, FleetConfig, FleetThread, PublishConfig
from simulator.pod import PodTokenizer
from tests.ingest.conftest import Harness, wait_until

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"
BLOCK = 16
PODS = 4
KV_BLOCKS = 40  # per pod: a few prompts' worth, so the LRU evicts constantly
REQUESTS = 300

WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "engine",
    "router",
    "model",
    "latency",
    "throughput",
    "memory",
    "request",
    "answer",
    "question",
    "system",
    "prompt",
    "group",
    "session",
    "vector",
    "index",
    "score",
    "pod",
    "fleet",
    "warm",
    "cold",
    "chain",
    "hash",
]


class RunningFleet:
    """Simulated pods served from a background thread's event loop."""

    def __init__(self, tokenizer: PodTokenizer, events_endpoint: str) -> None:
        pod = PodConfig(
            pod_id="sim-0",
            model=MODEL,
            engine=EngineConfig(block_size=BLOCK, kv_cache_size=KV_BLOCKS, hash_seed=SEED),
            latency=LatencyConfig(
                prefill_overhead_ms=0, prefill_time_per_token_ms=0, inter_token_latency_ms=0
            ),
        )
        config = FleetConfig(
            pod=pod, pods=PODS, base_port=0, publish=PublishConfig(endpoint=events_endpoint, layout="map")
        )
        self.fleet = Fleet(config, tokenizer=tokenizer, graceful_timeout=0.5)
        self._running = FleetThread(self.fleet)
        self.urls = {p.pod_id: p.url for p in self.fleet.pods}
        self.publishers = {p.pod_id: p.publishers[0] for p in self.fleet.pods}

    def stop(self) -> None:
        self._running.close()


def applied(harness: Harness, fleet: RunningFleet, pod: str) -> None:
    """Wait until ingest has applied every batch ``pod`` has published."""
    last = fleet.publishers[pod].next_seq - 1
    if last < 0:
        return

    def caught_up() -> bool:
        return any(s.pod == pod and s.last_seq == last for s in harness.stats.streams())

    wait_until(caught_up, timeout=10, what=f"{pod}'s events up to seq {last}")
    harness.pipeline.pool.join_idle(10)


@pytest.fixture(params=["memory", "redis"])
def system(request, qwen_tokenizer) -> Iterator[tuple[Harness, RunningFleet]]:
    from kvindex import open_index

    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    index = open_index(url)
    harness = Harness(index, ServiceConfig(seed=SEED, default_block_size=BLOCK))
    fleet = RunningFleet(qwen_tokenizer, harness.endpoint)
    try:
        with httpx.Client(timeout=30) as client:
            # ZeroMQ drops what a PUB sends before its subscription is through: poke each pod until
            # ingest hears it, then reset every cache so the index and the pods start equal.
            for pod, url in fleet.urls.items():

                def heard(pod=pod, url=url) -> bool:
                    client.post(
                        f"{url}/v1/completions",
                        json={"model": MODEL, "prompt": "warm " * 40, "max_tokens": 1},
                    )
                    return any(s.pod == pod for s in harness.stats.streams())

                wait_until(heard, timeout=10, what=f"{pod}'s first events")
                assert client.post(f"{url}/reset_prefix_cache").status_code == 200
                applied(harness, fleet, pod)
        yield harness, fleet
    finally:
        fleet.stop()
        harness.close()
        index.close()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> PodTokenizer:
    from tokenization.tokenizers import TokenizerRegistry

    return PodTokenizer(TokenizerRegistry(), MODEL)


def prompts(rng: random.Random) -> Iterator[str]:
    """Shared-prefix traffic: a few groups with long system prompts and short distinct questions."""
    systems = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(60, 200))) for _ in range(6)]
    while True:
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
        yield f"{rng.choice(systems)}\nQ: {question}"


@pytest.mark.slow
def test_predicted_scores_equal_the_cached_tokens_pods_report(system, qwen_tokenizer):
    harness, fleet = system
    rng = random.Random(2026)
    stream = prompts(rng)
    checked = hits = 0
    with httpx.Client(timeout=30) as client:
        for _ in range(REQUESTS):
            prompt = next(stream)
            token_ids = qwen_tokenizer.encode(prompt)
            keys = block_keys(token_ids, seed=SEED, block_size=BLOCK)
            holders = harness.index.lookup(model=MODEL, keys=keys)
            scores = longest_prefix_scores(holders, total_blocks=len(keys), tier_weight=lambda _: 1.0)
            # Mostly route to the warmest pod, sometimes elsewhere, so misses are checked too.
            pod = (
                max(scores, key=lambda p: scores[p].score)
                if scores and rng.random() < 0.7
                else rng.choice(list(fleet.urls))
            )
            predicted_blocks = scores[pod].matched_blocks if pod in scores else 0

            response = client.post(
                f"{fleet.urls[pod]}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": rng.randrange(1, 24)},
            )
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            assert usage["prompt_tokens"] == len(token_ids)
            # vLLM always computes at least one prompt token: a fully cached prompt that is an
            # exact multiple of the block size reports its last block as not cached.
            expected = predicted_blocks * BLOCK
            if expected == len(token_ids):
                expected -= BLOCK
            assert usage["prompt_tokens_details"]["cached_tokens"] == expected, (pod, prompt)
            checked += 1
            hits += predicted_blocks > 0
            applied(harness, fleet, pod)

    streams: list[StreamStats] = harness.stats.streams()
    removed = sum(s.blocks_removed for s in streams)
    assert checked == REQUESTS
    assert hits > REQUESTS // 3, "the workload should hit the cache often"
    assert removed > 100, "the caches should have evicted blocks along the way"
    assert sum(s.orphaned_blocks + s.misaligned_blocks for s in streams) == 0
