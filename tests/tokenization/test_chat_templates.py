"""Chat templates: the rendered prompt is exactly what transformers renders for Qwen3."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.tokenization import qwen_tokenizer_dir
from tokenization.chat_templates import (
    ChatTemplateError,
    ChatTemplates,
    TemplateBudgetExceeded,
    TemplateLimits,
    render_chat,
    render_template,
    template_reads_content_parts,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION = [
    {"role": "system", "content": "You answer with tools when you can."},
    {"role": "user", "content": "Weather in Paris and in Tōkyō?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tōkyō"}'}},
        ],
    },
    {"role": "tool", "content": '{"temp": 18, "unit": "C"}'},
    {"role": "tool", "content": '{"temp": 24, "unit": "C"}'},
    {"role": "assistant", "content": "<think>\nBoth answered.\n</think>\n\nParis 18 °C, Tōkyō 24 °C."},
    {"role": "user", "content": "And in Fahrenheit?"},
]

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a KV cache?"},
    {
        "role": "assistant",
        "content": "<think>\nDefine it.\n</think>\n\nThe attention keys and values kept per token.",
    },
    {"role": "user", "content": "Why route by it?"},
    {"role": "assistant", "content": "A pod that holds a prompt's prefix skips recomputing it."},
]


@pytest.fixture(scope="module")
def transformers_qwen() -> Any:
    """The transformers tokenizer of the same files: the reference renderer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))


@pytest.fixture(scope="module")
def qwen_templates() -> ChatTemplates:
    return ChatTemplates.from_directory(qwen_tokenizer_dir())


def hundred_turns() -> list[dict[str, str]]:
    conversation = [{"role": "system", "content": "You are a patient tutor."}]
    for turn in range(50):
        conversation.append({"role": "user", "content": f"Question {turn}: what is {turn} squared?"})
        conversation.append(
            {
                "role": "assistant",
                "content": f"<think>\n{turn} times {turn}.\n</think>\n\nIt is {turn * turn}.",
            }
        )
    return conversation


