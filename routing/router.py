"""The choice of a pod for one OpenAI request: the routing core that the gateway (which then
carries the request) and the Endpoint Picker (which names the pod to Envoy) both run.

:meth:`Router.decide` takes a request's body: parses it, finds the model's live pods (the base
model of a LoRA adapter it names), tokenizes it once (the chat template too, with vLLM's default
``add_generation_prompt``), looks its block keys up in the index (plus speculative entries) and has
the policy rank the pods with their load. :meth:`Router.chosen` records where it went (a
speculative entry, or the approximate prefix tree's memory) once a pod has taken it.

Live pods: registered, enabled, not found down by the prober, with an address, serving the
request's model (or the base model of the LoRA adapter it names). A request's ``cache_salt``
(vLLM's completions and chat field) keys its blocks as the pods' events key them. Multimodal
inputs are out of scope: vLLM's media identifiers are hashes its processor computes from the
media, which the router does not reproduce, so a conversation with non-text content parts is
routed on load alone (keying it fails, and is counted). Tokenizing or the index failing never
fails a request: it is routed on load alone and counted.

The pods' load (``routing.load``) comes from the router's own requests in flight and a scrape of
every live pod's ``/metrics`` each second (:meth:`Router.startup` starts it).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import random
import socket
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from kvindex import IndexUnavailable, KVIndex
from registry.config import ServiceConfig, owner_pod
from registry.pod_metrics import MAX_METRICS_BYTES, READ_FAILURES, PodMetricsError
from routing.disaggregation import DISAGGREGATED, SHORT_PROMPT, sides, uncached_tokens
from routing.load import SCRAPE_TIMEOUT_SECONDS, LoadTracker
from routing.memory import KeyMemory
from routing.metrics import RoutingMetrics
from routing.policies import DEFAULT_ALPHA, Candidate, affinity_of, make_policy
from routing.upstream import Upstream, UpstreamError
from scoring.read_path import (
    ChatRequest,
    KeyedRequest,
    ScoreResult,
    alook_up,
    key_chat,
    key_prompt,
    key_token_ids,
    look_up,
)
from tokenization.template_sandbox import TemplateSandbox
from tokenization.tokenizers import TokenizerRegistry

log = logging.getLogger(__name__)

ROUTED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The OpenAI paths the router keys (``kind`` of :meth:`Router.decide`)."""
INLINE_MAX_BODY_BYTES = 16 * 1024
"""A request body up to this size (a prompt of ~4,000 tokens, ~5 ms to key at most) is keyed on the
event loop (``Router._keys_on_loop``); a larger one in the pool, so it holds up no other
request's relay."""


class Snapshots(Protocol):
    """Where the router reads the registry (``registry.snapshot.ConfigSource``, or the EPP's view
    of an InferencePool's pods over it)."""

    async def aget(self) -> ServiceConfig: ...


