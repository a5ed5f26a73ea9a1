"""``epp.server.Endings``: a request's load on its pod lasts until Envoy's access log says it
ended, bounded in count and age, and an id seen twice never leaks load."""

from __future__ import annotations

from epp.server import Endings
from routing.load import LoadTracker


def test_an_answer_counts_until_its_log_entry_and_an_early_entry_ends_it_at_once() -> None:
    load = LoadTracker()
    endings = Endings(load)
    endings.logs = 1  # Envoy's access log is connected
    endings.hand_over("a", load.start("pod-1"))
    assert load.in_flight["pod-1"] == 1 and endings.pending == 1
    endings.ended("a")
    assert load.in_flight["pod-1"] == 0 and endings.pending == 0
    endings.ended("b")  # logged before its stream closed
    endings.hand_over("b", load.start("pod-1"))
    assert load.in_flight["pod-1"] == 0


def test_without_an_access_log_a_request_ends_with_its_stream() -> None:
    load = LoadTracker()
    endings = Endings(load)
    endings.hand_over("a", load.start("pod-1"))
    assert load.in_flight["pod-1"] == 0 and endings.pending == 0


def test_an_id_seen_twice_ends_the_first_request_and_no_load_leaks() -> None:
    load = LoadTracker()
    endings = Endings(load)
    endings.logs = 1
    endings.hand_over("same", load.start("pod-1"))
    endings.hand_over("same", load.start("pod-2"))
    assert load.in_flight["pod-1"] == 0 and load.in_flight["pod-2"] == 1
    endings.ended("same")
    assert load.in_flight["pod-2"] == 0


def test_waiting_requests_are_bounded_in_count_and_age() -> None:
    load = LoadTracker()
    endings = Endings(load, max_pending=3, max_age=0.0)
    endings.logs = 1
    for i in range(5):
        endings.hand_over(str(i), load.start("pod-1"))
    assert endings.pending <= 1  # over max_age at once: each hand-over expires the older ones
    bounded = Endings(load, max_pending=3)
    bounded.logs = 1
    for i in range(10):
        bounded.hand_over(f"x{i}", load.start("pod-3"))
    assert bounded.pending == 3 and load.in_flight["pod-3"] == 3
