"""The gateway as a plain ASGI application (no Django): an OpenAI endpoint in front of the fleet.

``POST /v1/completions`` and ``/v1/chat/completions``: the routing core (``routing.router``, the
EPP's too) tokenizes the request once (the chat template too, with vLLM's default
``add_generation_prompt``), looks its block keys up in the index (plus speculative entries) and
has the policy rank the model's live pods; the body goes to the first unchanged; the pod's answer
comes back byte for byte, streamed chunk by chunk, with ``x-kvcache-pod`` and
``x-kvcache-policy``. A connect error or a 5xx before the first byte sends it to the next pod
(``retries`` more at most). Tokenizing or the index failing never fails a request: it is routed
on load alone and counted. ``GET /v1/models`` (the live pods' models and LoRA adapters),
``/health``, ``/metrics``.

Which pods are live, how salted and multimodal requests are keyed: ``routing.router``.

Trust (issue 27):

* with ``api_keys``, every path but ``/health`` needs ``Authorization: Bearer <key>`` (401 in
  OpenAI's shape); ``pod_api_key``, when set, replaces the client's ``Authorization`` towards
  the pods;
* ``x-kvcache-matched-blocks`` (how many of the prompt's blocks the chosen pod was known to hold)
  is sent only when ``matched_blocks_header`` is on: it tells any client whether a guessed prefix,
  another tenant's prompt included, is cached. Tenants that send a ``cache_salt`` are kept apart
  whatever it says;
* the client's header bytes go to the pod as they came (``routing.upstream``), less the hop-by-hop
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
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway import metrics
from routing.disaggregation import DISAGGREGATED, FALLBACK, Prefilled, decode_body, prefill
from routing.load import Dispatch
from routing.policies import DEFAULT_ALPHA, Candidate
from routing.router import ROUTED_PATHS, Decision, RouteError, Router, RouterHandles, RouterSettings
from routing.upstream import Upstream, UpstreamError, UpstreamResponse
from stack.trust import TrustedProxies, bearer_problem

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
NOT_FOR_PODS = HOP_BY_HOP | {b"expect", b"x-forwarded-for", b"x-prefiller-host-port"}
"""Request headers the gateway does not pass on as they are (``X-Forwarded-For``: it writes its
own; ``x-prefiller-host-port`` would tell a decode pod's sidecar, ``gateway.sidecar``, where to
send the prompt)."""
FORWARDING = frozenset({b"forwarded", b"x-real-ip"})
"""With ``X-Forwarded-*``: what a client says of where it comes from, passed on from trusted proxies only."""
CHALLENGE = [(b"www-authenticate", b'Bearer realm="kvcache-gateway"')]


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
    pd_threshold_tokens: int = 0
    """P/D: a request whose decode pod would compute fewer prompt tokens skips the prefill step."""
    prefill_timeout: float = 60.0
    """P/D: the longest wait for a prefill pod's whole answer; then the decode pod serves it whole."""


GatewayHandles = RouterHandles
"""How the gateway reaches the shared state (the Django shell's, or a test's)."""


class Refused(Exception):
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


@dataclass(frozen=True, slots=True)
class _Step:
    """A request's prefill step: the ``pod`` it came to (none: every pod tried failed), what it
    came to, and the prompt's leading blocks that pod was known to hold."""

    pod: str
    prefilled: Prefilled
    matched: int


