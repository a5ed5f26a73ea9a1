"""The core of an index kept in one process (``--index in-process``) on real parts: engines as the
simulator's publishers (a bound PUB and a replay ROUTER, as vLLM's with a bind endpoint), a
pipeline over a memory index holding every pod with an event endpoint (a replica alone,
``SoloMembership``) and the ``RegistryFollower`` that does to it what the registry's writes do
to a shared index. The registry is a ``ServiceConfig`` the tests change."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from ingest.follower import RegistryChanges, RegistryFollower, registry_changes
from ingest.membership import Replica, SoloMembership
from ingest.pipeline import IngestPipeline
from ingest.replay import ReplayClient
from kvindex import open_index
from kvindex.keys import block_keys
from registry.config import ModelSettings, ServiceConfig
from tests.ingest.conftest import MODEL
from tests.ingest.test_replay import BLOCK, SEED, Engine, block
from tests.servers import wait_until

FAST = {"heartbeat_seconds": 0.2, "ttl_seconds": 1.0, "handover_seconds": 0.4}


class Registry:
    """The pods' engines and what the registry says of them (tests edit ``disabled``, ``seed``,
    ``block_sizes`` and ``engines``)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.engines: dict[str, Engine] = {}
        self.disabled: set[str] = set()
        self.seed = SEED
        self.block_sizes: dict[str, int] = {}

    def add(self, pod: str) -> Engine:
        engine = self.engines[pod] = Engine(self.context, "tcp://127.0.0.1:*", pod)
        return engine

    def config(self) -> ServiceConfig:
        return ServiceConfig(
            seed=self.seed,
            default_block_size=BLOCK,
            models={m: ModelSettings(name=m, block_size=size) for m, size in self.block_sizes.items()},
            pods=dict.fromkeys(self.engines, MODEL),
            pod_models=frozenset([MODEL]) if self.engines else frozenset(),
            disabled_pods=frozenset(self.disabled),
            replay_endpoints={pod: e.replay_endpoint for pod, e in self.engines.items()},
            event_endpoints={pod: e.publisher.bound_endpoint for pod, e in self.engines.items()},
        )

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.context.destroy(linger=0)


class InProcess:
    """What ``ingest.service`` wires for ``--index in-process``, without Django: a memory index,
    a pipeline holding every pod with an event endpoint (a replica alone), the follower."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.index = open_index("memory://")
        self.pipeline = IngestPipeline(
            index=self.index,
            config=registry.config,
            workers=2,
            context=registry.context,
            replay=ReplayClient(config=registry.config, context=registry.context, timeout=1.0),
            replica=True,
        )
        self.replica = Replica(
            name="in-process",
            store=SoloMembership(),
            config=registry.config,
            on_change=lambda h: self.pipeline.hold(h.held, foreign=h.foreign),
            **FAST,
        )
        self.follower = RegistryFollower(
            index=self.index, config=registry.config, forget_pod=self.pipeline.forget_pod
        )
        self.replica.join()
        self.pipeline.start()
        self.replica.start()

    def held(self, pod: str, *, seed: str = SEED, block_size: int = BLOCK) -> int:
        """How many leading blocks of the pod's chain the index says it holds."""
        chain = self.registry.engines[pod].chain if pod in self.registry.engines else []
        tokens = [t for i in range(len(chain) + 4) for t in block(i, None)[0].token_ids]
        keys = block_keys(tokens, seed=seed, block_size=block_size)
        return len(self.index.lookup(model=MODEL, keys=keys, pods=[pod]))

    def holds_chains(self, pods: list[str]) -> bool:
        return all(self.held(pod) == len(self.registry.engines[pod].chain) for pod in pods)

    def close(self) -> None:
        self.replica.stop(leave=True)
        self.pipeline.stop(drain_timeout=5)
        self.index.close()


@pytest.fixture
def registry() -> Iterator[Registry]:
    r = Registry()
    yield r
    r.close()


