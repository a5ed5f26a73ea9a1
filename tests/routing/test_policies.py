"""The kv-load blend and the load it is given: what waits costs, what runs in the batch barely;
kv-ttft's expected time to first token and what the tracker learns for it."""

from __future__ import annotations

import random

import pytest

from registry.pod_metrics import requests_by_state, requests_in
from routing.load import DEFAULT_BLOCK_SECONDS, DEFAULT_REQUEST_SECONDS, LoadTracker, ServiceTimes
from routing.policies import RUNNING_WEIGHT, Candidate, affinity_of, home_score, make_policy

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


def test_round_robin_takes_turns_within_each_set_of_candidates():
    """A P/D request ranks its decode pods, then its prefill pods: each side goes round all of
    its pods, whatever the other side does."""
    policy = make_policy("round-robin", rng=random.Random(0))
    decode = [Candidate(pod) for pod in ("d-0", "d-1", "d-2", "d-3")]
    prefill = [Candidate(pod) for pod in ("p-0", "p-1", "p-2", "p-3")]
    picks = [(policy.rank(decode, blocks=1)[0].pod, policy.rank(prefill, blocks=1)[0].pod) for _ in range(4)]
    assert picks == [("d-0", "p-0"), ("d-1", "p-1"), ("d-2", "p-2"), ("d-3", "p-3")]


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


def test_service_times_learn_a_slot_and_the_prefill_cost_of_a_block_and_of_the_batch():
    times = ServiceTimes()
    assert (times.request_seconds, times.block_seconds, times.running_seconds) == (
        DEFAULT_REQUEST_SECONDS,
        DEFAULT_BLOCK_SECONDS,
        0.0,
    )
    for i in range(60):  # time to first token = 20 ms + 3 ms per block ahead + 40 ms per running request
        blocks, running = 5 + (i % 8) * 10, i % 3
        times.first_token(blocks, running, 0.020 + 0.003 * blocks + 0.040 * running)
        times.finished(1.5)
    assert times.block_seconds == pytest.approx(0.003)
    assert times.running_seconds == pytest.approx(0.040)
    assert times.request_seconds == pytest.approx(1.5)
    times = ServiceTimes()
    for i in range(40):  # every request the same size: no slope to fit, the default stays
        times.first_token(10, i % 2, 0.5 + 0.1 * (i % 2))
    assert times.block_seconds == DEFAULT_BLOCK_SECONDS and times.running_seconds == pytest.approx(0.1)
    times = ServiceTimes()
    for i in range(40):  # an idle fleet: the batch never holds anything, the blocks alone are fitted
        times.first_token(10 + i, 0, 0.01 * (10 + i))
    assert times.block_seconds == pytest.approx(0.01) and times.running_seconds == 0.0


def test_the_tracker_keeps_the_prefill_ahead_until_the_first_bytes_and_learns_only_from_free_slots():
    tracker = LoadTracker()
    tracker.observe("a", running=2.0, now=0.0)  # a batch of 2
    tracker.observe("a", running=0.0, now=0.0)  # now idle
    first = tracker.start("a", prefill_blocks=10, now=0.0)
    second = tracker.start("a", prefill_blocks=4, now=0.0)
    third = tracker.start("a", prefill_blocks=6, now=0.0)  # the batch is full: it waits
    assert tracker.prefilling["a"] == 20 and (first.ahead, second.ahead, third.ahead) == (10, 14, 20)
    assert (first.free_slot, second.free_slot, third.free_slot) == (True, True, False)
    tracker.answered(first, now=0.1)
    tracker.answered(first, now=0.2)  # once only
    assert tracker.prefilling["a"] == 10
    tracker.finish(second, now=0.3)  # never answered (it failed): its prefill is no longer ahead
    assert tracker.prefilling["a"] == 6 and tracker.in_flight["a"] == 2
    tracker.answered(third, now=0.5)
    tracker.finish(third, now=1.0)
    tracker.finish(first, now=1.0)
    assert tracker.prefilling["a"] == 0 and tracker.in_flight["a"] == 0
    assert tracker.times.first_tokens_seen == 1  # only the first: the third waited, the second never answered
    unstreamed = tracker.start("a", prefill_blocks=3, learn=False, now=2.0)
    assert not unstreamed.free_slot  # its first bytes are its whole answer


def test_the_wait_for_a_slot_grows_with_the_queue_and_is_shared_by_the_slots():
    tracker = LoadTracker()
    assert tracker.wait_seconds("a", 0.0) == DEFAULT_REQUEST_SECONDS  # unknown batch: one slot
    tracker.observe("a", running=4.0, now=0.0)
    assert tracker.wait_seconds("a", 3.0) == 0.0
    assert tracker.wait_seconds("a", 4.0) == pytest.approx(DEFAULT_REQUEST_SECONDS / 4)
    assert tracker.wait_seconds("a", 6.0) == pytest.approx(3 * DEFAULT_REQUEST_SECONDS / 4)


def test_kv_ttft_weighs_a_hit_by_the_prefill_it_saves_against_the_wait():
    policy = make_policy("kv-ttft", rng=random.Random(0))
    block = 0.005
    idle = Candidate("idle", matched=0, load=0.0, queued=0.0, block_seconds=block)
    # A batch that runs requests slows the prefill: each costs what the tracker learned.
    crowded = Candidate("crowded", matched=0, load=3.0, queued=0.0, block_seconds=block, running_seconds=0.05)
    assert crowded.expected_ttft(10) == pytest.approx(0.05 + 3 * 0.05)
    assert policy.rank([crowded, idle], blocks=10)[0].pod == "idle"
    # A short prompt (28 blocks, 0.14 s of prefill) held where a request waits 0.25 s: not worth it.
    short = Candidate("holder", matched=28, load=4.0, queued=0.0, wait=0.25, block_seconds=block)
    assert policy.rank([idle, short], blocks=28)[0].pod == "idle"
    # A long one (190 blocks, 0.95 s): worth the same wait.
    long = Candidate("holder", matched=190, load=4.0, queued=0.0, wait=0.25, block_seconds=block)
    assert policy.rank([idle, long], blocks=190)[0].pod == "holder"
    # Prefill already queued on a pod counts as its own would.
    behind = Candidate("behind", matched=0, load=1.0, queued=0.0, prefill_ahead=100, block_seconds=block)
    assert policy.rank([behind, idle], blocks=10)[0].pod == "idle"
    assert idle.expected_ttft(10) == pytest.approx(0.05) and short.expected_ttft(190) == pytest.approx(
        0.25 + 0.81
    )
