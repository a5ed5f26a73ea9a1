"""The layering the style guide asks for, checked: the core and the fast path import no Django,
``scoring`` never imports ``ingest`` (ingest builds on scoring, not the other way round), and the
registry's reads and writes do not import each other in a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CORE = [
    "scoring.fastpath.app",
    "scoring.read_path",
    "registry.snapshot",
    "tokenization.large_prompts",
    "tokenization.template_sandbox",
    "kvindex",
    "kvindex.keys",
    "scoring.scorer",
    "kvindex.shared_stats",
    "registry.liveness",
    "ingest.events",
    "ingest.applier",
    "ingest.pool",
    "ingest.resync",
    "ingest.replay",
    "ingest.pipeline",
    "ingest.history",
    "kvindex.epochs",
    "gateway.app",
    "gateway.policies",
    "gateway.memory",
    "gateway.load",
]


def test_the_core_and_the_fast_path_import_no_django():
    probe = (
        f"import sys; import {', '.join(CORE)}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'channels')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code (function-level imports too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_scoring_never_imports_ingest():
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imports_of(path) if m.split(".")[0] == "ingest")
        for path in (ROOT / "scoring").rglob("*.py")
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_lower_layers_never_import_the_gateway():
    """The gateway builds on scoring (the read path, the index); nothing below imports it."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imports_of(path) if m.split(".")[0] == "gateway")
        for package in ("scoring", "ingest", "simulator", "dashboard")
        for path in (ROOT / package).rglob("*.py")
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_selectors_and_services_do_not_import_each_other_in_a_circle():
    selectors = imports_of(ROOT / "registry" / "selectors.py")
    assert not {"registry.services", "registry.runtime"} & selectors
