"""``python manage.py simulate``: N simulated vLLM pods in this process (``simulator.fleet``).

A thin shell: options -> ``FleetConfig``. What the manager keys blocks with comes from the registry
by default, so that pods and manager agree on every block key: the hash seed (``HashSeed``, else
``KVCACHE_HASH_SEED``), the model's block size and chat template (``ModelConfig``), and the
tokenizer (the manager's ``TokenizerRegistry``). SIGINT/SIGTERM stop the servers (in-flight
requests get 2 s) and exit 0.

Prefill/decode disaggregation: ``--role`` gives every pod of the run a role, ``--prefill-pods N``
makes a P/D fleet in one process (the first N pods prefill, the others decode); ``--register``
registers the roles with the pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import zmq
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from ingest.curve import CurveError, EventCurve, load_key_pair, load_public_key
from registry.config import POD_ROLES, ServiceConfig
from registry.services import register_pods
from simulator.config import (
    FAILURE_TYPES,
    ConfigError,
    EngineConfig,
    FailureConfig,
    LatencyConfig,
    LoraAdapter,
    PodConfig,
)
from simulator.fleet import Fleet, FleetConfig, PublishConfig
from simulator.pod import PodTokenizer
from simulator.publisher import should_bind
from tokenization.tokenizers import TokenizerError, TokenizerRegistry

_NO_ENDPOINT = ("", "none", "off")


def registry_config() -> ServiceConfig:
    """The registry snapshot (hash seed, model settings); the settings' defaults when the database
    is not usable (not migrated yet, unreachable)."""
    from registry.runtime import service_config

    try:
        return service_config()
    except DatabaseError:
        return ServiceConfig(seed=settings.KVCACHE_HASH_SEED, default_block_size=settings.KVCACHE_BLOCK_SIZE)


def publish_curve(options: dict[str, Any]) -> EventCurve | None:
    """The pods' CURVE keys (``--curve-*``), None without ``--curve-secret-key-file``;
    ``CurveError`` (a ``ValueError``) for a missing or malformed file."""
    secret_key_file, server_key_file = options["curve_secret_key_file"], options["curve_server_key_file"]
    if not secret_key_file:
        if server_key_file:
            raise CurveError("--curve-server-key-file needs --curve-secret-key-file (the pods' key pair)")
        return None
    return EventCurve(
        keys=load_key_pair(secret_key_file, what="--curve-secret-key-file"),
        server_key=load_public_key(server_key_file, what="--curve-server-key-file")
        if server_key_file
        else None,
    )


def fleet_config(options: dict[str, Any], *, registry: ServiceConfig) -> FleetConfig:
    """The fleet the options describe; ``ConfigError``/``ValueError`` for invalid ones."""
    loras = []
    for i, spec in enumerate(options["lora"] or [], start=1):
        name, eq, path = spec.partition("=")
        if not name:
            raise ConfigError(f"--lora {spec!r} must be NAME or NAME=PATH")
        loras.append(LoraAdapter(name=name, path=path if eq else name, lora_id=i))
    types = tuple(t.strip() for t in options["failure_types"].split(",") if t.strip())
    prefill_pods = options["prefill_pods"]
    if prefill_pods and options["role"] != "both":
        raise ConfigError("--prefill-pods gives the pods their roles (prefill, then decode): drop --role")
    if prefill_pods > options["pods"]:
        raise ConfigError(f"--prefill-pods {prefill_pods} is more than --pods ({options['pods']})")
    endpoint = options["events_endpoint"]
    model = registry.model(options["model"])
    hash_seed = options["hash_seed"] if options["hash_seed"] is not None else registry.seed
    block_size = options["block_size"] if options["block_size"] is not None else model.block_size
    pod = PodConfig(
        pod_id="template",
        model=options["model"],
        engine=EngineConfig(
            block_size=block_size,
            kv_cache_size=options["kv_cache_size"],
            max_num_seqs=options["max_num_seqs"],
            max_waiting=options["max_waiting"],
            max_model_len=options["max_model_len"],
            hash_seed=hash_seed,
        ),
        latency=LatencyConfig(
            prefill_overhead_ms=options["prefill_overhead_ms"],
            prefill_time_per_token_ms=options["prefill_time_per_token_ms"],
            inter_token_latency_ms=options["inter_token_latency_ms"],
            load_factor=options["load_factor"],
            jitter=options["jitter"],
            kv_cache_transfer_latency_ms=options["kv_cache_transfer_latency_ms"],
            kv_cache_transfer_time_per_token_ms=options["kv_cache_transfer_time_per_token_ms"],
            prefill_interference=options["prefill_interference"],
        ),
        failures=FailureConfig(rate=options["failure_rate"], types=types),
        output_mode=options["output_mode"],
        seed=options["seed"],
        data_parallel_size=options["data_parallel_size"],
        lora_adapters=tuple(loras),
        role=options["role"],
    )
    return FleetConfig(
        pod=pod,
        pods=options["pods"],
        host=options["host"],
        base_port=options["base_port"],
        pod_id_style=options["pod_id_style"],
        prefill_pods=prefill_pods,
        publish=PublishConfig(
            endpoint=None if endpoint.lower() in _NO_ENDPOINT else endpoint,
            layout=options["event_layout"],
            replay_endpoint=options["replay_endpoint"] or None,
            replay_layout=options["replay_layout"],
            buffer_steps=options["replay_buffer_steps"],
            curve=publish_curve(options),
        ),
    )


def load_tokenizer(model: str, *, chat_template: str) -> PodTokenizer:
    """The model's tokenizer from the manager's registry (configured from the settings and the
    model config); without a usable database, from the settings' sources only."""
    from registry.runtime import build_tokenizers

    try:
        return PodTokenizer(build_tokenizers(), model, chat_template=chat_template)
    except DatabaseError:
        directory = settings.KVCACHE_TOKENIZERS_DIR
        registry = TokenizerRegistry(
            tokenizers_dir=Path(directory) if directory else None, allow_hub=settings.KVCACHE_ALLOW_HUB
        )
        return PodTokenizer(registry, model, chat_template=chat_template)


