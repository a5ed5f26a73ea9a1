"""A master of the cluster index killed under load: ingest applying events from several engines
and readers looking blocks up. The replica takes over; nothing crashes, errors stop within a
bounded window, and once ingest has caught up the index holds exactly what the engines sent."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ingest.applier import EventApplier
from ingest.events import BlockRemoved, BlockStored, EventBatch
from ingest.stats import IngestStats
from kvindex import IndexUnavailable, MemoryIndex, open_index
from kvindex.keys import block_keys
from registry.config import ServiceConfig
from tests.ingest.conftest import MODEL, Harness
from tests.kvindex import assert_cluster_consistent
from tests.servers import ValkeyCluster, wait_until

PODS = 4
CHAIN = 8  # blocks per stored chain
LOAD_SECONDS = 7.0
KILL_AFTER = 2.0
MAX_ERROR_WINDOW = 10.0
log = logging.getLogger(__name__)


def tokens(pod: int, step: int) -> list[int]:
    return [pod * 1_000_000 + step * 1_000 + j for j in range(16 * CHAIN)]


class Load:
    """Engines publishing through ingest, the same batches applied to an in-memory oracle, and a
    reader timing every lookup."""

    def __init__(self, harness: Harness, config: ServiceConfig) -> None:
        self.harness = harness
        self.publishers = [harness.publisher(f"pod-{i}") for i in range(PODS)]
        self.oracle = MemoryIndex(pod_cache_size=100)
        self.applier = EventApplier(self.oracle, config=lambda: config, stats=IngestStats())
        self.chains: dict[tuple[int, int], list[int]] = {}  # (pod, step) -> block keys
        self.lookups: list[tuple[float, bool]] = []  # (monotonic time, answered)
        self.stop = threading.Event()

    def publish(self) -> None:
        step = 0
        while not self.stop.is_set():
            for i, pub in enumerate(self.publishers):
                ids = tokens(i, step)
                chain = block_keys(ids, seed="42", block_size=16)
                self.chains[i, step] = chain
                events: list = [
                    BlockStored(
                        block_hashes=tuple(chain),
                        parent_block_hash=None,
                        token_ids=tuple(ids),
                        block_size=16,
                        lora_id=None,
                        tier="gpu",
                        lora_name=None,
                        extra_keys=None,
                        group_idx=None,
                    )
                ]
                if step >= 5 and step % 3 == 0:  # an engine evicting the tail of an older chain
                    events.append(BlockRemoved(block_hashes=tuple(self.chains[i, step - 5][-3:])))
                seq = pub.send(events)
                self.applier.apply(
                    pod=pub.pod, model=MODEL, seq=seq, batch=EventBatch(time.time(), tuple(events))
                )
            step += 1
            time.sleep(0.02)

    def read(self) -> None:
        index = self.harness.index
        while not self.stop.is_set():
            chain = self.chains.get((0, 0))
            try:
                if chain is not None:
                    index.lookup(model=MODEL, keys=chain)
                self.lookups.append((time.monotonic(), True))
            except IndexUnavailable:
                self.lookups.append((time.monotonic(), False))
            time.sleep(0.01)


@pytest.mark.slow
def test_a_master_killed_under_load_fails_over_within_a_bounded_window_and_loses_nothing() -> None:
    cluster = ValkeyCluster(masters=3, replicas=1, node_timeout_ms=1000)
    index = open_index(cluster.url + "?socket_timeout=2&socket_connect_timeout=0.5")
    config = ServiceConfig(seed="42", default_block_size=16)
    harness = Harness(index, config, workers=2)
    try:
        load = Load(harness, config)
        threads = [threading.Thread(target=load.publish), threading.Thread(target=load.read)]
        for t in threads:
            t.start()
        time.sleep(KILL_AFTER)
        victim = cluster.master_ports()[0]
        replica = next(
            p
            for p in cluster.replica_ports()
            if cluster.clients[p].info("replication")["master_port"] == victim
        )
        killed_at = time.monotonic()
        cluster.kill(victim)
        promoted_at = wait_until(
            lambda: cluster.roles().get(replica) == "master" and time.monotonic(),
            timeout=15,
            what="the replica to take over",
        )
        time.sleep(max(0.0, LOAD_SECONDS - (time.monotonic() - killed_at) - KILL_AFTER))
        load.stop.set()
        for t in threads:
            t.join(10)
        stopped_at = time.monotonic()

        for pub in load.publishers:
            harness.sync(pub.pod, timeout=30)  # ingest caught up: every batch applied
        caught_up_at = time.monotonic()

        failures = [at for at, answered in load.lookups if not answered]
        window = (failures[-1] - killed_at) if failures else 0.0
        log.warning(
            "failover: promoted after %.2f s; lookups failed for %.2f s (%d of %d); "
            "ingest caught up %.2f s after the load stopped (%.1f s after the kill)",
            promoted_at - killed_at,
            window,
            len(failures),
            len(load.lookups),
            caught_up_at - stopped_at,
            stopped_at - killed_at,
        )
        assert failures, "the kill did not disturb the readers: the test measured nothing"
        assert window < MAX_ERROR_WINDOW
        assert all(answered for at, answered in load.lookups if at > killed_at + window)
        assert harness.stats.index_losses == 0  # the replica had the epoch witnesses: not a loss
        waited = [
            cluster.clients[p].info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
            for p in cluster.master_ports()
        ]
        assert max(waited) > 0  # writes waited for a replica's acknowledgement

        # Nothing lost: the index holds exactly what the engines sent, as the oracle does.
        for (i, _), chain in sorted(load.chains.items()):
            pod = f"pod-{i}"
            assert index.lookup(model=MODEL, keys=chain, pods=[pod]) == load.oracle.lookup(
                model=MODEL, keys=chain, pods=[pod]
            )
        assert index.pod_blocks() == load.oracle.pod_blocks()
        assert_cluster_consistent([cluster.clients[p] for p in cluster.master_ports()])
    finally:
        harness.close()
        index.close()
        cluster.stop()
