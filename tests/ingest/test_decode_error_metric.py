"""``kvcache_ingest_decode_errors_total``: every reason is exported from 0, so that an alert on its
``increase()`` sees the first error too."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ingest.events import REASONS
from ingest.stats import StreamStats
from kvindex.shared_stats import DECODE_ERROR_REASONS, collect_families

APPLIER = Path(__file__).resolve().parents[2] / "ingest" / "applier.py"


def test_every_reason_ingest_counts_is_a_known_reason() -> None:
    applier_reasons = set(re.findall(r'decode_errors\["([a-z_]+)"\]', APPLIER.read_text()))
    assert applier_reasons  # the applier counts some reasons of its own
    assert set(REASONS) | applier_reasons == set(DECODE_ERROR_REASONS)


def samples(snapshots: list[dict], unattributed: dict[str, int]) -> dict[tuple[str, str], float]:
    class Collector:
        def collect(self):
            return collect_families(snapshots, unattributed)

    registry = CollectorRegistry()
    registry.register(Collector())
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name == "kvcache_ingest_decode_errors_total":
                out[sample.labels["pod"], sample.labels["reason"]] = sample.value
    return out


def test_a_stream_without_errors_exports_every_reason_at_0_and_counts_the_rest() -> None:
    quiet = StreamStats(pod="pod-a", rank=0, model="m", first_event_at=0.0).as_dict()
    noisy = StreamStats(pod="pod-b", rank=0, model="m", first_event_at=0.0)
    noisy.decode_errors["field"] += 3
    found = samples([quiet, noisy.as_dict()], {"topic": 2})

    assert {reason for pod, reason in found if pod == "pod-a"} == set(DECODE_ERROR_REASONS)
    assert all(found["pod-a", reason] == 0 for reason in DECODE_ERROR_REASONS)
    assert found["pod-b", "field"] == 3
    assert found["pod-b", "seq"] == 0
    assert found["", "topic"] == 2
    assert found["", "msgpack"] == 0
