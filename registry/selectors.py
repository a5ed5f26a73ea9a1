"""Reads: the registry as a ``ServiceConfig`` snapshot (``registry.runtime`` keeps it fresh), and
the live state beside it (block counts in the index, the ingest processes' stream stats)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis
from django.conf import settings

from kvindex import IndexUnavailable, KVIndex
from kvindex.kv_cache_groups import groups_from_json, is_group_holder
from kvindex.shared_stats import read_snapshots
from registry.config import DEFAULT_OTHER_TIER_WEIGHT, ModelSettings, ServiceConfig, owner_pod
from registry.liveness import POD_STATES, pod_state
from registry.models import HashSeed, ModelConfig, Pod


def load_service_config() -> ServiceConfig:
    """A fresh snapshot from the database."""
    seed_row = HashSeed.objects.filter(pk=1).first()
    seed = seed_row.value if seed_row is not None else settings.KVCACHE_HASH_SEED
    models = {
        m.name: ModelSettings(
            name=m.name,
            block_size=m.block_size,
            tokenizer_source=m.tokenizer_source,
            chat_template=m.chat_template,
            tier_weights=dict(m.tier_weights or {}),
            other_tier_weight=m.other_tier_weight
            if m.other_tier_weight is not None
            else DEFAULT_OTHER_TIER_WEIGHT,
            lora_adapters=tuple(m.lora_adapters or ()),
            max_model_len=m.max_model_len,
            hash_lookahead_tokens=m.hash_lookahead_tokens,
            kv_cache_groups=groups_from_json(m.kv_cache_groups),
        )
        for m in ModelConfig.objects.all()
    }
    disabled, down, registered, addresses, replay, events, pods = set(), set(), set(), {}, {}, {}, {}
    pod_groups, roles = {}, {}
    rows = Pod.objects.values_list(
        "pod_id",
        "model",
        "enabled",
        "address",
        "replay_endpoint",
        "event_endpoint",
        "health",
        "registered",
        "learned_kv_cache_groups",
        "role",
    )
    for (
        pod_id,
        model,
        enabled,
        address,
        replay_endpoint,
        event_endpoint,
        health,
        is_registered,
        learned,
        role,
    ) in rows:
        pods[pod_id] = model
        if role != "both":
            roles[pod_id] = role
        if is_registered:
            registered.add(pod_id)
        if learned:
            pod_groups[pod_id] = groups_from_json(learned)
        if not enabled:
            disabled.add(pod_id)
        if health == "down":
            down.add(pod_id)
        if address:
            addresses[pod_id] = address
        if replay_endpoint:
            replay[pod_id] = replay_endpoint
        if event_endpoint:
            events[pod_id] = event_endpoint
    return ServiceConfig(
        seed=seed,
        default_block_size=settings.KVCACHE_BLOCK_SIZE,
        models=models,
        disabled_pods=frozenset(disabled),
        pod_addresses=addresses,
        pod_models=frozenset(pods.values()),
        pods=pods,
        registered_pods=frozenset(registered),
        pod_kv_cache_groups=pod_groups,
        replay_endpoints=replay,
        event_endpoints=events,
        down_pods=frozenset(down),
        pod_roles=roles,
    )


# --- live state beside the registry: the index's block counts, the ingest processes' stats ---

INGEST_STATS_TIMEOUT_SECONDS = 0.5
"""How long a request waits for the Redis holding the ingest stats before going without them."""

_STREAM_LATEST_FIELDS = ("last_seq", "lag_seconds", "resyncing")
_STREAM_REASON_COUNTS = ("decode_errors", "replay_failures")
_STREAM_NOT_SUMMED = frozenset(
    {
        "pod",
        "rank",
        "model",
        *_STREAM_REASON_COUNTS,
        "first_event_at",
        "last_event_at",
        "hash_alignment",
        *_STREAM_LATEST_FIELDS,
    }
)

_stats_clients: dict[str, redis.Redis] = {}
_stats_clients_lock = threading.Lock()


def _ingest_stats_client() -> redis.Redis:
    """One client per ``REDIS_URL`` (a pool of connections, shared by every request)."""
    url = settings.REDIS_URL
    client = _stats_clients.get(url)
    if client is None:
        with _stats_clients_lock:
            client = _stats_clients.get(url)
            if client is None:
                client = _stats_clients[url] = redis.Redis.from_url(
                    url,
                    socket_connect_timeout=INGEST_STATS_TIMEOUT_SECONDS,
                    socket_timeout=INGEST_STATS_TIMEOUT_SECONDS,
                )
    return client


def ingest_snapshots() -> list[dict] | None:
    """The fresh snapshots of every running ingest process (``IngestStats.snapshot`` shape), read
    from ``REDIS_URL``; ``None`` when that Redis cannot be reached (the caller says so)."""
    try:
        return read_snapshots(_ingest_stats_client())
    except redis.RedisError:
        return None


def merge_streams(snapshots: Iterable[dict]) -> list[dict]:
    """The streams of several ingest processes as one list, one entry per (pod, rank, model):
    counters summed, first/last event times widened, the latest process's seq and lag kept.
    Sorted by pod then rank. (Two processes share a stream only when both receive one pod.)"""
    merged: dict[tuple[str, int, str], dict] = {}
    for snapshot in snapshots:
        for stream in snapshot.get("streams", ()):
            key = (stream["pod"], stream["rank"], stream["model"])
            into = merged.get(key)
            if into is None:
                merged[key] = {
                    **stream,
                    **{name: dict(stream.get(name, {})) for name in _STREAM_REASON_COUNTS},
                }
                continue
            for name, value in stream.items():
                if name not in _STREAM_NOT_SUMMED and isinstance(value, int | float):
                    into[name] = into.get(name, 0) + value
            for name in _STREAM_REASON_COUNTS:
                for reason, n in stream.get(name, {}).items():
                    into[name][reason] = into[name].get(reason, 0) + n
            into["first_event_at"] = min(into["first_event_at"], stream["first_event_at"])
            if stream["last_event_at"] >= into["last_event_at"]:
                into["last_event_at"] = stream["last_event_at"]
                into.update({name: stream.get(name) for name in _STREAM_LATEST_FIELDS})
    for stream in merged.values():
        judged = stream.get("aligned_blocks", 0) + stream.get("misaligned_blocks", 0)
        stream["hash_alignment"] = stream.get("aligned_blocks", 0) / judged if judged else None
    return [merged[key] for key in sorted(merged, key=lambda k: (k[0], k[1], k[2]))]


def merge_unattributed_errors(snapshots: Iterable[dict]) -> dict[str, int]:
    """Decode errors no pod can be blamed for, summed over ingest processes, by reason."""
    total: dict[str, int] = {}
    for snapshot in snapshots:
        for reason, n in snapshot.get("unattributed_errors", {}).items():
            total[reason] = total.get(reason, 0) + n
    return total


def live_blocks_by_pod(index: KVIndex) -> dict[str, dict[str, int]]:
    """pod -> tier -> blocks held, from the index, summed over models and data-parallel ranks
    (a hybrid model's blocks once: its other KV-cache groups left out). Raises
    ``IndexUnavailable`` when the index cannot be reached."""
    out: dict[str, dict[str, int]] = {}
    for row in index.pod_blocks():
        if is_group_holder(row.pod):
            continue
        tiers = out.setdefault(owner_pod(row.pod), {})
        for tier, n in row.blocks_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + n
    return out


def state_of(pod: Pod, streams: Iterable[dict] = (), *, now: float) -> str:
    """``pod``'s state in one word (``registry.liveness.pod_state``): its last event is the later of
    the registry's ``last_seen`` and its ingest ``streams``' last events; no event within
    ``DASHBOARD_STALE_SECONDS`` makes it idle or stale."""
    last = max(
        [pod.last_seen.timestamp() if pod.last_seen else 0.0, *(s.get("last_event_at", 0.0) for s in streams)]
    )
    return pod_state(
        enabled=pod.enabled,
        health=pod.health,
        last_event_age=max(0.0, now - last) if last else None,
        stale_after=settings.DASHBOARD_STALE_SECONDS,
    )


def pod_state_counts(snapshots: Iterable[dict] | None = None) -> dict[str, int]:
    """How many registered pods are in each state (every one of ``POD_STATES``, zeros included),
    their last events read from the registry and ``snapshots`` (ingest snapshots, if any)."""
    streams_by_pod: dict[str, list[dict]] = {}  # only their last events are read: no merging
    for snapshot in snapshots or ():
        for stream in snapshot.get("streams", ()):
            streams_by_pod.setdefault(stream["pod"], []).append(stream)
    counts = dict.fromkeys(POD_STATES, 0)
    now = time.time()
    for pod in Pod.objects.only("pod_id", "enabled", "health", "last_seen"):
        counts[state_of(pod, streams_by_pod.get(pod.pod_id, ()), now=now)] += 1
    return counts


@dataclass(frozen=True)
class PodState:
    """A registered pod with what is live about it. ``blocks_by_tier`` is ``None`` when the index
    is unreachable; ``streams`` is ``None`` when the ingest stats are (else a list, empty when no
    running ingest process has heard from the pod); ``state`` is ``state_of`` the pod."""

    pod: Pod
    blocks_by_tier: dict[str, int] | None
    streams: list[dict] | None
    state: str


def pod_states(index: KVIndex, pods: Iterable[Pod] | None = None) -> list[PodState]:
    """``pods`` (default: the whole registry, by pod id) with live block counts from ``index``,
    stream stats and their state."""
    rows = list(Pod.objects.all() if pods is None else pods)
    try:
        blocks: dict[str, dict[str, int]] | None = live_blocks_by_pod(index)
    except IndexUnavailable:
        blocks = None
    snapshots = ingest_snapshots()
    streams_by_pod: dict[str, list[dict]] = {}
    for stream in merge_streams(snapshots or ()):
        streams_by_pod.setdefault(stream["pod"], []).append(stream)
    now = time.time()
    return [
        PodState(
            pod=pod,
            blocks_by_tier=None if blocks is None else blocks.get(pod.pod_id, {}),
            streams=None if snapshots is None else streams_by_pod.get(pod.pod_id, []),
            state=state_of(pod, streams_by_pod.get(pod.pod_id, ()), now=now),
        )
        for pod in rows
    ]
