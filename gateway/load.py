"""How busy each pod is: the gateway's own requests in flight, plus what the pod reports.

The gateway knows its requests at once; a pod's ``/metrics`` (``vllm:num_requests_running`` and
``vllm:num_requests_waiting``) also counts other clients' (another gateway replica, clients that
skip the gateway) but is a scrape old. So a pod's load is ours now plus what its last scrape
showed beyond ours then: ``in_flight + max(0, reported - in_flight_at_scrape)``.

Not all of that load costs the same: an engine runs up to ``max_num_seqs`` requests in one batch
(each slows the batch a little) and queues the rest (each waits for a whole request to finish).
The tracker learns a pod's batch size as the most requests it was ever seen running at once
(``slots``) and splits its load into ``running`` (up to that) and ``queued`` (beyond it). A pod
never scraped has no slots known: all its load counts as queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping

from registry.liveness import requests_by_state

log = logging.getLogger(__name__)

SCRAPE_SECONDS = 1.0
SCRAPE_TIMEOUT_SECONDS = 0.5
REPORTED_FOR_SECONDS = 5.0
"""A scrape older than this no longer counts (the pod stopped answering its metrics)."""


class LoadTracker:
    def __init__(self) -> None:
        self.in_flight: dict[str, int] = defaultdict(int)
        self._reported: dict[str, tuple[float, int, float]] = {}  # pod -> (reported, ours then, at)
        self.slots: dict[str, float] = {}
        """Per pod, the most requests it was seen running at once (its batch size, as learned)."""

    def start(self, pod: str) -> None:
        self.in_flight[pod] += 1

    def finish(self, pod: str) -> None:
        self.in_flight[pod] -= 1

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
        self, fetch: Callable[[str], Awaitable[bytes | None]], addresses: Callable[[], Mapping[str, str]]
    ) -> None:
        """Every ``SCRAPE_SECONDS``: every pod's ``/metrics`` (``fetch(address)``: its text, None when
        it did not answer 200 within ``SCRAPE_TIMEOUT_SECONDS``), concurrently (until cancelled)."""
        while True:
            targets = dict(addresses())
            if targets:
                await asyncio.gather(*(self._scrape(fetch, pod, address) for pod, address in targets.items()))
            await asyncio.sleep(SCRAPE_SECONDS)

    async def _scrape(self, fetch: Callable[[str], Awaitable[bytes | None]], pod: str, address: str) -> None:
        text = await fetch(address)
        if text is not None:  # else its load is ours alone, until the scrape goes stale
            self.observe(pod, *requests_by_state(text))
