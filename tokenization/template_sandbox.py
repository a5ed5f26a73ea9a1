"""A process sandbox for chat templates sent with a request.

``tokenization.chat_templates``'s bounded Jinja environment keeps every single step of a render
small, but not the number of steps: two nested ``range(10000)`` loops are 10^8 cheap steps.
:class:`TemplateSandbox` renders untrusted templates in a few long-lived worker processes (started
with ``spawn``: the web process has threads, so it never forks), each with

* a CPU-time budget per job: the worker arms ``ITIMER_PROF`` for ``cpu_seconds`` before each job,
  and ``SIGPROF``'s default action terminates it the moment the job has used that much CPU (user +
  system), precisely, even inside one long C call, and with no polling in the web process;
* a wall-clock cap, kept by the caller's thread, which SIGKILLs a worker that has not answered;
* a memory budget: ``RLIMIT_AS`` (1 GiB by default), where a ``MemoryError`` retires the worker.

A worker that died or was killed is reaped before the caller gets its :class:`TemplateBudgetExceeded`,
and a fresh one starts in the background, so nothing keeps running after the answer. Jobs go to
the workers pickled and results come back as UTF-8 text or a JSON error: plain data both ways, and
the web process never unpickles what a worker sends.

Measured per-call overhead (``render`` minus ``tokenization.chat_templates.render_template`` in this
process, on the shared 2-core test machine; a bare pipe round trip there takes ~30 us): ~70 us for a
trivial template (80 us against 16 us), ~90 us for a two-message Qwen3 conversation (170 us against
80 us), ~120 us for five messages (330 us against 210 us).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import pickle
import queue
import resource
import select
import signal
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tokenization.chat_templates import (
    DEFAULT_MAX_OUTPUT_CHARS,
    ChatTemplateError,
    TemplateBudgetExceeded,
    TemplateLimits,
    plain_data,
    render_template,
)
from tokenization.priority import lower_priority

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 1024**3
# How long a new worker may take to start (import Jinja, render a warm-up template).
_START_SECONDS = 30.0
_MAX_START_BACKOFF_SECONDS = 5.0
_READY = b"ready"
# A reply's first byte: the text follows (OK), or a JSON error (FAILED; RETIRED: the worker exits).
_OK, _FAILED, _RETIRED = b"\x00", b"\x01", b"\x02"
_ERRORS: Mapping[str, type[ChatTemplateError]] = {
    "ChatTemplateError": ChatTemplateError,
    "TemplateBudgetExceeded": TemplateBudgetExceeded,
}


class SandboxBusy(Exception):
    """Every worker stayed busy for the sandbox's ``queue_timeout`` (or the sandbox is closed): the
    request may be retried later (HTTP 503). Not a template error."""


@dataclass(eq=False)
class _Worker:
    """One worker process. Whoever holds it (the idle queue, a render, the thread starting it)
    is the only one to use its pipe and to :meth:`stop` it; :meth:`kill` is safe from anywhere."""

    process: BaseProcess
    connection: Connection
    # A poll object made once: Connection.poll builds a selector on every call (~10 us).
    answer: select.poll = field(default_factory=select.poll)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: bool = False

    def __post_init__(self) -> None:
        self.answer.register(self.connection.fileno(), select.POLLIN)

    def wait(self, seconds: float) -> bool:
        """Whether the worker answered (or died: its pipe closes) within ``seconds``."""
        return bool(self.answer.poll(seconds * 1000))

    def kill(self) -> None:
        """SIGKILL the process, unless it is already reaped (its pid may be another's by then)."""
        with self.lock:
            if not self.stopped and self.process.exitcode is None:
                with contextlib.suppress(OSError):
                    self.process.kill()

    def stop(self) -> None:
        """Kill the process if it still runs, reap it (its pid is gone) and close the pipe; once."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            if self.process.exitcode is None:
                with contextlib.suppress(OSError):
                    self.process.kill()
            self.process.join(timeout=5)
            self.connection.close()


class TemplateSandbox:
    """A pool of worker processes that render untrusted chat templates under CPU, wall-clock and
    memory budgets.

    ``processes`` workers start in the background at once (a render waits for the first one);
    ``cpu_seconds`` of CPU per render; ``max_output_chars`` bounds the rendered text and every step
    of the bounded environment; ``queue_timeout`` is how long a render waits for an idle worker
    before :class:`SandboxBusy`; ``memory_bytes`` is each worker's address-space limit;
    ``wall_seconds`` (default ``2 + 8 * cpu_seconds``) caps a render in real time.
    :meth:`render` is thread-safe; :meth:`close` (also run at interpreter exit) stops the workers.
    """

    def __init__(
        self,
        processes: int = 1,
        cpu_seconds: float = 0.25,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        queue_timeout: float = 1.0,
        *,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        wall_seconds: float | None = None,
    ) -> None:
        if processes < 1 or cpu_seconds <= 0 or max_output_chars < 1 or queue_timeout < 0:
            raise ValueError(
                "TemplateSandbox needs processes >= 1, cpu_seconds > 0, max_output_chars >= 1 "
                "and queue_timeout >= 0"
            )
        self.processes = processes
        self.cpu_seconds = cpu_seconds
        self.queue_timeout = queue_timeout
        self.memory_bytes = memory_bytes
        self.wall_seconds = wall_seconds if wall_seconds is not None else 2.0 + 8 * cpu_seconds
        self._pool = _Pool(
            TemplateLimits(max_output_chars=max_output_chars),
            cpu_seconds=cpu_seconds,
            memory_bytes=memory_bytes,
        )
        # A UTF-8 reply is at most 4 bytes a character; anything longer is a broken worker.
        self._max_reply = 4 * max_output_chars + 65536
        weakref.finalize(self, self._pool.close)
        for _ in range(processes):
            self._pool.start_in_background()

    def render(
        self,
        template: str,
        conversation: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """``tokenization.chat_templates.render_template(...)`` of the same arguments, run in a worker.

        Blocks until a worker is idle (at most ``queue_timeout``; :class:`SandboxBusy` after) and
        the render is done. Raises what ``render_template`` raises, and
        :class:`TemplateBudgetExceeded` when the worker used more than ``cpu_seconds`` of CPU,
        ``wall_seconds`` of time or its memory: that worker is gone (killed and reaped) by then.
        """
        options = {
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": bool(add_generation_prompt),
            "continue_final_message": bool(continue_final_message),
            "kwargs": dict(kwargs or {}),
        }
        try:
            job = pickle.dumps(
                (str(template), plain_data(conversation), plain_data(options)), pickle.HIGHEST_PROTOCOL
            )
        except RecursionError as error:
            raise ChatTemplateError(
                "the messages, tools, documents or chat_template_kwargs nest too deeply: flatten them"
            ) from error
        while True:
            worker = self._pool.take(self.queue_timeout)
            try:
                worker.connection.send_bytes(job)
            except OSError:  # it died while idle
                self._pool.replace(worker)
                continue
            return self._answer(worker)

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers (idle, busy or starting)."""
        return self._pool.pids()

    def close(self) -> None:
        """Kill every worker; renders under way get :class:`SandboxBusy`, and so do later ones."""
        self._pool.close()

    def __enter__(self) -> TemplateSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _answer(self, worker: _Worker) -> str:
        answered = True  # False only when the wall-clock cap passes
        try:
            answered = worker.wait(self.wall_seconds)
            reply = worker.connection.recv_bytes(self._max_reply) if answered else None
        except (EOFError, OSError):
            reply = None
        except BaseException:
            self._pool.replace(worker)  # a job in flight: the worker cannot be reused
            raise
        if reply is None:
            self._pool.replace(worker)  # killed (if still running) and reaped before we answer
            raise self._death(worker, timed_out=not answered)
        status, body = reply[:1], reply[1:]
        if status == _OK:
            self._pool.give_back(worker)
            return body.decode("utf-8", "surrogatepass")
        if status == _FAILED:
            self._pool.give_back(worker)
        else:
            self._pool.replace(worker)
        raise _reported_error(body)

    def _death(self, worker: _Worker, *, timed_out: bool) -> Exception:
        if self._pool.closed:
            return SandboxBusy("the chat-template sandbox was closed while rendering: retry later")
        if timed_out:
            return TemplateBudgetExceeded(
                f"the chat template ran for more than {self.wall_seconds:g} s: make it do less work"
            )
        if worker.process.exitcode == -signal.SIGPROF:
            return TemplateBudgetExceeded(
                f"the chat template used more than {self.cpu_seconds * 1000:g} ms of CPU: make it do less "
                "work (fewer or shorter loops)"
            )
        return TemplateBudgetExceeded(
            "the chat template's sandbox process died while rendering "
            f"(exit code {worker.process.exitcode}); it may have used more than its "
            f"{self.memory_bytes // 2**20} MiB of memory: make it build less"
        )


class _Pool:
    """The workers of one sandbox, shared with the threads that start them and with the finalizer
    that stops them (so neither keeps the sandbox alive)."""

    def __init__(self, limits: TemplateLimits, *, cpu_seconds: float, memory_bytes: int) -> None:
        self.limits = limits
        self.cpu_seconds = cpu_seconds
        self.memory_bytes = memory_bytes
        self.context = multiprocessing.get_context("spawn")
        self.idle: queue.LifoQueue[_Worker] = queue.LifoQueue()  # the most recently used first
        self.workers: set[_Worker] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.started = threading.Event()  # set once a first worker is ready

    def take(self, timeout: float) -> _Worker:
        """An idle, live worker; waits ``timeout`` (or, before any worker has started, as long as
        starting one may take)."""
        if not self.started.is_set():
            timeout = max(timeout, _START_SECONDS)
        deadline = time.monotonic() + timeout
        while True:
            if self.closed:
                raise SandboxBusy("the chat-template sandbox is closed")
            try:
                worker = self.idle.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise SandboxBusy(
                    f"every chat-template sandbox process stayed busy for {timeout:g} s: retry later"
                ) from None
            if worker.process.is_alive():
                return worker
            self.replace(worker)

    def give_back(self, worker: _Worker) -> None:
        with self.lock:  # close() drains the queue after setting `closed` under this lock
            if not self.closed:
                self.idle.put(worker)
                return
        worker.stop()

    def replace(self, worker: _Worker) -> None:
        """Stop ``worker`` now (kill and reap it) and start another in the background."""
        with self.lock:
            self.workers.discard(worker)
        worker.stop()
        if not self.closed:
            self.start_in_background()

    def start_in_background(self) -> None:
        threading.Thread(target=self._start, name="template-sandbox-start", daemon=True).start()

    def pids(self) -> list[int]:
        with self.lock:
            return sorted(worker.process.pid for worker in self.workers if worker.process.pid is not None)

    def close(self) -> None:
        """Kill every worker; reap the idle ones (busy and starting ones are reaped by the threads
        that hold them, once they see their worker die)."""
        with self.lock:
            self.closed = True
            workers = list(self.workers)
            self.workers.clear()
        for worker in workers:
            worker.kill()
        with contextlib.suppress(queue.Empty):
            while True:
                self.idle.get_nowait().stop()

    def _start(self) -> None:
        backoff = 0.1
        while not self.closed:
            try:
                worker = self._spawn()
            except Exception:  # e.g. out of processes or file descriptors: try again later
                logger.exception("could not start a chat-template sandbox process")
                worker = None
            if worker is not None:
                self.started.set()
                self.give_back(worker)
                return
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_START_BACKOFF_SECONDS)

    def _spawn(self) -> _Worker | None:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(
            target=_serve,
            args=(theirs, self.limits, self.cpu_seconds, self.memory_bytes),
            name="template-sandbox",
            daemon=True,
        )
        with self.lock:
            if self.closed:
                return None
            process.start()
            lower_priority(process.pid)  # now, before the child spends its start-up CPU
            worker = _Worker(process, ours)
            self.workers.add(worker)  # from now on close() stops it, even while it starts
        theirs.close()
        try:
            ready = ours.poll(_START_SECONDS) and ours.recv_bytes() == _READY
        except (EOFError, OSError):
            ready = False
        if ready:
            return worker
        if not self.closed:
            logger.error("a chat-template sandbox process failed to start (exit code %s)", process.exitcode)
        with self.lock:
            self.workers.discard(worker)
        worker.stop()
        return None