@dataclass(frozen=True, slots=True)
class RouterSettings:
    policy: str = "kv-load"
    alpha: float = DEFAULT_ALPHA
    speculative_seconds: float = 2.0
    threads: int = 8
    seed: int | None = None
    allow_request_templates: bool = True
    pod_api_key: str = ""
    """Sent to the pods' ``/metrics`` as ``Authorization: Bearer`` (empty: none)."""
    pd_threshold_tokens: int = 0
    """A request of a P/D model whose chosen decode pod would compute fewer of its prompt tokens
    than this skips the prefill step (``routing.disaggregation``); 0: none does."""

    @classmethod
    def from_settings(cls, settings: object, **overrides: object) -> RouterSettings:
        """From the service's settings (``KVCACHE_*`` attributes: the Django shell's
        ``django.conf.settings``; the gateway's and the picker's are the same ones)."""
        values = {
            "policy": settings.KVCACHE_GATEWAY_POLICY,
            "alpha": settings.KVCACHE_GATEWAY_ALPHA,
            "speculative_seconds": settings.KVCACHE_SPECULATIVE_SECONDS,
            "threads": settings.KVCACHE_SCORING_THREADS,
            "allow_request_templates": settings.KVCACHE_REQUEST_TEMPLATES,
            "pod_api_key": settings.KVCACHE_GATEWAY_POD_API_KEY,
            "pd_threshold_tokens": settings.KVCACHE_PD_THRESHOLD_TOKENS,
        }
        return cls(**{**values, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass(frozen=True, slots=True)
class RouterHandles:
    """How the router reaches the shared state (the Django shell's, or a test's)."""

    config: Snapshots
    index: Callable[[], KVIndex]
    tokenizers: Callable[[ServiceConfig], TokenizerRegistry]
    sandbox: Callable[[], TemplateSandbox | None]


class RouteError(Exception):
    """A request the router cannot route: the front answers it with ``status`` itself."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(slots=True)
class Decision:
    """One request's ranking: ``ranked`` candidates best first, among ``pods`` (pod -> address).
    For a request served in two steps (``pd``: ``routing.disaggregation``'s ``disaggregated``),
    ``ranked`` are the decode pods and ``prefill`` the prefill pods, best first; ``pd`` is
    ``short_prompt`` for a P/D model's request served whole by its decode pod, empty for a
    model without both roles."""

    model: str
    keys: list[int]
    ranked: list[Candidate]
    pods: dict[str, str]
    streamed: bool
    payload: dict
    prefill: list[Candidate] = field(default_factory=list)
    pd: str = ""


class Router:
    def __init__(
        self,
        handles: RouterHandles,
        settings: RouterSettings,
        metrics: RoutingMetrics | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        self.handles = handles
        self.settings = settings
        self.metrics = metrics or RoutingMetrics.unregistered()
        self.policy = make_policy(settings.policy, rng=random.Random(settings.seed), alpha=settings.alpha)
        self.metrics.policy.labels(settings.policy).set(1)
        # Speculative entries: this replica's own, exact and at once, and the index's, shared
        # with the other replicas (a round trip later).
        self.speculative = KeyMemory(ttl=settings.speculative_seconds, max_keys=200_000)
        self._sharing = settings.speculative_seconds > 0
        self.memory = KeyMemory(ttl=None, max_keys=1_000_000)
        self.load = LoadTracker(self.metrics)
        self._executor = ThreadPoolExecutor(settings.threads, thread_name_prefix="router")
        self._upstream = upstream or Upstream(
            connect_timeout=SCRAPE_TIMEOUT_SECONDS, first_byte_timeout=SCRAPE_TIMEOUT_SECONDS
        )
        self._owns_upstream = upstream is None
        self._scraper: asyncio.Task | None = None
        self._writes: set[asyncio.Task] = set()  # speculative entries on their way to the index
        self._config: ServiceConfig | None = None
        self._pod_authorization = (
            [(b"authorization", b"Bearer " + settings.pod_api_key.encode())] if settings.pod_api_key else []
        )

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._scraper is not None

    async def startup(self) -> None:
        self._scraper = asyncio.create_task(self.load.scrape_forever(self._pod_metrics, self.addresses))

    async def shutdown(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
        if self._owns_upstream:
            self._upstream.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- the choice --------------------------------------------------------------------------

    async def decide(self, kind: str, body: bytes, *, subset: Collection[str] | None = None) -> Decision:
        """The ranking for a request of ``kind`` (``completions`` or ``chat``) with ``body``;
        ``subset``: the endpoints (``ip:port``, :func:`endpoint_of`) it may go to (``None``: any).
        :class:`RouteError` when it cannot go anywhere: 400 (not a JSON object with a string
        ``model``), 404 (no pod serves its model), 503 (none of them is live, or in the subset)."""
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise RouteError(400, f"the body is not JSON: {error}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
            raise RouteError(400, "the body must be a JSON object with a string 'model'")
        config = await self.handles.config.aget()
        self._config = config
        model, lora = base_model(config, payload["model"])
        pods = live_pods(config, model)
        if not pods:
            if model not in config.pods.values() and model not in config.pod_models:
                raise RouteError(404, f"no pod serves the model {payload['model']!r}", "not_found_error")
            raise RouteError(
                503, f"no live pod serves {payload['model']!r} (disabled, down or no address)", "unavailable"
            )
        if subset is not None:
            allowed = set(subset)
            pods = {pod: address for pod, address in pods.items() if endpoint_of(address) in allowed}
            if not pods:
                raise RouteError(
                    503, f"no live pod serving {payload['model']!r} is in the subset", "unavailable"
                )
        keys, matched, token_count = await self._prefix(config, model, lora, kind, payload, pods, len(body))
        now = time.monotonic()
        candidates = [self._candidate(pod, matched.get(pod, 0), now) for pod in pods]
        streamed = payload.get("stream") is True
        affinity = affinity_of(keys)
        split = sides(pods, config.pod_roles)
        if split is None:
            ranked = self.policy.rank(candidates, blocks=len(keys), affinity=affinity)
            return Decision(model, keys, ranked, pods, streamed, payload)
        ranked = self._rank_decode([c for c in candidates if c.pod in split.decode], keys)
        uncached = uncached_tokens(token_count, ranked[0].matched, config.model(model).block_size)
        if token_count and uncached < self.settings.pd_threshold_tokens:
            self.metrics.pd_requests.labels(SHORT_PROMPT).inc()
            return Decision(model, keys, ranked, pods, streamed, payload, pd=SHORT_PROMPT)
        prefill = [c for c in candidates if c.pod in split.prefill]
        prefill = self.policy.rank(prefill, blocks=len(keys), affinity=affinity)
        return Decision(model, keys, ranked, pods, streamed, payload, prefill=prefill, pd=DISAGGREGATED)

    def decode_pods_now(self, decision: Decision) -> list[Candidate]:
        """A P/D request's decode pods ranked again with their load now, its prefill step done:
        the pod it goes to is chosen when its prompt's KV cache is ready to be pulled, not when
        the prefill began (a burst's requests would otherwise all see the same idle pod)."""
        if self.policy.source == "none":  # random, round-robin, least-loaded: as they chose
            return decision.ranked
        now = time.monotonic()
        fresh = [self._candidate(c.pod, c.matched, now) for c in decision.ranked]
        return self._rank_decode(fresh, decision.keys)

    def _rank_decode(self, decode: list[Candidate], keys: list[int]) -> list[Candidate]:
        """Decode pods best first: a policy that reads prefixes ranks them by load, then by their
        own prefix hits (what a decode pod holds it need not pull, but pulling is cheap against
        computing: a busy pod's hit is not worth a wait); the others (random, round-robin,
        least-loaded) their own way."""
        if self.policy.source == "none":
            return self.policy.rank(decode, blocks=len(keys), affinity=affinity_of(keys))
        shuffled = {c.pod: self.policy.rng.random() for c in decode}
        return sorted(decode, key=lambda c: (c.cost, -c.matched, shuffled[c.pod]))

    def _candidate(self, pod: str, matched: int, now: float) -> Candidate:
        tracker = self.load
        load = tracker.of(pod, now=now)
        return Candidate(
            pod,
            matched,
            load,
            tracker.queued(pod, load),
            wait=tracker.wait_seconds(pod, load),
            prefill_ahead=tracker.prefilling.get(pod, 0.0),
            block_seconds=tracker.times.block_seconds,
            running_seconds=tracker.times.running_seconds,
        )

    def chosen(self, decision: Decision, candidate: Candidate, *, counted: bool = True) -> None:
        """``candidate``'s pod took the request: it is taken to hold its blocks (a speculative
        entry, this replica's and shared through the index, or the memory's), and counted
        (``counted``: the decode step of a request served in two steps is not; its prefill
        step, where the prompt is computed, is)."""
        model, keys = decision.model, decision.keys
        if self.policy.source == "index":
            self.speculative.record(model, keys, candidate.pod, now=time.monotonic())
            if self._sharing and keys:
                self._share_speculation(model, candidate.pod, keys)
        elif self.policy.source == "memory":
            self.memory.record(model, keys, candidate.pod, now=time.monotonic())
        if not counted:
            return
        policy = self.policy.name
        self.metrics.matched.labels(policy).inc(candidate.matched)
        if candidate.matched:
            self.metrics.hits.labels(policy).inc()
        self.metrics.blocks.labels(policy).inc(len(keys))

    async def models(self) -> list[str]:
        """The live pods' models and their LoRA adapters."""
        config = await self.handles.config.aget()
        served = sorted({m for m in config.pods.values() if live_pods(config, m)})
        return [*served, *(a for m in served for a in config.model(m).lora_adapters)]

    # --- the prefix ----------------------------------------------------------------------------

    async def _prefix(
        self,
        config: ServiceConfig,
        model: str,
        lora: str | None,
        kind: str,
        payload: dict,
        pods: Mapping[str, str],
        body_bytes: int,
    ) -> tuple[list[int], dict[str, int], int]:
        """The request's block keys, per pod the leading blocks the policy's source says it holds
        ({} when the policy needs none, or tokenizing or the index failed) and its prompt tokens
        (0: not known)."""
        source = self.policy.source
        if source == "none":
            return [], {}, 0
        try:
            if self._keys_on_loop(config, model, kind, payload, body_bytes):
                keyed = self._key(config, model, lora, kind, payload)
            else:
                keyed = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._key, config, model, lora, kind, payload
                )
        except Exception as error:  # the pod will answer the request's own errors
            self.metrics.score_failures.labels(type(error).__name__).inc()
            log.debug("routing %s without its prefix: %s", model, error)
            return [], {}, 0
        keys = keyed.keys
        if source == "memory":
            return keys, self.memory.matched(model, keys, now=time.monotonic()), keyed.token_count
        keyed.wanted = frozenset(pods)
        result, shared = await self._look_up(config, model, keyed)
        matched: dict[str, int] = {}
        if result is not None:
            for holder, score in result.scores.items():
                pod = owner_pod(holder)
                matched[pod] = max(matched.get(pod, 0), score.matched_blocks)
        for speculated in (shared, self.speculative.matched(model, keys, now=time.monotonic())):
            for pod, n in speculated.items():
                matched[pod] = max(matched.get(pod, 0), n)
        return keys, matched, keyed.token_count

    def _keys_on_loop(
        self, config: ServiceConfig, model: str, kind: str, payload: dict, body_bytes: int
    ) -> bool:
        """Whether the request is keyed on the event loop: a body of at most
        ``INLINE_MAX_BODY_BYTES``, no template of its own (it renders in the sandbox's process)
        and the model's tokenizer already loaded. Such a request takes ~1.5 ms of CPU for 1,000
        tokens; in the pool it took a thread hand-off each way and, with the loop busy relaying
        other answers, a wait for the GIL after each step that releases it (tokenizing, every
        index read): most of its own time under load."""
        if body_bytes > INLINE_MAX_BODY_BYTES:
            return False
        if kind == "chat" and payload.get("chat_template") is not None:
            return False
        return self.handles.tokenizers(config).loaded(model) is not None

    async def _look_up(
        self, config: ServiceConfig, model: str, keyed: KeyedRequest
    ) -> tuple[ScoreResult | None, dict[str, int]]:
        """The index's scores for ``keyed`` (``None`` when nothing can match or reading the index
        failed, which is counted) and its speculative entries (every replica's).
        An index that reads on the event loop is read there, both reads at once on its pipelined
        connection (one round trip, no thread); another one in the pool."""
        if not keyed.needs_lookup:
            return None, {}
        index = self.handles.index()
        try:
            if not getattr(index, "reads_async", False):
                return await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._look_up_in_thread, index, config, model, keyed
                )
            if not self._sharing:
                return await alook_up(index, keyed, config=config), {}
            result, shared = await asyncio.gather(
                alook_up(index, keyed, config=config), self._speculated(index, model, keyed)
            )
            return result, shared
        except IndexUnavailable:
            self.metrics.score_failures.labels("index_unavailable").inc()
        except Exception as error:  # never the request's failure: it is routed on load alone
            self.metrics.score_failures.labels(type(error).__name__).inc()
            log.debug("routing %s without the index: %s", model, error)
        return None, {}

    def _look_up_in_thread(
        self, index: KVIndex, config: ServiceConfig, model: str, keyed: KeyedRequest
    ) -> tuple[ScoreResult, dict[str, int]]:
        result = look_up(index, keyed, config=config)
        shared = index.speculated(model=model, keys=keyed.keys) if self._sharing else {}
        return result, shared

    async def _speculated(self, index: KVIndex, model: str, keyed: KeyedRequest) -> dict[str, int]:
        """The index's speculative entries for ``keyed``, on the event loop where the index reads
        there (``aspeculated``), else in the pool."""
        aspeculated = getattr(index, "aspeculated", None)
        if aspeculated is not None:
            return await aspeculated(model=model, keys=keyed.keys)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(index.speculated, model=model, keys=keyed.keys)
        )

    def _share_speculation(self, model: str, pod: str, keys: list[int]) -> None:
        """The speculative entry, written to the index for the other replicas, off the request's
        path: on the event loop where the index writes there (``aspeculate``: one script call on
        its pipelined connection), else in the pool. Failures are counted."""
        index = self.handles.index()
        seconds = self.settings.speculative_seconds
        if getattr(index, "aspeculate", None) is None or not getattr(index, "reads_async", False):
            self._executor.submit(self._speculate_in_thread, index, model, pod, keys)
            return
        task = asyncio.create_task(index.aspeculate(model=model, pod=pod, keys=keys, seconds=seconds))
        self._writes.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._count_speculation_failure(task.exception())

    def _speculate_in_thread(self, index: KVIndex, model: str, pod: str, keys: list[int]) -> None:
        try:
            index.speculate(model=model, pod=pod, keys=keys, seconds=self.settings.speculative_seconds)
        except Exception as error:
            self._count_speculation_failure(error)

    def _count_speculation_failure(self, error: BaseException) -> None:
        self.metrics.score_failures.labels(f"speculate_{type(error).__name__}").inc()
        log.debug("could not share a speculative entry: %s", error)

    def _key(
        self, config: ServiceConfig, model: str, lora: str | None, kind: str, payload: dict
    ) -> KeyedRequest:
        tokenizers = self.handles.tokenizers(config)
        salt = payload.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None  # anything else: the pod says what is wrong
        if kind == "chat":
            chat = ChatRequest(
                messages=payload.get("messages"),
                tools=payload.get("tools"),
                documents=payload.get("documents"),
                chat_template=payload.get("chat_template"),
                chat_template_kwargs=payload.get("chat_template_kwargs"),
                add_generation_prompt=payload.get("add_generation_prompt", True),  # vLLM's default
                continue_final_message=payload.get("continue_final_message", False),
            )
            return key_chat(
                tokenizers=tokenizers,
                config=config,
                model=model,
                chat=chat,
                lora_name=lora,
                cache_salt=salt,
                sandbox=self.handles.sandbox() if chat.chat_template is not None else None,
                allow_request_templates=self.settings.allow_request_templates,
            )
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch goes where its first prompt is warmest
        if isinstance(prompt, str):
            return key_prompt(
                tokenizers=tokenizers,
                config=config,
                model=model,
                prompt=prompt,
                lora_name=lora,
                cache_salt=salt,
            )
        if isinstance(prompt, list):
            return key_token_ids(
                config=config, model=model, token_ids=prompt, lora_name=lora, cache_salt=salt
            )
        raise TypeError("prompt is neither text nor token ids")

    # --- the pods' load ------------------------------------------------------------------------

    async def _pod_metrics(self, address: str) -> bytes:
        """A pod's ``/metrics`` body (the load scraper's); :class:`PodMetricsError` when it does
        not answer 200 in time, whole and at most ``MAX_METRICS_BYTES``."""
        try:
            status, body = await self._upstream.fetch(
                address,
                b"/metrics",
                self._pod_authorization,
                timeout=SCRAPE_TIMEOUT_SECONDS,
                max_bytes=MAX_METRICS_BYTES,
            )
        except UpstreamError as error:
            reason = error.reason if error.reason in READ_FAILURES else "error"
            raise PodMetricsError(reason, str(error)) from None
        if status != 200:
            raise PodMetricsError("status", f"HTTP {status}")
        return body

    async def live(self) -> dict[str, str]:
        """Every live pod's address, from a current registry snapshot."""
        self._config = await self.handles.config.aget()
        return self.addresses()

    def addresses(self) -> dict[str, str]:
        """Every live pod's address (the load scraper's targets)."""
        config = self._config
        if config is None:
            return {}
        return {
            pod: address for m in set(config.pods.values()) for pod, address in live_pods(config, m).items()
        }


@functools.lru_cache(maxsize=4096)
def endpoint_of(address: str) -> str:
    """A pod's registry address (``host:port``) as a proxy names endpoints: ``ip:port`` (an IPv6
    address in brackets). A host name is resolved once (the first address it has); one that does
    not resolve stays as it is."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError, ValueError):
            return address
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def base_model(config: ServiceConfig, name: str) -> tuple[str, str | None]:
    """``(model, lora)``: a served model as it is, or a LoRA adapter's base model and its name."""
    if name in config.pods.values():
        return name, None
    for model in set(config.pods.values()):
        if name in config.model(model).lora_adapters:
            return model, name
    return name, None


def live_pods(config: ServiceConfig, model: str) -> dict[str, str]:
    """pod -> address of the pods that may take a request for ``model``."""
    unscored = config.unscored_pods
    return {
        pod: config.pod_addresses[pod]
        for pod, served in config.pods.items()
        if served == model and pod not in unscored and pod in config.pod_addresses
    }
