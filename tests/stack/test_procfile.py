"""The Procfile as ``python -m stack`` reads it: honcho's ``name: command`` lines, plus the
``# stack stop-order:`` and ``# stack essential:`` comments, checked so that no process can be
left out of the shutdown order."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.procfile import ProcfileError, parse_procfile, read_procfile

ROOT = Path(__file__).resolve().parents[2]


def test_the_project_procfile_stops_the_load_first_ingest_late_and_valkey_last():
    procfile = read_procfile(ROOT / "Procfile")

    assert list(procfile.commands) == [
        "redis",
        "web",
        "ingest",
        "sim",
        "gateway",
        "epp",
        "envoy",
        "loadgen",
        "vllm",
        "vllmload",
    ]
    assert procfile.stop_order == (
        ("loadgen", "vllmload"),
        ("sim", "vllm"),
        ("envoy",),
        ("web", "gateway", "epp"),
        ("ingest",),
        ("redis",),
    )
    assert procfile.essential == {"redis", "web", "ingest", "gateway", "epp", "envoy"}


def test_the_project_procfile_gives_each_valkey_port_its_own_append_only_file():
    assert '--appendfilename "index-$REDIS_PORT.aof"' in read_procfile(ROOT / "Procfile").commands["redis"]


def test_without_directives_all_stop_together_and_all_are_essential_as_under_honcho():
    procfile = parse_procfile("# a comment\n\nweb: serve --port $PORT\nworker:   work\n")

    assert procfile.commands == {"web": "serve --port $PORT", "worker": "work"}
    assert procfile.stop_order == (("web", "worker"),)
    assert procfile.essential == {"web", "worker"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# stack stop-order: a\na: x\nb: y\n", "line 1: '# stack stop-order:' leaves out b"),
        ("# stack stop-order: a > a\na: x\n", "names a more than once"),
        ("# stack stop-order: a > > b\na: x\nb: y\n", "an empty stage"),
        ("# stack stop-order: a > c\na: x\n", "names c, not a process of this Procfile"),
        ("# stack essential: web\na: x\n", "'# stack essential:' names web, not a process"),
        ("# stack stop_order: a\na: x\n", "line 1: unknown directive '# stack stop_order:'"),
        ("# stack essential: a\n# stack essential: a\na: x\n", "line 2: '# stack essential:' given twice"),
        ("a: x\na: y\n", "line 2: process 'a' is defined twice"),
        ("# only comments\n", "no processes"),
    ],
)
def test_an_ambiguous_procfile_is_refused_with_the_line_and_the_fix(text, message):
    with pytest.raises(ProcfileError) as refused:
        parse_procfile(text)

    assert message in str(refused.value)
