"""``epp.kubernetes``: the real lightkube client against ``FakeApiServer``, a small HTTP server that
speaks the Kubernetes API's list and watch protocol for pods (PodList with a ``resourceVersion``;
``watch=true&resourceVersion=N``: newline-delimited JSON events, chunked, from version N on) and
GET of an InferencePool. No kube-apiserver is installable here."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.resources.core_v1 import Pod

from epp.kubernetes import (
    Backoff,
    InferencePoolError,
    PoolConfigSource,
    PoolEndpoints,
    UnknownRole,
    overlay,
    parse_pod_selector,
    pod_role,
    pool_spec,
    read_inference_pool,
)
from registry.config import ModelSettings, ServiceConfig
from registry.snapshot import ConfigSource
from routing.disaggregation import Sides, sides

NAMESPACE = "serving"
TOKEN = "test-token"
SELECTOR = {"app.kubernetes.io/name": "vllm-qwen3"}
PORT = 8000
MODEL = "Qwen/Qwen3-0.6B"
FAST = Backoff(initial=0.01, maximum=0.05)


def pod(name: str, ip: str | None = "10.0.0.1", *, ready: bool = True, **extra: object) -> dict:
    """A Pod of the pool as the API server sends it; ``extra`` goes into ``metadata``."""
    status: dict = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip is not None:
        status["podIP"] = ip
    metadata = {"name": name, "namespace": NAMESPACE, "labels": dict(SELECTOR), **extra}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def deleting(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return obj


# --- the fake API server ---------------------------------------------------------------------------


@dataclass
class FakeApiServer:
    """Pods of ``NAMESPACE`` and InferencePools, changed by the test; every change is a watch event
    with the next ``resourceVersion``. Watches from a version below ``oldest`` are refused as
    expired (``ERROR`` 410, as the API server does once it has compacted those events)."""

    pods: dict[str, dict] = field(default_factory=dict)
    pools: dict[str, dict] = field(default_factory=dict)
    version: int = 100
    oldest: int = 0
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    failing_lists: int = 0
    """Lists to answer with a 500 before answering again."""
    _log: list[tuple[int, bytes, dict | None]] = field(default_factory=list)  # version, line, pod
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _generation: int = 0  # bumped by end_watches: the open streams end
    open_watches: int = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_get(f"/api/v1/namespaces/{NAMESPACE}/pods", self._pods)
        app.router.add_get(
            "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools/{name}", self._pool
        )
        return app

    async def put(self, obj: dict) -> None:
        kind = "MODIFIED" if obj["metadata"]["name"] in self.pods else "ADDED"
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version + 1)
        self.pods[obj["metadata"]["name"]] = obj
        await self._event(json.dumps({"type": kind, "object": obj}).encode(), obj)

    async def delete(self, name: str) -> None:
        obj = self.pods.pop(name)
        obj["metadata"]["resourceVersion"] = str(self.version + 1)
        await self._event(json.dumps({"type": "DELETED", "object": obj}).encode(), obj)

    async def send_raw(self, line: bytes) -> None:
        """A watch event line as it is, malformed or not, to every watch; it changes no pod."""
        await self._event(line, None)

    async def end_watches(self) -> None:
        async with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def watch_requests(self) -> list[dict[str, str]]:
        return [query for _, query in self.requests if query.get("watch") == "true"]

    def list_requests(self) -> list[dict[str, str]]:
        return [query for path, query in self.requests if path.endswith("/pods") and "watch" not in query]

    def _latest(self) -> int:
        return self._log[-1][0] if self._log else 0

    async def _event(self, line: bytes, obj: dict | None) -> None:
        async with self._changed:
            self.version += 1
            self._log.append((self.version, line, obj))
            self._changed.notify_all()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return status_response(401, "Unauthorized", "no or a wrong bearer token")
        return await handler(request)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        wanted = parse_pod_selector(request.query["labelSelector"])
        if request.query.get("watch") == "true":
            return await self._watch(request, int(request.query["resourceVersion"]), wanted)
        if self.failing_lists:
            self.failing_lists -= 1
            return status_response(500, "InternalError", "etcd is away")
        items = [obj for obj in self.pods.values() if selected(obj, wanted)]
        return json_response(
            {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, since: int, wanted: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.oldest:
            expired = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410}
            expired |= {"reason": "Expired", "message": f"too old resource version: {since}"}
            await response.write(json.dumps({"type": "ERROR", "object": expired}).encode() + b"\n")
            return response
        generation = self._generation
        self.open_watches += 1
        try:
            return await self._stream(response, since, wanted, generation)
        finally:
            self.open_watches -= 1

    async def _stream(
        self, response: web.StreamResponse, since: int, wanted: dict[str, str], generation: int
    ) -> web.StreamResponse:
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda since=since: self._latest() > since or generation != self._generation
                )
                if generation != self._generation:
                    return response
                due = [event for event in self._log if event[0] > since]
            for version, line, obj in due:
                if obj is None or selected(obj, wanted):
                    await response.write(line + b"\n")
                since = version

    async def _pool(self, request: web.Request) -> web.Response:
        found = self.pools.get(request.match_info["name"])
        if found is None or request.match_info["namespace"] != NAMESPACE:
            return status_response(404, "NotFound", f"inferencepools {request.match_info['name']} not found")
        return json_response(found)


def selected(obj: dict, wanted: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {})
    return all(labels.get(key) == value for key, value in wanted.items())


def json_response(obj: dict, *, status: int = 200) -> web.Response:
    """As the API server answers: ``Content-Type: application/json`` exactly (lightkube reads a
    ``Status`` from an error answer only then)."""
    return web.Response(
        body=json.dumps(obj).encode(), status=status, headers={"Content-Type": "application/json"}
    )


def status_response(code: int, reason: str, message: str) -> web.Response:
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
    return json_response(status | {"reason": reason, "message": message}, status=code)


@contextlib.asynccontextmanager
async def served(api: FakeApiServer) -> AsyncIterator[AsyncClient]:
    """A lightkube client of ``api``, served on a loopback port for the block's duration."""
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    config = KubeConfig.from_one(cluster=Cluster(server=f"http://{host}:{port}"), user=User(token=TOKEN))
    client = AsyncClient(config, trust_env=False)
    try:
        yield client
    finally:
        await client.close()
        await api.end_watches()
        await runner.cleanup()


