"""The InferencePool's endpoints from the Kubernetes API, for the Endpoint Picker (``manage.py epp``).

* ``read_inference_pool`` reads an InferencePool (``inference.networking.k8s.io/v1``): the pod
  labels its ``spec.selector.matchLabels`` requires and its first ``spec.targetPorts`` number.
  ``parse_pod_selector`` reads the same labels from ``--pod-selector 'app=vllm,tier=x'``.
* ``PoolEndpoints`` lists, then watches, the Pods of one namespace that match those labels, and
  keeps ``pod name -> "podIP:port"`` for the pods that can take a request: Ready (condition
  ``Ready=True``), with an IP, and not being deleted (no ``deletionTimestamp``). Any other pod,
  and a pod gone (``DELETED``), is out. Each list replaces the whole map, so a pod deleted while
  no watch ran leaves it too. Beside it, ``roles``: ``pod name -> "prefill" | "decode"`` for
  those pods, under prefill/decode disaggregation, from the label ``llm-d.ai/role`` read as
  llm-d's role filters read it (``ROLES``): ``prefill`` (or ``encode-prefill``), ``decode``;
  ``prefill-decode`` (or the older ``both``, or ``encode-prefill-decode``) and no label serve whole
  requests, so the pod is not in ``roles``. Any other value serves whole requests too, and is
  counted in ``PoolStats.unknown_roles`` and logged. The two maps change together: a pod
  relabelled, its address the same, makes a new ``endpoints`` object as an address change does.
* ``overlay`` and ``PoolConfigSource``: the registry snapshot the EPP routes with, its pods
  replaced by the pool's and ``pod_roles`` by their roles, both under the snapshot's pod ids (the
  pod's address, or its name: ``pod_ids``); model settings, hash seed, down and disabled pods kept.

Keeping the map (the invariant ``run`` holds): a successful list first, then one watch from the
list's ``resourceVersion``. When the API server ends a watch stream cleanly, lightkube resumes it
at the last ``resourceVersion`` seen, so no event is lost and no list is needed. Anything else
(the resume refused as expired, ``410 Gone``; an ``ERROR`` event; a broken connection; an event
that cannot be decoded) ends the watch, and the pods are listed again after a delay that doubles
with each failure in a row, up to ``Backoff.maximum`` seconds. A pod object that decodes but
makes no sense (no name, an IP that is none, an unknown event type) is counted in
``PoolStats.malformed`` and skipped; so is an event lightkube cannot decode, after which the pods
are listed again (the stream it came in cannot go on). Nothing received ends ``run``.

Talks to the API server with lightkube's ``AsyncClient`` (in a pod: its service account). No
Django import: this is part of the core (``pyproject.toml``, contract ``core``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import httpx2
import msgspec
from lightkube import AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from registry.config import ServiceConfig
from registry.snapshot import ConfigSource

log = logging.getLogger(__name__)

INFERENCE_POOL = create_namespaced_resource(
    group="inference.networking.k8s.io", version="v1", kind="InferencePool", plural="inferencepools"
)
"""The Gateway API Inference Extension's InferencePool, v1 (its CRD:
``deploy/overlays/inference-pool/crd/inference.networking.k8s.io_inferencepools.yaml``)."""

ROLE_LABEL = "llm-d.ai/role"
"""A pool pod's role under prefill/decode disaggregation (llm-d's label)."""
ROLES: Mapping[str, str | None] = MappingProxyType(
    {
        "prefill": "prefill",
        "decode": "decode",
        "prefill-decode": None,
        "both": None,
        "encode-prefill": "prefill",
        "encode-prefill-decode": None,
    }
)
"""The values of ``llm-d.ai/role`` llm-d's prefill and decode filters take (llm-d-router,
``pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go``), as ``ServiceConfig.pod_roles``
has them: ``prefill``, ``decode``, or None for a pod that serves whole requests, on the decode
side of a P/D model (``prefill-decode``; ``both`` is its deprecated name). This router has no
encode stage: a pod that also encodes is read for its prefill and decode part."""
LIST_CHUNK_SIZE = 500
"""Pods per list request: a large namespace is listed in pages rather than one huge answer."""


class InferencePoolError(ValueError):
    """An InferencePool, or a ``--pod-selector``, that names no pods the EPP can watch."""


class MalformedPod(ValueError):
    """A pod object or watch event that decoded but cannot be read (no name, an IP that is none)."""


class UnknownRole(ValueError):
    """A pod's ``llm-d.ai/role`` that is none of ``ROLES``: the pod is kept, serving whole requests."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Which pods are the pool's, and the port their engines serve on."""

    selector: Mapping[str, str]
    """label -> value: a pod of the namespace is the pool's when it has every one."""
    target_port: int


