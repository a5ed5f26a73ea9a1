"""The layering of the README's architecture, checked: ``make lint`` runs the import contracts in
``pyproject.toml`` (``lint-imports``); these tests check that the contracts bite, and that the
core they name imports no Django at run time either (an import made by name, through importlib,
is invisible to a static graph)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def contract(contract_id: str) -> dict:
    return next(c for c in CONFIG["contracts"] if c.get("id") == contract_id)


def test_the_core_imports_no_django_at_run_time():
    core = contract("core")["source_modules"]
    probe = (
        f"import sys; import {', '.join(core)}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'channels')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_box_is_in_the_layers():
    """A top-level package left out of the layers would escape the circle check."""
    boxes = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", "bench", "conformance"}
    layered = {box.strip() for layer in CONFIG["contracts"][0]["layers"] for box in layer.split("|")}
    assert boxes == layered == set(CONFIG["root_packages"])


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=120
    )


def test_the_contracts_pass_here_and_catch_a_wrong_import(tmp_path):
    for package in CONFIG["root_packages"]:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint(tmp_path).returncode == 0

    with (tmp_path / "kvindex" / "keys.py").open("a") as f:
        f.write("\nimport django  # planted\n")
    with (tmp_path / "registry" / "config.py").open("a") as f:
        f.write("\nfrom scoring import scorer  # planted: a circle registry -> scoring -> registry\n")
    with (tmp_path / "ingest" / "events.py").open("a") as f:
        f.write("\nfrom scoring import read_path  # planted\n")
    result = lint(tmp_path)
    assert result.returncode == 1
    broken = {line.removesuffix(" BROKEN") for line in result.stdout.splitlines() if line.endswith(" BROKEN")}
    assert broken == {
        "The boxes are layered: each imports only the boxes below it",
        "kvindex, tokenization and stack import no Django",
        "ingest never imports scoring, gateway or dashboard",
        "The core imports no Django",
        "engines never import ingest or scoring",  # through registry.config, the planted import
    }
    assert "kvindex.keys -> django" in result.stdout
    assert "registry.config -> scoring.scorer" in result.stdout
