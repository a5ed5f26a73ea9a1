"""The registry snapshot source: fresh enough, and no request waits for a refresh."""

from __future__ import annotations

import asyncio
import threading
import time

from registry.config import ServiceConfig
from registry.snapshot import ConfigSource


class Registry:
    """A loader whose seed is the number of loads, and which can be held mid-load."""

    def __init__(self) -> None:
        self.loads = 0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def load(self) -> ServiceConfig:
        self.entered.set()
        self.gate.wait(5)
        self.loads += 1
        return ServiceConfig(seed=str(self.loads))


def test_get_loads_once_then_again_after_max_age_or_invalidation():
    registry = Registry()
    source = ConfigSource(registry.load, max_age=60)
    assert source.current() is None
    assert source.get().seed == "1"
    assert source.get().seed == "1"
    source.invalidate()
    assert source.get().seed == "2"
    source.max_age = 0
    assert source.get().seed == "3"


def test_no_request_waits_for_a_refresh_and_one_reload_runs_at_a_time():
    registry = Registry()
    source = ConfigSource(registry.load, max_age=0, refresh_wait=0.05)
    source.get()
    registry.gate.clear()
    registry.entered.clear()

    async def scenario() -> tuple[list[str], str]:
        # The first request past max_age starts the reload, waits refresh_wait for it and goes on
        # with the stale snapshot, like the others (the loader is held at its gate all along).
        started = time.monotonic()
        during = [(await asyncio.wait_for(source.aget(), 1)).seed for _ in range(6)]
        assert time.monotonic() - started < 0.5
        assert registry.entered.wait(5)
        registry.gate.set()
        while source.current().seed == "1":
            await asyncio.sleep(0.01)
        source.max_age = 60
        return during, (await source.aget()).seed

    during, after = asyncio.run(scenario())
    assert during == ["1"] * 6
    assert after == "2"
    assert registry.loads == 2  # one reload for the six stale requests


def test_a_refresh_that_lands_within_refresh_wait_serves_the_request_that_started_it():
    registry = Registry()
    source = ConfigSource(registry.load, max_age=0, refresh_wait=5)
    source.get()
    assert asyncio.run(source.aget()).seed == "2"


def test_a_missing_snapshot_is_awaited_and_a_failed_refresh_keeps_the_stale_one():
    registry = Registry()
    source = ConfigSource(registry.load, max_age=0.2)

    async def scenario() -> list[str]:
        first = (await source.aget()).seed  # nothing to serve yet: this one waits
        registry.load = _failing  # the database goes away
        await asyncio.sleep(0.25)
        stale = (await source.aget()).seed
        await asyncio.sleep(0.05)  # the failed reload lands; the next try waits another max_age
        again = (await source.aget()).seed
        return [first, stale, again]

    source._load = lambda: registry.load()
    assert asyncio.run(scenario()) == ["1", "1", "1"]
    assert source.current().seed == "1"


def _failing() -> ServiceConfig:
    raise ConnectionError("database unreachable")


def test_a_load_that_began_before_an_invalidation_does_not_win():
    registry = Registry()
    source = ConfigSource(registry.load, max_age=60)
    registry.gate.clear()
    loading = threading.Thread(target=source.get)
    loading.start()
    assert registry.entered.wait(5)
    source.invalidate()  # a write lands while the load is under way
    registry.gate.set()
    loading.join()
    assert source.current() is None  # the next caller loads again
    assert source.get().seed == "2"
