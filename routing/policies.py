"""Routing policies: the order in which the router (the gateway, or the EPP for Envoy) tries the
pods for one request.

Each candidate pod comes with ``matched`` (leading blocks of the request it holds, as the
policy's source of prefix knowledge says), ``load`` (requests in flight on it) and ``queued``
(the part of its load beyond its batch size: requests that wait, see ``routing.load``). A policy
ranks every candidate, best first; the gateway sends the request to the first and, on a connect
error or a 5xx before the first byte, to the next.

* ``kv-load`` (default): ``matched / blocks - alpha * (queued + RUNNING_WEIGHT * running)``:
  a whole prefix hit is worth ``1 / alpha`` waiting requests (0.25: four); a request running in
  the pod's batch costs a tenth of a waiting one (it slows the batch, it does not wait). The index
  (KV events) plus speculative entries. Why waiting and not in-flight requests: in the routing
  benchmark's capacity workload, charging every in-flight request moved groups off the pods that
  held them while those pods still had free batch slots, so prefixes were duplicated and evicted
  (hit rate 35.9% against 38.5% for ``kv``, TTFT p90 2.5 s against 1.8 s at 9 QPS,
  docs/performance.md).
* ``kv-ttft``: the lowest expected time to first token: the wait for a batch slot (requests
  queued before it times how long a request holds a slot, over the pod's slots), plus the prefill
  ahead of it on the pod and its own uncached blocks times the time a block of prefill takes,
  plus what each request running in the batch adds, all learned from the gateway's own requests
  (``routing.load.ServiceTimes``). A hit is worth
  the prefill it saves, in seconds, not a share of the prompt: a short prompt's hit is not worth
  queueing for, a long one's may be (as Dynamo's router weighs prefill and decode blocks).
* ``kv``: the most blocks matched; load breaks ties.
* ``approx-prefix``: ``kv-load`` on the gateway's own memory of where it sent prefixes, no KV
  events (what routers without them do): the baseline that shows what the events are worth.
* ``least-loaded``, ``round-robin``, ``random``: no prefix knowledge.

Ties go to the least loaded, then to the request's *home* (given its keys): the pod that wins a
rendezvous hash of the pod ids with the request's first ``AFFINITY_BLOCKS`` blocks, so that gateway
replicas (which cannot see each other's speculative entries) send a prefix no pod holds to the
same pod when their views of the load agree; without keys, to the seeded ``random.Random``.
Homes only break exact ties: preferring the home over a pod a few running requests lighter (a
margin of half a waiting request) made ``kv-load`` worse on the benchmark's capacity workload
(TTFT p90 4.0 s against 2.0 s at 9 QPS), as 48 groups hashed onto 8 pods are not spread evenly.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import xxhash

from kvindex.keys import BlockKey

DEFAULT_ALPHA = 0.25
AFFINITY_BLOCKS = 8
"""A request's home is chosen by its first 8 blocks (128 tokens of 16): requests that share them
share a home."""

Source = Literal["index", "memory", "none"]


RUNNING_WEIGHT = 0.1
"""What a request running in a pod's batch costs ``kv-load``, against one waiting (1)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    pod: str
    matched: int = 0
    load: float = 0.0
    queued: float | None = None
    """Of ``load``, the requests beyond the pod's batch size; None: unknown, all of it."""
    wait: float = 0.0
    """Seconds until a batch slot is expected to be free for this request (``kv-ttft``)."""
    prefill_ahead: float = 0.0
    """Blocks of prefill the gateway's requests still have queued on the pod (``kv-ttft``)."""
    block_seconds: float = 0.0
    """Time to first token per block of prefill, as learned (``kv-ttft``)."""
    running_seconds: float = 0.0
    """Time to first token per request running in the batch, as learned (``kv-ttft``)."""

    def expected_ttft(self, blocks: int) -> float:
        """Seconds to the first token here, less what is the same on every pod."""
        prefill = (self.prefill_ahead + max(0, blocks - self.matched)) * self.block_seconds
        running = self.load if self.queued is None else self.load - min(self.queued, self.load)
        return self.wait + prefill + running * self.running_seconds

    @property
    def cost(self) -> float:
        """Load in waiting requests: queued ones count 1, running ones ``RUNNING_WEIGHT``."""
        queued = self.load if self.queued is None else min(self.queued, self.load)
        return queued + RUNNING_WEIGHT * (self.load - queued)