class GatewayApp:
    def __init__(self, handles: GatewayHandles, settings: GatewaySettings) -> None:
        self.handles = handles
        self.settings = settings
        self._upstream = Upstream(
            connect_timeout=settings.connect_timeout, first_byte_timeout=settings.first_byte_timeout
        )
        self.router = Router(
            handles,
            RouterSettings(
                policy=settings.policy,
                alpha=settings.alpha,
                speculative_seconds=settings.speculative_seconds,
                threads=settings.threads,
                seed=settings.seed,
                allow_request_templates=settings.allow_request_templates,
                pod_api_key=settings.pod_api_key,
                pd_threshold_tokens=settings.pd_threshold_tokens,
            ),
            metrics.ROUTING,
            upstream=self._upstream,
        )
        self.policy = self.router.policy
        self.load = self.router.load
        self._proxies = TrustedProxies(settings.trusted_proxies)
        self._pod_authorization = (
            [(b"authorization", b"Bearer " + settings.pod_api_key.encode())] if settings.pod_api_key else []
        )
        self._not_for_pods = NOT_FOR_PODS | ({b"authorization"} if settings.pod_api_key else set())

    # --- lifecycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        await self.router.startup()

    async def shutdown(self) -> None:
        await self.router.shutdown()
        self._upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if not self.router.started:  # served without a lifespan (some test servers)
            await self.startup()
        path, method = scope["path"], scope["method"]
        try:
            if self.settings.api_keys and path != "/health":
                self._authenticate(scope)
            if path in ROUTED_PATHS:
                if method != "POST":
                    raise Refused(405, f"{path} takes POST")
                await self._route(scope, receive, send, ROUTED_PATHS[path])
            elif path == "/v1/models" and method == "GET":
                await send_json(send, 200, await self._models())
            elif path == "/health" and method == "GET":
                await send_json(send, 200, {"status": "ok"})
            elif path == "/metrics" and method == "GET":
                body, content_type = metrics.exposition()
                await send_bytes(send, 200, body, content_type.encode())
            else:
                raise Refused(404, f"no route {method} {path}", "not_found_error")
        except Refused as refused:
            await send_error(send, refused.status, str(refused), refused.kind, refused.headers)

    def _authenticate(self, scope: Scope) -> None:
        """Passes a request with one of the API keys (``stack.trust``, as the scoring API's)."""
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        problem = bearer_problem(header, self.settings.api_keys)
        if problem is not None:
            raise Refused(401, problem, "authentication_error", CHALLENGE)

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
        body = await read_body(receive, self.settings.max_body_bytes)
        received = time.perf_counter()
        try:
            decision = await self.router.decide(kind, body)
        except RouteError as error:
            raise Refused(error.status, str(error), error.kind) from None
        await self._forward(scope, receive, send, body, decision, received)

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, decision: Decision, received: float
    ) -> None:
        policy = self.policy.name
        keys, pods = decision.keys, decision.pods
        headers = self._pod_headers(scope)
        target = scope["path"].encode()  # one of ROUTED_PATHS
        metrics.OVERHEAD.labels(policy).observe(time.perf_counter() - received)
        # One watcher for the whole hop: when the client goes away, at any await below (the
        # prefill step, connecting, waiting for the pod's head, relaying its body), this task is
        # cancelled and the pod's connection closed with it.
        watcher = asyncio.create_task(cancel_on_departure(receive, asyncio.current_task()))
        pod, outcome = "", "upstream_error"
        try:
            extra, prefilled = [], False
            if decision.pd:
                extra.append((b"x-kvcache-pd", decision.pd.encode()))
            if decision.prefill:
                step = await self._prefill(decision, headers, target)
                if step.prefilled.refusal is not None:
                    pod, outcome = step.pod, "prefill_refused"
                    status, answer = step.prefilled.refusal
                    pd = [(b"x-kvcache-pod", pod.encode()), (b"x-kvcache-pd", b"prefill_refused")]
                    await send_bytes(send, status, answer, b"application/json", pd)
                    return
                decision.ranked = self.router.decode_pods_now(decision)
                if step.prefilled.params is not None:
                    body, prefilled = decode_body(decision.payload, step.prefilled.params), True
                    extra = [(b"x-kvcache-pd", DISAGGREGATED.encode())]
                    extra.append((b"x-kvcache-prefill-pod", step.pod.encode()))
                    if self.settings.matched_blocks_header:
                        extra.append((b"x-kvcache-prefill-matched-blocks", str(step.matched).encode()))
                else:
                    extra = [(b"x-kvcache-pd", FALLBACK.encode())]
            problems: list[tuple[str, str]] = []
            for attempt, candidate in enumerate(decision.ranked[: 1 + self.settings.retries]):
                if attempt:
                    metrics.RETRIES.labels(policy, problems[-1][0]).inc()
                pod = candidate.pod
                prefill = 0 if prefilled else max(0, len(keys) - candidate.matched)
                # A decode step's first bytes mark a KV pull, not a prefill: nothing to learn from.
                learn = decision.streamed and not prefilled
                dispatch = self.load.start(pod, prefill_blocks=prefill, learn=learn)
                try:
                    sent = time.perf_counter()
                    try:
                        response = await self._upstream.request(pods[pod], b"POST", target, headers, body)
                    except UpstreamError as error:
                        if error.reason == "timeout":  # the pod may still be working on it: no retry
                            seconds = self.settings.first_byte_timeout
                            message = f"{pod} did not answer within {seconds:g} s"
                            await send_error(send, 504, message, "upstream_timeout")
                            return
                        problems.append((error.reason, f"{pod}: {error}"))
                        continue
                    if response.status >= 500:
                        response.close()
                        problems.append(("status", f"{pod}: HTTP {response.status}"))
                        continue
                    self.router.chosen(decision, candidate, counted=not prefilled)
                    step = "transfer" if prefilled else None
                    outcome = await self._relay(response, send, candidate, sent, dispatch, extra, step)
                    return
                finally:
                    self.load.finish(dispatch)
            pod = ""
            detail = "; ".join(message for _, message in problems) or "no pod to try"
            await send_error(send, 502, f"no pod answered: {detail}", "upstream_error")
        except asyncio.CancelledError:
            if not departed(watcher) or asyncio.current_task().uncancel():  # not (only) the client's
                raise
            outcome = "client_gone"
        finally:
            watcher.cancel()
            metrics.REQUESTS.labels(policy, pod, outcome).inc()

    async def _prefill(self, decision: Decision, headers: list[tuple[bytes, bytes]], target: bytes) -> _Step:
        """The prefill step of a request served in two steps (``routing.disaggregation``) on the
        best prefill pod, then the next ones after a failure (``retries`` more at most): its
        ``kv_transfer_params``, or the pod's refusal of the request itself, or neither (counted):
        the decode pod then serves it whole."""
        routing, reason = metrics.ROUTING, "no_pod"
        for candidate in decision.prefill[: 1 + self.settings.retries]:
            pod = candidate.pod
            uncached = max(0, len(decision.keys) - candidate.matched)
            dispatch = self.load.start(pod, prefill_blocks=uncached, learn=False)
            sent = time.perf_counter()
            try:
                step = await prefill(
                    self._upstream,
                    decision.pods[pod],
                    target,
                    headers,
                    decision.payload,
                    timeout=self.settings.prefill_timeout,
                )
            finally:
                self.load.finish(dispatch)
            if step.refusal is not None:
                metrics.PD_PREFILLS.labels(pod, "refused").inc()
                return _Step(pod, step, candidate.matched)
            if step.params is None:
                reason = step.failure
                metrics.PD_PREFILLS.labels(pod, reason).inc()
                log.info("the prefill step on %s failed: %s", pod, reason)
                continue
            metrics.PD_PREFILLS.labels(pod, "ok").inc()
            metrics.PD_STEP.labels("prefill").observe(time.perf_counter() - sent)
            self.router.chosen(decision, candidate)
            routing.pd_requests.labels(DISAGGREGATED).inc()
            return _Step(pod, step, candidate.matched)
        routing.pd_fallbacks.labels(reason).inc()
        routing.pd_requests.labels(FALLBACK).inc()
        return _Step("", Prefilled(failure=reason), 0)

    async def _relay(
        self,
        response: UpstreamResponse,
        send: Send,
        candidate: Candidate,
        sent: float,
        dispatch: Dispatch,
        extra: list[tuple[bytes, bytes]],
        step: str | None,
    ) -> str:
        """The pod's answer to the client (:func:`relay`) with the gateway's headers and the
        ``extra`` ones; returns the outcome. ``step``: the P/D step whose time ends with the
        first bytes (``transfer``: the decode pod pulled the prompt's KV cache, then answered)."""
        policy = self.policy.name
        headers = [(b"x-kvcache-pod", candidate.pod.encode())]
        if self.settings.matched_blocks_header:
            headers.append((b"x-kvcache-matched-blocks", str(candidate.matched).encode()))
        headers.append((b"x-kvcache-policy", policy.encode()))

        def first_bytes() -> None:
            metrics.TTFT.labels(policy).observe(time.perf_counter() - sent)
            if step is not None:
                metrics.PD_STEP.labels(step).observe(time.perf_counter() - sent)
            self.load.answered(dispatch)

        return await relay(response, send, candidate.pod, headers + extra, first_bytes)

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
        ids = await self.router.models()
        return {
            "object": "list",
            "data": [{"id": i, "object": "model", "created": 0, "owned_by": "kvcache-gateway"} for i in ids],
        }


