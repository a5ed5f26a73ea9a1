"""The ``ingest`` command's housekeeping against the registry (a real database)."""

from __future__ import annotations

import time

import pytest

from ingest.management.commands.ingest import Housekeeping
from ingest.stats import IngestStats
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