@contextlib.asynccontextmanager
async def watching(api: FakeApiServer) -> AsyncIterator[PoolEndpoints]:
    """A started ``PoolEndpoints`` of the pool's selector on ``api``, synced."""
    async with served(api) as client:
        pool = PoolEndpoints(client, namespace=NAMESPACE, selector=SELECTOR, port=PORT, backoff=FAST)
        pool.start()
        try:
            await asyncio.wait_for(pool.synced.wait(), 5)
            await eventually(lambda: api.open_watches == 1, "the watch")
            yield pool
        finally:
            await pool.stop()


async def eventually(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


def run(scenario: Callable[[FakeApiServer], object]) -> FakeApiServer:
    """Run ``scenario(api)`` on a new event loop; the server, for what it recorded."""

    async def main() -> FakeApiServer:
        api = FakeApiServer()
        await scenario(api)
        return api

    return asyncio.run(main())


# --- list and watch ----------------------------------------------------------------------------------


def test_the_first_list_keeps_the_ready_pods_the_selector_names() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("ready", "10.0.0.1"))
        await api.put(pod("starting", "10.0.0.2", ready=False))
        await api.put(pod("unscheduled", None))
        await api.put(deleting(pod("terminating", "10.0.0.4")))
        await api.put(pod("ipv6", "fd00::7"))
        other = pod("other-app", "10.0.0.5")
        other["metadata"]["labels"] = {"app.kubernetes.io/name": "something-else"}
        await api.put(other)
        async with watching(api) as pool:
            assert dict(pool.endpoints) == {"ready": "10.0.0.1:8000", "ipv6": "[fd00::7]:8000"}
            assert pool.stats.lists == 1
            assert pool.stats.malformed == 0

    api = run(scenario)
    (first, *_) = api.list_requests()
    assert first["labelSelector"] == "app.kubernetes.io/name=vllm-qwen3"
    (watch, *_) = api.watch_requests()
    assert watch["labelSelector"] == "app.kubernetes.io/name=vllm-qwen3"
    assert watch["resourceVersion"] == "106"  # the list's: six pods put


