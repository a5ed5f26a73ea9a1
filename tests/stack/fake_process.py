"""A stand-in for a stack process, run by the tests' Procfiles: it writes ``NAME.ready`` into
``$STATE`` once running, ``NAME.term`` (the CLOCK_MONOTONIC time) when SIGTERM arrives and
``NAME.exit`` just before it exits, so a test can tell who was stopped when."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--stop-seconds", type=float, default=0.0, help="time SIGTERM takes (draining)")
    parser.add_argument("--ignore-term", action="store_true", help="note SIGTERM, keep running")
    parser.add_argument("--reraise", action="store_true", help="end on SIGTERM by it (-15), as uvicorn does")
    parser.add_argument("--exit-after", type=float, default=None, help="exit by itself after this long")
    parser.add_argument("--code", type=int, default=0, help="the exit code of --exit-after")
    args = parser.parse_args()
    state = Path(os.environ["STATE"])

    def mark(what: str) -> None:
        """Whole or not at all: a test polling for the file never reads it half written."""
        path = state / f"{args.name}.{what}"
        part = path.with_suffix(path.suffix + ".part")
        part.write_text(repr(time.monotonic()))
        part.replace(path)

    def on_term(_signum: int, _frame: object) -> None:
        mark("term")
        if args.ignore_term:
            return
        time.sleep(args.stop_seconds)
        print(f"{args.name} stopped", flush=True)
        mark("exit")
        if args.reraise:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    print(f"{args.name} ready", flush=True)
    mark("ready")
    started = time.monotonic()
    while args.exit_after is None or time.monotonic() - started < args.exit_after:
        time.sleep(0.01)
    mark("exit")
    sys.exit(args.code)


if __name__ == "__main__":
    main()
