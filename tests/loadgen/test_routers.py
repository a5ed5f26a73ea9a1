"""Routers: each policy's choice, its tie-breaking, its seeded randomness, the kv fallback."""

from __future__ import annotations

import asyncio
import random

import pytest

from simulator.loadgen.routers import (
    ROUTER_NAMES,
    InFlight,
    KVLoadRouter,
    KVRouter,
    LeastLoadedRouter,
    RandomRouter,
    RoundRobinRouter,
    RouteRequest,
    ScoreLookup,
    Scores,
    ScoreUnavailable,
    make_router,
)

PODS = ["sim-0", "sim-1", "sim-2"]


class FixedScores:
    """The scoring service's stand-in: the same answer for every query, or a failure."""

    def __init__(self, by_pod: dict[str, float] | None, blocks: int = 10) -> None:
        self.answer = None if by_pod is None else Scores(blocks=blocks, by_pod=by_pod)
        self.queries: list[dict] = []

    async def __call__(self, query: dict) -> Scores:
        self.queries.append(query)
        if self.answer is None:
            raise ScoreUnavailable("HTTP 503: index unavailable")
        return self.answer


def request(i: int = 0) -> RouteRequest:
    return RouteRequest(id=i, score_query={"model": "m", "prompt": f"p{i}"})


def choose(router, n: int = 1) -> list[str]:
    async def go():
        return [await router.choose(request(i)) for i in range(n)]

    return asyncio.run(go())


def loads(**counts: int) -> InFlight:
    in_flight = InFlight(PODS)
    for pod, count in counts.items():
        for _ in range(count):
            in_flight.start(pod.replace("_", "-"))
    return in_flight


def kv(by_pod, in_flight=None, seed=0, cls=KVRouter, **kwargs):
    lookup = ScoreLookup(FixedScores(by_pod))
    return cls(PODS, lookup=lookup, in_flight=in_flight or InFlight(PODS), rng=random.Random(seed), **kwargs)


def test_round_robin_cycles_in_pod_order():
    assert choose(RoundRobinRouter(PODS), 7) == [*PODS, *PODS, "sim-0"]


def test_random_is_seeded_and_reaches_every_pod():
    first = choose(RandomRouter(PODS, rng=random.Random(5)), 50)
    assert first == choose(RandomRouter(PODS, rng=random.Random(5)), 50)
    assert first != choose(RandomRouter(PODS, rng=random.Random(6)), 50)
    assert set(first) == set(PODS)


def test_least_loaded_picks_the_fewest_in_flight():
    router = LeastLoadedRouter(PODS, in_flight=loads(sim_0=3, sim_1=1, sim_2=2), rng=random.Random(0))
    assert choose(router) == ["sim-1"]


def test_least_loaded_breaks_ties_with_the_seeded_rng():
    def picks(seed):
        return choose(LeastLoadedRouter(PODS, in_flight=loads(sim_0=1), rng=random.Random(seed)), 40)

    assert set(picks(1)) == {"sim-1", "sim-2"}
    assert picks(1) == picks(1)


def test_kv_picks_the_highest_score():
    assert choose(kv({"sim-0": 2.0, "sim-2": 7.5}, loads(sim_2=5))) == ["sim-2"]


def test_kv_breaks_score_ties_by_load_then_at_random():
    assert choose(kv({"sim-0": 4.0, "sim-1": 4.0}, loads(sim_0=2, sim_1=1))) == ["sim-1"]
    tied = {"sim-0": 4.0, "sim-1": 4.0}
    assert set(choose(kv(tied, seed=3), 40)) == {"sim-0", "sim-1"}
    assert choose(kv(tied, seed=3), 40) == choose(kv(tied, seed=3), 40)


def test_kv_without_any_match_routes_least_loaded():
    assert choose(kv({}, loads(sim_0=1, sim_2=1))) == ["sim-1"]


def test_kv_falls_back_to_least_loaded_when_scoring_fails_and_counts_it():
    router = kv(None, loads(sim_0=2, sim_1=1))
    assert choose(router, 3) == ["sim-2", "sim-2", "sim-2"]
    assert router.fallbacks == 3
    assert router.last_error == "HTTP 503: index unavailable"
    assert router.lookup.failures == 3


def test_kv_load_trades_prefix_share_for_load():
    # value = score / blocks - alpha * in_flight: sim-0 0.9 - 0.1*5 = 0.4, sim-1 0.5 - 0.1*0 = 0.5
    scores = {"sim-0": 9.0, "sim-1": 5.0}
    assert choose(kv(scores, loads(sim_0=5), cls=KVLoadRouter, alpha=0.1)) == ["sim-1"]
    assert choose(kv(scores, loads(sim_0=3), cls=KVLoadRouter, alpha=0.1)) == ["sim-0"]  # 0.6 > 0.5
    assert choose(kv(scores, loads(sim_0=5), cls=KVLoadRouter, alpha=0.0)) == ["sim-0"]


def test_score_lookup_fetches_once_per_request_and_remembers_failures():
    fetch = FixedScores({"sim-1": 3.0})
    lookup = ScoreLookup(fetch)

    async def twice(req):
        return await lookup.scores(req), await lookup.scores(req)

    first, second = asyncio.run(twice(request(1)))
    assert first is second and len(fetch.queries) == 1 and lookup.calls == 1
    assert lookup.known(request(1)) is first
    lookup.forget(request(1))
    assert lookup.known(request(1)) is None

    failing = ScoreLookup(FixedScores(None))
    for _ in range(2):
        with pytest.raises(ScoreUnavailable):
            asyncio.run(failing.scores(request(2)))
    assert failing.calls == 1 and failing.failures == 1 and failing.known(request(2)) is None


def test_scores_best_and_missing_pods():
    scores = Scores(blocks=4, by_pod={"sim-0": 1.0, "sim-1": 3.0})
    assert scores.of("sim-2") == 0.0 and scores.best() == 3.0
    assert scores.is_best("sim-1") and not scores.is_best("sim-0")
    assert Scores(blocks=4, by_pod={}).best() == 0.0


def test_in_flight_counts_and_refuses_to_go_negative():
    in_flight = loads(sim_1=2)
    in_flight.finish("sim-1")
    assert in_flight.snapshot() == {"sim-0": 0, "sim-1": 1, "sim-2": 0}
    with pytest.raises(ValueError, match="sim-0"):
        in_flight.finish("sim-0")


def test_make_router_knows_every_name():
    lookup, in_flight = ScoreLookup(FixedScores({})), InFlight(PODS)
    for name in ROUTER_NAMES:
        router = make_router(name, pods=PODS, lookup=lookup, in_flight=in_flight, rng=random.Random(0))
        assert router.name == name
    with pytest.raises(ValueError, match="unknown router 'best'"):
        make_router("best", pods=PODS, lookup=lookup, in_flight=in_flight, rng=random.Random(0))
