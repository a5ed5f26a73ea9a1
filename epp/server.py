"""The Endpoint Picker as a plain gRPC service (no Django): Envoy's ext_proc filter opens one
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` stream per HTTP request, and the picker
names the pod the request goes to (the Gateway API Inference Extension's endpoint-picker
protocol, as llm-d's router speaks it).

One stream, in order:

1. the request's headers, then its body in chunks (``FULL_DUPLEX_STREAMED``): the picker buffers
   the body to its end (at most ``max_body_bytes``: over it, 413), then chooses with the routing
   core (``routing.router``: the gateway's own choice, tokenizing once, the index, speculative
   entries, the pods' load, the policy);
2. it answers the headers with a mutation that clears the route cache and sets
   ``x-gateway-destination-endpoint: <ip:port>[,<ip:port>...]`` (the primary, then up to
   ``fallbacks`` more in the policy's order), the same value as dynamic metadata
   ``envoy.lb`` / ``x-gateway-destination-endpoint``, then streams the body back unchanged
   (chunks of ``BODY_CHUNK_BYTES``);
3. on the response's headers, the endpoint that served (``x-gateway-destination-endpoint-served``,
   from the ``envoy.lb`` metadata Envoy forwards or from the header its route adds) takes the
   request's speculative entry and load; the client sees ``x-kvcache-pod`` instead of the address.

Envoy closes the stream once the response's headers are through, while the answer may stream for
minutes: what load the request puts on its pod, until it ends, the picker learns from Envoy's gRPC
access log (``envoy.service.accesslog.v3``, on the same port: :class:`AccessLog`), one entry per
request as it ends, matched by ``x-request-id`` (:class:`Endings`). Without that log the request
counts until the stream closes.

A subset hint (filter metadata ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``:
a list of ``ip:port``) restricts the candidates: none left is a 503, as no live pod is. A request
that cannot be routed gets Envoy's immediate response in OpenAI's error shape: 400 (not a JSON
object with a string ``model``), 404 (no pod serves its model), 413, 503; a sheddable request
(``x-kvcache-priority`` below 0) a 429 when every candidate pod has ``shed_queue`` requests
waiting. Other paths (``GET /v1/models``...) go to the least loaded live pod. The picker failing
(a bug) answers 500, or with ``fail_open`` lets the request through without a destination (Envoy's
own balancing then picks). What Envoy does when the picker is down is Envoy's setting
(``failure_mode_allow``: deploy/envoy/).

Trust: a client's own ``x-gateway-destination-endpoint*`` headers never choose a pod: the picker's
mutation overwrites the destination, and deploy/envoy's configuration drops them before the
picker sees the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp import metrics
from routing.disaggregation import DISAGGREGATED, FALLBACK
from routing.load import Dispatch, LoadTracker
from routing.router import ROUTED_PATHS, Decision, RouteError, Router, endpoint_of

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
PRIORITY = "x-kvcache-priority"
PREFILLER = "x-prefiller-host-port"
"""A P/D request's prefill pod (``ip:port``), for its decode pod's sidecar: llm-d's header."""
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
BODY_CHUNK_BYTES = 62 * 1024
"""The body goes back to Envoy in chunks of this size (under gRPC's 4 MiB message limit, and
Envoy's buffer limits, as the reference picker does)."""


@dataclass(frozen=True, slots=True)
class PickerSettings:
    fallbacks: int = 2
    """Endpoints named after the primary, for Envoy's retries."""
    max_body_bytes: int = 4 * 1024 * 1024
    shed_queue: float = 5.0
    """A sheddable request is refused (429) when every candidate pod has this many requests waiting."""
    fail_open: bool = False
    """When the picker fails (a bug), let the request through without a destination instead of 500."""


