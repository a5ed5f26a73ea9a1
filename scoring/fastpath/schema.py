"""The scoring endpoints' request bodies: decoded and validated in one pass, with the errors the
API answers and the JSON Schema its documentation shows.

The types are ``msgspec`` structs: decoding 2,048 token ids into a validated request costs about
as much as parsing the JSON alone. Everything a request names is bounded before any cache,
tokenizer or index sees it: names (model, LoRA adapter, pods) are at most 256 characters, JSON
nesting at most ``MAX_JSON_DEPTH`` levels, a batch at most ``MAX_BATCH`` requests, multimodal
features at most ``MAX_MM_FEATURES`` a request. A body that does not fit raises
:class:`RequestError` with ``fields`` naming each wrong field and what to send.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import chain
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from kvindex import keys

MAX_NAME_CHARS = 256
MAX_JSON_DEPTH = 64
MAX_BATCH = 64
MAX_PODS = 4096
MAX_MM_FEATURES = 64
U64_MAX = (1 << 64) - 1

ModelName = Annotated[
    str,
    Meta(
        min_length=1, max_length=MAX_NAME_CHARS, description='The served model name, e.g. "Qwen/Qwen3-0.6B".'
    ),
]
PodName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
LoraName = Annotated[
    str,
    Meta(
        max_length=MAX_NAME_CHARS,
        description="The LoRA adapter the request will be served with (it changes every block key).",
    ),
]
CacheSalt = Annotated[
    str,
    Meta(
        max_length=MAX_NAME_CHARS,
        description="The request's cache_salt, as sent to vLLM: it changes the key of the first block, "
        "hence of every block. A pod's salted blocks score only for requests with the same salt; empty: "
        "no salt (as vLLM).",
    ),
]
Prompt = Annotated[str, Meta(min_length=1, description="The completion prompt, exactly as sent to vLLM.")]
TokenIds = Annotated[
    list[Annotated[int, Meta(ge=0)]],
    Meta(
        min_length=1, description="The prompt already tokenized: no tokenizer needed, any model name works."
    ),
]
Messages = Annotated[
    list[dict[str, Any]],
    Meta(
        min_length=1,
        description='[{"role": "user", "content": "..."}, ...]; content is a string, a list of text parts '
        '[{"type": "text", "text": ...}] or null; other keys (tool_calls, name...) reach the template.',
    ),
]
ChatTemplate = Annotated[
    str,
    Meta(
        description="A Jinja chat template, or the name of one of the model's templates. Default (also for "
        "null or \"\"): the model config's template, else the tokenizer's own. A template sent here renders "
        "in a sandbox with a CPU-time budget (422 when over it), or is refused when the server sets "
        "KVCACHE_REQUEST_TEMPLATES=false."
    ),
]
TemplateKwargs = Annotated[
    dict[str, Any],
    Meta(description="Extra template variables (e.g. enable_thinking); they win over the model's defaults."),
]
ObjectList = list[dict[str, Any]]


class MultimodalFeature(Struct, kw_only=True):
    """One multimodal input of the prompt, as vLLM hashes it (``kvindex.keys.MultimodalFeature``)."""

    identifier: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=MAX_NAME_CHARS,
            description="vLLM's hash of the media (its request's mm_features[i].identifier).",
        ),
    ]
    offset: Annotated[
        int,
        Meta(
            ge=0, description="The first placeholder token of the media, a position in the prompt's tokens."
        ),
    ]
    length: Annotated[int, Meta(ge=1, description="How many placeholder tokens the media takes.")]


MultimodalFeatures = Annotated[
    list[MultimodalFeature],
    Meta(
        max_length=MAX_MM_FEATURES,
        description="The prompt's images (audio, video) in token positions of the tokens scored (the "
        "rendered conversation's, for messages): each adds (identifier, offset) to the keys of the "
        "blocks its placeholder tokens overlap, as vLLM keys them. A feature that ends past the prompt's "
        "last token is a 400.",
    ),
]


class RequestError(Exception):
    """A request the API refuses: ``status``, a stable ``code``, a message saying what to fix, and
    for an invalid body ``fields`` (field -> problems)."""

    def __init__(
        self, status: int, code: str, message: str, *, fields: Mapping[str, list[str]] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.fields = dict(fields) if fields else None


def invalid(fields: Mapping[str, list[str]]) -> RequestError:
    """A 400 ``invalid_request`` naming every wrong field (``non_field_errors`` for the body)."""
    parts = [
        problem if name == "non_field_errors" else f"{name}: {problem}"
        for name, problems in fields.items()
        for problem in problems
    ]
    return RequestError(400, "invalid_request", "; ".join(parts) or "invalid request", fields=fields)


# --- the bodies ----------------------------------------------------------------------------------


class KeyingOptions(Struct, kw_only=True):
    """What a request adds to its block keys besides its tokens, as vLLM hashes it: every scoring
    body takes these."""

    cache_salt: CacheSalt | None = None
    mm_features: MultimodalFeatures | None = None

    def multimodal_features(self) -> tuple[keys.MultimodalFeature, ...]:
        """``mm_features`` as the core's values (validated already: never a ``ValueError``)."""
        return tuple(keys.MultimodalFeature(f.identifier, f.offset, f.length) for f in self.mm_features or ())


