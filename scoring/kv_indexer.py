"""NVIDIA Dynamo's standalone KV-indexer API (``python -m dynamo.indexer``, 1.6; the Mooncake
KV-indexer convention) over our registry and index: its requests, our names for its names, and
its answers. No Django: ``scoring.fastpath.kv_indexer`` serves the reads, ``kvsite.kv_indexer``
the registry writes.

Names, one way each:

* ``instance_id`` N (Dynamo's u64 worker id) is our pod ``"N"``; a pod whose id is not a decimal
  number is answered with its id as a string (a client may also send one: an extension).
* ``dp_rank`` r is our index holder ``pod#dp<r>`` (rank 0: the pod itself), as ingest names the
  data-parallel ranks an engine's batches carry (``registry.config.DP_RANK_SEPARATOR``).
* ``routing_group`` (Dynamo's partition of a model's workers): only ``"default"``, our one
  partition per model. ``tenant_id`` is read and ignored, as Dynamo 1.6 does (a legacy alias);
  ``cache_salt`` is vLLM's salt, mixed into the keys as ``/api/v1/score`` mixes it.
* A model "has an indexer" (else 404, Dynamo's words) when registered pods serve it or it has a
  model config.

Errors are Dynamo's statuses with a JSON body ``{"error": message}`` (where Dynamo answers some
in plain text: a body that is not JSON, 400; a field of the wrong type or missing, 422).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from msgspec import Meta, Struct

from kvindex.base import PodBlocks
from kvindex.dynamo import HeldBlocks, runs
from kvindex.kv_cache_groups import is_group_holder
from registry.config import DP_RANK_SEPARATOR, ServiceConfig, owner_pod
from scoring.fastpath.schema import MAX_NAME_CHARS, U64_MAX, RequestError, decode
from scoring.read_path import ScoreResult

DEFAULT_GROUP = "default"
U32_MAX = (1 << 32) - 1
MAX_DP_RANK = 63
"""Highest rank ingest takes from an engine (64 ranks per pod)."""

InstanceId = Annotated[int, Meta(ge=0)] | Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Text = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Rank = Annotated[int, Meta(ge=0, le=MAX_DP_RANK)]


class RegisterRequest(Struct, kw_only=True):
    """``POST /kv-indexer/register``: Dynamo's fields (``additional_salt``, which Dynamo ignores
    too, and unknown fields are ignored)."""

    instance_id: InstanceId
    endpoint: Annotated[str, Meta(min_length=1, max_length=1024)]
    model_name: Name
    block_size: Annotated[int, Meta(ge=0, le=U32_MAX)]
    routing_group: Text = DEFAULT_GROUP
    tenant_id: Text | None = None
    dp_rank: Rank | None = None
    replay_endpoint: Annotated[str, Meta(max_length=1024)] | None = None


class UnregisterRequest(Struct, kw_only=True):
    """``POST /kv-indexer/unregister``: without ``routing_group`` the whole instance goes (Dynamo
    then ignores ``dp_rank``); with it and ``dp_rank``, that rank only."""

    instance_id: InstanceId
    model_name: Name
    routing_group: Text | None = None
    tenant_id: Text | None = None
    dp_rank: Rank | None = None


class QueryRequest(Struct, kw_only=True):
    """``POST /kv-indexer/query``: the matched tokens of ``token_ids`` per instance and rank."""

    token_ids: list[Annotated[int, Meta(ge=0, le=U32_MAX)]]
    model_name: Name
    routing_group: Text = DEFAULT_GROUP
    tenant_id: Text | None = None
    lora_name: Text | None = None
    cache_salt: Text | None = None


class QueryByHashRequest(Struct, kw_only=True):
    """``POST /kv-indexer/query_by_hash``: Dynamo's own block hashes (refused: ``by_hash_refusal``)."""

    block_hashes: list[int]
    model_name: Name
    routing_group: Text = DEFAULT_GROUP
    tenant_id: Text | None = None
    cache_salt: Text | None = None


