"""How busy each pod is: the requests this router sent there in flight, plus what the pod reports.

"The gateway" below is whichever front runs the routing core: the gateway or the EPP.

The gateway knows its requests at once; a pod's ``/metrics`` (``vllm:num_requests_running`` and
``vllm:num_requests_waiting``) also counts other clients' (another gateway replica, clients that
skip the gateway) but is a scrape old. So a pod's load is ours now plus what its last scrape
showed beyond ours then: ``in_flight + max(0, reported - in_flight_at_scrape)``.

Not all of that load costs the same: an engine runs up to ``max_num_seqs`` requests in one batch
(each slows the batch a little) and queues the rest (each waits for a whole request to finish).
The tracker learns a pod's batch size as the most requests it was ever seen running at once
(``slots``) and splits its load into ``running`` (up to that) and ``queued`` (beyond it). A pod
never scraped has no slots known: all its load counts as queued.

For ``kv-ttft`` the tracker also keeps, per pod, the prefill work the gateway's own requests have
queued there (the uncached blocks of those that have not yet answered their first bytes), and
learns from those requests how fast the pods are (:class:`ServiceTimes`): how long a request holds
a batch slot, and what a block of prefill costs in time to first token.

Scrapes are untrusted input, one pod at a time: each is bounded in time (``SCRAPE_TIMEOUT_SECONDS``
for the whole answer) and size (``registry.pod_metrics``), and whatever one pod answers (nothing,
a malformed count, an endless body) costs only that pod its reported load, never another pod's
scrape nor the scraper: failures are counted by reason (``kvcache_gateway_scrape_failures_total``, the EPP's
``kvcache_epp_scrape_failures_total``)
and logged when a pod's reason changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from registry.pod_metrics import PodMetricsError, requests_by_state
from routing.metrics import RoutingMetrics

log = logging.getLogger(__name__)

SCRAPE_SECONDS = 1.0
SCRAPE_TIMEOUT_SECONDS = 0.5
REPORTED_FOR_SECONDS = 5.0
"""A scrape older than this no longer counts (the pod stopped answering its metrics)."""


DEFAULT_REQUEST_SECONDS = 1.0
"""How long a request holds a batch slot, until the gateway has seen some finish."""
DEFAULT_BLOCK_SECONDS = 0.005
"""Time to first token per block of prefill, until the gateway has seen enough first tokens
(16 tokens at 0.3 ms each: a small model on a small accelerator)."""
HALF_LIFE_REQUESTS = 64
"""The estimates forget at this pace: an observation 64 requests old weighs half a new one."""
MIN_FIT_WEIGHT = 8.0
"""Observations (decayed) before the fitted prefill cost replaces the default."""


class ServiceTimes:
    """The pods' speed as the gateway's own requests show it (fleet-wide, recent requests weigh
    most). ``request_seconds``: the mean time a request holds a batch slot (sent to finished).
    ``block_seconds`` and ``running_seconds``: a least-squares fit of time to first token as
    ``a + block_seconds * blocks + running_seconds * running``, ``blocks`` the prefill ahead of the
    request on its pod (its own included), ``running`` the requests in the pod's batch then (each
    slows the batch, so the prefill too), fitted on requests that found a free slot (a queued
    one's time to first token is mostly its wait). Never negative; defaults until enough seen."""

    def __init__(self) -> None:
        self._decay = 0.5 ** (1 / HALF_LIFE_REQUESTS)
        self._requests = [0.0, 0.0]  # weight, weighted seconds
        # weight, and the sums of x1, x2, y, x1 x1, x2 x2, x1 x2, x1 y, x2 y
        self._sums = [0.0] * 9
        self._fitted: tuple[float, float] | None = None

    def finished(self, seconds: float) -> None:
        w, total = self._requests
        self._requests = [w * self._decay + 1, total * self._decay + seconds]

    def first_token(self, blocks: float, running: float, seconds: float) -> None:
        terms = (1.0, blocks, running, seconds, blocks * blocks, running * running, blocks * running,
                 blocks * seconds, running * seconds)  # fmt: skip
        d = self._decay
        self._sums = [total * d + term for total, term in zip(self._sums, terms, strict=True)]
        self._fitted = None

    @property
    def first_tokens_seen(self) -> float:
        """How many first tokens the fit rests on (decayed: recent ones count 1, older less)."""
        return self._sums[0]

    @property
    def request_seconds(self) -> float:
        w, total = self._requests
        return total / w if w >= 1 else DEFAULT_REQUEST_SECONDS

    @property
    def block_seconds(self) -> float:
        return self._fit()[0]

    @property
    def running_seconds(self) -> float:
        return self._fit()[1]

    def _fit(self) -> tuple[float, float]:
        if self._fitted is None:
            self._fitted = self._solve()
        return self._fitted

    def _solve(self) -> tuple[float, float]:
        n, s1, s2, sy, s11, s22, s12, s1y, s2y = self._sums
        if n < MIN_FIT_WEIGHT:
            return DEFAULT_BLOCK_SECONDS, 0.0
        # Centred (co)variances, times n.
        c11, c22, c12 = n * s11 - s1 * s1, n * s22 - s2 * s2, n * s12 - s1 * s2
        c1y, c2y = n * s1y - s1 * sy, n * s2y - s2 * sy
        tiny = 1e-9
        if c11 <= tiny * max(1.0, n * s11):  # every request the same size: no slope to fit
            return DEFAULT_BLOCK_SECONDS, max(0.0, c2y / c22) if c22 > tiny * max(1.0, n * s22) else 0.0
        det = c11 * c22 - c12 * c12
        if c22 <= tiny * max(1.0, n * s22) or det <= tiny * c11 * c22:  # no spread in the batch
            return max(0.0, c1y / c11), 0.0
        block = (c1y * c22 - c2y * c12) / det
        running = (c2y * c11 - c1y * c12) / det
        if block < 0 or running < 0:  # a negative part is noise: fit the other alone
            return (max(0.0, c1y / c11), 0.0) if running < 0 else (0.0, max(0.0, c2y / c22))
        return block, running


@dataclass(slots=True)
class Dispatch:
    """One request sent to ``pod``: its ``prefill_blocks`` (blocks the pod was expected to
    compute), the prefill ``ahead`` of it then (its own included), the requests ``running`` in the
    pod's batch then, when it was sent, whether it found a free batch slot, and whether its first
    bytes came."""

    pod: str
    prefill_blocks: float
    ahead: float
    running: float
    sent: float
    free_slot: bool
    answered: bool = False


class LoadTracker:
    def __init__(self, metrics: RoutingMetrics | None = None) -> None:
        self.metrics = metrics or RoutingMetrics.unregistered()
        self.in_flight: dict[str, int] = defaultdict(int)
        self.prefilling: dict[str, float] = defaultdict(float)
        """Per pod, the blocks of prefill of the gateway's requests there not yet answered."""
        self.times = ServiceTimes()
        self._reported: dict[str, tuple[float, int, float]] = {}  # pod -> (reported, ours then, at)
        self.slots: dict[str, float] = {}
        """Per pod, the most requests it was seen running at once (its batch size, as learned)."""
        self.problems: dict[str, str] = {}
        """Per pod whose last scrape failed, why (a reason of ``registry.pod_metrics.READ_FAILURES``)."""

    def start(
        self, pod: str, *, prefill_blocks: float = 0.0, learn: bool = True, now: float | None = None
    ) -> Dispatch:
        """A request sent to ``pod``, expected to compute ``prefill_blocks`` blocks there;
        ``learn`` False when its first bytes will not mark its first token (an answer that is
        not streamed comes whole)."""
        now = time.monotonic() if now is None else now
        load = self.of(pod, now=now)
        free = learn and pod in self.slots and load < self.slots[pod]
        self.in_flight[pod] += 1
        self.prefilling[pod] += prefill_blocks
        return Dispatch(pod, prefill_blocks, self.prefilling[pod], load, now, free)

    def answered(self, dispatch: Dispatch, *, now: float | None = None) -> None:
        """The request's first bytes came: its prefill is done (learned from when it had a slot)."""
        if dispatch.answered:
            return
        dispatch.answered = True
        self.prefilling[dispatch.pod] = max(0.0, self.prefilling[dispatch.pod] - dispatch.prefill_blocks)
        if dispatch.free_slot:
            seconds = (time.monotonic() if now is None else now) - dispatch.sent
            self.times.first_token(dispatch.ahead, dispatch.running, seconds)

    def finish(self, dispatch: Dispatch, *, now: float | None = None) -> None:
        """The request is over (answered whole, failed or abandoned)."""
        self.in_flight[dispatch.pod] -= 1
        if not dispatch.answered:  # it never prefilled here: its work is no longer ahead of anyone
            dispatch.answered = True
            self.prefilling[dispatch.pod] = max(0.0, self.prefilling[dispatch.pod] - dispatch.prefill_blocks)
        else:
            self.times.finished((time.monotonic() if now is None else now) - dispatch.sent)

    def wait_seconds(self, pod: str, load: float) -> float:
        """Expected wait for a batch slot on ``pod`` carrying ``load``: none while its batch has
        room, else a slot's time per request queued before this one (and this one), shared by its
        slots (an unknown batch: one slot)."""
        slots = self.slots.get(pod, 0.0)
        if slots and load < slots:
            return 0.0
        return (load - slots + 1) * self.times.request_seconds / max(slots, 1.0)

    def of(self, pod: str, *, now: float | None = None) -> float:
        ours = self.in_flight.get(pod, 0)
        seen = self._reported.get(pod)
        if seen is None:
            return float(ours)
        reported, ours_then, at = seen
        if (now if now is not None else time.monotonic()) - at > REPORTED_FOR_SECONDS:
            return float(ours)
        return ours + max(0.0, reported - ours_then)

    def queued(self, pod: str, load: float) -> float:
        """The part of ``load`` (the pod's, from :meth:`of`) beyond its known batch size."""
        return max(0.0, load - self.slots.get(pod, 0.0))

    def observe(self, pod: str, running: float, waiting: float = 0.0, *, now: float | None = None) -> None:
        """The pod's own counts of running and waiting requests, as just scraped."""
        self._reported[pod] = (
            running + waiting,
            self.in_flight.get(pod, 0),
            now if now is not None else time.monotonic(),
        )
        if running > self.slots.get(pod, 0.0):
            self.slots[pod] = running

    async def scrape_forever(
        self, fetch: Callable[[str], Awaitable[bytes]], addresses: Callable[[], Mapping[str, str]]
    ) -> None:
        """Every ``SCRAPE_SECONDS``: every pod's ``/metrics`` (``fetch(address)``: its body, or
        :class:`PodMetricsError` when it did not answer 200), concurrently (until cancelled). A
        round takes at most ``SCRAPE_TIMEOUT_SECONDS``, whatever the pods do, and no pod's failure
        ends it or the next."""
        while True:
            started = time.monotonic()
            targets = dict(addresses())
            if targets:
                await asyncio.gather(*(self._scrape(fetch, pod, address) for pod, address in targets.items()))
            for pod in [p for p in self.problems if p not in targets]:
                del self.problems[pod]
            await asyncio.sleep(max(0.0, SCRAPE_SECONDS - (time.monotonic() - started)))

    async def _scrape(self, fetch: Callable[[str], Awaitable[bytes]], pod: str, address: str) -> None:
        """One pod's scrape, observed, or its failure counted (never raises but when cancelled):
        its load is then ours alone, until the last good scrape goes stale."""
        self.metrics.scrapes.inc()
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_SECONDS):
                body = await fetch(address)
            running, waiting = requests_by_state(body)
        except PodMetricsError as error:
            self._failed(pod, error)
        except TimeoutError:
            self._failed(pod, PodMetricsError("timeout", f"no whole answer within {SCRAPE_TIMEOUT_SECONDS}s"))
        except Exception as error:  # a broken answer, an address that is not host:port: this pod's alone
            self._failed(pod, PodMetricsError("error", f"{type(error).__name__}: {error}"))
        else:
            self.observe(pod, running, waiting)
            if self.problems.pop(pod, None) is not None:
                log.info("pod %s: its /metrics gives request counts again", pod)

    def _failed(self, pod: str, error: PodMetricsError) -> None:
        self.metrics.scrape_failures.labels(error.reason).inc()
        if self.problems.get(pod) != error.reason:  # one line when a pod goes wrong, not one a second
            log.warning("pod %s: no load from its /metrics (%s: %s)", pod, error.reason, error)
            self.problems[pod] = error.reason