class ChatOptions(KeyingOptions, kw_only=True):
    """The rendering options of a conversation (upstream's ``score_chat_completions`` fields), beside
    the keying options."""

    tools: ObjectList | None = None
    documents: ObjectList | None = None
    chat_template: ChatTemplate | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    continue_final_message: bool = False
    return_assistant_tokens_mask: bool = False  # accepted for compatibility; no tokens are returned


class ScoreCompletionsRequest(KeyingOptions, kw_only=True):
    """Upstream's ``POST /score_completions`` body (``cache_salt`` and ``mm_features`` are ours)."""

    model: ModelName
    prompt: Prompt


class ScoreChatCompletionsRequest(ChatOptions, kw_only=True):
    """Upstream's ``POST /score_chat_completions`` body (``cache_salt`` and ``mm_features`` are ours);
    ``add_generation_prompt`` defaults to false (as upstream)."""

    model: ModelName
    messages: Messages
    add_generation_prompt: bool = False


class ScoreRequest(ChatOptions, kw_only=True):
    """``POST /api/v1/score``: exactly one of ``prompt``, ``messages`` or ``token_ids``; with messages,
    ``add_generation_prompt`` defaults to true (vLLM's chat completions), false with
    ``continue_final_message``."""

    model: ModelName
    prompt: Prompt | UnsetType = UNSET
    messages: Messages | UnsetType = UNSET
    token_ids: TokenIds | UnsetType = UNSET
    pods: Annotated[list[PodName], Meta(min_length=1, max_length=MAX_PODS)] | None = None
    lora_name: LoraName | None = None
    add_generation_prompt: bool | None = None

    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class ScoreBatchRequest(Struct, kw_only=True):
    """``POST /api/v1/score/batch``: up to 64 ``/api/v1/score`` bodies, answered in order."""

    requests: Annotated[list[msgspec.Raw], Meta(min_length=1, max_length=MAX_BATCH)]


INPUTS = ("prompt", "messages", "token_ids")
CHAT_ONLY = ("tools", "documents", "chat_template", "chat_template_kwargs")


# --- decoding -------------------------------------------------------------------------------------

_DECODERS: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, kind: type[Struct], *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``body`` as a validated ``kind``; raises :class:`RequestError` (400) naming what is wrong."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    check_depth(body, max_depth)
    try:
        request = decoder.decode(body)
    except msgspec.ValidationError as error:
        raise _explain(_generic(body), kind, str(error)) from None
    except UnicodeDecodeError as error:  # msgspec checks each string it decodes (not skipped ones)
        raise _not_utf8(error) from None
    except (msgspec.DecodeError, RecursionError):
        # msgspec refuses some JSON the standard allows and a field should judge (a lone
        # surrogate escape), and says little about malformed input ("truncated"): the standard
        # parser either reads the body or says what is wrong with it and where.
        request = _convert(_standard_parse(body), kind)
    _check(request)
    return request