class IndexerError(Exception):
    """A refused request: ``status`` and Dynamo's body, ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, str]:
        return {"error": self.message}


def decode_request(body: bytes, content_type: str | None, kind: type[Struct], *, max_depth: int) -> Any:
    """``body`` as a ``kind``, refused as Dynamo refuses it: 415 without ``Content-Type:
    application/json``, 400 when it is not JSON, 422 when a field is missing or of the wrong type."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise IndexerError(415, "Expected request with `Content-Type: application/json`")
    try:
        return decode(body, kind, max_depth=max_depth)
    except RequestError as error:
        status = 400 if error.code == "invalid_json" else 422
        raise IndexerError(status, error.message) from None


def pod_id(instance_id: int | str) -> str:
    """Our pod id for Dynamo's ``instance_id``: the number in decimal, or the string as it is."""
    return str(instance_id)


def instance_id(pod: str) -> int | str:
    """Dynamo's ``instance_id`` for our pod: the number when the id is one (as ``pod_id`` writes
    it, so the two are inverse), else the id."""
    if pod.isascii() and pod.isdigit() and str(int(pod)) == pod and int(pod) <= U64_MAX:
        return int(pod)
    return pod


def rank_of(holder_id: str) -> int:
    """The data-parallel rank of an index holder: ``pod#dp3`` -> 3, ``pod`` -> 0."""
    _, sep, rest = holder_id.partition(DP_RANK_SEPARATOR)
    digits = rest.partition("#")[0]
    return int(digits) if sep and digits.isdigit() else 0


def no_indexer(model: str, routing_group: str) -> IndexerError:
    return IndexerError(404, f"no indexer for model={model} routing_group={routing_group}")


def check_indexed(config: ServiceConfig, model: str, routing_group: str) -> None:
    """Dynamo's 404 unless ``model`` has an indexer here (registered pods serve it, or it has a
    model config) in the one routing group we have."""
    if routing_group != DEFAULT_GROUP or not (model in config.pod_models or model in config.models):
        raise no_indexer(model, routing_group)


def by_hash_refusal(model: str) -> IndexerError:
    """Why ``/query_by_hash`` cannot be answered: Dynamo's block hashes are its own (XXH3-64 of
    each block's tokens, salt and LoRA name, not chained); our index keys a block by vLLM's
    ``sha256_cbor`` chain over every block before it (``kvindex.keys``). One cannot be turned into
    the other without the tokens."""
    return IndexerError(
        400,
        f"block_hashes cannot be looked up here (model={model}): Dynamo's block hashes are XXH3-64 hashes "
        "of each block's tokens, and this index keys blocks by vLLM's sha256_cbor chain of the tokens; "
        "send the token_ids to /kv-indexer/query instead",
    )


def query_answer(result: ScoreResult, config: ServiceConfig) -> dict[str, Any]:
    """Dynamo's ``/query`` answer from our score: matched blocks x the model's block size, per
    instance and rank (``scores``, ``instances[i].dp``), whatever tier holds them (our index
    matches a prefix across tiers; Dynamo's ``scores`` count the GPU's); ``frequencies[d]``, how
    many holders matched more than ``d`` blocks; per instance, its longest match and, by tier, the
    tokens Dynamo counts on ``gpu``, then cumulatively through ``cpu`` and ``disk``. Our scores
    know the slowest tier of each matched prefix, not where it changes tier: a prefix held partly
    on CPU counts wholly under ``cpu`` (0 under ``gpu``)."""
    block_size = config.model(result.model).block_size
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    depths: list[int] = []
    for holder_id, score in result.scores.items():
        instance = str(instance_id(owner_pod(holder_id)))
        rank = str(rank_of(holder_id))
        tokens = score.matched_blocks * block_size
        scores.setdefault(instance, {})[rank] = tokens
        depths.append(score.matched_blocks)
        summary = instances.setdefault(
            instance, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
        )
        summary["dp"][rank] = tokens
        if score.tier == "gpu":
            summary["gpu"] = max(summary["gpu"], tokens)
        if score.tier in ("gpu", "cpu"):
            summary["cpu"] = max(summary["cpu"], tokens)
        summary["disk"] = max(summary["disk"], tokens)
        summary["longest_matched"] = max(summary["longest_matched"], tokens)
    frequencies = [sum(1 for d in depths if d > i) for i in range(max(depths, default=0))]
    return {"scores": scores, "frequencies": frequencies, "instances": instances}


