"""JSON into the Django API (the registry): size- and depth-limited.

``BoundedJSONParser`` is the parser of the whole DRF API (``REST_FRAMEWORK
["DEFAULT_PARSER_CLASSES"]``): the body is read once with a hard size limit, parsed by ``orjson``,
and refused when nested deeper than ``KVCACHE_MAX_JSON_DEPTH`` (the fast path's check,
``scoring.fastpath.schema.json_depth_exceeds``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from django.conf import settings
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import BaseParser

from scoring.fastpath.schema import json_depth_exceeds


class BoundedJSONParser(BaseParser):
    """Parses the request body as JSON, refusing one larger than ``KVCACHE_MAX_BODY_BYTES``
    (413) before reading more than one byte past the limit, and one nesting arrays and objects
    deeper than ``KVCACHE_MAX_JSON_DEPTH`` (400 ``invalid_json``; never a ``RecursionError``,
    however deep)."""

    media_type = "application/json"

    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        limit = settings.KVCACHE_MAX_BODY_BYTES
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise _too_large(limit)
        depth_limit = settings.KVCACHE_MAX_JSON_DEPTH
        value = _loads(raw, depth_limit)
        if json_depth_exceeds(raw, value, depth_limit):
            raise _too_deep(depth_limit)
        return value


def _loads(raw: bytes, depth_limit: int) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    # orjson refuses some JSON that the standard allows and that a field should judge (an
    # integer beyond 64 bits, a lone surrogate escape): the standard parser says either what is
    # wrong with the text or what the field has to refuse. orjson also refuses more than 1024
    # levels of nesting, on which the standard parser recurses until Python stops it.
    try:
        return json.loads(raw)
    except RecursionError:
        raise _too_deep(depth_limit) from None
    except UnicodeDecodeError as error:
        raise ParseError(f"the body is not UTF-8 text: {error.reason}") from None
    except ValueError as error:
        raise ParseError(f"the body is not valid JSON: {error}") from None


# ParseError is answered 400 invalid_json (registry.api.errors).
def _too_deep(limit: int) -> ParseError:
    return ParseError(
        f"the body's JSON is nested deeper than {limit} levels (KVCACHE_MAX_JSON_DEPTH): flatten it"
    )


def _too_large(limit: int) -> APIException:
    # Imported here, not at the top: DRF imports this module (DEFAULT_PARSER_CLASSES) while it loads
    # rest_framework.views, which registry.api.errors imports.
    from registry.api.errors import BodyTooLarge

    return BodyTooLarge(limit)
