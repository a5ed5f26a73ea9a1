"""Chat templates: turn an OpenAI-style conversation into the prompt text the model sees.

The output is, by construction, what ``transformers``' ``tokenizer.apply_chat_template(...,
tokenize=False)`` renders: :func:`render_template` does what transformers' ``render_jinja_template``
does (the same sandboxed Jinja environment, template globals and filters, the same handling of
reasoning fields and of ``continue_final_message``), and :func:`render_chat` adds what
``apply_chat_template`` does around it (choose the template, pass the special tokens, drop ``None``
fields, refuse ``add_generation_prompt`` with ``continue_final_message``) plus:

* content given as a list of text parts (``[{"type": "text", "text": ...}]``) is joined with
  ``"\\n"`` into a string, as vLLM does, unless the template itself iterates over a message's
  content parts; ``null`` content (an assistant turn with only tool calls) is empty, as in vLLM
  (transformers would drop the field and most templates would fail on it);
* ``chat_template_kwargs`` are merged over the model's defaults, the caller's values winning;
* every failure is a :class:`ChatTemplateError` whose message says what to fix.

Templates render in a **bounded** environment (:class:`BoundedEnvironment`), because a request may
send its own template: Jinja's sandbox stops templates from reaching Python internals, but not from
asking for ``9 ** (9 ** 8)`` or ``'a' * 10 ** 9``. The bounded environment keeps every single step
of a render small (the invariant, kept by the checks in that class): no step takes an input whose
text is longer than the output budget, and none produces more than a constant times that budget;
numbers stay under :data:`DEFAULT_MAX_INT_BITS` bits, ``range`` under :data:`DEFAULT_MAX_RANGE`
items, and the streamed output under the budget. A refused step is a :class:`TemplateBudgetExceeded`.
What it cannot bound is the number of steps (nested loops): untrusted templates get a CPU budget only
in ``tokenization.template_sandbox.TemplateSandbox``'s worker processes.

transformers is not imported here (it takes ~0.6 s to import); the tests compare against it.
Rendering measured as fast as through transformers' ``render_jinja_template``: ~0.2 ms for a
five-message Qwen3 conversation on the test machine either way (the bounds cost a few percent).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import time
import types
from collections import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.filters
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum
from markupsafe import Markup

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

# Twice the default request-body limit (KVCACHE_MAX_BODY_BYTES, 4 MiB): room for any prompt a
# request can carry plus the template's own text, far below what would hurt a process.
DEFAULT_MAX_OUTPUT_CHARS = 8 * 1024 * 1024
# Items one ``range()`` may have; Jinja's sandbox allows 100,000.
DEFAULT_MAX_RANGE = 10_000
# Bits an integer a template computes may have: ~4,900 decimal digits, more than Python will print
# (4,300), and multiplying two such numbers takes microseconds.
DEFAULT_MAX_INT_BITS = 16_384

# Compiled templates are cached, except long ones: a request may send a new 4 MiB template each time.
_COMPILED_CACHE_SIZE = 64
_CACHED_TEMPLATE_CHARS = 64 * 1024
# Error messages quote the failing exception, shortened: its text may hold a huge value.
_MAX_ERROR_CHARS = 500


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: bad input, no template, or the template refused it."""


class TemplateBudgetExceeded(ChatTemplateError):
    """The template needed more than a render may use (output size, a number, a range, CPU, memory,
    recursion depth); the message names the budget and what to change."""


class RequestTemplateRefused(ChatTemplateError):
    """The request sent its own chat template and this server does not render request templates."""


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

    def owns(self, template: str) -> bool:
        """Whether ``template`` (a template's text) is one of the model's own templates: trusted, as
        opposed to a template written by whoever sent the request."""
        return any(template == own for own in self.templates.values())


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


