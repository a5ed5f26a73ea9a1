"""The API under test: Django's test client against each index backend, the real Qwen3 tokenizer,
and blocks cached the way an engine reports them (BlockStored events through the EventApplier).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from ingest.applier import EventApplier
from ingest.events import BlockRemoved, BlockStored, EventBatch
from ingest.stats import IngestStats
from kvindex import KVIndex, MemoryIndex, open_index
from kvindex.dynamo import DynamoBlockStore, MemoryDynamoBlockStore, RedisDynamoBlockStore
from kvindex.keys import ExtraKeys, block_keys
from registry import runtime
from registry.config import ServiceConfig
from registry.runtime import invalidate_service_config
from tests.asgi import AsgiClient
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"  # the captures' PYTHONHASHSEED
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizers() -> TokenizerRegistry:
    """One registry for the session, built as the web process builds it (loading Qwen3 takes
    ~0.4 s: once). Model sources come from the model configs, read when a model first loads."""
    return runtime.build_tokenizers()


@pytest.fixture(autouse=True)
def api_process(db, settings, tokenizers: TokenizerRegistry) -> Iterator[None]:
    """A web process: the session's tokenizers, the capture's seed, open auth, a fresh config."""
    settings.KVCACHE_HASH_SEED = SEED
    settings.KVCACHE_API_KEYS = []
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins
    runtime.set_tokenizers(tokenizers)
    invalidate_service_config()
    yield
    invalidate_service_config()
    runtime.set_tokenizers(None)


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def index(request: pytest.FixtureRequest, settings) -> Iterator[KVIndex]:
    """Each backend in turn, installed as the process's index."""
    if request.param == "memory":
        idx = open_index("memory://")
    else:
        url = request.getfixturevalue("redis_url")
        settings.REDIS_URL = url  # the ingest stats live there (beside a single-server index)
        if request.param == "redis-cluster":
            url = request.getfixturevalue("redis_cluster_url")
            settings.KVCACHE_INDEX_BACKEND = url
        idx = open_index(url)
    runtime.set_index(idx)
    yield idx
    runtime.set_index(None)
    idx.close()


@dataclass
class Engines:
    """Caches blocks in the index as vLLM engines report them: BlockStored events (engine hashes
    computed the way a ``sha256_cbor`` engine computes them, unless given) through the applier."""

    index: KVIndex
    applier: EventApplier

    def cache(
        self,
        pod: str,
        token_ids: Sequence[int],
        *,
        block_hashes: Sequence[int] | None = None,
        lora_name: str | None = None,
        tier: str = "gpu",
        model: str = MODEL,
        rank: int | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
        lookahead_token_ids: Sequence[Sequence[int]] | None = None,
        group_idx: int | None = None,
    ) -> int:
        """Cache every full block of ``token_ids`` on ``pod`` (or the first ``len(extra_keys)``
        blocks, each with its extra keys as vLLM sends them; ``lookahead_token_ids`` as vLLM sends
        them with lookahead hashing; ``group_idx``, a hybrid model's KV-cache group); returns how
        many blocks."""
        n = len(token_ids) // BLOCK_SIZE if extra_keys is None else len(extra_keys)
        if block_hashes is None:
            block_hashes = block_keys(token_ids, seed=SEED, block_size=BLOCK_SIZE, lora_name=lora_name)
        event = BlockStored(
            block_hashes=tuple(block_hashes[:n]),
            parent_block_hash=None,
            token_ids=tuple(token_ids[: n * BLOCK_SIZE]),
            block_size=BLOCK_SIZE,
            lora_id=None,
            tier=tier,
            lora_name=lora_name,
            extra_keys=None if extra_keys is None else tuple(extra_keys),
            group_idx=group_idx,
            lookahead_token_ids=None
            if lookahead_token_ids is None
            else tuple(map(tuple, lookahead_token_ids)),
        )
        batch = EventBatch(ts=time.time(), events=(event,), data_parallel_rank=rank)
        self.applier.apply(pod=pod, model=model, seq=0, batch=batch)
        return n

    def evict(self, pod: str, block_hashes: Sequence[int], *, group_idx: int | None = None) -> None:
        """``pod`` evicted these blocks (of KV-cache group ``group_idx``): one BlockRemoved."""
        event = BlockRemoved(block_hashes=tuple(block_hashes), group_idx=group_idx)
        self.applier.apply(pod=pod, model=MODEL, seq=0, batch=EventBatch(ts=time.time(), events=(event,)))

    def cache_capture(self, pod: str, capture: dict, *, tier: str = "gpu") -> int:
        """The real capture's 25 blocks, with the hashes vLLM reported."""
        return self.cache(
            pod,
            capture["token_ids"],
            block_hashes=capture["block_hashes"],
            lora_name=capture["lora_name"],
            tier=tier,
        )


@pytest.fixture
def dynamo_blocks(index: KVIndex, settings) -> Iterator[DynamoBlockStore]:
    """``KVCACHE_DYNAMO_BLOCKS`` on: the store of Dynamo block records beside the index (in this
    process beside the memory index, else on ``REDIS_URL``), installed as the process's."""
    settings.KVCACHE_DYNAMO_BLOCKS = True
    if isinstance(index, MemoryIndex):
        store: DynamoBlockStore = MemoryDynamoBlockStore()
    else:
        store = RedisDynamoBlockStore.from_url(settings.REDIS_URL)
    runtime.set_dynamo_blocks(store)
    yield store
    runtime.set_dynamo_blocks(None)
    store.close()


@pytest.fixture
def engines(index: KVIndex, request: pytest.FixtureRequest) -> Engines:
    """Engines through ingest's applier (recording Dynamo blocks when the test has ``dynamo_blocks``)."""
    config = ServiceConfig(seed=SEED, default_block_size=BLOCK_SIZE)
    dynamo = request.getfixturevalue("dynamo_blocks") if "dynamo_blocks" in request.fixturenames else None
    return Engines(index, EventApplier(index, config=lambda: config, stats=IngestStats(), dynamo=dynamo))


@pytest.fixture
def client() -> AsgiClient:
    """The whole ASGI application, as ``manage.py serve`` runs it (fast path and Django)."""
    return AsgiClient()


@pytest.fixture
def staff(db) -> APIClient:
    user = User.objects.create(username="ops", is_staff=True)
    api = APIClient()
    api.force_authenticate(user)
    return api


@pytest.fixture
def tokens(tokenizers: TokenizerRegistry) -> Callable[[str], list[int]]:
    """The Qwen3 token ids of a text, as the service tokenizes prompts."""
    return lambda text: tokenizers.get(MODEL).encode(text).ids


def post(client: AsgiClient | APIClient, path: str, body: object, **extra: str):
    """POST ``body`` as JSON; the response's ``json()`` is the decoded body."""
    return client.post(path, data=json.dumps(body), content_type="application/json", **extra)