def _reported_error(body: bytes) -> ChatTemplateError:
    """The error a worker reported, as a JSON ``{"error", "message"}``."""
    try:
        error = json.loads(body)
        return _ERRORS.get(error["error"], ChatTemplateError)(str(error["message"]))
    except (ValueError, TypeError, KeyError):
        return ChatTemplateError(
            "the chat template could not be rendered: its sandbox sent a malformed reply"
        )


def _serve(connection: Connection, limits: TemplateLimits, cpu_seconds: float, memory_bytes: int) -> None:
    """A worker process: render each job under the budgets until the web process goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the web process's to handle
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # the CPU timer's signal terminates the process
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    render_template("{{ messages[0].content }}", [{"role": "user", "content": "ready"}], limits=limits)
    connection.send_bytes(_READY)
    while True:
        try:
            job = connection.recv_bytes()
        except (EOFError, OSError):
            return
        signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
        try:
            reply, retire = _run(job, limits, memory_bytes)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        connection.send_bytes(reply)
        if retire:
            return


def _run(job: bytes, limits: TemplateLimits, memory_bytes: int) -> tuple[bytes, bool]:
    """The reply to one job, and whether the worker must retire (its memory ran out)."""
    try:
        template, conversation, options = pickle.loads(job)
        text = render_template(template, conversation, limits=limits, **options)
        return _OK + text.encode("utf-8", "surrogatepass"), False
    except ChatTemplateError as error:
        if not isinstance(error.__cause__, MemoryError):
            return _FAILED + _error(type(error).__name__, str(error)), False
    except MemoryError:
        pass
    except Exception as error:  # a job that does not unpickle: a bug on our side, not the template's
        return _FAILED + _error(
            "ChatTemplateError", f"the chat template could not be rendered: {error}"
        ), False
    message = f"the chat template used more than {memory_bytes // 2**20} MiB of memory: make it build less"
    return _RETIRED + _error("TemplateBudgetExceeded", message), True


def _error(kind: str, message: str) -> bytes:
    return json.dumps({"error": kind, "message": message}).encode()