def announced(fleet: Fleet) -> list[tuple[str, str, str, str]]:
    """``(pod, model, address, replay endpoint)`` of each running pod, for the registry: the
    address is host:port of its HTTP server, the replay endpoint its rank 0's (connectable: a
    wildcard bind is named by the pod's host)."""
    rows = []
    for pod in fleet.pods:
        address = pod.url.removeprefix("http://")
        replay = pod.publishers[0].replay_bound_endpoint if pod.publishers else None
        if replay:
            host = address.rpartition(":")[0]
            replay = replay.replace("tcp://0.0.0.0:", f"tcp://{host}:").replace(
                "tcp://[::]:", f"tcp://{host}:"
            )
        rows.append((pod.pod_id, fleet.config.pod.model, address, replay or ""))
    return rows


def announced_event_endpoints(fleet: Fleet) -> dict[str, str]:
    """pod -> where its rank 0's KV-event PUB binds (connectable: a wildcard bind is named by the
    pod's host), for the pods whose PUB binds (none when the PUBs connect to ingest): what a
    subscriber that connects to each engine (``ingest --replica``, ``--index in-process``) needs."""
    found = {}
    for pod in fleet.pods:
        if not pod.publishers or not should_bind(pod.publishers[0].endpoint):
            continue
        host = pod.url.removeprefix("http://").rpartition(":")[0]
        bound = pod.publishers[0].bound_endpoint
        found[pod.pod_id] = bound.replace("tcp://0.0.0.0:", f"tcp://{host}:").replace(
            "tcp://[::]:", f"tcp://{host}:"
        )
    return found


def announced_roles(fleet: Fleet) -> dict[str, str]:
    """pod -> its role, for the registry."""
    return {pod.pod_id: pod.pod.config.role for pod in fleet.pods}