class Endings:
    """Requests whose picker stream has closed while Envoy still carries their answer: each keeps
    its load on its pod until Envoy's access log says it ended (or ``max_age`` passed: a log
    entry lost). Bounded: at most ``max_pending`` requests wait, the oldest ended first."""

    def __init__(self, load: LoadTracker, *, max_age: float = 900.0, max_pending: int = 65536) -> None:
        self.load = load
        self.max_age = max_age
        self.max_pending = max_pending
        self.logs = 0
        """Access-log streams from Envoy open now: with none, a request ends with its stream."""
        self._pending: OrderedDict[str, tuple[Dispatch, float]] = OrderedDict()
        self._ended: OrderedDict[str, float] = OrderedDict()  # logged before their stream closed

    def hand_over(self, request_id: str, dispatch: Dispatch) -> None:
        """``dispatch``'s stream closed: it ends now, or when the access log says so."""
        now = time.monotonic()
        if not request_id or not self.logs or self._ended.pop(request_id, None) is not None:
            self.load.finish(dispatch)
            return
        earlier = self._pending.pop(request_id, None)
        if earlier is not None:  # an id seen twice (Envoy makes them; a client's must not leak load)
            self.load.finish(earlier[0])
        self._pending[request_id] = (dispatch, now)
        while len(self._pending) > self.max_pending:
            self.load.finish(self._pending.popitem(last=False)[1][0])
        self._expire(now)

    def ended(self, request_id: str) -> None:
        """Envoy logged ``request_id``: its answer is over."""
        found = self._pending.pop(request_id, None)
        if found is not None:
            self.load.finish(found[0])
            return
        self._ended[request_id] = time.monotonic()  # its stream has not closed yet
        while len(self._ended) > self.max_pending:
            self._ended.popitem(last=False)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _expire(self, now: float) -> None:
        while self._pending:
            request_id, (dispatch, since) = next(iter(self._pending.items()))
            if now - since < self.max_age:
                break
            del self._pending[request_id]
            self.load.finish(dispatch)
        while self._ended and now - next(iter(self._ended.values())) > self.max_age:
            self._ended.popitem(last=False)


class AccessLog(als_grpc.AccessLogServiceServicer):
    """Envoy's HTTP access log: each entry ends its request's load (:class:`Endings`)."""

    def __init__(self, endings: Endings) -> None:
        self.endings = endings

    async def StreamAccessLogs(  # the gRPC method's name
        self, messages: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        self.endings.logs += 1
        try:
            async for message in messages:
                for entry in message.http_logs.log_entry:
                    if entry.request.request_id:
                        self.endings.ended(entry.request.request_id)
        finally:
            self.endings.logs -= 1
        return als_pb2.StreamAccessLogsResponse()


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router, settings: PickerSettings, endings: Endings | None = None) -> None:
        self.router = router
        self.settings = settings
        self.endings = endings or Endings(router.load)

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """The stream read and written with ``context.read`` / ``write``: grpc.aio's faster API
        (an async generator and iterator wrap every message in more tasks and awaits)."""
        exchange = _Exchange(self.router, self.settings, self.endings)
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                for response in await exchange.on(message):
                    await context.write(response)
        except _OutOfOrder as error:
            metrics.ERRORS.labels("protocol").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except asyncio.CancelledError:  # Envoy went away mid-request (the client, a reset)
            metrics.ERRORS.labels("cancelled").inc()
            raise
        except Exception:
            metrics.ERRORS.labels("internal").inc()
            log.exception("an ext_proc stream failed")
            await context.abort(grpc.StatusCode.INTERNAL, "the endpoint picker failed")
        finally:
            exchange.close()


class _OutOfOrder(Exception):
    """A message the protocol does not allow here (a body before the headers...)."""