def test_watch_events_add_the_pods_turning_ready_and_remove_the_rest() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("a", "10.0.0.1"))
        await api.put(pod("b", "10.0.0.2", ready=False))
        async with watching(api) as pool:
            assert dict(pool.endpoints) == {"a": "10.0.0.1:8000"}

            await api.put(pod("b", "10.0.0.2"))
            await eventually(lambda: "b" in pool.endpoints, "b ready")
            assert pool.endpoints["b"] == "10.0.0.2:8000"

            await api.put(pod("a", "10.0.0.1", ready=False))
            await eventually(lambda: "a" not in pool.endpoints, "a not ready")

            await api.put(pod("c", "10.0.0.3"))
            await eventually(lambda: "c" in pool.endpoints, "c ready")
            await api.put(deleting(api.pods["c"]))
            await eventually(lambda: "c" not in pool.endpoints, "c terminating")

            await api.delete("b")
            await eventually(lambda: "b" not in pool.endpoints, "b deleted")
            assert dict(pool.endpoints) == {}
            assert (pool.stats.lists, pool.stats.failures, pool.stats.malformed) == (1, 0, 0)
            assert pool.stats.events == 5

    run(scenario)


def test_a_watch_that_ends_resumes_from_the_last_version_without_a_list() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("a", "10.0.0.1"))
        async with watching(api) as pool:
            await api.put(pod("b", "10.0.0.2"))
            await eventually(lambda: "b" in pool.endpoints, "b ready")
            last_seen = api.version

            await api.end_watches()
            await eventually(lambda: len(api.watch_requests()) == 2, "the watch resumed")
            assert api.watch_requests()[1]["resourceVersion"] == str(last_seen)

            await api.put(pod("c", "10.0.0.3"))
            await eventually(lambda: "c" in pool.endpoints, "c ready")
            assert pool.stats.lists == 1
            assert pool.stats.failures == 0

    run(scenario)


def test_a_resume_refused_as_expired_lists_again_and_drops_the_pods_gone_meanwhile() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("a", "10.0.0.1"))
        await api.put(pod("b", "10.0.0.2"))
        async with watching(api) as pool:
            assert set(pool.endpoints) == {"a", "b"}
            # b goes while no watch runs, and its DELETED event is compacted away.
            del api.pods["b"]
            api.version += 5
            api.oldest = api.version
            await api.end_watches()
            await api.put(pod("c", "10.0.0.3"))

            await eventually(lambda: pool.stats.lists == 2, "a second list")
            await eventually(lambda: set(pool.endpoints) == {"a", "c"}, "the pods listed again")
            assert pool.stats.failures == 1
            # The new watch starts from the second list's version, not the expired one.
            await eventually(lambda: len(api.watch_requests()) == 3, "a third watch")
            assert [watch["resourceVersion"] for watch in api.watch_requests()] == ["102", "102", "108"]

    run(scenario)


def test_failed_lists_are_retried_until_one_answers() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("a", "10.0.0.1"))
        api.failing_lists = 3
        async with watching(api) as pool:
            assert dict(pool.endpoints) == {"a": "10.0.0.1:8000"}
            assert pool.stats.failures == 3
            assert pool.stats.lists == 1

    api = run(scenario)
    assert len(api.list_requests()) == 4


def test_a_malformed_event_is_skipped_and_counted() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("a", "10.0.0.1"))
        async with watching(api) as pool:
            # Decodes as a Pod, but names none; an event type the API does not have: skipped,
            # the stream goes on.
            await api.send_raw(b'{"type": "ADDED", "object": {"kind": "Pod", "metadata": {}}}')
            await api.send_raw(json.dumps({"type": "REPLACED", "object": pod("x", "10.0.0.8")}).encode())
            await api.put(pod("b", "10.0.0.2", ready=True))
            await eventually(lambda: "b" in pool.endpoints, "b ready")
            assert pool.stats.malformed == 2
            assert pool.stats.lists == 1

            # Not even a Pod: the stream cannot go on past it, so the pods are listed again.
            await api.send_raw(b'{"type": "MODIFIED", "object": {"metadata": "not an object"}}')
            await eventually(lambda: pool.stats.lists == 2, "a second list")
            await api.put(pod("c", "10.0.0.3"))
            await eventually(lambda: "c" in pool.endpoints, "c ready")
            assert pool.stats.malformed == 3
            assert dict(pool.endpoints) == {"a": "10.0.0.1:8000", "b": "10.0.0.2:8000", "c": "10.0.0.3:8000"}

    run(scenario)


def test_a_listed_pod_with_an_ip_that_is_none_is_skipped_and_counted() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("a", "10.0.0.1"))
        await api.put(pod("b", "not-an-ip"))
        async with watching(api) as pool:
            assert dict(pool.endpoints) == {"a": "10.0.0.1:8000"}
            assert pool.stats.malformed == 1

    run(scenario)


