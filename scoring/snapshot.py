"""The registry snapshot a process scores with, kept fresh without ever making a request wait
on the database (after the first load).

``ConfigSource`` holds the latest ``ServiceConfig`` and how to load a new one. The loaders come
in as arguments (the Django shell reads the registry tables), so the code that scores, the fast
path included, never imports Django:

* ``get()`` (sync callers: views, commands, ingest) loads inline when there is no snapshot yet,
  when it was invalidated, or when it is older than ``max_age``;
* ``aget()`` (the event loop): when the snapshot is missing, invalidated or older than
  ``max_age``, the first request to notice loads it (off the loop) while every concurrent request
  goes on with the stale one: one request per ``max_age`` and process waits for the database.

A write through this process (``invalidate``) is seen by its next request; other processes see it
within ``max_age`` (plus one request).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from scoring.config import ServiceConfig

DEFAULT_MAX_AGE_SECONDS = 2.0


class ConfigSource:
    """This process's registry snapshot (thread-safe; ``aget`` from any event loop)."""

    def __init__(
        self,
        load: Callable[[], ServiceConfig],
        *,
        load_async: Callable[[], Awaitable[ServiceConfig]] | None = None,
        max_age: float = DEFAULT_MAX_AGE_SECONDS,
    ) -> None:
        self._load = load
        self._load_async = load_async
        self.max_age = max_age
        self._lock = threading.Lock()  # guards the value, its age and the generation together
        self._value: ServiceConfig | None = None
        self._loaded_at = 0.0
        self._generation = 0  # bumped by invalidate: a load started before it must not win
        self._loading = False  # an aget() is loading: the others keep the snapshot they have

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
        if value is not None and (self._loading or time.monotonic() - self._loaded_at < self.max_age):
            return value
        self._loading = True
        try:
            return await self._reload()
        except Exception:
            if value is None:
                raise
            return value  # the stale snapshot keeps serving; the next request tries again
        finally:
            self._loading = False

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