def _convert(data: Any, kind: type[Struct]) -> Any:
    # Text that is not Unicode is refused before it is converted: msgspec cannot even say that
    # such a string is not the number a field wants (it raises UnicodeEncodeError).
    unicode_problems = _lone_surrogates(data)
    if unicode_problems:
        raise invalid(unicode_problems)
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as error:
        raise _explain(data, kind, str(error)) from None


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``limit`` (400 ``invalid_json``), never by a RecursionError."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # the usual body: it cannot nest deeper than it has brackets
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise RequestError(400, "invalid_json", f"the body is nested deeper than {limit} levels") from None
    except (msgspec.DecodeError, UnicodeDecodeError):
        return  # not JSON: decoding says so
    if json_depth_exceeds(body, value, limit):
        raise RequestError(400, "invalid_json", f"the body is nested deeper than {limit} levels")


def json_depth_exceeds(raw: bytes, value: Any, limit: int) -> bool:
    """Whether ``value``, parsed from ``raw``, nests arrays and objects more than ``limit`` deep
    (``[]`` is 1 deep, ``[{}]`` 2). Cheap for the usual body: one that holds at most ``limit``
    ``[`` and ``{`` bytes cannot nest deeper; only another one is walked, a level at a time (no
    recursion, and never below level ``limit + 1``)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    level = [value] if isinstance(value, (list, dict)) else []  # the containers at one depth
    for _ in range(limit):
        children = chain.from_iterable([c.values() if isinstance(c, dict) else c for c in level])
        level = [child for child in children if isinstance(child, (list, dict))]
    return bool(level)


def _not_utf8(error: UnicodeDecodeError) -> RequestError:
    return RequestError(
        400, "invalid_json", f"the body is not UTF-8 text ({error.reason}): send JSON in UTF-8"
    )


def _standard_parse(body: bytes) -> Any:
    try:
        # Decoded here, strictly: json.loads would take UTF-16 and UTF-32 bodies, and encoded
        # surrogates; and no NaN or Infinity, which JSON does not have.
        return json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as error:
        raise _not_utf8(error) from None
    except RecursionError:
        raise RequestError(
            400, "invalid_json", f"the body is nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    except ValueError as error:
        raise RequestError(400, "invalid_json", f"the body is not valid JSON: {error}") from None


def _generic(body: bytes) -> Any:
    """The body as plain values, to explain a validation error (``None`` when it is no JSON)."""
    try:
        return msgspec.json.decode(body)
    except UnicodeDecodeError as error:  # in a field the typed decoder skipped
        raise _not_utf8(error) from None
    except (msgspec.DecodeError, RecursionError):
        pass
    try:  # what msgspec refuses and the standard parser reads (a lone surrogate escape)
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    unicode_problems = _lone_surrogates(data)
    if unicode_problems:
        raise invalid(unicode_problems)
    return data


_TYPE_NAMES = {
    "int": "an integer",
    "str": "a string",
    "array": "a list",
    "object": "an object",
    "bool": "true or false",
    "null": "null",
    "float": "a number",
}


def _explain(data: Any, kind: type[Struct], message: str) -> RequestError:
    """``fields`` for msgspec's first error, plus every missing required field of ``data``."""
    if not isinstance(data, dict):
        return invalid({"non_field_errors": ["the body must be a JSON object"]})
    fields: dict[str, list[str]] = {}
    required = [field.name for field in msgspec.structs.fields(kind) if field.required]
    for name in required:
        if name not in data:
            fields[name] = ["this field is required"]
    problem, _, where = message.partition(" - at `$")
    if where:
        path = where.rstrip("`")
        field = path.lstrip(".").split("[", 1)[0].split(".", 1)[0]
        location = path.lstrip(".")
        where = "" if location == field else f"at {location}: "
        fields.setdefault(field, []).append(where + _plain(problem))
    elif not problem.startswith("Object missing required field"):
        fields.setdefault("non_field_errors", []).append(_plain(problem))
    return invalid(fields)