def test_stop_ends_the_task_and_the_watch() -> None:
    async def scenario(api: FakeApiServer) -> None:
        async with served(api) as client:
            pool = PoolEndpoints(client, namespace=NAMESPACE, selector=SELECTOR, port=PORT, backoff=FAST)
            task = pool.start()
            assert pool.start() is task
            await asyncio.wait_for(pool.synced.wait(), 5)
            await pool.stop()
            assert task.done()
            assert pool.synced.is_set()

    run(scenario)


def test_an_empty_selector_is_refused() -> None:
    with pytest.raises(InferencePoolError, match="every pod"):
        PoolEndpoints(None, namespace=NAMESPACE, selector={}, port=PORT)  # type: ignore[arg-type]


# --- the InferencePool and --pod-selector ------------------------------------------------------------------

INFERENCE_POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "qwen3", "namespace": NAMESPACE, "resourceVersion": "7"},
    "spec": {
        "selector": {"matchLabels": dict(SELECTOR)},
        "targetPorts": [{"number": 8000}, {"number": 8002}],
        "endpointPickerRef": {"name": "kvcache-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
    },
}


def test_read_inference_pool_gives_its_selector_and_first_target_port() -> None:
    async def scenario(api: FakeApiServer) -> None:
        api.pools["qwen3"] = INFERENCE_POOL
        async with served(api) as client:
            spec = await read_inference_pool(client, "qwen3", namespace=NAMESPACE)
            assert dict(spec.selector) == SELECTOR
            assert spec.target_port == 8000
            with pytest.raises(ApiError) as missing:
                await read_inference_pool(client, "llama", namespace=NAMESPACE)
            assert missing.value.status.code == 404

    api = run(scenario)
    path = f"/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools/qwen3"
    assert api.requests[0][0] == path


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        (None, "no spec"),
        ({"targetPorts": [{"number": 8000}]}, "matchLabels"),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}, "matchLabels"),
        ({"selector": {"matchLabels": {"app": 1}}, "targetPorts": [{"number": 8000}]}, "strings"),
        ({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}, "targetPorts"),
        ({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": "8000"}]}, "targetPorts"),
        ({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 70000}]}, "targetPorts"),
    ],
)
def test_an_inference_pool_not_of_the_v1_shape_is_refused(spec: object, complaint: str) -> None:
    with pytest.raises(InferencePoolError, match=complaint):
        pool_spec(spec)


def test_parse_pod_selector_reads_equalities() -> None:
    assert parse_pod_selector("app=vllm,tier=x") == {"app": "vllm", "tier": "x"}
    assert parse_pod_selector("app.kubernetes.io/name==vllm-qwen3") == SELECTOR
    for refused in ("app", "app!=vllm", "=vllm", "app=a=b", "app in (a,b)"):
        with pytest.raises(InferencePoolError, match="LABEL=VALUE"):
            parse_pod_selector(refused)


# --- the overlaid registry snapshot -----------------------------------------------------------------------

REGISTRY = ServiceConfig(
    seed="42",
    models={MODEL: ModelSettings(name=MODEL, block_size=32)},
    disabled_pods=frozenset({"10.0.0.2:8000"}),
    down_pods=frozenset({"10.0.0.3:8000"}),
    pods={"registry-pod": "other/model"},
    pod_addresses={"registry-pod": "192.168.1.1:8000"},
    registered_pods=frozenset({"registry-pod"}),
    pod_models=frozenset({"other/model"}),
)


def test_overlay_replaces_the_pods_and_keeps_the_rest() -> None:
    endpoints = {"10.0.0.1:8000": "10.0.0.1:8000", "10.0.0.2:8000": "10.0.0.2:8000"}
    config = overlay(REGISTRY, endpoints, MODEL)
    assert config.pods == dict.fromkeys(endpoints, MODEL)
    assert config.pod_addresses == endpoints
    assert config.registered_pods == frozenset(endpoints)
    assert config.pod_models == {MODEL}
    assert config.seed == "42"
    assert config.model(MODEL).block_size == 32
    assert config.unscored_pods == {"10.0.0.2:8000", "10.0.0.3:8000"}
    assert overlay(REGISTRY, {}, MODEL).pod_models == {MODEL}  # served, none ready: 503, not 404


