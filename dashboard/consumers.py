"""The dashboard's websocket: staff only, one JSON message a push interval.

Messages sent: first ``{"type": "history", ...}``: the charts' columns over the last
``DASHBOARD_HISTORY_SECONDS`` from the history ingest records in Redis (``ingest.history``; its
``step`` says their resolution), then every ``DASHBOARD_PUSH_SECONDS`` a ``{"type": "frame",
...}``: the fleet and its gateways (``/ws/dashboard/``) or one pod with its activity log
(``/ws/dashboard/pods/<pod>/``), with ``chart``: the columns of the points recorded since the
last message (every browser shows the same charts). The page may send ``{"history_seconds": n}``
(up to 24 hours) for the history of another span; anything else it sends is ignored. The
consumer also joins the group ingest processes send their snapshots to, and hands each snapshot
to this process's sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from dashboard import selectors
from dashboard.fleet import fleet_chart, pod_chart
from dashboard.sampler import FleetSampler, get_sampler
from kvindex.shared_stats import HISTORY_LEVELS, HISTORY_PODS, history_level

log = logging.getLogger(__name__)

FORBIDDEN = 4403
"""Close code for a connection without a staff session (refused before the handshake ends)."""


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """One open dashboard page: the fleet, or one pod when the route names it."""

    pod: str | None
    sampler: FleetSampler
    history_seconds: float
    _after = 0.0  # the start of the last history interval sent
    _pusher: asyncio.Task | None = None
    _joined = False

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_active and user.is_staff):
            await self.close(code=FORBIDDEN)
            return
        self.pod = self.scope["url_route"]["kwargs"].get("pod")
        self.sampler = get_sampler()
        self.history_seconds = settings.DASHBOARD_HISTORY_SECONDS
        if self.channel_layer is not None:
            await self.channel_layer.group_add(settings.KVCACHE_STATS_GROUP, self.channel_name)
            self._joined = True
        await self.accept()
        self._pusher = asyncio.create_task(self._push_forever())

    async def disconnect(self, code: int) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher
        if self._joined:
            await self.channel_layer.group_discard(settings.KVCACHE_STATS_GROUP, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs) -> None:
        """``{"history_seconds": n}`` is answered with the history of the last ``n`` seconds (60
        to 24 hours); anything else is ignored."""
        try:
            seconds = float(json.loads(text_data or "")["history_seconds"])
        except (ValueError, TypeError, KeyError):
            return
        if math.isfinite(seconds):
            self.history_seconds = min(max(seconds, 60.0), HISTORY_LEVELS[-1].seconds)
            await self.send_json(await database_sync_to_async(self._history)())

    async def ingest_snapshot(self, message: dict) -> None:
        """A group message from an ingest process's housekeeping: ``{"snapshot": {...}}``."""
        self.sampler.observe(message["snapshot"])

    async def _push_forever(self) -> None:
        await self.send_json(await database_sync_to_async(self._history)())
        while True:
            try:
                await self.send_json(await database_sync_to_async(self._frame)())
            except asyncio.CancelledError:
                raise
            except Exception:
                # A failed read (database, index) skips one push; the page keeps its numbers.
                log.exception("dashboard frame failed")
            await asyncio.sleep(settings.DASHBOARD_PUSH_SECONDS)

    def _history(self) -> dict:
        level = history_level(self.history_seconds)
        points = selectors.recorded_history(level, after=time.time() - self.history_seconds)
        self._after = points[-1]["t"] if points else time.time() - level.step
        span = {"type": "history", "seconds": self.history_seconds, "step": level.step}
        if self.pod is None:
            return {**span, **fleet_chart(points)}
        return {**span, "pod": self.pod, **pod_chart(points, self.pod), "log": self.sampler.pod_log(self.pod)}

    def _frame(self) -> dict:
        frame = self.sampler.frame()
        points = selectors.recorded_history(HISTORY_LEVELS[0], after=self._after)
        if points:
            self._after = points[-1]["t"]
        if self.pod is None:
            # Every pod's blocks: a pod entering the chart's top brings the points since along.
            return {"type": "frame", **frame, "chart": fleet_chart(points, pods=HISTORY_PODS)}
        row = next((r for r in frame["pods"] if r["pod"] == self.pod), None)
        return {
            "type": "frame",
            "at": frame["at"],
            "totals": frame["totals"],
            "pod": row,
            "log": self.sampler.pod_log(self.pod),
            "chart": pod_chart(points, self.pod),
        }
