"""The fleet view's pure core: counters per pod, rates and activity from successive snapshots,
rows with their status, totals, and the charts' columns from recorded history points."""

from __future__ import annotations

import pytest

from dashboard.fleet import (
    RegistryPod,
    ScoreCounters,
    activity_between,
    fleet_chart,
    fleet_totals,
    pod_chart,
    pod_counters,
    pod_of_holder,
    pod_rows,
    rates_between,
)
from kvindex.base import PodBlocks
from tests.dashboard.conftest import stream


def test_holders_of_data_parallel_ranks_belong_to_their_pod():
    assert pod_of_holder("pod-a") == "pod-a"
    assert pod_of_holder("pod-a#dp3") == "pod-a"
    assert pod_of_holder("#dp1") == "#dp1"  # nothing before the rank: not a rank holder


def test_pod_counters_sum_ranks_and_keep_the_latest_rank_seq():
    counters = pod_counters(
        [
            stream("a", 0, blocks_stored=10, aligned_blocks=8, misaligned_blocks=2, last_event_at=5.0),
            stream("a", 1, blocks_stored=5, aligned_blocks=2, decode_errors={"bad": 1}, last_event_at=9.0),
            stream("b", 0, events=3),
        ]
    )
    a = counters["a"]
    assert a.counts["blocks_stored"] == 15
    assert a.ranks == 2
    assert a.decode_errors == {"bad": 1}
    assert a.last_event_at == 9.0
    assert a.hash_alignment == pytest.approx(10 / 12)
    assert counters["b"].hash_alignment is None  # no computed block yet


def test_rates_are_counter_growth_over_the_time_between_snapshots():
    before = pod_counters([stream("a", blocks_stored=10, blocks_removed=2, events=4)])
    now = pod_counters([stream("a", blocks_stored=30, blocks_removed=6, events=8), stream("b", events=5)])
    rates = rates_between(before, now, seconds=2.0)
    assert (rates["a"].stored, rates["a"].removed, rates["a"].events) == (10.0, 2.0, 2.0)
    assert rates["b"].events == 2.5  # new since the last snapshot: everything it has is new


def test_a_counter_that_went_down_restarted_from_zero():
    before = pod_counters([stream("a", blocks_stored=100)])
    now = pod_counters([stream("a", blocks_stored=4)])
    assert rates_between(before, now, seconds=1.0)["a"].stored == 4.0
    assert rates_between(before, now, seconds=0.0) == {}


def test_activity_lists_what_moved_per_pod():
    before = pod_counters([stream("a", batches=1, events=1, blocks_stored=16), stream("b", batches=4)])
    now = pod_counters(
        [
            stream(
                "a",
                batches=3,
                events=4,
                blocks_stored=20,
                blocks_removed=2,
                seq_gaps=1,
                missed_batches=5,
                decode_errors={"bad_payload": 2},
                last_seq=9,
            ),
            stream("b", batches=4),
        ]
    )
    [entry] = activity_between(before, now, at=123.0)
    assert entry["pod"] == "a"
    assert entry["at"] == 123.0
    moved = (entry["batches"], entry["events"], entry["blocks_stored"], entry["blocks_removed"])
    assert moved == (2, 3, 4, 2)
    assert (entry["seq_gaps"], entry["missed_batches"], entry["last_seq"]) == (1, 5, 9)
    assert entry["decode_errors"] == {"bad_payload": 2}


def test_rows_merge_registry_index_and_streams_with_a_status():
    now = 1000.0
    rows = pod_rows(
        now=now,
        registry=[
            RegistryPod("live-pod", "m", True, now - 5),
            RegistryPod("off-pod", "m", False, now - 1),
            RegistryPod("quiet-pod", "m", True, now - 500),
        ],
        blocks=[
            PodBlocks("m", "live-pod", {"gpu": 10}),
            PodBlocks("m", "live-pod#dp1", {"gpu": 5, "cpu": 2}),
            PodBlocks("m", "index-only", {"gpu": 1}),
        ],
        counters=pod_counters(
            [
                stream(
                    "live-pod",
                    last_event_at=now - 2,
                    seq_gaps=1,
                    replayed_batches=4,
                    decode_errors={"x": 3},
                    resyncing=True,
                ),
                stream("off-pod", last_event_at=now - 1),
                stream("quiet-pod", last_event_at=now - 400),
            ]
        ),
        rates={},
        stale_after=60.0,
    )
    by_pod = {r["pod"]: r for r in rows}
    assert [r["pod"] for r in rows] == sorted(by_pod)
    live = by_pod["live-pod"]
    assert (live["replayed_batches"], live["resyncing"]) == (4, True)
    assert by_pod["off-pod"]["resyncing"] is False
    assert live["blocks_by_tier"] == {"cpu": 2, "gpu": 15}
    assert live["blocks"] == 17
    assert live["status"] == "active"
    assert live["last_event_age"] == pytest.approx(2.0)
    assert (live["seq_gaps"], live["decode_errors"]) == (1, 3)
    assert live["stored_per_s"] is None  # no second snapshot yet: unknown, not zero
    assert by_pod["off-pod"]["status"] == "disabled"
    assert by_pod["quiet-pod"]["status"] == "stale"
    assert by_pod["index-only"]["status"] == "stale"  # no running ingest process knows it
    assert by_pod["index-only"]["last_event_age"] is None


