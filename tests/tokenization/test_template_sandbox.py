"""The template sandbox: request templates render in worker processes under CPU, memory and
output budgets; a worker over its budget is killed, reaped and replaced. Real processes throughout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tokenization import qwen_tokenizer_dir
from tests.tokenization.test_chat_templates import MULTI_TURN, TOOL_CONVERSATION, WEATHER_TOOL
from tokenization.chat_templates import (
    ChatTemplateError,
    ChatTemplates,
    RequestTemplateRefused,
    TemplateBudgetExceeded,
    render_chat,
    render_template,
)
from tokenization.template_sandbox import SandboxBusy, TemplateSandbox

HI = [{"role": "user", "content": "hi"}]
PROCESSES = 2
OUTPUT_BUDGET = 1_000_000
MEMORY_BUDGET = 128 * 2**20
NESTED_LOOPS = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"

# The templates that stalled or bloated the web process before the bounds (see
# tokenization/chat_templates.py).
HOSTILE_TEMPLATES = {
    "a huge power": ("{{ (9**(9**8)) % 2 }}", TemplateBudgetExceeded, "more than 16384 bits"),
    "a huge string": ("{{ 'a'*10**9 }}", TemplateBudgetExceeded, "1000000-character output budget"),
    "nested loops": (NESTED_LOOPS, TemplateBudgetExceeded, "more than 250 ms of CPU"),
    "division by zero": ("{{ 1/0 }}", ChatTemplateError, "division by zero"),
    "a recursive macro": (
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        TemplateBudgetExceeded,
        "recurses too deeply",
    ),
    "a huge range": ("{{ range(10**6)|length }}", TemplateBudgetExceeded, "at most 10000 items"),
    "memory": (
        "{% set ns = namespace(l=[]) %}{% for i in range(10000) %}"
        "{% set ns.l = ns.l + ['x' * 900000] %}{% endfor %}",
        TemplateBudgetExceeded,
        "more than 128 MiB of memory",
    ),
}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[TemplateSandbox]:
    with TemplateSandbox(
        processes=PROCESSES,
        cpu_seconds=0.25,
        max_output_chars=OUTPUT_BUDGET,
        queue_timeout=10,
        memory_bytes=MEMORY_BUDGET,
    ) as started:
        yield started


@pytest.fixture(scope="module")
def qwen_templates() -> ChatTemplates:
    return ChatTemplates.from_directory(qwen_tokenizer_dir())


def pid_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def cpu_ticks(pid: int) -> int:
    """The process's user + system CPU time, in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    # "pid (comm) state ...": comm may hold spaces, so split after its ")"; state is field 3.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def worker_pipes(sandbox: TemplateSandbox) -> dict[int, str]:
    """Each worker's pid and the kernel object ("socket:[inode]") of this process's end of its pipe."""
    return {
        worker.process.pid: os.readlink(f"/proc/self/fd/{worker.connection.fileno()}")
        for worker in sandbox._pool.workers
    }


def open_pipes() -> set[str]:
    """The kernel objects this process has open (other tests' files come and go meanwhile)."""
    objects = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since the listing
            objects.add(os.readlink(f"/proc/self/fd/{fd}"))
    return objects


def wait_for_workers(sandbox: TemplateSandbox, count: int) -> list[int]:
    """The worker pids once ``count`` workers run (replacements start in the background)."""
    deadline = time.monotonic() + 10
    while len(sandbox.worker_pids()) != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return sandbox.worker_pids()


