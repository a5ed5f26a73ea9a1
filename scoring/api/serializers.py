"""Request validation and response shapes of the API (and, through them, its OpenAPI schema).

Serializers validate and shape, nothing more. The fields on the scoring hot path are written to
cost little: a prompt is checked as one string, token ids as one list (not thousands of child
fields), and every error names the field and what to send instead.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from scoring.models import HashSeed, ModelConfig, Pod
from scoring.read_path import ChatRequest
from scoring.selectors import PodState

U64_MAX = (1 << 64) - 1


# --- fields ------------------------------------------------------------------------------------


@extend_schema_field({"type": "string"})
class TextField(serializers.Field):
    """A JSON string taken exactly as sent (no trimming, no coercion of numbers to text)."""

    default_error_messages = {
        "invalid": "must be a string",
        "blank": "may not be empty",
        "surrogate": "is not valid Unicode text (a lone surrogate at character {index})",
    }

    def __init__(self, *, allow_blank: bool = False, **kwargs: Any) -> None:
        self.allow_blank = allow_blank
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        if not data and not self.allow_blank:
            self.fail("blank")
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as error:
            self.fail("surrogate", index=error.start)
        return data

    def to_representation(self, value: str) -> str:
        return value


@extend_schema_field({"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1})
class TokenIdsField(serializers.Field):
    """A non-empty list of token ids (integers in 0..2**64-1), checked in one pass."""

    default_error_messages = {
        "invalid": "must be a non-empty list of integer token ids",
        "not_int": "token_ids[{index}] must be an integer, not {value!r}",
        "range": "token_ids[{index}] = {value} is outside 0..2**64-1",
    }

    def to_internal_value(self, data: Any) -> list[int]:
        if not isinstance(data, list) or not data:
            self.fail("invalid")
        if set(map(type, data)) != {int}:  # bools and floats are not token ids
            index = next(i for i, t in enumerate(data) if type(t) is not int)
            self.fail("not_int", index=index, value=data[index])
        low, high = min(data), max(data)
        if low < 0 or high > U64_MAX:
            value = low if low < 0 else high
            self.fail("range", index=data.index(value), value=value)
        return data

    def to_representation(self, value: list[int]) -> list[int]:
        return value


class MessagesField(serializers.ListField):
    """A conversation: a non-empty list of ``{"role", "content"}`` objects. Content is a string,
    a list of text parts ``[{"type": "text", "text": ...}]`` or null; other keys (``tool_calls``,
    ``name``...) are passed to the template. The template checks the rest."""

    default_error_messages = {
        "message": 'messages[{index}] must be an object with a string "role"',
        "content": "messages[{index}].content must be a string, a list of text parts or null",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.DictField(), allow_empty=False, **kwargs)

    def to_internal_value(self, data: Any) -> list[dict[str, Any]]:
        if not isinstance(data, list) or not data:
            self.fail("not_a_list" if not isinstance(data, list) else "empty", input_type=type(data).__name__)
        for index, message in enumerate(data):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                self.fail("message", index=index)
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                self.fail("content", index=index)
        return data


class ObjectListField(serializers.ListField):
    """A list of JSON objects passed through as they are (tools, documents)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.DictField(), **kwargs)


# --- scoring requests --------------------------------------------------------------------------


class GivenFieldsSerializer(serializers.Serializer):
    """Binds only the fields a request sends, plus the required ones.

    DRF deep-copies every declared field for each serializer it creates: ~150 us per request for
    ``ScoreRequest``'s 14 fields, most of which a scoring request never sends. Optional fields a
    request leaves out are then absent from ``validated_data`` (read them with ``.get`` and their
    default). Without data (schema generation, rendering) every field is bound, as usual."""

    def get_fields(self) -> dict[str, serializers.Field]:
        data = getattr(self, "initial_data", None)
        declared = self._declared_fields
        if not isinstance(data, Mapping):
            return copy.deepcopy(declared)
        return {
            name: copy.deepcopy(field) for name, field in declared.items() if field.required or name in data
        }