CASES = {
    "one user message": ([{"role": "user", "content": "Hello!"}], {"add_generation_prompt": True}),
    "multi-turn, no generation prompt": (MULTI_TURN, {"add_generation_prompt": False}),
    "multi-turn, generation prompt": (MULTI_TURN[:-1], {"add_generation_prompt": True}),
    "tools and tool calls": (TOOL_CONVERSATION, {"tools": [WEATHER_TOOL], "add_generation_prompt": True}),
    "tools, no system message": (
        TOOL_CONVERSATION[1:2],
        {"tools": [WEATHER_TOOL], "add_generation_prompt": True},
    ),
    "thinking disabled": (MULTI_TURN[:2], {"add_generation_prompt": True, "enable_thinking": False}),
    "continue the final message": (
        [*MULTI_TURN[:2], {"role": "assistant", "content": "A KV cache is"}],
        {"continue_final_message": True},
    ),
    "reasoning_content field": (
        [
            *MULTI_TURN[:2],
            {"role": "assistant", "content": "Keys and values.", "reasoning_content": "Short."},
        ],
        {},
    ),
    "documents": (MULTI_TURN[:2], {"documents": [{"title": "Doc", "text": "KV caches."}]}),
    "a hundred turns": (hundred_turns(), {"add_generation_prompt": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_rendering_equals_transformers_apply_chat_template(
    case: str, qwen_templates: ChatTemplates, transformers_qwen: Any
) -> None:
    messages, options = CASES[case][0], dict(CASES[case][1])
    expected = transformers_qwen.apply_chat_template(messages, tokenize=False, **options)
    template_kwargs = {key: options.pop(key) for key in list(options) if key == "enable_thinking"}

    rendered = render_chat(
        messages, templates=qwen_templates, chat_template_kwargs=template_kwargs, **options
    )

    assert rendered.text == expected
    assert rendered.elapsed > 0


def test_content_given_as_text_parts_renders_as_the_joined_text(
    qwen_templates: ChatTemplates, transformers_qwen: Any
) -> None:
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    as_string = [{"role": "user", "content": "First part.\nSecond part."}]

    rendered = render_chat(
        [{"role": "user", "content": parts}], templates=qwen_templates, add_generation_prompt=True
    )

    assert rendered.text == transformers_qwen.apply_chat_template(
        as_string, tokenize=False, add_generation_prompt=True
    )


def test_null_content_renders_as_empty_content(qwen_templates: ChatTemplates, transformers_qwen: Any) -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    expected = transformers_qwen.apply_chat_template(
        [messages[0], {**messages[1], "content": ""}], tokenize=False
    )

    assert render_chat(messages, templates=qwen_templates).text == expected


def test_the_callers_kwargs_win_over_the_models_defaults(
    qwen_templates: ChatTemplates, transformers_qwen: Any
) -> None:
    template = "{{ eos_token }}|{{ pad_token }}|{{ enable_thinking | default('unset') }}"
    messages = [{"role": "user", "content": "hi"}]

    defaults = render_chat(messages, templates=qwen_templates, chat_template=template)
    overridden = render_chat(
        messages,
        templates=qwen_templates,
        chat_template=template,
        chat_template_kwargs={"eos_token": "<END>", "enable_thinking": False},
    )

    assert defaults.text == "<|im_end|>|<|endoftext|>|unset"
    assert overridden.text == "<END>|<|endoftext|>|False"
    assert overridden.text == transformers_qwen.apply_chat_template(
        messages, chat_template=template, tokenize=False, eos_token="<END>", enable_thinking=False
    )


def test_the_requests_template_replaces_the_models(qwen_templates: ChatTemplates) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"

    rendered = render_chat(MULTI_TURN[:2], templates=qwen_templates, chat_template=template)

    assert rendered.text == "[system] Be brief.\n[user] What is a KV cache?\n"


def test_templates_that_read_content_parts_get_the_parts(qwen_templates: ChatTemplates) -> None:
    template = (
        "{% for m in messages %}{% for part in m['content'] %}<{{ part.text }}>{% endfor %}{% endfor %}"
    )
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]

    rendered = render_chat(
        [{"role": "user", "content": parts}], templates=qwen_templates, chat_template=template
    )

    assert template_reads_content_parts(template)
    assert not template_reads_content_parts(qwen_templates.templates["default"])
    assert rendered.text == "<a><b>"


def test_fields_set_to_null_are_dropped_as_transformers_does(
    qwen_templates: ChatTemplates, transformers_qwen: Any
) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "user", "content": "yo", "name": "bo"},
    ]

    rendered = render_chat(messages, templates=qwen_templates, chat_template=template)

    assert rendered.text == "user;user(bo);"
    assert rendered.text == transformers_qwen.apply_chat_template(
        messages, chat_template=template, tokenize=False
    )


# --- templates a model ships ----------------------------------------------------------------


def test_the_qwen3_template_and_special_tokens_are_read_from_tokenizer_config(
    qwen_templates: ChatTemplates,
) -> None:
    config = json.loads((qwen_tokenizer_dir() / "tokenizer_config.json").read_text())

    assert qwen_templates.templates == {"default": config["chat_template"]}
    assert qwen_templates.default_kwargs == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_named_templates_are_chosen_as_transformers_chooses_them(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools"},
        ],
        "eos_token": {"content": "</s>", "special": True},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    templates = ChatTemplates.from_directory(tmp_path)
    messages = [{"role": "user", "content": "hi"}]

    assert render_chat(messages, templates=templates).text == "plain"
    assert render_chat(messages, templates=templates, tools=[WEATHER_TOOL]).text == "tools"
    assert render_chat(messages, templates=templates, chat_template="tool_use").text == "tools"
    assert templates.default_kwargs == {"eos_token": "</s>"}


def test_chat_template_files_override_the_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    (tmp_path / "chat_template.jinja").write_text("from chat_template.jinja")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text("from rag.jinja")

    templates = ChatTemplates.from_directory(tmp_path)

    assert templates.templates == {"default": "from chat_template.jinja", "rag": "from rag.jinja"}


# --- errors the caller must fix -------------------------------------------------------------


def test_a_model_without_a_template_asks_for_one() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template: pass one in chat_template"):
        render_chat([{"role": "user", "content": "hi"}], templates=ChatTemplates())