def test_overlay_replaces_the_pod_roles_with_those_of_its_pods() -> None:
    registry = dataclasses.replace(REGISTRY, pod_roles={"registry-pod": "prefill"})
    endpoints = {"10.0.0.1:8000": "10.0.0.1:8000", "10.0.0.2:8000": "10.0.0.2:8000"}
    roles = {"10.0.0.1:8000": "prefill", "10.0.0.9:8000": "decode"}  # the second is no pod of it
    assert overlay(registry, endpoints, MODEL, roles=roles).pod_roles == {"10.0.0.1:8000": "prefill"}
    assert overlay(registry, endpoints, MODEL).pod_roles == {}


def test_the_pool_config_source_overlays_the_pool_on_the_registry_snapshot() -> None:
    registry = ConfigSource(lambda: REGISTRY)

    async def scenario(api: FakeApiServer) -> None:
        await api.put(pod("vllm-qwen3-0", "10.0.0.1"))
        async with watching(api) as pool:
            source = PoolConfigSource(registry, pool, MODEL)
            assert source.current() is None  # the registry has not loaded yet
            config = await source.aget()
            assert config.pod_addresses == {"10.0.0.1:8000": "10.0.0.1:8000"}
            assert config.pods == {"10.0.0.1:8000": MODEL}
            assert source.current() is config  # built again only when something changed

            await api.put(pod("vllm-qwen3-1", "10.0.0.9"))
            await eventually(lambda: len(pool.endpoints) == 2, "the second pod")
            assert set((await source.aget()).pods) == {"10.0.0.1:8000", "10.0.0.9:8000"}

            by_name = PoolConfigSource(registry, pool, MODEL, pod_ids="name")
            assert (await by_name.aget()).pod_addresses == {
                "vllm-qwen3-0": "10.0.0.1:8000",
                "vllm-qwen3-1": "10.0.0.9:8000",
            }

    run(scenario)


# --- the pods' prefill/decode roles ---------------------------------------------------------------------


def labelled(obj: dict, role: str) -> dict:
    """``obj`` with llm-d's P/D role label."""
    obj = copy.deepcopy(obj)
    obj["metadata"]["labels"]["llm-d.ai/role"] = role
    return obj


@pytest.mark.parametrize(
    ("value", "role"),
    [
        ("prefill", "prefill"),
        ("decode", "decode"),
        ("prefill-decode", None),
        ("both", None),  # llm-d's deprecated name of prefill-decode
        ("encode-prefill", "prefill"),
        ("encode-prefill-decode", None),
        (None, None),  # no label
    ],
)
def test_pod_role_reads_the_values_of_llm_d_role_label(value: str | None, role: str | None) -> None:
    obj = pod("p-0") if value is None else labelled(pod("p-0"), value)
    assert pod_role(Pod.from_dict(obj)) == role


@pytest.mark.parametrize("value", ["encode", "Prefill", "", "prefill,decode"])
def test_pod_role_refuses_a_value_llm_d_does_not_have(value: str) -> None:
    with pytest.raises(UnknownRole, match=r"pod p-0: llm-d\.ai/role="):
        pod_role(Pod.from_dict(labelled(pod("p-0"), value)))


def test_the_listed_pods_roles_come_from_their_label() -> None:
    async def scenario(api: FakeApiServer) -> None:
        await api.put(labelled(pod("p-0", "10.0.0.1"), "prefill"))
        await api.put(labelled(pod("d-0", "10.0.0.2"), "decode"))
        await api.put(labelled(pod("pd-0", "10.0.0.3"), "prefill-decode"))
        await api.put(labelled(pod("b-0", "10.0.0.4"), "both"))
        await api.put(pod("u-0", "10.0.0.5"))
        await api.put(labelled(pod("x-0", "10.0.0.6"), "encode"))
        await api.put(labelled(pod("s-0", "10.0.0.7", ready=False), "prefill"))
        async with watching(api) as pool:
            assert set(pool.endpoints) == {"p-0", "d-0", "pd-0", "b-0", "u-0", "x-0"}
            assert dict(pool.roles) == {"p-0": "prefill", "d-0": "decode"}  # the rest: whole requests
            assert pool.stats.unknown_roles == 1  # x-0, kept
            assert pool.stats.malformed == 0

    run(scenario)


