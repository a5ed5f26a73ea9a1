"""The kv-load blend and the load it is given: what waits costs, what runs in the batch barely."""

from __future__ import annotations

import random

import pytest

from gateway.load import LoadTracker
from gateway.policies import RUNNING_WEIGHT, Candidate, affinity_of, home_score, make_policy
from registry.pod_metrics import requests_by_state, requests_in

METRICS = b"""# HELP vllm:num_requests_running Running.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{reason="x"} 9.0
"""


def test_running_and_waiting_are_read_apart():
    assert requests_by_state(METRICS) == (4.0, 2.0)
    assert requests_in(METRICS) == 6.0
    assert requests_by_state(b"") == (0.0, 0.0)


def test_the_tracker_learns_a_pods_batch_and_splits_its_load():
    tracker = LoadTracker()
    for _ in range(3):
        tracker.start("a")
    assert tracker.queued("a", tracker.of("a", now=0.0)) == 3.0  # never scraped: all of it waits
    tracker.observe("a", running=2.0, waiting=1.0, now=0.0)
    tracker.observe("a", running=1.0, waiting=0.0, now=0.5)  # the most seen running stays 2
    assert tracker.slots["a"] == 2.0
    for _ in range(3):
        tracker.start("a")
    load = tracker.of("a", now=1.0)
    assert load == 6.0 and tracker.queued("a", load) == 4.0
    assert tracker.queued("a", 1.0) == 0.0


def test_candidate_cost_counts_running_requests_a_tenth():
    assert Candidate("a", load=6.0, queued=2.0).cost == pytest.approx(2.0 + RUNNING_WEIGHT * 4)
    assert Candidate("a", load=3.0).cost == 3.0  # unknown batch: everything waits
    assert Candidate("a", load=1.0, queued=5.0).cost == 1.0  # never more than the load


def test_kv_load_keeps_a_prefix_on_its_pod_until_requests_wait_there():
    policy = make_policy("kv-load", rng=random.Random(0))
    idle = Candidate("idle", matched=0, load=0.0, queued=0.0)
    # The holder's batch has room: three running requests cost 0.075 of a hit.
    holder = Candidate("holder", matched=100, load=3.0, queued=0.0)
    assert policy.rank([idle, holder], blocks=100)[0].pod == "holder"
    # Four waiting (plus a full batch of four): one whole hit is worth four waiting requests.
    swamped = Candidate("holder", matched=100, load=8.0, queued=4.0)
    assert policy.rank([idle, swamped], blocks=100)[0].pod == "idle"
    # A partial hit gives way sooner.
    half = Candidate("holder", matched=50, load=6.0, queued=2.0)
    assert policy.rank([idle, half], blocks=100)[0].pod == "idle"


def test_least_loaded_still_counts_every_request():
    policy = make_policy("least-loaded", rng=random.Random(0))
    ranked = policy.rank(
        [Candidate("a", load=3.0, queued=0.0), Candidate("b", load=1.0, queued=1.0)], blocks=1
    )
    assert ranked[0].pod == "b"


def test_a_prefix_nobody_holds_goes_home_from_every_replica():
    pods = [Candidate(f"sim-{i}", load=0.0, queued=0.0) for i in range(8)]
    homes = set()
    for affinity in range(1, 400, 7):
        # Two replicas (differently seeded, candidates in another order) agree on the home.
        a = make_policy("kv-load", rng=random.Random(1)).rank(pods, blocks=10, affinity=affinity)
        b = make_policy("kv-load", rng=random.Random(2)).rank(pods[::-1], blocks=10, affinity=affinity)
        assert a[0].pod == b[0].pod == max(pods, key=lambda c: home_score(c.pod, affinity)).pod
        assert [c.pod for c in a] == [c.pod for c in b]  # and on the order of the retries
        homes.add(a[0].pod)
    assert len(homes) == 8  # homes spread over the fleet
    # Without keys (no affinity) ties are shuffled by the seeded generator instead.
    firsts = {make_policy("kv-load", rng=random.Random(s)).rank(pods, blocks=0)[0].pod for s in range(20)}
    assert len(firsts) > 1


def test_homes_only_break_ties():
    affinity = affinity_of(list(range(100, 120)))
    assert affinity == 107  # the 8th block's key names the first 128 tokens
    assert affinity_of([]) is None and affinity_of([5, 6]) == 6
    idle = [Candidate(f"sim-{i}", load=0.0, queued=0.0) for i in range(4)]
    home = max(idle, key=lambda c: home_score(c.pod, affinity)).pod
    other = next(c.pod for c in idle if c.pod != home)
    for name in ("kv-load", "kv", "approx-prefix"):
        policy = make_policy(name, rng=random.Random(0))
        assert policy.rank(idle, blocks=10, affinity=affinity)[0].pod == home
        # A holder wins, and so does a lighter pod: one running request is no tie.
        holder = [Candidate(other, matched=10, load=1.0, queued=0.0) if c.pod == other else c for c in idle]
        assert policy.rank(holder, blocks=10, affinity=affinity)[0].pod == other
        busy = [Candidate(home, load=1.0, queued=0.0) if c.pod == home else c for c in idle]
        assert policy.rank(busy, blocks=10, affinity=affinity)[0].pod != home