def test_rows_tell_idle_stale_and_down_pods_apart_by_their_health():
    now = 1000.0
    rows = pod_rows(
        now=now,
        registry=[
            RegistryPod("quiet-but-up", "m", True, now - 500, health="up"),
            RegistryPod("quiet-unprobed", "m", True, now - 500),
            RegistryPod("streaming-but-down", "m", True, now - 1, health="down"),
        ],
        blocks=[],
        counters={},
        rates={},
        stale_after=60.0,
    )
    assert {r["pod"]: (r["status"], r["health"]) for r in rows} == {
        "quiet-but-up": ("idle", "up"),
        "quiet-unprobed": ("stale", "unknown"),
        "streaming-but-down": ("down", "down"),
    }


def test_totals_add_up_rows_and_the_scoring_traffic():
    rows = [
        {
            "blocks_by_tier": {"gpu": 3},
            "stored_per_s": 1.5,
            "removed_per_s": None,
            "events_per_s": 2.0,
            "seq_gaps": 1,
            "decode_errors": 2,
            "status": "active",
        },
        {
            "blocks_by_tier": {"gpu": 1, "cpu": 4},
            "stored_per_s": 0.5,
            "removed_per_s": 1.0,
            "events_per_s": None,
            "seq_gaps": 0,
            "decode_errors": 0,
            "status": "stale",
        },
    ]
    score = ScoreCounters(requests=30, hits=12).rates_since(ScoreCounters(requests=10, hits=2), seconds=4.0)
    totals = fleet_totals(
        rows,
        unattributed_errors=5,
        ingest_processes=2,
        scoring=ScoreCounters(requests=30, hits=12),
        score=score,
    )
    assert totals["blocks"] == 8
    assert totals["blocks_by_tier"] == {"cpu": 4, "gpu": 4}
    assert (totals["active"], totals["idle"], totals["stale"], totals["down"], totals["disabled"]) == (
        1,
        0,
        1,
        0,
        0,
    )
    assert (totals["stored_per_s"], totals["removed_per_s"], totals["events_per_s"]) == (2.0, 1.0, 2.0)
    assert totals["decode_errors"] == 7
    assert totals["score_requests_per_s"] == 5.0
    assert totals["hit_rate"] == 0.5


def test_no_scoring_request_in_the_interval_has_no_hit_rate():
    same = ScoreCounters(requests=10, hits=2)
    assert same.rates_since(same, seconds=1.0).hit_rate is None


def test_hits_counted_before_their_requests_end_give_a_hit_rate_of_at_most_one():
    # A gateway counts the hit when the pod starts answering, the request when the answer ends.
    rates = ScoreCounters(requests=11, hits=12).rates_since(ScoreCounters(requests=10, hits=10), seconds=1.0)
    assert rates.hit_rate == 1.0


def test_without_a_hits_counter_the_hit_rate_is_unknown_not_zero():
    rates = ScoreCounters(requests=20, hits=None).rates_since(
        ScoreCounters(requests=10, hits=None), seconds=2
    )
    assert rates.requests_per_s == 5.0
    assert rates.hit_rate is None
    totals = fleet_totals(
        [], unattributed_errors=0, ingest_processes=0, scoring=ScoreCounters(20, None), score=rates
    )
    assert (totals["scoring_available"], totals["hit_rate_available"]) == (True, False)


def point(t: float, **pods: list) -> dict:
    """A recorded history point (``kvindex.shared_stats``): per pod [blocks, stored/s, removed/s,
    events/s]."""
    return {
        "t": t,
        "blocks": 0,
        "events_per_s": 1.0,
        "score_requests_per_s": None,
        "hit_rate": None,
        "pods": pods,
    }


def test_the_fleet_chart_shows_the_pods_holding_most_blocks_in_the_latest_point():
    points = [
        point(1.0, small=[5, 0, 0, 0], gone=[99, 0, 0, 0]),
        point(2.0, small=[1, 0, 0, 0], big=[9, 1.5, 0, 2.0], mid=[4, 0, 0, 0]),
    ]
    chart = fleet_chart(points, pods=2)
    assert chart["t"] == [1.0, 2.0]
    assert chart["events_per_s"] == [1.0, 1.0]
    assert chart["pods"] == {"big": [None, 9], "mid": [None, 4]}  # None: not in that point
    assert fleet_chart([], pods=2)["pods"] == {}


def test_a_pod_chart_has_its_four_series_and_gaps_where_it_was_not_recorded():
    chart = pod_chart([point(1.0), point(2.0, big=[9, 1.5, 0.5, 2.0])], "big")
    assert chart == {
        "t": [1.0, 2.0],
        "blocks": [None, 9],
        "stored_per_s": [None, 1.5],
        "removed_per_s": [None, 0.5],
        "events_per_s": [None, 2.0],
    }
