"""The Prometheus assets in ``deploy/prometheus/`` as Prometheus's own tool reads them: ``promtool``
(installed by ``make system-deps``) accepts the alert rules and the example scrape configuration,
and the rules' unit tests (``kvcache-alerts.test.yaml``) pass, with every alert seen firing on
series that should page and staying quiet on healthy ones."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "kvcache-alerts.yaml"
RULE_TESTS = PROMETHEUS / "kvcache-alerts.test.yaml"
SCRAPE_CONFIG = PROMETHEUS / "scrape-config.example.yaml"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH: run `make system-deps` (it installs Debian's promtool)")
    return path


def run(promtool: str, *args: str | Path) -> str:
    """``promtool args`` from the repository root; its output, failing the test with it unless it
    exits 0."""
    done = subprocess.run(
        [promtool, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


def alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def test_promtool_accepts_every_rule(promtool):
    output = run(promtool, "check", "rules", RULES.relative_to(ROOT))
    assert f"SUCCESS: {len(alert_names())} rules found" in output


def test_promtool_accepts_the_example_scrape_config_and_the_rules_it_loads(promtool):
    output = run(promtool, "check", "config", SCRAPE_CONFIG.relative_to(ROOT))
    assert "SUCCESS: 1 rule files found" in output


def test_the_rules_unit_tests_pass(promtool):
    output = run(promtool, "test", "rules", RULE_TESTS.relative_to(ROOT))
    assert "SUCCESS" in output


def test_every_alert_is_unit_tested_firing_and_quiet():
    """Each alert of the rules has a promtool case where it fires (``exp_alerts`` not empty) and
    one where it does not (healthy series, or not yet for its ``for``)."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    cases = [case for test in tests["tests"] for case in test.get("alert_rule_test", ())]
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    names = set(alert_names())
    assert not names - firing, f"never seen firing in {RULE_TESTS.name}: {sorted(names - firing)}"
    assert not names - quiet, f"never seen quiet in {RULE_TESTS.name}: {sorted(names - quiet)}"
    assert not (firing | quiet) - names, f"tests of alerts the rules lack: {sorted((firing | quiet) - names)}"
