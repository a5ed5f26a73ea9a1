"""``python -m stack`` with real processes (``fake_process.py``) from a small Procfile shaped like
the project's: a signal stops them stage by stage, each stage after the last has exited; a
process that ignores SIGTERM is killed after the grace period; a non-essential process's end
leaves the rest running; an essential one's stops everything, exit status 1."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack.__main__ import main
from stack.supervisor import Output, describe_exit
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_process.py")

STACK = """\
# stack stop-order: loadgen > sim > web gateway > ingest > redis
# stack essential: redis web ingest gateway
redis: exec "$PY" "$FAKE" redis
web: exec "$PY" "$FAKE" web --stop-seconds 1
ingest: exec "$PY" "$FAKE" ingest --stop-seconds 0.3 {ingest}
gateway: exec "$PY" "$FAKE" gateway --reraise
sim: exec "$PY" "$FAKE" sim
loadgen: sleep 0.2 && exec "$PY" "$FAKE" loadgen {loadgen}
"""
NAMES = ["redis", "web", "ingest", "gateway", "sim", "loadgen"]


class Stack:
    """A ``python -m stack`` process and the marks its processes leave in ``state``."""

    def __init__(self, tmp_path: Path, procfile: str, names: list[str], *, grace: float = 5.0) -> None:
        self.state = tmp_path
        (tmp_path / "Procfile").write_text(procfile)
        self.log = tmp_path / "stack.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stack",
                    "-f",
                    str(tmp_path / "Procfile"),
                    "--grace",
                    str(grace),
                    *names,
                ],
                cwd=ROOT,
                env={**os.environ, "PY": sys.executable, "FAKE": str(FAKE), "STATE": str(tmp_path)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text()

    def mark(self, name: str, what: str) -> float | None:
        path = self.state / f"{name}.{what}"
        return float(path.read_text()) if path.exists() else None

    def wait_ready(self, names: list[str]) -> None:
        wait_until(lambda: all(self.mark(n, "ready") for n in names), timeout=10, what=f"{names} ready")

    def stop(self, sig: signal.Signals = signal.SIGINT, *, timeout: float = 10) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Whatever a failed test left running: the supervisor, then any process it started."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in re.findall(r"started \(pid (\d+)\)", self.output()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    stacks = []

    def start(procfile: str, names: list[str], **kwargs) -> Stack:
        stacks.append(Stack(tmp_path, procfile, names, **kwargs))
        return stacks[-1]

    yield start
    for stack in stacks:
        stack.close()


def assert_stopped_in_order(stack: Stack, stages: list[list[str]]) -> None:
    """Each stage got SIGTERM after every process of the previous stage had exited, and the
    processes of one stage got it together (well before ``web``, in the same stage as
    ``gateway``, takes its 1 s to stop)."""
    for earlier, later in itertools.pairwise(stages):
        last_exit = max(stack.mark(name, "exit") for name in earlier)
        for name in later:
            assert stack.mark(name, "term") >= last_exit, f"{name} was signalled before {earlier} exited"
    for stage in stages:
        terms = [stack.mark(name, "term") for name in stage]
        assert max(terms) - min(terms) < 0.5, f"{stage} were not signalled together"


def test_a_signal_stops_the_stages_in_the_declared_order_and_exits_0(start):
    stack = start(STACK.format(ingest="", loadgen=""), NAMES)
    stack.wait_ready(NAMES)

    assert stack.stop(signal.SIGINT) == 0

    assert_stopped_in_order(stack, [["loadgen"], ["sim"], ["web", "gateway"], ["ingest"], ["redis"]])
    out = stack.output()
    assert "SIGINT: stopping loadgen > sim > web gateway > ingest > redis" in out
    assert "stopping web, gateway" in out
    assert "ingest stopped (exit code 0)" in out
    assert "gateway stopped (signal SIGTERM)" in out  # uvicorn's way: reported as a plain stop
    assert out.rstrip().endswith("all processes stopped; exit status 0")
    # honcho's layout: time, the name padded to the longest (``gateway``), a bar, the line
    assert re.search(r"^\d\d:\d\d:\d\d redis   \| redis ready$", out, re.MULTILINE)
    assert re.search(r"^\d\d:\d\d:\d\d stack   \| ingest stopped", out, re.MULTILINE)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(start):
    procfile = """\
