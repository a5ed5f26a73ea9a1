"""A simulated fleet served from a background thread's event loop, for tests that put a router
(a peer, Dynamo) in front of pods in this process."""

from __future__ import annotations

import asyncio
import threading

from simulator.fleet import Fleet, FleetConfig
from simulator.pod import PodTokenizer


class ThreadedFleet:
    """The pods of ``config`` (``base_port`` 0: free loopback ports), started on a thread's loop;
    ``urls`` their base URLs. ``stop`` ends them and the thread."""

    def __init__(self, config: FleetConfig, tokenizer: PodTokenizer) -> None:
        self.fleet = Fleet(config, tokenizer=tokenizer, graceful_timeout=0.5)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fleet.start(), self.loop).result(30)
        self.urls = [p.url for p in self.fleet.pods]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.fleet.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