def _plain(problem: str) -> str:
    """msgspec's wording for a person: "Expected `int`, got `str`" -> "expected an integer, got a string"."""
    text = problem.replace("`", "")
    for name, words in _TYPE_NAMES.items():
        text = text.replace(f"Expected {name}", f"expected {words}").replace(f"got {name}", f"got {words}")
    return text[:1].lower() + text[1:]


def _check(request: Struct) -> None:
    """What the types cannot say: token ids within uint64, message shapes, and ``/api/v1/score``'s
    exactly-one-input rule. (Valid Unicode is :func:`_lone_surrogates`'s, before conversion;
    whether ``mm_features`` lie within the prompt's tokens is known once it is tokenized: the read
    path says, ``read_path.key_token_ids``.)"""
    fields: dict[str, list[str]] = {}
    token_ids = getattr(request, "token_ids", UNSET)
    if token_ids is not UNSET and (index := keys.first_invalid_token(token_ids)) is not None:
        fields["token_ids"] = [f"token_ids[{index}] = {token_ids[index]} is outside 0..2**64-1"]
    messages = getattr(request, "messages", UNSET)
    if messages is not UNSET:
        for index, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                fields.setdefault("messages", []).append(
                    f'messages[{index}] must be an object with a string "role"'
                )
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                fields.setdefault("messages", []).append(
                    f"messages[{index}].content must be a string, a list of text parts or null"
                )
    if isinstance(request, ScoreRequest):
        given = [name for name in INPUTS if getattr(request, name) is not UNSET]
        if len(given) != 1:
            problem = "none was given" if not given else f"got {', '.join(given)}"
            fields.setdefault("non_field_errors", []).append(
                f"send exactly one of prompt, messages or token_ids ({problem})"
            )
        elif given[0] != "messages":
            chat_only = [name for name in CHAT_ONLY if getattr(request, name)]
            if request.add_generation_prompt is not None:
                chat_only.append("add_generation_prompt")
            if request.continue_final_message:
                chat_only.append("continue_final_message")
            for name in chat_only:
                fields.setdefault(name, []).append(f"only applies to messages, not to {given[0]}")
    if fields:
        raise invalid(fields)


def _lone_surrogates(data: Any) -> dict[str, list[str]]:
    """Per field of ``data`` (a body as the standard parser reads it), the first place where its
    text is not valid Unicode: a lone surrogate, which a JSON ``\\u`` escape can write but no UTF-8
    text holds (nor can it be answered back). Every string is looked at, keys too: the msgspec
    decoder refuses such a body, so this costs only bodies that take the standard parser."""
    if not isinstance(data, dict):
        return {}
    fields: dict[str, list[str]] = {}
    for name, value in data.items():
        if _unicode_problem(name):
            fields.setdefault("non_field_errors", []).append(f"a field name {_unicode_problem(name)}")
            continue
        todo: list[tuple[str, Any]] = [(name, value)]
        while todo:
            path, item = todo.pop()
            where = "" if path == name else f"at {path}: "
            if isinstance(item, str) and _unicode_problem(item):
                fields[name] = [f"{where}{_unicode_problem(item)}"]
                break
            if isinstance(item, dict):
                bad_key = next((key for key in item if _unicode_problem(key)), None)
                if bad_key is not None:
                    fields[name] = [f"{where}a key {_unicode_problem(bad_key)}"]
                    break
                todo += [(f"{path}.{key}", child) for key, child in reversed(item.items())]
            elif isinstance(item, list):
                todo += [(f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item)))]
    return fields


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _unicode_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not valid Unicode text (a lone surrogate at character {error.start})"
    return None


# --- documentation ------------------------------------------------------------------------------


def openapi_components() -> dict[str, Any]:
    """JSON Schema of every request body, as OpenAPI ``components/schemas`` (``$ref`` names are
    the struct names)."""
    _, components = msgspec.json.schema_components(
        [ScoreCompletionsRequest, ScoreChatCompletionsRequest, ScoreRequest, ScoreBatchRequest],
        ref_template="#/components/schemas/{name}",
    )
    # msgspec.Raw has no schema of its own: each item is a ScoreRequest.
    items = components["ScoreBatchRequest"]["properties"]["requests"]
    items["items"] = {"$ref": "#/components/schemas/ScoreRequest"}
    return components
