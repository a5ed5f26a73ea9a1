"""Prometheus metrics of one simulated pod, under vLLM's names, in a registry of its own.

Every series has the labels ``model_name`` (the pod's base model, also for LoRA requests, as
vLLM) and ``engine`` (the data-parallel rank). Counters and histograms are fed by the engines
(:class:`PodMetrics` makes one ``EngineObserver`` per rank); gauges are read from the engines when
``/metrics`` is scraped, so they are never stale. The prefix-cache counters count tokens, as vLLM's:
``queries`` the prompt tokens looked up, ``hits`` the cached tokens found.

Prefill/decode disaggregation, as vLLM with NixlConnector counts it (every pod can load a KV cache
another pod prefilled): ``vllm:external_prefix_cache_queries`` the prompt tokens not hit locally,
``vllm:external_prefix_cache_hits`` those loaded from the prefill pod, ``vllm:prompt_tokens_by_source``
every prompt token by where its KV came from (``local_compute``, ``local_cache_hit``,
``external_kv_transfer``), ``vllm:nixl_xfer_time_seconds`` one observation per transfer and
``vllm:nixl_num_failed_transfers`` (no transfer fails here: it stays 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from simulator.engine import Engine, RequestState

__all__ = ["PodMetrics"]

_LABELS = ("model_name", "engine")
# vLLM's buckets, with finer steps below 10 ms where simulated latencies often are.
_TTFT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's (nixl/stats.py): its transfer histogram drops the first of its 1 ms..5 s list.
_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _EngineObserver:
    """Feeds one rank's counters and histograms."""

    def __init__(self, metrics: PodMetrics, rank: int) -> None:
        labels = {"model_name": metrics.model, "engine": str(rank)}
        self._labels = labels
        self._metrics = metrics
        self._queries = metrics.prefix_cache_queries.labels(**labels)
        self._hits = metrics.prefix_cache_hits.labels(**labels)
        self._external_queries = metrics.external_prefix_cache_queries.labels(**labels)
        self._external_hits = metrics.external_prefix_cache_hits.labels(**labels)
        self._prompt = metrics.prompt_tokens.labels(**labels)
        self._by_source = {
            source: metrics.prompt_tokens_by_source.labels(**labels, source=source)
            for source in _PROMPT_TOKEN_SOURCES
        }
        self._xfer_time = metrics.nixl_xfer_time.labels(**labels)
        metrics.nixl_failed_transfers.labels(**labels)  # exposed at 0: no simulated transfer fails
        self._generation = metrics.generation_tokens.labels(**labels)
        self._ttft = metrics.ttft.labels(**labels)
        self._itl = metrics.itl.labels(**labels)
        self._e2e = metrics.e2e.labels(**labels)

    def request_admitted(self, state: RequestState) -> None:
        self._queries.inc(state.prompt_tokens)
        self._hits.inc(state.cached_tokens)
        self._external_queries.inc(state.prompt_tokens - state.cached_tokens)
        self._external_hits.inc(state.transferred_tokens)
        self._prompt.inc(state.prompt_tokens)
        computed = state.prompt_tokens - state.cached_tokens - state.transferred_tokens
        self._by_source["local_compute"].inc(computed)
        self._by_source["local_cache_hit"].inc(state.cached_tokens)
        self._by_source["external_kv_transfer"].inc(state.transferred_tokens)

    def kv_transferred(self, state: RequestState, seconds: float) -> None:
        self._xfer_time.observe(seconds)

    def first_token(self, state: RequestState, ttft: float) -> None:
        self._ttft.observe(ttft)
        self._generation.inc()

    def next_token(self, state: RequestState, itl: float) -> None:
        self._itl.observe(itl)
        self._generation.inc()

    def request_finished(self, state: RequestState, e2e: float) -> None:
        reason = state.finish_reason or "abort"
        self._metrics.request_success.labels(**self._labels, finished_reason=reason).inc()
        if reason != "abort":
            self._e2e.observe(e2e)


class _GaugeCollector(Collector):
    """Gauges computed from the engines at scrape time."""

    def __init__(self, metrics: PodMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        m = self._metrics
        engines = m.engines()
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in the running batch.", labels=_LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests in the waiting queue.", labels=_LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", labels=_LABELS
        )
        loras = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (value: the time of the scrape).",
            labels=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
        )
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV-cache configuration.",
            labels=("model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"),
        )
        running_loras: set[str] = set()
        waiting_loras: set[str] = set()
        for rank, engine in enumerate(engines):
            labels = [m.model, str(rank)]
            running.add_metric(labels, engine.num_running)
            waiting.add_metric(labels, engine.num_waiting)
            usage.add_metric(labels, engine.cache.usage)
            running_loras |= engine.running_loras()
            waiting_loras |= engine.waiting_loras()
        loras.add_metric(
            [str(m.max_loras()), ",".join(sorted(running_loras)), ",".join(sorted(waiting_loras))],
            time.time(),
        )
        if engines:
            first = engines[0].config
            config.add_metric([m.model, str(first.block_size), str(first.kv_cache_size), "True"], 1.0)
        return [running, waiting, usage, loras, config]


class PodMetrics:
    """The registry of one pod. ``engines`` returns the pod's engines (rank order) when scraped;
    ``max_loras`` how many adapters the pod serves at most."""

    def __init__(
        self, model: str, *, engines: Callable[[], Sequence[Engine]], max_loras: Callable[[], int]
    ) -> None:
        self.model = model
        self.engines = engines
        self.max_loras = max_loras
        self.registry = CollectorRegistry()
        r = self.registry
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in prompt tokens.", _LABELS, registry=r
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits, in cached prompt tokens.", _LABELS, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            (*_LABELS, "finished_reason"),
            registry=r,
        )
        self.external_prefix_cache_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "KV-connector prefix-cache queries, in prompt tokens not hit locally.",
            _LABELS,
            registry=r,
        )
        self.external_prefix_cache_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "KV-connector prefix-cache hits, in prompt tokens loaded from a prefill pod.",
            _LABELS,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", _LABELS, registry=r)
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by source: local_compute, local_cache_hit, external_kv_transfer.",
            (*_LABELS, "source"),
            registry=r,
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", _LABELS, registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two output tokens.",
            _LABELS,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            _LABELS,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.nixl_xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Duration of a KV-cache transfer from a prefill pod.",
            _LABELS,
            buckets=_XFER_BUCKETS,
            registry=r,
        )
        self.nixl_failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers", "Failed KV-cache transfers.", _LABELS, registry=r
        )
        r.register(_GaugeCollector(self))

    def observer(self, rank: int) -> _EngineObserver:
        """The ``EngineObserver`` of data-parallel rank ``rank``."""
        return _EngineObserver(self, rank)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
