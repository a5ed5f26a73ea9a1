"""What a benchmark ran on, recorded beside its results."""

from __future__ import annotations

import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path


def machine(**extra: object) -> dict:
    """CPU model, cores, Python, platform, load average and date, plus ``extra``."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **extra,
    }
