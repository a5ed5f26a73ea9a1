"""How busy each pod is: the gateway's own requests in flight, plus what the pod reports.

The gateway knows its requests at once; a pod's ``/metrics`` (``vllm:num_requests_running`` and
``vllm:num_requests_waiting``) also counts other clients' (another gateway replica, clients that
skip the gateway) but is a scrape old. So a pod's load is ours now plus what its last scrape
showed beyond ours then: ``in_flight + max(0, reported - in_flight_at_scrape)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping

import httpx

from scoring.liveness import requests_in

log = logging.getLogger(__name__)

SCRAPE_SECONDS = 1.0
SCRAPE_TIMEOUT_SECONDS = 0.5
REPORTED_FOR_SECONDS = 5.0
"""A scrape older than this no longer counts (the pod stopped answering its metrics)."""


class LoadTracker:
    def __init__(self) -> None:
        self.in_flight: dict[str, int] = defaultdict(int)
        self._reported: dict[str, tuple[float, int, float]] = {}  # pod -> (reported, ours then, at)

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

    def observe(self, pod: str, reported: float, *, now: float | None = None) -> None:
        """The pod's own count of running + waiting requests, as just scraped."""
        self._reported[pod] = (
            reported,
            self.in_flight.get(pod, 0),
            now if now is not None else time.monotonic(),
        )

    async def scrape_forever(
        self, client: httpx.AsyncClient, addresses: Callable[[], Mapping[str, str]]
    ) -> None:
        """Every ``SCRAPE_SECONDS``: every pod's ``/metrics``, concurrently (until cancelled)."""
        while True:
            targets = dict(addresses())
            if targets:
                await asyncio.gather(
                    *(self._scrape(client, pod, address) for pod, address in targets.items())
                )
            await asyncio.sleep(SCRAPE_SECONDS)

    async def _scrape(self, client: httpx.AsyncClient, pod: str, address: str) -> None:
        try:
            response = await client.get(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_SECONDS)
            if response.status_code == 200:
                self.observe(pod, requests_in(response.content))
        except httpx.HTTPError:
            pass  # its load is then ours alone, until the scrape goes stale
