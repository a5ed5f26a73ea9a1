"""The gateway as a plain ASGI application (no Django): an OpenAI endpoint in front of the fleet.

``POST /v1/completions`` and ``/v1/chat/completions``: the request is tokenized once (the chat
template too, with vLLM's default ``add_generation_prompt``), its block keys looked up in the
index (plus speculative entries), the policy ranks the model's live pods, and the body goes to
the first unchanged; the pod's answer comes back byte for byte, streamed chunk by chunk, with
``x-kvcache-pod`` and ``x-kvcache-policy``. A connect error or a 5xx before the first byte sends it
to the next pod (``retries`` more at most). Tokenizing or the index failing never fails a request:
it is routed on load alone and counted. ``GET /v1/models`` (the live pods' models and LoRA
adapters), ``/health``, ``/metrics``.

Live pods: registered, enabled, not found down by the prober, with an address, serving the
request's model (or the base model of the LoRA adapter it names).

A request's ``cache_salt`` (vLLM's completions and chat field) keys its blocks as the pods' events
key them, so a salted request is routed by its salted prefix. Multimodal inputs are out of scope:
vLLM's media identifiers are hashes its processor computes from the media, which the gateway does
not reproduce, so a conversation with non-text content parts is routed on load alone (keying it
fails, and is counted).

Trust (issue 27):

* with ``api_keys``, every path but ``/health`` needs ``Authorization: Bearer <key>`` (401 in
  OpenAI's shape); ``pod_api_key``, when set, replaces the client's ``Authorization`` towards
  the pods;
* ``x-kvcache-matched-blocks`` (how many of the prompt's blocks the chosen pod was known to hold)
  is sent only when ``matched_blocks_header`` is on: it tells any client whether a guessed prefix,
  another tenant's prompt included, is cached. Tenants that send a ``cache_salt`` are kept apart
  whatever it says;
* the client's header bytes go to the pod as they came (``gateway.upstream``), less the hop-by-hop
  ones and ``Expect`` (the gateway has the whole body before it picks a pod); ``X-Forwarded-For``
  names the client's connection, after what a trusted proxy (``trusted_proxies``) said; the other
  forwarding headers (``X-Forwarded-*``, ``Forwarded``, ``X-Real-IP``) pass only from a trusted
  proxy;
* every wait on a pod is bounded (``connect_timeout``, ``first_byte_timeout``: 504), a pod's
  malformed answer is a 502 (or, once the client's answer has begun, its connection closes), and
  a client that goes away, at any point, closes the pod's request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from gateway import metrics
from gateway.load import SCRAPE_TIMEOUT_SECONDS, Dispatch, LoadTracker
from gateway.memory import KeyMemory
from gateway.policies import DEFAULT_ALPHA, Candidate, affinity_of, make_policy
from gateway.upstream import Upstream, UpstreamError, UpstreamResponse
from kvindex import IndexUnavailable, KVIndex
from registry.config import ServiceConfig, owner_pod
from registry.pod_metrics import MAX_METRICS_BYTES, READ_FAILURES, PodMetricsError
from registry.snapshot import ConfigSource
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
from stack.trust import TrustedProxies, bearer_problem
from tokenization.template_sandbox import TemplateSandbox
from tokenization.tokenizers import TokenizerRegistry

log = logging.getLogger(__name__)

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
NOT_FOR_PODS = HOP_BY_HOP | {b"expect", b"x-forwarded-for"}
"""Request headers the gateway does not pass on as they are (``X-Forwarded-For``: it writes its own)."""
FORWARDING = frozenset({b"forwarded", b"x-real-ip"})
"""With ``X-Forwarded-*``: what a client says of where it comes from, passed on from trusted proxies only."""
CHALLENGE = [(b"www-authenticate", b'Bearer realm="kvcache-gateway"')]
ROUTED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
INLINE_MAX_BODY_BYTES = 16 * 1024
"""A request body up to this size (a prompt of ~4,000 tokens, ~5 ms to key at most) is keyed on the
event loop (``GatewayApp._keys_on_loop``); a larger one in the pool, so it holds up no other
request's relay."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    policy: str = "kv-load"
    alpha: float = DEFAULT_ALPHA
    speculative_seconds: float = 2.0
    retries: int = 2
    connect_timeout: float = 2.0
    first_byte_timeout: float = 300.0
    """Longest wait for a pod's answer to begin (its head: for a non-streaming request, when the
    completion is done); then 504."""
    max_body_bytes: int = 4 * 1024 * 1024
    threads: int = 8
    seed: int | None = None
    allow_request_templates: bool = True
    api_keys: tuple[str, ...] = ()
    """The clients' keys (``Authorization: Bearer``); empty: every client is served."""
    pod_api_key: str = ""
    """Sent to the pods as ``Authorization: Bearer`` instead of the client's; empty: the client's."""
    matched_blocks_header: bool = False
    """Send ``x-kvcache-matched-blocks`` (a prefix-cache oracle for any client: off by default)."""
    trusted_proxies: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GatewayHandles:
    """How the gateway reaches the shared state (the Django shell's, or a test's)."""

    config: ConfigSource
    index: Callable[[], KVIndex]
    tokenizers: Callable[[ServiceConfig], TokenizerRegistry]
    sandbox: Callable[[], TemplateSandbox | None]