class Policy(ABC):
    name: ClassVar[str]
    source: ClassVar[Source] = "none"
    """Where ``matched`` comes from: the index and speculative entries, the gateway's memory of
    its decisions, or nowhere (the request is then not tokenized)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def rank(
        self, candidates: Sequence[Candidate], *, blocks: int, affinity: int | None = None
    ) -> list[Candidate]:
        """Every candidate, best first; ``affinity`` (:func:`affinity_of` the request's keys)
        orders ties by the request's home, else they are shuffled."""
        if affinity is None:
            order = {c.pod: self.rng.random() for c in candidates}
        else:
            order = {c.pod: -home_score(c.pod, affinity) for c in candidates}
        return sorted(candidates, key=lambda c: (-self.value(c, blocks), c.load, order[c.pod]))

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
        return candidate.matched / max(blocks, 1) - self.alpha * candidate.cost


class KVTTFTPolicy(Policy):
    name = "kv-ttft"
    source = "index"

    def value(self, candidate: Candidate, blocks: int) -> float:
        return -candidate.expected_ttft(blocks)


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


def affinity_of(keys: Sequence[BlockKey]) -> int | None:
    """What picks a request's home: the key of its ``AFFINITY_BLOCKS``-th block (which names the
    whole prefix up to it), or of its last one when it is shorter; None without blocks."""
    if not keys:
        return None
    return keys[min(len(keys), AFFINITY_BLOCKS) - 1]


def home_score(pod: str, affinity: int) -> int:
    """Rendezvous hashing: the pod with the highest score is the home. Stable across processes
    (unlike ``hash()``), so every gateway replica picks the same home."""
    return xxhash.xxh64_intdigest(pod.encode(), seed=affinity & 0xFFFF_FFFF_FFFF_FFFF)


class RandomPolicy(Policy):
    name = "random"

    def value(self, candidate: Candidate, blocks: int) -> float:
        return 0.0

    def rank(
        self, candidates: Sequence[Candidate], *, blocks: int, affinity: int | None = None
    ) -> list[Candidate]:
        ranked = list(candidates)
        self.rng.shuffle(ranked)
        return ranked


MAX_TURNS = 1024
"""Sets of candidates whose turns round-robin keeps (subset hints make more)."""


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._turns: dict[tuple[str, ...], itertools.count] = {}

    def value(self, candidate: Candidate, blocks: int) -> float:
        return 0.0

    def rank(
        self, candidates: Sequence[Candidate], *, blocks: int, affinity: int | None = None
    ) -> list[Candidate]:
        """The candidates in name order, starting one further each time: each set of candidates
        has its turn of its own (a P/D request ranks its prefill pods and its decode pods: one
        turn for both would skip every other pod of each)."""
        ordered = sorted(candidates, key=lambda c: c.pod)
        if not ordered:
            return []
        pods = tuple(c.pod for c in ordered)
        turn = self._turns.get(pods)
        if turn is None:
            if len(self._turns) >= MAX_TURNS:  # the fleet changed this often: start again
                self._turns.clear()
            turn = self._turns[pods] = itertools.count()
        start = next(turn) % len(ordered)
        return ordered[start:] + ordered[:start]


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        KVLoadPolicy,
        KVTTFTPolicy,
        KVPolicy,
        ApproxPrefixPolicy,
        LeastLoadedPolicy,
        RoundRobinPolicy,
        RandomPolicy,
    )
}


def make_policy(name: str, *, rng: random.Random, alpha: float = DEFAULT_ALPHA) -> Policy:
    """The policy called ``name`` (a key of :data:`POLICIES`)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    if issubclass(cls, KVLoadPolicy):
        return cls(rng, alpha=alpha)
    return cls(rng)
