"""The gateway over real sockets: simulated vLLM pods publishing KV events into a real ingest
pipeline and index, the gateway under uvicorn in front of them, and a few hand-made upstreams
for what the simulator does not do on purpose (fail, stream slowly, notice a client leaving)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.app import GatewayApp, GatewayHandles, GatewaySettings
from ingest.events import BlockStored
from kvindex import open_index
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from registry.snapshot import ConfigSource
from scoring.read_path import ChatRequest, key_chat, key_prompt
from simulator.config import EngineConfig, LatencyConfig, PodConfig
from simulator.fleet import Fleet, FleetConfig, FleetThread, PublishConfig
from simulator.pod import PodTokenizer
from tests.ingest.conftest import Harness
from tests.servers import Served, wait_until
from tokenization.tokenizers import TokenizerRegistry

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"
BLOCK = 16
LONG = " ".join(f"word{i}" for i in range(400))  # ~100 blocks


class System:
    """Two simulated pods, ingest, an index, the registry snapshot, and gateways on demand."""

    def __init__(self, tokenizer: PodTokenizer, index_url: str = "memory://", pods: int = 2) -> None:
        self.index = open_index(index_url)
        self.harness = Harness(self.index, ServiceConfig(seed=SEED, default_block_size=BLOCK))
        pod = PodConfig(
            pod_id="sim-0",
            model=MODEL,
            engine=EngineConfig(block_size=BLOCK, kv_cache_size=2048, hash_seed=SEED),
            latency=LatencyConfig(
                prefill_overhead_ms=1, prefill_time_per_token_ms=0, inter_token_latency_ms=2
            ),
        )
        self.fleet = Fleet(
            FleetConfig(
                pod=pod, pods=pods, base_port=0, publish=PublishConfig(endpoint=self.harness.endpoint)
            ),
            tokenizer=tokenizer,
            graceful_timeout=0.5,
        )
        self._running = FleetThread(self.fleet)
        self.addresses = {p.pod_id: p.url.removeprefix("http://") for p in self.fleet.pods}
        self.extra: dict[str, str] = {}  # more pods: pod -> address
        self.roles: dict[str, str] = {}  # pod -> prefill or decode (ServiceConfig.pod_roles)
        self.gateways: list[Served] = []
        self.tokenizers = TokenizerRegistry()

    def config(self) -> ServiceConfig:
        addresses = {**self.addresses, **self.extra}
        return ServiceConfig(
            seed=SEED,
            default_block_size=BLOCK,
            pods={pod: MODEL for pod in addresses},
            pod_addresses=addresses,
            pod_roles=dict(self.roles),
        )

    def gateway(self, index: object = None, **settings) -> str:
        """A gateway in front of the pods (over ``index``, else the system's), telling matched
        blocks (``x-kvcache-matched-blocks``, off by default:
        tests/security/test_gateway_matched_blocks.py) unless told otherwise."""
        settings.setdefault("matched_blocks_header", True)
        app = GatewayApp(
            GatewayHandles(
                config=ConfigSource(self.config, max_age=0.0),
                index=lambda: index or self.index,
                tokenizers=lambda _config: self.tokenizers,
                sandbox=lambda: None,
            ),
            GatewaySettings(seed=7, **settings),
        )
        served = Served(app)
        self.gateways.append(served)
        return served.url

    def applied(self) -> None:
        """Wait until ingest has applied everything the pods published."""
        for p in self.fleet.pods:
            last = p.publishers[0].next_seq - 1
            if last >= 0:
                wait_until(
                    lambda pod=p.pod_id, last=last: (
                        self.index.progress(model=MODEL).get((MODEL, pod)) == last
                    ),
                    what=f"{p.pod_id}'s events",
                )

    def close(self) -> None:
        for served in self.gateways:
            served.stop()
        self._running.close()
        self.harness.close()
        self.index.close()


@pytest.fixture(scope="module")
def tokenizer() -> PodTokenizer:
    return PodTokenizer(TokenizerRegistry(), MODEL)


@pytest.fixture
def system(tokenizer) -> Iterator[System]:
    yield from _system(System(tokenizer))


@pytest.fixture
def redis_system(tokenizer, redis_url: str) -> Iterator[System]:
    """The same over a Redis index: the gateway reads it (and writes its speculative entries) on
    its event loop, through the index's pipelined connection."""
    yield from _system(System(tokenizer, redis_url))


def _system(s: System) -> Iterator[System]:
    # ZeroMQ drops what a PUB sends before the subscription is through: poke until heard.
    with httpx.Client(timeout=30) as client:
        for pod, address in s.addresses.items():

            def heard(address=address, pod=pod) -> bool:
                client.post(f"http://{address}/v1/completions", json={"model": MODEL, "prompt": "hi " * 40})
                return any(st.pod == pod for st in s.harness.stats.streams())

            wait_until(heard, what=f"{pod}'s events")
            client.post(f"http://{address}/reset_prefix_cache")
    s.applied()
    yield s
    s.close()


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}, timeout=30
    )


