"""Epoch markers: how every process notices that the index lost its data.

Ingest keeps one marker per model in the index (``KVIndex.set_epoch``), ``"<token> <state>"``,
beside the model's blocks, so it vanishes with them: a server restarted empty, a flush, a
failover to an empty replica. (In a cluster the model's blocks span every master, so the marker
does too: it reads as gone when any master lost its data; ``kvindex.cluster``.) Ingest
checks the markers every half second; a marker gone (or replaced by another process's token)
means the model's data is gone. Ingest then writes a new token in state ``resyncing``, rebuilds
the model from the engines' replay buffers, and writes ``ready``. Readers (``/readyz``, metrics,
the dashboard) say "index resyncing" while a marker says so, or while a marker they saw has
vanished and ingest has not yet written a new one.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence

from kvindex.base import KVIndex

READY = "ready"
RESYNCING = "resyncing"


def new_token() -> str:
    return secrets.token_hex(8)


def marker(token: str, state: str) -> str:
    return f"{token} {state}"


def parse_marker(value: str | None) -> tuple[str, str] | None:
    """``(token, state)`` of a marker; None when there is none (or it is not ours)."""
    if not value:
        return None
    token, _, state = value.partition(" ")
    return (token, state) if state in (READY, RESYNCING) else None


class EpochWatch:
    """A reader's view of the markers: which models the index is rebuilding. Remembers the
    tokens it saw, so a marker that vanishes reads as resyncing before ingest notices too."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}
        self._lock = threading.Lock()

    def resyncing(self, index: KVIndex, models: Sequence[str]) -> list[str]:
        """The models among ``models`` whose index data is being rebuilt (one round trip)."""
        if not models:
            return []
        values = index.epochs(models)
        out = []
        with self._lock:
            for model, value in zip(models, values, strict=True):
                parsed = parse_marker(value)
                if parsed is None:
                    if model in self._seen:
                        out.append(model)  # gone since we last looked: lost, not yet noticed
                    continue
                token, state = parsed
                self._seen[model] = token
                if state == RESYNCING:
                    out.append(model)
        return out
