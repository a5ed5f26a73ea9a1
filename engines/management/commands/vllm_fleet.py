"""``manage.py vllm_fleet``: real vLLM engines, registered, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engines.fleet import EngineError, EngineSpec, engine_env_seed, start_engines
from engines.registration import register_model
from registry.services import current_hash_seed, register_pods

DEFAULT_MODEL = "qwen3-41m-random"


class Command(BaseCommand):
    help = (
        "Start N real vLLM engines (vLLM 0.32 on the CPU, var/vllm) serving the random-weight Qwen3 "
        "of var/vllm-model, publishing KV events to ingest; once each answers /health, register its "
        "model (block size, tokenizer, context length) and each engine (address and replay "
        "endpoint) in the registry; stop them all on SIGTERM or Ctrl-C. `make run FLEET=vllm` runs it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        var = Path(settings.VAR_DIR)
        parser.add_argument("--pods", type=int, default=2, help="Engines to start (default 2).")
        parser.add_argument(
            "--model", default=DEFAULT_MODEL, help=f"Served model name (default {DEFAULT_MODEL})."
        )
        parser.add_argument(
            "--model-dir", type=Path, default=var / "vllm-model", help="The model (engines/prepare.py)."
        )
        parser.add_argument("--vllm", type=Path, default=var / "vllm" / "bin" / "vllm", help="The vllm CLI.")
        parser.add_argument("--base-port", type=int, default=8300, help="Engine i serves on this port + i.")
        parser.add_argument(
            "--replay-port", type=int, default=9300, help="Engine i replays on this port + i."
        )
        parser.add_argument(
            "--events-endpoint",
            default="tcp://127.0.0.1:5557",
            help="Where ingest's SUB is bound (every engine connects to it).",
        )
        parser.add_argument(
            "--kv-cache-mib",
            type=int,
            default=16,
            help="KV cache per engine, MiB (default 16: 256 blocks).",
        )
        parser.add_argument("--max-model-len", type=int, default=4096)
        parser.add_argument("--start-timeout", type=float, default=300.0, help="Seconds to wait for /health.")

    def handle(self, *args, **options) -> None:
        if options["pods"] < 1:
            raise CommandError("--pods must be at least 1")
        seed = current_hash_seed().value
        try:
            engine_env_seed(seed)
        except EngineError as error:
            raise CommandError(str(error)) from None
        model_dir = options["model_dir"].resolve()
        if not (model_dir / "config.json").exists():
            raise CommandError(f"no model in {model_dir}: `make vllm-engines` generates it")
        cores = _cores()
        specs = [
            EngineSpec(
                pod=f"vllm-{i}",
                model=options["model"],
                model_dir=model_dir,
                port=options["base_port"] + i,
                replay_port=options["replay_port"] + i,
                events_endpoint=options["events_endpoint"],
                kv_cache_bytes=options["kv_cache_mib"] * 1024 * 1024,
                max_model_len=options["max_model_len"],
                core=cores[i % len(cores)],
                hash_seed=seed,
            )
            for i in range(options["pods"])
        ]
        try:  # the model first: its tokenizer must load
            register_model(
                model=specs[0].model,
                model_dir=model_dir,
                block_size=specs[0].block_size,
                max_model_len=specs[0].max_model_len,
            )
        except ValidationError as error:
            raise CommandError(f"cannot register the model {specs[0].model}: {error}") from None
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write(f"starting {len(specs)} vLLM engine(s) of {specs[0].model} (about 40 s)")
        self.stdout.flush()
        try:
            engines = start_engines(
                specs,
                vllm=options["vllm"],
                var=Path(settings.VAR_DIR) / "vllm-run",
                timeout=options["start_timeout"],
                out=self.stdout,
            )
        except EngineError as error:
            raise CommandError(str(error)) from None
        try:
            register_pods((s.pod, s.model, s.address, s.replay_endpoint) for s in specs)
            for s in specs:
                self.stdout.write(
                    f"  {s.pod}  {s.url}  replay {s.replay_endpoint}  core {s.core}  registered"
                )
            self.stdout.flush()
            while not stop.wait(1.0):
                for engine in engines:
                    if engine.proc.poll() is not None:
                        raise CommandError(f"{engine.spec.pod} ended with exit code {engine.proc.returncode}")
        finally:
            for engine in engines:
                engine.stop()
            self.stdout.write("vLLM engines stopped")


def _cores() -> list[int]:
    """The cores this process may run on: engine i is bound to the i-th (round robin)."""
    return sorted(os.sched_getaffinity(0))
