"""Log lines about bad input, rate-limited per reason."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """Warnings about bad input, at most one per ``reason`` every ``interval`` seconds: a flood
    of malformed messages must not become a flood of log lines (they are all counted in the
    stats anyway). The next line of a reason says how many were left out since the last."""

    def __init__(self, logger: logging.Logger, *, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, reason: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``reason`` was logged less than ``interval`` ago;
        returns whether it was logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < self.interval:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return False
            self._last[reason] = now
            suppressed = self._suppressed.pop(reason, 0)
        if suppressed:
            message += f" (and {suppressed} more {reason} in the last {self.interval:g}s, not logged)"
        self.logger.warning(message, *args)
        return True