class ChatOptionsMixin(GivenFieldsSerializer):
    """The rendering options of a chat request (upstream's ``score_chat_completions`` fields)."""

    tools = ObjectListField(required=False, allow_null=True, help_text="Tool definitions for the template.")
    documents = ObjectListField(required=False, allow_null=True, help_text="Documents for RAG templates.")
    chat_template = TextField(
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="A Jinja chat template, or the name of one of the model's templates. "
        "Default (also for null or \"\"): the model config's template, else the tokenizer's own.",
    )
    chat_template_kwargs = serializers.DictField(
        required=False,
        allow_null=True,
        help_text="Extra template variables (e.g. enable_thinking); they win over the model's defaults.",
    )
    continue_final_message = serializers.BooleanField(required=False, default=False)
    return_assistant_tokens_mask = serializers.BooleanField(
        required=False, default=False, help_text="Accepted for compatibility; no tokens are returned."
    )

    def chat_request(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> ChatRequest:
        data = self.validated_data
        return ChatRequest(
            messages=messages,
            tools=data.get("tools"),
            documents=data.get("documents"),
            chat_template=data.get("chat_template") or None,
            chat_template_kwargs=data.get("chat_template_kwargs"),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=data.get("continue_final_message", False),
        )


class ScoreCompletionsRequest(serializers.Serializer):
    """Upstream's ``POST /score_completions`` body."""

    class Meta:
        ref_name = "ScoreCompletions"  # the schema adds "Request"

    model = TextField(help_text='The served model name, e.g. "Qwen/Qwen3-0.6B".')
    prompt = TextField(help_text="The completion prompt, exactly as sent to vLLM.")


class ScoreChatCompletionsRequest(ChatOptionsMixin):
    """Upstream's ``POST /score_chat_completions`` body."""

    class Meta:
        ref_name = "ScoreChatCompletions"

    model = TextField(help_text='The served model name, e.g. "Qwen/Qwen3-0.6B".')
    messages = MessagesField(help_text='[{"role": "user", "content": "..."}, ...]')
    add_generation_prompt = serializers.BooleanField(
        required=False, default=False, help_text="Default false, as upstream."
    )


class ScoreRequest(ChatOptionsMixin):
    """``POST /api/v1/score``: exactly one of ``prompt``, ``messages`` or ``token_ids``."""

    INPUTS = ("prompt", "messages", "token_ids")

    class Meta:
        ref_name = "Score"

    model = TextField(help_text='The served model name, e.g. "Qwen/Qwen3-0.6B".')
    prompt = TextField(required=False, help_text="A completion prompt.")
    messages = MessagesField(
        required=False, help_text="A conversation, rendered with the model's chat template."
    )
    token_ids = TokenIdsField(
        required=False, help_text="The prompt already tokenized: no tokenizer needed, any model name works."
    )
    pods = serializers.ListField(
        child=TextField(),
        required=False,
        allow_empty=False,
        help_text="Score only these pods (default: every enabled pod).",
    )
    lora_name = TextField(
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="The LoRA adapter the request will be served with (it changes every block key).",
    )
    add_generation_prompt = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="With messages: default true (as vLLM's chat completions), false when "
        "continue_final_message is true.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        given = [name for name in self.INPUTS if name in attrs]
        if len(given) != 1:
            problem = "none was given" if not given else f"got {', '.join(given)}"
            raise serializers.ValidationError(
                {"non_field_errors": [f"send exactly one of prompt, messages or token_ids ({problem})"]}
            )
        if given[0] != "messages":
            chat_only = [
                name
                for name in ("tools", "documents", "chat_template", "chat_template_kwargs")
                if attrs.get(name)
            ]
            if attrs.get("add_generation_prompt") is not None:
                chat_only.append("add_generation_prompt")
            if attrs.get("continue_final_message"):
                chat_only.append("continue_final_message")
            if chat_only:
                raise serializers.ValidationError(
                    {name: [f"only applies to messages, not to {given[0]}"] for name in chat_only}
                )
        return attrs

    def generation_prompt(self) -> bool:
        data = self.validated_data
        chosen = data.get("add_generation_prompt")
        return not data.get("continue_final_message", False) if chosen is None else chosen


# --- scoring responses (documentation of the shapes the views build) ----------------------------


PodScoresField = extend_schema_field(
    {"type": "object", "additionalProperties": {"type": "number"}, "example": {"pod-a": 25.0}}
)


@PodScoresField
class PodScoresSchema(serializers.DictField):
    """``{pod: score}``; ``{}`` when nothing matched."""


class ScoreChatCompletionsResponse(serializers.Serializer):
    podScores = PodScoresSchema(child=serializers.FloatField())  # upstream's name
    templated_messages = serializers.CharField(help_text="The rendered prompt that was scored.")


class PodResult(serializers.Serializer):
    score = serializers.FloatField(help_text="Sum of the tier weights of the matched blocks.")
    matched_blocks = serializers.IntegerField(help_text="Leading blocks of the prompt the pod holds.")
    normalized = serializers.FloatField(help_text="matched_blocks / blocks.")
    tier = serializers.CharField(help_text='The slowest tier of the matched prefix ("gpu" when all on GPU).')


class ScoreResponse(serializers.Serializer):
    model = serializers.CharField()
    blocks = serializers.IntegerField(help_text="Full blocks in the request (a partial last block is not).")
    scores = PodScoresSchema(child=serializers.FloatField())
    pods = serializers.DictField(child=PodResult(), help_text="The same pods, with the detail.")


class ErrorDetail(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField(help_text="What went wrong and what to fix.")
    fields = serializers.DictField(required=False, help_text="Field -> problems, for invalid requests.")


class ErrorResponse(serializers.Serializer):
    error = ErrorDetail()


# --- the registry ------------------------------------------------------------------------------


class PodSerializer(serializers.ModelSerializer):
    """A pod as written through the API."""

    class Meta:
        model = Pod
        fields = ["pod_id", "address", "model", "labels", "enabled", "first_seen", "last_seen"]
        read_only_fields = ["first_seen", "last_seen"]


class PodStateSerializer(serializers.Serializer):
    """A pod with what is live about it (output only)."""

    pod_id = serializers.CharField()
    address = serializers.CharField()
    model = serializers.CharField()
    labels = serializers.JSONField()
    enabled = serializers.BooleanField()
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
            "updated_at",
        ]
        read_only_fields = ["updated_at"]


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
