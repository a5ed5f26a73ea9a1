"""A pod's ``/metrics``, read as untrusted input: its running and waiting requests, or a reason why not.

The gateway's load scraper (``routing.load``) and the liveness prober (``registry.liveness``) read
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` from every pod. One pod's answer must
never cost the others anything, so a body is fed to :class:`RequestsReader` chunk by chunk as it
arrives, and what one pod can make a reader do is bounded:

* bytes: at most ``MAX_METRICS_BYTES`` (``too_large`` past it: the reader stops there);
* memory: one line at most ``MAX_LINE_BYTES`` is held (a longer line is skipped, unless it is a
  line of ours: ``malformed``);
* values: a count is a plain non-negative decimal, finite, at most ``MAX_REQUESTS``; anything else
  (``1.2.3``, ``NaN``, ``+Inf``, ``-1``, ``1e999``, bytes that are not ASCII) is ``malformed``
  rather than a number that would poison the pod's load.

The time a pod may take is the caller's bound (each caller has a timeout per pod). A failure is a
:class:`PodMetricsError` with a reason from ``READ_FAILURES``, which the callers count; nothing
here raises anything else for any input. No Django import.
"""

from __future__ import annotations

import math
import re

MAX_METRICS_BYTES = 4 * 1024 * 1024
"""Most bytes read from one ``/metrics`` answer (vLLM's are tens of kB, a few hundred with many
data-parallel ranks and LoRA adapters)."""
MAX_LINE_BYTES = 64 * 1024
"""Longest line kept whole; a longer one is skipped (``malformed`` if it is a line of ours)."""
MAX_REQUESTS = 1_000_000
"""Largest count of one line taken as true: no engine runs or queues a million requests."""

READ_FAILURES = ("connect", "timeout", "status", "too_large", "malformed", "error")
"""Why a pod's ``/metrics`` gave no counts: the connection was refused or reset; no whole answer
within the timeout; an answer other than 200; a body over ``MAX_METRICS_BYTES``; a line of ours
that is not a count; anything else (a broken response, an address that is not ``host:port``)."""

_PREFIX = b"vllm:num_requests_"
_NAME = re.compile(rb"vllm:num_requests_(running|waiting)(?=[{ \t\r]|$)")
_REST = re.compile(  # after the name: labels (quoted values may hold braces), the value, a timestamp
    rb'(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*\r?', re.DOTALL
)
_COUNT = re.compile(rb"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class PodMetricsError(Exception):
    """A pod's ``/metrics`` gave no counts: ``reason`` is one of ``READ_FAILURES``; the message
    says what was wrong (quoting at most a few bytes of what the pod sent)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RequestsReader:
    """Running and waiting requests of a ``/metrics`` body fed in chunks (each summed over its
    label sets, as an engine with several data-parallel ranks reports them). ``feed`` raises
    :class:`PodMetricsError` as soon as the body is over ``max_bytes`` or a line of ours is not a
    count; ``counts`` gives the result once the body has ended."""

    __slots__ = ("_line", "_size", "_skipping", "max_bytes", "running", "waiting")

    def __init__(self, *, max_bytes: int = MAX_METRICS_BYTES) -> None:
        self.max_bytes = max_bytes
        self.running = 0.0
        self.waiting = 0.0
        self._size = 0
        self._line = b""  # the start of a line not ended yet
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES (not ours)

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self.max_bytes:
            raise PodMetricsError("too_large", f"the body is over {self.max_bytes} bytes")
        lines = chunk.split(b"\n")
        for n, line in enumerate(lines):
            last = n == len(lines) - 1
            if self._skipping:
                self._skipping = last  # the long line goes on unless a newline came
                continue
            if len(self._line) + len(line) > MAX_LINE_BYTES:
                k = len(_PREFIX)
                if (self._line[:k] + line[:k])[:k] == _PREFIX:
                    raise PodMetricsError(
                        "malformed", f"a {_PREFIX.decode()}* line is over {MAX_LINE_BYTES} bytes"
                    )
                self._line, self._skipping = b"", last
                continue
            if last:
                self._line += line
            else:
                self._take(self._line + line)
                self._line = b""

    def counts(self) -> tuple[float, float]:
        """(running, waiting), once the whole body was fed."""
        if self._line:
            self._take(self._line)
            self._line = b""
        return self.running, self.waiting

    def _take(self, line: bytes) -> None:
        if not line.startswith(_PREFIX):
            return
        name = _NAME.match(line)
        if name is None:
            return  # another metric of the same prefix (vllm:num_requests_waiting_by_reason...)
        rest = _REST.fullmatch(line, name.end())
        value = rest.group(1) if rest is not None else None
        count = float(value) if value is not None and _COUNT.fullmatch(value) else math.nan
        if not 0.0 <= count <= MAX_REQUESTS:  # NaN too
            shown = (value if value is not None else line[name.end() :])[:40]
            raise PodMetricsError(
                "malformed", f"vllm:num_requests_{name.group(1).decode()} is not a count: {shown!r}"
            )
        if name.group(1) == b"running":
            self.running += count
        else:
            self.waiting += count


def requests_by_state(exposition: bytes) -> tuple[float, float]:
    """Running and waiting requests in a whole vLLM ``/metrics`` text (each summed over label
    sets); raises :class:`PodMetricsError` as :class:`RequestsReader` does."""
    reader = RequestsReader()
    reader.feed(exposition)
    return reader.counts()


def requests_in(exposition: bytes) -> float:
    """Running plus waiting requests in a whole vLLM ``/metrics`` text (summed over label sets)."""
    return sum(requests_by_state(exposition))
