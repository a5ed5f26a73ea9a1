"""The latency model: what makes a prefix-cache hit (and a lightly loaded pod) visibly faster.

All results are seconds as floats: nothing is rounded to whole milliseconds, so a 0.2 ms latency
stays 0.2 ms (the reference simulator truncates such values to 0).

* load multiplier ``m = 1 + (f - 1) * (running - 1) / (max_num_seqs - 1)``: 1 with one running
  request, ``f`` (``load_factor``) with a full batch; 1 when ``max_num_seqs`` is 1;
* TTFT = (``prefill_overhead`` + (prompt_tokens - cached_tokens) * ``prefill_time_per_token``) * m;
* ITL = ``inter_token_latency`` * m * (1 + ``prefill_interference`` * p), evaluated for each token
  with the load at that time, p the engine's requests computing their prompts then;
* KV transfer (a prompt prefilled by another pod) = ``kv_cache_transfer_latency`` + transferred
  tokens * ``kv_cache_transfer_time_per_token``, in place of the TTFT and without ``m``;
* jitter: each value times a seeded Gaussian factor N(1, jitter) clipped to [1 - 3 jitter,
  1 + 3 jitter]; with jitter <= 0.3 (enforced by ``LatencyConfig``) a positive value stays positive.
"""

from __future__ import annotations

import random

from simulator.config import LatencyConfig

__all__ = ["Jitter", "inter_token_latency", "kv_transfer_time", "load_multiplier", "time_to_first_token"]

_MS = 1e-3


def load_multiplier(load_factor: float, *, running: int, max_num_seqs: int) -> float:
    """How much slower a step is with ``running`` requests in the batch (>= 1)."""
    if max_num_seqs <= 1:
        return 1.0
    busy = min(max(running, 1), max_num_seqs) - 1
    return 1.0 + (load_factor - 1.0) * busy / (max_num_seqs - 1)


def time_to_first_token(
    config: LatencyConfig, *, prompt_tokens: int, cached_tokens: int, running: int, max_num_seqs: int
) -> float:
    """Seconds from admission to the first token, without jitter. Cached tokens cost nothing."""
    computed = max(prompt_tokens - cached_tokens, 0)
    nominal = config.prefill_overhead_ms + computed * config.prefill_time_per_token_ms
    return nominal * _MS * load_multiplier(config.load_factor, running=running, max_num_seqs=max_num_seqs)


def inter_token_latency(
    config: LatencyConfig, *, running: int, max_num_seqs: int, prefilling: int = 0
) -> float:
    """Seconds between two output tokens, without jitter; ``prefilling``: the engine's requests
    computing their prompts meanwhile (each slows the step by ``prefill_interference``)."""
    multiplier = load_multiplier(config.load_factor, running=running, max_num_seqs=max_num_seqs)
    interference = 1.0 + config.prefill_interference * prefilling
    return config.inter_token_latency_ms * _MS * multiplier * interference


def kv_transfer_time(config: LatencyConfig, *, transferred_tokens: int) -> float:
    """Seconds to load ``transferred_tokens`` of KV from the pod that prefilled them, without
    jitter. The load does not slow it down: the batch does not compute it."""
    nominal = (
        config.kv_cache_transfer_latency_ms + transferred_tokens * config.kv_cache_transfer_time_per_token_ms
    )
    return nominal * _MS


class Jitter:
    """Seeded Gaussian jitter: the same seed gives the same sequence of factors."""

    def __init__(self, seed: int | str) -> None:
        self._rng = random.Random(f"jitter:{seed}")

    def apply(self, value: float, relative_std: float) -> float:
        """``value`` times a factor drawn from N(1, relative_std), clipped to within three
        standard deviations; ``value`` unchanged (and no draw) when ``relative_std`` is 0."""
        if relative_std <= 0 or value <= 0:
            return value
        factor = self._rng.gauss(1.0, relative_std)
        low, high = 1.0 - 3 * relative_std, 1.0 + 3 * relative_std
        return value * min(max(factor, low), high)
