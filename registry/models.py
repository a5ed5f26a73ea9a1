"""The registry: pods, model configs and the hash seed. Thin tables; logic is in services."""

from __future__ import annotations

import re

import jinja2
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from kvindex.keys import MAX_BLOCK_SIZE
from kvindex.kv_cache_groups import GROUP_RULES, MAX_KV_CACHE_GROUPS, MAX_SLIDING_WINDOW
from registry.config import POD_ROLES
from tokenization.chat_templates import BoundedEnvironment


def validate_json_text(value: object) -> None:
    """Every string of a JSON value, keys too, is text that a database stores and a JSON answer
    carries: valid Unicode (no lone surrogate, which a JSON ``\\u`` escape can write: stored, it
    would break every answer that lists it) and no NUL character (PostgreSQL's ``jsonb`` refuses
    it). The JSON fields' validators call it first."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo += item.values()
            texts = [key for key in item if isinstance(key, str)]
        elif isinstance(item, list):
            todo += item
            continue
        else:
            texts = [item] if isinstance(item, str) else []
        for text in texts:
            if "\x00" in text:
                raise ValidationError("must not hold a NUL character (\\u0000)")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValidationError(
                    f"must be valid Unicode text: U+{ord(text[error.start]):04X} is a lone surrogate"
                ) from None


def default_tier_weights() -> dict[str, float]:
    return {"gpu": 1.0, "cpu": 0.8}


def validate_tier_weights(value: object) -> None:
    validate_json_text(value)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
        for k, v in value.items()
    ):
        raise ValidationError(
            'tier weights must be an object of tier -> non-negative number, e.g. {"gpu": 1.0}'
        )


def validate_string_list(value: object) -> None:
    validate_json_text(value)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValidationError('must be a list of non-empty strings, e.g. ["Alice"]')


# Characters that survive a URL path as they are (the detail route is /api/v1/pods/<pod_id>/) and
# a topic (kv@<pod>@<model>: a pod id ends at the first "@"). "#" is not one: ingest indexes the
# data-parallel ranks of pod P as P#dp<r>. Brackets are for IPv6 addresses ("[fd00::7]:8000").
_POD_ID = re.compile(r"[A-Za-z0-9\[][A-Za-z0-9._:\[\]-]*")


def validate_pod_id(value: str) -> None:
    if not _POD_ID.fullmatch(value):
        raise ValidationError(
            "may contain only letters, digits and . _ - : [ ] (not / # @ % or spaces), and must start "
            'with a letter, a digit or "[", e.g. "vllm-0" or "10.0.0.7:8000"'
        )


def validate_labels(value: object) -> None:
    validate_json_text(value)
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValidationError('must be an object of name -> string, e.g. {"zone": "b"}')


# tcp://host:port (a name, an IPv4 address or a bracketed IPv6 one: a SUB connects there, so no
# wildcard) or ipc://path.
_EVENT_ENDPOINT_TCP = re.compile(
    r"tcp://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})"
)
_EVENT_ENDPOINT_IPC = re.compile(r"ipc://[^\s]+")


def validate_event_endpoint(value: str) -> None:
    """An endpoint ingest can connect a ZeroMQ SUB socket to."""
    tcp = _EVENT_ENDPOINT_TCP.fullmatch(value)
    if not (_EVENT_ENDPOINT_IPC.fullmatch(value) or (tcp and 0 < int(tcp.group(1)) < 65536)):
        raise ValidationError(
            'must be where the engine\'s KV-event PUB binds, as tcp://host:port (port 1 to 65535, no "*") '
            'or ipc://path, e.g. "tcp://10.0.0.7:5557"'
        )


def validate_block_size(value: int) -> None:
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise ValidationError(
            f"must be between 1 and {MAX_BLOCK_SIZE} tokens: the engines' --block-size (vLLM's default is 16)"
        )


MAX_HASH_LOOKAHEAD_TOKENS = 64
"""vLLM's ``num_hash_lookahead_tokens`` comes from a speculative decoding config (the draft tokens
a step may propose: a handful); 64 leaves room for any of them."""


def validate_kv_cache_groups(value: object) -> None:
    example = '[{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4096}]'
    if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
        raise ValidationError(f"must be a list of groups in vLLM's group order, e.g. {example}")
    if len(value) > MAX_KV_CACHE_GROUPS:
        raise ValidationError(f"a model has at most {MAX_KV_CACHE_GROUPS} KV-cache groups, not {len(value)}")
    for i, group in enumerate(value):
        kind = group.get("kind")
        if not isinstance(kind, str) or kind not in GROUP_RULES:
            raise ValidationError(
                f"group {i}: kind must be one of {', '.join(sorted(GROUP_RULES))}, not {kind!r}"
            )
        window = group.get("sliding_window")
        windowed = GROUP_RULES[kind] == "window"
        if windowed and not (
            isinstance(window, int) and not isinstance(window, bool) and 1 <= window <= MAX_SLIDING_WINDOW
        ):
            raise ValidationError(
                f"group {i}: a {kind} group needs its sliding_window in tokens (1 to {MAX_SLIDING_WINDOW})"
            )
        if set(group) - {"kind", "sliding_window"} or (not windowed and window is not None):
            raise ValidationError(f"group {i}: only kind (and sliding_window for a window) are allowed")
    if value and GROUP_RULES[value[0]["kind"]] != "full":
        raise ValidationError("group 0 must be full attention (vLLM orders it first)")


def validate_chat_template(value: str) -> None:
    """A chat template must compile in the environment it renders in (``tokenization.chat_templates``)."""
    try:
        BoundedEnvironment().from_string(value)
    except jinja2.TemplateSyntaxError as error:
        raise ValidationError(f"is not valid Jinja (line {error.lineno}): {error.message}") from error
    except RecursionError as error:
        raise ValidationError("nests too deeply to compile: simplify it") from error


class Pod(models.Model):
    """A vLLM engine that publishes KV events: registered (the admin, the API, ``simulate
    --register``, a pod selector), or made by ``ingest`` on its first event (``registered`` false:
    it has no address until someone gives it one, so nothing routes to it)."""

    pod_id = models.CharField(
        max_length=255,
        unique=True,
        validators=[validate_pod_id],
        help_text="The <pod> of the kv@<pod>@<model> topic: letters, digits and . _ - : [ ].",
    )
    address = models.CharField(
        max_length=255,
        blank=True,
        help_text="Where the pod serves HTTP (host:port), if known; its /health is probed there.",
    )
    replay_endpoint = models.CharField(
        max_length=255,
        blank=True,
        help_text="The engine's KV-event replay ROUTER (e.g. tcp://10.0.0.7:5558), which ingest asks "
        "for missed batches; data-parallel rank r uses its port + r. Empty: ingest --replay-port-offset "
        "derives it from the address, else the pod cannot replay.",
    )
    event_endpoint = models.CharField(
        max_length=255,
        blank=True,
        validators=[validate_event_endpoint],
        help_text="Where the engine's KV-event PUB binds (e.g. tcp://10.0.0.7:5557): the ingest replica "
        "that owns the pod connects to it. Empty: the engine connects to ingest (its --bind).",
    )
    model = models.CharField(max_length=255, db_index=True)
    role = models.CharField(
        max_length=8,
        choices=[(role, role) for role in POD_ROLES],
        default="both",
        db_default="both",  # a row written without it (an older process, a raw insert): whole requests
        help_text="What the pod is for under prefill/decode disaggregation: prefill (it computes "
        "prompts and hands their KV cache on), decode (it takes handed-on KV caches and generates), "
        "or both (it serves whole requests). A model whose live pods include prefill and decode "
        "pods is routed in two steps (routing.disaggregation).",
    )
    labels = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_labels],
        help_text='Name -> string, e.g. {"zone": "b"}: shown in the registry, not used in scoring.',
    )
    enabled = models.BooleanField(
        default=True, help_text="A disabled pod's blocks are removed from the index and from scores."
    )
    health = models.CharField(
        max_length=16,
        choices=[("unknown", "unknown"), ("up", "up"), ("busy", "busy"), ("down", "down")],
        default="unknown",
        editable=False,
        help_text="What the liveness prober last concluded from the pod's /health (busy: serving, "
        "but its KV events stopped arriving); a down pod leaves scores.",
    )
    health_changed_at = models.DateTimeField(null=True, blank=True, editable=False)
    registered = models.BooleanField(
        default=True,
        editable=False,
        help_text="Registered by an operator or a fleet (the admin, the API, simulate --register, a pod "
        "selector); not registered: ingest made the row from the pod's KV events alone. Only the "
        "registry says where a pod is: ingest never gives one an address.",
    )
    learned_kv_cache_groups = models.JSONField(
        default=list,
        blank=True,
        editable=False,
        help_text="The KV-cache groups this pod's events described (kv_cache_spec_kind): its own "
        "scores follow them while its model config sets no kv_cache_groups.",
    )
    first_seen = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["pod_id"]

    def __str__(self) -> str:
        return self.pod_id


class ModelConfig(models.Model):
    """How one model's blocks are keyed (block size), tokenized and scored."""

    name = models.CharField(max_length=255, unique=True, help_text='As in the topic, e.g. "Qwen/Qwen3-0.6B".')
    block_size = models.PositiveIntegerField(
        default=16,
        validators=[validate_block_size],
        help_text=f"Must equal the engines' --block-size (1 to {MAX_BLOCK_SIZE} tokens).",
    )
    tokenizer_source = models.CharField(
        max_length=500,
        blank=True,
        help_text="A local directory (or tokenizer.json), or a model id it is an alias of; empty means "
        "auto-discovery. A new source must load to be saved.",
    )
    chat_template = models.TextField(
        blank=True,
        validators=[validate_chat_template],
        help_text="Overrides the tokenizer's own chat template (Jinja, as in tokenizer_config.json).",
    )
    tier_weights = models.JSONField(default=default_tier_weights, validators=[validate_tier_weights])
    other_tier_weight = models.FloatField(default=0.5, validators=[MinValueValidator(0.0)])
    lora_adapters = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_string_list],
        help_text="LoRA adapters served under it.",
    )
    max_model_len = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Context length in tokens (vLLM's --max-model-len); longer prompts are refused. "
        "Empty: the tokenizer config's model_max_length.",
    )
    hash_lookahead_tokens = models.PositiveSmallIntegerField(
        default=0,
        validators=[MaxValueValidator(MAX_HASH_LOOKAHEAD_TOKENS)],
        help_text="Must equal the engines' lookahead hashing (vLLM's num_hash_lookahead_tokens, set by "
        f"speculative decoding configs): each block's key also covers this many tokens after it. 0 to "
        f"{MAX_HASH_LOOKAHEAD_TOKENS}; 0 (the default): none.",
    )
    kv_cache_groups = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_kv_cache_groups],
        help_text="Hybrid models only: the engines' KV-cache groups in vLLM's order (group_idx), e.g. "
        '[{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4096}]. Empty: '
        "each pod's groups as its own events describe them, else one full-attention group.",
    )
    learned_kv_cache_groups = models.JSONField(
        default=list,
        blank=True,
        editable=False,
        help_text="The groups this model's pods described in their events (kv_cache_spec_kind), when "
        "they agree; empty when none did or they disagree (each pod has its own).",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "model config"

    def __str__(self) -> str:
        return self.name


def initial_seed() -> str:
    return settings.KVCACHE_HASH_SEED


class HashSeed(models.Model):
    """The single hash-seed setting: must equal the engines' PYTHONHASHSEED."""

    value = models.CharField(max_length=255, blank=True, default=initial_seed)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "hash seed"
        verbose_name_plural = "hash seed"

    def save(self, *args, **kwargs) -> None:
        self.pk = 1  # a singleton
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        return f"hash seed {self.value!r}"
