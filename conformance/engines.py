"""The vLLM side: one pod is vLLM 0.33's own ``KVCacheManager`` and ``ZmqEventPublisher``, wired as
vLLM's engine core and scheduler wire them (``vllm/v1/engine/core.py``,
``vllm/v1/core/sched/scheduler.py``); nothing of vLLM is copied, only called.

- The block hasher is ``get_request_block_hasher(block_size, sha256_cbor, num_hash_lookahead_tokens)``
  after ``init_none_hash(sha256_cbor)``, which takes the root seed from ``PYTHONHASHSEED`` or, unset,
  ``"vllm-none-hash"`` (per process, as in the engine core).
- The publisher is ``EventPublisherFactory.create(KVEventsConfig(...))`` with the llm-d topic
  ``kv@<pod>@<model>``, connecting to our ingest's bound SUB, and a replay ROUTER of its own. It
  outlives the manager of one test: publishers are up before ingest starts (as engines running when
  it starts), so ingest's start-up catch-up finds every registered replay endpoint answering.
- A request is served as the scheduler serves it: ``get_computed_blocks`` (its cap, the prompt
  length - 1), ``allocate_slots`` for the prefill, one ``allocate_slots(request, 1)`` per decoded
  token, ``free`` when it finishes; after every step ``take_events`` goes out as one
  ``KVEventBatch``, as ``Scheduler.update_from_output`` publishes them.
- What vLLM holds of a prompt is ``get_computed_blocks(request, max_cache_hit_length=len(prompt))``:
  the leading blocks a new request would hit, without the scheduler's "recompute the last token" cap
  (a router scores blocks held, not blocks skipped).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisher, EventPublisherFactory, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_none_hash_seed, get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from conformance.spec import BLOCK_SIZE, Prompt, ServedModel

HASH_ALGORITHM = "sha256_cbor"  # --prefix-caching-hash-algo, as llm-d deployments set it
MAX_MODEL_LEN = 4096

_request_ids = itertools.count()


class PoolExhausted(RuntimeError):
    """The scenario asked more of a pod than its block pool holds (a bug in the scenario)."""


def kv_cache_config(model: ServedModel, *, num_blocks: int) -> KVCacheConfig:
    """One full-attention group, plus a sliding-window group for a hybrid model; ``num_blocks``
    physical blocks shared by the groups (block 0 is vLLM's null block)."""
    layout = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    specs: list[tuple[str, KVCacheSpec]] = [("full", FullAttentionSpec(block_size=BLOCK_SIZE, **layout))]
    if model.sliding_window:
        specs.append(
            (
                "sliding",
                SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=model.sliding_window, **layout),
            )
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"{name}.0"], spec) for name, spec in specs],
    )


