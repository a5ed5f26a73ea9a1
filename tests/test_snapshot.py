"""The registry snapshot source: fresh enough, never a database wait for more than one request."""

from __future__ import annotations

import asyncio
import threading

from scoring.config import ServiceConfig
from scoring.snapshot import ConfigSource


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


def test_while_one_request_reloads_the_others_keep_the_stale_snapshot():
    registry = Registry()
    source = ConfigSource(registry.load, max_age=0)
    source.get()
    registry.gate.clear()

    async def scenario() -> tuple[str, list[str]]:
        first = asyncio.ensure_future(source.aget())
        await asyncio.sleep(0.05)  # it is now loading, held at the gate
        others = [(await source.aget()).seed for _ in range(5)]
        registry.gate.set()
        return (await first).seed, others

    reloaded, others = asyncio.run(scenario())
    assert others == ["1"] * 5
    assert reloaded == "2"
    assert registry.loads == 2


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
