"""The ``ingest`` command's housekeeping against the registry (a real database)."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

import ingest.service as housekeeping_module
from ingest.service import Housekeeping
from ingest.stats import IngestStats
from kvindex import MemoryIndex, StoredBlock
from kvindex.dynamo import PRUNE_GRACE_SECONDS, DynamoBlock, MemoryDynamoBlockStore
from registry import runtime
from registry.models import Pod

MODEL = "google/gemma-3-1b-it"


@pytest.mark.django_db(transaction=True)
def test_groups_learned_before_the_pod_has_a_row_are_recorded_once_it_has_one(settings):
    """A worker can learn a pod's KV-cache groups between housekeeping recording the pods seen and
    recording the groups (the pod's first event arrived in between): that round has no row to
    write them in. They were then skipped and never written (nothing changed since), and the pod
    was scored as if its events had described no groups (caught by a loaded CI run)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    stats = IngestStats()
    housekeeping = Housekeeping(stats)
    try:
        stats.learn_group("pod-a", MODEL, 1, "sliding_window", 512)  # the event's groups are in...
        housekeeping.run_once()  # ...but its stream's last_event_at is not yet: no row this round
        assert not Pod.objects.filter(pod_id="pod-a").exists()
        stream = stats.stream("pod-a", 0, MODEL)
        stream.first_event_at = stream.last_event_at = time.time()
        housekeeping.run_once()
        pod = Pod.objects.get(pod_id="pod-a")
        assert [g["kind"] for g in pod.learned_kv_cache_groups] == ["full_attention", "sliding_window"]
    finally:
        housekeeping.close()


@pytest.mark.django_db(transaction=True)
def test_a_round_writes_the_groups_of_the_pods_whose_groups_changed_only(settings):
    """A round wrote the groups of every pod whenever one pod's changed: a query naming the whole
    fleet each second, and under a flood of fuzzed groups a prepared statement per fleet size in
    SQLite's cache (~12 MB in ``bench/hostile.py``'s fuzz)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    stats = IngestStats()
    housekeeping = Housekeeping(stats)
    try:
        for pod in ("pod-a", "pod-b", "pod-c"):
            stats.learn_group(pod, MODEL, 1, "sliding_window", 512)
            stream = stats.stream(pod, 0, MODEL)
            stream.first_event_at = stream.last_event_at = time.time()
        housekeeping.run_once()  # the rows
        housekeeping.run_once()  # their groups
        assert Pod.objects.exclude(learned_kv_cache_groups=[]).count() == 3
        stats.learn_group("pod-b", MODEL, 2, "sliding_window", 1024)
        with CaptureQueriesContext(connection) as queries:
            housekeeping.run_once()
        named = [q["sql"] for q in queries if "learned_kv_cache_groups" in q["sql"]]
        assert named and all("pod-a" not in sql and "pod-c" not in sql for sql in named), named
        assert len(Pod.objects.get(pod_id="pod-b").learned_kv_cache_groups) == 3
        assert len(Pod.objects.get(pod_id="pod-a").learned_kv_cache_groups) == 2
        with CaptureQueriesContext(connection) as queries:
            housekeeping.run_once()  # nothing changed: nothing written
        assert not [q for q in queries if "learned_kv_cache_groups" in q["sql"]]
    finally:
        housekeeping.close()


@pytest.mark.django_db(transaction=True)
def test_the_dynamo_block_records_of_blocks_nobody_holds_are_pruned_every_few_minutes(settings, monkeypatch):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    index = MemoryIndex()
    index.store(model=MODEL, pod="7", tier="gpu", blocks=[StoredBlock(1, 1, (1).to_bytes(8, "big"))])
    store = MemoryDynamoBlockStore(clock=lambda: time.time() - 2 * PRUNE_GRACE_SECONDS)
    store.record(model=MODEL, blocks={1: DynamoBlock(None, 1337, 10), 2: DynamoBlock(1, 1337, 20)})
    monkeypatch.setattr(housekeeping_module, "DYNAMO_PRUNE_SECONDS", 0.0)
    runtime.set_index(index)
    housekeeping = Housekeeping(IngestStats(), dynamo=store)
    try:
        housekeeping.run_once()
        housekeeping._pruning.join(5)
        assert store.get(model=MODEL, keys=[1, 2]) == [DynamoBlock(None, 1337, 10), None]
    finally:
        housekeeping.close()
        runtime.set_index(None)