def event_publisher(*, pod: str, model: ServedModel, endpoint: str, replay_endpoint: str) -> EventPublisher:
    """A pod's publisher as the scheduler creates it from ``--kv-events-config``: ZeroMQ, connecting
    to ``endpoint`` (our ingest binds), the llm-d topic ``kv@<pod>@<model>``, a replay ROUTER bound
    at ``replay_endpoint``."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        replay_endpoint=replay_endpoint,
        topic=f"kv@{pod}@{model.name}",
    )
    return EventPublisherFactory.create(config, data_parallel_rank=0)


class Engine:
    """One vLLM pod: its KV-cache manager and its event publisher. ``batches`` counts the non-empty
    batches it published (what our ingest must have applied once in sync), ``published`` its events
    by type (``BlockStored``...), so a scenario can show it exercised what it claims."""

    def __init__(self, *, pod: str, model: ServedModel, publisher: EventPublisher, num_blocks: int) -> None:
        self.pod = pod
        self.model = model
        self.publisher = publisher
        hash_fn = get_hash_fn_by_name(HASH_ALGORITHM)
        init_none_hash(hash_fn)  # as EngineCore.__init__: reads PYTHONHASHSEED now
        self.hash_seed = get_none_hash_seed()
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn, model.hash_lookahead_tokens)
        self.manager = KVCacheManager(
            kv_cache_config=kv_cache_config(model, num_blocks=num_blocks),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
            num_hash_lookahead_tokens=model.hash_lookahead_tokens,
            enable_kv_cache_events=True,
        )
        self.batches = 0
        self.published: Counter[str] = Counter()

    # --- what vLLM holds ------------------------------------------------------------------------

    def cached_blocks(self, prompt: Prompt) -> int:
        """How many leading blocks of ``prompt`` this pod's prefix cache holds, by vLLM's own lookup
        (for a hybrid model, the hit its coordinator reconciles over the groups)."""
        request = self.request(prompt)
        _, hit_tokens, _ = self.manager.get_computed_blocks(request, max_cache_hit_length=request.num_tokens)
        return hit_tokens // BLOCK_SIZE

    def full_attention_blocks(self, prompt: Prompt) -> int:
        """How many leading blocks of ``prompt`` the full-attention group alone holds (for a hybrid
        model, what its coordinator's hit starts from, before the other groups cut it)."""
        request = self.request(prompt)
        _, hits = self.manager.coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens
        )
        return hits[0] // BLOCK_SIZE

    # --- serving --------------------------------------------------------------------------------

    def serve(
        self, prompt: Prompt, *, generated: Sequence[int] = (), report_mode: str = "incremental"
    ) -> None:
        """Prefill ``prompt``, decode ``generated``, finish: the scheduler's calls, one published
        batch per step. ``report_mode`` is the request's ``kv_cache_report_mode``."""
        request = self.request(prompt, max_tokens=len(generated) + 1, report_mode=report_mode)
        computed, hit_tokens, _ = self.manager.get_computed_blocks(request)
        self._allocate(request, request.num_tokens - hit_tokens, hit_tokens, computed)
        request.num_computed_tokens = request.num_tokens
        self.publish_events()
        for token in generated:
            request.append_output_token_ids(token)
            self._allocate(request, 1)
            request.num_computed_tokens += 1
            self.publish_events()
        self.manager.free(request)
        self.publish_events()

    def reset_prefix_cache(self) -> None:
        """vLLM's ``reset_prefix_cache`` (e.g. after a weight update): ``AllBlocksCleared``."""
        if not self.manager.reset_prefix_cache():
            raise RuntimeError(f"{self.pod}: vLLM refused to reset its prefix cache (blocks in use)")
        self.publish_events()

    def request(self, prompt: Prompt, *, max_tokens: int = 1, report_mode: str = "incremental") -> Request:
        """``prompt`` as the engine core builds a ``Request`` (``Request.from_engine_core_request``)."""
        lora = None
        if prompt.lora_name:
            lora = LoRARequest(
                lora_name=prompt.lora_name,
                lora_int_id=self.model.lora_adapters.index(prompt.lora_name) + 1,
                lora_path=f"/adapters/{prompt.lora_name}",
            )
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=image.identifier,
                mm_position=PlaceholderRange(offset=image.offset, length=image.length),
            )
            for image in sorted(prompt.images, key=lambda image: image.offset)
        ]
        extra_args = {"kv_cache_report_mode": report_mode} if report_mode != "incremental" else None
        return Request(
            request_id=f"{self.pod}-{next(_request_ids)}",
            prompt_token_ids=list(prompt.token_ids),
            sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
            pooling_params=None,
            mm_features=features or None,
            lora_request=lora,
            cache_salt=prompt.cache_salt,
            block_hasher=self.block_hasher,
        )

    def _allocate(self, request: Request, num_new_tokens: int, hit_tokens: int = 0, computed=None) -> None:
        if self.manager.allocate_slots(request, num_new_tokens, hit_tokens, computed) is None:
            raise PoolExhausted(
                f"{self.pod}: no free blocks for {num_new_tokens} tokens of {request.request_id}"
            )

    # --- events ---------------------------------------------------------------------------------

    def publish_events(self) -> None:
        """What the scheduler does at the end of a step: the manager's events, one batch."""
        events = self.manager.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.batches += 1
            self.published.update(type(event).__name__ for event in events)

    def warm_up(self, arrived: Callable[[], bool], *, timeout: float = 10.0) -> None:
        """Publish empty batches until ``arrived()``: a PUB drops what it sends before the SUB's
        subscription reaches it (ingest replays the lost ones from the ROUTER, all empty)."""
        deadline = time.monotonic() + timeout
        while not arrived():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.pod}: ingest never saw its batches")
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            time.sleep(0.05)


class TextPrompts:
    """Text prompts as vLLM receives them: token ids from vLLM's own tokenizer loader
    (``vllm.tokenizers.get_tokenizer``) over the tokenizer files in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.tokenizer = get_tokenizer(directory)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def prompt(self, label: str, text: str, **fields) -> Prompt:
        """A request of ``text`` (our API is sent the text), with ``fields`` of ``Prompt``."""
        return Prompt(label, tuple(self.encode(text)), text=text, **fields)
