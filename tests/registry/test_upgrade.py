"""A database made before the registry had a package of its own (migration head ``scoring`` 0008,
dumped in ``fixtures/registry-at-0008.sql``) upgrades with ``manage.py migrate`` and keeps every
row: the app label stays ``scoring``, so its tables, migration history, permissions and admin URLs
are the registry's as they were. The migrations since add to the rows, and take back only the
addresses ingest once took from pod ids (0009)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DUMP = Path(__file__).parent / "fixtures" / "registry-at-0008.sql"

pytestmark = pytest.mark.slow

# Run with today's code against the upgraded database: what the ORM, the registry snapshot and the
# admin make of the old rows.
READ_BACK = """
import json, django
django.setup()
from django.contrib.auth import authenticate
from django.urls import reverse
from registry.models import ModelConfig, Pod
from registry.selectors import load_service_config
config = load_service_config()
print(json.dumps({
    "pods": sorted(Pod.objects.values_list("pod_id", "address", "enabled", "health", "registered")),
    "models": sorted(ModelConfig.objects.values_list("name", "block_size", "max_model_len")),
    "seed": config.seed,
    "groups": [g.kind for g in config.model("google/gemma-3-1b-it").kv_cache_groups],
    "admin_logs_in": authenticate(username="admin", password="pre-move-password") is not None,
    "admin_url": reverse("admin:scoring_pod_changelist"),
}))
"""


def table_rows(database: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(database) as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {table: sorted(db.execute(f'SELECT * FROM "{table}"'), key=repr) for table in tables}


def test_a_database_made_before_the_move_migrates_without_loss(tmp_path):
    database = tmp_path / "db.sqlite3"
    with sqlite3.connect(database) as db:
        db.executescript(DUMP.read_text())
    before = table_rows(database)
    assert len(before["scoring_pod"]) == 3 and len(before["scoring_modelconfig"]) == 2

    env = {**os.environ, "DATABASE_URL": f"sqlite:///{database}", "KVCACHE_VAR_DIR": str(tmp_path)}
    env["DJANGO_SETTINGS_MODULE"] = "kvsite.settings"
    manage = [sys.executable, "manage.py"]
    migrated = subprocess.run(
        [*manage, "migrate", "--noinput"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert migrated.returncode == 0, migrated.stderr
    assert "scoring.0001_registry" not in migrated.stdout  # the app's history was recognized
    assert "Applying scoring.0009_pod_trust... OK" in migrated.stdout

    after = table_rows(database)
    for table, rows in before.items():  # every row of every table, the migration history included
        if table not in ("scoring_pod", "scoring_modelconfig", "sqlite_sequence"):  # read back below
            assert set(rows) <= set(after[table]), table
    assert len(after["scoring_pod"]) == len(before["scoring_pod"])
    assert len(after["scoring_modelconfig"]) == len(before["scoring_modelconfig"])
    pending = subprocess.run(
        [*manage, "migrate", "--check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert pending.returncode == 0, pending.stdout + pending.stderr

    read = subprocess.run(
        [sys.executable, "-c", READ_BACK], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(read.stdout) == {
        "pods": [
            ["10.0.0.1:8000", "", True, "up", False],  # its address was its id, seen by ingest: 0009
            ["gemma-0", "", True, "unknown", True],
            ["sim-1", "127.0.0.1:8101", False, "down", True],
        ],
        "models": [["Qwen/Qwen3-0.6B", 32, 4096], ["google/gemma-3-1b-it", 16, None]],
        "seed": "42",
        "groups": ["full_attention", "sliding_window"],
        "admin_logs_in": True,
        "admin_url": "/admin/scoring/pod/",
    }
