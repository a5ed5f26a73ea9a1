"""Request validation and response shapes of the registry API (and, through them, its OpenAPI
schema). Serializers validate and shape, nothing more. The scoring endpoints' bodies are
``scoring.fastpath.schema``'s."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from registry.config import POD_ROLES
from registry.liveness import HEALTHS, POD_STATES
from registry.models import HashSeed, ModelConfig, Pod
from registry.selectors import PodState

U64_MAX = (1 << 64) - 1


# --- the registry ------------------------------------------------------------------------------


class PodSerializer(serializers.ModelSerializer):
    """A pod as written through the API."""

    class Meta:
        model = Pod
        fields = [
            "pod_id",
            "address",
            "replay_endpoint",
            "event_endpoint",
            "model",
            "role",
            "labels",
            "enabled",
            "registered",
            "health",
            "health_changed_at",
            "first_seen",
            "last_seen",
            "learned_kv_cache_groups",
        ]
        read_only_fields = [
            "registered",
            "health",
            "health_changed_at",
            "first_seen",
            "last_seen",
            "learned_kv_cache_groups",
        ]


class PodStateSerializer(serializers.Serializer):
    """A pod with what is live about it (output only)."""

    pod_id = serializers.CharField()
    address = serializers.CharField()
    model = serializers.CharField()
    role = serializers.ChoiceField(choices=POD_ROLES)
    labels = serializers.JSONField()
    enabled = serializers.BooleanField()
    health = serializers.ChoiceField(
        choices=HEALTHS, help_text="What the liveness prober last concluded from the pod's /health."
    )
    health_changed_at = serializers.DateTimeField(allow_null=True)
    state = serializers.ChoiceField(
        choices=POD_STATES,
        help_text="disabled; down (the prober finds /health failing: out of scores); active (an event "
        "within DASHBOARD_STALE_SECONDS); else idle (the prober finds it up) or stale (nothing says it "
        "is alive: no address, or not probed yet).",
    )
    first_seen = serializers.DateTimeField(allow_null=True)
    last_seen = serializers.DateTimeField(allow_null=True)
    blocks_by_tier = serializers.DictField(
        child=serializers.IntegerField(),
        allow_null=True,
        help_text="Blocks held, by tier, over every model and data-parallel rank; null: index unreachable.",
    )
    streams = serializers.ListField(
        child=serializers.DictField(),
        allow_null=True,
        help_text="The ingest stream counters of the pod, one per data-parallel rank; null: the ingest "
        "stats cannot be read.",
    )

    def to_representation(self, instance: PodState) -> dict[str, Any]:
        data = PodSerializer(instance.pod).data
        data["state"] = instance.state
        data["blocks_by_tier"] = instance.blocks_by_tier
        data["streams"] = instance.streams
        return data


class ModelConfigSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelConfig
        fields = [
            "name",
            "block_size",
            "tokenizer_source",
            "chat_template",
            "tier_weights",
            "other_tier_weight",
            "lora_adapters",
            "max_model_len",
            "hash_lookahead_tokens",
            "kv_cache_groups",
            "learned_kv_cache_groups",
            "updated_at",
        ]
        read_only_fields = ["learned_kv_cache_groups", "updated_at"]


class HashSeedSerializer(serializers.ModelSerializer):
    value = serializers.CharField(
        allow_blank=True,
        trim_whitespace=False,
        max_length=255,
        help_text="The engines' PYTHONHASHSEED. Changing it clears the whole index.",
    )

    class Meta:
        model = HashSeed
        fields = ["value", "updated_at"]
        read_only_fields = ["updated_at"]
