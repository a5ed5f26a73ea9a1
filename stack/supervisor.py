"""Run some of a Procfile's processes together; stop them in their declared order.

Each process runs as ``/bin/sh -c COMMAND`` (so ``$VARS`` expand as under honcho) in a process
group of its own: every signal goes to the whole group, reaching the children a command starts
(a ``sleep 10 && exec ...`` too), and the terminal's Ctrl-C reaches the supervisor only, which
then stops the processes stage by stage (``Procfile.stop_order``): SIGTERM to a stage's groups,
up to ``grace`` seconds for every process in them to exit, SIGKILL for what is left, then the next
stage. A process has ended when its group's leader (the shell, or what it execs) exits;
what it leaves running in its group is stopped with its stage.

A process that ends by itself is logged with its exit status; if it is essential
(``Procfile.essential``) the rest is stopped as on a signal. The exit status of ``run``: 0 when a
signal stopped everything cleanly (each stopped process exited 0 or on the SIGTERM: -15, or 143
from a shell); 1 when an essential process ended, a process did not stop cleanly, or one could
not be started. A second signal during the shutdown kills what is left at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, TextIO

from stack.procfile import Procfile

SELF = "stack"  # the name the supervisor's own lines carry
POLL_SECONDS = 0.05
PROC = Path("/proc")
READER_JOIN_SECONDS = 1.0  # for the last lines of an exited process to be printed before its exit
CLEAN_STOP = frozenset({0, -signal.SIGTERM, 128 + signal.SIGTERM})
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# honcho's colour cycle (``honcho/colour.py``): ANSI foreground codes, then their bold variants.
COLOURS = ("36", "33", "32", "35", "31", "34", "36;1", "33;1", "32;1", "35;1", "31;1", "34;1")


def describe_exit(returncode: int) -> str:
    """A process's exit status in words: ``exit code 1``, ``signal SIGTERM``, ``exit code 143
    (SIGTERM)`` (a shell reporting its child's signal)."""
    if returncode < 0:
        return f"signal {_signal_name(-returncode)}"
    if returncode > 128 and (name := _signal_name(returncode - 128, default="")):
        return f"exit code {returncode} ({name})"
    return f"exit code {returncode}"


def _signal_name(number: int, default: str | None = None) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number) if default is None else default


class Output:
    """Lines as honcho prints them: ``HH:MM:SS name | text``, the name padded to the longest and,
    on a terminal, the prefix coloured per process. Safe to call from any thread. Once the stream
    is gone (a closed terminal or pipe) lines are dropped: stopping the processes in order matters
    more than printing, and there is nowhere left to say so."""

    def __init__(self, stream: TextIO, names: Sequence[str], *, colour: bool | None = None) -> None:
        self._stream = stream
        self._width = max(len(name) for name in [SELF, *names])
        self._colour = stream.isatty() if colour is None else colour
        self._colours = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(names)}
        self._lock = threading.Lock()
        self._gone = False

    def line(self, name: str, text: str) -> None:
        prefix = f"{datetime.now():%H:%M:%S} {name.ljust(self._width)} | "
        if self._colour and name in self._colours:
            prefix = f"\033[0m\033[{self._colours[name]}m{prefix}\033[0m"
        with self._lock:
            if self._gone:
                return
            try:
                self._stream.write(prefix + text + "\n")
                self._stream.flush()
            except OSError:
                self._gone = True


@dataclass
class Child:
    """One started process: its group's leader is ``popen`` (the ``/bin/sh -c``, or what it
    execs)."""

    name: str
    popen: subprocess.Popen[bytes]
    reader: threading.Thread
    signalled: bool = False  # the shutdown sent it SIGTERM
    killed: bool = False  # and SIGKILL, after the grace period or on a second signal
    returncode: int | None = None  # set once it has exited and been reported

    @property
    def running(self) -> bool:
        """Whether its leader still runs."""
        return self.returncode is None

    @property
    def alive(self) -> bool:
        """Whether its leader or anything else of its group still runs."""
        return self.running or _group_alive(self.popen.pid)

    @property
    def stopped_cleanly(self) -> bool:
        return not self.killed and self.returncode in CLEAN_STOP