@pytest.mark.parametrize(
    ("messages", "options", "message"),
    [
        ([], {}, "messages must be a non-empty list"),
        ([{"content": "no role"}], {}, r"messages\[0\] must be an object with a string role"),
        ([{"role": "user", "content": 42}], {}, r"messages\[0\].content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            "only text parts",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {"add_generation_prompt": True, "continue_final_message": True},
            "cannot both be true",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {"chat_template_kwargs": {"add_generation_prompt": True}},
            "chat_template_kwargs cannot set add_generation_prompt",
        ),
        ([{"role": "user", "content": "hi"}], {"tools": {"name": "not a list"}}, "tools must be a list"),
        ([{"role": "user", "content": "hi"}], {"chat_template": "{% if %}"}, "not valid Jinja"),
        (
            [{"role": "user", "content": "hi"}],
            {"chat_template": "{{ raise_exception('roles must alternate') }}"},
            "roles must alternate",
        ),
        (
            [{"role": "assistant", "content": "x"}],
            {"chat_template": "{{ messages[0].content + messages }}"},
            "could not render this conversation",
        ),
    ],
)
def test_bad_requests_are_chat_template_errors_saying_what_to_fix(
    messages: list[dict[str, Any]], options: dict[str, Any], message: str, qwen_templates: ChatTemplates
) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(messages, templates=qwen_templates, **options)


def test_templates_cannot_escape_the_sandbox(qwen_templates: ChatTemplates) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"

    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "user", "content": "hi"}], templates=qwen_templates, chat_template=escape)


# --- the bounded environment renders as transformers' does ----------------------------------

FEATURE_TEMPLATES = {
    "tojson with its arguments": (
        "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ tools | tojson(separators=(',', ':')) }}"
        "|{{ {'b': 'é', 'a': 1} | tojson(sort_keys=True) }}|{{ 'é<>' | tojson(ensure_ascii=True) }}"
    ),
    "namespace, dict and loop controls": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ dict(a=1, b=[2]) }}{{ dict.fromkeys('ab', 0) }}"
    ),
    "whitespace control (trim_blocks, lstrip_blocks)": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n<{{ m.content }}>\n    {% endif %}\n"
        "{% endfor %}\n"
    ),
    "the generation tag": (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    ),
    "reasoning fields": "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}",
    "text filters and formatting": (
        "{{ messages[0].content | center(40) }}|{{ 'a\nb' | indent(3, first=True) }}"
        "|{{ messages[1].content | wordwrap(10) }}|{{ messages[1].content | replace('KV', 'kv') }}"
        "|{{ messages[1].content | truncate(12) }}|{{ '%s-%05.1f' % ('x', 2.5) }}|{{ '{:>6}'.format('y') }}"
        "|{{ '%(a)s' | format(a=1) }}|{{ range(5) | join(',') }}|{{ [1, 2, 3] | batch(2, 0) | list }}"
        "|{{ [1, 2, 3] | slice(2) | list }}|{{ [[1], [2]] | sum(start=[]) }}|{{ tools | pprint }}"
        "|{{ messages[0].content ~ 7 ~ none }}|{{ 2 ** 10 * 3 }}|{{ 'ab' * 3 }}|{{ 'x'.rjust(4, '-') }}"
    ),
}


@pytest.mark.parametrize("case", FEATURE_TEMPLATES)
def test_template_features_render_as_transformers_renders_them(case: str, transformers_qwen: Any) -> None:
    template = FEATURE_TEMPLATES[case]
    messages = [
        *MULTI_TURN[:2],
        {"role": "assistant", "content": "Keys and values.", "reasoning_content": "Short."},
        {"role": "assistant", "content": "Cached.", "thinking": "Older name."},
    ]
    templates = ChatTemplates(templates={"default": template})

    rendered = render_chat(messages, templates=templates, tools=[WEATHER_TOOL])

    assert rendered.text == transformers_qwen.apply_chat_template(
        messages, chat_template=template, tools=[WEATHER_TOOL], tokenize=False
    )


def test_a_verbatim_copy_of_the_models_template_is_trusted(qwen_templates: ChatTemplates) -> None:
    own = qwen_templates.templates["default"]

    assert qwen_templates.owns(own)
    assert not qwen_templates.owns(own + "{# a request's edit #}")


