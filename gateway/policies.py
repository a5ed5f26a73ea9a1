"""Routing policies: the order in which the gateway tries the pods for one request.

Each candidate pod comes with ``matched`` (leading blocks of the request it holds, as the
policy's source of prefix knowledge says) and ``load`` (requests in flight on it). A policy ranks
every candidate, best first; the gateway sends the request to the first and, on a connect error
or a 5xx before the first byte, to the next.

* ``kv-load`` (default): ``matched / blocks - alpha * load``: a prefix hit is worth up to one
  request of queue per ``1 / alpha`` (0.1: ten); the index (KV events) plus speculative entries.
* ``kv``: the most blocks matched; load breaks ties.
* ``approx-prefix``: ``kv-load`` on the gateway's own memory of where it sent prefixes, no KV
  events (what routers without them do): the baseline that shows what the events are worth.
* ``least-loaded``, ``round-robin``, ``random``: no prefix knowledge.

Ties go to the least loaded, then to the seeded ``random.Random``.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

DEFAULT_ALPHA = 0.1

Source = Literal["index", "memory", "none"]


@dataclass(frozen=True, slots=True)
class Candidate:
    pod: str
    matched: int = 0
    load: float = 0.0


class Policy(ABC):
    name: ClassVar[str]
    source: ClassVar[Source] = "none"
    """Where ``matched`` comes from: the index and speculative entries, the gateway's memory of
    its decisions, or nowhere (the request is then not tokenized)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def rank(self, candidates: Sequence[Candidate], *, blocks: int) -> list[Candidate]:
        """Every candidate, best first."""
        jitter = {c.pod: self.rng.random() for c in candidates}
        return sorted(candidates, key=lambda c: (-self.value(c, blocks), c.load, jitter[c.pod]))

    @abstractmethod
    def value(self, candidate: Candidate, blocks: int) -> float:
        """How good the candidate is (higher first)."""


class KVLoadPolicy(Policy):
    name = "kv-load"
    source = "index"

    def __init__(self, rng: random.Random, *, alpha: float = DEFAULT_ALPHA) -> None:
        super().__init__(rng)
        if alpha < 0:
            raise ValueError("alpha must be >= 0")
        self.alpha = alpha

    def value(self, candidate: Candidate, blocks: int) -> float:
        return candidate.matched / max(blocks, 1) - self.alpha * candidate.load


class KVPolicy(Policy):
    name = "kv"
    source = "index"

    def value(self, candidate: Candidate, blocks: int) -> float:
        return candidate.matched


class ApproxPrefixPolicy(KVLoadPolicy):
    name = "approx-prefix"
    source = "memory"


class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def value(self, candidate: Candidate, blocks: int) -> float:
        return -candidate.load


class RandomPolicy(Policy):
    name = "random"

    def value(self, candidate: Candidate, blocks: int) -> float:
        return 0.0

    def rank(self, candidates: Sequence[Candidate], *, blocks: int) -> list[Candidate]:
        ranked = list(candidates)
        self.rng.shuffle(ranked)
        return ranked


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._turn = itertools.count()

    def value(self, candidate: Candidate, blocks: int) -> float:
        return 0.0

    def rank(self, candidates: Sequence[Candidate], *, blocks: int) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.pod)
        if not ordered:
            return []
        start = next(self._turn) % len(ordered)
        return ordered[start:] + ordered[:start]


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (KVLoadPolicy, KVPolicy, ApproxPrefixPolicy, LeastLoadedPolicy, RoundRobinPolicy, RandomPolicy)
}


def make_policy(name: str, *, rng: random.Random, alpha: float = DEFAULT_ALPHA) -> Policy:
    """The policy called ``name`` (a key of :data:`POLICIES`)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    if issubclass(cls, KVLoadPolicy):
        return cls(rng, alpha=alpha)
    return cls(rng)
