"""The CPU priority of bulk work: the large-prompt tokenizer's process, the request-template
sandbox's processes and the fast path's threads for bulk requests run lower than the web
process, so that under contention for the cores small scoring requests go first."""

from __future__ import annotations

import contextlib
import os

BACKGROUND_NICENESS = 10
"""How much lower the CPU priority of bulk work is than the web process's."""


def lower_priority(pid_or_thread_id: int) -> None:
    """Run a process (or, on Linux, a thread: niceness is per thread) ``BACKGROUND_NICENESS``
    lower than it runs now; nothing when the system refuses."""
    with contextlib.suppress(OSError):
        current = os.getpriority(os.PRIO_PROCESS, pid_or_thread_id)
        os.setpriority(os.PRIO_PROCESS, pid_or_thread_id, current + BACKGROUND_NICENESS)