def test_a_prompt_goes_back_to_the_pod_that_holds_its_prefix(system: System) -> None:
    url = system.gateway(speculative_seconds=0.0)  # the index alone decides
    first = complete(url, LONG)
    assert first.status_code == 200
    pod = first.headers["x-kvcache-pod"]
    assert first.headers["x-kvcache-matched-blocks"] == "0"
    system.applied()
    for _ in range(3):
        again = complete(url, LONG + " and then something else")
        assert again.headers["x-kvcache-pod"] == pod
        assert int(again.headers["x-kvcache-matched-blocks"]) >= 20
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_over_a_redis_index_prefixes_and_shared_entries_are_read_on_the_loop(redis_system: System) -> None:
    system = redis_system
    assert system.index.reads_async
    url = system.gateway(speculative_seconds=0.0)  # the index alone decides
    pod = complete(url, LONG).headers["x-kvcache-pod"]
    system.applied()
    again = complete(url, LONG + " and then something else")
    assert again.headers["x-kvcache-pod"] == pod
    assert int(again.headers["x-kvcache-matched-blocks"]) >= 20
    system.harness.pipeline.receiver.stop()  # no KV events reach the index from now on
    first, second = system.gateway(speculative_seconds=30), system.gateway(speculative_seconds=30)
    new = LONG.replace("word", "term")
    pod = complete(first, new).headers["x-kvcache-pod"]
    keys = key_prompt(tokenizers=system.tokenizers, config=system.config(), model=MODEL, prompt=new).keys
    wait_until(lambda: system.index.speculated(model=MODEL, keys=keys), what="the shared entry")
    shared = complete(second, new + " and more")
    assert shared.headers["x-kvcache-pod"] == pod
    assert int(shared.headers["x-kvcache-matched-blocks"]) >= len(keys) - 8


class _FailingOnTheLoop:
    """The system's index, but its reads on the event loop fail as no backend says they may."""

    reads_async = True

    def __init__(self, index) -> None:
        self._index = index

    def __getattr__(self, name: str):
        return getattr(self._index, name)

    async def alookup(self, **_):
        raise RuntimeError("a bug in a backend")

    async def aspeculated(self, **_):
        raise RuntimeError("a bug in a backend")


def test_an_index_failing_on_the_loop_costs_the_request_only_its_prefix(system: System) -> None:
    url = system.gateway(index=_FailingOnTheLoop(system.index))
    answer = complete(url, LONG)
    assert answer.status_code == 200
    assert answer.headers["x-kvcache-matched-blocks"] == "0"
    assert 'kvcache_gateway_score_failures_total{reason="RuntimeError"}' in httpx.get(f"{url}/metrics").text


def test_chat_is_templated_as_the_pod_does_and_routed_by_its_prefix(system: System) -> None:
    url = system.gateway(speculative_seconds=0.0)
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "hello"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert first.status_code == 200
    system.applied()
    second = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert second.headers["x-kvcache-pod"] == first.headers["x-kvcache-pod"]
    # every full block the gateway counted is one the pod then reported cached
    matched = int(second.headers["x-kvcache-matched-blocks"])
    assert matched > 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (matched - 1) * BLOCK


def salted_store(ids: list[int], salt: str) -> BlockStored:
    """The full blocks of ``ids`` as a vLLM engine stores them for a request with ``cache_salt``."""
    n = len(ids) // BLOCK
    return BlockStored(
        block_hashes=tuple(block_keys(ids, seed=SEED, cache_salt=salt)),
        parent_block_hash=None,
        token_ids=tuple(ids[: n * BLOCK]),
        block_size=BLOCK,
        extra_keys=((salt,), *[None] * (n - 1)),
    )