class Command(BaseCommand):
    help = "Run N simulated vLLM pods (OpenAI HTTP + KV events over ZeroMQ) in one process."

    def add_arguments(self, parser: CommandParser) -> None:
        d_engine, d_latency = EngineConfig(), LatencyConfig()
        fleet = parser.add_argument_group("fleet")
        fleet.add_argument("--pods", type=int, default=1, help="How many pods (default 1).")
        fleet.add_argument(
            "--base-port", type=int, default=8000, help="Pod i serves HTTP on this + i (0: any)."
        )
        fleet.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1).")
        fleet.add_argument("--model", default="Qwen/Qwen3-0.6B", help="Served model (its tokenizer is used).")
        fleet.add_argument(
            "--pod-id-style",
            choices=["sim", "hostport"],
            default="sim",
            help="Pod ids sim-<i> (default) or <host>:<port>.",
        )
        fleet.add_argument(
            "--lora", action="append", metavar="NAME[=PATH]", help="A LoRA adapter loaded at start."
        )
        fleet.add_argument(
            "--role",
            choices=POD_ROLES,
            default="both",
            help="What every pod is for under prefill/decode disaggregation (default both); announced "
            "(/server_info, --register), any pod serves both sides of a transfer.",
        )
        fleet.add_argument(
            "--prefill-pods",
            type=int,
            default=0,
            metavar="N",
            help="A P/D fleet: the first N pods are prefill pods, the others decode pods.",
        )

        events = parser.add_argument_group("KV events")
        events.add_argument(
            "--events-endpoint",
            default="tcp://127.0.0.1:5557",
            help="ZeroMQ PUB endpoint; binds if it has '*' or '::' or is ipc:// or inproc://, else "
            "connects (vLLM's rule). 'none' disables events.",
        )
        events.add_argument(
            "--event-layout", choices=["array", "map"], default="map", help="array (vLLM <= 0.23) or map."
        )
        events.add_argument(
            "--replay-endpoint", default=None, help="ROUTER endpoint for replay (port + i*dp + r)."
        )
        events.add_argument(
            "--replay-layout",
            choices=["topic", "legacy"],
            default="topic",
            help="Replies [b'', topic, seq, payload] (vLLM >= 0.26, default) or [b'', seq, payload].",
        )
        events.add_argument(
            "--replay-buffer-steps", type=int, default=10_000, help="Batches kept for replay."
        )
        events.add_argument(
            "--curve-secret-key-file",
            default=None,
            metavar="FILE",
            help="Publish (and replay) over CURVE with this key pair (a NAME.key_secret certificate "
            "from manage.py curve_keys; every pod uses it): the client of ingest's bound SUB, or the "
            "server where the PUB binds and on the replay ROUTER.",
        )
        events.add_argument(
            "--curve-server-key-file",
            default=None,
            metavar="FILE",
            help="Ingest's public certificate (its NAME.key): needed with --curve-secret-key-file "
            "when the PUB connects.",
        )
        events.add_argument(
            "--register",
            action="store_true",
            help="Write each pod's address, role, replay endpoint and, when its PUB binds, its event "
            "endpoint into the pod registry once serving (what a deployment would tell the registry "
            "about real engines).",
        )

        engine = parser.add_argument_group("engine")
        engine.add_argument(
            "--block-size", type=int, default=None, help="Tokens per KV block (default: the model config's)."
        )
        engine.add_argument(
            "--kv-cache-size", type=int, default=d_engine.kv_cache_size, help="KV cache size in blocks."
        )
        engine.add_argument(
            "--hash-seed", default=None, help="PYTHONHASHSEED of the block hashes (default: the registry's)."
        )
        engine.add_argument(
            "--max-num-seqs", type=int, default=d_engine.max_num_seqs, help="Requests running at once."
        )
        engine.add_argument(
            "--max-waiting", type=int, default=d_engine.max_waiting, help="Waiting-queue length (more: 429)."
        )
        engine.add_argument(
            "--max-model-len", type=int, default=d_engine.max_model_len, help="Context window."
        )
        engine.add_argument(
            "--data-parallel-size", "--dp", type=int, default=1, help="Engines per pod (ranks)."
        )
        engine.add_argument(
            "--output-mode", choices=["echo", "random"], default="echo", help="What pods answer."
        )
        engine.add_argument(
            "--seed", type=int, default=0, help="Seed of generated text, failures and jitter."
        )

        latency = parser.add_argument_group("latency (milliseconds)")
        latency.add_argument("--prefill-overhead-ms", type=float, default=d_latency.prefill_overhead_ms)
        latency.add_argument(
            "--prefill-time-per-token-ms", type=float, default=d_latency.prefill_time_per_token_ms
        )
        latency.add_argument("--inter-token-latency-ms", type=float, default=d_latency.inter_token_latency_ms)
        latency.add_argument(
            "--load-factor",
            type=float,
            default=d_latency.load_factor,
            help="Latency multiplier at a full batch.",
        )
        latency.add_argument(
            "--jitter", type=float, default=d_latency.jitter, help="Relative std-dev, 0 to 0.3."
        )
        latency.add_argument(
            "--kv-cache-transfer-latency-ms",
            type=float,
            default=d_latency.kv_cache_transfer_latency_ms,
            help="Fixed part of loading a prompt's KV cache from its prefill pod (do_remote_prefill).",
        )
        latency.add_argument(
            "--kv-cache-transfer-time-per-token-ms",
            type=float,
            default=d_latency.kv_cache_transfer_time_per_token_ms,
            help="Per prompt token loaded (those not hit in the pod's own cache).",
        )
        latency.add_argument(
            "--prefill-interference",
            type=float,
            default=d_latency.prefill_interference,
            help="ITL slow-down per request prefilling on the engine meanwhile (chunked prefill; default 0).",
        )

        failures = parser.add_argument_group("failure injection")
        failures.add_argument(
            "--failure-rate", type=float, default=0.0, help="Percent of requests that fail."
        )
        failures.add_argument(
            "--failure-types",
            default=",".join(FAILURE_TYPES),
            help=f"Comma-separated, from {', '.join(FAILURE_TYPES)}.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.register = options["register"]
        registry = registry_config()
        try:
            config = fleet_config(options, registry=registry)
        except (ConfigError, ValueError) as error:
            raise CommandError(str(error)) from None
        try:
            tokenizer = load_tokenizer(
                config.pod.model, chat_template=registry.model(config.pod.model).chat_template
            )
        except TokenizerError as error:
            raise CommandError(str(error)) from None
        try:
            asyncio.run(self._run(Fleet(config, tokenizer=tokenizer)))
        except (OSError, zmq.ZMQError) as error:
            raise CommandError(f"cannot start the fleet: {error}") from None

    async def _run(self, fleet: Fleet) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with fleet:
            c = fleet.config
            self.stdout.write(
                f"{c.pods} simulated pod(s) of {c.pod.model}, hash seed {c.pod.engine.hash_seed!r}, "
                f"block size {c.pod.engine.block_size}, {c.pod.engine.kv_cache_size} blocks"
            )
            for i, pod in enumerate(fleet.pods):
                ends = ", ".join(
                    f"rank {r}: {e or '-'} replay {p or '-'}" for r, (e, p) in enumerate(fleet.endpoints(i))
                )
                role = "" if pod.pod.config.role == "both" else f"  {pod.pod.config.role}"
                self.stdout.write(f"  {pod.pod_id}  {pod.url}{role}  events {ends}")
            if c.publish.curve is not None:
                self.stdout.write(
                    f"  events over CURVE, the pods' public key {c.publish.curve.keys.public.decode()}"
                )
            if self.register:
                events = announced_event_endpoints(fleet)
                await sync_to_async(register_pods)(
                    announced(fleet), event_endpoints=events, roles=announced_roles(fleet)
                )
                what = "addresses, roles, replay endpoints" + (" and event endpoints" if events else "")
                self.stdout.write(f"  registered: {what} are in the pod registry")
            self.stdout.flush()
            await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