class TemplateRenderer(Protocol):
    """Renders untrusted templates elsewhere, as ``render_template`` would here (with budgets of
    its own): ``tokenization.template_sandbox.TemplateSandbox``."""

    def render(
        self,
        template: str,
        conversation: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...


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
    sandbox: TemplateRenderer | None = None,
    allow_request_templates: bool = True,
) -> RenderedChat:
    """Render ``messages`` with the request's ``chat_template`` or the model's own.

    Guarantees: the text equals ``apply_chat_template(messages, tools=..., documents=...,
    chat_template=..., add_generation_prompt=..., continue_final_message=..., tokenize=False,
    **chat_template_kwargs)`` on the model's transformers tokenizer, for messages whose content is a
    string; content given as text parts renders as their ``"\\n"``-joined text (unless the template
    reads parts itself). The caller's ``chat_template_kwargs`` win over the model's defaults.

    The model's own templates (chosen by default, by name, or sent verbatim) render in this process.
    A template written by the request is untrusted: refused (:class:`RequestTemplateRefused`) unless
    ``allow_request_templates``, rendered in ``sandbox``'s worker processes when one is given (CPU
    and memory budgets), else here (bounded steps, but no CPU budget).
    Raises :class:`ChatTemplateError` (:class:`TemplateBudgetExceeded` for a template that needs
    more than a render may use) for anything the caller must fix, and ``SandboxBusy`` when every
    sandbox worker stayed busy.
    """
    started = time.perf_counter()
    kwargs = _template_kwargs(templates.default_kwargs, chat_template_kwargs)
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be true: the first starts a new "
            "assistant message, the second continues the last one"
        )
    template = templates.select(chat_template, tools=tools)
    trusted = templates.owns(template)
    if not trusted and not allow_request_templates:
        raise RequestTemplateRefused(_refusal(templates))
    conversation = _conversation(messages)
    _check_list_of_objects("tools", tools)
    _check_list_of_objects("documents", documents)
    options: dict[str, Any] = {
        "tools": None if tools is None else list(tools),
        "documents": None if documents is None else list(documents),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "kwargs": kwargs,
    }
    if trusted or sandbox is None:
        text = render_template(template, conversation, **options)
    else:
        text = sandbox.render(template, conversation, **options)
    return RenderedChat(text=text, elapsed=time.perf_counter() - started)


def _refusal(templates: ChatTemplates) -> str:
    names = (
        f", or name one of its templates: {sorted(templates.templates)}"
        if len(templates.templates) > 1
        else ""
    )
    return (
        "this server does not render chat templates sent with a request (KVCACHE_REQUEST_TEMPLATES is off): "
        f"leave out chat_template to use the model's own template{names}"
    )


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


def _conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated copies of the messages: ``None`` fields dropped (as ``apply_chat_template`` does),
    content a string or a list of validated text parts (``[]`` when missing). Whether parts are
    joined depends on the template, which :func:`render_template` reads."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] must be an object with a string role")
        copy = {key: value for key, value in message.items() if value is not None}
        content = copy.get("content")
        if content is None:
            copy["content"] = []
        elif isinstance(content, list):
            copy["content"] = _parts(content, index)
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
        conversation.append(copy)
    return conversation


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


# --- rendering one conversation (what transformers' render_jinja_template does) ----------------

# Names a message's reasoning is passed under; the first is the one chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """The bounds of one render; see :class:`BoundedEnvironment` for where each one is kept."""

    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    max_range: int = DEFAULT_MAX_RANGE
    max_int_bits: int = DEFAULT_MAX_INT_BITS


DEFAULT_LIMITS = TemplateLimits()


def render_template(
    template: str,
    conversation: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    limits: TemplateLimits = DEFAULT_LIMITS,
) -> str:
    """Render one conversation (messages whose content is a string or a list of text parts, as
    :func:`render_chat` passes them) with ``template``, in this process.

    Guarantees: the text is what transformers' ``render_jinja_template`` renders for the same
    inputs, when that stays within ``limits``; the template sees only plain data (copies); every
    failure is a :class:`ChatTemplateError` (:class:`TemplateBudgetExceeded` past a limit).
    This is also what ``TemplateSandbox`` workers run.
    """
    try:
        compiled = _compile(template, limits)
        chat = _alias_reasoning_fields(
            _join_text_parts(plain_data(conversation), keep_parts=compiled.reads_content_parts)
        )
        final_message = _tag_final_message(chat, template) if continue_final_message else None
        text = _generate(
            compiled.template,
            limits.max_output_chars,
            {
                "messages": chat,
                "tools": plain_data(tools),
                "documents": plain_data(documents),
                "add_generation_prompt": add_generation_prompt,
                **plain_data(dict(kwargs or {})),
            },
        )
        return text if final_message is None else _cut_at_tag(text, final_message)
    except ChatTemplateError:
        raise
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"chat_template is not valid Jinja (line {error.lineno}): {_brief(error.message)}"
        ) from error
    except RecursionError as error:
        raise TemplateBudgetExceeded(
            "the chat template nests or recurses too deeply (deeply nested expressions or lists, or a "
            "macro calling itself without end): simplify it"
        ) from error
    except MemoryError as error:
        raise TemplateBudgetExceeded("the chat template ran out of memory: make it build less") from error
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        # TypeError: a template doing arithmetic on a field of the wrong type ("str" + list).
        raise ChatTemplateError(
            f"the chat template could not render this conversation: {_brief(error)}"
        ) from error
    except Exception as error:
        raise ChatTemplateError(
            f"the chat template could not render this conversation: {type(error).__name__}: {_brief(error)}"
        ) from error