async def read_inference_pool(client: AsyncClient, name: str, *, namespace: str) -> PoolSpec:
    """The pool's selector and first target port (``spec.targetPorts[0].number``; GIE's further
    ports, several engines per pod, are not served yet). Raises ``lightkube.ApiError`` when the
    InferencePool cannot be read (missing, forbidden) and ``InferencePoolError`` when it is not
    the v1 shape."""
    pool = await client.get(INFERENCE_POOL, name, namespace=namespace)
    return pool_spec(pool.get("spec"), where=f"InferencePool {namespace}/{name}")


def pool_spec(spec: object, *, where: str = "InferencePool") -> PoolSpec:
    """A ``PoolSpec`` from an InferencePool's ``spec`` (a decoded JSON object)."""
    if not isinstance(spec, dict):
        raise InferencePoolError(f"{where}: no spec")
    selector = spec.get("selector")
    selector = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(selector, dict) or not selector:
        raise InferencePoolError(f"{where}: spec.selector.matchLabels must name at least one label")
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in selector.items()):
        raise InferencePoolError(f"{where}: spec.selector.matchLabels must map strings to strings")
    ports = spec.get("targetPorts")
    first = ports[0] if isinstance(ports, list) and ports else None
    number = first.get("number") if isinstance(first, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535:
        raise InferencePoolError(f"{where}: spec.targetPorts[0].number must be a port number")
    return PoolSpec(selector=MappingProxyType(dict(selector)), target_port=number)


def parse_pod_selector(text: str) -> dict[str, str]:
    """``'app=vllm,tier=x'`` -> ``{"app": "vllm", "tier": "x"}`` (``==`` reads as ``=``). Only
    equality: an InferencePool's selector is ``matchLabels`` too."""
    selector = {}
    for term in text.split(","):
        key, equals, value = term.replace("==", "=").partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not key or key.endswith("!") or "=" in value:
            raise InferencePoolError(f"--pod-selector: {term!r} is not LABEL=VALUE (like 'app=vllm,tier=x')")
        selector[key] = value
    return selector


def pod_endpoint(pod: Pod, port: int) -> str | None:
    """``"podIP:port"`` (``"[ip]:port"`` for IPv6) of a pod that can take a request, else None.
    Raises ``MalformedPod`` when ``status.podIP`` is set but is no IP address."""
    if pod.metadata is not None and pod.metadata.deletionTimestamp is not None:
        return None  # terminating: its endpoint is leaving every Service too
    status = pod.status
    if status is None or not status.podIP:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    try:
        ip = ipaddress.ip_address(status.podIP)
    except ValueError:
        raise MalformedPod(f"pod {pod_name(pod)}: status.podIP {status.podIP!r} is no IP address") from None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def pod_role(pod: Pod) -> str | None:
    """``prefill`` or ``decode`` from the pod's ``llm-d.ai/role`` label (``ROLES``); None for a
    pod that serves whole requests (``prefill-decode``, ``both``, no label). Raises
    ``UnknownRole`` for a value that is none of ``ROLES``."""
    labels = (pod.metadata.labels if pod.metadata is not None else None) or {}
    value = labels.get(ROLE_LABEL)
    if value is None:
        return None
    try:
        return ROLES[value]
    except KeyError:
        raise UnknownRole(
            f"pod {pod_name(pod)}: {ROLE_LABEL}={value!r} is none of {', '.join(ROLES)}; "
            "it serves whole requests"
        ) from None


def pod_name(pod: Pod) -> str:
    """``metadata.name``; raises ``MalformedPod`` when there is none."""
    if pod.metadata is None or not pod.metadata.name:
        raise MalformedPod("a pod without metadata.name")
    return pod.metadata.name


@dataclass(frozen=True, slots=True)
class Backoff:
    """Seconds to wait before listing again after ``failures`` failed lists or watches in a row:
    ``initial``, doubling, at most ``maximum``."""

    initial: float = 0.5
    maximum: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, failures - 1))