def test_a_replica_alone_holds_every_pod_catches_up_what_it_missed_and_follows_the_registry(registry):
    for pod in ("pod-a", "pod-b"):
        engine = registry.add(pod)
        for _ in range(3):
            engine.store()  # before anyone subscribed: only a replay brings these
    ingest = InProcess(registry)
    try:
        assert set(ingest.replica.holding.held) == {"pod-a", "pod-b"}
        assert ingest.replica.holding.foreign == frozenset()
        wait_until(lambda: ingest.holds_chains(["pod-a", "pod-b"]), what="the missed batches replayed")

        registry.engines["pod-a"].store(lost=True)  # a batch lost on the way, then one that arrives
        registry.engines["pod-a"].store()
        wait_until(lambda: ingest.holds_chains(["pod-a"]), what="pod-a's gap replayed")

        # A pod registered later is connected to and caught up; one gone from the registry is
        # let go (disconnected) and, once the follower ran, forgotten with its blocks.
        late = registry.add("pod-c")
        late.store()
        late.store()
        wait_until(lambda: "pod-c" in ingest.replica.holding.held, what="pod-c held")
        wait_until(lambda: ingest.holds_chains(["pod-c"]), what="pod-c caught up")
        assert not ingest.follower.run_once()  # its baseline: pod-a, pod-b and pod-c
        gone = registry.engines.pop("pod-b")
        try:
            wait_until(lambda: "pod-b" not in ingest.replica.holding.held, what="pod-b let go")
            wait_until(
                lambda: gone.publisher.bound_endpoint not in ingest.pipeline.receiver.connected,
                what="pod-b disconnected",
            )
            assert ingest.follower.run_once().gone_pods == {"pod-b"}
            assert ingest.index.lookup(model=MODEL, keys=_chain_keys(3), pods=["pod-b"]) == []
            assert "pod-b" not in {s.pod for s in ingest.pipeline.stats.streams()}
        finally:
            gone.close()
        assert ingest.holds_chains(["pod-a", "pod-c"])
    finally:
        ingest.close()


def _chain_keys(n: int) -> list[int]:
    tokens = [t for i in range(n) for t in block(i, None)[0].token_ids]
    return block_keys(tokens, seed=SEED, block_size=BLOCK)


def test_the_follower_clears_what_registry_writes_elsewhere_made_wrong(registry):
    for pod in ("pod-a", "pod-b"):
        engine = registry.add(pod)
        for _ in range(3):
            engine.store()
    ingest = InProcess(registry)
    try:
        wait_until(lambda: ingest.holds_chains(["pod-a", "pod-b"]), what="both chains")
        assert not ingest.follower.run_once()  # the baseline
        assert not ingest.follower.run_once()  # nothing changed since

        registry.disabled.add("pod-a")
        assert ingest.follower.run_once() == RegistryChanges(disabled_pods=frozenset({"pod-a"}))
        assert (ingest.held("pod-a"), ingest.held("pod-b")) == (0, 3)

        # A new block size changes every key of the model: it is emptied, then indexed again
        # from the engines' next chains.
        registry.block_sizes[MODEL] = BLOCK * 2
        assert ingest.follower.run_once().resized_models == {MODEL}
        assert ingest.index.pod_blocks(model=MODEL) == []
        registry.block_sizes.clear()
        ingest.follower.run_once()
        registry.engines["pod-b"].clear()
        registry.engines["pod-b"].store()
        wait_until(lambda: ingest.held("pod-b") == 1, what="pod-b's next chain")

        registry.seed = "7"
        assert ingest.follower.run_once().seed_changed
        assert ingest.index.pod_blocks() == []
    finally:
        ingest.close()


def test_registry_changes_are_what_the_registry_services_clear_a_shared_index_for():
    before = ServiceConfig(
        seed="1",
        pods={"a": "m", "b": "m", "c": "m"},
        pod_models=frozenset(["m"]),
        disabled_pods=frozenset(["c"]),
        models={"m": ModelSettings(name="m", block_size=16), "n": ModelSettings(name="n", block_size=32)},
    )
    after = ServiceConfig(
        seed="1",
        pods={"a": "m", "c": "m", "d": "m"},
        pod_models=frozenset(["m"]),
        disabled_pods=frozenset(["a", "c", "x"]),  # c was disabled already; x is not a pod
        models={"m": ModelSettings(name="m", block_size=16)},  # n's config deleted: back to 16
    )
    assert registry_changes(before, after) == RegistryChanges(
        gone_pods=frozenset({"b"}), disabled_pods=frozenset({"a"}), resized_models=frozenset({"n"})
    )
    assert registry_changes(before, before) == RegistryChanges()
    assert not RegistryChanges()
    assert registry_changes(before, ServiceConfig(seed="2", **_without_seed(before))).seed_changed


def _without_seed(config: ServiceConfig) -> dict:
    return {
        "pods": config.pods,
        "pod_models": config.pod_models,
        "disabled_pods": config.disabled_pods,
        "models": config.models,
    }
