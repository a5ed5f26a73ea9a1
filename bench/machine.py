"""What a benchmark ran on, recorded beside its results."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path


def commit() -> str | None:
    """The checkout's commit, with ``+changes`` when the tree differs from it; None outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.decode().strip() + ("+changes" if dirty.stdout.strip() else "")


def machine(**extra: object) -> dict:
    """CPU model, cores, Python, platform, load average, date and commit, plus ``extra``."""
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
        "commit": commit(),
        **extra,
    }