@dataclass(slots=True)
class PoolStats:
    """What ``PoolEndpoints`` has done, for metrics and tests (counters only grow)."""

    lists: int = 0
    """Successful lists: the first one, then one per re-list."""
    events: int = 0
    """Watch events applied."""
    malformed: int = 0
    """Pods and watch events that could not be read, and skipped."""
    failures: int = 0
    """Lists and watches that failed (an error from the API server or the connection, an
    undecodable answer); each is followed by a re-list."""
    unknown_roles: int = 0
    """Ready pods read (in a list or a watch event) with an ``llm-d.ai/role`` that is none of
    ``ROLES``: kept, serving whole requests."""


class PoolEndpoints:
    """``pod name -> "podIP:port"`` of the ready pods of ``namespace`` that carry every label of
    ``selector``, kept by a list, then a watch, on ``client`` (see the module docstring).

    ``endpoints`` is an immutable mapping, replaced as a whole on each change: a reader keeps a
    consistent one, and a new object means a change. ``synced`` is set after the first list and
    stays set (the map keeps its last pods while the API server cannot be reached).
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        namespace: str,
        selector: Mapping[str, str],
        port: int,
        backoff: Backoff | None = None,
    ) -> None:
        if not selector:
            raise InferencePoolError("an empty selector would take every pod of the namespace")
        self.client = client
        self.namespace = namespace
        self.selector = dict(selector)
        self.port = port
        self.backoff = backoff or Backoff()
        self.stats = PoolStats()
        self.synced = asyncio.Event()
        self._endpoints: Mapping[str, str] = MappingProxyType({})
        self._roles: Mapping[str, str] = MappingProxyType({})
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> Mapping[str, str]:
        return self._endpoints

    @property
    def roles(self) -> Mapping[str, str]:
        """pod name -> ``prefill`` or ``decode`` of the pods in ``endpoints`` that have one;
        replaced with ``endpoints`` (a new ``endpoints`` object whenever either changes)."""
        return self._roles

    def start(self) -> asyncio.Task[None]:
        """Run ``run`` in a task of the running loop (once)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"pool-endpoints-{self.namespace}")
        return self._task

    async def stop(self) -> None:
        """End the task ``start`` made and wait for it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        """List and watch until cancelled; never returns otherwise."""
        failures = 0
        while True:
            if failures:
                await asyncio.sleep(self.backoff.delay(failures))
            try:
                version = await self._list()
            except Exception as error:
                failures += 1
                self._failed("list", error)
                continue
            self.synced.set()
            try:
                async for kind, pod in self.client.watch(
                    Pod, namespace=self.namespace, labels=self.selector, resource_version=version
                ):
                    failures = 0  # the watch works: a later failure starts the delays again
                    self._apply(kind, pod)
            except Exception as error:
                self._failed("watch", error)
            failures += 1

    async def _list(self) -> str:
        listing = self.client.list(
            Pod, namespace=self.namespace, labels=self.selector, chunk_size=LIST_CHUNK_SIZE
        )
        endpoints, roles = {}, {}
        async for pod in listing:
            try:
                endpoint = pod_endpoint(pod, self.port)
                if endpoint is not None:
                    name = pod_name(pod)
                    endpoints[name] = endpoint
                    if (role := self._role(pod)) is not None:
                        roles[name] = role
            except MalformedPod as error:
                self._malformed(error)
        version = listing.resourceVersion  # raises NotReadyError when the answer had none
        self.stats.lists += 1
        self._replace(endpoints, roles)
        return version

    def _apply(self, kind: str, pod: Pod) -> None:
        if kind == "BOOKMARK":
            return
        try:
            if kind not in {"ADDED", "MODIFIED", "DELETED"}:
                raise MalformedPod(f"a watch event of type {kind!r}")
            name = pod_name(pod)
            endpoint = None if kind == "DELETED" else pod_endpoint(pod, self.port)
        except MalformedPod as error:
            self._malformed(error)
            return
        self.stats.events += 1
        role = self._role(pod) if endpoint is not None else None
        if self._endpoints.get(name) == endpoint and self._roles.get(name) == role:
            return
        endpoints, roles = dict(self._endpoints), dict(self._roles)
        endpoints.pop(name, None)
        roles.pop(name, None)
        if endpoint is not None:
            endpoints[name] = endpoint
            if role is not None:
                roles[name] = role
        self._replace(endpoints, roles)

    def _replace(self, endpoints: dict[str, str], roles: dict[str, str]) -> None:
        if endpoints == self._endpoints and roles == self._roles:
            return
        before = self._endpoints
        for name in sorted(before.keys() - endpoints.keys()):
            log.info("pool %s: pod %s left (was %s)", self.namespace, name, before[name])
        for name in sorted(endpoints.keys() - before.keys()):
            log.info("pool %s: pod %s ready at %s", self.namespace, name, endpoints[name])
        for name in sorted(endpoints.keys()):
            # A new pod's role, or one that changed ("both" goes without saying for a new pod).
            if (role := roles.get(name)) != self._roles.get(name):
                log.info("pool %s: pod %s, role %s", self.namespace, name, role or "both")
        self._roles = MappingProxyType(roles)
        self._endpoints = MappingProxyType(endpoints)  # a new object: the snapshot is built again

    def _role(self, pod: Pod) -> str | None:
        """``pod_role``; an unknown value counted and logged, the pod serving whole requests."""
        try:
            return pod_role(pod)
        except UnknownRole as error:
            self.stats.unknown_roles += 1
            log.warning("pool %s: %s", self.namespace, error)
            return None

    def _malformed(self, error: Exception) -> None:
        self.stats.malformed += 1
        log.warning("pool %s: skipped %s", self.namespace, error)

    def _failed(self, what: str, error: Exception) -> None:
        self.stats.failures += 1
        if isinstance(error, msgspec.DecodeError):
            # Not a pod at all: the stream it came in cannot go on past it.
            self.stats.malformed += 1
            log.warning("pool %s: undecodable %s answer, listing again: %s", self.namespace, what, error)
        elif isinstance(error, httpx2.HTTPError):
            log.warning("pool %s: %s failed, listing again: %s", self.namespace, what, error)
        else:
            log.exception("pool %s: %s failed, listing again", self.namespace, what)


def overlay(
    config: ServiceConfig,
    endpoints: Mapping[str, str],
    model: str,
    *,
    roles: Mapping[str, str] | None = None,
) -> ServiceConfig:
    """``config`` with its pods replaced by ``endpoints`` (pod -> address), each serving ``model``,
    all of them registered, and its ``pod_roles`` by ``roles`` (pod -> ``prefill`` or ``decode``,
    under the same pod ids; the role of a pod not in ``endpoints`` is dropped). Everything else is
    kept: model settings, the hash seed, disabled and down pods (they apply to the pool's pods of
    the same ids), endpoints of the registry's pods."""
    return dataclasses.replace(
        config,
        pods=dict.fromkeys(endpoints, model),
        pod_addresses=dict(endpoints),
        registered_pods=frozenset(endpoints),
        pod_models=frozenset({model}),  # the pool serves it, even while none of its pods is ready
        pod_roles={pod: role for pod, role in (roles or {}).items() if pod in endpoints},
    )