def _brief(error: object) -> str:
    text = str(error)
    return text if len(text) <= _MAX_ERROR_CHARS else f"{text[:_MAX_ERROR_CHARS]}..."


def plain_data(value: Any) -> Any:
    """A copy made of plain JSON-like types only (what transformers' ``_plain_template_data`` makes):
    anything else becomes a placeholder naming its type, so a template never sees a rich object."""
    kind = type(value)
    if value is None or kind is str or kind is int or kind is float or kind is bool:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    return f"<{kind.__name__}>"


def _join_text_parts(conversation: list[dict[str, Any]], *, keep_parts: bool) -> list[dict[str, Any]]:
    if not keep_parts:
        for message in conversation:
            if isinstance(message.get("content"), list):
                message["content"] = "\n".join(part["text"] for part in message["content"])
    return conversation


def _alias_reasoning_fields(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Fill `reasoning_content` from older names for it, and `thinking` for gpt-oss templates.
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(chat: list[dict[str, Any]], template: str) -> str:
    """Mark the end of the last message so it can be cut there after rendering, as transformers
    does for ``continue_final_message``; returns the message's text."""
    final = chat[-1].get("content")
    if final is None:
        raise ChatTemplateError(
            'continue_final_message is set but the final message has no "content" to continue'
        )
    if "content" not in template:
        raise ChatTemplateError(
            'continue_final_message is set but the chat template does not read "content": '
            "it cannot be continued"
        )
    if isinstance(final, list | tuple):
        for part in reversed(final):
            if "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final_message: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_message.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat: "
            "the chat template changes or drops it, so it cannot be continued"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the message's trailing spacing: trim ours too.
    return rendered[:at].rstrip()


def _generate(template: jinja2.Template, max_chars: int, variables: dict[str, Any]) -> str:
    """The template's output, streamed so that rendering stops once it passes ``max_chars``."""
    parts = []
    total = 0
    for part in template.generate(variables):
        total += len(part)
        if total > max_chars:
            raise TemplateBudgetExceeded(
                f"the chat template's output passed the {max_chars}-character budget: render less text"
            )
        parts.append(part)
    return "".join(parts)


def template_reads_content_parts(template: str) -> bool:
    """Whether ``template`` iterates over a message's content, i.e. expects a list of parts: a
    ``{% for %}`` whose iterable (or condition) reads ``.content`` or ``['content']``. False for a
    template that is not valid Jinja."""
    try:
        return _reads_content_parts(_environment(DEFAULT_LIMITS).parse(template))
    except (jinja2.TemplateSyntaxError, RecursionError):
        return False


def _reads_content_parts(ast: nodes.Template) -> bool:
    # Walks the parsed template, in time linear in its size (a regular expression over the text
    # backtracked for seconds on a crafted 80 kB template).
    for loop in ast.find_all(nodes.For):
        for expression in (loop.iter, loop.test):
            if expression is not None and any(
                _reads_content(node) for node in (expression, *expression.find_all(nodes.Expr))
            ):
                return True
    return False


def _reads_content(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False


@dataclass(frozen=True, slots=True)
class _Compiled:
    template: jinja2.Template
    reads_content_parts: bool


def _compile(source: str, limits: TemplateLimits) -> _Compiled:
    if len(source) <= _CACHED_TEMPLATE_CHARS:
        return _compile_cached(source, limits)
    return _compile_uncached(source, limits)


@functools.lru_cache(maxsize=_COMPILED_CACHE_SIZE)
def _compile_cached(source: str, limits: TemplateLimits) -> _Compiled:
    return _compile_uncached(source, limits)


def _compile_uncached(source: str, limits: TemplateLimits) -> _Compiled:
    environment = _environment(limits)
    ast = environment.parse(source)
    return _Compiled(environment.from_string(ast), _reads_content_parts(ast))


@functools.lru_cache(maxsize=8)
def _environment(limits: TemplateLimits) -> BoundedEnvironment:
    return BoundedEnvironment(limits)


# --- the bounded environment ------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's text with it
    (for its assistant-token mask, which we never ask for); renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: nodes.EvalContext, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates, without handing them the ``dict`` type (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """``namespace(...)`` refusing underscore names, which could reach CPython internals (as
    transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature, so that `namespace(self=...)` works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}: rename the attribute"
            )


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to the environment's bounded join instead of Jinja's ``str_join``."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.str_join((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class _Oversized(Exception):
    """Internal: a size estimate passed its limit."""


# String methods (str and bytes) whose result can be much longer than the string: checked in `call`.
_CHECKED_METHODS = frozenset(
    {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate", "to_bytes"}
)
# Filters that turn their input into text: the input's text must fit the budget.
_TEXT_FILTERS = (
    "string",
    "e",
    "escape",
    "forceescape",
    "safe",
    "trim",
    "upper",
    "lower",
    "title",
    "capitalize",
    "striptags",
    "wordcount",
    "truncate",
    "urlencode",
    "xmlattr",
)
# One %-conversion: (key), flags, width, .precision, length modifier, type.
_PRINTF_CONVERSION = re.compile(
    r"%(?:\((?P<key>[^()]*)\))?[#0\- +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?[hlL]?(?P<kind>.?)",
    re.DOTALL,
)
_DIGITS = re.compile(r"\d+")
_SEQUENCES = (str, bytes, list, tuple)
# A float printed with %f / {:f} has up to 309 integer digits.
_FLOAT_TEXT = 330
_MAX_WIDTH_DIGITS = 9
_MAX_STRFTIME_FORMAT = 4096
_MAX_LIPSUM_WORDS = 100_000


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with every step of a render bounded.

    Configured as transformers' ``render_jinja_template`` configures its own (an immutable sandbox,
    ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, its
    ``tojson`` filter and its ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``
    globals), so a template renders to the same text. On top, with ``limits.max_output_chars``
    as the budget, the steps that could allocate or compute without bound in one call check their
    arguments first and raise :class:`TemplateBudgetExceeded`:

    * operators ``+``, ``*``, ``**``, ``%`` (``call_binop``): strings and lists stay within the
      budget, integers within ``limits.max_int_bits``, ``%``-formats' widths and arguments within it;
    * ``~``, ``{{ ... }}`` output, macro and block bodies (``str_join``, ``finalize``, ``concat``):
      the text of a value is measured before it is made (a list nested in itself many times has a
      short source and an enormous text);
    * string methods with a width or a multiplying argument, ``str.format`` and ``int.to_bytes``
      (``call``, ``wrap_str_format``); filters that build text (``center``, ``indent``, ``join``,
      ``replace``, ``wordwrap``, ``format``, ``tojson``, ``pprint``, ...) or repeat items
      (``batch``, ``slice``, ``sum``);
    * ``range`` (at most ``limits.max_range`` items), ``lipsum`` and ``strftime_now``.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, limits: TemplateLimits = DEFAULT_LIMITS) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
            finalize=self._finalize,
        )
        self.limits = limits
        self.filters["tojson"] = self._tojson
        self.globals.update(
            {
                "raise_exception": self._raise_exception,
                "strftime_now": self._strftime_now,
                "dict": _TemplateDict(),
                "namespace": _TemplateNamespace,
                "range": self._range,
                "lipsum": self._lipsum,
            }
        )
        for name in _TEXT_FILTERS:
            self.filters[name] = self._text_filter(_sync(self.filters[name]))
        for name, check in {
            "center": self._check_center,
            "indent": self._check_indent,
            "replace": self._check_replace_filter,
            "wordwrap": self._check_wordwrap,
            "format": self._check_format_filter,
            "pprint": self._check_pprint,
            "urlize": self._check_urlize,
            "batch": self._check_batch,
            "slice": self._check_slice,
        }.items():
            self.filters[name] = self._checked_filter(_sync(self.filters[name]), check)
        self.filters["join"] = self._join_filter(_sync(self.filters["join"]))
        self.filters["sum"] = self._sum_filter(_sync(self.filters["sum"]))

    # -- measuring ------------------------------------------------------------------------------

    def refuse(self, what: str, fix: str) -> TemplateBudgetExceeded:
        """The error for a step past the budget: ``what`` the template did, ``fix`` what to change."""
        return TemplateBudgetExceeded(f"the chat template {what}: {fix}")

    def check_length(self, length: int, what: str) -> None:
        """Refuse a result of ``length`` characters (or items) past the output budget."""
        if length > self.limits.max_output_chars:
            raise self.refuse(
                f"{what} past the {self.limits.max_output_chars}-character output budget", "make less text"
            )

    def check_text(self, value: Any, what: str = "turns a value into text") -> int:
        """The length of ``value``'s text (an estimate, never below the real length for strings and
        containers of them); refuses a value whose text would pass the output budget."""
        size = len(value) if type(value) is str else _text_size(value, self.limits.max_output_chars)
        self.check_length(size, what)
        return size

    def _finalize(self, value: Any) -> Any:
        if type(value) is not str:
            self.check_text(value, "prints a value whose text would be")
        return value

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """Join a macro's, block's or ``{% set %}`` body's output, within the budget."""
        parts = list(parts)
        self.check_length(sum(map(len, parts)), "builds a block of text")
        return "".join(parts)

    def str_join(self, values: Iterable[Any]) -> str:
        """``a ~ b``: the values' texts joined, within the budget."""
        parts = [value if type(value) is str else self._text(value) for value in values]
        self.check_length(sum(map(len, parts)), "joins text (~)")
        return "".join(parts)

    def _text(self, value: Any) -> str:
        self.check_text(value)
        return str(value)

    # -- operators ------------------------------------------------------------------------------

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            # Templates add strings all the time: keep that path short.
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                self.check_length(len(left) + len(right), "adds strings or lists")
            return left + right
        if operator == "*":
            self._check_multiply(left, right)
        elif operator == "**":
            self._check_power(left, right)
        elif operator == "%" and isinstance(left, str | bytes):
            self._check_printf(left, right)
        return self.binop_table[operator](left, right)

    def _check_multiply(self, left: Any, right: Any) -> None:
        sequence, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, _SEQUENCES) and isinstance(count, int):
            self.check_length(len(sequence) * count, "repeats a string or list (*)")
        elif isinstance(left, int) and isinstance(right, int):
            self._check_bits(left.bit_length() + right.bit_length(), "multiplies")

    def _check_power(self, base: Any, exponent: Any) -> None:
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 1 and abs(base) > 1:
            bits = exponent * math.log2(abs(base)) if exponent.bit_length() < 64 else math.inf
            self._check_bits(bits, "raises to a power (**)")

    def _check_bits(self, bits: float, what: str) -> None:
        if bits > self.limits.max_int_bits:
            raise self.refuse(
                f"{what} to a number of more than {self.limits.max_int_bits} bits", "use smaller numbers"
            )

    def _check_printf(self, template: str | bytes, values: Any) -> None:
        """``template % values``: the literal text plus, for each conversion, its width, precision
        and the text of the value it formats."""
        fmt = template.decode("latin-1") if isinstance(template, bytes) else template
        if "%" not in fmt:
            return
        mapping = values if isinstance(values, Mapping) else None
        positional = iter(values if isinstance(values, tuple) else (values,))
        total = len(fmt)
        for conversion in _PRINTF_CONVERSION.finditer(fmt):
            kind = conversion["kind"]
            if kind == "%":
                continue
            if kind == "(":
                raise self.refuse("uses a %-format key with parentheses", "use a simpler key")
            total += self._width(conversion["width"], positional)
            total += self._width(conversion["precision"], positional)
            key = conversion["key"]
            if key is None:
                value = next(positional, None)
            else:
                value = mapping.get(key) if mapping is not None else None
            total += self.formatted_size(value)
            self.check_length(total, "formats text (%)")

    def _width(self, spec: str | None, positional: abc.Iterator[Any]) -> int:
        if spec is None:
            return 0
        if spec == "*":
            width = next(positional, 0)
            return abs(width) if isinstance(width, int) else 0
        if len(spec) > _MAX_WIDTH_DIGITS:
            raise self.refuse(f"pads text to a width of {len(spec)} digits", "use a smaller width")
        return int(spec)

    def formatted_size(self, value: Any) -> int:
        """The longest text a %-conversion or format field can make of ``value`` (widths apart)."""
        if isinstance(value, float):
            return _FLOAT_TEXT
        if isinstance(value, int):
            return value.bit_length() + 2
        return self.check_text(value, "formats a value whose text would be")

    # -- calls ----------------------------------------------------------------------------------

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        kind = type(obj)
        if (kind is types.BuiltinMethodType or kind is types.MethodType) and obj.__name__ in _CHECKED_METHODS:
            owner = obj.__self__
            if isinstance(owner, str | bytes):
                args = self._check_string_method(owner, obj.__name__, args, kwargs)
            elif isinstance(owner, int) and obj.__name__ == "to_bytes":
                length = args[0] if args else kwargs.get("length", 1)
                if isinstance(length, int):
                    self.check_length(length, "asks int.to_bytes() for bytes")
        # SandboxedEnvironment.call, inlined: this runs for every call a template makes.
        if not self.is_safe_callable(obj):
            raise jinja2.exceptions.SecurityError(f"{obj!r} is not safely callable")
        return context.call(obj, *args, **kwargs)

    def _check_string_method(
        self, owner: str | bytes, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ...]:
        """Checks a string method's result size before the call; returns the arguments to call it
        with (``join`` gets its iterable as a list, measured once)."""
        if name in ("center", "ljust", "rjust", "zfill"):
            width = args[0] if args else kwargs.get("width")
            if isinstance(width, int):
                self.check_length(width, f"pads text with {name}()")
        elif name == "expandtabs":
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tabsize, int):
                tab = "\t" if isinstance(owner, str) else b"\t"
                self.check_length(len(owner) + owner.count(tab) * tabsize, "expands tabs")
        elif name == "replace" and len(args) >= 2:
            self.check_length(_replaced_length(owner, *args[:3]), "replaces text")
        elif name == "join" and args:
            items = args[0] if isinstance(args[0], str | bytes | list | tuple) else list(args[0])
            self.check_length(_joined_length(owner, items), "joins text")
            return (items, *args[1:])
        elif name == "translate" and args and isinstance(owner, str):
            self.check_length(len(owner) * _longest_replacement(args[0]), "translates text")
        return args

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` and ``str.format_map``, through a formatter that measures each field
        (Jinja's own wrapper, with a bounded formatter)."""
        if not isinstance(value, types.MethodType | types.BuiltinMethodType) or value.__name__ not in (
            "format",
            "format_map",
        ):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        formatter: SandboxedFormatter = (
            _BoundedEscapeFormatter(self, escape=owner.escape)
            if isinstance(owner, Markup)
            else _BoundedFormatter(self)
        )
        is_format_map = value.__name__ == "format_map"
        str_type = type(owner)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return str_type(formatter.vformat(owner, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    # -- globals --------------------------------------------------------------------------------

    def _range(self, *args: int) -> range:
        items = range(*args)
        try:
            length = len(items)
        except OverflowError:
            length = math.inf
        if length > self.limits.max_range:
            raise self.refuse(
                f"asks for a range of {'too many' if length == math.inf else length} items",
                f"chat templates may use ranges of at most {self.limits.max_range} items",
            )
        return items

    def _raise_exception(self, message: Any) -> None:
        # The message becomes the error's text: measured first, like any other text.
        raise jinja2.exceptions.TemplateError(self._text(message))

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        # Jinja's parameter names: `min` and `max` are the words per paragraph.
        if all(isinstance(value, int) for value in (n, min, max)):
            words = n * (max if max > min else min)
            if n > _MAX_LIPSUM_WORDS or words > _MAX_LIPSUM_WORDS:
                raise self.refuse("asks lipsum() for too many words", f"ask for at most {_MAX_LIPSUM_WORDS}")
        return generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    def _strftime_now(self, format: str) -> str:
        if len(format) > _MAX_STRFTIME_FORMAT:
            raise self.refuse("passes strftime_now() a very long format", "use a short date format")
        return datetime.now().strftime(format)

    # -- filters --------------------------------------------------------------------------------

    def _tojson(
        self,
        x: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # transformers' filter (Jinja's escapes HTML characters), with indent and separators bounded:
        # they are repeated once per item and nesting level.
        if isinstance(indent, int):
            self.check_length(indent, "indents JSON")
        indent_width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
        separator = max((len(s) for s in separators if isinstance(s, str)), default=2) if separators else 2
        size = _text_size(x, self.limits.max_output_chars, indent=indent_width, separator=separator + 2)
        self.check_length(size, "writes JSON")
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def _text_filter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        value_at = 0 if getattr(original, "jinja_pass_arg", None) is None else 1

        @functools.wraps(original)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            if len(args) > value_at:
                self.check_text(args[value_at])
            return original(*args, **kwargs)

        return bounded

    def _checked_filter(
        self, original: Callable[..., Any], check: Callable[[dict[str, Any]], None]
    ) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # let the filter report its own argument error
            bound.apply_defaults()
            check(bound.arguments)
            return original(*args, **kwargs)

        return bounded

    def _check_center(self, arguments: dict[str, Any]) -> None:
        self.check_text(arguments["value"])
        if isinstance(arguments["width"], int):
            self.check_length(arguments["width"], "centers text")

    def _check_indent(self, arguments: dict[str, Any]) -> None:
        text, width = arguments["s"], arguments["width"]
        size = self.check_text(text)
        if isinstance(width, int):
            self.check_length(width, "indents text")
        else:
            width = self.check_text(width)
        lines = text.count("\n") + 1 if isinstance(text, str) else size
        self.check_length(size + lines * width, "indents text")

    def _check_replace_filter(self, arguments: dict[str, Any]) -> None:
        text, old, new = (self._text(arguments[name]) for name in ("s", "old", "new"))
        count = arguments["count"]
        self.check_length(_replaced_length(text, old, new, -1 if count is None else count), "replaces text")

    def _check_wordwrap(self, arguments: dict[str, Any]) -> None:
        size = self.check_text(arguments["s"])
        wrapstring = arguments["wrapstring"]
        separator = len(wrapstring) if isinstance(wrapstring, str) else 1
        # At most one line per character.
        self.check_length(size + (size + 1) * separator, "wraps text")

    def _check_format_filter(self, arguments: dict[str, Any]) -> None:
        text = self._text(arguments["value"])
        self._check_printf(text, arguments["kwargs"] or arguments["args"])

    def _check_pprint(self, arguments: dict[str, Any]) -> None:
        # pformat indents nested values by one space per level.
        size = _text_size(arguments["value"], self.limits.max_output_chars, indent=1)
        self.check_length(size, "pretty-prints a value whose text would be")

    def _check_urlize(self, arguments: dict[str, Any]) -> None:
        size = self.check_text(arguments["value"])
        extra = sum(len(arguments[name]) for name in ("target", "rel") if isinstance(arguments[name], str))
        # A link is at least 4 characters ("a.co"); each gets the target and rel attributes.
        self.check_length(size + (size // 4 + 1) * extra, "links URLs")

    def _check_batch(self, arguments: dict[str, Any]) -> None:
        if isinstance(arguments["linecount"], int):
            self._check_count(arguments["linecount"], "batch")

    def _check_slice(self, arguments: dict[str, Any]) -> None:
        if isinstance(arguments["slices"], int):
            self._check_count(arguments["slices"], "slice")

    def _check_count(self, count: int, name: str) -> None:
        if count > self.limits.max_range:
            raise self.refuse(
                f"asks |{name} for {count} items at once", f"use at most {self.limits.max_range}"
            )

    def _join_filter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def bounded(
            eval_ctx: nodes.EvalContext, value: Iterable[Any], d: str = "", attribute: Any = None
        ) -> str:
            if attribute is not None:
                value = map(jinja2.filters.make_attrgetter(self, attribute), value)
            items = [item if type(item) is str else self._text(item) for item in value]
            self.check_length(_joined_length(self._text(d), items), "joins text (|join)")
            return original(eval_ctx, items, d)

        return bounded

    def _sum_filter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def bounded(
            environment: jinja2.Environment, iterable: Iterable[Any], attribute: Any = None, start: Any = 0
        ) -> Any:
            if attribute is not None:
                iterable = map(jinja2.filters.make_attrgetter(self, attribute), iterable)
            items = list(iterable)
            if not isinstance(start, int | float):
                lengths = (len(item) for item in (start, *items) if isinstance(item, abc.Sized))
                self.check_length(sum(lengths), "sums lists (|sum)")
            return original(environment, items, start=start)

        return bounded


class _BoundedFormatterMixin:
    """Measures each ``{field}`` of ``str.format`` before formatting it: its width and its value's text."""

    _env: BoundedEnvironment
    _written = 0

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self._written = len(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        widths = _DIGITS.findall(format_spec)
        if any(len(width) > _MAX_WIDTH_DIGITS for width in widths):
            raise self._env.refuse("formats a field with a huge width", "use a smaller width")
        self._written += sum(map(int, widths)) + self._env.formatted_size(value)
        self._env.check_length(self._written, "formats text (str.format)")
        return super().format_field(value, format_spec)  # type: ignore[misc]


class _BoundedFormatter(_BoundedFormatterMixin, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_BoundedFormatterMixin, SandboxedEscapeFormatter):
    pass


def _sync(jinja_filter: Callable[..., Any]) -> Callable[..., Any]:
    """The plain function behind a filter that has an async variant (this environment is never
    async): its signature is the one the filter is called with."""
    if getattr(jinja_filter, "jinja_async_variant", False):
        return jinja_filter.__wrapped__  # type: ignore[attr-defined, no-any-return]
    return jinja_filter


def _replaced_length(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(old, str | bytes) and isinstance(new, str | bytes) and isinstance(count, int)):
        return len(text)
    found = text.count(old) if old else len(text) + 1
    if count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _joined_length(separator: Any, items: Sequence[Any]) -> int:
    lengths = sum(len(item) for item in items if isinstance(item, str | bytes))
    return lengths + len(separator) * max(len(items) - 1, 0)


def _longest_replacement(table: Any) -> int:
    values = (
        table.values() if isinstance(table, Mapping) else table if isinstance(table, list | tuple) else ()
    )
    return max((len(value) for value in values if isinstance(value, str)), default=1) or 1


def _text_size(value: Any, limit: int, *, indent: int = 0, separator: int = 2) -> int:
    """An estimate of ``len(str(value))`` (or of its JSON / pretty-printed text with ``indent``
    spaces per level), no smaller than the real length up to a constant factor; stops counting
    past ``limit`` and returns ``limit + 1``. Shared sublists are measured once each, so a list
    nested in itself thirty times costs thirty steps, not 2 ** 30."""
    sizes: dict[Any, int] = {}

    def size(value: Any, depth: int) -> int:
        if isinstance(value, str | bytes):
            return len(value) + 2
        if isinstance(value, bool) or value is None:
            return 5
        if isinstance(value, int):
            return value.bit_length() + 2
        if isinstance(value, float):
            return 24
        if isinstance(value, abc.MappingView) and hasattr(value, "mapping"):
            value = value.mapping
        elif isinstance(value, Namespace):
            value = object.__getattribute__(value, "_Namespace__attrs")
        if not isinstance(value, list | tuple | set | frozenset | Mapping):
            return 32  # objects whose text is a short repr: macros, loops, undefined values, ranges
        key = id(value) if not indent else (id(value), depth)
        if key in sizes:
            return sizes[key]
        sizes[key] = 0  # a namespace holding itself prints as "{...}"
        per_item = separator + (indent * (depth + 1) + 1 if indent else 0)
        total = 2
        if isinstance(value, Mapping):
            for item_key, item in value.items():
                total += size(item_key, depth + 1) + size(item, depth + 1) + per_item + separator
                if total > limit:
                    raise _Oversized
        else:
            for item in value:
                total += size(item, depth + 1) + per_item
                if total > limit:
                    raise _Oversized
        sizes[key] = total
        return total

    try:
        return size(value, 0)
    except _Oversized:
        return limit + 1