# --- hostile templates, rendered in this process ------------------------------------------------

HOSTILE_TEMPLATES = {
    "a huge power": ("{{ (9**(9**8)) % 2 }}", TemplateBudgetExceeded, "number of more than 16384 bits"),
    "a huge string": ("{{ 'a'*10**9 }}", TemplateBudgetExceeded, "output budget"),
    "division by zero": ("{{ 1/0 }}", ChatTemplateError, "ZeroDivisionError: division by zero"),
    "a recursive macro": (
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        TemplateBudgetExceeded,
        "recurses too deeply",
    ),
    "a huge range": ("{{ range(10**6)|length }}", TemplateBudgetExceeded, "at most 10000 items"),
    "a wide %-format": ("{{ '%*s' % (10**9, 'a') }}", TemplateBudgetExceeded, r"formats text \(%\)"),
    "a repeated %-format key": (
        "{{ ('%(a)s' * 20) % {'a': 'x' * 1000000} }}",
        TemplateBudgetExceeded,
        r"formats text \(%\)",
    ),
    "a wide str.format field": ("{{ '{:>1000000000}'.format('a') }}", TemplateBudgetExceeded, "huge width"),
    "a huge join": (
        "{{ range(10000)|join('x' * 100000) }}",
        TemplateBudgetExceeded,
        r"joins text \(\|join\)",
    ),
    "a wide string method": ("{{ 'x'.center(10**9) }}", TemplateBudgetExceeded, r"center\(\)"),
    "a wide indent": ("{{ 'x'|indent(10**9) }}", TemplateBudgetExceeded, "indents text"),
    "a long wrapstring": (
        "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100) }}",
        TemplateBudgetExceeded,
        "wraps text",
    ),
    "a growing replace": ("{{ ('a' * 1000000)|replace('a', 'b' * 20) }}", TemplateBudgetExceeded, "replaces"),
    "a huge JSON indent": ("{{ tools|tojson(indent=10**9) }}", TemplateBudgetExceeded, "indents JSON"),
    "int.to_bytes": ("{{ (5).to_bytes(10**9, 'big') }}", TemplateBudgetExceeded, "to_bytes"),
    "a list nested in itself": (
        "{% set a = ['x' * 100000] %}" + "{% set a = [a, a] %}" * 30 + "{{ a }}",
        TemplateBudgetExceeded,
        "prints a value",
    ),
    "doubling a string": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        TemplateBudgetExceeded,
        r"joins text \(~\)",
    ),
    "a long block": (
        "{% set x %}{% for i in range(10000) %}{{ 'x' * 10000 }}{% endfor %}{% endset %}",
        TemplateBudgetExceeded,
        "builds a block of text",
    ),
    "a long output": (
        "{% for i in range(10000) %}{{ 'x' * 10000 }}{% endfor %}",
        TemplateBudgetExceeded,
        "output passed the 8388608-character budget",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_TEMPLATES)
def test_hostile_templates_are_refused_quickly_in_process(case: str, qwen_templates: ChatTemplates) -> None:
    template, error, message = HOSTILE_TEMPLATES[case]
    started = time.perf_counter()

    with pytest.raises(error, match=message):
        render_chat(
            [{"role": "user", "content": "hi"}],
            templates=qwen_templates,
            chat_template=template,
            tools=[WEATHER_TOOL],
        )

    assert time.perf_counter() - started < 2


def test_the_output_budget_is_a_limit_of_render_template() -> None:
    limits = TemplateLimits(max_output_chars=10)
    conversation = [{"role": "user", "content": "hi"}]

    assert render_template("{{ 'x' * 10 }}", conversation, limits=limits) == "x" * 10
    with pytest.raises(TemplateBudgetExceeded, match="10-character"):
        render_template("{% for i in range(11) %}x{% endfor %}", conversation, limits=limits)


def test_reading_content_parts_is_detected_in_linear_time() -> None:
    # A regular expression over the text took 9 s on this 80 kB template; parsing it takes ~0.25 s.
    crafted = "{% for " + "a in " * 16000
    started = time.perf_counter()

    assert not template_reads_content_parts(crafted)
    assert time.perf_counter() - started < 2
