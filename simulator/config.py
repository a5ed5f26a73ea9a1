"""Configuration of simulated pods: immutable values with explicit defaults, validated on creation.

Times are milliseconds in every configuration field (the ``_ms`` suffix says so), as on the command
line and in ``/admin/config``; the latency functions turn them into seconds. Latency and failure
settings can be replaced while a pod runs (``POST /admin/config``): :func:`updated` builds the new
value from a partial mapping and rejects unknown or invalid fields with :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from kvindex.keys import DEFAULT_SEED
from registry.config import POD_ROLES

__all__ = [
    "FAILURE_TYPES",
    "MAX_JITTER",
    "OUTPUT_MODES",
    "ConfigError",
    "EngineConfig",
    "FailureConfig",
    "LatencyConfig",
    "LoraAdapter",
    "PodConfig",
    "as_dict",
    "updated",
]

MAX_JITTER: Final = 0.3
"""Largest relative standard deviation of the latency jitter: with it, a jittered value stays
within [1 - 3 sigma, 1 + 3 sigma] = [0.1, 1.9] times the nominal one, so never 0."""

FAILURE_TYPES: Final = (
    "rate_limit",
    "invalid_api_key",
    "context_length",
    "server_error",
    "invalid_request",
    "model_not_found",
)
OUTPUT_MODES: Final = ("echo", "random")
OutputMode = Literal["echo", "random"]


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field and what to fix."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """The latency model of one pod (see ``simulator.latency``).

    TTFT = ``prefill_overhead_ms`` + uncached prompt tokens * ``prefill_time_per_token_ms``; every
    later token takes ``inter_token_latency_ms``; both are multiplied by the load multiplier, which
    grows linearly from 1 (one running request) to ``load_factor`` (``max_num_seqs`` running).
    ``jitter`` is the relative standard deviation of a seeded Gaussian factor (0 disables it).

    A request whose prompt was prefilled by another pod (``kv_transfer_params.do_remote_prefill``)
    has its first token after the KV transfer instead: ``kv_cache_transfer_latency_ms`` +
    transferred tokens * ``kv_cache_transfer_time_per_token_ms``, not multiplied by the load (the
    transfer is the network's work, not the batch's). The defaults: 1 ms for a transfer's fixed
    cost (the notification and the set-up of the read); 0.02 ms a token, Qwen3-0.6B's 112 KiB of
    KV a token (28 layers, 8 KV heads of 128, bf16) at ~5.7 GB/s, a tenth of the default
    ``prefill_time_per_token_ms``: a transfer is visibly cheaper than prefilling again, not free.

    ``prefill_interference``: how much a prompt being computed slows the engine's decoding, as
    vLLM's chunked prefill does (a step that carries prefill tokens takes longer for every
    request in the batch): each output token's ITL is multiplied by ``1 + prefill_interference``
    for each request of the engine computing its prompt at that moment. 0 (the default) leaves
    decoding alone; what prefill/decode disaggregation removes from the decode pods.
    """

    prefill_overhead_ms: float = 10.0
    prefill_time_per_token_ms: float = 0.2
    inter_token_latency_ms: float = 10.0
    load_factor: float = 1.0
    jitter: float = 0.0
    kv_cache_transfer_latency_ms: float = 1.0
    kv_cache_transfer_time_per_token_ms: float = 0.02
    prefill_interference: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_overhead_ms",
            "prefill_time_per_token_ms",
            "inter_token_latency_ms",
            "kv_cache_transfer_latency_ms",
            "kv_cache_transfer_time_per_token_ms",
            "prefill_interference",
        ):
            value = getattr(self, name)
            _check(_number(value) and value >= 0, f"{name} must be a number >= 0, not {value!r}")
        _check(
            _number(self.load_factor) and self.load_factor >= 1,
            f"load_factor must be a number >= 1, not {self.load_factor!r}",
        )
        _check(
            _number(self.jitter) and 0 <= self.jitter <= MAX_JITTER,
            f"jitter must be a number in [0, {MAX_JITTER}], not {self.jitter!r}",
        )


@dataclass(frozen=True, slots=True)
class FailureConfig:
    """Failure injection: ``rate`` percent of completion requests fail with one of ``types``,
    chosen uniformly by the pod's seeded generator."""

    rate: float = 0.0
    types: tuple[str, ...] = FAILURE_TYPES

    def __post_init__(self) -> None:
        _check(
            _number(self.rate) and 0 <= self.rate <= 100,
            f"rate must be a percentage 0-100, not {self.rate!r}",
        )
        if isinstance(self.types, list):
            object.__setattr__(self, "types", tuple(self.types))
        _check(isinstance(self.types, tuple) and bool(self.types), "types must be a non-empty list")
        unknown = [t for t in self.types if t not in FAILURE_TYPES]
        _check(not unknown, f"unknown failure types {unknown}: choose from {list(FAILURE_TYPES)}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine (one data-parallel rank): its KV cache and scheduler limits.

    ``kv_cache_size`` counts blocks of ``block_size`` tokens. At most ``max_num_seqs`` requests run
    at once; at most ``max_waiting`` wait in the FIFO queue (more is 429). ``hash_seed`` is the
    engines' PYTHONHASHSEED of vLLM's ``sha256_cbor`` block hashing (by default vLLM 0.33's when it is
    unset).
    """

    block_size: int = 16
    kv_cache_size: int = 1024
    max_num_seqs: int = 16
    max_waiting: int = 1000
    max_model_len: int = 32768
    hash_seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_size", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1, not {value!r}")
        _check(
            isinstance(self.max_waiting, int) and self.max_waiting >= 0,
            f"max_waiting must be an integer >= 0, not {self.max_waiting!r}",
        )
        _check(isinstance(self.hash_seed, str), "hash_seed must be a string")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter served under its own model name. ``lora_id`` is the int vLLM puts in
    ``BlockStored.lora_id``; ``name`` goes into every block hash of its requests."""

    name: str
    path: str
    lora_id: int


@dataclass(frozen=True, slots=True)
class PodConfig:
    """Everything one simulated pod needs. ``seed`` drives generated text, failure injection and
    jitter: the same seed gives the same behaviour for the same requests.

    ``role`` (one of :data:`POD_ROLES`) says what the pod is for under prefill/decode
    disaggregation, as the registry's ``Pod.role``: it is announced (``/server_info``'s
    ``disaggregation_mode``, registration) but restricts nothing: every pod serves whole requests,
    prefills for another pod and decodes another pod's prefill, as a vLLM with NixlConnector's
    ``kv_role`` ``kv_both``."""

    pod_id: str
    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    output_mode: OutputMode = "echo"
    seed: int = 0
    data_parallel_size: int = 1
    lora_adapters: tuple[LoraAdapter, ...] = ()
    role: str = "both"

    def __post_init__(self) -> None:
        _check(
            bool(self.pod_id) and "@" not in self.pod_id,
            f"pod_id {self.pod_id!r} must be non-empty without '@'",
        )
        _check(bool(self.model), "model must be non-empty")
        _check(self.output_mode in OUTPUT_MODES, f"output_mode must be one of {list(OUTPUT_MODES)}")
        _check(
            isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
            "data_parallel_size must be an integer >= 1",
        )
        _check(self.role in POD_ROLES, f"role must be one of {list(POD_ROLES)}, not {self.role!r}")


_Config = TypeVar("_Config", LatencyConfig, FailureConfig)


def updated(config: _Config, changes: Mapping[str, Any]) -> _Config:
    """``config`` with the fields in ``changes`` replaced. Raises :class:`ConfigError` for a field
    the config does not have or a value it does not accept; ``config`` itself never changes."""
    if not isinstance(changes, Mapping):
        raise ConfigError(f"expected an object of {type(config).__name__} fields")
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(changes) - names)
    _check(not unknown, f"unknown fields {unknown}: {type(config).__name__} has {sorted(names)}")
    try:
        return dataclasses.replace(config, **changes)
    except TypeError as error:
        raise ConfigError(str(error)) from None


def as_dict(config: LatencyConfig | FailureConfig | EngineConfig) -> dict[str, Any]:
    """The config as JSON-ready values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