async def relay(
    response: UpstreamResponse,
    send: Send,
    pod: str,
    extra: list[tuple[bytes, bytes]],
    first_bytes: Callable[[], None] = lambda: None,
) -> str:
    """``pod``'s answer to the client as it comes, with the ``extra`` headers; returns the outcome
    (``ok`` or ``upstream_error``). The client's head waits for the body's first bytes
    (``first_bytes`` is called when they come): a body malformed from its start is a 502, not a
    200 cut short. A body that breaks off later leaves the client's answer unfinished (uvicorn
    closes it)."""
    done = False
    try:
        try:
            chunk = await response.next_chunk()
        except UpstreamError as error:
            await send_error(send, 502, f"{pod} answered malformed: {error}", "upstream_error")
            return "upstream_error"
        first_bytes()
        headers = [
            (k, v)
            for k, v in response.headers
            if k.lower() not in HOP_BY_HOP or k.lower() == b"content-length"
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers + extra})
        while True:
            last = response.at_end()
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                break
            try:
                chunk = await response.next_chunk()
            except UpstreamError as error:
                log.warning("the answer of %s broke off: %s", pod, error)
                return "upstream_error"
        done = True
        return "ok"
    finally:
        if done:
            response.release()  # read to the end: the connection is kept for the next request
        else:
            response.close()  # closing the connection ends the pod's request


async def read_body(receive: Receive, limit: int) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refused(499, "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"the body is over {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def cancel_on_departure(receive: Receive, request: asyncio.Task | None) -> None:
    """Cancels ``request`` (the task relaying it) when its client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if request is not None:
        request.cancel()


def departed(watcher: asyncio.Task) -> bool:
    """Whether ``cancel_on_departure`` saw the client go (and cancelled the request)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or ())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_bytes(send, status, orjson.dumps(payload), b"application/json", extra)


async def send_error(
    send: Send, status: int, message: str, kind: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """OpenAI's error shape."""
    await send_json(send, status, {"error": {"message": message, "type": kind, "code": status}}, extra)
