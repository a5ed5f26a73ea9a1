"""What the core needs to know about models and pods, as plain immutable values.

The Django shell (``registry.selectors.service_config``) builds a ``ServiceConfig`` from the
registry tables and refreshes it every few seconds, so admin edits reach running processes
without a restart. Nothing here imports Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

from kvindex.keys import DEFAULT_SEED
from kvindex.kv_cache_groups import KVCacheGroup

DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"gpu": 1.0, "cpu": 0.8})
DEFAULT_OTHER_TIER_WEIGHT = 0.5

DP_RANK_SEPARATOR = "#dp"
POD_ROLES = ("both", "prefill", "decode")
"""What a pod is for under prefill/decode disaggregation (``Pod.role``; vLLM's NixlConnector
``kv_role`` says what it can do, which for a P/D pod is always both ways)."""
"""Data-parallel rank r > 0 of pod P is indexed as ``P#dp<r>`` (``ingest.applier.holder_id``)."""


def owner_pod(holder: str) -> str:
    """The pod an index holder belongs to: ``pod#dp<r>`` (a data-parallel rank), ``pod#g<g>`` (a
    hybrid model's KV-cache group) and ``pod#dp<r>#g<g>`` -> ``pod`` (a pod id has no "#")."""
    return holder.partition("#")[0]


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """How blocks of one model are keyed and scored."""

    name: str
    block_size: int = 16
    tokenizer_source: str = ""
    chat_template: str = ""
    tier_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    other_tier_weight: float = DEFAULT_OTHER_TIER_WEIGHT
    lora_adapters: tuple[str, ...] = ()
    max_model_len: int | None = None
    """The model's context length in tokens (vLLM's ``--max-model-len``); ``None``: the tokenizer
    config's ``model_max_length``, if it has one."""
    hash_lookahead_tokens: int = 0
    """The engines' lookahead hashing (vLLM's ``num_hash_lookahead_tokens``, set by speculative
    decoding configs): each block key also covers this many tokens after the block
    (``kvindex.keys.block_keys(lookahead_tokens=...)``). Ingest needs no setting: events carry
    the tokens (``lookahead_token_ids``)."""
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    """A hybrid model's KV-cache groups in vLLM's order (``kvindex.kv_cache_groups``), as its
    model config sets them, for every pod of the model; none: each pod's own
    (``ServiceConfig.kv_cache_groups_of``)."""

    def tier_weight(self, tier: str) -> float:
        return self.tier_weights.get(tier, self.other_tier_weight)


@lru_cache(maxsize=1024)
def _default_settings(name: str, block_size: int) -> ModelSettings:
    """The settings of a model without a config (one object per name: ingest asks per event)."""
    return ModelSettings(name=name, block_size=block_size)


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """A consistent snapshot of the registry: the hash seed, per-model settings, disabled and down
    pods, the pods' addresses (``pod -> host:port``, only pods that have one) and the models pods serve."""

    seed: str = DEFAULT_SEED
    """The engines' ``PYTHONHASHSEED``; by default the seed of a vLLM >= 0.33 ``sha256`` /
    ``sha256_cbor`` engine started without one (``kvindex.keys.DEFAULT_SEED``)."""
    default_block_size: int = 16
    models: Mapping[str, ModelSettings] = field(default_factory=dict)
    disabled_pods: frozenset[str] = frozenset()
    pod_addresses: Mapping[str, str] = field(default_factory=dict)
    pod_models: frozenset[str] = frozenset()  # the models registered pods serve
    pods: Mapping[str, str] = field(default_factory=dict)
    """Every pod of the registry -> the model it serves (the ones ingest recorded from their events
    alone too)."""
    registered_pods: frozenset[str] = frozenset()
    """The pods an operator or a fleet registered (``Pod.registered``): the event stream admits
    them always (``ingest.pool.Receiver``), and only they can have an address."""
    replay_endpoints: Mapping[str, str] = field(default_factory=dict)
    """pod -> its registry ``replay_endpoint`` (only pods that have one)."""
    event_endpoints: Mapping[str, str] = field(default_factory=dict)
    """pod -> its registry ``event_endpoint``, where its engine's KV-event PUB binds (only pods
    that have one): ingest replicas share these pods out and connect to them (``ingest.membership``)."""
    pod_kv_cache_groups: Mapping[str, tuple[KVCacheGroup, ...]] = field(default_factory=dict)
    """pod -> the KV-cache groups its own events described (only pods whose events did)."""
    down_pods: frozenset[str] = frozenset()
    """Pods the liveness prober found down: they leave scores like disabled ones."""
    pod_roles: Mapping[str, str] = field(default_factory=dict)
    """pod -> ``prefill`` or ``decode`` (``Pod.role``; a pod not in it serves whole requests)."""
    unscored_pods: frozenset[str] = field(init=False)
    """Disabled and down pods: neither they nor their data-parallel ranks appear in scores."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "unscored_pods", self.disabled_pods | self.down_pods)

    def model(self, name: str) -> ModelSettings:
        """Settings of ``name``; a model without a config gets the defaults."""
        found = self.models.get(name)
        if found is not None:
            return found
        return _default_settings(name, self.default_block_size)

    def kv_cache_groups_of(self, model: str, holder: str) -> tuple[KVCacheGroup, ...]:
        """The KV-cache groups ``holder`` is scored over: its model config's, else those its pod's
        own events described (what one pod says of its groups changes its own scores only), else
        none (one full-attention group)."""
        return self.model(model).kv_cache_groups or self.pod_kv_cache_groups.get(owner_pod(holder), ())

    def kv_cache_group_variants(self) -> dict[str, int]:
        """model -> how many different lists of KV-cache groups its pods' events described (more
        than 1: they disagree), for the models whose pods described any."""
        variants: dict[str, set] = {}
        for pod, groups in self.pod_kv_cache_groups.items():
            model = self.pods.get(pod)
            if model is not None:
                variants.setdefault(model, set()).add(groups)
        return {model: len(found) for model, found in variants.items()}

    def address_of(self, holder: str) -> str | None:
        """Where the pod behind an index holder serves HTTP (``pod#dp<r>`` -> ``pod``'s address)."""
        return self.pod_addresses.get(owner_pod(holder))
