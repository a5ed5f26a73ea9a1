"""What the router remembers of its own decisions, by block key: which pod it sent a prefix to.

Two uses, one structure (``KeyMemory``):

* **speculative entries** (``ttl`` seconds): right after routing, the chosen pod is taken to hold
  the request's blocks until its engine's KV events arrive (they take a few hundred milliseconds:
  a prefill, a publish, ingest). Without them a burst of one new prefix scatters over the fleet,
  each request seeing an empty index;
* the **approximate prefix tree** (no ttl): what routers without KV events do (vllm-router's and
  SMG's ``cache_aware`` over HTTP workers): believe a prefix is where it was last sent, evicted only by
  the memory's own bound. The ``approx-prefix`` policy routes on it alone, as a baseline.

Bounded: at most ``max_keys`` (model, key) entries, least recently recorded out first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvindex.keys import BlockKey

_EXPIRED = float("-inf")  # the expiry of an entry a pod does not have


class KeyMemory:
    def __init__(self, *, ttl: float | None, max_keys: int = 1_000_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.ttl = ttl
        self.max_keys = max_keys
        self._entries: OrderedDict[tuple[str, BlockKey], dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, model: str, keys: Sequence[BlockKey], pod: str, *, now: float) -> None:
        """``pod`` holds ``keys`` (a request's blocks, in order) as of ``now``."""
        until = now + self.ttl if self.ttl is not None else float("inf")
        with self._lock:
            entries = self._entries
            for key in keys:
                ident = (model, key)
                holders = entries.get(ident)
                if holders is None:
                    holders = entries[ident] = {}
                else:
                    entries.move_to_end(ident)
                holders[pod] = until
            while len(entries) > self.max_keys:
                entries.popitem(last=False)

    def matched(self, model: str, keys: Sequence[BlockKey], *, now: float) -> dict[str, int]:
        """Per pod, how many leading ``keys`` it is remembered to hold (pods with none left out)."""
        out: dict[str, int] = {}
        with self._lock:
            entries = self._entries
            first = entries.get((model, keys[0])) if keys else None
            alive = [pod for pod, until in first.items() if until > now] if first else []
            held = len(keys)
            # Plain loops over the few pods still alive, no sets: this runs for every key of a
            # long prompt, and most keys are held by every pod still alive.
            for i in range(1, len(keys)):
                if not alive:
                    break
                holders = entries.get((model, keys[i]))
                if holders is None:
                    held = i
                    break
                for pod in alive:
                    if holders.get(pod, _EXPIRED) <= now:
                        break
                else:
                    continue
                for pod in alive:
                    if holders.get(pod, _EXPIRED) <= now:
                        out[pod] = i
                alive = [pod for pod in alive if pod not in out]
            for pod in alive:
                out[pod] = held
        return out