class Supervisor:
    """Runs ``names`` (processes of ``procfile``) until a signal or an essential process's end,
    then stops them in ``procfile.stop_order``, each stage given ``grace`` seconds. ``env`` is added
    to this process's environment; output goes to ``stream`` (default stdout), coloured when it is
    a terminal unless ``colour`` says otherwise."""

    def __init__(
        self,
        procfile: Procfile,
        names: Sequence[str],
        *,
        grace: float = 10.0,
        env: Mapping[str, str] | None = None,
        stream: TextIO | None = None,
        colour: bool | None = None,
    ) -> None:
        if unknown := [name for name in names if name not in procfile.commands]:
            raise ValueError(f"not in the Procfile: {', '.join(unknown)}")
        self.procfile = procfile
        self.names = tuple(names)
        self.grace = grace
        self.env = dict(env or {})
        self._out = Output(stream or sys.stdout, self.names, colour=colour)
        self._children: dict[str, Child] = {}
        self._stopping: list[Child] = []  # what the shutdown found running
        self._signals: list[int] = []

    def run(self) -> int:
        """Start, supervise and stop the processes; return the exit status (module docstring).
        Must be called from the main thread (it handles SIGINT, SIGTERM and SIGHUP)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            failed_start = self._start()
            cause = failed_start or self._watch()
            if cause is not None:
                self._say(f"stopping {self._order_text()}")
            elif self._signals:
                self._say(f"{_signal_name(self._signals[0])}: stopping {self._order_text()}")
            self._stop()
            return self._conclude(cause)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Runs between two bytecodes of the main thread: record only, no locks.
        self._signals.append(signum)

    def _start(self) -> str | None:
        """Start every process; the name of one that could not be started (then stop)."""
        env = {**os.environ, **self.env}
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines as they are written, not when a buffer fills
        for name in self.names:
            try:
                popen = subprocess.Popen(
                    ["/bin/sh", "-c", self.procfile.commands[name]],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    process_group=0,
                )
            except OSError as e:
                self._say(f"cannot start {name}: {e}")
                return name
            reader = threading.Thread(target=self._pump, args=(name, popen.stdout), daemon=True)
            reader.start()
            self._children[name] = Child(name=name, popen=popen, reader=reader)
            self._say(f"{name} started (pid {popen.pid})")
        return None

    def _pump(self, name: str, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                for text in raw.decode("utf-8", "replace").splitlines():
                    self._out.line(name, text)

    def _watch(self) -> str | None:
        """Until a signal (None) or the end of an essential process (its name). A non-essential
        process's end is logged; when nothing is left running, return None."""
        while not self._signals:
            essential = None
            for child in self._reap():
                if child.name in self.procfile.essential:
                    self._say(f"{child.name} ended ({describe_exit(child.returncode)}); it is essential")
                    essential = essential or child.name
                else:
                    self._say(
                        f"{child.name} ended ({describe_exit(child.returncode)}); "
                        "not essential: the rest keeps running"
                    )
            if essential is not None:
                return essential
            if not self._running():
                self._say("every process has ended")
                return None
            time.sleep(POLL_SECONDS)
        return None

    def _stop(self) -> None:
        """Stop what runs, stage by stage; a further signal kills everything left at once."""
        signals_seen = len(self._signals)
        self._stopping = self._running()
        for stage in self.procfile.stop_order:
            children = [self._children[name] for name in stage if name in self._children]
            children = [child for child in children if child.alive]
            if not children:
                continue
            self._say(f"stopping {', '.join(child.name for child in children)}")
            for child in children:
                child.signalled = True
                _signal_group(child, signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while any(child.alive for child in children) and time.monotonic() < deadline:
                if len(self._signals) > signals_seen:
                    self._say(f"{_signal_name(self._signals[-1])} again: killing every process left")
                    self._kill([child for child in self._children.values() if child.alive])
                    return
                self._reap_and_report()
                time.sleep(POLL_SECONDS)
            self._reap_and_report()
            if late := [child for child in children if child.alive]:
                for child in late:
                    self._say(f"{child.name} did not stop within {self.grace:g} s: SIGKILL")
                self._kill(late)

    def _kill(self, children: list[Child]) -> None:
        for child in children:
            child.killed = True
            _signal_group(child, signal.SIGKILL)
        while any(child.alive for child in children):
            self._reap_and_report()
            time.sleep(POLL_SECONDS)
        self._reap_and_report()

    def _reap(self) -> list[Child]:
        """The processes whose leader exited since the last call, their last lines printed
        (unless the rest of their group still writes)."""
        ended = []
        for child in self._running():
            returncode = child.popen.poll()
            if returncode is None:
                continue
            if not _group_alive(child.popen.pid):
                child.reader.join(READER_JOIN_SECONDS)
            child.returncode = returncode
            ended.append(child)
        return ended

    def _reap_and_report(self) -> None:
        for child in self._reap():
            status = describe_exit(child.returncode)
            if child.killed:
                self._say(f"{child.name} killed ({status})")
            elif not child.signalled:
                self._say(f"{child.name} ended ({status}) before its turn to stop")
            elif child.stopped_cleanly:
                self._say(f"{child.name} stopped ({status})")
            else:
                self._say(f"{child.name} did not stop cleanly ({status})")

    def _conclude(self, cause: str | None) -> int:
        unclean = [
            f"{child.name} ({'SIGKILL' if child.killed else describe_exit(child.returncode)})"
            for child in self._stopping
            if not child.stopped_cleanly
        ]
        if cause is not None:
            self._say(f"stopped because {cause} ended; exit status 1")
            return 1
        if unclean:
            self._say(f"stopped, not cleanly: {', '.join(unclean)}; exit status 1")
            return 1
        if not self._signals and any(child.returncode != 0 for child in self._children.values()):
            self._say("every process ended, not all with exit code 0; exit status 1")
            return 1
        self._say("all processes stopped; exit status 0")
        return 0

    def _running(self) -> list[Child]:
        return [child for child in self._children.values() if child.running]

    def _order_text(self) -> str:
        running = {child.name for child in self._running()}
        stages = [[name for name in stage if name in running] for stage in self.procfile.stop_order]
        return " > ".join(" ".join(stage) for stage in stages if stage)

    def _say(self, text: str) -> None:
        self._out.line(SELF, text)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    """``sig`` to every process of ``child``'s group; a group already gone is no error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.popen.pid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs. Zombies do not count: an orphan's exit is
    collected by init (or never, in a container whose first process does not reap)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not PROC.is_dir():
        return True
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            # After "pid (comm)": state, ppid, pgrp, ... (proc(5)); comm may hold spaces and parens.
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            return True
    return False
