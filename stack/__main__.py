"""``python -m stack [-f Procfile] [--grace SECONDS] [NAME ...]``: run those processes of the
Procfile (default: all) until Ctrl-C, SIGTERM or the end of an essential one; see
``stack.supervisor`` for the shutdown and the exit status."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from stack.procfile import ProcfileError, read_procfile
from stack.supervisor import Supervisor


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stack",
        description="Run Procfile processes; stop them in the Procfile's '# stack stop-order:'.",
    )
    parser.add_argument("-f", "--procfile", type=Path, default=Path("Procfile"), help="default ./Procfile")
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds each shutdown stage has to exit after SIGTERM before SIGKILL (default 10)",
    )
    parser.add_argument("--no-colour", action="store_true", help="no coloured names, even on a terminal")
    parser.add_argument("names", nargs="*", metavar="NAME", help="processes to run (default: all)")
    args = parser.parse_args(argv)
    try:
        procfile = read_procfile(args.procfile)
    except ProcfileError as e:
        parser.error(f"{args.procfile}: {e}")
    names = args.names or list(procfile.commands)
    if unknown := [name for name in names if name not in procfile.commands]:
        parser.error(
            f"not in {args.procfile}: {', '.join(unknown)} (its processes: {', '.join(procfile.commands)})"
        )
    if len(set(names)) < len(names):
        parser.error("a process is named twice")
    supervisor = Supervisor(procfile, names, grace=args.grace, colour=False if args.no_colour else None)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