def test_a_salted_request_goes_to_the_pod_holding_its_salted_prefix(system: System) -> None:
    """vLLM keys a request's ``cache_salt`` into its first block: the gateway keys it the same way,
    so a salted request is routed to the pod whose events stored its salted blocks, and neither
    the plain prompt nor another salt finds them."""
    url = system.gateway(speculative_seconds=0.0)  # the index alone decides
    plain_pod = complete(url, LONG).headers["x-kvcache-pod"]
    system.applied()
    # The simulator ignores salts: "salty" is a stub pod whose KV events (published through ingest)
    # store the salted blocks of a prompt and of a conversation as a vLLM engine sends them.
    upstream = Served(lambda s, r, w: _upstream(s, r, w, chunks=[b'{"stub": true}']), lifespan="off")
    system.gateways.append(upstream)
    system.extra["salty"] = upstream.address
    messages = [{"role": "user", "content": LONG}]
    common = {"tokenizers": system.tokenizers, "config": system.config(), "model": MODEL}
    prompt_ids = key_prompt(prompt=LONG, **common).tokenization.token_ids
    chat = ChatRequest(messages=messages, add_generation_prompt=True)  # vLLM's default, as sent below
    chat_ids = key_chat(chat=chat, **common).tokenization.token_ids
    system.harness.publisher("salty").send(
        [salted_store(prompt_ids, "tenant-a"), salted_store(chat_ids, "tenant-a")], layout="map"
    )
    system.harness.sync("salty")

    salted = complete(url, LONG, cache_salt="tenant-a")
    assert salted.headers["x-kvcache-pod"] == "salty"
    assert salted.headers["x-kvcache-matched-blocks"] == str(len(prompt_ids) // BLOCK)
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "cache_salt": "tenant-a"}
    salted_chat = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert salted_chat.headers["x-kvcache-pod"] == "salty"
    assert salted_chat.headers["x-kvcache-matched-blocks"] == str(len(chat_ids) // BLOCK)

    plain = complete(url, LONG)
    assert plain.headers["x-kvcache-pod"] == plain_pod
    assert int(plain.headers["x-kvcache-matched-blocks"]) >= 20
    assert complete(url, LONG, cache_salt="tenant-b").headers["x-kvcache-matched-blocks"] == "0"
    unsalted_chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "cache_salt": None}, timeout=30)
    assert unsalted_chat.headers["x-kvcache-matched-blocks"] == "0"


def test_speculative_entries_keep_a_burst_together_then_expire(system: System) -> None:
    system.harness.pipeline.receiver.stop()  # no KV events reach the index from now on
    url = system.gateway(speculative_seconds=0.5)
    pods = {complete(url, LONG).headers["x-kvcache-pod"] for _ in range(4)}
    assert len(pods) == 1
    assert int(complete(url, LONG).headers["x-kvcache-matched-blocks"]) > 0
    time.sleep(0.6)
    assert complete(url, LONG).headers["x-kvcache-matched-blocks"] == "0"


def test_replicas_share_their_speculative_entries_through_the_index(system: System) -> None:
    system.harness.pipeline.receiver.stop()  # no KV events reach the index from now on
    first, second = system.gateway(speculative_seconds=30), system.gateway(speculative_seconds=30)
    pod = complete(first, LONG).headers["x-kvcache-pod"]
    keys = key_prompt(
        tokenizers=system.tokenizers, config=system.config(), model=MODEL, prompt=LONG, lora_name=None
    ).keys
    wait_until(lambda: system.index.speculated(model=MODEL, keys=keys), what="the shared entry")
    for _ in range(3):  # the other replica has routed nothing yet, and the index has no blocks
        again = complete(second, LONG + " and more")
        assert again.headers["x-kvcache-pod"] == pod
        assert int(again.headers["x-kvcache-matched-blocks"]) >= len(keys) - 8


def test_load_breaks_ties_and_spreads_a_burst_without_prefixes(system: System) -> None:
    url = system.gateway(policy="least-loaded")

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 40}
            responses = await asyncio.gather(
                *(client.post(f"{url}/v1/completions", json=body) for _ in range(6))
            )
        return [r.headers["x-kvcache-pod"] for r in responses]

    pods = asyncio.run(burst())
    assert sorted(pods.count(p) for p in set(pods)) == [3, 3]