def test_watch_events_change_the_roles_with_the_endpoints() -> None:
    async def scenario(api: FakeApiServer) -> None:
        async with watching(api) as pool:
            await api.put(labelled(pod("p-0", "10.0.0.1"), "prefill"))
            await api.put(labelled(pod("d-0", "10.0.0.2", ready=False), "decode"))
            await eventually(lambda: "p-0" in pool.roles, "p-0 added")
            assert dict(pool.roles) == {"p-0": "prefill"}  # d-0 is not ready
            await api.put(labelled(pod("d-0", "10.0.0.2"), "decode"))
            await eventually(lambda: "d-0" in pool.roles, "d-0 ready")
            assert dict(pool.roles) == {"p-0": "prefill", "d-0": "decode"}

            endpoints, events = pool.endpoints, pool.stats.events
            await api.put(labelled(pod("d-0", "10.0.0.2"), "decode"))  # nothing changes
            await eventually(lambda: pool.stats.events > events, "the event")
            assert pool.endpoints is endpoints

            await api.put(labelled(pod("d-0", "10.0.0.2"), "prefill"))  # relabelled, the same address
            await eventually(lambda: pool.roles.get("d-0") == "prefill", "d-0 a prefill pod")
            assert pool.endpoints == endpoints
            assert pool.endpoints is not endpoints  # a new object: PoolConfigSource builds again

            await api.put(pod("d-0", "10.0.0.2"))  # the label removed: whole requests
            await eventually(lambda: "d-0" not in pool.roles, "d-0 unlabelled")
            await api.put(labelled(pod("p-0", "10.0.0.1"), "encode"))  # no role llm-d has
            await eventually(lambda: "p-0" not in pool.roles, "p-0 relabelled")
            assert set(pool.endpoints) == {"p-0", "d-0"}
            assert pool.stats.unknown_roles == 1

            await api.put(labelled(pod("p-0", "10.0.0.1", ready=False), "prefill"))
            await eventually(lambda: "p-0" not in pool.endpoints, "p-0 not ready")
            await api.put(labelled(pod("q-0", "10.0.0.3"), "decode"))
            await eventually(lambda: "q-0" in pool.roles, "q-0 added")
            await api.delete("q-0")
            await eventually(lambda: "q-0" not in pool.endpoints, "q-0 deleted")
            assert dict(pool.roles) == {}
            assert pool.stats.malformed == 0

    run(scenario)


def test_the_snapshot_has_the_pool_pods_roles_under_its_pod_ids() -> None:
    """``pod_roles`` keyed as ``pods`` are: by address (the default) or by name. A pod relabelled
    from decode to prefill, its address the same, makes a new snapshot."""
    registry = ConfigSource(lambda: dataclasses.replace(REGISTRY, pod_roles={"registry-pod": "decode"}))

    async def scenario(api: FakeApiServer) -> None:
        await api.put(labelled(pod("vllm-qwen3-p", "10.0.0.1"), "prefill"))
        await api.put(labelled(pod("vllm-qwen3-d", "10.0.0.2"), "decode"))
        await api.put(pod("vllm-qwen3-b", "10.0.0.3"))
        async with watching(api) as pool:
            by_address = PoolConfigSource(registry, pool, MODEL)
            by_name = PoolConfigSource(registry, pool, MODEL, pod_ids="name")
            config = await by_address.aget()
            assert config.pod_roles == {"10.0.0.1:8000": "prefill", "10.0.0.2:8000": "decode"}
            assert (await by_name.aget()).pod_roles == {"vllm-qwen3-p": "prefill", "vllm-qwen3-d": "decode"}
            # As the routing core splits them: the unlabelled pod decodes (and serves whole requests).
            assert sides(config.pod_addresses, config.pod_roles) == Sides(
                prefill={"10.0.0.1:8000": "10.0.0.1:8000"},
                decode={"10.0.0.2:8000": "10.0.0.2:8000", "10.0.0.3:8000": "10.0.0.3:8000"},
            )

            await api.put(labelled(pod("vllm-qwen3-d", "10.0.0.2"), "prefill"))
            await eventually(lambda: pool.roles.get("vllm-qwen3-d") == "prefill", "the relabel")
            relabelled = await by_address.aget()
            assert relabelled is not config
            assert relabelled.pod_addresses == config.pod_addresses
            assert relabelled.pod_roles == {"10.0.0.1:8000": "prefill", "10.0.0.2:8000": "prefill"}
            assert by_address.current() is relabelled
            assert (await by_name.aget()).pod_roles == {"vllm-qwen3-p": "prefill", "vllm-qwen3-d": "prefill"}

    run(scenario)