class _Exchange:
    """One HTTP request's stream: what the picker has seen of it and what it decided."""

    def __init__(self, router: Router, settings: PickerSettings, endings: Endings) -> None:
        self.router = router
        self.settings = settings
        self.endings = endings
        self.headers: dict[str, str] | None = None
        self.subset: list[str] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.decided = False
        self.refused = False
        self.decision: Decision | None = None
        self.pods_by_address: dict[str, str] = {}
        self.dispatch: Dispatch | None = None
        self.answered = False  # the response's headers came: Envoy is carrying the answer
        self.buffered = False
        """Envoy buffers the body and sends it whole (``BUFFERED``: what failing open needs), waiting
        for the headers' answer first: the destination then goes with the body's answer."""

    async def on(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if self.refused:
            return []  # Envoy ends the request after an immediate response
        if kind == "request_headers":
            if self.headers is not None:
                raise _OutOfOrder("the request's headers came twice")
            self.headers = _header_map(message.request_headers.headers)
            self.subset = _subset(message.metadata_context)
            mode = (
                message.protocol_config.request_body_mode if message.HasField("protocol_config") else DUPLEX
            )
            if message.request_headers.end_of_stream or mode == NO_BODY:
                return await self._decide(body_follows=False)
            if mode != DUPLEX:  # Envoy waits for this answer before it sends the body
                self.buffered = True
                return [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]
            return []
        if kind == "request_body":
            if self.headers is None:
                raise _OutOfOrder("a body before the request's headers")
            if self.decided:
                raise _OutOfOrder("a body after its end")
            chunk = message.request_body
            self.size += len(chunk.body)
            if self.size > self.settings.max_body_bytes:
                return self._refuse(413, f"the body is over {self.settings.max_body_bytes} bytes", "refused")
            self.parts.append(chunk.body)
            if chunk.end_of_stream or self.buffered:
                return await self._decide(body_follows=True)
            return []
        if kind == "request_trailers":
            if self.headers is None:
                raise _OutOfOrder("trailers before the request's headers")
            trailers = ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
            if self.decided:
                return [trailers]
            return [*await self._decide(body_follows=True, ends=False), trailers]
        if kind == "response_headers":
            return [self._served(message)]
        if kind == "response_body":
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
        if kind == "response_trailers":
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    def close(self) -> None:
        if self.dispatch is not None:
            request_id = (self.headers or {}).get("x-request-id", "") if self.answered else ""
            self.endings.hand_over(request_id, self.dispatch)  # an answer under way ends with Envoy's log
            self.dispatch = None

    # --- the request ---------------------------------------------------------------------------

    async def _decide(self, *, body_follows: bool, ends: bool = True) -> list[ext_proc.ProcessingResponse]:
        started = time.perf_counter()
        self.decided = True
        body = b"".join(self.parts)
        self.parts = []
        headers = self.headers or {}
        path = headers.get(":path", "").split("?", 1)[0]
        kind = ROUTED_PATHS.get(path)
        prefill_at = ""
        try:
            if kind is not None and headers.get(":method") == "POST":
                try:
                    decision = await self.router.decide(kind, body, subset=self.subset)
                except RouteError as error:
                    outcome = "unavailable" if error.status == 503 else "refused"
                    return self._refuse(error.status, str(error), outcome, error.kind)
                ranked = decision.ranked
                if _sheddable(headers) and all(c.queued >= self.settings.shed_queue for c in ranked):
                    return self._refuse(429, "every pod has a queue: a sheddable request is shed", "shed")
                addresses = [endpoint_of(decision.pods[c.pod]) for c in ranked[: 1 + self.settings.fallbacks]]
                if decision.prefill:  # the decode pod's sidecar runs the prefill step there
                    prefiller = decision.prefill[0]
                    prefill_at = endpoint_of(decision.pods[prefiller.pod])
                    self.router.chosen(decision, prefiller)
                    metrics.PICKS.labels(prefiller.pod, "prefill").inc()
                primary = ranked[0]
                prefill = max(0, len(decision.keys) - primary.matched)
                self.decision = decision
                self.pods_by_address = {endpoint_of(address): pod for pod, address in decision.pods.items()}
            else:
                primary, prefill = None, 0
                addresses = await self._least_loaded()
                if not addresses:
                    return self._refuse(503, "no live pod", "unavailable", "unavailable")
        except Exception:
            log.exception("the picker failed on %s", path)
            metrics.DECISIONS.labels("error").inc()
            if self.settings.fail_open:
                return [_pass_through(self.buffered), *self._body(body, body_follows, ends)]
            return self._refuse(500, "the endpoint picker failed", "error", "internal_error", count=False)
        pod = primary.pod if primary is not None else self.pods_by_address.get(addresses[0], "")
        destination = _destination(",".join(addresses), self.buffered, prefill_at)
        if pod:
            # What an answer's first bytes mean Envoy does not tell: no time-to-first-token to learn.
            self.dispatch = self.router.load.start(pod, prefill_blocks=prefill, learn=False)
            metrics.PICKS.labels(pod, "primary").inc()
        metrics.DECISIONS.labels("routed").inc()
        responses = [destination, *self._body(body, body_follows, ends)]
        metrics.PICK_SECONDS.observe(time.perf_counter() - started)
        return responses

    def _body(self, body: bytes, body_follows: bool, ends: bool) -> list[ext_proc.ProcessingResponse]:
        """Envoy's body back when it streamed it to the picker (a buffered one stays in Envoy)."""
        return [] if self.buffered else _streamed(body, body_follows, ends)

    async def _least_loaded(self) -> list[str]:
        """A request the router does not key (another path): the least loaded live pods' addresses."""
        live = await self.router.live()
        self.pods_by_address = {endpoint_of(address): pod for pod, address in live.items()}
        load = self.router.load
        ranked = sorted(live, key=lambda pod: (load.of(pod), pod))
        return [endpoint_of(live[pod]) for pod in ranked[: 1 + self.settings.fallbacks]]

    def _refuse(
        self,
        status: int,
        message: str,
        outcome: str,
        kind: str = "invalid_request_error",
        *,
        count: bool = True,
    ) -> list[ext_proc.ProcessingResponse]:
        self.refused = True
        if count:
            metrics.DECISIONS.labels(outcome).inc()
        body = orjson.dumps({"error": {"message": message, "type": kind, "code": status}})
        headers = ext_proc.HeaderMutation(set_headers=[_header("content-type", b"application/json")])
        immediate = ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=headers,
            body=body,
            details=f"kvcache_epp_{outcome}",
        )
        return [ext_proc.ProcessingResponse(immediate_response=immediate)]

    # --- the response --------------------------------------------------------------------------

    def _served(self, message: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
        """The endpoint that served takes the request (its speculative entry, its load); the
        client sees the pod's name, not its address."""
        self.answered = True
        headers = _header_map(message.response_headers.headers)
        served = _metadata_string(message.metadata_context, LB_NAMESPACE, SERVED) or headers.get(SERVED, "")
        pod = self.pods_by_address.get(served.strip(), "")
        mutation = ext_proc.HeaderMutation(remove_headers=[SERVED])
        if pod:
            metrics.PICKS.labels(pod, "served").inc()
            mutation.set_headers.append(_header("x-kvcache-pod", pod.encode()))
            mutation.set_headers.append(_header("x-kvcache-policy", self.router.policy.name.encode()))
            self._took(pod, ok=_status(headers) < 500)
        if self.decision is not None and self.decision.prefill:
            mutation.set_headers.extend(self._disaggregated(headers.get("x-kvcache-pd", "")))
        return ext_proc.ProcessingResponse(
            response_headers=ext_proc.HeadersResponse(
                response=ext_proc.CommonResponse(header_mutation=mutation)
            )
        )

    def _disaggregated(self, step: str) -> list[base_pb2.HeaderValueOption]:
        """A P/D request's answer came, with what its decode pod's sidecar made of it (``step``:
        its ``x-kvcache-pd``): counted, and the prefill pod named to the client when it was used.
        No such header: no sidecar ran the prefill step (the decode pod served it whole)."""
        assert self.decision is not None
        counts = self.router.metrics
        if step == DISAGGREGATED:
            counts.pd_requests.labels(DISAGGREGATED).inc()
            return [_header("x-kvcache-prefill-pod", self.decision.prefill[0].pod.encode())]
        counts.pd_requests.labels(FALLBACK).inc()
        if step != FALLBACK:  # the sidecar counts its own failures
            counts.pd_fallbacks.labels("no_sidecar").inc()
            return [_header("x-kvcache-pd", FALLBACK.encode())]
        return []

    def _took(self, pod: str, *, ok: bool) -> None:
        decision, dispatch = self.decision, self.dispatch
        if dispatch is not None and dispatch.pod != pod:  # a fallback served it
            self.router.load.finish(dispatch)
            self.dispatch = dispatch = self.router.load.start(
                pod, prefill_blocks=dispatch.prefill_blocks, learn=False
            )
        if decision is None or not ok:
            return
        candidate = next((c for c in decision.ranked if c.pod == pod), None)
        if candidate is not None:  # a P/D request's decode pod: its prefill pod was counted
            self.router.chosen(decision, candidate, counted=not decision.prefill)


def _destination(endpoints: str, buffered: bool, prefill_at: str = "") -> ext_proc.ProcessingResponse:
    """The answer naming the endpoints, as a header and as ``envoy.lb`` metadata: the headers'
    answer, or the body's when Envoy buffered the body (its headers are still held then). A P/D
    request's prefill pod (``prefill_at``) goes in ``x-prefiller-host-port`` for the decode pod's
    sidecar (``gateway.sidecar``); any other request's client-sent one is removed."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: endpoints}})
    mutation = ext_proc.HeaderMutation(set_headers=[_header(DESTINATION, endpoints.encode())])
    if prefill_at:
        mutation.set_headers.append(_header(PREFILLER, prefill_at.encode()))
    else:
        mutation.remove_headers.append(PREFILLER)
    return _answer(
        ext_proc.CommonResponse(clear_route_cache=True, header_mutation=mutation), buffered, metadata
    )


def _pass_through(buffered: bool) -> ext_proc.ProcessingResponse:
    """The answer failing open: no destination (a client's own one removed)."""
    mutation = ext_proc.HeaderMutation(remove_headers=[DESTINATION, PREFILLER])
    return _answer(ext_proc.CommonResponse(clear_route_cache=True, header_mutation=mutation), buffered)


def _answer(
    common: ext_proc.CommonResponse, buffered: bool, metadata: struct_pb2.Struct | None = None
) -> ext_proc.ProcessingResponse:
    if buffered:
        return ext_proc.ProcessingResponse(
            request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata
        )
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def _streamed(body: bytes, body_follows: bool, ends: bool) -> list[ext_proc.ProcessingResponse]:
    """The body back to Envoy, unchanged, in chunks (``ends``: the last one ends the request;
    not when trailers follow)."""
    if not body_follows:
        return []
    chunks = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    return [
        ext_proc.ProcessingResponse(
            request_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(
                    body_mutation=ext_proc.BodyMutation(
                        streamed_response=ext_proc.StreamedBodyResponse(
                            body=chunk, end_of_stream=ends and i == len(chunks) - 1
                        )
                    )
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


def _header(name: str, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Names (lower case, as Envoy sends them) -> value; a repeated header's first value."""
    found: dict[str, str] = {}
    for header in headers.headers:
        value = header.raw_value.decode("latin-1") if header.raw_value else header.value
        found.setdefault(header.key.lower(), value)
    return found


def _subset(context: base_pb2.Metadata) -> list[str] | None:
    """The proxy's subset hint: the endpoints the request may go to (``None``: no hint)."""
    namespace = context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value.strip() for v in value.list_value.values if v.HasField("string_value")]
    if value.HasField("string_value"):
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []


def _metadata_string(context: base_pb2.Metadata, namespace: str, key: str) -> str:
    fields = context.filter_metadata.get(namespace)
    if fields is None or key not in fields.fields:
        return ""
    return fields.fields[key].string_value


def _sheddable(headers: dict[str, str]) -> bool:
    try:
        return int(headers.get(PRIORITY, "0")) < 0
    except ValueError:
        return False


def _status(headers: dict[str, str]) -> int:
    try:
        return int(headers.get(":status", "200"))
    except ValueError:
        return 200
