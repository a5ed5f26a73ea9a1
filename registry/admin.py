"""Django admin for the registry: thin; every write goes through ``registry.services``."""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest

from kvindex.base import IndexUnavailable
from registry import runtime, services
from registry.models import HashSeed, ModelConfig, Pod


@admin.register(Pod)
class PodAdmin(admin.ModelAdmin):
    list_display = (
        "pod_id",
        "model",
        "role",
        "enabled",
        "registered",
        "health",
        "address",
        "live_blocks",
        "last_seen",
        "first_seen",
    )
    list_filter = ("enabled", "registered", "health", "role", "model")
    search_fields = ("pod_id", "model", "address", "event_endpoint")
    readonly_fields = (
        "registered",
        "health",
        "health_changed_at",
        "first_seen",
        "last_seen",
        "live_blocks",
        "learned_kv_cache_groups",
    )
    ordering = ("pod_id",)
    actions = ("disable_pods", "enable_pods")

    def get_readonly_fields(self, request: HttpRequest, obj: Pod | None = None) -> tuple[str, ...]:
        # The index knows a pod by its id: a renamed row would leave its blocks behind (as the API,
        # which refuses renames, says: delete the pod and create the new one).
        return self.readonly_fields + (("pod_id",) if obj is not None else ())

    def get_queryset(self, request: HttpRequest):
        self._blocks = _live_blocks()
        return super().get_queryset(request)

    @admin.display(description="live blocks by tier")
    def live_blocks(self, pod: Pod) -> str:
        counts = getattr(self, "_blocks", None)
        if counts is None:
            counts = self._blocks = _live_blocks()
        if counts is None:
            return "index unreachable"
        by_tier = counts.get(pod.pod_id, {})
        return ", ".join(f"{tier} {n}" for tier, n in sorted(by_tier.items())) or "none"

    def save_model(self, request, obj: Pod, form, change: bool) -> None:
        if change and "enabled" in form.changed_data and not obj.enabled:
            messages.warning(request, f"{obj.pod_id} is disabled: its blocks were removed from the index.")
        services.save_pod(obj)

    def delete_model(self, request, obj: Pod) -> None:
        services.delete_pod(obj)

    def delete_queryset(self, request, queryset) -> None:
        for pod in queryset:
            services.delete_pod(pod)

    @admin.action(description="Disable selected pods (removes their blocks)")
    def disable_pods(self, request, queryset) -> None:
        for pod in queryset.filter(enabled=True):
            pod.enabled = False
            services.save_pod(pod)

    @admin.action(description="Enable selected pods")
    def enable_pods(self, request, queryset) -> None:
        for pod in queryset.filter(enabled=False):
            pod.enabled = True
            services.save_pod(pod)


def _live_blocks() -> dict[str, dict[str, int]] | None:
    """pod -> tier -> blocks, from the index (None when it is unreachable)."""
    try:
        rows = runtime.get_index().pod_blocks()
    except IndexUnavailable:
        return None
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        tiers = out.setdefault(row.pod, {})
        for tier, n in row.blocks_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + n
    return out


class ConfirmClearForm(forms.ModelForm):
    """A form that makes the admin confirm a change that clears index data before it is saved.
    ``clearing_fields`` name the fields whose change clears; ``clearing_warning`` says what."""

    clearing_fields: tuple[str, ...] = ()
    clearing_warning = ""
    confirm_clear = forms.BooleanField(
        required=False, label="I understand", help_text="Confirm the index clearing this change causes."
    )

    def clean(self):
        cleaned = super().clean()
        changed = self.instance.pk and any(f in self.changed_data for f in self.clearing_fields)
        if changed and not cleaned.get("confirm_clear"):
            raise forms.ValidationError(f'{self.clearing_warning} Tick "I understand" to save.')
        return cleaned


class ModelConfigForm(ConfirmClearForm):
    clearing_fields = ("block_size", "name")
    clearing_warning = "Changing the block size or the name clears this model's blocks from the index."

    class Meta:
        model = ModelConfig
        fields = "__all__"

    def clean(self):
        cleaned = super().clean()
        if "tokenizer_source" in self.changed_data and "tokenizer_source" in cleaned:
            services.check_tokenizer_source(model=cleaned.get("name", ""), source=cleaned["tokenizer_source"])
        return cleaned


class HashSeedForm(ConfirmClearForm):
    clearing_fields = ("value",)
    clearing_warning = "Changing the hash seed clears the whole index."

    class Meta:
        model = HashSeed
        fields = "__all__"


@admin.register(ModelConfig)
class ModelConfigAdmin(admin.ModelAdmin):
    form = ModelConfigForm
    list_display = (
        "name",
        "block_size",
        "tokenizer_source",
        "tier_weights",
        "other_tier_weight",
        "hash_lookahead_tokens",
        "updated_at",
    )
    search_fields = ("name", "tokenizer_source")
    list_filter = ("block_size",)
    readonly_fields = ("learned_kv_cache_groups", "pods_groups", "updated_at")

    @admin.display(description="groups the pods described")
    def pods_groups(self, config: ModelConfig) -> str:
        """Each list of KV-cache groups the model's pods described, with how many pods: more than
        one line, they disagree (each pod is scored over its own, unless kv_cache_groups is set)."""
        pods: dict[str, list[str]] = {}
        for pod_id, groups in Pod.objects.filter(model=config.name).values_list(
            "pod_id", "learned_kv_cache_groups"
        ):
            if groups:
                pods.setdefault(json.dumps(groups), []).append(pod_id)
        if not pods:
            return "none"
        lines = [
            f"{groups}: {len(ids)} pods ({', '.join(sorted(ids)[:5])}{', ...' if len(ids) > 5 else ''})"
            for groups, ids in sorted(pods.items(), key=lambda item: -len(item[1]))
        ]
        return ("pods disagree: " if len(lines) > 1 else "") + "; ".join(lines)

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change, **kwargs)
        form.base_fields[
            "block_size"
        ].help_text = (
            "Must equal the engines' --block-size. Changing it clears this model's blocks from the index."
        )
        return form

    def save_model(self, request, obj: ModelConfig, form, change: bool) -> None:
        if "block_size" in form.changed_data:
            messages.warning(
                request, f"The block size of {obj.name} changed: its blocks were cleared from the index."
            )
        services.save_model_config(obj, tokenizer_source_checked=True)  # by the form

    def delete_model(self, request, obj: ModelConfig) -> None:
        services.delete_model_config(obj)

    def delete_queryset(self, request, queryset) -> None:
        for config in queryset:
            services.delete_model_config(config)


@admin.register(HashSeed)
class HashSeedAdmin(admin.ModelAdmin):
    form = HashSeedForm
    list_display = ("__str__", "value", "updated_at")
    readonly_fields = ("updated_at",)

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change, **kwargs)
        form.base_fields["value"].help_text = (
            "Must equal the engines' PYTHONHASHSEED. Changing it clears the whole index: every block "
            "key depends on it, so engines must re-report their blocks."
        )
        return form

    def has_add_permission(self, request) -> bool:
        return not HashSeed.objects.exists()

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj: HashSeed, form, change: bool) -> None:
        if change and "value" in form.changed_data:
            messages.warning(request, "The hash seed changed: the index was cleared.")
        services.set_hash_seed(obj.value)