class _Refused(Exception):
    """A request answered by the gateway itself (an OpenAI-style error)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or []


class GatewayApp:
    def __init__(self, handles: GatewayHandles, settings: GatewaySettings) -> None:
        self.handles = handles
        self.settings = settings
        self.policy = make_policy(settings.policy, rng=random.Random(settings.seed), alpha=settings.alpha)
        metrics.POLICY.labels(settings.policy).set(1)
        # Speculative entries: this replica's own, exact and at once, and the index's, shared
        # with the other replicas (a round trip later).
        self.speculative = KeyMemory(ttl=settings.speculative_seconds, max_keys=200_000)
        self._sharing = settings.speculative_seconds > 0
        self.memory = KeyMemory(ttl=None, max_keys=1_000_000)
        self.load = LoadTracker()
        self._executor = ThreadPoolExecutor(settings.threads, thread_name_prefix="gateway")
        self._upstream = Upstream(
            connect_timeout=settings.connect_timeout, first_byte_timeout=settings.first_byte_timeout
        )
        self._scraper: asyncio.Task | None = None
        self._writes: set[asyncio.Task] = set()  # speculative entries on their way to the index
        self._config: ServiceConfig | None = None
        self._proxies = TrustedProxies(settings.trusted_proxies)
        self._pod_authorization = (
            [(b"authorization", b"Bearer " + settings.pod_api_key.encode())] if settings.pod_api_key else []
        )
        self._not_for_pods = NOT_FOR_PODS | ({b"authorization"} if settings.pod_api_key else set())

    # --- lifecycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        self._scraper = asyncio.create_task(self.load.scrape_forever(self._pod_metrics, self._addresses))

    async def shutdown(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
        self._upstream.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self._scraper is None:  # served without a lifespan (some test servers)
            await self.startup()
        path, method = scope["path"], scope["method"]
        try:
            if self.settings.api_keys and path != "/health":
                self._authenticate(scope)
            if path in ROUTED_PATHS:
                if method != "POST":
                    raise _Refused(405, f"{path} takes POST")
                await self._route(scope, receive, send, ROUTED_PATHS[path])
            elif path == "/v1/models" and method == "GET":
                await _send_json(send, 200, await self._models())
            elif path == "/health" and method == "GET":
                await _send_json(send, 200, {"status": "ok"})
            elif path == "/metrics" and method == "GET":
                body, content_type = metrics.exposition()
                await _send(send, 200, body, content_type.encode())
            else:
                raise _Refused(404, f"no route {method} {path}", "not_found_error")
        except _Refused as refused:
            await _send_error(send, refused.status, str(refused), refused.kind, refused.headers)

    def _authenticate(self, scope: Scope) -> None:
        """Passes a request with one of the API keys (``stack.trust``, as the scoring API's)."""
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        problem = bearer_problem(header, self.settings.api_keys)
        if problem is not None:
            raise _Refused(401, problem, "authentication_error", CHALLENGE)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- routing -----------------------------------------------------------------------------

    async def _route(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        body = await _read_body(receive, self.settings.max_body_bytes)
        received = time.perf_counter()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise _Refused(400, f"the body is not JSON: {error}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
            raise _Refused(400, "the body must be a JSON object with a string 'model'")
        config = await self.handles.config.aget()
        self._config = config
        model, lora = _base_model(config, payload["model"])
        pods = _live_pods(config, model)
        if not pods:
            if model not in config.pods.values():
                raise _Refused(404, f"no pod serves the model {payload['model']!r}", "not_found_error")
            raise _Refused(
                503, f"no live pod serves {payload['model']!r} (disabled, down or no address)", "unavailable"
            )
        keys, matched = await self._prefix(config, model, lora, kind, payload, pods, len(body))
        now = time.monotonic()
        candidates = []
        tracker = self.load
        block_seconds, running_seconds = tracker.times.block_seconds, tracker.times.running_seconds
        for pod in pods:
            load = tracker.of(pod, now=now)
            candidates.append(
                Candidate(
                    pod,
                    matched.get(pod, 0),
                    load,
                    tracker.queued(pod, load),
                    wait=tracker.wait_seconds(pod, load),
                    prefill_ahead=tracker.prefilling.get(pod, 0.0),
                    block_seconds=block_seconds,
                    running_seconds=running_seconds,
                )
            )
        ranked = self.policy.rank(candidates, blocks=len(keys), affinity=affinity_of(keys))
        streamed = payload.get("stream") is True
        await self._forward(scope, receive, send, body, ranked, pods, model, keys, received, streamed)

    async def _prefix(
        self,
        config: ServiceConfig,
        model: str,
        lora: str | None,
        kind: str,
        payload: dict,
        pods: Mapping[str, str],
        body_bytes: int,
    ) -> tuple[list[int], dict[str, int]]:
        """The request's block keys and, per pod, the leading blocks the policy's source says
        it holds ({} when the policy needs none, or tokenizing or the index failed)."""
        source = self.policy.source
        if source == "none":
            return [], {}
        try:
            if self._keys_on_loop(config, model, kind, payload, body_bytes):
                keyed = self._key(config, model, lora, kind, payload)
            else:
                keyed = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._key, config, model, lora, kind, payload
                )
        except Exception as error:  # the pod will answer the request's own errors
            metrics.SCORE_FAILURES.labels(type(error).__name__).inc()
            log.debug("routing %s without its prefix: %s", model, error)
            return [], {}
        keys = keyed.keys
        if source == "memory":
            return keys, self.memory.matched(model, keys, now=time.monotonic())
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
        return keys, matched

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
        failed, which is counted) and its speculative entries (every gateway replica's).
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
            metrics.SCORE_FAILURES.labels("index_unavailable").inc()
        except Exception as error:  # never the request's failure: it is routed on load alone
            metrics.SCORE_FAILURES.labels(type(error).__name__).inc()
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
            _count_speculation_failure(task.exception())

    def _speculate_in_thread(self, index: KVIndex, model: str, pod: str, keys: list[int]) -> None:
        try:
            index.speculate(model=model, pod=pod, keys=keys, seconds=self.settings.speculative_seconds)
        except Exception as error:
            _count_speculation_failure(error)

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

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        ranked: list[Candidate],
        pods: Mapping[str, str],
        model: str,
        keys: list[int],
        received: float,
        streamed: bool,
    ) -> None:
        policy = self.policy.name
        headers = self._pod_headers(scope)
        target = scope["path"].encode()  # one of ROUTED_PATHS
        metrics.OVERHEAD.labels(policy).observe(time.perf_counter() - received)
        # One watcher for the whole hop: when the client goes away, at any await below (connecting,
        # waiting for the pod's head, relaying its body), this task is cancelled and the pod's
        # connection closed with it.
        watcher = asyncio.create_task(_cancel_on_departure(receive, asyncio.current_task()))
        pod, outcome = "", "upstream_error"
        try:
            problems: list[tuple[str, str]] = []
            for attempt, candidate in enumerate(ranked[: 1 + self.settings.retries]):
                if attempt:
                    metrics.RETRIES.labels(policy, problems[-1][0]).inc()
                pod = candidate.pod
                prefill = max(0, len(keys) - candidate.matched)
                dispatch = self.load.start(pod, prefill_blocks=prefill, learn=streamed)
                try:
                    sent = time.perf_counter()
                    try:
                        response = await self._upstream.request(pods[pod], b"POST", target, headers, body)
                    except UpstreamError as error:
                        if error.reason == "timeout":  # the pod may still be working on it: no retry
                            seconds = self.settings.first_byte_timeout
                            message = f"{pod} did not answer within {seconds:g} s"
                            await _send_error(send, 504, message, "upstream_timeout")
                            return
                        problems.append((error.reason, f"{pod}: {error}"))
                        continue
                    if response.status >= 500:
                        response.close()
                        problems.append(("status", f"{pod}: HTTP {response.status}"))
                        continue
                    if self.policy.source == "index":
                        self.speculative.record(model, keys, pod, now=time.monotonic())
                        if self._sharing and keys:
                            self._share_speculation(model, pod, keys)
                    elif self.policy.source == "memory":
                        self.memory.record(model, keys, pod, now=time.monotonic())
                    metrics.MATCHED.labels(policy).inc(candidate.matched)
                    if candidate.matched:
                        metrics.HITS.labels(policy).inc()
                    metrics.BLOCKS.labels(policy).inc(len(keys))
                    outcome = await self._relay(response, send, candidate, sent, dispatch)
                    return
                finally:
                    self.load.finish(dispatch)
            pod = ""
            detail = "; ".join(message for _, message in problems) or "no pod to try"
            await _send_error(send, 502, f"no pod answered: {detail}", "upstream_error")
        except asyncio.CancelledError:
            if not _departed(watcher) or asyncio.current_task().uncancel():  # not (only) the client's
                raise
            outcome = "client_gone"
        finally:
            watcher.cancel()
            metrics.REQUESTS.labels(policy, pod, outcome).inc()

    async def _relay(
        self, response: UpstreamResponse, send: Send, candidate: Candidate, sent: float, dispatch: Dispatch
    ) -> str:
        """The pod's answer to the client as it comes; returns the outcome. The client's head waits
        for the body's first bytes: a body malformed from its start is a 502, not a 200 cut short.
        A body that breaks off later leaves the client's answer unfinished (uvicorn closes it)."""
        policy = self.policy.name
        done = False
        try:
            try:
                chunk = await response.next_chunk()
            except UpstreamError as error:
                await _send_error(send, 502, f"{candidate.pod} answered malformed: {error}", "upstream_error")
                return "upstream_error"
            metrics.TTFT.labels(policy).observe(time.perf_counter() - sent)
            self.load.answered(dispatch)
            headers = [
                (k, v)
                for k, v in response.headers
                if k.lower() not in HOP_BY_HOP or k.lower() == b"content-length"
            ]
            headers.append((b"x-kvcache-pod", candidate.pod.encode()))
            if self.settings.matched_blocks_header:
                headers.append((b"x-kvcache-matched-blocks", str(candidate.matched).encode()))
            headers.append((b"x-kvcache-policy", policy.encode()))
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            while True:
                last = response.at_end()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
                try:
                    chunk = await response.next_chunk()
                except UpstreamError as error:
                    log.warning("the answer of %s broke off: %s", candidate.pod, error)
                    return "upstream_error"
            done = True
            return "ok"
        finally:
            if done:
                response.release()  # read to the end: the connection is kept for the next request
            else:
                response.close()  # closing the connection ends the pod's request

    def _pod_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The client's request headers for the pod, bytes as they came, less the hop-by-hop ones
        and ``Expect``; ``Authorization`` the pods' key when there is one; forwarding headers
        only from a trusted proxy, and ``X-Forwarded-For`` ending with the connection's peer."""
        client = scope.get("client")
        peer = client[0] if client else None
        trusted = peer is not None and self._proxies.trusts(peer)
        not_for_pods = self._not_for_pods
        headers, forwarded_for = [], []
        for name, value in scope["headers"]:  # ASGI: names in lower case
            if name in not_for_pods:
                if name == b"x-forwarded-for" and trusted:
                    forwarded_for.append(value)
            elif trusted or not (name in FORWARDING or name.startswith(b"x-forwarded-")):
                headers.append((name, value))
        headers += self._pod_authorization
        if peer is not None:
            forwarded_for.append(peer.encode())
            headers.append((b"x-forwarded-for", b", ".join(forwarded_for)))
        return headers

    # --- the rest ----------------------------------------------------------------------------

    async def _models(self) -> dict:
        config = await self.handles.config.aget()
        served = sorted({m for m in config.pods.values() if _live_pods(config, m)})
        ids = [*served, *(a for m in served for a in config.model(m).lora_adapters)]
        return {
            "object": "list",
            "data": [{"id": i, "object": "model", "created": 0, "owned_by": "kvcache-gateway"} for i in ids],
        }

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

    def _addresses(self) -> dict[str, str]:
        """Every live pod's address (the load scraper's targets)."""
        config = self._config
        if config is None:
            return {}
        return {
            pod: address for m in set(config.pods.values()) for pod, address in _live_pods(config, m).items()
        }


def _count_speculation_failure(error: BaseException) -> None:
    metrics.SCORE_FAILURES.labels(f"speculate_{type(error).__name__}").inc()
    log.debug("could not share a speculative entry: %s", error)


def _base_model(config: ServiceConfig, name: str) -> tuple[str, str | None]:
    """``(model, lora)``: a served model as it is, or a LoRA adapter's base model and its name."""
    if name in config.pods.values():
        return name, None
    for model in set(config.pods.values()):
        if name in config.model(model).lora_adapters:
            return model, name
    return name, None


def _live_pods(config: ServiceConfig, model: str) -> dict[str, str]:
    """pod -> address of the pods that may take a request for ``model``."""
    unscored = config.unscored_pods
    return {
        pod: config.pod_addresses[pod]
        for pod, served in config.pods.items()
        if served == model and pod not in unscored and pod in config.pod_addresses
    }


async def _read_body(receive: Receive, limit: int) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Refused(499, "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"the body is over {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def _cancel_on_departure(receive: Receive, request: asyncio.Task | None) -> None:
    """Cancels ``request`` (the task relaying it) when its client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if request is not None:
        request.cancel()


def _departed(watcher: asyncio.Task) -> bool:
    """Whether ``_cancel_on_departure`` saw the client go (and cancelled the request)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None


async def _send(
    send: Send, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or ())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(
    send: Send, status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    await _send(send, status, orjson.dumps(payload), b"application/json", extra)


async def _send_error(
    send: Send, status: int, message: str, kind: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """OpenAI's error shape."""
    await _send_json(send, status, {"error": {"message": message, "type": kind, "code": status}}, extra)
