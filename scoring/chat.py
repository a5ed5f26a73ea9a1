"""Chat templates: turn an OpenAI-style conversation into the prompt text the model sees.

The output is, by construction, what ``transformers``' ``tokenizer.apply_chat_template(...,
tokenize=False)`` renders: the work is done by transformers' own ``render_jinja_template`` (a
sandboxed Jinja environment, compiled templates cached by transformers in an LRU), and this module
only adds what ``apply_chat_template`` does around it (choose the template, pass the special tokens,
drop ``None`` fields, refuse ``add_generation_prompt`` with ``continue_final_message``) plus:

* content given as a list of text parts (``[{"type": "text", "text": ...}]``) is joined with
  ``"\\n"`` into a string, as vLLM does, unless the template itself iterates over a message's
  content parts; ``null`` content (an assistant turn with only tool calls) is empty, as in vLLM
  (transformers would drop the field and most templates would fail on it);
* ``chat_template_kwargs`` are merged over the model's defaults, the caller's values winning;
* every failure is a :class:`ChatTemplateError` whose message says what to fix.

Calling ``render_jinja_template`` directly measured as fast as rendering the compiled template
ourselves and faster than going through a transformers tokenizer, which we would otherwise have to
load next to the ``tokenizers`` one.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

# The named special tokens transformers passes to every template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names the renderer sets itself; a caller putting them in chat_template_kwargs is told where they go.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "conversations",
        "return_assistant_tokens_mask",
    }
)

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: bad input, no template, or the template refused it."""


