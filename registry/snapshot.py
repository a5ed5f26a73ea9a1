"""The registry snapshot a process scores with, kept fresh without ever making a request wait
on the database (after the first load).

``ConfigSource`` holds the latest ``ServiceConfig`` and how to load a new one. The loaders come
in as arguments (the Django shell reads the registry tables), so the code that scores, the fast
path included, never imports Django:

* ``get()`` (sync callers: views, commands, ingest) loads inline when there is no snapshot yet,
  when it was invalidated, or when it is older than ``max_age``;
* ``aget()`` (the event loop): when the snapshot is older than ``max_age``, the first request to
  notice starts a reload and waits for it at most ``refresh_wait`` seconds (time enough for an
  idle database), then goes on with the stale snapshot while the reload finishes in the
  background; every request until the reload lands keeps the stale one. Only a missing or
  invalidated snapshot is awaited in full.

So a slow database costs no request more than ``refresh_wait``: before, the one request per
``max_age`` that reloaded waited for the whole load plus a turn of a busy event loop.

A write through this process (``invalidate``) is seen by its next request; other processes see it
within ``max_age`` (plus one request).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from registry.config import ServiceConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_AGE_SECONDS = 2.0
DEFAULT_REFRESH_WAIT_SECONDS = 0.02


class ConfigSource:
    """This process's registry snapshot (thread-safe; ``aget`` from any event loop)."""

    def __init__(
        self,
        load: Callable[[], ServiceConfig],
        *,
        load_async: Callable[[], Awaitable[ServiceConfig]] | None = None,
        max_age: float = DEFAULT_MAX_AGE_SECONDS,
        refresh_wait: float = DEFAULT_REFRESH_WAIT_SECONDS,
    ) -> None:
        self._load = load
        self._load_async = load_async
        self.max_age = max_age
        self.refresh_wait = refresh_wait
        self._lock = threading.Lock()  # guards the value, its age and the generation together
        self._value: ServiceConfig | None = None
        self._loaded_at = 0.0
        self._generation = 0  # bumped by invalidate: a load started before it must not win
        self._refresh: asyncio.Future[ServiceConfig] | None = None  # the background reload, if any

    def current(self) -> ServiceConfig | None:
        """The latest snapshot, however old; ``None`` before the first load."""
        return self._value

    def get(self) -> ServiceConfig:
        """A snapshot at most ``max_age`` old (loaded inline when needed)."""
        value = self._value
        if value is not None and time.monotonic() - self._loaded_at < self.max_age:
            return value
        generation = self._generation
        loaded = self._load()
        self._store(loaded, generation)
        return loaded

    async def aget(self) -> ServiceConfig:
        """The snapshot for a request on an event loop (see the module docstring)."""
        value = self._value
        if value is None:
            return await self._reload()
        if time.monotonic() - self._loaded_at < self.max_age or self._refreshing():
            return value
        refresh = self._refresh = asyncio.ensure_future(self._reload())
        refresh.add_done_callback(self._refreshed)
        try:
            return await asyncio.wait_for(asyncio.shield(refresh), self.refresh_wait)
        except Exception:  # not loaded yet (it goes on), or failed (``_refreshed`` logs it)
            return value

    def _refreshing(self) -> bool:
        """A reload is under way (one started on an event loop since closed is not)."""
        refresh = self._refresh
        return refresh is not None and not refresh.done() and not refresh.get_loop().is_closed()

    def _refreshed(self, refresh: asyncio.Future[ServiceConfig]) -> None:
        if self._refresh is refresh:
            self._refresh = None
        if not refresh.cancelled() and refresh.exception() is not None:
            # The stale snapshot keeps serving; the next try comes after another max_age.
            logger.warning("registry snapshot reload failed", exc_info=refresh.exception())
            with self._lock:
                self._loaded_at = time.monotonic()

    def invalidate(self) -> None:
        """Forget the snapshot: the next ``get``/``aget`` loads a fresh one."""
        with self._lock:
            self._value = None
            self._generation += 1

    async def _reload(self) -> ServiceConfig:
        generation = self._generation
        loaded = await self._run_load()
        self._store(loaded, generation)
        return loaded

    async def _run_load(self) -> ServiceConfig:
        if self._load_async is not None:
            return await self._load_async()
        return await asyncio.get_running_loop().run_in_executor(None, self._load)

    def _store(self, value: ServiceConfig, generation: int) -> None:
        with self._lock:
            if generation == self._generation:  # else an invalidation came after the load began
                self._value = value
                self._loaded_at = time.monotonic()
