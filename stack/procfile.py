"""The Procfile: the stack's processes, their shutdown order and which of them are essential.

The format is honcho's (and Heroku's): one ``name: command`` a line, each command run with
``/bin/sh -c``; blank lines and ``#`` comments are ignored, so honcho still reads the file. Two
comment lines, read by ``python -m stack`` only, declare the rest:

    # stack stop-order: loadgen > sim > web gateway > ingest > redis
    # stack essential: redis web ingest gateway

``stop-order`` lists every process once, in stages separated by ``>``: on shutdown the first
stage is stopped (SIGTERM, a grace period, then SIGKILL) before the next is signalled; the
processes of one stage stop together. ``essential`` names the processes whose ending stops the
whole stack; any other process may end (its exit is logged) while the rest keeps running.
Without these lines every process is in one stage and every process is essential, as under
honcho.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# honcho's own pattern for a process line (``honcho/environ.py``), so both read the same names.
PROCESS_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
DIRECTIVE_LINE = re.compile(r"^#\s*stack\s+([A-Za-z_-]+):(.*)$")
DIRECTIVES = ("stop-order", "essential")

Stages = tuple[tuple[str, ...], ...]


class ProcfileError(ValueError):
    """A Procfile that cannot be run as written; the message says which line and what to fix."""


@dataclass(frozen=True)
class Procfile:
    """The processes of a Procfile, in file order, with their shutdown stages and essential set.

    Invariant (kept by ``parse_procfile``): every process is in exactly one stage of
    ``stop_order``, and ``essential`` names processes of ``commands`` only.
    """

    commands: Mapping[str, str]
    stop_order: Stages
    essential: frozenset[str]


def read_procfile(path: Path) -> Procfile:
    """The Procfile at ``path``, parsed by ``parse_procfile``."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ProcfileError(f"cannot read {path}: {e.strerror}") from e
    return parse_procfile(text)


def parse_procfile(text: str) -> Procfile:
    """Parse a Procfile's text; raise ``ProcfileError`` naming the line for anything ambiguous: a
    process defined twice, an unknown ``# stack`` directive, a directive given twice or naming an
    unknown process, and a stop order that leaves a process out or names it twice."""
    commands: dict[str, str] = {}
    directives: dict[str, tuple[int, str]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if directive := DIRECTIVE_LINE.match(line):
            key, value = directive.groups()
            if key not in DIRECTIVES:
                raise ProcfileError(
                    f"line {number}: unknown directive '# stack {key}:' (known: {', '.join(DIRECTIVES)})"
                )
            if key in directives:
                raise ProcfileError(f"line {number}: '# stack {key}:' given twice")
            directives[key] = (number, value)
        elif process := PROCESS_LINE.match(line):
            name, command = process.groups()
            if name in commands:
                raise ProcfileError(f"line {number}: process {name!r} is defined twice")
            commands[name] = command
    if not commands:
        raise ProcfileError("no processes: a Procfile line reads 'name: command'")
    return Procfile(
        commands=commands,
        stop_order=_stop_order(directives.get("stop-order"), commands),
        essential=_essential(directives.get("essential"), commands),
    )


def _stop_order(directive: tuple[int, str] | None, commands: Mapping[str, str]) -> Stages:
    if directive is None:
        return (tuple(commands),)
    number, value = directive
    stages = tuple(tuple(stage.split()) for stage in value.split(">"))
    if any(not stage for stage in stages):
        raise ProcfileError(f"line {number}: an empty stage in '# stack stop-order:' (write 'a > b c > d')")
    listed = [name for stage in stages for name in stage]
    _check_known(number, "stop-order", listed, commands)
    if twice := sorted({name for name in listed if listed.count(name) > 1}):
        raise ProcfileError(f"line {number}: '# stack stop-order:' names {', '.join(twice)} more than once")
    if missing := [name for name in commands if name not in listed]:
        raise ProcfileError(
            f"line {number}: '# stack stop-order:' leaves out {', '.join(missing)}: "
            "every process needs its place in the shutdown order"
        )
    return stages


def _essential(directive: tuple[int, str] | None, commands: Mapping[str, str]) -> frozenset[str]:
    if directive is None:
        return frozenset(commands)
    number, value = directive
    names = value.split()
    _check_known(number, "essential", names, commands)
    return frozenset(names)


def _check_known(number: int, key: str, names: list[str], commands: Mapping[str, str]) -> None:
    if unknown := [name for name in names if name not in commands]:
        raise ProcfileError(
            f"line {number}: '# stack {key}:' names {', '.join(unknown)}, not a process of this Procfile"
        )
