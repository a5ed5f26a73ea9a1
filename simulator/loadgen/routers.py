"""Routers: which pod gets a request. One small class per policy, one async method.

Every router answers ``await router.choose(request) -> pod`` for a :class:`RouteRequest`. Load
is the number of requests loadgen itself has in flight per pod (:class:`InFlight`), not what the
pods report. Randomness always comes from the ``random.Random`` a router is given, so a seeded
run routes the same way twice (given the same completion order).

- ``random``: a uniformly random pod.
- ``round-robin``: pods in their listed order, cyclically.
- ``least-loaded``: the fewest requests in flight; ties at random.
- ``kv``: the highest score from the scoring service; ties by fewest in flight, then at random.
  When the score call fails it falls back to ``least-loaded`` and counts it in ``fallbacks``.
- ``kv-load``: the highest ``score / blocks - alpha * in_flight``: the share of the prompt's
  blocks the pod holds (tier-weighted, 0..1) minus ``alpha`` per request in flight there.
  With the default ``alpha`` 0.1 a fully cached prompt is worth ten queued requests. Ties and
  score failures as ``kv``.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from itertools import cycle
from typing import ClassVar

DEFAULT_ALPHA = 0.1


class ScoreUnavailable(Exception):
    """The scoring service gave no usable answer for a request (the message says why)."""


@dataclass(frozen=True)
class Scores:
    """A score answer: ``by_pod`` holds the pods that matched; every other pod scores 0.
    ``blocks`` is the number of blocks in the prompt."""

    blocks: int
    by_pod: dict[str, float]

    def of(self, pod: str) -> float:
        return self.by_pod.get(pod, 0.0)

    def best(self) -> float:
        return max(self.by_pod.values(), default=0.0)

    def is_best(self, pod: str) -> bool:
        return math.isclose(self.of(pod), self.best(), rel_tol=1e-9, abs_tol=1e-9)


@dataclass(eq=False)
class RouteRequest:
    """What a router sees of a request: its id and the query to send to the scoring service."""

    id: int
    score_query: dict


class InFlight:
    """Requests in flight per pod, as counted by loadgen (started and not yet finished)."""

    def __init__(self, pods: Iterable[str]) -> None:
        self._counts = dict.fromkeys(pods, 0)

    def __getitem__(self, pod: str) -> int:
        return self._counts[pod]

    def start(self, pod: str) -> None:
        self._counts[pod] += 1

    def finish(self, pod: str) -> None:
        if self._counts[pod] <= 0:
            raise ValueError(f"no request in flight on {pod}")
        self._counts[pod] -= 1

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)


class ScoreLookup:
    """Fetches each request's scores at most once, so the router and the report share one answer.

    ``fetch`` is the transport (an HTTP call in production). A failure is remembered too: the
    second caller gets the same :class:`ScoreUnavailable`. ``forget`` drops a finished request.
    """

    def __init__(self, fetch: Callable[[dict], Awaitable[Scores]]) -> None:
        self._fetch = fetch
        self._answers: dict[int, Scores | ScoreUnavailable] = {}
        self.calls = 0
        self.failures = 0

    async def scores(self, request: RouteRequest) -> Scores:
        answer = self._answers.get(request.id)
        if answer is None:
            self.calls += 1
            try:
                answer = await self._fetch(request.score_query)
            except ScoreUnavailable as e:
                self.failures += 1
                answer = e
            self._answers[request.id] = answer
        if isinstance(answer, ScoreUnavailable):
            raise answer
        return answer

    def known(self, request: RouteRequest) -> Scores | None:
        """The scores already fetched for ``request``, None if not fetched or failed."""
        answer = self._answers.get(request.id)
        return answer if isinstance(answer, Scores) else None

    def forget(self, request: RouteRequest) -> None:
        self._answers.pop(request.id, None)


def pick(pods: list[str], *, value: Callable[[str], float], in_flight: InFlight, rng: random.Random) -> str:
    """The pod with the highest ``value``; ties go to the fewest in flight, then to ``rng``."""
    best = max(value(p) for p in pods)
    top = [p for p in pods if math.isclose(value(p), best, rel_tol=1e-9, abs_tol=1e-9)]
    least = min(in_flight[p] for p in top)
    return rng.choice([p for p in top if in_flight[p] == least])


class Router(ABC):
    name: ClassVar[str]

    def __init__(self, pods: list[str]) -> None:
        if not pods:
            raise ValueError("a router needs at least one pod")
        self.pods = list(pods)

    @abstractmethod
    async def choose(self, request: RouteRequest) -> str:
        """The pod to send ``request`` to."""


class RandomRouter(Router):
    name = "random"

    def __init__(self, pods: list[str], *, rng: random.Random) -> None:
        super().__init__(pods)
        self.rng = rng

    async def choose(self, request: RouteRequest) -> str:
        return self.rng.choice(self.pods)


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, pods: list[str]) -> None:
        super().__init__(pods)
        self._next = cycle(self.pods)

    async def choose(self, request: RouteRequest) -> str:
        return next(self._next)


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def __init__(self, pods: list[str], *, in_flight: InFlight, rng: random.Random) -> None:
        super().__init__(pods)
        self.in_flight = in_flight
        self.rng = rng

    async def choose(self, request: RouteRequest) -> str:
        return pick(self.pods, value=lambda p: -self.in_flight[p], in_flight=self.in_flight, rng=self.rng)


class KVRouter(Router):
    name = "kv"

    def __init__(
        self, pods: list[str], *, lookup: ScoreLookup, in_flight: InFlight, rng: random.Random
    ) -> None:
        super().__init__(pods)
        self.lookup = lookup
        self.in_flight = in_flight
        self.rng = rng
        self.fallbacks = 0  # requests routed least-loaded because the score call failed
        self.last_error: str | None = None

    async def choose(self, request: RouteRequest) -> str:
        try:
            scores = await self.lookup.scores(request)
        except ScoreUnavailable as e:
            self.fallbacks += 1
            self.last_error = str(e)
            return pick(self.pods, value=lambda p: -self.in_flight[p], in_flight=self.in_flight, rng=self.rng)
        return pick(self.pods, value=self.value(scores), in_flight=self.in_flight, rng=self.rng)

    def value(self, scores: Scores) -> Callable[[str], float]:
        return scores.of


class KVLoadRouter(KVRouter):
    name = "kv-load"

    def __init__(
        self,
        pods: list[str],
        *,
        lookup: ScoreLookup,
        in_flight: InFlight,
        rng: random.Random,
        alpha: float = DEFAULT_ALPHA,
    ) -> None:
        super().__init__(pods, lookup=lookup, in_flight=in_flight, rng=rng)
        if alpha < 0:
            raise ValueError("alpha must be >= 0")
        self.alpha = alpha

    def value(self, scores: Scores) -> Callable[[str], float]:
        blocks = max(scores.blocks, 1)
        return lambda p: scores.of(p) / blocks - self.alpha * self.in_flight[p]


ROUTER_NAMES = ("kv", "kv-load", "least-loaded", "random", "round-robin")


def make_router(
    name: str,
    *,
    pods: list[str],
    lookup: ScoreLookup,
    in_flight: InFlight,
    rng: random.Random,
    alpha: float = DEFAULT_ALPHA,
) -> Router:
    """The router called ``name`` (one of :data:`ROUTER_NAMES`)."""
    if name == "random":
        return RandomRouter(pods, rng=rng)
    if name == "round-robin":
        return RoundRobinRouter(pods)
    if name == "least-loaded":
        return LeastLoadedRouter(pods, in_flight=in_flight, rng=rng)
    if name == "kv":
        return KVRouter(pods, lookup=lookup, in_flight=in_flight, rng=rng)
    if name == "kv-load":
        return KVLoadRouter(pods, lookup=lookup, in_flight=in_flight, rng=rng, alpha=alpha)
    raise ValueError(f"unknown router {name!r}: choose one of {', '.join(ROUTER_NAMES)}")