def settle(sandbox: TemplateSandbox) -> list[int]:
    """The worker pids once every worker has started (replacements start in the background)."""
    workers = wait_for_workers(sandbox, PROCESSES)
    deadline = time.monotonic() + 10
    while any(thread.name == "template-sandbox-start" for thread in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return workers


def render_once_a_worker_is_idle(sandbox: TemplateSandbox, template: str) -> str:
    deadline = time.monotonic() + 10
    while True:
        try:
            return sandbox.render(template, HI)
        except SandboxBusy:
            if time.monotonic() > deadline:
                raise


# --- hostile templates ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", HOSTILE_TEMPLATES)
def test_hostile_templates_are_answered_quickly_with_a_template_error(
    case: str, sandbox: TemplateSandbox
) -> None:
    template, error, message = HOSTILE_TEMPLATES[case]
    sandbox.render("{{ messages[0].content }}", HI)  # a worker is ready: only the template is timed
    started = time.perf_counter()

    with pytest.raises(error, match=message):
        sandbox.render(template, HI)

    assert time.perf_counter() - started < 2
    assert sandbox.render("{{ messages[0].content }}", HI) == "hi"


def test_a_worker_over_its_cpu_budget_is_killed_reaped_and_replaced(sandbox: TemplateSandbox) -> None:
    before = settle(sandbox)

    with pytest.raises(TemplateBudgetExceeded, match="more than 250 ms of CPU"):
        sandbox.render(NESTED_LOOPS, HI)

    killed = set(before) - set(sandbox.worker_pids())
    assert len(killed) == 1
    assert not pid_exists(killed.pop())  # gone, not a zombie
    assert sandbox.render("{{ messages[0].content }}", HI) == "hi"
    after = wait_for_workers(sandbox, PROCESSES)
    assert len(set(after) - set(before)) == 1
    assert all(pid_exists(pid) for pid in after)


def test_a_worker_out_of_memory_retires_and_is_replaced(sandbox: TemplateSandbox) -> None:
    before = settle(sandbox)

    with pytest.raises(TemplateBudgetExceeded, match="memory"):
        sandbox.render(HOSTILE_TEMPLATES["memory"][0], HI)

    retired = set(before) - set(sandbox.worker_pids())
    assert len(retired) == 1
    assert not pid_exists(retired.pop())
    assert wait_for_workers(sandbox, PROCESSES) != before


def test_nothing_keeps_running_after_a_kill(sandbox: TemplateSandbox) -> None:
    before = settle(sandbox)
    pipes = worker_pipes(sandbox)

    with pytest.raises(TemplateBudgetExceeded):
        sandbox.render(NESTED_LOOPS, HI)

    workers = settle(sandbox)
    used = {pid: cpu_ticks(pid) for pid in workers}
    time.sleep(0.1)
    assert {pid: cpu_ticks(pid) for pid in workers} == used  # idle: blocked on their pipes
    (killed,) = set(before) - set(workers)
    # The dead worker's end of its pipe is closed here; the survivor's stays open.
    assert open_pipes() & set(pipes.values()) == {pipes[pid] for pid in before if pid != killed}


def test_workers_stop_when_the_web_process_exits_without_closing_the_sandbox() -> None:
    script = (
        "from tokenization.template_sandbox import TemplateSandbox\n"
        "sandbox = TemplateSandbox()\n"
        "assert sandbox.render('{{ 6 * 7 }}', [{'role': 'user', 'content': 'hi'}]) == '42'\n"
        "print(*sandbox.worker_pids())\n"
    )

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert not any(pid_exists(int(pid)) for pid in done.stdout.split())


def test_the_output_budget_applies_in_the_workers(sandbox: TemplateSandbox) -> None:
    with pytest.raises(TemplateBudgetExceeded, match="output passed the 1000000-character budget"):
        sandbox.render("{% for i in range(1000) %}{{ 'x' * 1001 }}{% endfor %}", HI)


# --- same output as in-process -------------------------------------------------------------------

QWEN_CASES = {
    "multi-turn, generation prompt": (MULTI_TURN[:-1], {"add_generation_prompt": True}),
    "tools and tool calls": (TOOL_CONVERSATION, {"tools": [WEATHER_TOOL], "add_generation_prompt": True}),
    "continue the final message": (
        [*MULTI_TURN[:2], {"role": "assistant", "content": "A KV cache is"}],
        {"continue_final_message": True},
    ),
    "thinking disabled": (
        MULTI_TURN[:2],
        {"add_generation_prompt": True, "kwargs": {"enable_thinking": False}},
    ),
}


@pytest.mark.parametrize("case", QWEN_CASES)
def test_the_qwen3_template_renders_as_in_process(
    case: str, sandbox: TemplateSandbox, qwen_templates: ChatTemplates
) -> None:
    messages, options = QWEN_CASES[case]
    template = qwen_templates.templates["default"]

    assert sandbox.render(template, messages, **options) == render_template(template, messages, **options)


def test_a_request_template_renders_in_the_sandbox_as_in_process(
    sandbox: TemplateSandbox, qwen_templates: ChatTemplates
) -> None:
    request_template = qwen_templates.templates["default"] + "{# the request's copy #}"
    options: dict[str, Any] = {
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
        "chat_template": request_template,
    }

    in_sandbox = render_chat(TOOL_CONVERSATION, templates=qwen_templates, sandbox=sandbox, **options)

    # test_chat_templates.py shows that the in-process text is transformers' apply_chat_template's.
    assert in_sandbox.text == render_chat(TOOL_CONVERSATION, templates=qwen_templates, **options).text


def test_renders_from_several_threads_at_once(
    sandbox: TemplateSandbox, qwen_templates: ChatTemplates
) -> None:
    template = qwen_templates.templates["default"]
    conversations = [[{"role": "user", "content": f"Question {n}?"}] for n in range(40)]
    results: dict[int, str] = {}

    def render(n: int) -> None:
        results[n] = sandbox.render(template, conversations[n], add_generation_prompt=True)

    threads = [threading.Thread(target=render, args=(n,)) for n in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert results == {
        n: render_template(template, conversation, add_generation_prompt=True)
        for n, conversation in enumerate(conversations)
    }


# --- which templates go where -----------------------------------------------------------------


def test_request_templates_render_in_the_sandbox_and_the_models_own_in_process(
    sandbox: TemplateSandbox,
) -> None:
    # Output past the sandbox's budget (1,000,000) but within the in-process one (8 Mi).
    long_output = "{{ 'x' * 1000001 }}"
    templates = ChatTemplates(templates={"default": long_output})

    assert len(render_chat(HI, templates=templates, sandbox=sandbox).text) == 1000001
    # A model with one template does not look names up (as transformers): "default" is a template.
    assert render_chat(HI, templates=templates, chat_template="default", sandbox=sandbox).text == "default"
    with pytest.raises(TemplateBudgetExceeded):
        render_chat(HI, templates=templates, chat_template=long_output + " ", sandbox=sandbox)


def test_request_templates_are_refused_when_disabled() -> None:
    templates = ChatTemplates(templates={"default": "model: {{ messages[0].content }}", "tool_use": "tools"})

    with pytest.raises(RequestTemplateRefused, match="KVCACHE_REQUEST_TEMPLATES") as refused:
        render_chat(HI, templates=templates, chat_template="mine: {{ 1 }}", allow_request_templates=False)

    assert "['default', 'tool_use']" in str(refused.value)
    assert isinstance(refused.value, ChatTemplateError)
    assert render_chat(HI, templates=templates, allow_request_templates=False).text == "model: hi"
    named = render_chat(HI, templates=templates, chat_template="tool_use", allow_request_templates=False)
    assert named.text == "tools"


# --- busy and closed ---------------------------------------------------------------------------


def test_callers_get_sandbox_busy_when_every_worker_is_stuck_and_nothing_after_close() -> None:
    with TemplateSandbox(processes=1, cpu_seconds=0.5, queue_timeout=0.05) as sandbox:
        assert sandbox.render("{{ 1 }}", HI) == "1"
        [worker] = sandbox.worker_pids()
        barrier = threading.Barrier(2)
        outcomes: list[type[BaseException]] = []

        def render() -> None:
            barrier.wait()
            try:
                sandbox.render(NESTED_LOOPS, HI)
            except (SandboxBusy, TemplateBudgetExceeded) as error:
                outcomes.append(type(error))

        threads = [threading.Thread(target=render) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert sorted(outcomes, key=lambda kind: kind.__name__) == [SandboxBusy, TemplateBudgetExceeded]
        assert not pid_exists(worker)
        assert render_once_a_worker_is_idle(sandbox, "{{ 2 }}") == "2"  # its replacement is up
        workers = sandbox.worker_pids()

    assert sandbox.worker_pids() == []
    assert not any(pid_exists(pid) for pid in workers)
    with pytest.raises(SandboxBusy, match="closed"):
        sandbox.render("{{ 1 }}", HI)