# stack stop-order: stubborn > after
stubborn: exec "$PY" "$FAKE" stubborn --ignore-term
after: exec "$PY" "$FAKE" after
"""
    stack = start(procfile, ["stubborn", "after"], grace=0.5)
    stack.wait_ready(["stubborn", "after"])

    assert stack.stop(signal.SIGTERM) == 1

    assert stack.mark("stubborn", "exit") is None
    assert stack.mark("after", "term") - stack.mark("stubborn", "term") >= 0.5
    out = stack.output()
    assert "SIGTERM: stopping stubborn > after" in out
    assert "stubborn did not stop within 0.5 s: SIGKILL" in out
    assert "stubborn killed (signal SIGKILL)" in out
    assert "after stopped (exit code 0)" in out
    assert out.rstrip().endswith("stopped, not cleanly: stubborn (SIGKILL); exit status 1")


def test_a_non_essential_process_ending_leaves_the_rest_running(start):
    stack = start(STACK.format(ingest="", loadgen="--exit-after 0.3 --code 3"), NAMES)
    wait_until(lambda: "loadgen ended" in stack.output(), timeout=10, what="loadgen's end")
    time.sleep(1.0)

    assert stack.proc.poll() is None
    assert not any(stack.mark(name, "term") for name in NAMES)
    assert "loadgen ended (exit code 3); not essential: the rest keeps running" in stack.output()
    assert stack.stop(signal.SIGTERM) == 0  # loadgen's code 3 does not make the stop unclean
    assert_stopped_in_order(stack, [["sim"], ["web", "gateway"], ["ingest"], ["redis"]])
    assert "SIGTERM: stopping sim > web gateway > ingest > redis" in stack.output()


def test_an_essential_process_ending_stops_the_rest_in_order_and_exits_1(start):
    stack = start(STACK.format(ingest="--exit-after 1 --code 1", loadgen=""), NAMES)

    assert stack.proc.wait(15) == 1

    assert stack.mark("ingest", "term") is None
    assert_stopped_in_order(stack, [["loadgen"], ["sim"], ["web", "gateway"], ["redis"]])
    out = stack.output()
    assert "ingest ended (exit code 1); it is essential" in out
    assert "stopping loadgen > sim > web gateway > redis" in out
    assert out.rstrip().endswith("stopped because ingest ended; exit status 1")


def test_signals_reach_the_children_a_command_starts(start):
    procfile = 'family: "$PY" "$FAKE" kid1 & "$PY" "$FAKE" kid2 & wait\n'
    stack = start(procfile, ["family"])
    stack.wait_ready(["kid1", "kid2"])

    assert stack.stop(signal.SIGINT) == 0  # the shell itself dies of the SIGTERM: a clean stop

    assert stack.mark("kid1", "exit") and stack.mark("kid2", "exit")
    assert "family stopped (signal SIGTERM)" in stack.output()


def test_a_name_that_is_not_in_the_procfile_is_refused(tmp_path, capsys):
    (tmp_path / "Procfile").write_text("web: true\n")

    with pytest.raises(SystemExit) as exited:
        main(["-f", str(tmp_path / "Procfile"), "web", "wbe"])

    assert exited.value.code == 2
    assert "wbe (its processes: web)" in capsys.readouterr().err


def test_output_colours_each_name_on_a_terminal_and_pads_it():
    stream = io.StringIO()
    out = Output(stream, ["web", "loadgen"], colour=True)

    out.line("web", "up")
    out.line("stack", "web started")

    web, own = stream.getvalue().splitlines()
    assert re.fullmatch(r"\x1b\[0m\x1b\[36m\d\d:\d\d:\d\d web     \| \x1b\[0mup", web)
    assert re.fullmatch(r"\d\d:\d\d:\d\d stack   \| web started", own)  # its own lines: plain


@pytest.mark.parametrize(
    ("returncode", "words"),
    [(0, "exit code 0"), (3, "exit code 3"), (-15, "signal SIGTERM"), (143, "exit code 143 (SIGTERM)")],
)
def test_exit_statuses_are_described_in_words(returncode, words):
    assert describe_exit(returncode) == words
