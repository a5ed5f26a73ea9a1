"""What the core needs to know about models and pods, as plain immutable values.

The Django shell (``registry.selectors.service_config``) builds a ``ServiceConfig`` from the
registry tables and refreshes it every few seconds, so admin edits reach running processes
without a restart. Nothing here imports Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvindex.keys import DEFAULT_SEED
from kvindex.kv_cache_groups import KVCacheGroup

DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"gpu": 1.0, "cpu": 0.8})
DEFAULT_OTHER_TIER_WEIGHT = 0.5

DP_RANK_SEPARATOR = "#dp"
"""Data-parallel rank r > 0 of pod P is indexed as ``P#dp<r>`` (``ingest.applier.holder_id``)."""


def owner_pod(holder: str) -> str:
    """The pod an index holder belongs to: ``pod#dp<r>`` (a data-parallel rank), ``pod#g<g>`` (a
    hybrid model's KV-cache group) and ``pod#dp<r>#g<g>`` -> ``pod`` (a pod id has no "#")."""
    return holder.partition("#")[0]


def address_in_pod_id(pod_id: str) -> str:
    """The address a ``host:port`` pod id names (llm-d's convention; IPv6 as ``[::1]:8000``),
    else ""."""
    host, colon, port = pod_id.rpartition(":")
    if not (colon and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return ""
    if len(pod_id) > 255 or not host.isascii():
        return ""
    if host.startswith("["):
        return pod_id if host.endswith("]") and len(host) > 2 else ""
    return pod_id if all(c.isalnum() or c in ".-" for c in host) else ""


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
    """A hybrid model's KV-cache groups in vLLM's order (``kvindex.kv_cache_groups``); none: one
    full-attention group."""

    def tier_weight(self, tier: str) -> float:
        return self.tier_weights.get(tier, self.other_tier_weight)


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
    """Every registered pod -> the model it serves."""
    replay_endpoints: Mapping[str, str] = field(default_factory=dict)
    """pod -> its registry ``replay_endpoint`` (only pods that have one)."""
    event_endpoints: Mapping[str, str] = field(default_factory=dict)
    """pod -> its registry ``event_endpoint``, where its engine's KV-event PUB binds (only pods
    that have one): ingest replicas share these pods out and connect to them (``ingest.membership``)."""
    down_pods: frozenset[str] = frozenset()
    """Pods the liveness prober found down: they leave scores like disabled ones."""
    unscored_pods: frozenset[str] = field(init=False)
    """Disabled and down pods: neither they nor their data-parallel ranks appear in scores."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "unscored_pods", self.disabled_pods | self.down_pods)

    def model(self, name: str) -> ModelSettings:
        """Settings of ``name``; a model without a config gets the defaults."""
        found = self.models.get(name)
        if found is not None:
            return found
        return ModelSettings(name=name, block_size=self.default_block_size)

    def address_of(self, holder: str) -> str | None:
        """Where the pod behind an index holder serves HTTP (``pod#dp<r>`` -> ``pod``'s address)."""
        return self.pod_addresses.get(owner_pod(holder))