@dataclass(frozen=True)
class ChatTemplates:
    """What a model contributes to rendering: its templates by name and its default template variables.

    A model with a single template has it under ``"default"``. ``default_kwargs`` are the named
    special tokens (``eos_token``...) that transformers exposes to every template.
    """

    templates: Mapping[str, str] = field(default_factory=dict)
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_directory(cls, directory: Path) -> ChatTemplates:
        """Read a tokenizer directory the way transformers does: ``tokenizer_config.json``'s
        ``chat_template`` (a string or a list of ``{"name", "template"}``), overridden by
        ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` when present.
        Raises ``OSError`` or ``ValueError`` (bad JSON) for unreadable files."""
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        templates: dict[str, str] = {}
        configured = config.get("chat_template")
        if isinstance(configured, str):
            templates[DEFAULT_TEMPLATE_NAME] = configured
        elif isinstance(configured, list):
            templates.update({entry["name"]: entry["template"] for entry in configured})
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            templates[DEFAULT_TEMPLATE_NAME] = jinja_file.read_text(encoding="utf-8")
        extra_dir = directory / "additional_chat_templates"
        if extra_dir.is_dir():
            for extra in sorted(extra_dir.glob("*.jinja")):
                templates[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
        return cls(templates=templates, default_kwargs=special_tokens(config))

    def select(self, chat_template: str | None, *, tools: object | None) -> str:
        """The template to render with, chosen as transformers' ``get_chat_template`` does: the
        request's template (or the name of one of the model's templates), else the model's
        ``tool_use`` template when tools are given, else its default."""
        several = len(self.templates) > 1
        if chat_template is not None:
            return (
                self.templates[chat_template]
                if several and chat_template in self.templates
                else chat_template
            )
        if tools is not None and several and TOOL_USE_TEMPLATE_NAME in self.templates:
            return self.templates[TOOL_USE_TEMPLATE_NAME]
        if DEFAULT_TEMPLATE_NAME in self.templates:
            return self.templates[DEFAULT_TEMPLATE_NAME]
        if self.templates:
            raise ChatTemplateError(
                "the model has several chat templates and none is the default: pass chat_template "
                f"(a template or one of {sorted(self.templates)})"
            )
        raise ChatTemplateError("the model has no chat template: pass one in chat_template")


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a ``tokenizer_config.json`` (plain strings or AddedToken dicts)."""
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """The prompt text and how long rendering took (seconds), for the render-latency histogram."""

    text: str
    elapsed: float


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    templates: ChatTemplates,
    chat_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> RenderedChat:
    """Render ``messages`` with the request's ``chat_template`` or the model's own.

    Guarantees: the text equals ``apply_chat_template(messages, tools=..., documents=...,
    chat_template=..., add_generation_prompt=..., continue_final_message=..., tokenize=False,
    **chat_template_kwargs)`` on the model's transformers tokenizer, for messages whose content is a
    string; content given as text parts renders as their ``"\\n"``-joined text (unless the template
    reads parts itself). The caller's ``chat_template_kwargs`` win over the model's defaults.
    Raises :class:`ChatTemplateError` for anything the caller must fix.
    """
    started = time.perf_counter()
    kwargs = _template_kwargs(templates.default_kwargs, chat_template_kwargs)
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be true: the first starts a new "
            "assistant message, the second continues the last one"
        )
    template = templates.select(chat_template, tools=tools)
    conversation = _conversation(messages, keep_parts=template_reads_content_parts(template))
    _check_list_of_objects("tools", tools)
    _check_list_of_objects("documents", documents)
    render_jinja_template = _renderer()
    try:
        rendered, _ = render_jinja_template(
            conversations=[conversation],
            tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"chat_template is not valid Jinja (line {error.lineno}): {error.message}"
        ) from error
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        # TypeError: a template doing arithmetic on a field of the wrong type ("str" + list).
        raise ChatTemplateError(f"the chat template could not render this conversation: {error}") from error
    return RenderedChat(text=rendered[0], elapsed=time.perf_counter() - started)


def _template_kwargs(defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return dict(defaults)
    if not isinstance(overrides, Mapping) or not all(isinstance(key, str) for key in overrides):
        raise ChatTemplateError("chat_template_kwargs must be an object with string keys")
    reserved = sorted(RESERVED_KWARGS.intersection(overrides))
    if reserved:
        raise ChatTemplateError(
            f"chat_template_kwargs cannot set {', '.join(reserved)}: use the request field of that name"
        )
    return {**defaults, **overrides}


def _conversation(messages: Sequence[Mapping[str, Any]], *, keep_parts: bool) -> list[dict[str, Any]]:
    """Validated copies of the messages: ``None`` fields dropped (as ``apply_chat_template`` does),
    missing content empty, text parts joined unless the template reads parts itself."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] must be an object with a string role")
        copy = {key: value for key, value in message.items() if value is not None}
        content = copy.get("content")
        if content is None:
            copy["content"] = [] if keep_parts else ""
        elif isinstance(content, list):
            copy["content"] = _parts(content, index) if keep_parts else "\n".join(_texts(content, index))
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
        conversation.append(copy)
    return conversation


def _texts(parts: list[Any], index: int) -> list[str]:
    return [part["text"] for part in _parts(parts, index)]


def _parts(parts: list[Any], index: int) -> list[dict[str, Any]]:
    for part in parts:
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ChatTemplateError(
                f'messages[{index}].content: only text parts {{"type": "text", "text": "..."}} are supported'
            )
    return [dict(part) for part in parts]


def _check_list_of_objects(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise ChatTemplateError(f"{name} must be a list of objects")
    if not all(isinstance(item, Mapping) for item in value):
        raise ChatTemplateError(f"{name} must be a list of objects")


# `{% for x in <expression> %}` where the expression reads a message's content (`.content` or
# `['content']`): such templates render content parts themselves (vLLM's "openai" content format).
_FOR_OVER_CONTENT = re.compile(
    r"\{%-?\s*for\s+[\w\s,]+\s+in\s+[^%]*?(?:\.content\b|\[\s*['\"]content['\"]\s*\])[^%]*-?%\}"
)


@functools.lru_cache(maxsize=256)
def template_reads_content_parts(template: str) -> bool:
    """Whether ``template`` iterates over a message's content, i.e. expects a list of parts."""
    return _FOR_OVER_CONTENT.search(template) is not None


@functools.cache
def _renderer():
    # Imported on first use: transformers takes ~0.6 s to import, which processes that never render
    # a chat (the ingest workers, management commands) should not pay.
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template