class PoolConfigSource:
    """The snapshot the EPP routes with: ``overlay`` of ``pool``'s endpoints on ``registry``'s
    latest snapshot, built again only when either has changed.

    ``pod_ids``: what the pool's pods are called in the snapshot, so in scores. The index knows a
    pod by the id its engine publishes KV events under (the topic's ``kv@<pod>@<model>``); the
    engines of ``deploy/examples/vllm-engine.yaml`` use their address (``$(POD_IP):8000``), hence
    ``"address"`` by default. ``"name"``: the Kubernetes pod name, for engines that publish under it.
    The pods' roles (``PoolEndpoints.roles``, by name) go into ``pod_roles`` under the same ids.
    """

    def __init__(
        self,
        registry: ConfigSource,
        pool: PoolEndpoints,
        model: str,
        *,
        pod_ids: Literal["address", "name"] = "address",
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.model = model
        self.pod_ids = pod_ids
        self._built: tuple[ServiceConfig, Mapping[str, str], ServiceConfig] | None = None

    async def aget(self) -> ServiceConfig:
        return self._overlaid(await self.registry.aget())

    def current(self) -> ServiceConfig | None:
        """The overlaid latest snapshot; ``None`` before the registry's first load."""
        config = self.registry.current()
        return None if config is None else self._overlaid(config)

    def _overlaid(self, config: ServiceConfig) -> ServiceConfig:
        endpoints = self.pool.endpoints
        built = self._built
        # A relabelled pod makes a new endpoints object too: its identity covers the roles.
        if built is not None and built[0] is config and built[1] is endpoints:
            return built[2]
        pods, roles = endpoints, self.pool.roles
        if self.pod_ids == "address":
            pods = {address: address for address in endpoints.values()}
            roles = {endpoints[name]: role for name, role in roles.items() if name in endpoints}
        result = overlay(config, pods, self.model, roles=roles)
        self._built = (config, endpoints, result)
        return result