def workers_answer(
    config: ServiceConfig, *, model_name: str | None = None, routing_group: str | None = None
) -> list[dict[str, Any]]:
    """Dynamo's ``/workers``: every registered pod (with a model), filtered as asked. A pod's
    ``endpoints`` and ``listeners`` are its registry ``event_endpoint`` under rank 0 (empty when it
    has none: its engine connects to ingest instead); ``status`` is ``active``, or ``disabled`` /
    ``down`` for a pod out of scores."""
    if routing_group is not None and routing_group != DEFAULT_GROUP:
        return []
    workers = []
    for pod in sorted(config.registered_pods):
        model = config.pods.get(pod)
        if model is None or (model_name is not None and model != model_name):
            continue
        status = "active"
        if pod in config.unscored_pods:
            status = "disabled" if pod in config.disabled_pods else "down"
        endpoint = config.event_endpoints.get(pod)
        endpoints = {} if endpoint is None else {"0": endpoint}
        workers.append(
            {
                "instance_id": instance_id(pod),
                "source": "zmq",
                "status": status,
                "model_name": model,
                "routing_group": DEFAULT_GROUP,
                "block_size": config.model(model).block_size,
                "endpoints": endpoints,
                "listeners": {rank: {"endpoint": e, "status": status} for rank, e in endpoints.items()},
            }
        )
    return workers


DYNAMO_TIERS = {"gpu": "device", "cpu": "host_pinned"}
"""Dynamo's ``storage_tier`` for our tiers; any other tier (``fs``, ``obj``, ...) is ``disk``."""


def dump_answer(
    config: ServiceConfig, blocks: Iterable[PodBlocks], held: Mapping[str, HeldBlocks] | None = None
) -> dict[str, Any]:
    """Dynamo's ``/dump``, per ``"<model>:default"``: the model's ``block_size`` and ``events``,
    what a Dynamo indexer started with ``--peers`` at us replays (``dump_events``), from ``held``
    (model -> ``kvindex.dynamo.held_blocks``; without it, as when ingest records no Dynamo blocks,
    ``events`` is empty). ``blocks``, ours, counts per instance, rank and tier the blocks the index
    holds (Dynamo ignores it)."""
    held = held or {}
    models: dict[str, dict[str, Any]] = {}
    for model in sorted(config.pod_models | set(config.models)):
        models[model] = {"block_size": config.model(model).block_size, "events": [], "blocks": {}}
    for row in blocks:
        entry = models.setdefault(
            row.model, {"block_size": config.model(row.model).block_size, "events": [], "blocks": {}}
        )
        per_rank = entry["blocks"].setdefault(str(instance_id(owner_pod(row.pod))), {})
        tiers = per_rank.setdefault(str(rank_of(row.pod)), {})
        for tier, count in row.blocks_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + count
    for model, entry in models.items():
        entry["events"] = dump_events(held.get(model, {}), config)
    return {f"{model}:{DEFAULT_GROUP}": entry for model, entry in sorted(models.items())}


def dump_events(held: HeldBlocks, config: ServiceConfig) -> list[dict[str, Any]]:
    """The blocks ``held`` as Dynamo 1.6's ``/dump`` lists its radix tree: ``stored`` events per
    worker, rank and tier, each parent's before its children's (``kvindex.dynamo.runs``), with
    our block keys as Dynamo's ``block_hash`` and the Dynamo block hashes as ``tokens_hash``. Only
    the pods whose id is a number (Dynamo's ``worker_id`` is a u64: another id would make the
    whole dump unreadable to it) and that scores count (not disabled or down), KV-cache group 0."""
    events: list[dict[str, Any]] = []
    for holder in sorted(held):
        pod = owner_pod(holder)
        worker = instance_id(pod)
        if not isinstance(worker, int) or pod in config.unscored_pods or is_group_holder(holder):
            continue
        rank = rank_of(holder)
        for tier in sorted(held[holder]):
            for run in runs(held[holder][tier]):
                stored = {
                    "parent_hash": run.parent,
                    "start_position": None,
                    "blocks": [
                        {"block_hash": key, "tokens_hash": block_hash, "mm_extra_info": None}
                        for key, block_hash in run.blocks
                    ],
                }
                events.append(
                    {
                        "worker_id": worker,
                        "storage_tier": DYNAMO_TIERS.get(tier, "disk"),
                        "residency_domain": "worker",
                        "event": {"event_id": len(events), "data": {"stored": stored}, "dp_rank": rank},
                    }
                )
    return events
