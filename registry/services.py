"""Writes to the registry, with their effects on the index (``registry.runtime`` has the handles)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from kvindex.kv_cache_groups import KVCacheGroup, groups_to_json
from registry.config import DP_RANK_SEPARATOR
from registry.liveness import HEALTHS, HealthChange, clear_pod_and_ranks
from registry.models import HashSeed, ModelConfig, Pod
from registry.runtime import get_index, get_tokenizers, invalidate_service_config
from tokenization.tokenizers import TokenizerError


def record_pods_seen(seen: Iterable[tuple[str, str, float, float]]) -> int:
    """Upsert ``(pod, model, first_seen, last_seen)`` (unix times) into the registry; returns how
    many pods were new. ``first_seen`` never moves later; ``last_seen`` never moves earlier. A new
    pod is not ``registered`` and has no address, whatever its id says (``kv@10.0.0.7:8000@m``
    included): events are not trusted to say where a pod is, so nothing routes to it until an
    operator or a fleet registers it."""
    rows = {pod: (model, first, last) for pod, model, first, last in seen}
    if not rows:
        return 0
    created = 0
    with transaction.atomic():
        existing = {p.pod_id: p for p in Pod.objects.select_for_update().filter(pod_id__in=rows)}
        changed = []
        for pod_id, (model, first, last) in rows.items():
            first_dt = datetime.fromtimestamp(first, UTC)
            last_dt = datetime.fromtimestamp(last, UTC)
            pod = existing.get(pod_id)
            if pod is None:
                Pod.objects.create(
                    pod_id=pod_id,
                    model=model,
                    registered=False,
                    first_seen=first_dt,
                    last_seen=last_dt,
                )
                created += 1
                continue
            pod.model = model
            pod.first_seen = min(pod.first_seen or first_dt, first_dt)
            pod.last_seen = max(pod.last_seen or last_dt, last_dt)
            changed.append(pod)
        if changed:
            Pod.objects.bulk_update(changed, ["model", "first_seen", "last_seen"])
    return created


def register_pods(
    pods: Iterable[tuple[str, str, str, str]],
    *,
    event_endpoints: Mapping[str, str] | None = None,
    roles: Mapping[str, str] | None = None,
) -> None:
    """Announce ``(pod, model, address, replay_endpoint)`` (a fleet that knows its pods, e.g. the
    simulator), where the engines' KV-event PUBs bind (``event_endpoints``: pod -> endpoint, for
    the pods whose PUB binds) and what the pods are for (``roles``: pod -> ``Pod.role``; one not
    in it serves whole requests): new pods are created, known ones get these values; enabled and
    health stay."""
    event_endpoints, roles = event_endpoints or {}, roles or {}
    with transaction.atomic():
        for pod_id, model, address, replay_endpoint in pods:
            values = {
                "model": model,
                "address": address,
                "replay_endpoint": replay_endpoint,
                "role": roles.get(pod_id, "both"),
            }
            if pod_id in event_endpoints:
                values["event_endpoint"] = event_endpoints[pod_id]
            Pod.objects.update_or_create(pod_id=pod_id, defaults={**values, "registered": True})
    invalidate_service_config()


def save_pod(pod: Pod) -> Pod:
    """Save a pod from the admin or the API. Disabling it removes its blocks from the index now
    (ingest stops indexing it within a config refresh and clears it again in order).

    ``health`` belongs to the liveness prober: a save never writes back the value the form was
    read with (the prober may have changed it since), except to reset it to unknown when the pod
    gets a new address or is disabled (the verdict was about an address, or a pod, it no longer
    probes).

    A pod id or labels already stored are not judged again by the validators (ingest records
    whatever pod id a topic names): such a pod can still be disabled. A pod saved here is
    ``registered``: an operator vouched for it (and for its address)."""
    pod.registered = True
    previous = (
        Pod.objects.filter(pk=pod.pk)
        .values("pod_id", "labels", "enabled", "address", "health", "health_changed_at")
        .first()
        if pod.pk
        else None
    )
    pod.full_clean(exclude=[f for f in ("pod_id", "labels") if previous and previous[f] == getattr(pod, f)])
    if previous is None:
        pod.save()
    else:
        fields = [f.name for f in Pod._meta.concrete_fields if not f.primary_key]
        no_longer_probed_there = pod.address != previous["address"] or not pod.enabled
        if no_longer_probed_there and previous["health"] != "unknown":
            pod.health, pod.health_changed_at = "unknown", datetime.now(UTC)
        else:
            pod.health, pod.health_changed_at = previous["health"], previous["health_changed_at"]
            fields = [f for f in fields if f not in ("health", "health_changed_at")]
        pod.save(update_fields=fields)
    if (previous is None or previous["enabled"]) and not pod.enabled:
        clear_pod_blocks(pod.pod_id)
    invalidate_service_config()
    return pod


class RegistrationConflict(Exception):
    """A registration the registry cannot take as asked (the KV-indexer API answers it 409)."""


def register_event_publisher(
    *,
    pod_id: str,
    model: str,
    event_endpoint: str,
    block_size: int,
    dp_rank: int = 0,
    replay_endpoint: str | None = None,
) -> None:
    """Register the engine of ``pod_id`` as Dynamo's ``/register`` does a worker: where its
    KV-event PUB binds (``event_endpoint``: ``ingest --replica`` connects there), its model, and
    the model's block size. A new pod is created; a pod registered otherwise (the admin, a fleet)
    gets the endpoint, as does one ingest made from its events alone. A model without a config
    gets one with ``block_size``.

    Raises ``RegistrationConflict`` when the model's block size is another, when the pod already
    has an event endpoint (Dynamo's "already registered") or serves another model, and for a rank
    above 0 on an endpoint other than its pod's: our registry keeps one event endpoint per pod, on
    which the engine's batches name their rank. A rank on its pod's endpoint changes nothing.
    Raises ``ValidationError`` (field -> what to fix) for a bad pod id, endpoint or block size."""
    config = ModelConfig.objects.filter(name=model).first()
    if config is not None and config.block_size != block_size:
        raise RegistrationConflict(
            f"block_size mismatch for model={model} routing_group=default: existing={config.block_size}, "
            f"requested={block_size}"
        )
    pod = Pod.objects.filter(pod_id=pod_id).first()
    if dp_rank:
        if pod is None or pod.model != model or pod.event_endpoint != event_endpoint:
            raise RegistrationConflict(
                f"instance {pod_id} dp_rank {dp_rank}: this registry keeps one KV-event endpoint per "
                "instance, on which its engine's batches name their data-parallel rank: register dp_rank 0 "
                "with that endpoint first, then ranks with the same endpoint (or each rank as an instance)"
            )
        return
    if pod is not None and pod.registered:
        if pod.model != model:
            raise RegistrationConflict(
                f"instance {pod_id} is registered for model={pod.model} routing_group=default"
            )
        if pod.event_endpoint:
            raise RegistrationConflict(f"instance {pod_id} dp_rank 0 already registered")
    pod = pod or Pod(pod_id=pod_id)
    pod.model = model
    pod.event_endpoint = event_endpoint
    if replay_endpoint:
        pod.replay_endpoint = replay_endpoint
    with transaction.atomic():
        if config is None:
            save_model_config(ModelConfig(name=model, block_size=block_size))
        save_pod(pod)


def unregister_event_publisher(*, pod_id: str, model: str, dp_rank: int | None = None) -> None:
    """Dynamo's ``/unregister``: the registered pod goes with its blocks (``delete_pod``); with a
    ``dp_rank`` above 0 only that rank's blocks go (its pod stays: the rank is indexed again when
    it next stores). Raises ``LookupError`` (Dynamo's 404) when the pod is not registered, or is
    for another model."""
    pod = Pod.objects.filter(pod_id=pod_id, registered=True).first()
    if pod is None:
        raise LookupError(f"instance {pod_id} not found")
    if pod.model != model:
        raise LookupError(f"instance {pod_id} is registered for model={pod.model} routing_group=default")
    if dp_rank:
        get_index().clear_pod(pod=f"{pod_id}{DP_RANK_SEPARATOR}{dp_rank}")
        return
    delete_pod(pod)


def set_pod_health(changes: Iterable[HealthChange]) -> int:
    """Record the liveness prober's verdicts: each pod's ``health`` and, as
    ``health_changed_at``, the time of the change. A pod already in that health is left as it is
    (``health_changed_at`` keeps saying when it really changed); a pod not in the registry is
    skipped. Returns how many pods changed. Raises ``ValueError`` for a health not in ``HEALTHS``."""
    changed = 0
    with transaction.atomic():
        for change in changes:
            if change.health not in HEALTHS:
                raise ValueError(f"health must be one of {', '.join(HEALTHS)}, not {change.health!r}")
            changed += (
                Pod.objects.filter(pod_id=change.pod)
                .exclude(health=change.health)
                .update(health=change.health, health_changed_at=datetime.fromtimestamp(change.at, UTC))
            )
    if changed:
        invalidate_service_config()
    return changed


def expire_pods(*, last_seen_before: datetime) -> list[str]:
    """Delete the pods ingest has seen (they have a ``first_seen``) whose last event is older than
    ``last_seen_before``, and clear their blocks; returns their ids, sorted. Pods made by hand and
    never seen stay; so do disabled ones (deleting one would register it again, enabled, when it
    next publishes: the admin's decision outlives its silence). A pod that publishes again after
    being expired is registered again."""
    expired_rows = Pod.objects.filter(first_seen__isnull=False, last_seen__lt=last_seen_before, enabled=True)
    with transaction.atomic():
        expired = sorted(expired_rows.select_for_update().values_list("pod_id", flat=True))
        Pod.objects.filter(pod_id__in=expired).delete()
    for pod_id in expired:
        clear_pod_blocks(pod_id)
    if expired:
        invalidate_service_config()
    return expired


def forget_unregistered_pods(pod_ids: Iterable[str]) -> int:
    """Forget those of these pods that nobody registered: delete their rows (``registered``
    false) and clear their blocks; returns how many rows went. Ingest calls it with the
    unregistered pods its receiver evicted (``ingest.pool.Admission``), so that a flood of
    made-up pod names leaves neither rows nor blocks behind. A pod registered meanwhile stays."""
    pod_ids = set(pod_ids)
    pod_ids -= set(Pod.objects.filter(pod_id__in=pod_ids, registered=True).values_list("pod_id", flat=True))
    deleted, _ = Pod.objects.filter(pod_id__in=pod_ids).delete()
    for pod_id in sorted(pod_ids):
        clear_pod_blocks(pod_id)
    if deleted:
        invalidate_service_config()
    return deleted


def delete_pod(pod: Pod) -> None:
    """Delete a pod and its blocks. A pod that keeps publishing is registered again."""
    pod_id = pod.pod_id
    pod.delete()
    clear_pod_blocks(pod_id)
    invalidate_service_config()


def clear_pod_blocks(pod_id: str) -> int:
    """Remove every block of ``pod_id`` (and of its data-parallel ranks) under every model."""
    return clear_pod_and_ranks(get_index(), pod_id)


def save_model_config(config: ModelConfig, *, tokenizer_source_checked: bool = False) -> ModelConfig:
    """Save a model config. A new tokenizer source is loaded first (``check_tokenizer_source``;
    skipped when the caller has, ``tokenizer_source_checked``). A new block size changes every
    block key of the model, so its index is cleared (engines re-report blocks as they cache them;
    until then it scores nothing). Raises ``ValidationError`` (field -> what to fix), saving nothing."""
    previous = ModelConfig.objects.filter(pk=config.pk).first() if config.pk else None
    config.full_clean()
    old_source = previous.tokenizer_source if previous is not None else ""
    if config.tokenizer_source != old_source and not tokenizer_source_checked:
        check_tokenizer_source(model=config.name, source=config.tokenizer_source)
    config.save()
    old_block_size = previous.block_size if previous is not None else settings.KVCACHE_BLOCK_SIZE
    if config.block_size != old_block_size:
        get_index().clear_model(model=config.name)
    if previous is not None and previous.name != config.name:
        get_index().clear_model(model=previous.name)
    invalidate_service_config()
    return config


def record_learned_groups(learned: Mapping[tuple[str, str], Mapping[int, tuple[str, int | None]]]) -> int:
    """Write what ingest learned of each pod's KV-cache groups, from the events that describe them
    ((pod, model) -> group_idx -> (kind, sliding window)), into ``Pod.learned_kv_cache_groups``
    of the registry's pods serving that model; returns how many pods changed. A group no event
    described reads as full attention. Scoring follows a pod's own groups while its model config
    sets none: what one pod says never changes how another is scored. A model config that exists
    gets, as ``learned_kv_cache_groups``, what its pods described when they agree, and nothing
    when they disagree (``ServiceConfig.kv_cache_group_variants`` counts the variants)."""
    changed, models = 0, set()
    with transaction.atomic():
        rows = {
            (p.pod_id, p.model): p
            for p in Pod.objects.select_for_update().filter(pod_id__in={pod for pod, _ in learned})
        }
        for (pod_id, model), groups in learned.items():
            row = rows.get((pod_id, model))
            if row is None or not groups:
                continue
            described = [
                KVCacheGroup(*groups.get(g, ("full_attention", None))) for g in range(max(groups) + 1)
            ]
            value = groups_to_json(described)
            if row.learned_kv_cache_groups != value:
                row.learned_kv_cache_groups = value
                row.save(update_fields=["learned_kv_cache_groups"])
                changed += 1
                models.add(model)
        for config in ModelConfig.objects.select_for_update().filter(name__in=models):
            variants = {
                json.dumps(value, sort_keys=True)
                for value in Pod.objects.filter(model=config.name).values_list(
                    "learned_kv_cache_groups", flat=True
                )
                if value
            }
            agreed = json.loads(variants.pop()) if len(variants) == 1 else []
            if config.learned_kv_cache_groups != agreed:
                config.learned_kv_cache_groups = agreed
                config.save(update_fields=["learned_kv_cache_groups", "updated_at"])
    if changed:
        invalidate_service_config()
    return changed


def check_tokenizer_source(*, model: str, source: str) -> None:
    """Load ``model``'s tokenizer from ``source`` as scoring will (``""``, auto-discovery, is not
    loaded: a model may be scored by token ids alone). Raises ``ValidationError`` on
    ``tokenizer_source`` naming what each tokenizer source answered: a source that does not load
    would answer every prompt of the model 404 or 422."""
    if not source:
        return
    try:
        get_tokenizers().load_source(model, source)
    except TokenizerError as error:
        raise ValidationError(
            {
                "tokenizer_source": f"{source!r} does not load a tokenizer ({'; '.join(error.tried)}): "
                "give a local directory or tokenizer.json path, or a model id that KVCACHE_TOKENIZERS_DIR "
                "(or, with KVCACHE_ALLOW_HUB, the hub) has; empty for auto-discovery"
            }
        ) from error


def delete_model_config(config: ModelConfig) -> None:
    name, block_size = config.name, config.block_size
    config.delete()
    if block_size != settings.KVCACHE_BLOCK_SIZE:
        get_index().clear_model(model=name)
    invalidate_service_config()


def current_hash_seed() -> HashSeed:
    """The hash-seed row, created from ``KVCACHE_HASH_SEED`` the first time it is asked for."""
    seed, _ = HashSeed.objects.get_or_create(pk=1, defaults={"value": settings.KVCACHE_HASH_SEED})
    return seed


def set_hash_seed(value: str) -> HashSeed:
    """Change the hash seed. Every block key depends on it, so the whole index is cleared."""
    seed = current_hash_seed()
    if seed.value != value:
        seed.value = value
        seed.full_clean()
        seed.save()
        index = get_index()
        for model in {b.model for b in index.pod_blocks()}:
            index.clear_model(model=model)
    invalidate_service_config()
    return seed
