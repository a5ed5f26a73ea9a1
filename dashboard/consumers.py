"""The dashboard's websocket: staff only, one JSON message a push interval, no client input.

Messages sent: first ``{"type": "history", ...}`` (the charts' columns so far), then every
``DASHBOARD_PUSH_SECONDS`` a ``{"type": "frame", ...}``: the fleet and its gateways
(``/ws/dashboard/``) or one pod with its activity log (``/ws/dashboard/pods/<pod>/``). The
consumer also joins the group ingest processes send their snapshots to, and hands each snapshot
to this process's sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from dashboard.sampler import FleetSampler, get_sampler

log = logging.getLogger(__name__)

FORBIDDEN = 4403
"""Close code for a connection without a staff session (refused before the handshake ends)."""


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """One open dashboard page: the fleet, or one pod when the route names it."""

    pod: str | None
    sampler: FleetSampler
    _pusher: asyncio.Task | None = None
    _joined = False

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_active and user.is_staff):
            await self.close(code=FORBIDDEN)
            return
        self.pod = self.scope["url_route"]["kwargs"].get("pod")
        self.sampler = get_sampler()
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
        """The page sends nothing; anything it does send is ignored."""

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
        if self.pod is None:
            return {"type": "history", **self.sampler.fleet_history()}
        return {
            "type": "history",
            "pod": self.pod,
            **self.sampler.pod_history(self.pod),
            "log": self.sampler.pod_log(self.pod),
        }

    def _frame(self) -> dict:
        frame = self.sampler.frame()
        if self.pod is None:
            return {"type": "frame", **frame}
        row = next((r for r in frame["pods"] if r["pod"] == self.pod), None)
        return {
            "type": "frame",
            "at": frame["at"],
            "totals": frame["totals"],
            "pod": row,
            "log": self.sampler.pod_log(self.pod),
        }
