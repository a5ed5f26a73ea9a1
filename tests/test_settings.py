"""What every process gets from ``kvsite.settings`` before it does anything else."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_command_that_imports_transformers_prints_no_pytorch_advice(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("TRANSFORMERS_")}
    env.update(DJANGO_SETTINGS_MODULE="kvsite.settings", KVCACHE_VAR_DIR=str(tmp_path))

    def output(*argv: str) -> str:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    # Without our settings, transformers advises at import that PyTorch is missing.
    assert "PyTorch" in output(sys.executable, "-c", "import transformers")
    assert "PyTorch" not in output(sys.executable, "manage.py", "shell", "-c", "import transformers")


@pytest.mark.slow
def test_the_channel_layer_outwaits_a_quiet_channel(redis_url: str) -> None:
    """channels-redis blocks 5 s per wait for a message: a socket timeout of 5 s (redis-py's
    default) made a quiet channel an error, which closed the dashboard's websocket."""
    from channels_redis.core import RedisChannelLayer
    from django.conf import settings

    host = {**settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0], "address": redis_url}
    layer = RedisChannelLayer(hosts=[host])

    async def scenario() -> None:
        channel = await layer.new_channel()
        with pytest.raises(TimeoutError):  # asyncio's: no message came, and nothing failed
            await asyncio.wait_for(layer.receive(channel), 6.5)
        await layer.flush()

    asyncio.run(scenario())