def test_a_dead_pod_is_skipped_for_the_next(system: System) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    system.extra["a-dead-pod"] = f"127.0.0.1:{dead.getsockname()[1]}"  # nothing listens
    dead.close()
    url = system.gateway(policy="round-robin")  # ranks pods by name: the dead one comes first
    before = connect_retries(url)
    response = complete(url, "hello")
    assert response.status_code == 200
    assert response.headers["x-kvcache-pod"] in system.addresses
    assert connect_retries(url) == before + 1


def connect_retries(url: str) -> float:
    """The gateway's count of connect-error retries (metrics are per process: read a difference)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('kvcache_gateway_retries_total{policy="round-robin",reason="connect"}'):
            return float(line.rpartition(" ")[2])
    return 0.0


async def _upstream(
    scope, receive, send, *, chunks: list[bytes], status: int = 200, delay: float = 0.0, left=None
):
    """A pod that answers ``chunks``, ``delay`` apart; ``left`` is set when its client leaves."""
    while (await receive()).get("more_body"):
        pass
    watch = asyncio.ensure_future(receive())
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(delay)
        if watch.done() and watch.result()["type"] == "http.disconnect":
            if left is not None:
                left.set()
            return
    await send({"type": "http.response.body", "body": b""})
    watch.cancel()


def test_streams_pass_through_byte_for_byte_as_they_come(system: System) -> None:
    chunks = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]
    upstream = Served(lambda s, r, w: _upstream(s, r, w, chunks=chunks, delay=0.3), lifespan="off")
    system.gateways.append(upstream)
    system.addresses.clear()
    system.extra["stub"] = upstream.address
    url = system.gateway(policy="random")
    arrived = []
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    ) as r:
        assert r.headers["x-kvcache-pod"] == "stub"
        for chunk in r.iter_raw():
            arrived.append((time.monotonic() - started, chunk))
    assert b"".join(c for _, c in arrived) == b"".join(chunks)
    assert arrived[0][0] < 0.25  # the first chunk came before the upstream sent the second


def test_a_client_that_leaves_closes_the_pods_request(system: System) -> None:
    left = threading.Event()

    async def slow(scope, receive, send):
        await _upstream(scope, receive, send, chunks=[b"data: x\n\n"] * 100, delay=0.1, left=_Flag(left))

    upstream = Served(slow, lifespan="off")
    system.gateways.append(upstream)
    system.addresses.clear()
    system.extra["stub"] = upstream.address
    url = system.gateway(policy="random")
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    ) as r:
        next(r.iter_raw())
    assert left.wait(5), "the upstream never saw the client leave"


class _Flag:
    """An asyncio-side handle to a threading.Event."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def set(self) -> None:
        self.event.set()


def test_a_5xx_before_the_first_byte_goes_to_the_next_pod(system: System) -> None:
    failing = Served(lambda s, r, w: _upstream(s, r, w, chunks=[b"overloaded"], status=503), lifespan="off")
    system.gateways.append(failing)
    system.extra["a-failing"] = failing.address
    url = system.gateway(policy="round-robin")
    response = complete(url, "hello")
    assert response.status_code == 200
    assert response.headers["x-kvcache-pod"] in system.addresses


def test_models_errors_and_unknown_models(system: System) -> None:
    url = system.gateway()
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    unknown = complete(url, "hi", model="no/such-model")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=10)
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, 400)
    assert httpx.get(f"{url}/v1/completions").status_code == 405


@pytest.mark.django_db
def test_the_gateway_process_answers_metrics_and_models_from_the_registry() -> None:
    from gateway.asgi import application  # the Django shell: runtime handles, settings
    from registry.models import Pod
    from registry.runtime import invalidate_service_config
    from tests.asgi import AsgiClient

    Pod.objects.create(pod_id="p", model=MODEL, address="127.0.0.1:9")
    invalidate_service_config()
    client = AsgiClient(application)
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert b"kvcache_gateway_requests_total" in metrics.content
    assert b"kvcache_pod_blocks" not in metrics.content  # the web's collectors stay the web's
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
